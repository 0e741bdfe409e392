"""The provenance a results file keeps (extproc_testbed/provenance.py), read from real git work
trees: the commit, whether the tree was clean (what the benchmarks write aside), and never a crash
where there is no checkout, no commit or no git. Here, not in the unit layer: it runs git."""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from extproc_testbed.provenance import code_checkout, provenance

ROOT = Path(__file__).resolve().parents[2]


def git(repo: Path, *args: str) -> str:
    run = subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                         capture_output=True, text=True, check=True)
    return run.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout with one commit: code, and results the benchmarks wrote earlier."""
    root = tmp_path / "checkout"
    (root / "bench" / "results").mkdir(parents=True)
    git(root, "init", "-q")
    (root / "code.py").write_text("x = 1\n")
    (root / "bench" / "results" / "scenario.json").write_text("{}\n")
    (root / "bench" / "RESULTS.md").write_text("# Benchmark results\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def test_a_clean_checkout_gives_its_commit_the_machine_the_command_and_the_date(repo):
    p = provenance(command="extproc bench scenario --size 0.05", envoy=False, checkout=repo)
    assert p["commit"] == git(repo, "rev-parse", "HEAD") and len(p["commit"]) == 40
    assert p["clean"] is True and p["note"] is None and p["checkout"] == str(repo)
    assert p["command"] == "extproc bench scenario --size 0.05"
    assert datetime.fromisoformat(p["date"].replace("Z", "+00:00")).utcoffset().total_seconds() == 0
    assert p["date"].endswith("Z")
    machine = p["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["memory_gib"] > 0 and machine["kernel"]
    assert p["load_1m_at_start"] >= 0
    assert machine["python"].count(".") == 2 and machine["envoy"] is None  # no Envoy asked for


def test_a_change_to_the_code_or_a_new_file_makes_the_tree_dirty(repo):
    (repo / "code.py").write_text("x = 2\n")
    assert provenance(envoy=False, checkout=repo)["clean"] is False
    git(repo, "checkout", "--", "code.py")
    assert provenance(envoy=False, checkout=repo)["clean"] is True
    (repo / "new.py").write_text("")  # untracked
    p = provenance(envoy=False, checkout=repo)
    assert p["clean"] is False and set(p) == {"commit", "clean", "checkout", "note", "machine", "command", "date", "load_1m_at_start"}


def test_what_the_benchmarks_write_leaves_the_tree_clean(repo):
    """A second benchmark run before the first one's results are committed still reads clean."""
    (repo / "bench" / "results" / "scenario.json").write_text('{"setups": {}}\n')
    (repo / "bench" / "results" / "matrix").mkdir()
    (repo / "bench" / "results" / "matrix" / "matrix.json").write_text("{}\n")
    (repo / "bench" / "RESULTS.md").write_text("# Benchmark results, again\n")
    assert provenance(envoy=False, checkout=repo)["clean"] is True


def test_without_a_checkout_a_commit_or_git_the_commit_is_none_and_it_says_why(tmp_path, repo, monkeypatch):
    plain = tmp_path / "plain"
    plain.mkdir()
    p = provenance(envoy=False, checkout=plain)
    assert p["commit"] is None and p["clean"] is None and "not the top of a git checkout" in p["note"]
    inside = repo / "bench"  # a folder inside a checkout is not one
    assert provenance(envoy=False, checkout=inside)["commit"] is None
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    p = provenance(envoy=False, checkout=empty)
    assert p["commit"] is None and "no commit yet" in p["note"]
    monkeypatch.setenv("PATH", str(plain))  # no git at all
    p = provenance(envoy=False, checkout=repo)
    assert p["commit"] is None and p["note"].startswith("git could not be run")


def test_the_testbed_records_the_checkout_it_runs_from():
    assert code_checkout() == ROOT
    p = provenance(command="x", envoy=False)
    assert p["commit"] == git(ROOT, "rev-parse", "HEAD") and isinstance(p["clean"], bool)
