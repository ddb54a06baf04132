"""The CUDA C sources in ``colibri_cuda/kernels`` and their self-contained form.

``source(name)`` expands the local ``#include "..."`` lines (each header once, as its
``#pragma once`` asks), so the text handed to NVRTC (``cupy.RawModule``) needs no
include path and names everything it depends on: CuPy's compile cache is keyed by that
text, so a changed header recompiles. CI compiles the same files with nvcc
(tests/test_cuda_sources.py).
"""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


def kernel_files() -> list[Path]:
    """Every compiled source (the .cu files; the .cuh headers come with them)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def source(name: str) -> str:
    """``kernels/<name>`` with its local headers expanded in place."""
    return _expand(KERNEL_DIR / name, set())


def _expand(path: Path, seen: set[Path]) -> str:
    lines = []
    for line in path.read_text().splitlines():
        match = INCLUDE.match(line)
        if match:
            header = (path.parent / match.group(1)).resolve()
            if header.parent != KERNEL_DIR:
                raise ValueError(f"{path.name}: includes {match.group(1)!r} from outside {KERNEL_DIR}")
            if header not in seen:
                seen.add(header)
                lines.append(_expand(header, seen))
            continue
        if PRAGMA_ONCE.match(line):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"
