"""What the engine streams back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    delta_text: str
    delta_token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (then `error` says why)
    seq_serial: int = 0  # which admission of this request id produced the output (ids may be reused)
    error: str | None = None
