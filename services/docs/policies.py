"""The offload policies' table, read from the registries the engine, the CLI and the simulator resolve names
through (services/engine/offload: policies.py, eviction/, prefetch/), so a policy added there is documented."""

from __future__ import annotations

from services.common.report import markdown_table
from services.engine.offload.eviction import EVICTION_POLICIES
from services.engine.offload.policies import POLICIES
from services.engine.offload.prefetch import PREFETCHERS

_MISSES = {"device": "fetched", "host": "on the host", "cost": "host, link or split: whichever finishes first"}


def render() -> str:
    rows = [
        (f"`{p.name}`", p.description, f"`{p.eviction}`" if offloads else "-",
         ", ".join(f"`{n}`" for n in p.prefetchers) or "-", _MISSES.get(p.placement, p.placement) if offloads else "-")
        for p in POLICIES.values()
        for offloads in [p.name != "resident"]
    ]
    table = markdown_table(["policy", "what it reproduces", "eviction", "prefetchers", "misses"], rows)
    names = lambda registry: ", ".join(f"`{n}`" for n in registry)  # noqa: E731
    return (f"{table}\n\nEvictions (`--eviction`): {names(EVICTION_POLICIES)}. "
            f"Prefetchers: {names(PREFETCHERS)}.")
