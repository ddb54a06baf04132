"""Every relative link in the repository's markdown resolves: the file exists and an
#anchor names a heading of it (GitHub's slug rule). Docs move (the lab notebook went to
benchmarks/results/); links must follow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCED = re.compile(r"```.*?```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    patterns = ("README.md", "CHANGELOG.md", "docs/*.md", "benchmarks/**/*.md", "families/*/README.md",
                "backends/*/README.md", "plugins/*/README.md", "models/*/README.md")
    return sorted({p for pattern in patterns for p in REPO.glob(pattern)})


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCED.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(path: Path) -> list[str]:
    broken = []
    for match in LINK.finditer(FENCED.sub("", path.read_text())):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_check_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n[ok](#title-here) [gone](b.md) [no](#nope)\n")
    assert broken_links(tmp_path / "a.md") == ["b.md (no such file)", "#nope (no such heading)"]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{path.relative_to(REPO)}: " + ", ".join(broken_links(path))
