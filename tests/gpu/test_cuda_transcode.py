"""On a GPU: quantized experts kept in the CPU kernels' layout on the host land in their slots in torch's CUDA
layout, bit for bit what packing them for the device gives, over the copy engine and at start-up; a hybrid
policy's quantized engine runs (tests/test_transcode.py checks the repack's inputs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.expert_provider import ExpertWeights
from services.engine.llm_engine import LLMEngine
from services.engine.offload.cuda_link import CudaLink
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transcode import Transcoder
from services.engine.offload.transfer_engine import Transfer, TransferEngine
from services.engine.quant.layout import QuantizedExpertLayout
from services.engine.quant.packed import QuantScheme
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (4, 128), (8, 64)])
def test_a_transcoded_expert_is_the_device_packed_one(bits: int, group: int) -> None:
    hidden, width = 256, 128
    scheme = QuantScheme(bits, group)
    host, device = QuantizedExpertLayout(hidden, width, scheme, "cpu"), QuantizedExpertLayout(hidden, width, scheme, "cuda")
    gen = torch.Generator().manual_seed(group)
    w = ExpertWeights(torch.randn(2 * width, hidden, generator=gen) / 16, torch.randn(hidden, width, generator=gen) / 11)
    want = torch.zeros(device.numel, dtype=torch.uint8, device="cuda")  # its alignment gaps zero, as below
    device.pack(w, want)
    source = torch.empty(host.numel, dtype=torch.uint8).pin_memory()
    host.pack(w, source)
    transcoder = Transcoder(host, device)

    filled = torch.zeros_like(want)
    transcoder.fill(filled, source)
    torch.cuda.synchronize()
    assert torch.equal(filled, want)

    link = CudaLink("cuda")
    engine = TransferEngine(link, OffloadStats(1))
    try:
        copied = torch.zeros_like(want)
        torch.cuda.synchronize()  # the zeros (default stream) before the repack writes (copy stream)
        chunks, repacks = transcoder.chunks(copied, source)
        transfer = Transfer((0, 0), chunks, link.new_event(), True, 1.0, (0, 0), repacks=repacks)
        engine.submit(transfer)
        transfer.event.synchronize()
        assert torch.equal(copied, want)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("policy", ["cpu-experts", "fiddler", "hintserve"])
def test_a_hybrid_quantized_engine_computes_on_the_host_and_decodes(tiny_mixtral_dir: str, policy: str,
                                                                    dtype: str) -> None:
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, device="cuda", expert_dtype=dtype, expert_group_size=32,
                                    offload_policy=policy, expert_cache_experts=3, link="native"))
    try:
        outputs = engine.generate(prompts, params)
        assert [len(tokens) for tokens in outputs] == [10, 10]
        assert engine.model.experts.stats.host_experts > 0
    finally:
        engine.close()
