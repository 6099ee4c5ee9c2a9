from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from loadgen.load_generator import LoadGenerator, parse_histogram_sum_count, poisson_arrivals
from loadgen.workload import WorkloadItem
from tests.loadgen.conftest import FakeApi, make_record, make_report


def _items(*specs: tuple[str, int]) -> list[WorkloadItem]:
    return [WorkloadItem(messages=[{"role": "user", "content": text}], max_tokens=n) for text, n in specs]


def _run(api: FakeApi, workload: list[WorkloadItem], rate: float, worker_name: str | None = None):
    generator = LoadGenerator("http://bench.test", transport=httpx.ASGITransport(app=api.app()))
    return asyncio.run(generator.run("continuous", workload, rate, seed=0, worker_name=worker_name))


def test_run_times_every_token_and_counts_what_the_api_reports(fake_api: FakeApi) -> None:
    report = _run(fake_api, _items(("a", 2), ("b", 3), ("c", 4)), rate=2.0, worker_name="bench-w")

    assert [len(r.token_times) for r in report.records] == [2, 3, 4]
    assert [r.finish_reason for r in report.records] == ["length"] * 3
    assert [r.error for r in report.records] == ["", "", ""]
    assert all(r.submitted_at <= r.token_times[0] <= r.token_times[-1] <= r.finished_at
               for r in report.records)
    # Each job offered no earlier than its Poisson arrival (how much later is the machine's
    # business: a busy CI host can stall the loop, so no upper bound is asserted).
    starts = [r.submitted_at - report.records[0].submitted_at for r in report.records]
    arrivals = poisson_arrivals(3, 2.0, seed=0)
    assert all(start >= at - 0.01 for start, at in zip(starts, arrivals)), (starts, arrivals)
    assert fake_api.bodies[0] == {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                                  "temperature": 0.0, "ignore_eos": True}
    assert report.preemptions == 3  # the fake counts one per submission
    assert report.worker_itl_mean_s == pytest.approx(0.02)
    # Only the named worker's seats: the stopped worker's idle ones would halve it.
    assert report.slot_utilisation == 0.5
    summary = report.summary()
    assert (summary["jobs"], summary["failed"]) == (3, 0)
    assert summary["itl_mean_worker_s"] == 0.02


def test_poisson_arrivals_are_the_seeds_exponential_gaps_from_zero() -> None:
    # Seed 0 at 2 jobs/s: 0, 0.51 and 0.52 s after the first.
    assert poisson_arrivals(3, 2.0, seed=0) == pytest.approx([0.0, 0.5098, 0.5197], abs=1e-4)
    assert poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_all_workers_count_without_a_worker_name(fake_api: FakeApi) -> None:
    report = _run(fake_api, _items(("a", 2), ("b", 2), ("c", 2)), rate=2.0)
    assert report.slot_utilisation == 0.25


@pytest.mark.parametrize(("prompt", "error"), [
    ("no-done", "stream of job job0 ended without its done event"),
    ("short", "job job0 streamed 2 tokens, not 3 (length)"),
    ("reject", '429: {"detail":"queue full"}'),
])
def test_a_job_that_did_not_do_its_work_is_failed(fake_api: FakeApi, prompt: str, error: str) -> None:
    report = _run(fake_api, _items((prompt, 3)), rate=math.inf)
    assert report.records[0].error == error
    assert report.completed == []
    assert report.summary()["failed"] == 1


def test_summary_percentiles_and_rates() -> None:
    # Two jobs submitted at t=0: TTFTs 1 and 3 s, gaps 0.1 and 0.2 s, ends at 1.3 and 3.0 s.
    records = [make_record(0.0, [1.0, 1.1, 1.3]), make_record(0.0, [3.0])]
    report = make_report("static", 2.0, records, elapsed_s=4.0, worker_itl_mean_s=0.12)
    summary = report.summary()
    assert summary["ttft_p50_p90_p99"] == [2.0, 2.8, 2.98]
    assert summary["itl_p50_p90_p99"] == [0.15, 0.19, 0.199]
    assert summary["itl_mean_client_s"] == 0.15
    assert summary["itl_mean_worker_s"] == 0.12
    assert summary["e2e_p50_p90_p99"] == [2.15, 2.83, 2.983]
    assert (summary["tokens_per_s"], summary["jobs_per_s"]) == (1.0, 0.5)
    assert report.offered_tokens_per_s == 4.0  # 2 jobs/s times 2 tokens on average


def test_summary_of_a_run_where_every_job_failed_has_nan_percentiles() -> None:
    report = make_report("sequential", math.inf, [make_record(0.0, [1.0], error="boom")])
    summary = report.summary()
    assert summary["failed"] == 1
    assert all(math.isnan(x) for x in summary["ttft_p50_p90_p99"])
    assert summary["itl_mean_client_s"] is None
    assert math.isinf(report.offered_tokens_per_s)


def test_parse_histogram_sum_count() -> None:
    text = ("# HELP carpool_inter_token_latency_seconds gaps\n"
            'carpool_inter_token_latency_seconds_bucket{le="0.05"} 3\n'
            "carpool_inter_token_latency_seconds_sum 0.125\n"
            "carpool_inter_token_latency_seconds_count 4\n"
            "carpool_e2e_latency_seconds_sum 9\n")
    assert parse_histogram_sum_count(text, "carpool_inter_token_latency_seconds") == (0.125, 4.0)
    assert parse_histogram_sum_count(text, "carpool_time_to_first_token_seconds") is None


def test_a_report_survives_its_plain_data_form() -> None:
    records = [make_record(100.0, [101.0, 101.25]), make_record(100.5, [102.0], error="boom")]
    report = make_report("static", math.inf, records, elapsed_s=4.0, worker_itl_mean_s=0.2)
    data = report.to_dict()
    assert data["rate"] == "inf"
    assert data["records"][0] == {"max_tokens": 2, "submitted_at": 0.0, "token_times": [1.0, 1.25],
                                  "finished_at": 1.25, "finish_reason": "length", "error": ""}
    again = type(report).from_dict(data)
    assert again.summary() == report.summary()
    assert again.to_dict() == data
