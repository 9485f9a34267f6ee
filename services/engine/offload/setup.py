"""The engine's expert provider for OffloadSettings: resident, or offloaded with a policy.

The engine's own parts (the host store, the link, the host executor, the measured prices) are made here; the
rest is offload/assembler.py's, which the simulator shares."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from services.engine.expert_provider import ExpertProvider, HostCompute
from services.engine.models.geometry import ExpertGeometry, expert_bytes
from services.engine.models.resident import load_resident_experts
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import NonExpertWeights, WeightReader
from services.engine.offload.assembler import OffloadParts, assemble_provider
from services.engine.offload.cost_model import PlacementCosts, measure_costs
from services.engine.offload.cuda_link import CudaLink
from services.engine.offload.host_executor import HostExecutor
from services.engine.offload.host_store import HostExpertStore
from services.engine.offload.hybrid_setup import is_hybrid
from services.engine.offload.link import EmulatedLink, Link, emulation_unit
from services.engine.offload.memory_bus import MemoryBus, emulated_dram
from services.engine.offload.settings import OffloadSettings
from services.engine.offload.split_experts import layout_split_prices
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transcode import Transcoder, needs_transcoding
from services.engine.offload.transfer_engine import TransferEngine
from services.engine.quant.layout import QuantizedExpertLayout, StoredLayout

log = logging.getLogger(__name__)


def make_link(settings: OffloadSettings, spec: ExpertGeometry, dtype: torch.dtype, reference_bytes: int) -> Link:
    """`reference_bytes`: the unquantized expert, whose transfer the emulated link's ratio prices."""
    if settings.link == "native":
        return CudaLink(settings.device)
    if settings.link_bytes_per_second is not None:
        return EmulatedLink(settings.link_bytes_per_second)
    ratio = settings.link_ratio
    per_expert = ratio * emulation_unit(spec.hidden_size, spec.moe_intermediate_size, dtype)
    log.info("emulated link: %.3f ms per expert (ratio %.1f)", per_expert * 1e3, ratio)
    # Bandwidth from the unquantized expert, so a packed one moves its fewer bytes faster (a fair comparison).
    return EmulatedLink(reference_bytes / per_expert)


def _one_dram(costs: PlacementCosts, link: EmulatedLink, reference: int, stored: int) -> PlacementCosts:
    """The emulated host's math and the emulated link's copies on one DRAM (offload/memory_bus.py), sized as the
    emulated host's GEMV; the emulated host prices an expert as the reference (unquantized) one, whose bytes the
    link's rate counts, the link moves the stored ones."""
    link.bus = MemoryBus(emulated_dram(reference, costs.host(1), link.bytes_per_second))
    return replace(costs, dram=link.bus.capacity, host_bytes=reference, link_bytes=stored)


def _host_executor(
    settings: OffloadSettings, costs: PlacementCosts, link: Link
) -> Callable[[OffloadStats, TransferEngine], HostCompute]:
    """On CUDA the host is real; on the CPU it is emulated at the measured prices, on the link's DRAM."""
    cuda = settings.device.startswith("cuda")
    emulated = None if cuda else costs.host
    bus = link.bus if not cuda and isinstance(link, EmulatedLink) else None
    return lambda stats, _transfers: HostExecutor(settings.host_threads, stats, emulated, bus, costs.host_bytes,
                                                  pool_is_host=cuda)


def build_expert_provider(
    settings: OffloadSettings, reader: WeightReader, spec: ModelSpec, weights: NonExpertWeights, layout: StoredLayout
) -> ExpertProvider:
    """Every routed expert stored in `layout`: resident on the device, or in host memory behind the policy."""
    if not settings.offloads:
        return load_resident_experts(reader, spec, layout)
    slots = settings.cache_slots(spec, layout.nbytes)  # a budget too small fails before the store is read
    cuda = settings.device.startswith("cuda")
    transcoder = None
    if needs_transcoding(layout, settings.device, is_hybrid(settings.policy)):
        assert isinstance(layout, QuantizedExpertLayout)  # needs_transcoding checked it
        host_layout = QuantizedExpertLayout(spec.hidden_size, spec.moe_intermediate_size, layout.scheme, "cpu")
        transcoder = Transcoder(host_layout, layout)
    # Page-locked only where the copy engine reads it: a policy with no device slots (cpu-experts) never copies.
    store = HostExpertStore(reader, spec, pin=cuda and slots > 0,
                            layout=layout if transcoder is None else transcoder.host)
    # The unquantized expert: an emulated link and host price an expert as R x its compute on the device.
    reference = expert_bytes(spec, reader.dtype if settings.expert_dtype == "auto" else torch.bfloat16)
    link = make_link(settings, spec, reader.dtype, reference)
    costs = None
    if is_hybrid(settings.policy):
        costs = measure_costs(spec.hidden_size, spec.moe_intermediate_size, reader.dtype, settings.device, link,
                              store.expert_bytes, settings.host_ratio, host_layout=store.layout, device_layout=layout)
        log.info("placement costs (ms): device %.3f, host %.3f, link %.3f per expert and token",
                 costs.device(1) * 1e3, costs.host(1) * 1e3, costs.link * 1e3)
        if not cuda and isinstance(link, EmulatedLink):  # the emulated host and link read one DRAM
            costs = _one_dram(costs, link, reference, store.expert_bytes)
    fence = link.compute_fence if isinstance(link, CudaLink) else None

    def transfers(stats: OffloadStats) -> TransferEngine:
        return TransferEngine(link, stats)

    parts = OffloadParts(
        store, transfers, split=layout_split_prices(store.layout), costs=costs,
        make_host=_host_executor(settings, costs, link) if costs is not None else None, fence=fence,
        router_model=(spec, weights), transcoder=transcoder,
    )
    return assemble_provider(settings, spec, slots, parts)
