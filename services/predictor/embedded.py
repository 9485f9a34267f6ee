"""The predictor service an engine runs in its own link thread when it has no Redis (no --redis-url)."""

from __future__ import annotations

from collections.abc import Callable

from services.common.broker import Broker
from services.predictor.hub import PredictorHub, resolve_predictor
from services.predictor.service import PredictorService


def embedded_service(predictor: str, engine_id: str) -> Callable[[Broker], PredictorService]:
    """Builds the service on the link's broker; raises ValueError or ImportError for an unknown predictor."""
    predictor_factory = resolve_predictor(predictor)

    def embedded(broker: Broker) -> PredictorService:
        return PredictorService(broker, PredictorHub(predictor_factory, predictor), consumer=engine_id)

    return embedded
