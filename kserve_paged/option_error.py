"""The error of a bad request option, in a module of its own so that the modules that check
options (request_options.py, request_caps.py) can both raise it without importing each other."""

from __future__ import annotations


class OptionError(ValueError):
    """A bad request option; ``param`` names it for OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
