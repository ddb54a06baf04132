"""Where a backend's host synchronisations come from.

A decode step may cross from the device to the host only where the host needs the
numbers: the LM head's logits (the sampled token), each MoE router's expert ids (the
expert store reads by id) and each sparse-attention indexer's selection (scores to the
host, and the selection once more where the attention taking it is a composite). Every
other op stays on the device. ``SyncAudit`` wraps one backend instance's ``to_host`` and
names, for each synchronisation, the first frame outside the compute layer and the
backend packages: the block that asked for it.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import colibri_core

CORE = Path(colibri_core.__file__).resolve().parent
COMPUTE = CORE / "compute"
# the modules whose blocks may synchronise, and why
ALLOWED_SITES = {
    "colibri_core.nn.layers": "the LM head's logits, the routers' expert ids",
    "colibri_core.nn.routers": "the routers' expert ids",
    "colibri_core.nn.sinkmoe": "the routers' expert ids",
    "colibri_core.nn.dsa": "the indexer's selection",
    "colibri_core.nn.mla": "the indexer's selection, where the latent attention taking it is a composite",
    "colibri_core.nn.compressed": "the indexer's selection",
}


def _package_dir(cls) -> Path:
    """The folder of the top-level package that defines ``cls`` (a backend's own code)."""
    module = sys.modules[cls.__module__]
    top = sys.modules[module.__name__.split(".")[0]]
    return Path(top.__file__).resolve().parent


def caller_site(skip: tuple[Path, ...] = ()) -> str:
    """``module:function`` of the nearest frame outside compute/, this module and the
    folders in ``skip`` (the backend's own package)."""
    frame = sys._getframe(1)
    here = Path(__file__).resolve()
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if not (path.is_relative_to(COMPUTE) or path == here or any(path.is_relative_to(d) for d in skip)):
            if path.is_relative_to(CORE.parent):
                return f"{'.'.join(path.relative_to(CORE.parent).with_suffix('').parts)}:{frame.f_code.co_name}"
            return f"{path.stem}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class SyncAudit:
    """Counts ``backend.to_host`` calls by site, and calls of the ops a budget depends on."""

    COUNTED_OPS = ("dsa_index_scores",)

    def __init__(self, backend):
        self.sites: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        original = backend.to_host
        # the backend's own package, whichever distribution it comes from (colibri_core's
        # own backends live in compute/, skipped anyway)
        own = tuple(d for d in {_package_dir(type(backend))} if d != CORE)

        def to_host(x):
            self.sites[caller_site(own)] += 1
            return original(x)

        backend.to_host = to_host  # on the instance: the backend's own methods reach it through self
        for op in self.COUNTED_OPS:
            self._count(backend, op)

    def _count(self, backend, op: str) -> None:
        original = getattr(backend, op)

        def counted(*args, **kwargs):
            self.calls[op] += 1
            return original(*args, **kwargs)

        setattr(backend, op, counted)

    def snapshot(self) -> tuple[Counter, Counter]:
        return Counter(self.sites), Counter(self.calls)


def disallowed(sites: Counter) -> dict[str, int]:
    """The sites outside ``ALLOWED_SITES`` (module:function -> syncs)."""
    return {site: n for site, n in sites.items() if n and site.split(":")[0] not in ALLOWED_SITES}
