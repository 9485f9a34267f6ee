"""The predictor service an engine runs in its own link thread when it has no Redis (no --redis-url).

`hintserve` installs `embedded_service` for its engines (services/cli.py ->
services/engine/embedded_predictor.py); the engine itself cannot import this package, a layer above it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.common.broker import Broker

if TYPE_CHECKING:
    from services.predictor.service import PredictorService


def embedded_service(predictor: str, engine_id: str) -> Callable[[Broker], PredictorService]:
    """Builds the service on the link's broker; raises ValueError or ImportError for an unknown predictor."""
    # Imported here, not above: the command line installs this function in every process it starts, and
    # only an engine without Redis runs it.
    from services.predictor.hub import PredictorHub, resolve_predictor
    from services.predictor.service import PredictorService

    predictor_factory = resolve_predictor(predictor)

    def embedded(broker: Broker) -> PredictorService:
        return PredictorService(broker, PredictorHub(predictor_factory, predictor), consumer=engine_id)

    return embedded
