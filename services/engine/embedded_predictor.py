"""The predictor service an engine runs in its own link thread when it has no Redis: given, not looked up.

The service lives in the predictor package, a layer above the engine, so the engine cannot import it. The
command line (services/cli.py) hands its factory down once with `use_embedded_predictor`; the engine core
process receives it from its frontend (a module-level function pickles by name). Without one, an engine
with no --redis-url serves with its local prefetchers only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from services.common.broker import Broker


class EmbeddedService(Protocol):
    """What the link thread runs: until stop()."""

    async def run(self) -> None: ...

    def stop(self) -> None: ...


# (predictor name, engine id) -> the service, built on the link's broker; ValueError or ImportError for a
# predictor it does not know.
EmbeddedPredictorFactory = Callable[[str, str], Callable[[Broker], EmbeddedService]]

_factory: EmbeddedPredictorFactory | None = None


def use_embedded_predictor(factory: EmbeddedPredictorFactory | None) -> None:
    """Installs the factory engines of this process use (None: engines run no embedded predictor)."""
    global _factory
    _factory = factory


def embedded_predictor() -> EmbeddedPredictorFactory | None:
    return _factory
