"""The matrix's sidecar setup with engine_priority at its default (off), sidecar only, each cell once:

    .venv/bin/python bench/results/before-after/long-lanes/matrix_engine_priority_off.py SCRATCH CELL...
"""
import sys, json, time, yaml
from pathlib import Path
from extproc_testbed import scenario_setups, scenario_run
orig = scenario_setups.shipped_config
def shipped(work, ports, time_scale, max_num_seqs=None):
    path = orig(work, ports, time_scale, max_num_seqs)
    config = yaml.safe_load(path.read_text()); config["queue"]["engine_priority"] = False
    path.write_text(yaml.safe_dump(config)); return path
scenario_run.shipped_config = shipped
from extproc_testbed.scenario_setups import CELLS
from extproc_testbed.traffic import Traffic, SLO_CLASS
out = Path(sys.argv[1])
for name in sys.argv[2:]:
    cell = {c.name: c for c in CELLS}[name]
    r = scenario_run.run_setup("sidecar", cell.backends, Traffic.independent_burst(), 0.5, out / name, lambda m: None, cell=cell)
    loan = r["classes"][SLO_CLASS]
    beside_long = sum(1 for l in r["slow_loans"]["slowest"] if l["beside_long_prefill_s"] > 0)
    print(name, "in_time", loan["in_time"], "burst_p99", loan["burst_p99_s"], "avail", r["availability"],
          "crashes", r["oom_crashes"], "slow", len(r["slow_loans"]["slowest"]), "beside_long", beside_long, flush=True)
    json.dump(r, open(out / f"{name}.json", "w"), default=str)
