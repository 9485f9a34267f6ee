"""Wiring of the "hints" prefetcher: an offload policy's HintPrefetcher and the predictor link feeding it.

Over Redis when the engine has --redis-url (a standalone `hintserve predictor` answers); otherwise an
embedded predictor service on an in-process broker, in the link's thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.common.broker import Broker
from services.engine.offload.prefetch.hints import HintPrefetcher
from services.engine.predictor_link import PredictorLink, default_engine_id
from services.predictor.messages import Shape

if TYPE_CHECKING:
    from services.engine.models.geometry import ExpertGeometry
    from services.engine.offload.settings import PredictorSettings
    from services.engine.offload.stats import OffloadStats

log = logging.getLogger(__name__)


def build_hint_prefetcher(
    predictor: PredictorSettings | None, spec: ExpertGeometry, near: int, stats: OffloadStats | None
) -> HintPrefetcher:
    """The "hints" prefetcher of an offload policy, fed by a predictor link unless `predictor` is None.

    Hints serve the layers more than `near` hops ahead; contexts are published after the first MoE layer
    (its routing sharpens the far-layer guesses) and at the end of every step."""
    hints = HintPrefetcher(spec.moe_layers, stats, min_hops=near + 1)
    if predictor is None:
        return hints
    shape = Shape(predictor.model_name, spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size)
    first_moe = spec.moe_layers.index(True)
    attach_predictor_link(
        hints, shape, predictor.name, predictor.redis_url, predictor.engine_id, partial_layers=(first_moe,)
    )
    return hints


def attach_predictor_link(
    hints: HintPrefetcher, shape: Shape, predictor: str, redis_url: str | None, engine_id: str | None,
    partial_layers: tuple[int, ...] = (0,),
) -> PredictorLink | None:
    """Feeds `hints` from the predictor: over Redis when `redis_url` is set, else from an embedded service
    on an in-process broker. Returns the started link, or None when no predictor can run here."""
    from services.common.broker import check_broker_url, make_broker

    engine_id = engine_id or default_engine_id()
    embedded = None
    if redis_url:
        check_broker_url(redis_url)  # a bad URL fails at start-up, not in the link thread

        def factory() -> Broker:
            return make_broker(redis_url)
    else:
        from services.common.inprocess_broker import InProcessBroker
        from services.predictor.hub import PredictorHub, resolve_predictor
        from services.predictor.service import PredictorService

        try:
            predictor_factory = resolve_predictor(predictor)
        except (ValueError, ImportError) as exc:
            log.warning("no embedded predictor (%s): serving with local prefetchers only", exc)
            return None
        shared = InProcessBroker()

        def factory() -> Broker:
            return shared

        def embedded(broker: Broker) -> PredictorService:
            return PredictorService(broker, PredictorHub(predictor_factory, predictor), consumer=engine_id)

    link = PredictorLink(
        factory, engine_id, shape, hints, predictor=predictor, embedded=embedded, partial_layers=partial_layers
    )
    if hasattr(hints.stats, "sources"):
        hints.stats.sources.append(link.engine_stats)  # type: ignore[attr-defined]
    hints.add_closer(link.close)
    return link.start()
