"""What the benchmarks' reports say about the machine they ran on, and where they keep
themselves (standard library only)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo; elsewhere (or where it names none, as on
    ARM) ``platform.processor()``, or "?"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def write_record(out: Path, stem: str, report: dict, markdown: str) -> Path:
    """Write a run's record as ``out/STEM.json`` and ``STEM.md``, or ``STEM-2``, ``-3``...:
    never over an earlier run's (either file). Returns the Markdown's path."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    name = stem
    for n in range(2, 1000):
        if not (out / f"{name}.json").exists() and not (out / f"{name}.md").exists():
            break
        name = f"{stem}-{n}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown)
    return out / f"{name}.md"
