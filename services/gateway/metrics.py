"""The gateway's request-level Prometheus series (`hintserve_*`, with the semantics of vLLM's `vllm:*`).

Each gateway owns a registry (several gateways can live in one test process). Label children are bound
once per model name so the per-token path is a dict lookup and an observe().
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets, extended downwards: a small model on a fast link answers in a few milliseconds.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05) + _REQUEST_BUCKETS[2:]


class ModelMetrics:
    """The series of one served model name, label children bound."""

    def __init__(self, m: GatewayMetrics, model_name: str) -> None:
        self.ttft = m.time_to_first_token.labels(model_name)
        self.itl = m.inter_token_latency.labels(model_name)
        self.tpot = m.time_per_output_token.labels(model_name)
        self.e2e = m.e2e_request_latency.labels(model_name)
        self.queue = m.request_queue_time.labels(model_name)
        self.running = m.num_requests_running.labels(model_name)
        self.waiting = m.num_requests_waiting.labels(model_name)
        self.prompt_tokens = m.prompt_tokens.labels(model_name)
        self.generation_tokens = m.generation_tokens.labels(model_name)
        self._success = m.request_success
        self._cuts = m.stream_cuts
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()

    def stream_cut(self, reason: str) -> None:
        self._cuts.labels(self._model_name, reason).inc()


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, model = self.registry, ["model_name"]
        self.time_to_first_token = Histogram(
            "hintserve_time_to_first_token_seconds",
            "Time from the request's arrival at the gateway to its first generated token.",
            model,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "hintserve_inter_token_latency_seconds",
            "Time between consecutive streamed outputs of a request.",
            model,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "hintserve_request_time_per_output_token_seconds",
            "Per request: decode time (first to last token) divided by output tokens after the first.",
            model,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "hintserve_e2e_request_latency_seconds",
            "Time from arrival at the gateway to the request's last token.",
            model,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "hintserve_request_queue_time_seconds",
            "Time from arrival to submission to an engine (admission queue and batch window).",
            model,
            buckets=_QUEUE_BUCKETS,
            registry=r,
        )
        self.num_requests_running = Gauge(
            "hintserve_num_requests_running",
            "Requests submitted to an engine and not finished.",
            model,
            registry=r,
        )
        self.num_requests_waiting = Gauge(
            "hintserve_num_requests_waiting",
            "Requests waiting in the gateway (admission queue, batch window).",
            model,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "hintserve_prompt_tokens", "Prompt tokens of requests an engine processed.", model, registry=r
        )
        self.generation_tokens = Counter(
            "hintserve_generation_tokens", "Generated tokens streamed to clients.", model, registry=r
        )
        self.request_success = Counter(
            "hintserve_request_success",
            "Finished engine requests by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.stream_cuts = Counter(
            "hintserve_stream_cuts",
            "Engine requests the gateway cut: reason idle_timeout (engine silent past --stream-idle-timeout-s) "
            "or engine_unhealthy (its engine turned unhealthy).",
            ["model_name", "reason"],
            registry=r,
        )
        self.http_requests = Counter(
            "hintserve_http_requests",
            "HTTP requests by handler, method and status code.",
            ["handler", "method", "status"],
            registry=r,
        )
        self._models: dict[str, ModelMetrics] = {}

    def model(self, model_name: str) -> ModelMetrics:
        bound = self._models.get(model_name)
        if bound is None:
            bound = self._models[model_name] = ModelMetrics(self, model_name)
        return bound

    def http_request(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()
