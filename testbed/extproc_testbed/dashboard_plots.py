"""Pictures of the main Grafana panels from a real run (docs/img/dashboard-*.png).

Envoy, the sidecar and simulated vLLM run on loopback (`Stack`); Debian's `prometheus` scrapes
them every second with the shipped alert rules loaded; three bursts of mixed tickets make the
primary pool's line form and drain; then each panel's own queries, read from
deploy/grafana/dashboards/extproc.json, are asked of Prometheus and drawn with matplotlib.

    python -m extproc_testbed.dashboard_plots [OUT_DIR]    # from a checkout; default docs/img
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import aiohttp
import yaml

from .plots import plt, save  # matplotlib without a screen
from .stack import LOOPBACK, ManagedProcess, SimSpec, Stack, StackPorts, find_program, free_port, http_get, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "extproc.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
# (file name, panel title, the panel's queries to draw: None for all)
PANELS = (
    ("queue-depth", "Queue depth by pool and class", None),
    ("inflight", "In flight against the limits", None),
    ("queue-wait-p99", "Queue wait p50 / p99 by pool and class", {"B"}),
    ("outcomes", "Admissions and refusals by outcome", None),
    ("kv-usage", "KV-cache usage by backend", None),
)
# What Grafana fills in: every pool and class, and a rate window of five scrapes.
VARIABLES = {"$__rate_interval": "5s", "$pool": ".*", "$class": ".*"}
TICKETS = ("loan_approval", "complaint", "archive_query")


def sidecar_config(ports: StackPorts) -> dict:
    def backends(pool: str) -> list[str]:
        return [f"http://{LOOPBACK}:{p}" for p in ports.pool_ports(pool)]

    return {
        "classes": {
            "loan_approval": {"base": 0, "max_wait_s": 30, "protected": True, "latency_target_s": 2},
            "complaint": {"base": 1, "max_wait_s": 20},
            "archive_query": {"base": 2, "max_wait_s": 6, "degradable": True},
        },
        "default_class": "archive_query",
        "anonymous": {"ticket_types": "*"},
        "pools": {
            "primary": {"cluster": "vllm_primary", "max_inflight": 8, "fallback": "fallback",
                        "tiers": {"yellow": 10, "orange": 25, "red": 45, "hard_max": 100},
                        "capacity": {"backends": backends("primary")}},
            "fallback": {"cluster": "vllm_fallback", "max_inflight": 4, "models": {"deepseek-sim": "deepseek-sim-small"},
                         "tiers": {"yellow": 10, "orange": 25, "red": 45, "hard_max": 100},
                         "capacity": {"backends": backends("fallback")}},
        },
        "default_pool": "primary",
        "probes": {"interval_s": 0.5, "stale_after_s": 3, "timeout_s": 0.5, "nvml": "off"},
    }


def prometheus_config(ports: StackPorts) -> dict:
    sims = [f"{LOOPBACK}:{p}" for p in ports.primary + ports.fallback]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "extproc", "static_configs": [{"targets": [f"{LOOPBACK}:{ports.metrics}"]}]},
            {"job_name": "vllm", "static_configs": [{"targets": sims}]},
        ],
    }


async def burst(url: str, tickets: list[str], rng: random.Random) -> list[int]:
    async def one(session: aiohttp.ClientSession, ticket: str) -> int:
        tokens = rng.choice((200, 800, 2000, 3000))
        body = {"model": "deepseek-sim", "max_tokens": rng.choice((32, 64, 128)),
                "messages": [{"role": "user", "content": "x" * (4 * tokens)}]}
        headers = {"x-ticket-type": ticket}
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            await response.read()
            return response.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, ticket) for ticket in tickets))


def query_range(prometheus: str, expr: str, start: float, end: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1s"})
    status, text = http_get(f"{prometheus}/api/v1/query_range?{params}", timeout=10)
    if status != 200:
        raise RuntimeError(f"Prometheus refused {expr!r}: {text}")
    return json.loads(text)["data"]["result"]


def targets_up(prometheus: str) -> int:
    status, text = http_get(f"{prometheus}/api/v1/query?query=sum(up)")
    result = json.loads(text)["data"]["result"] if status == 200 else []
    return int(float(result[0]["value"][1])) if result else 0


def fill(template: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        template = template.replace(name, value)
    return template


def legend(target: dict, labels: dict[str, str]) -> str:
    """Grafana's legendFormat filled in: `{{pool}} {{class}}` -> `primary loan_approval`."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), target["legendFormat"]).strip()


def plot_panel(path: Path, panel: dict, ref_ids: set[str] | None, prometheus: str, start: float, end: float) -> None:
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for target in panel["targets"]:
        if ref_ids is not None and target["refId"] not in ref_ids:
            continue
        for series in query_range(prometheus, fill(target["expr"], VARIABLES), start, end):
            values = [(float(t) - start, float(v)) for t, v in series["values"]]
            if not any(v for _, v in values if v == v):  # all zero or NaN: nothing to see
                continue
            ax.plot([t for t, _ in values], [v for _, v in values], label=legend(target, series["metric"]), linewidth=1.3)
    unit = panel["fieldConfig"]["defaults"].get("unit")
    ax.set_ylabel({"s": "seconds", "reqps": "requests / s", "percentunit": "share (0..1)"}.get(unit, "requests"))
    ax.set_xlabel("seconds since the first burst")
    ax.set_title(panel["title"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    save(fig, path)


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="extproc-dashboard-"))
    ports = StackPorts.random(primary=2, fallback=1)
    config_path = workdir / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(sidecar_config(ports)))
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(ports)))
    sim_args = ("--kv-tokens", "12288")
    stack = Stack(workdir, ports, config_path, primary=SimSpec("deepseek-sim", sim_args),
                  fallback=SimSpec("deepseek-sim-small", sim_args))
    prometheus_port = free_port()
    prometheus = ManagedProcess("prometheus", [
        find_program("prometheus", "install Debian's prometheus package (apt-get install prometheus)"),
        f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address={LOOPBACK}:{prometheus_port}", "--log.level=warn"], workdir / "prometheus.log")
    base = f"http://{LOOPBACK}:{prometheus_port}"
    with stack:
        prometheus.start()
        try:
            targets = 1 + len(ports.primary + ports.fallback)
            wait_until(lambda: targets_up(base) == targets, 30, "Prometheus to scrape every target", prometheus)
            rng = random.Random(7)
            asyncio.run(burst(stack.url, list(TICKETS), rng))  # each class's series exists before the bursts
            time.sleep(3)  # a few idle scrapes first
            start = time.time() - 2
            statuses: list[int] = []
            for size in (60, 90, 60):
                statuses += asyncio.run(burst(stack.url, [rng.choice(TICKETS) for _ in range(size)], rng))
                time.sleep(4)
            time.sleep(4)  # the last scrapes of the drained line
            end = time.time()
            panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
            for name, title, ref_ids in PANELS:
                plot_panel(out / f"dashboard-{name}.png", panels[title], ref_ids, base, start, end)
        finally:
            prometheus.stop()
    counts = {status: statuses.count(status) for status in sorted(set(statuses))}
    print(f"{len(statuses)} requests over {end - start:.0f} s, answered {counts}; plots in {out}; logs in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img"))
