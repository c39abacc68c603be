"""The README a newcomer reads and the pages it links: short, starting with the two commands, and no
link that leads nowhere (the cheap stand-in for a documentation site built with --strict)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+\s+(.*)$", FENCE.sub("", page.read_text()), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; detail belongs in docs/"
    assert lines[:4] == ["```bash", "make release   # the monthly release on the embedded default data and model",
                         "make test      # the test suite", "```"]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert len(PAGES) > 5
    broken = {page.name: links for page in PAGES if (links := broken_links(page))}
    assert broken == {}


def test_a_link_to_a_missing_file_or_heading_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# A heading: `with code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading-with-code) [gone](missing.md) [bad anchor](there.md#nope) "
                    "[web](https://example.com)\n```\n[in code](ignored.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "there.md#nope"]
