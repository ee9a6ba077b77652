"""An OpenAI-compatible HTTP server over the engine: FastAPI app, engine core client, metrics, CLI.

`create_app(core)` (app.py) builds the app around an engine core; `python -m server` (cli.py) serves it.
`create_app` is imported when first asked for: the engine core and the API processes are spawned, and
each spawned process imports this package first (to re-run `server.__main__`), where the core needs
none of the HTTP side (FastAPI, the app, their imports: about 0.5 s of CPU a process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from server.app import create_app

        return create_app
    raise AttributeError(f"module 'server' has no attribute {name!r}")
