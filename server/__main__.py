"""Entry point: `python -m server --model DIR [...]`; see server/cli.py for the flags.

The import sits under the main guard: the engine core and the API processes are spawned, and a
spawned process imports this module again (as `__mp_main__`); it needs none of the HTTP side's
modules that server.cli brings (FastAPI, uvicorn, the app: about 0.5 s of CPU a process)."""

import sys

if __name__ == "__main__":
    from server.cli import main

    sys.exit(main())
