"""`extproc bench scenario --matrix`: the independent burst through every cell of what users vary,
each cell run twice side by side, Envoy alone and Envoy + the sidecar.

    extproc bench scenario --matrix [--cells plain-32-ignore,template-8-honour] [--seeds 7,11,13] [--size 0.3]

The cells (`scenario_setups.CELLS`, named ENVOY-SEQUENCES-CLIENTS):
- the Envoy: `template` (envoy/envoy.yaml, following the sidecar's engine picks through
  override_host) or `plain` (a platform team's own: the same file, its model clusters balanced
  by plain `LEAST_REQUEST`, the ext_proc filter in the documented processing mode);
- the engines: two simulated engines in crash mode, `8` sequences and 24,576 KV tokens each, or
  `32` and 65,536, `--scheduling-policy priority`;
- the clients: `honour` retry-after as the OpenAI SDKs do, or `ignore` it (complaint and archive
  clients in hand-written loops, retrying 50-250 ms later up to ten times; loans keep the SDK's).

With `--long-prefill-token-threshold N` the engines run with vLLM's flag of that name: a long
prompt's chunks take at most N tokens of a step shared with other requests, so a request that
arrives during a long prefill joins beside it instead of waiting it out (0, vLLM's default: none).
Such a run belongs in a folder of its own (`--out bench/results/NAME`).

The sidecar runs on its shipped defaults but for the pool: `max_inflight` at the engines' real
slot count, the backends listed, their `max_num_seqs`, `pick_backend`, no fallback; durations
scaled. The traffic is `Traffic.independent_burst` (`--size` shortens it); with `--seeds`, each
cell runs once per seed (the classes, prompts and arrivals drawn anew) and its figures are those
of all the runs' requests together, each run's under `by_seed` (scenario_run.pooled).

Each cell's figures go into `<out>/matrix/matrix.json` (cells run earlier and not run again are
kept), its plot (the loans' latency over time beside the sidecar's latency cap) into
`<out>/matrix/CELL.png`, the table into bench/RESULTS.md (report_scenario.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from .machine import describe_machine
from .provenance import provenance
from .report import write_results
from .report_scenario import matrix_section
from .scenario_run import pooled, run_setup, strip
from .scenario_setups import CELLS, Cell
from .traffic import SLO_CLASS, SLO_P99_S, Traffic

SETUPS = ("envoy_only", "sidecar")


def chosen_cells(names: str | None) -> list[Cell]:
    """The cells named (comma-separated), or all of them; an unknown name is refused with the known ones."""
    if not names:
        return list(CELLS)
    known = {cell.name: cell for cell in CELLS}
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(f"unknown cell(s) {', '.join(unknown)}; the cells: {', '.join(known)}")
    return [known[name] for name in wanted]


def seeds_arg(text: str) -> tuple[int, ...]:
    """--seeds: distinct seeds in the order given."""
    seeds = tuple(dict.fromkeys(int(n) for n in text.split(",") if n.strip()))
    if not seeds:
        raise ValueError(f"{text!r}: at least one seed")
    return seeds


def earlier_cells(path: Path, threshold: int) -> dict:
    """What `path` holds already (cells run earlier and not run again are kept); a file whose
    engines ran with another --long-prefill-token-threshold is refused: one file, one kind."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"cells": {}}
    others = {c.get("long_prefill_token_threshold", 0) for c in summary["cells"].values()} - {threshold}
    if others:
        raise SystemExit(f"{path} holds cells whose engines ran with --long-prefill-token-threshold "
                         f"{', '.join(map(str, sorted(others)))}; write this run elsewhere (--out)")
    return summary


def run(args) -> dict:
    out = Path(args.out) / "matrix"
    path = out / "matrix.json"
    threshold = getattr(args, "long_prefill_token_threshold", 0) or 0
    summary = earlier_cells(path, threshold)  # before anything starts
    cells = [dataclasses.replace(cell, long_prefill_token_threshold=threshold) for cell in chosen_cells(args.cells)]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="extproc-matrix-"))
    traffic = Traffic.independent_burst()
    traffic = traffic if args.size == 1 else traffic.scaled(args.size)
    seeds = list(args.seeds or (traffic.seed,))
    origin = provenance()  # before anything is written
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {message}", flush=True)

    progress(f"cells: {', '.join(c.name for c in cells)}; seeds {seeds}; traffic: {traffic}; "
             f"time scale {args.time_scale}; engines' long prefill token threshold {threshold or 'none'}; logs in {work}")
    from . import plots  # matplotlib: installed with the test and bench tools, not the server

    command = " ".join(["extproc", "bench", "scenario", *sys.argv[3:]])
    for cell in cells:
        cell_started = time.monotonic()
        results = {}
        for setup in SETUPS:
            runs = [run_setup(setup, cell.backends, dataclasses.replace(traffic, seed=seed), args.time_scale,
                              work / f"{cell.name}-{setup}-{seed}", progress, cell=cell,
                              keep_outcomes=len(seeds) > 1) for seed in seeds]
            results[setup] = pooled(runs, traffic) if len(runs) > 1 else runs[0]
            loan = results[setup]["classes"][SLO_CLASS]
            progress(f"{cell.name} {setup}: loans within {SLO_P99_S:g} s {loan['in_time']}, burst p99 "
                     f"{loan['burst_p99_s']} s, availability {results[setup]['availability']}, "
                     f"crashes {results[setup]['oom_crashes']}")
        plots.matrix_cell_plot(out, cell.name, results, SLO_P99_S)
        summary["cells"][cell.name] = {
            "envoy": cell.envoy, "max_num_seqs": cell.max_num_seqs, "kv_tokens": cell.kv_tokens,
            "clients": cell.clients, "backends": cell.backends, "seeds": seeds,
            "long_prefill_token_threshold": cell.long_prefill_token_threshold,
            "setups": {setup: strip(result) for setup, result in results.items()},
            # (its seed the one run's; where several ran, `seeds` names them)
            "traffic": {**traffic.__dict__, "seed": seeds[0] if len(seeds) == 1 else None},
            "time_scale": args.time_scale, "command": command,
            "machine": describe_machine(origin["machine"]), "seconds": round(time.monotonic() - cell_started),
            "provenance": origin,  # each cell its own: cells run earlier and not again keep theirs
        }
        summary["provenance"] = origin  # the file's: its latest run
        summary["cells"] = {c.name: summary["cells"][c.name] for c in CELLS if c.name in summary["cells"]}
        path.write_text(json.dumps(summary, indent=2) + "\n")  # after each cell: a long run keeps what it did
    return summary


def main(args) -> int:
    summary = run(args)
    path = write_results(Path(args.out))
    print("\n".join(matrix_section(summary)))
    print(f"written: {Path(args.out) / 'matrix' / 'matrix.json'}, {path}")
    return 0
