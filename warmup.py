"""Warm a running service (--url) or the engine in-process (--model-dir). See README."""

import sys

from chattts_service.tools.warmup import main

if __name__ == "__main__":
    sys.exit(main())
