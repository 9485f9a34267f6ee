"""Request schemas of the OpenAI API subset we serve (vLLM's names), and the unsupported-field check.

Responses are plain dicts built in the serving modules: validating our own output with pydantic on every
streamed chunk would cost CPU for nothing.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from services.engine.sampling_params import (
    DEFAULT_MAX_TOKENS,
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
)

# Fields of the OpenAI API (or of vLLM) that we do not implement. A request naming any of them with a
# value other than its neutral default gets a 400 that lists them: never silently ignored.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),
    "echo": (False,),
    "best_of": (1,),
    "parallel_tool_calls": (True, False),  # only meaningful with tools, which are refused anyway
    "tools": ([],),
    "functions": ([],),
}
MAX_STOP_SEQUENCES = 16
MAX_STOP_TOKEN_IDS = 256
# Token ids travel as int32 (engine.proto); the vocabulary bound is checked once the model is known.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# strict: as OpenAI, "2" is not an integer and "yes" not a boolean (ints are still accepted as floats).
_STRICT = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by chat and completions. Extra fields are kept so they can be named in the 400."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    # Floats as the engine's sampler (fp32) can hold them; SamplingParams.validate adds "0 or >= FLOAT32_TINY".
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, ge=FLOAT32_TINY, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    # vLLM extras
    repetition_penalty: float | None = Field(default=None, ge=FLOAT32_TINY, le=FLOAT32_MAX, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's newer name for max_tokens; when both are given this one wins, as in vLLM.
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1, le=INT32_MAX)  # legacy completions: 16


def unsupported_fields(request: BaseModel, prefix: str = "") -> list[str]:
    """Names of extra fields with a non-neutral value (None counts as absent)."""
    names = []
    for name, value in (request.model_extra or {}).items():
        if value is None or value in _NEUTRAL_VALUES.get(name, ()):
            continue
        names.append(prefix + name)
    return names


def chat_unsupported_fields(request: ChatCompletionRequest) -> list[str]:
    names = unsupported_fields(request)
    for i, message in enumerate(request.messages):
        names += unsupported_fields(message, f"messages[{i}].")
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text":
                    names.append(f"messages[{i}].content[{j}].type={part.type}")
                names += unsupported_fields(part, f"messages[{i}].content[{j}].")
    return names


CHAT_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
