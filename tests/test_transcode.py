"""Quantized experts carried from the CPU kernels' layout (the host store of a CUDA engine whose host computes)
into torch's CUDA layout (its slots): the repack's inputs are what packing for the device makes, bit for bit,
and the transfer engine runs each chunk's repack after that chunk's copy. tests/gpu/test_cuda_transcode.py
runs the last step on a GPU."""

from __future__ import annotations

import pytest
import torch

from services.engine.cpu_kernels import formats
from services.engine.offload.link import EmulatedLink
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transcode import int8_rows, needs_transcoding, tinygemm_inputs
from services.engine.offload.transfer_engine import Transfer, TransferEngine
from services.engine.quant.groupwise import quantize_int4, quantize_int8
from services.engine.quant.layout import expert_layout
from services.engine.quant.packed import SCALE_DTYPE


@pytest.mark.parametrize(("n", "k", "group"), [(48, 128, 32), (64, 256, 64), (40, 256, 128)])
def test_the_cpu_layout_gives_back_pack_int4s_inputs(n: int, k: int, group: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k + group))
    q, scale, zero = quantize_int4(w, group)
    cpu = formats.from_int4(q, scale, zero, group)  # the host store's bytes (40 rows: a padded last tile)
    nibbles, scale_zero = tinygemm_inputs(cpu.weight.reshape(-1), (n, k), group)
    # What pack_int4 builds for CUDA from the same quantization, before _convert_weight_to_int4pack.
    assert torch.equal(nibbles, (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8))
    assert torch.equal(scale_zero, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(SCALE_DTYPE))


@pytest.mark.parametrize(("n", "k"), [(48, 128), (40, 256)])
def test_the_cpu_layout_gives_back_the_int8_rows_and_scales(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    q, scale = quantize_int8(w)
    cpu = formats.pack(w, "int8")  # the host store's bytes and row scales (40 rows: a padded last tile)
    assert cpu.scales is not None
    rows, scales = int8_rows(cpu.weight.reshape(-1), cpu.scales, (n, k))
    # What pack_matrix moves to a CUDA device from the same quantization.
    assert rows.dtype == torch.int8 and torch.equal(rows, q)
    assert torch.equal(scales, scale.to(SCALE_DTYPE))


def test_transcoding_is_for_a_cuda_engines_quantized_experts_its_host_computes() -> None:
    int4 = expert_layout(64, 32, "int4", 32, torch.float32, "cpu")
    int8 = expert_layout(64, 32, "int8", 32, torch.float32, "cpu")
    dense = expert_layout(64, 32, "bf16", 32, torch.float32, "cpu")
    assert needs_transcoding(int4, "cuda:0", host_computes=True)
    assert not needs_transcoding(int4, "cuda:0", host_computes=False)  # copies only: the store keeps CUDA's
    assert not needs_transcoding(int4, "cpu", host_computes=True)  # one layout on a CPU engine
    assert needs_transcoding(int8, "cuda", host_computes=True)
    assert not needs_transcoding(dense, "cuda", host_computes=True)


def test_each_chunks_repack_runs_after_its_copy_before_the_transfer_is_ready() -> None:
    link = EmulatedLink(1e9)
    engine = TransferEngine(link, OffloadStats(1))
    seen: list[tuple[int, float]] = []
    try:
        srcs = [torch.full((300,), 1.0), torch.full((200,), 2.0)]
        dsts = [torch.zeros(300), torch.zeros(200)]
        repacks = [lambda i=i: seen.append((i, dsts[i][0].item())) for i in range(2)]
        transfer = Transfer((0, 0), list(zip(dsts, srcs)), link.new_event(), True, 1.0, (0, 0), repacks=repacks)
        engine.submit(transfer)
        transfer.event.wait()
        assert seen == [(0, 1.0), (1, 2.0)]  # in chunk order, each on its chunk's landed bytes
    finally:
        engine.shutdown()


def test_a_hybrid_engine_moves_every_expert_through_the_transcoders_chunks(tiny_mixtral_dir: str,
                                                                           monkeypatch) -> None:
    """The wiring a CUDA engine takes (host store in the host layout, slots in the device's, start-up fills
    and every transfer through the transcoder's staging and repacks), run on the CPU with a repack that copies
    the staged matrix as it is: the tokens are the untranscoded engine's, and every fill and copy repacked."""
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.offload import setup
    from services.engine.offload.transcode import Transcoder
    from services.engine.sampling_params import SamplingParams

    repacked: list[str] = []

    class StagedCopy(Transcoder):
        """The CPU layout on both sides; each matrix staged, then copied into its slot by its repack."""

        def __init__(self, host, device) -> None:  # the setup's two layouts, both CPU here
            self.host = self.device = host
            self.group = host.scheme.group_size
            flat = torch.empty(host.numel, dtype=torch.uint8)
            self.staging = [torch.empty(chunk.numel(), dtype=torch.uint8) for chunk in host.chunks(flat)]

        def _repack(self, name, staging, start, slot):
            def repack() -> None:
                repacked.append(name)
                chunk = self.host.chunks(slot)[0 if name == "gate_up" else 1]
                chunk.copy_(staging)

            return repack

    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(model=tiny_mixtral_dir, offload_policy="hintserve", expert_dtype="int4", expert_group_size=32,
              expert_cache_fraction=0.25, link_ratio=100.0, host_ratio=4.0)
    engine = LLMEngine(EngineConfig(**kw))
    try:
        expected = engine.generate(prompts, params)
    finally:
        engine.close()
    monkeypatch.setattr(setup, "needs_transcoding", lambda layout, device, host_computes: host_computes)
    monkeypatch.setattr(setup, "Transcoder", StagedCopy)
    engine = LLMEngine(EngineConfig(**kw))
    try:
        provider = engine.model.experts
        assert isinstance(provider.cache.transcoder, StagedCopy)
        assert engine.generate(prompts, params) == expected
        moved = provider.stats.bytes_demand + provider.stats.bytes_prefetch
        assert moved > 0 and provider.stats.host_experts > 0
        assert len(repacked) >= 2 * moved // provider.store.expert_bytes  # every copied expert: both matrices
    finally:
        engine.close()
