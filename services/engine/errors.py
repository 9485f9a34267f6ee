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


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its step raised); the engine itself goes on serving.

    Not retried on another engine: what failed here was this request's own content.
    """
