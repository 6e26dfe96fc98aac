"""Start the ChatTTS speech service (gunicorn, one worker). Settings: see README."""

import sys

from chattts_service.transport.serve import main

if __name__ == "__main__":
    sys.exit(main())
