"""Turns sampled tokens into streamed text deltas and decides when a request finishes."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.outputs import RequestOutput
from services.engine.sequence import Sequence


class RequestStream:
    """Text state of one request: full output text, how much was sent, stop-string hold-back."""

    def __init__(self, seq: Sequence, tokenizer: PreTrainedTokenizerBase) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids[: seq.num_prompt_tokens])
        self.text = ""
        self.sent_chars = 0
        self.holdback = max((len(s) for s in seq.params.stop), default=1) - 1


def finish_reason_for(seq: Sequence, token_id: int, eos_ids: tuple[int, ...], max_model_len: int) -> str | None:
    p = seq.params
    if seq.num_completion_tokens >= p.min_tokens:
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in eos_ids):
            return "stop"
    if seq.num_completion_tokens >= p.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None


def text_delta(stream: RequestStream, stop: list[str], token_id: int, reason: str | None) -> tuple[str, str | None]:
    """Appends `token_id` to the request's text; returns the text to stream now and the finish reason, which
    becomes "stop" when a stop string appears (the text is cut before it)."""
    stream.text += stream.detokenizer.step(token_id)
    if stop:
        search_from = max(0, stream.sent_chars - stream.holdback)
        hits = [i for i in (stream.text.find(s, search_from) for s in stop) if i >= 0]
        if hits:
            stream.text = stream.text[: min(hits)]
            reason = "stop"
    end = len(stream.text) if reason else max(stream.sent_chars, len(stream.text) - stream.holdback)
    delta = stream.text[stream.sent_chars : end]
    stream.sent_chars = end
    return delta, reason


def process_token(
    seq: Sequence, stream: RequestStream | None, token_id: int, eos_ids: tuple[int, ...], max_model_len: int
) -> tuple[RequestOutput, str | None]:
    """The delta to stream for `token_id` and the finish reason, if any; no text without a `stream` (the
    engine core process leaves text and stop strings to its frontend)."""
    reason = finish_reason_for(seq, token_id, eos_ids, max_model_len)
    delta_text = ""
    if stream is not None:
        delta_text, reason = text_delta(stream, seq.params.stop, token_id, reason)
    output = RequestOutput(
        request_id=seq.request_id,
        delta_text=delta_text,
        delta_token_ids=[token_id],
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_completion_tokens,
        finished=reason is not None,
        finish_reason=reason,
        seq_serial=seq.serial,
    )
    return output, reason
