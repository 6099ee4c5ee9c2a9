"""PNG pictures of a benchmark run (matplotlib, no display needed)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; a server has no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.load_generator import LoadReport  # noqa: E402

MODE_COLORS = {"continuous": "#1d7874", "static": "#e76f51", "sequential": "#8d99ae"}
DPI = 100  # the PNGs live in the repository: keep them small


def _save(fig: plt.Figure, path: Path) -> None:
    """Write a PNG with a 64-colour palette: lines and text look the same at a third of the size."""
    from PIL import Image  # matplotlib depends on Pillow

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, optimize=True)


def rate_label(rate: float) -> str:
    """How an offered arrival rate reads on an axis or in a table."""
    return "all at once" if math.isinf(rate) else f"{rate:g} jobs/s"


def _ecdf(ax: plt.Axes, values: list[float], **style: object) -> None:
    """An empirical CDF as a step line from (min, 0) to (max, 1): each step is one sample."""
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(np.concatenate(([xs[0]], xs)), np.concatenate(([0.0], ys)), where="post", **style)


def plot_latency_distributions(reports: list[LoadReport], path: Path, title: str = "") -> Path:
    """Empirical CDFs of time to first token, inter-token latency and end-to-end latency.

    One row per offered arrival rate, one line per mode; a line further left is faster, and
    where it reaches 0.9 on the y axis is that mode's p90.
    """
    rates = sorted(dict.fromkeys(r.rate for r in reports))
    panels = (("time to first token", "seconds from submit to first token",
               lambda rep: [r.ttft for r in rep.completed]),
              ("inter-token latency", "milliseconds between consecutive tokens",
               lambda rep: [x * 1000 for x in rep.inter_token_latencies()]),
              ("end-to-end latency", "seconds from submit to last token",
               lambda rep: [r.e2e for r in rep.completed]))
    fig, axes = plt.subplots(len(rates), len(panels), figsize=(13, 3.1 * len(rates) + 0.9),
                             squeeze=False)
    for row, rate in zip(axes, rates):
        for ax, (name, xlabel, values_of) in zip(row, panels):
            for report in (r for r in reports if r.rate == rate):
                _ecdf(ax, values_of(report), label=report.label,
                      color=MODE_COLORS.get(report.label), linewidth=1.8)
            ax.set_title(f"{name}, arrivals {rate_label(rate)}", fontsize=10)
            ax.set_xlabel(xlabel, fontsize=9)
            ax.set_ylabel("fraction of jobs" if name != "inter-token latency"
                          else "fraction of token gaps", fontsize=9)
            ax.set_xlim(left=0)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right", title="worker mode", title_fontsize=8)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    _save(fig, path)
    return path


def plot_throughput_vs_rate(reports: list[LoadReport], path: Path, title: str = "") -> Path:
    """Delivered tokens/s and jobs/s against the offered arrival rate, one line per mode.

    Rates are evenly spaced categories ("all at once", an infinite rate, is the last one); the
    dashed line is what the clients offered, which no mode can exceed for long.
    """
    rates = sorted(dict.fromkeys(r.rate for r in reports))
    positions = {rate: i for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    metrics = (("generated tokens/s", lambda r: r.tokens_per_s, lambda r: r.offered_tokens_per_s),
               ("completed jobs/s", lambda r: r.jobs_per_s, lambda r: r.rate))
    for ax, (ylabel, delivered, offered) in zip(axes, metrics):
        finite = sorted({r.rate: offered(r) for r in reports if math.isfinite(r.rate)}.items())
        if finite:
            ax.plot([positions[rate] for rate, _ in finite], [y for _, y in finite], linestyle="--",
                    marker="x", markersize=5, color="#999999", linewidth=1,
                    label="offered by the clients")
        for label in dict.fromkeys(r.label for r in reports):
            points = sorted((positions[r.rate], delivered(r)) for r in reports if r.label == label)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                    color=MODE_COLORS.get(label), linewidth=1.8)
        ax.set_xticks(range(len(rates)), [rate_label(rate) for rate in rates])
        ax.set_xlabel("offered arrival rate (Poisson arrivals; all at once = every job at t=0)",
                      fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_title(f"throughput: {ylabel} against arrival rate", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="worker mode", title_fontsize=8)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    _save(fig, path)
    return path


def plot_slot_timelines(timelines: dict[str, list[list[str | None]]], path: Path) -> Path:
    """Which request sits in which batch seat at each step; white cells are empty seats.

    `timelines[mode][step][seat]` is a request id or None.
    """
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.2 * len(timelines) + 0.6),
                             squeeze=False)
    for ax, (mode, steps) in zip(axes[:, 0], timelines.items()):
        num_seats = max((len(s) for s in steps), default=1)
        ids = {rid: i for i, rid in enumerate(dict.fromkeys(r for s in steps for r in s if r))}
        grid = np.full((num_seats, len(steps)), np.nan)
        for t, seats in enumerate(steps):
            for seat, rid in enumerate(seats):
                if rid is not None:
                    grid[seat, t] = ids[rid] % 20
        busy = np.isfinite(grid).sum() / grid.size if grid.size else 0.0
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="tab20", vmin=0, vmax=19)
        ax.set_title(f"{mode}: {len(steps)} steps, {busy:.0%} of seat-steps occupied")
        ax.set_ylabel("seat")
        ax.set_xlabel("step")
    fig.tight_layout()
    _save(fig, path)
    return path
