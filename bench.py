"""Load check for a running service: latency percentiles, throughput, errors. See README."""

import sys

from chattts_service.tools.loadtest import main

if __name__ == "__main__":
    sys.exit(main())
