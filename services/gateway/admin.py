"""POST /v1/admin/replay: replays an Azure LLM inference trace against this gateway via `loadgen`.

The replay logic lives once, in `loadgen.replay` (`arun_replay(ReplayConfig) -> dict`, or the blocking
`run_replay`); this endpoint only authenticates, validates, points the replay at this gateway and returns
the report. The body holds `ReplayConfig` fields (`trace`, `speedup`, `duration`, `max_requests`,
`max_context`, `prompts`, `goodput`, ...); `url`, `model` and `api_key` are the gateway's own, and the
output-file fields are refused (the report is the response; the server's disk is not the client's).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from services.gateway.auth import bearer_token, key_matches, unauthorized
from services.gateway.errors import APIError, bad_request

_SET_BY_GATEWAY = ("url", "model", "api_key")
_REFUSED = ("json_path", "csv_path", "plot_path", "progress")


def check_admin(admin_key: str | None, authorization: str | None) -> None:
    if admin_key is None:
        raise APIError(
            403, "the admin API is disabled: set HINTSERVE_ADMIN_KEY to enable it", code="admin_disabled"
        )
    if not key_matches(bearer_token(authorization), [admin_key]):
        raise unauthorized("missing or incorrect admin key", invalid=authorization is not None)


def load_replay_module() -> Any:
    """`loadgen.replay`, imported on first use: the gateway must not need loadgen (or its deps) to start."""
    try:
        from loadgen import replay as module
    except ModuleNotFoundError as exc:
        raise APIError(501, f"the replay needs the loadgen package: {exc}", code="not_implemented") from exc
    if not hasattr(module, "ReplayConfig") or not hasattr(module, "run_replay"):
        raise APIError(501, "loadgen.replay lacks ReplayConfig / run_replay", code="not_implemented")
    return module


def build_replay_config(
    module: Any, body: Any, url: str, model: str | None, api_key: str | None, tokenizer: str | None
) -> Any:
    """A validated `ReplayConfig` from the request body; 400 naming the field on anything wrong."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object of replay settings")
    if model is None:
        raise APIError(
            503, "the served model is not known yet (no engine answered)", code="no_healthy_engine"
        )
    fields = {f.name for f in dataclasses.fields(module.ReplayConfig)}
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(f"unknown replay setting(s): {', '.join(unknown)}", param=unknown[0])
    for group, why in ((_SET_BY_GATEWAY, "set by the gateway"), (_REFUSED, "not allowed over HTTP")):
        given = [name for name in group if name in body]
        if given:
            raise bad_request(f"{', '.join(given)}: {why}", param=given[0])
    settings = dict(body)
    # Exact prompt lengths need the served model's tokenizer; the gateway knows where it is.
    settings.setdefault("tokenizer", tokenizer)
    try:
        config = module.ReplayConfig(url=url, model=model, api_key=api_key, **settings)
        config.validate()
    except (TypeError, ValueError) as exc:
        raise bad_request(f"invalid replay settings: {exc}") from exc
    return config


class ReplayRunner:
    """Runs at most one replay at a time (a replay saturates the engines; two would measure each other)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def run(self, module: Any, config: Any) -> dict[str, Any]:
        if self._lock.locked():
            raise APIError(409, "a replay is already running", code="replay_running")
        async with self._lock:
            try:
                if hasattr(module, "arun_replay"):  # in this loop: cancellable when the admin disconnects
                    report = await module.arun_replay(config)
                else:  # blocking: in a thread, never on the loop that serves the replayed requests
                    report = await asyncio.to_thread(module.run_replay, config)
            except (ValueError, FileNotFoundError) as exc:
                raise bad_request(f"replay failed: {exc}") from exc
        if not isinstance(report, dict):
            raise APIError(500, "loadgen returned no report", code="internal_error")
        return report
