"""Entry point: `python -m server --model DIR [...]`; see server/cli.py for the flags."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
