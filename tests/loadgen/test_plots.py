from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402

from loadgen.plots import plot_latency_distributions, plot_throughput_vs_rate, rate_label  # noqa: E402
from tests.loadgen.conftest import make_record, make_report  # noqa: E402

RATES = (0.5, 2.0, math.inf)


def _reports() -> list:
    reports = []
    for mode, speed in (("continuous", 1.0), ("static", 2.0), ("sequential", 4.0)):
        for rate in RATES:
            records = [make_record(0.0, [speed * (1 + i) + 0.05 * k for k in range(5)]) for i in range(4)]
            reports.append(make_report(mode, rate, records, elapsed_s=10 * speed))
    return reports


def test_rate_label() -> None:
    assert [rate_label(r) for r in RATES] == ["0.5 jobs/s", "2 jobs/s", "all at once"]


@pytest.mark.parametrize("plot", [plot_latency_distributions, plot_throughput_vs_rate])
def test_plots_every_rate_including_all_at_once_as_a_small_png(tmp_path: Path, plot) -> None:
    path = plot(_reports(), tmp_path / "plot.png", title="tiny: 4 jobs")
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.mode == "P"  # palette: a small file for the repository
        width, height = image.size
    assert width == 1300 if plot is plot_latency_distributions else 1200
    # One row of panels per rate for the latency picture.
    assert height == (1020 if plot is plot_latency_distributions else 440)
    assert path.stat().st_size < 150_000


def test_a_run_where_every_job_failed_still_plots(tmp_path: Path) -> None:
    failed = make_report("static", 1.0, [make_record(0.0, [1.0], error="boom")])
    ok = make_report("continuous", 1.0, [make_record(0.0, [0.5, 0.6])])
    assert plot_latency_distributions([failed, ok], tmp_path / "a.png").is_file()
    assert plot_throughput_vs_rate([failed, ok], tmp_path / "b.png").is_file()
