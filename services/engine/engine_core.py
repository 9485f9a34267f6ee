"""The engine core: LLMEngine's step loop on its own, fed and drained through two pipes (vLLM V1's EngineCore).

It runs in its own process under `hintserve serve` and `hintserve engine`, so the model never shares a GIL with
HTTP, SSE, gRPC or detokenisation; `AsyncLLMEngine` (the frontend) tokenises, detokenises and streams. The
messages, typed and sent as MessagePack, are in core_messages.py.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from multiprocessing.connection import Connection

from services.engine import core_messages
from services.engine.config import EngineConfig
from services.engine.core_messages import (
    AbortRequest,
    AddRequest,
    CoreDead,
    CoreMessage,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    CoreStats,
    StopCore,
)
from services.engine.embedded_predictor import EmbeddedPredictorFactory, use_embedded_predictor
from services.engine.errors import InvalidRequestError
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence
from services.engine.watchdog import HEARTBEAT_S

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # while busy, stats ride along with outputs this often, and with every finish


def _core_output(out: RequestOutput) -> CoreOutput:
    token = out.delta_token_ids[0] if out.delta_token_ids else None
    return CoreOutput(out.request_id, out.seq_serial, token, out.prompt_tokens, out.completion_tokens,
                      out.finish_reason, out.error)


class EngineCore:
    def __init__(self, engine: LLMEngine, requests: Connection, outputs: Connection) -> None:
        self.engine = engine
        self.requests = requests
        self.outputs = outputs
        self._stats_due = 0.0
        self._heartbeat_due = 0.0  # the frontend's step watchdog hears from a busy core at least this often

    def run(self) -> None:
        """Steps while there is work, blocks on the pipe when there is none; returns on StopCore or EOF."""
        engine, requests = self.engine, self.requests
        while True:
            if not engine.has_unfinished():
                core_messages.send(self.outputs, CoreStats(engine.stats()))
                requests.poll(None)
            while requests.poll():
                if not self._handle(core_messages.recv_request(requests)):  # EOFError: the frontend is gone; so are we
                    return
            if engine.has_unfinished():
                outputs = engine.step()
                if outputs:
                    self._send_outputs(outputs)
                elif time.monotonic() >= self._heartbeat_due:  # a step without outputs (a prefill chunk)
                    self._heartbeat_due = time.monotonic() + HEARTBEAT_S
                    core_messages.send(self.outputs, CoreStats(engine.stats()))

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        self._heartbeat_due = now + HEARTBEAT_S
        stats = None
        if now >= self._stats_due or any(o.finished for o in outputs):  # a finish frees blocks, bumps counters
            self._stats_due = now + STATS_INTERVAL_S
            stats = self.engine.stats()
        core_messages.send(self.outputs, CoreOutputs([_core_output(o) for o in outputs], stats))

    def _handle(self, msg: CoreRequest) -> bool:
        if isinstance(msg, AddRequest):
            self._add(msg.request_id, msg.serial, msg.prompt_token_ids, msg.params)
        elif isinstance(msg, AbortRequest):
            out = self.engine.abort_request(msg.request_id, msg.serial, msg.reason)
            if out is not None:
                self._send_outputs([out])
        elif isinstance(msg, StopCore):
            outs = [self.engine.abort_request(rid) for rid in list(self.engine._streams)]
            self._send_outputs([o for o in outs if o is not None])
            return False
        return True

    def _add(self, request_id: str, serial: int, token_ids: list[int], params: SamplingParams) -> None:
        seq = Sequence(request_id, token_ids, params, self.engine.config.block_size)
        seq.serial = serial  # the frontend's numbering: its streams match outputs by (id, serial)
        try:
            self.engine.add_sequence(seq)
        except InvalidRequestError as exc:
            self._send_outputs([RequestOutput(request_id, "", [], len(token_ids), 0, True, "error", serial,
                                              error=str(exc))])


def run_engine_core(config: EngineConfig, requests: Connection, outputs: Connection,
                    embedded: EmbeddedPredictorFactory | None = None) -> int:
    """Loads the model, says CoreReady and runs the loop; 1 if loading or the loop failed (said CoreDead).
    `embedded`: the frontend's embedded predictor factory, for a core in a process of its own."""
    if embedded is not None:
        use_embedded_predictor(embedded)
    try:
        engine = LLMEngine(config, detokenize=False)
        # Served shapes vary step to step: build every kernel now, not during the first requests (~0.5 s).
        # A step's rows: its prompt tokens plus, in a mixed step, a token per running sequence.
        engine.model.warm_up(config.max_num_batched_tokens + config.max_num_seqs, config.max_num_seqs)
    except Exception as exc:
        log.exception("engine core failed to start")
        _say(outputs, CoreDead(f"engine failed to start: {exc}", isinstance(exc, (ValueError, FileNotFoundError))))
        return 1
    try:
        core_messages.send(outputs, CoreReady(engine.limits, engine.model_info(), engine.stats()))
        EngineCore(engine, requests, outputs).run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return 0  # the frontend went away first
    except Exception as exc:  # a bug or device failure no single request explains: stop, loudly
        log.exception("engine core loop failed")
        _say(outputs, CoreDead(f"engine loop failed: {exc!r}", False))
        return 1
    finally:
        engine.close()
    return 0


def _say(outputs: Connection, msg: CoreMessage) -> None:
    try:
        core_messages.send(outputs, msg)
    except (BrokenPipeError, ConnectionResetError):
        pass


def engine_core_main(config: EngineConfig, requests: Connection, outputs: Connection,
                     embedded: EmbeddedPredictorFactory | None = None) -> None:
    """The core process's entry point (spawned): Ctrl-C goes to the frontend, which stops us in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="[hintserve core] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("torchao").setLevel(logging.ERROR)  # optional CUDA kernels it cannot load on CPU
    sys.exit(run_engine_core(config, requests, outputs, embedded))
