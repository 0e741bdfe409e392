"""vLLM's request-latency histograms for the simulated engine, with vLLM's names, labels and buckets
(vllm/v1/metrics/loggers.py); the engine's gauges are `SimEngine.collect` (sim_engine.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineHistograms:
    """vLLM's request-latency histograms, in the engine's unscaled seconds."""

    def __init__(self, registry: CollectorRegistry, model: str):
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name", "engine"], registry=registry, buckets=buckets).labels(model, "0")

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        rejections = Counter("vllm:admission_rejections", "Requests the engine refused at admission, by reason.",
                             ["model_name", "reason"], registry=registry)
        self.rejected_requests = rejections.labels(model, "max_num_queued_reqs")
        self.rejected_tokens = rejections.labels(model, "max_num_queued_tokens")  # the sim sets no token limit
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name", "engine"], registry=registry).labels(model, "0")

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "engine", "finished_reason"], registry=registry)
        self.finished_length = success.labels(model, "0", "length")  # the sim's answers all run to max_tokens
        self.finished_abort = success.labels(model, "0", "abort")  # the client went away
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   ["model_name", "engine"], registry=registry).labels(model, "0")
