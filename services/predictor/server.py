"""The predictor's gRPC API: Search, Observe, Snapshot, Restore, Stats, Health (protos/predictor.proto).

Runs on the service's event loop, next to the stream loop, so both see one hub without locks. Errors map
to clear status codes: INVALID_ARGUMENT (wrong shapes, bad names), NOT_FOUND (unknown model or snapshot),
RESOURCE_EXHAUSTED (too many models / live requests), FAILED_PRECONDITION (no snapshot directory),
DEADLINE_EXCEEDED (the caller's deadline passed while we worked).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import contextmanager

import grpc

from services.common.messages import InvalidInput
from services.common.protos import predictor_pb2 as pb
from services.common.protos import predictor_pb2_grpc as pb_grpc
from services.predictor.hub import CapacityExceeded, UnknownModel
from services.predictor.service import PredictorService
from services.predictor.snapshots import file_name

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownModel, grpc.StatusCode.NOT_FOUND),
    (FileNotFoundError, grpc.StatusCode.NOT_FOUND),
    (CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def _status():
    """Turns our exceptions into (code, message); aborting happens outside (abort() must be awaited)."""
    try:
        yield
    except _Abort:
        raise
    except tuple(c for c, _ in _CODES) as exc:
        code = next(code for cls, code in _CODES if isinstance(exc, cls))
        raise _Abort(code, str(exc)) from exc


def _check_deadline(context: grpc.aio.ServicerContext) -> None:
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the answer was ready")


class PredictorServicer(pb_grpc.PredictorServicer):
    def __init__(self, service: PredictorService) -> None:
        self.service = service
        self.hub = service.hub

    async def _run(self, context: grpc.aio.ServicerContext, fn):
        try:
            with _status():
                return await fn()
        except _Abort as exc:
            await context.abort(exc.code, str(exc))

    async def Search(self, request: pb.SearchRequest, context: grpc.aio.ServicerContext) -> pb.SearchResponse:
        async def go() -> pb.SearchResponse:
            if not request.HasField("shape") or not request.HasField("context"):
                raise InvalidInput("SearchRequest needs shape and context")
            _check_deadline(context)
            start = time.perf_counter()
            hints = self.hub.search(request)
            elapsed = time.perf_counter() - start
            self.service.metrics.search_seconds.labels("grpc").observe(elapsed)
            _check_deadline(context)
            return pb.SearchResponse(hints=hints, latency_us=elapsed * 1e6)

        return await self._run(context, go)

    async def Observe(
        self, request_iterator: AsyncIterator[pb.ContextBatch], context: grpc.aio.ServicerContext
    ) -> pb.ObserveResponse:
        async def go() -> pb.ObserveResponse:
            batches = contexts = 0
            async for batch in request_iterator:
                try:
                    self.hub.handle(batch, predict=False, strict=True)
                except (InvalidInput, CapacityExceeded) as exc:
                    code = (
                        grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, InvalidInput)
                        else grpc.StatusCode.RESOURCE_EXHAUSTED
                    )
                    raise _Abort(code, f"batch {batches}: {exc}") from exc
                batches += 1
                contexts += len(batch.contexts)
            return pb.ObserveResponse(batches=batches, contexts=contexts)

        return await self._run(context, go)

    def _snapshotter(self):
        if self.service.snapshotter is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "this service runs without --snapshot-dir")
        return self.service.snapshotter

    async def Snapshot(self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext) -> pb.SnapshotResponse:
        async def go() -> pb.SnapshotResponse:
            self._snapshotter()
            if request.model and request.model not in self.hub.models:
                raise UnknownModel(f"model {request.model!r} not seen yet (known: {sorted(self.hub.models)})")
            saved = await self.service.snapshot([request.model] if request.model else None)
            return pb.SnapshotResponse(files=[n for n, _ in saved], bytes=sum(b for _, b in saved))

        return await self._run(context, go)

    async def Restore(self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext) -> pb.RestoreResponse:
        async def go() -> pb.RestoreResponse:
            snapshotter = self._snapshotter()
            if not request.file and not request.model:
                raise InvalidInput("RestoreRequest needs model or file")
            name = request.file or file_name(request.model)
            shape = snapshotter.restore(name)
            if request.model and shape.model != request.model:
                raise InvalidInput(f"snapshot {name!r} holds model {shape.model!r}, not {request.model!r}")
            return pb.RestoreResponse(file=name, shape=shape.to_pb())

        return await self._run(context, go)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        models = [s.shape.to_pb() for s in self.hub.models.values()]
        return pb.StatsResponse(counters=self.service.stats(), models=models)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        connected = self.service.connected
        message = f"broker {self.service.broker.url} {'connected' if connected else 'unreachable'}"
        return pb.HealthResponse(
            status=pb.HealthResponse.SERVING, message=message, broker_connected=connected
        )


async def serve_predictor(service: PredictorService, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Starts the gRPC server on the running loop; returns it and the bound port (0 picks a free one)."""
    server = grpc.aio.server()
    pb_grpc.add_PredictorServicer_to_server(PredictorServicer(service), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the predictor gRPC server to {host}:{port}")
    await server.start()
    return server, bound
