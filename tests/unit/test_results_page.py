"""bench/RESULTS.md is what the benchmarks' own report makes of the committed results files: a
hand edit, or a results file committed without the page it refreshes, fails here. (Refresh it
with `python -c 'from pathlib import Path; from extproc_testbed.report import write_results;
write_results(Path("bench/results"))'`.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from extproc_testbed.report import write_results

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_results_page_is_the_one_the_committed_results_make(tmp_path):
    results = tmp_path / "bench" / "results"
    shutil.copytree(BENCH / "results", results, ignore=shutil.ignore_patterns("*.png"))
    page = write_results(results)
    assert page == tmp_path / "bench" / "RESULTS.md"
    assert page.read_text() == (BENCH / "RESULTS.md").read_text()
