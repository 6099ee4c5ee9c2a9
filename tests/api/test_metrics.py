"""GET /metrics (Prometheus text format) and /v1/stats, from what workers write to Redis."""

from __future__ import annotations

import re

import httpx
import pytest
from api_support import Harness

from api.metrics import _cumulative
from protocol.messages import HISTOGRAM_BUCKETS

pytestmark = pytest.mark.anyio

# A sample line: name, optional labels, value.
_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_]+="[^"]*"(,[a-zA-Z_]+="[^"]*")*\})? '
                     r'-?[0-9.e+Inf]+$')


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def _write_cumulative(harness: Harness, name: str, values: list[float]) -> None:
    """The hash as worker/stream_publisher.py keeps it: cumulative, zero buckets skipped."""
    key = harness.keys.histogram(name)
    for bound in HISTOGRAM_BUCKETS:
        count = sum(1 for v in values if v <= bound)
        if count:
            harness.sync.hset(key, str(bound), count)
    harness.sync.hset(key, mapping={"+Inf": len(values), "count": len(values), "sum": sum(values)})


async def test_metrics_text_format(harness: Harness, client: httpx.AsyncClient) -> None:
    await client.post("/v1/jobs", json={"prompt": "hello", "priority": "high"})
    await client.post("/v1/jobs", json={"prompt": "hello", "priority": "low"})
    await client.post("/v1/jobs", json={"prompt": "hello", "priority": "low"})
    harness.add_worker("w1", num_running=3, num_waiting=1, num_kv_blocks_used=40,
                       num_kv_blocks_total=100, slot_utilisation=0.75, max_num_seqs=4)
    harness.add_worker("w2", num_running=1, max_num_seqs=4, slot_utilisation=0.25,
                       suspended=True)
    harness.sync.hset(harness.keys.counters(), mapping={
        "generated_tokens_total": 1234, "jobs_preempted_total": 5})
    _write_cumulative(harness, "time_to_first_token_seconds", [0.02, 0.3, 0.3, 200.0])

    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.text
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or _SAMPLE.match(line), line
    samples = _samples(text)
    assert samples['carpool_queue_depth{priority="high"}'] == 1
    assert samples['carpool_queue_depth{priority="normal"}'] == 0
    assert samples['carpool_queue_depth{priority="low"}'] == 2
    assert samples['carpool_jobs{status="queued"}'] == 3
    assert samples['carpool_jobs{status="running"}'] == 0
    assert samples["carpool_workers"] == 2
    assert samples['carpool_running_sequences{worker="w1",model="tiny"}'] == 3
    assert samples['carpool_waiting_sequences{worker="w1",model="tiny"}'] == 1
    assert samples['carpool_slot_utilisation{worker="w2",model="tiny"}'] == 0.25
    assert samples['carpool_kv_blocks_used{worker="w1",model="tiny"}'] == 40
    assert samples['carpool_kv_blocks_total{worker="w1",model="tiny"}'] == 100
    assert samples['carpool_worker_suspended{worker="w1",model="tiny"}'] == 0
    assert samples['carpool_worker_suspended{worker="w2",model="tiny"}'] == 1
    assert samples["carpool_generated_tokens_total"] == 1234
    assert samples["carpool_jobs_preempted_total"] == 5
    assert samples["carpool_prompt_tokens_total"] == 0  # present before any worker counted
    assert "# TYPE carpool_generated_tokens_total counter" in text
    assert "# TYPE carpool_time_to_first_token_seconds histogram" in text
    ttft = "carpool_time_to_first_token_seconds"
    assert samples[f'{ttft}_bucket{{le="0.01"}}'] == 0
    assert samples[f'{ttft}_bucket{{le="0.025"}}'] == 1
    assert samples[f'{ttft}_bucket{{le="0.5"}}'] == 3
    assert samples[f'{ttft}_bucket{{le="120.0"}}'] == 3
    assert samples[f'{ttft}_bucket{{le="+Inf"}}'] == 4
    assert samples[f"{ttft}_count"] == 4
    assert samples[f"{ttft}_sum"] == pytest.approx(200.62)
    # Histograms nobody observed yet are still there, empty.
    assert samples['carpool_e2e_latency_seconds_bucket{le="+Inf"}'] == 0
    assert samples["carpool_inter_token_latency_seconds_count"] == 0


def test_cumulative_and_per_bucket_histograms_render_the_same() -> None:
    values = [0.003, 0.02, 0.3, 0.3, 7.0, 500.0]
    cumulative = {str(b): str(sum(1 for v in values if v <= b)) for b in HISTOGRAM_BUCKETS}
    cumulative.update({"+Inf": "6", "count": "6", "sum": str(sum(values))})
    per_bucket = {}
    previous = 0
    for bound in HISTOGRAM_BUCKETS:
        count = int(cumulative[str(bound)])
        per_bucket[str(bound)] = str(count - previous)
        previous = count
    per_bucket.update({"+Inf": "1", "count": "6", "sum": str(sum(values))})
    assert _cumulative(cumulative) == _cumulative(per_bucket)
    buckets, total, count = _cumulative(cumulative)
    assert buckets[0] == (0.005, 1.0) and buckets[-1][1] == 6.0 and count == 6.0


async def test_stats_json(harness: Harness, client: httpx.AsyncClient) -> None:
    harness.add_worker("w1", num_running=2, max_num_seqs=8)
    harness.sync.hset(harness.keys.counters(), mapping={"jobs_preempted_total": 3})
    stats = (await client.get("/v1/stats")).json()
    assert stats["preemptions"] == 3
    assert stats["jobs_preempted_total"] == 3
    assert stats["queue_depth"] == {"high": 0, "normal": 0, "low": 0, "batch": 0}
    assert [(w["name"], w["num_running"], w["max_num_seqs"]) for w in stats["workers"]] == [
        ("w1", 2, 8)]


async def test_vllm_metric_names_beside_carpools(harness: Harness, client: httpx.AsyncClient) -> None:
    harness.add_worker("w1", num_running=3, num_waiting=1, num_kv_blocks_used=40,
                       num_kv_blocks_total=100)
    harness.add_worker("w2", num_running=1, num_waiting=2, num_kv_blocks_used=10,
                       num_kv_blocks_total=100)
    harness.sync.hset(harness.keys.counters(), mapping={
        "prefix_cache_queries_total": 300, "prefix_cache_hits_total": 120,
        "requests_finished_stop_total": 7, "requests_finished_abort_total": 2,
        "generated_tokens_total": 99})
    _write_cumulative(harness, "e2e_latency_seconds", [0.02, 0.3])

    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or _SAMPLE.match(line), line
    samples = _samples(text)
    model = '{model_name="tiny"}'
    assert samples[f"vllm:num_requests_running{model}"] == 4
    assert samples[f"vllm:num_requests_waiting{model}"] == 3
    assert samples[f"vllm:kv_cache_usage_perc{model}"] == 0.25
    assert samples[f"vllm:prefix_cache_queries_total{model}"] == 300
    assert samples[f"vllm:prefix_cache_hits_total{model}"] == 120
    assert samples[f"vllm:generation_tokens_total{model}"] == 99
    assert samples['vllm:request_success_total{model_name="tiny",finished_reason="stop"}'] == 7
    assert samples['vllm:request_success_total{model_name="tiny",finished_reason="abort"}'] == 2
    assert samples['vllm:request_success_total{model_name="tiny",finished_reason="length"}'] == 0
    assert samples['vllm:e2e_request_latency_seconds_bucket{model_name="tiny",le="0.025"}'] == 1
    assert samples['vllm:e2e_request_latency_seconds_bucket{model_name="tiny",le="+Inf"}'] == 2
    assert samples[f"vllm:e2e_request_latency_seconds_count{model}"] == 2
    assert samples[f"vllm:time_to_first_token_seconds_count{model}"] == 0
    assert samples[f"vllm:inter_token_latency_seconds_count{model}"] == 0
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert samples["carpool_prefix_cache_hits_total"] == 120  # Carpool's own name stays
