"""The benchmarks' pictures (matplotlib, written as PNG into the results folder), from what their
callers pass in: this module imports nothing of the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"envoy_only": "tab:red", "sidecar": "tab:blue"}
LABELS = {"envoy_only": "Envoy alone", "sidecar": "Envoy + sidecar"}


def save(fig, path: Path) -> Path:
    """Lay the figure out, write it as PNG, free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdf(out: Path, results: dict[str, dict], classes: Sequence[str], slo_p99_s: float) -> Path:
    """Per class, the share of requests answered within a latency; `slo_p99_s` drawn as a line."""
    fig, axes = plt.subplots(1, len(classes), figsize=(14, 4), sharey=True)
    for ax, name in zip(axes, classes, strict=True):
        for setup, result in results.items():
            latencies = result["latencies_s"][name]
            requests = result["classes"][name]["requests"] or 1
            if latencies:
                ys = [(i + 1) / requests for i in range(len(latencies))]  # failed requests never reach 1.0
                ax.step(latencies, ys, where="post", color=COLORS[setup], label=LABELS[setup])
        ax.axvline(slo_p99_s, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("latency, s (unscaled; failures never arrive)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests answered within")
    axes[0].legend(loc="lower right")
    return save(fig, out / "latency_cdf.png")


def queue_kv_over_time(out: Path, results: dict[str, dict]) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    sidecar = results.get("sidecar", {}).get("series", [])
    if sidecar:
        t = [p["t"] for p in sidecar]
        top.plot(t, [p.get("queue_depth", 0) for p in sidecar], color="tab:blue", label="queue depth (sidecar)")
        top.plot(t, [p.get("inflight", 0) for p in sidecar], color="tab:green", label="in flight (sidecar)")
        tier_ax = top.twinx()
        tier_ax.step(t, [p.get("tier", 0) for p in sidecar], where="post", color="tab:orange", alpha=0.6, label="tier")
        tier_ax.set_ylim(-0.2, 3.5)
        tier_ax.set_yticks([0, 1, 2, 3], ["green", "yellow", "orange", "red"])
        top.legend(loc="upper left")
    top.set_ylabel("requests")
    for setup, result in results.items():
        series = result.get("series", [])
        bottom.plot([p["t"] for p in series], [p["kv_usage"] for p in series], color=COLORS[setup], label=LABELS[setup])
    bottom.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    bottom.set_ylabel("KV cache usage (busiest backend)")
    bottom.set_xlabel("time, s (unscaled)")
    bottom.legend(loc="upper left")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return save(fig, out / "queue_kv_over_time.png")


def availability_over_time(out: Path, results: dict[str, dict], classes: Sequence[str]) -> Path:
    fig, (ax, by_class) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for setup, result in results.items():
        points = sorted((float(t), v) for t, v in result["availability_over_time"].items())
        ax.plot([p[0] for p in points], [p[1] for p in points], color=COLORS[setup], marker="o", markersize=3,
                label=LABELS[setup])
        retries = sorted((float(t), n) for t, n in result["retries_over_time"].items())
        if retries:
            twin = ax.twinx() if setup == "envoy_only" else None
            if twin is not None:
                twin.bar([r[0] for r in retries], [r[1] for r in retries], width=4, color=COLORS[setup], alpha=0.15)
                twin.set_ylabel("retries per 5 s (Envoy alone, bars)")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("requests answered (by arrival, 5 s buckets)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    styles = dict(zip(classes, ("-", "--", ":"), strict=False))
    for setup, result in results.items():
        for name, over_time in (result.get("in_time_over_time_by_class") or {}).items():
            points = sorted((float(t), v) for t, v in over_time.items())
            by_class.plot([p[0] for p in points], [p[1] for p in points], color=COLORS[setup],
                          linestyle=styles.get(name, "-"), label=f"{LABELS[setup]}: {name}")
    by_class.set_ylim(0, 1.05)
    by_class.set_ylabel("answered within the class's deadline")
    by_class.set_xlabel("time the request was first sent, s (unscaled)")
    by_class.grid(alpha=0.3)
    by_class.legend(loc="lower left", fontsize=7, ncol=2)
    return save(fig, out / "availability_over_time.png")


def appointments_over_time(out: Path, results: dict[str, dict]) -> Path | None:
    """Appointments given per second against the requests the pool releases per second: the
    clients told to come back never outnumber what the pool drains."""
    series = results.get("sidecar", {}).get("series") or []
    points = [p for p in series if "released" in p and "appointments_given" in p]
    if len(points) < 2:
        return None
    fig, ax = plt.subplots(figsize=(11, 3.5))

    def per_second(key: str) -> tuple[list[float], list[float]]:
        times, rates = [], []
        for a, b in zip(points, points[1:], strict=False):
            if b["t"] > a["t"]:
                times.append(b["t"])
                rates.append((b[key] - a[key]) / (b["t"] - a["t"]))
        return times, rates

    for key, label, style in (("released", "released by the pool", "-"), ("appointments_given", "appointments given", "-"),
                              ("appointments_past_deadline", "final answers (no appointment within the deadline)", ":")):
        times, rates = per_second(key)
        ax.plot(times, rates, linestyle=style, label=label)
    ax.set_ylabel("per second (unscaled)")
    ax.set_xlabel("time, s (unscaled)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return save(fig, out / "appointments_over_time.png")


def scenario_plots(out: Path, results: dict[str, dict], classes: Sequence[str], slo_p99_s: float) -> list[Path]:
    """The burst scenario's plots, from its setups' results (with their raw series)."""
    plots = [latency_cdf(out, results, classes, slo_p99_s), queue_kv_over_time(out, results),
             availability_over_time(out, results, classes), appointments_over_time(out, results)]
    return [plot for plot in plots if plot is not None]


def throughput_against_workers(out: Path, points: dict[int, float]) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ns = sorted(points)
    ax.plot(ns, [points[n] for n in ns], marker="o")
    ax.set_xticks(ns)
    ax.set_xlabel("workers (serve --workers N, Redis queue)")
    ax.set_ylabel("requests / s")
    ax.grid(alpha=0.3)
    return save(fig, out / "throughput_workers.png")


def matrix_cell_plot(out: Path, cell: str, results: dict[str, dict], slo_s: float) -> Path:
    """One cell of the matrix: each loan's latency by when it was sent (failures along the top),
    both setups; below, the sidecar's concurrency cap for latency-bound classes (the latency
    limiter's trajectory) and its requests in flight."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    ceiling = max([latency for result in results.values() for _, latency in result.get("loans_over_time", [])
                   if latency is not None] + [slo_s * 2])
    for setup, result in results.items():
        loans = result.get("loans_over_time", [])
        answered = [(t, latency) for t, latency in loans if latency is not None]
        failed = [t for t, latency in loans if latency is None]
        top.scatter([p[0] for p in answered], [p[1] for p in answered], s=8, color=COLORS[setup], alpha=0.6,
                    label=LABELS[setup])
        if failed:
            top.scatter(failed, [ceiling * 1.1] * len(failed), s=14, marker="x", color=COLORS[setup],
                        label=f"{LABELS[setup]}: failed")
    top.axhline(slo_s, color="grey", linestyle=":", linewidth=1)
    top.set_yscale("log")
    top.set_ylabel("loan latency, s (unscaled)")
    top.set_title(cell)
    top.legend(loc="upper left", fontsize=8)
    series = results.get("sidecar", {}).get("series", [])
    if series:
        t = [p["t"] for p in series]
        # -1: no cap (no latency-bound request seen yet, or the target holds at the pool's size)
        cap = [p["latency_limit"] if p.get("latency_limit", -1) >= 0 else float("nan") for p in series]
        bottom.step(t, cap, where="post", color="tab:purple", label="latency cap (extproc_latency_limit)")
        bottom.plot(t, [p.get("inflight", 0) for p in series], color="tab:green", alpha=0.7, label="in flight")
        bottom.plot(t, [p.get("queue_depth", 0) for p in series], color="tab:blue", alpha=0.5, label="waiting")
        bottom.legend(loc="upper left", fontsize=8)
    bottom.set_ylabel("requests (sidecar)")
    bottom.set_xlabel("time, s (unscaled)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return save(fig, out / f"{cell}.png")
