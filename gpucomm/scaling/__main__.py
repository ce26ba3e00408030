"""Entry point of ``python -m gpucomm.scaling``."""

from .cli import main

raise SystemExit(main())
