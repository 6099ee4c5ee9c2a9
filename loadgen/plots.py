"""PNG pictures of a benchmark run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; a server has no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.load_generator import LoadReport  # noqa: E402

MODE_COLORS = {"continuous": "#1d7874", "static": "#e76f51", "sequential": "#8d99ae"}


def plot_latency_distributions(reports: list[LoadReport], path: Path) -> Path:
    """Empirical CDFs of time to first token and end-to-end latency, one line per mode."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for report in reports:
        done = report.completed
        color = MODE_COLORS.get(report.label)
        for ax, values in zip(axes, ([r.ttft for r in done], [r.e2e for r in done])):
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=report.label, color=color)
    for ax, title in zip(axes, ("time to first token", "end-to-end latency")):
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of jobs")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput_vs_rate(reports: list[LoadReport], path: Path) -> Path:
    """Delivered tokens/s against offered arrival rate, one line per mode."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label in dict.fromkeys(r.label for r in reports):
        points = sorted((r.rate, r.tokens_per_s) for r in reports if r.label == label)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                color=MODE_COLORS.get(label))
    ax.set_xlabel("arrival rate (jobs/s)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("throughput against arrival rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
