"""Argument parsing shared by the `hintserve bench` and `hintserve simulate` commands: each a one-line ValueError
(the CLI's exit 2) on bad input."""

from __future__ import annotations

import os
from collections.abc import Sequence

from services.engine.expert_format import EXPERT_DTYPES


def require_model(model: str) -> None:
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"no model (config.json) in {model}")


def parse_policies(text: str) -> list[str]:
    from services.engine.offload.eviction import EVICTION_POLICIES
    from services.engine.offload.policies import POLICIES

    policies = [p for item in text.split(",") for p in (POLICIES if item == "all" else [item])]
    unknown = [p for p in policies if p.partition("@")[0] not in POLICIES
               or p.partition("@")[2] not in ("", *EVICTION_POLICIES)]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from: {', '.join(POLICIES)} or all "
                         f"(POLICY@EVICTION swaps the eviction: {', '.join(EVICTION_POLICIES)})")
    return policies


def fractions(text: str) -> list[float]:
    """'25%,50%' or '0.25,0.5' -> [0.25, 0.5]."""
    out = [float(t[:-1]) / 100 if t.endswith("%") else float(t) for t in text.split(",") if t]
    if not out or any(not 0 < f <= 1 for f in out):
        raise ValueError(f"cache fractions must be in (0, 1] (or 1%-100%), got {text!r}")
    return out


def numbers(text: str, kind: type) -> list:
    out = [kind(t) for t in text.split(",") if t]
    if not out or any(v <= 0 for v in out):
        raise ValueError(f"expected a comma-separated list of positive numbers, got {text!r}")
    return out


def choices(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    """A comma-separated list of some of `allowed`, or a one-line error naming `flag`."""
    chosen = [c for c in text.split(",") if c]
    if not chosen or any(c not in allowed for c in chosen):
        raise ValueError(f"{flag}: comma-separated {', '.join(allowed)}; got {text!r}")
    return chosen


def expert_dtypes(text: str) -> tuple[str, ...]:
    dtypes = tuple(d for d in text.split(",") if d)
    if not dtypes or any(d not in EXPERT_DTYPES for d in dtypes):
        raise ValueError(f"expert dtypes: comma-separated {', '.join(EXPERT_DTYPES)}; got {text!r}")
    return dtypes
