"""The section of bench/RESULTS.md for the burst on real engines (scenario_vllm.py's
OUT/vllm/scenario-vllm.json): the simulated scenario's figures, sidecar beside Envoy alone, and
the engines' own counts; what was scaled and why, what limits it. Reads, never runs."""

from __future__ import annotations

from .provenance import provenance_line
from .traffic import CLASSES, SLO_CLASS


def _fmt(value, unit: str = "", missing: str = "—") -> str:
    return missing if value is None else f"{value:g}{unit}"


def _pair(a: dict, b: dict, get, unit: str = "", missing: str = "—", bold: bool = False) -> str:
    x, y = _fmt(get(a), unit, missing), _fmt(get(b), unit, missing)
    return f"{x} | **{y}**" if bold else f"{x} | {y}"


def _engine_rows(a: dict, b: dict) -> list[str]:
    ea, eb = a["engine"], b["engine"]

    def hist(e: dict, name: str) -> str:
        h = e[name]
        return f"{_fmt(h['mean_s'])} / {_fmt(h['p50_s'])} / {_fmt(h['p99_s'])} s ({h['count']})"

    def finished(e: dict) -> str:
        return ", ".join(f"{reason} {n}" for reason, n in e["finished"].items() if n) or "none"

    return [
        f"| engines: preemptions (`vllm:num_preemptions_total`) | {ea['preemptions']} | {eb['preemptions']} |",
        "| engines: time in the engine's line, mean / p50 / p99 (`vllm:request_queue_time_seconds`, count) | "
        f"{hist(ea, 'queue_time')} | {hist(eb, 'queue_time')} |",
        "| engines: end-to-end in the engine, mean / p50 / p99 (`vllm:e2e_request_latency_seconds`) | "
        f"{hist(ea, 'e2e_latency')} | {hist(eb, 'e2e_latency')} |",
        "| engines: time to first token, mean / p50 / p99 (`vllm:time_to_first_token_seconds`) | "
        f"{hist(ea, 'time_to_first_token')} | {hist(eb, 'time_to_first_token')} |",
        *([f"| engines: a decode step, mean / p50 / p99 (`vllm:inter_token_latency_seconds`) | "
           f"{hist(ea, 'inter_token_latency')} | {hist(eb, 'inter_token_latency')} |"]
          if "inter_token_latency" in ea else []),
        f"| engines: requests finished, by reason (`vllm:request_success_total`) | {finished(ea)} | {finished(eb)} |",
        f"| engines: KV cache usage, peak of the busiest (`vllm:kv_cache_usage_perc`, every 0.5 s) | "
        f"{_fmt(ea['kv_usage_peak'])} | {_fmt(eb['kv_usage_peak'])} |",
        f"| engines: requests waiting / running, peak (summed over the engines) | {ea['waiting_peak']} / "
        f"{ea['running_peak']} | {eb['waiting_peak']} / {eb['running_peak']} |",
        f"| engines: prompt / generated tokens | {ea['prompt_tokens']} / {ea['generation_tokens']} | "
        f"{eb['prompt_tokens']} / {eb['generation_tokens']} |",
        f"| engines: prefix cache hits (share of queried tokens) | {_fmt(ea['prefix_cache_hit_share'])} | "
        f"{_fmt(eb['prefix_cache_hit_share'])} |",
        f"| engine processes that exited during the run | {a['engine_exits']} | {b['engine_exits']} |",
    ]


def _scaling_lines(summary: dict) -> list[str]:
    s, t, ref = summary["scaling"], summary["traffic"], summary["scaling"]["reference"]["traffic"]
    lines = [f"What was scaled, and why: {s['how']}. Rate scale **{s['rate_scale']:g}**: steady "
             f"{ref['steady_rps']:g} → {t['steady_rps']:g} req/s, burst {ref['burst_rps']:g} → {t['burst_rps']:g} "
             f"req/s; latency scale **{s['latency_scale']:g}**: deadlines "
             + ", ".join(f"{name} {_fmt(d)} s" for name, d in summary["deadlines_s"].items())
             + f" (the simulated run's 2, 30, 120 s), the sidecar's latency target and waits likewise. Phases "
             f"{t['steady_s']:g} s, {t['burst_s']:g} s, {t['recovery_s']:g} s; {summary['requests_in_trace']} "
             "requests in the trace, the same in both setups"
             + (f", {prompts['long']} with long prompts (8.5k-12.8k tokens), {prompts['1k_to_4k']} of 1k-4k tokens"
                if (prompts := summary.get("prompts_in_trace")) else "") + "."]
    probe = s.get("probe")
    if probe:
        sim, real = probe["sim"], probe["vllm"]
        lines[0] += (f" The probe ({real['seconds']:g} s each, {real['clients']} clients straight to the engines): "
                     f"a simulated engine carries {sim['rps_per_engine']:g} req/s of the mix and answers a typical "
                     f"loan alone in {sim['alone_s']:g} s; a real one {real['rps_per_engine']:g} req/s and "
                     f"{real['alone_s']:g} s. So the steady phase offers {t['steady_rps'] / real['rps']:.2g} and the "
                     f"burst {t['burst_rps'] / real['rps']:.2g} times what the {real['engines']} real engines carry.")
    return lines


def _beside_the_simulator(summary: dict) -> list[str]:
    """What the engines' own counts say about the simulator's model: a decode step alone and
    under load, on both kinds; preemptions and KV."""
    from .sim_engine import SimParams

    a, b = (summary["setups"][s]["engine"] for s in ("envoy_only", "sidecar"))
    p = SimParams()
    lines = []
    probe = summary["scaling"].get("probe") or {}
    sim, real = probe.get("sim") or {}, probe.get("vllm") or {}
    if sim.get("step_alone_s") and real.get("step_alone_s") and sim.get("step_loaded_s") and real.get("step_loaded_s"):
        per = real["clients"] // real["engines"]
        sim_x, real_x = sim["step_loaded_s"] / sim["step_alone_s"], real["step_loaded_s"] / real["step_alone_s"]
        lines.append(
            f"Beside the simulator: a decode step as the engines count it (`vllm:inter_token_latency_seconds`, mean "
            f"over the probe) takes {sim['step_alone_s'] * 1000:.1f} ms alone and {sim['step_loaded_s'] * 1000:.1f} "
            f"ms with {per} requests per engine on the simulated engines ({sim_x:.1f}x; its timing model adds "
            f"{p.decode_contention * 100:g} % per sequence beside the first, and the prefill of prompts scheduled in "
            f"the same step), {real['step_alone_s'] * 1000:.1f} ms and {real['step_loaded_s'] * 1000:.1f} ms on the "
            f"real ones ({real_x:.1f}x). A request the engine schedules first still shares each step with the batch "
            "beside it.")
    if a.get("inter_token_latency"):
        lines.append(f"In the run, the engines' mean step: Envoy alone {_fmt(a['inter_token_latency']['mean_s'])} s, "
                     f"the sidecar {_fmt(b['inter_token_latency']['mean_s'])} s.")
    if a["preemptions"] == b["preemptions"] == 0:
        lines.append(f"No engine preempted a request: the busiest KV cache peaked at {_fmt(a['kv_usage_peak'])} "
                     f"(Envoy alone) and {_fmt(b['kv_usage_peak'])} (the sidecar); at these rates the engines run out "
                     "of compute long before KV cache, where the simulated headline's engines crash on KV overflow.")
    return [" ".join(lines), ""] if lines else []


def section(summary: dict) -> list[str]:
    a, b = summary["setups"]["envoy_only"], summary["setups"]["sidecar"]
    versions = sorted({str(e.get("vllm_version")) for setup in (a, b) for e in setup.get("engines", [])})
    lines = [
        "## The burst on real engines (`extproc bench scenario --engine vllm`)",
        "",
        f"`{summary['command']}` — the simulated scenario's traffic through Envoy alone and through Envoy + the "
        f"sidecar in front of the same real engines: {summary['pool']}; vLLM {', '.join(versions)} (its own "
        f"`/version`). Engines between the setups: {summary['engines_between_setups']}. The sidecar: "
        f"{summary['sidecar_config']}. Clients retry up to three attempts, after `retry-after-ms` (else "
        "`retry-after`) as the OpenAI SDKs do. Latencies in wall seconds; **in time** counts the requests "
        "answered within their class's deadline from their first attempt; availability counts each request once, "
        "its retries included.",
        "",
        *_scaling_lines(summary),
        "",
        "| | Envoy alone | Envoy + sidecar |",
        "|---|---|---|",
        f"| requests sent / counted / answered | {summary['requests_in_trace']} / {a['requests']} / {a['answered']} | "
        f"{summary['requests_in_trace']} / {b['requests']} / {b['answered']} |",
        f"| **answered in time, all requests** | {_pair(a, b, lambda r: r['in_time'], bold=True)} |",
        f"| availability | {_pair(a, b, lambda r: r['availability'])} |",
        f"| refused attempts; attempts per request | {_fmt(a['refused_attempts_share'])}; "
        f"{_fmt(a['attempts_per_request'])} | {_fmt(b['refused_attempts_share'])}; {_fmt(b['attempts_per_request'])} |",
        f"| goodput (completion tokens/s) | {_pair(a, b, lambda r: r['goodput_tokens_per_s'])} |",
        f"| goodput within the deadlines (tokens/s; requests/s) | {_fmt(a['goodput_in_time_tokens_per_s'])}; "
        f"{_fmt(a['goodput_in_time_rps'])} | {_fmt(b['goodput_in_time_tokens_per_s'])}; "
        f"{_fmt(b['goodput_in_time_rps'])} |",
        f"| **{SLO_CLASS}: p99 of those sent during the burst (failures counted)** | "
        f"{_pair(a, b, lambda r: r['classes'][SLO_CLASS]['burst_p99_s'], ' s', 'failed', bold=True)} |",
    ]
    for name in CLASSES:
        ca, cb = a["classes"][name], b["classes"][name]
        lines += [
            f"| **{name}: in time** (deadline {_fmt(cb.get('deadline_s'), ' s')}) | "
            f"{_fmt(ca['in_time'])} | **{_fmt(cb['in_time'])}** |",
            f"| {name}: p50 / p99 of answered | {_fmt(ca['p50_s'])} / {_fmt(ca['p99_s'])} s | "
            f"{_fmt(cb['p50_s'])} / {_fmt(cb['p99_s'])} s |",
            f"| {name}: availability, p99 counting failures | {_fmt(ca['availability'])}, "
            f"{_fmt(ca['p99_with_failures_s'], ' s', 'failed')} | {_fmt(cb['availability'])}, "
            f"{_fmt(cb['p99_with_failures_s'], ' s', 'failed')} |",
            f"| {name}: sidecar's queue wait p50 / p99 | — | {_fmt(cb['queue_wait_p50_s'])} / "
            f"{_fmt(cb['queue_wait_p99_s'])} s |",
        ]
    lines += _engine_rows(a, b)
    endings = {setup: {name: r["classes"][name]["failed_endings"] for name in CLASSES
                       if r["classes"][name].get("failed_endings")}
               for setup, r in (("Envoy alone", a), ("sidecar", b))}
    for setup, by_class in endings.items():
        if by_class:
            lines += ["", f"How {setup}'s failed requests ended (their attempts' statuses): "
                      + "; ".join(f"{name}: " + ", ".join(f"{k} × {v}" for k, v in e.items())
                                  for name, e in by_class.items()) + "."]
    lines += ["", *_beside_the_simulator(summary), f"What limits it: {summary['limits']}", "",
              "Plots: `latency_cdf.png`, `queue_kv_over_time.png`, `availability_over_time.png`, "
              "`appointments_over_time.png` in `results/vllm/`.", "",
              f"Machine: {summary['machine']}; the run took {summary['seconds']} s.", "",
              provenance_line(summary), ""]
    return lines
