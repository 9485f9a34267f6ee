"""The synchronous engine: admission, the step loop (schedule -> run -> process outputs), abort, stats."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import OrderedDict, defaultdict

import torch
from transformers import AutoTokenizer

from services.engine.block_manager import BlockManager
from services.engine.chunk_sizer import ChunkSizer
from services.engine.config import EngineConfig
from services.engine.cpu_threads import apply_threads
from services.engine.cuda_graphs import graphs_supported
from services.engine.errors import InvalidRequestError
from services.engine.host_allocator import loading_weights
from services.engine.input_processor import (
    EngineLimits,
    InputProcessor,
    apply_chat_template,
    has_chat_template,
)
from services.engine.isolation import StepIsolator
from services.engine.model_runner import ModelRunner
from services.engine.models.loader import load_model
from services.engine.models.spec import load_hf_config, spec_from_config
from services.engine.offload.prefetch.hints import HintPrefetcher
from services.engine.offload.settings import OffloadSettings
from services.engine.output_processor import RequestStream, process_token
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence

_MAX_DEFAULT_CONTEXT = 4096
_MAX_DEFAULT_KV_BYTES = 2 << 30
RECENT_LENGTH_ENDS = 1024  # max_tokens finishes remembered for a stop string that lands on their last tokens

log = logging.getLogger(__name__)


def _finished(reason: str) -> str:
    return f'requests_finished_total{{reason="{reason}"}}'


def _generation_eos_ids(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else (eos if isinstance(eos, list) else [eos])


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """`detokenize=False`: the engine core process, whose frontend turns tokens into text (and stop strings)."""
        config.validate()
        self.config = config
        self.offload = OffloadSettings.from_config(config)  # every offload knob, resolved and checked once
        self.detokenize = detokenize
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        model_positions = spec_from_config(load_hf_config(config.model)).max_position_embeddings
        self.max_model_len = config.max_model_len or min(model_positions, _MAX_DEFAULT_CONTEXT)
        if self.max_model_len > model_positions:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {model_positions}")
        self._torch_threads = torch.get_num_threads()  # restored at close: the setting is process-wide
        apply_threads(config)
        make_current(config.device)
        # Loaded with the transients' pages returned as freed; then the host's activations (and, offloaded, its
        # expert compute) keep and reuse their pages.
        with loading_weights():
            loaded = load_model(
                config.model,
                config.dtype,
                config.device,
                self.max_model_len,
                offload=self.offload,
                weight_dtype=config.weight_dtype,
                weight_group_size=config.weight_group_size,
            )
        self.spec = loaded.spec
        self.dtype = loaded.dtype
        self.model_type = loaded.hf_config.model_type
        eos = set(self.spec.eos_token_ids) | set(_generation_eos_ids(config.model))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(eos))
        self.block_manager = BlockManager(self._num_kv_blocks(loaded.dtype.itemsize), config.block_size,
                                          config.enable_prefix_caching)
        sizer = None if config.itl_target_ms is None else ChunkSizer(config.itl_target_ms / 1e3,
                                                                    config.max_num_batched_tokens)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager, sizer)
        graphs = not config.enforce_eager and graphs_supported(loaded.model)
        self.runner = ModelRunner(loaded.model, self.block_manager, self.eos_ids, config.seed, config.device, graphs)
        if graphs:
            self._capture_graphs()
        self.isolator = StepIsolator(self.runner.run)
        self._start_predictor_link(loaded.model.experts)
        self.model = loaded.model
        self.limits = EngineLimits(
            self.spec.vocab_size,
            self.max_model_len,
            config.block_size,
            self.block_manager.num_blocks,
        )
        self.input_processor = InputProcessor(self.tokenizer, self.limits)
        self._streams: dict[str, tuple[Sequence, RequestStream | None]] = {}
        self.counters: defaultdict[str, float] = defaultdict(float)  # counts and seconds, exported as floats
        # Requests the core ended at max_tokens, latest last: a frontend's stop string can land on one of their
        # last tokens after the core ran past it, and the finish is then counted as the client saw it.
        self._ended_by_length: OrderedDict[tuple[str, int], None] = OrderedDict()

    def _capture_graphs(self) -> None:
        """CUDA graphs for every decode bucket; a capture that fails leaves decode eager, with a warning."""
        blocks = math.ceil(self.max_model_len / self.config.block_size)
        try:
            self.runner.capture_graphs(self.config.max_num_seqs, blocks)
        except RuntimeError as exc:
            log.warning("CUDA graph capture failed, decode runs eagerly (--enforce-eager skips trying): %s", exc)

    def _start_predictor_link(self, experts: object) -> None:
        """A hint policy's prefetcher gets its predictor link, which watches the runner's steps."""
        hints = [p for p in getattr(experts, "prefetchers", ()) if isinstance(p, HintPrefetcher)]
        predictor = self.offload.predictor
        if hints and predictor is not None:
            from services.engine.predictor_link import start_predictor_link  # redis, grpc: only when used

            start_predictor_link(self.runner, hints[0], predictor, self.spec)
        elif hints and self.config.predictor != "none":
            log.info("hybrid policy %s: no embedded predictor on the host cores it computes on; pass --redis-url "
                     "for a predictor service, or --predictor NAME to embed one anyway", self.config.offload_policy)

    def _num_kv_blocks(self, itemsize: int) -> int:
        cfg, spec = self.config, self.spec
        bytes_per_block = cfg.block_size * spec.kv_cache_elems_per_token * itemsize
        if cfg.kv_cache_mb is not None:
            return max(1, cfg.kv_cache_mb * (1 << 20) // bytes_per_block)
        wanted = cfg.max_num_seqs * math.ceil(self.max_model_len / cfg.block_size)
        return max(1, min(wanted, _MAX_DEFAULT_KV_BYTES // bytes_per_block))

    # ---- admission ----
    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validates a request and builds its sequence; raises InvalidRequestError with a clear message."""
        return self.input_processor.make_sequence(request_id, prompt, params)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self._streams:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in flight")
        self._streams[seq.request_id] = (seq, RequestStream(seq, self.tokenizer) if self.detokenize else None)
        self.scheduler.add(seq)
        self.counters["requests_received_total"] += 1
        self.counters["prompt_tokens_total"] += seq.num_prompt_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        seq = self.make_sequence(request_id, prompt, params)
        self.add_sequence(seq)
        return seq

    def abort_request(
        self, request_id: str, serial: int | None = None, reason: str = "abort"
    ) -> RequestOutput | None:
        """Aborts the in-flight request `request_id` (only its admission `serial`, if given); `reason` "stop":
        the frontend found a stop string in the text."""
        entry = self._streams.get(request_id)
        if entry is None or (serial is not None and entry[0].serial != serial):
            if reason == "stop" and serial is not None and (request_id, serial) in self._ended_by_length:
                del self._ended_by_length[(request_id, serial)]
                self.counters[_finished("length")] -= 1
                self.counters[_finished("stop")] += 1
            return None
        del self._streams[request_id]
        seq, _ = entry
        self.scheduler.abort(request_id)
        self.counters[_finished(reason)] += 1
        return RequestOutput(
            request_id, "", [], seq.num_prompt_tokens, seq.num_completion_tokens, True, reason, seq.serial
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        seqs, is_prefill, num_decodes = self.scheduler.schedule()
        if not seqs:
            return []
        start = time.perf_counter()
        done, failed = self.isolator.step(seqs, is_prefill)
        elapsed = time.perf_counter() - start
        kind = "prefill" if is_prefill else "decode"
        self.counters[f"{kind}_steps_total"] += 1
        self.counters[f"{kind}_seconds_total"] += elapsed
        if is_prefill:  # prompt tokens; the running sequences' rows it carried counted apart (decode rates stay pure)
            prompt_tokens = sum(s.num_scheduled_tokens for s in seqs[num_decodes:])
            self.counters["prefill_tokens_total"] += prompt_tokens
            self.counters["prefill_step_decode_tokens_total"] += num_decodes
            if self.scheduler.chunk_sizer is not None:
                self.scheduler.chunk_sizer.observe(prompt_tokens, elapsed)
        else:
            self.counters["decode_tokens_total"] += len(seqs)
        outputs = [self._fail(seq, message) for seq, message in failed]
        now = time.monotonic()
        for seq, token in done:
            self.block_manager.register_computed(seq)  # a block just filled, by a prompt or by decoding, is shareable
            if token is None:  # a prefill chunk with more of the prompt to come
                continue
            seq.append_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            _, stream = self._streams[seq.request_id]
            try:  # detokenizing is this sequence's own business too: a failure ends it alone
                out, reason = process_token(seq, stream, token, self.eos_ids, self.max_model_len)
            except Exception as exc:
                outputs.append(self._fail(seq, f"the engine failed on this request: {exc!r}"))
                continue
            self.counters["generation_tokens_total"] += 1
            if reason:
                self.scheduler.finish(seq, reason)
                del self._streams[seq.request_id]
                self.counters[_finished(reason)] += 1
                if reason == "length":
                    self._ended_by_length[(seq.request_id, seq.serial)] = None
                    if len(self._ended_by_length) > RECENT_LENGTH_ENDS:
                        self._ended_by_length.popitem(last=False)
            outputs.append(out)
        return outputs

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Ends one sequence whose step raised: its KV blocks are freed, its stream gets the error."""
        self.scheduler.finish(seq, "error")
        del self._streams[seq.request_id]
        self.counters[_finished("error")] += 1
        return RequestOutput(
            seq.request_id,
            "",
            [],
            seq.num_prompt_tokens,
            seq.num_completion_tokens,
            True,
            "error",
            seq.serial,
            error=message,
        )

    # ---- conveniences ----
    def generate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
        """Offline batch generation: completion token ids per prompt, in order."""
        ids = [f"offline-{self.counters['requests_received_total']}-{i}" for i in range(len(prompts))]
        seqs = [self.add_request(rid, p, params) for rid, p in zip(ids, prompts)]
        while self.has_unfinished():
            self.step()
        return [s.completion_token_ids for s in seqs]

    def stats(self) -> dict[str, float]:
        while True:  # other threads read while the loop thread adds keys; retry a torn copy
            try:
                stats = {k: float(v) for k, v in list(self.counters.items())}
                break
            except RuntimeError:
                continue
        stats.update(
            num_running=float(len(self.scheduler.running)),
            num_waiting=float(len(self.scheduler.waiting)),
            kv_blocks_used=float(self.block_manager.num_used),
            kv_blocks_capacity=float(self.block_manager.num_blocks),
            preemptions_total=float(self.scheduler.num_preemptions),
            prefix_cache_queries_total=float(self.block_manager.prefix_queries),
            prefix_cache_hits_total=float(self.block_manager.prefix_hits),
            device_bytes=float(self.device_bytes()),
        )
        stats.update(self.model.experts.engine_stats())
        return stats

    def device_bytes(self) -> int:
        """Peak device memory: the allocator's figure on CUDA, else tracked bytes of device tensors."""
        if self.config.device.startswith("cuda"):
            return torch.cuda.max_memory_allocated(self.config.device)
        m = self.model
        tensors = [m.w.embed, m.w.lm_head, m.w.final_norm, *m.kv_cache_tensors]
        for layer in m.w.layers:
            tensors += [t for t in vars(layer.attention).values() if isinstance(t, torch.Tensor)]
            norms_and_router = (layer.input_norm, layer.post_attention_norm, layer.router, layer.router_bias)
            tensors += [t for t in norms_and_router if t is not None]
            for mlp in (layer.dense_mlp, layer.shared_expert):
                if mlp is not None:
                    tensors += [mlp.gate_up, mlp.down]
        linears = [lin for lin in (*m.qkv, *m.o, m.lm_head) if lin is not None]
        tensors += [lin.weight for lin in linears if lin.weight is not None]  # the fused qkv weights are copies
        unique = {id(t): t for t in tensors}
        # oneDNN's prepacked copies (CPU fp32), and the layers that hold only their own format (no float copy)
        packed = sum(lin.extra_bytes if lin.weight is not None else lin.nbytes for lin in linears)
        return sum(t.numel() * t.element_size() for t in unique.values()) + packed + m.experts.device_bytes

    def close(self) -> None:
        self.model.experts.close()
        torch.set_num_threads(self._torch_threads)

    def model_info(self) -> dict[str, object]:
        spec = self.spec
        return {
            "model": os.path.basename(os.path.normpath(self.config.model)),
            "model_type": self.model_type,
            "num_layers": spec.num_layers,
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
            "max_model_len": self.max_model_len,
            "vocab_size": spec.vocab_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": self.config.device,
        }

    @property
    def has_chat_template(self) -> bool:
        return has_chat_template(self.tokenizer)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return apply_chat_template(self.tokenizer, messages)


def make_current(device: str) -> None:
    """The device this thread's steps run on, made its current one: events, streams and graph capture default
    to it (under cuda:1 host jobs recorded their copies' events on cuda:0's stream, and graphs captured
    nothing). A bare "cuda" is the current device already (set_device refuses it: no index)."""
    parsed = torch.device(device)
    if parsed.type == "cuda" and parsed.index is not None:
        torch.cuda.set_device(parsed.index)
