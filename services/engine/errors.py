"""Errors the engine raises to its frontends (gRPC maps them to status codes)."""


class InvalidRequestError(ValueError):
    """The request itself is wrong: bad sampling parameters, empty prompt, unknown field values."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the offending request field, when one is to blame


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context window."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no further requests can be served."""
