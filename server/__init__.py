"""An OpenAI-compatible HTTP server over the engine: FastAPI app, engine thread, metrics, CLI.

`create_app(engine)` (app.py) builds the app around an LLMEngine; `python -m server` (cli.py) serves it.
"""

from server.app import create_app

__all__ = ["create_app"]
