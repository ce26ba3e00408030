"""``python -m gpucomm.runner`` is ``gpucomm-run``."""

from .cli import console_main

console_main()
