"""``python -m gpucomm.timeline FILE -o out.png``."""

import sys

from .cli import main

sys.exit(main())
