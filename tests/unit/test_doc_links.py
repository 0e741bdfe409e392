"""Every relative link in the README and docs/ leads to a file of the repository, and every
`#anchor` to a heading of the page it names (anchors as GitHub writes them: the heading in lower
case, without punctuation, spaces as hyphens, a repeated heading suffixed -1, -2, ...)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(text: str) -> set[str]:
    found: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = found.get(slug, 0)
        found[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(page: Path) -> list[str]:
    text = page.read_text("utf-8")
    broken = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text("utf-8")):
            broken.append(f"{target}: {file.relative_to(ROOT)} has no heading #{anchor}")
    return broken


def test_every_relative_link_in_the_docs_leads_somewhere():
    assert {page.relative_to(ROOT).as_posix(): broken_links(page) for page in PAGES if broken_links(page)} == {}


def test_anchors_are_written_as_github_writes_them():
    text = "# A request's life\n## Step by step, as Envoy sees it\n## The `extproc` cluster\n## Notes\n## Notes\n"
    assert anchors(text) == {"a-requests-life", "step-by-step-as-envoy-sees-it", "the-extproc-cluster",
                             "notes", "notes-1"}
