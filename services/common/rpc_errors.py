"""One line describing a failed RPC, for logs, health reasons and probes."""

from __future__ import annotations


def describe_error(exc: BaseException) -> str:
    # AioRpcError's str() is a multi-line debug dump; its details() is the one line worth logging.
    details = exc.details() if hasattr(exc, "details") else None
    return f"{type(exc).__name__}: {details or exc}"
