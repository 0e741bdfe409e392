"""The README's headline figures are the results files' own.

README.md holds one table of headline figures between `<!-- figures: begin -->` and
`<!-- figures: end -->`. Each row names its results file (a link in the column `results file`)
and, in the column `where in it`, one JSON path per figure, as code, in the order the figures
stand in the row (left to right; several figures in one cell are separated by ` / `). A path is
keys joined by dots; a list is indexed by a number, or searched with `key=value` (the first item
whose `key` is `value`). A figure is compared with the value at its path after the rounding it
shows: `99.7 %` is 0.997 to 0.1 of a percent, `1.94 s` is 1.94, `1758 tokens/s` is 1758 to the
unit; `failed` stands for null (a p99 that counts failures, where too many failed); `—` is no
figure and takes no path. So refreshing a figure after a new run is a one-line edit of its row.
"""

from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BEGIN, END = "<!-- figures: begin -->", "<!-- figures: end -->"
FIGURE_COLUMNS = ("Envoy + sidecar", "Envoy alone")
_NUMBER = re.compile(r"^([+-]?\d+(?:\.(\d+))?)\s*(%|[^\d\s].*)?$")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`]+)`")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the table between the markers, each as {column header: cell}."""
    if BEGIN not in text or END not in text:
        raise AssertionError(f"README.md has no {BEGIN} ... {END} table")
    lines = [line for line in text[text.index(BEGIN) + len(BEGIN): text.index(END)].splitlines() if line.strip()]
    header, rule, *body = lines
    assert set(rule.replace("|", "").strip()) <= set("-: "), f"not a table: {rule!r}"
    names = _cells(header)
    rows = []
    for line in body:
        cells = _cells(line)
        assert len(cells) == len(names), f"{len(cells)} cells where the header has {len(names)}: {line!r}"
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def lookup(data: object, path: str) -> object:
    """The value at `path` in parsed JSON; KeyError naming the step that is missing."""
    here = data
    for step in path.split("."):
        if isinstance(here, dict):
            if step not in here:
                raise KeyError(f"{step!r} (keys: {', '.join(map(str, list(here)[:12]))})")
            here = here[step]
        elif isinstance(here, list):
            if step.isdigit() and int(step) < len(here):
                here = here[int(step)]
            elif "=" in step:
                key, _, wanted = step.partition("=")
                found = [item for item in here if isinstance(item, dict) and str(item.get(key)) == wanted]
                if not found:
                    raise KeyError(f"no item with {key}={wanted}")
                here = found[0]
            else:
                raise KeyError(f"{step!r} in a list of {len(here)}")
        else:
            raise KeyError(f"{step!r} under a {type(here).__name__}")
    return here


def figure_matches(shown: str, value: object) -> bool:
    """Whether `shown` (as the README writes it) is `value` after the rounding it shows."""
    if shown == "failed":
        return value is None
    match = _NUMBER.match(shown.replace("−", "-").replace(",", ""))
    if match is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    number, decimals, unit = match.group(1), match.group(2) or "", match.group(3)
    scaled = Decimal(repr(value)) * (100 if unit == "%" else 1)
    return scaled.quantize(Decimal(1).scaleb(-len(decimals)), rounding=ROUND_HALF_UP) == Decimal(number)


def problems(text: str, root: Path) -> list[str]:
    """Every figure of the table that is not what its results file holds, or has no file or path."""
    found = []
    rows = table_rows(text)
    if not rows:
        return ["the figures table has no rows"]
    for row in rows:
        name = row.get("measured", "?")
        links = _LINK.findall(row.get("results file", ""))
        if len(links) != 1:
            found.append(f"{name}: the column 'results file' must link one file, not {links}")
            continue
        path = root / links[0]
        paths = _CODE.findall(row.get("where in it", ""))
        figures = [figure.strip().strip("*").strip() for column in FIGURE_COLUMNS
                   for figure in row.get(column, "—").split(" / ")]
        figures = [figure for figure in figures if figure not in ("—", "")]
        if not figures or len(figures) != len(paths):
            found.append(f"{name}: {len(figures)} figures ({figures}) but {len(paths)} paths ({paths})")
            continue
        try:
            data = json.loads(path.read_text("utf-8"))
        except (OSError, ValueError) as error:
            found.append(f"{name}: {links[0]} cannot be read: {error}")
            continue
        for shown, where in zip(figures, paths, strict=True):
            try:
                value = lookup(data, where)
            except KeyError as error:
                found.append(f"{name}: {links[0]} has no {where}: missing {error}")
                continue
            if not figure_matches(shown, value):
                found.append(f"{name}: the README shows {shown}, {links[0]} holds {value!r} at {where}")
    return found


def test_every_headline_figure_is_the_one_its_results_file_holds():
    assert problems(README.read_text("utf-8"), ROOT) == []


def test_the_table_links_every_results_file_it_reads():
    for row in table_rows(README.read_text("utf-8")):
        (link,) = _LINK.findall(row["results file"])
        assert link.startswith("bench/results/") and link.endswith(".json"), link


def _readme(row: str) -> str:
    return "\n".join([BEGIN, "| measured | Envoy + sidecar | Envoy alone | results file | where in it |",
                      "|---|---|---|---|---|", row, END])


def test_a_figure_one_digit_off_its_file_is_caught(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"setups": {"sidecar": {"in_time": 0.9974, "p99": 1.94},
                                                            "envoy_only": {"in_time": 0.4175, "p99": None}}}))
    good = ("| in time | **99.7 %** / 1.94 s | 41.8 % / failed | [r.json](r.json) | `setups.sidecar.in_time` "
            "`setups.sidecar.p99` `setups.envoy_only.in_time` `setups.envoy_only.p99` |")
    assert problems(_readme(good), tmp_path) == []
    assert problems(_readme(good.replace("99.7 %", "99.8 %")), tmp_path) == [
        "in time: the README shows 99.8 %, r.json holds 0.9974 at setups.sidecar.in_time"]
    assert problems(_readme(good.replace("failed", "2.1 s")), tmp_path) == [
        "in time: the README shows 2.1 s, r.json holds None at setups.envoy_only.p99"]
    assert problems(_readme(good.replace("1.94 s", "1.95 s")), tmp_path) != []
    assert problems(_readme(good.replace("1.94 s", "1.9 s")), tmp_path) == []  # 1.94 to the digit shown


def test_a_missing_file_path_or_locator_is_caught(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"cells": [{"name": "a", "x": 3}]}))
    row = "| x | 3 | — | [r.json](r.json) | `cells.name=a.x` |"
    assert problems(_readme(row), tmp_path) == []
    assert problems(_readme(row.replace("cells.name=a.x", "cells.0.x")), tmp_path) == []
    assert "has no cells.name=b.x" in problems(_readme(row.replace("name=a", "name=b")), tmp_path)[0]
    assert "cannot be read" in problems(_readme(row.replace("(r.json)", "(gone.json)")), tmp_path)[0]
    assert "1 figures" in problems(_readme(row.replace("`cells.name=a.x`", "")), tmp_path)[0]


def test_rounding_is_half_up_to_the_digits_shown():
    assert figure_matches("100 %", 0.99996) and figure_matches("99.6 %", 0.9962)
    assert figure_matches("1758 tokens/s", 1758.1) and figure_matches("737 tokens/s", 736.6)
    assert figure_matches("0.81", 0.805) and not figure_matches("0.80", 0.805)
    assert figure_matches("0", 0) and not figure_matches("0", None) and not figure_matches("1", True)
