"""Load check for a running service: latency, first audio, streams behind playback,
throughput, errors, and how many streams the box serves (--capacity). See README."""

import sys

from benchmarks.loadtest import main

if __name__ == "__main__":
    sys.exit(main())
