"""The metric names vLLM's dashboards and autoscalers read, from the same FleetSnapshot as
Carpool's own (api/metrics.py renders both on /metrics).

Gauges come per model from the workers' live stats. Counters and histograms are fleet-wide in
Redis (workers do not split them by model): they carry the served model's name when the fleet
serves one model, the usual case, and model_name="all" otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from api.fleet import FleetSnapshot
from protocol.messages import FINISHED_COUNTER_PREFIX, WorkerStats

# vLLM name -> (Carpool histogram, help)
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("time_to_first_token_seconds",
                                         "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("inter_token_latency_seconds",
                                         "Histogram of inter-token latency in seconds."),
    "vllm:e2e_request_latency_seconds": ("e2e_latency_seconds",
                                         "Histogram of e2e request latency in seconds."),
}
# vLLM name (rendered with _total) -> (Carpool counter field, help)
_COUNTERS = {
    "vllm:prefix_cache_queries": ("prefix_cache_queries_total",
                                  "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("prefix_cache_hits_total",
                               "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:prompt_tokens": ("prompt_tokens_total", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generated_tokens_total", "Number of generation tokens processed."),
    "vllm:num_preemptions": ("jobs_preempted_total", "Cumulative number of preemptions."),
}
# Every finish reason a dashboard may select, shown at 0 before the first.
_FINISH_REASONS = ("stop", "length", "abort", "error")


def render_vllm(snapshot: FleetSnapshot, served_models: list[str],
                sample: Callable[[str, float, dict[str, str] | None], None],
                family: Callable[[str, str, str], None],
                cumulative: Callable[[dict[str, str]], tuple[list[tuple[float, float]], float, float]],
                ) -> None:
    """Append vLLM's metrics through the exposition's `family`/`sample` (api/metrics.py)."""
    by_model: dict[str, list[WorkerStats]] = {name: [] for name in served_models}
    for worker in snapshot.workers:
        by_model.setdefault(worker.model, []).append(worker)
    fleet_model = next(iter(by_model)) if len(by_model) == 1 else "all"

    gauges = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         lambda ws: float(sum(w.num_running for w in ws))),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         lambda ws: float(sum(w.num_waiting for w in ws))),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         _kv_usage),
    )
    for name, help_text, value in gauges:
        family(name, "gauge", help_text)
        for model, workers in by_model.items():
            sample(name, value(workers), {"model_name": model})

    labels = {"model_name": fleet_model}
    for name, (field, help_text) in _COUNTERS.items():
        family(name + "_total", "counter", help_text)
        sample(name + "_total", snapshot.counters.get(field, 0.0), labels)
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
    for reason in _FINISH_REASONS:
        count = snapshot.counters.get(f"{FINISHED_COUNTER_PREFIX}{reason}_total", 0.0)
        sample("vllm:request_success_total", count, {**labels, "finished_reason": reason})

    for name, (source, help_text) in _HISTOGRAMS.items():
        family(name, "histogram", help_text)
        buckets, total, count = cumulative(snapshot.histograms.get(source, {}))
        for bound, running in buckets:
            le = "+Inf" if math.isinf(bound) else repr(float(bound))
            sample(name + "_bucket", running, {**labels, "le": le})
        sample(name + "_sum", total, labels)
        sample(name + "_count", count, labels)


def _kv_usage(workers: list[WorkerStats]) -> float:
    total = sum(w.num_kv_blocks_total for w in workers)
    return sum(w.num_kv_blocks_used for w in workers) / total if total else 0.0
