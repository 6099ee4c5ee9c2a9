from __future__ import annotations

import math

import pytest

from launcher.bench_run import BenchConfig, _jsonable, format_markdown, format_table, parse_mode_rates, parse_rates
from launcher.cli import main

ROW = {"label": "continuous", "rate": math.inf, "jobs": 32, "failed": 0, "elapsed_s": 8.0,
       "tokens_per_s": 168.04, "jobs_per_s": 4.0, "ttft_p50_p90_p99": [0.5, 1.25, 2.0],
       "itl_p50_p90_p99": [0.0421, 0.08, 0.1234], "itl_mean_client_s": 0.05,
       "itl_mean_worker_s": 0.045, "e2e_p50_p90_p99": [3.0, 6.5, 7.75],
       "slot_utilisation": 0.412, "preemptions": 2}


def test_parse_rates() -> None:
    assert parse_rates("0.5, 1,2,inf") == (0.5, 1.0, 2.0, math.inf)
    assert parse_rates("all") == (math.inf,)
    for bad in ("", "0", "-1", "nan", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_parse_mode_rates_and_rates_for() -> None:
    mode_rates = parse_mode_rates(["sequential=1,inf", "static=2"])
    assert mode_rates == {"sequential": (1.0, math.inf), "static": (2.0,)}
    config = BenchConfig(rates=(0.5, 4.0), mode_rates=mode_rates)
    assert config.rates_for("continuous") == (0.5, 4.0)
    assert config.rates_for("sequential") == (1.0, math.inf)
    for bad in (["sequential"], ["turbo=1"]):
        with pytest.raises(ValueError):
            parse_mode_rates(bad)


def test_markdown_row() -> None:
    assert format_markdown([ROW]).splitlines()[2] == (
        "| continuous | all at once | 168.0 | 4.00 | 0.50 / 1.25 / 2.00 | 42 / 80 / 123 "
        "| 3.00 / 6.50 / 7.75 | 41% | 2 |")
    failed = format_markdown([{**ROW, "rate": 2.0, "failed": 3}]).splitlines()[2]
    assert failed.startswith("| continuous (3 of 32 failed) | 2 jobs/s |")


def test_text_table_row() -> None:
    line = format_table([ROW]).splitlines()[2]
    assert line.split() == ["continuous", "all", "32", "168.04", "4.0", "0.50/1.25/2.00",
                            "42/80/123", "3.00/6.50/7.75", "41%", "2", "50.0/45.0"]


def test_json_rows_spell_the_infinite_rate() -> None:
    assert _jsonable(ROW)["rate"] == "inf"
    assert _jsonable({**ROW, "rate": 0.5})["rate"] == 0.5


@pytest.mark.parametrize("argv", [
    ["bench", "--modes", "continuous,turbo"],
    ["bench", "--rates", "0"],
    ["bench", "--mode-rates", "sequential"],
])
def test_bench_refuses_bad_options_before_starting_anything(argv: list[str]) -> None:
    assert main(argv) == 2


def test_replot_redraws_an_earlier_run_from_its_records(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from launcher.bench_run import _write_outputs, replot
    from tests.loadgen.conftest import make_record, make_report

    reports = [make_report(mode, rate, [make_record(0.0, [0.5, 0.6, 0.8])])
               for mode in ("continuous", "static") for rate in (1.0, math.inf)]
    config = BenchConfig(model="tiny", num_requests=1, max_output=3, out_dir=tmp_path,
                         command="carpool bench --model tiny")
    _write_outputs(reports, config, wall_s=12.0)
    first = (tmp_path / "bench.json").read_text()
    (tmp_path / "latency_cdf.png").unlink()

    again = replot(tmp_path)

    assert [r.summary() for r in again] == [r.summary() for r in reports]
    assert (tmp_path / "bench.json").read_text() == first
    assert (tmp_path / "latency_cdf.png").is_file()
    assert main(["bench", "--replot", "--out-dir", str(tmp_path)]) == 0
    assert main(["bench", "--replot", "--out-dir", str(tmp_path / "missing")]) == 2
