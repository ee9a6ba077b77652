"""Exceptions the engine raises to its callers.

InvalidRequestError carries the name of the offending field, so that the HTTP server can answer with
an OpenAI-style 400 body (`param`) without re-validating anything itself.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses before scheduling it: says what was wrong and which field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
