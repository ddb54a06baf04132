"""What reading ahead costs or saves per decode step, with the measured gate taken out of the
loop: every step reads ahead (``--way ahead``), none does (``--way without``), or the gate
decides (``--way gate``). Prints the mean and median one-row step, decode tok/s, the bytes
read, the reads ahead issued and unused, and the look-ahead's precision by the router's
rank (predictions are scored whether read or not). One cold run per call: alternate the
ways across calls, after dropping the page cache (root), to compare them.

    python benchmarks/prefetch_ways.py --model frontier-0.25-int4 --ram 4335M --tokens 24 --prompt-tokens 8 --way ahead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import colibri_core  # noqa: E402
from colibri_core.cli.bench import prompt_ids  # noqa: E402
from colibri_core.io import drives  # noqa: E402
from store_bench import drop_caches  # noqa: E402  (this directory is on the path of a script run)


class TimedWay:
    """A gate for ``Prefetcher``: the given way on one-row steps (or ``inner``'s), each timed."""

    def __init__(self, way: str, inner):
        self.way, self.inner, self.steps_s, self._started = way, inner, [], None

    def begin(self, rows: int) -> bool:
        decided = self.inner.begin(rows)
        self._started = time.perf_counter() if rows == 1 else None
        return decided if self.way == "gate" else self.way == "ahead"

    def end(self) -> None:
        self.inner.end()
        if self._started is not None:
            self.steps_s.append(time.perf_counter() - self._started)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ram", required=True, help="colibri's --ram")
    ap.add_argument("--way", choices=("ahead", "without", "gate"), required=True)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefetch-slots", type=int, default=None, help="colibri's --prefetch-slots (default: its own)")
    ap.add_argument("--stop-chunk", type=int, default=None, metavar="MIB",
                    help="read reads ahead in chunks of this many MiB (default: io/drives.py's STOP_CHUNK)")
    ap.add_argument("--no-drop-cache", action="store_true", help="keep the page cache (default: drop it, as root)")
    a = ap.parse_args(argv)
    if a.stop_chunk is not None:
        drives.STOP_CHUNK = a.stop_chunk << 20
    if not a.no_drop_cache:
        drop_caches()
    with colibri_core.load(a.model, ram=a.ram, prefetch=True, prefetch_slots=a.prefetch_slots, direct_io=True,
                          history="read") as model:
        store, prefetcher = model.store, model.lm.prefetcher
        gate = prefetcher.gate = TimedWay(a.way, prefetcher.gate)
        predicted: dict[int, list[tuple[int, bool]]] = {}  # layer -> [(expert, needed a read)] by rank
        by_rank: list[list[int]] = []
        reads_by_rank: list[list[int]] = []  # per rank: [used, predicted] of the predictions not resident
        prefetch, end_layer = store.prefetch, store.end_layer

        def scoring_prefetch(layer, experts, **kw):
            predicted[layer] = [(int(e), not store._resident(layer, int(e))) for e in experts]
            return prefetch(layer, experts, **kw)

        def scoring_end_layer(layer, indices, experts):
            ranks = predicted.pop(layer, None)
            if ranks is not None and np.shape(indices)[0] == 1:
                used = set(np.asarray(experts).tolist())
                by_rank.append([int(e in used) for e, _ in ranks])
                for r, (e, needed) in enumerate(ranks):
                    if needed:
                        while len(reads_by_rank) <= r:
                            reads_by_rank.append([0, 0])
                        reads_by_rank[r][0] += e in used
                        reads_by_rank[r][1] += 1
            return end_layer(layer, indices, experts)

        store.prefetch, store.end_layer = scoring_prefetch, scoring_end_layer
        ids = prompt_ids(model.lm.vocab_size, a.prompt_tokens, a.seed)
        for _ in model.stream(token_ids=ids, max_tokens=a.tokens, ignore_eos=True, temperature=1.0, seed=a.seed):
            pass
        s = store.stats
        full = [r for r in by_rank if len(r) == max(map(len, by_rank), default=0)]
        out = {
            "way": a.way, "steps": len(gate.steps_s),
            "step_ms_mean": 1e3 * statistics.fmean(gate.steps_s), "step_ms_median": 1e3 * statistics.median(gate.steps_s),
            "decode_tok_s": len(gate.steps_s) / sum(gate.steps_s), "bytes_read": store.disk.bytes_read,
            "prefetch_issued": s.prefetch_issued, "prefetch_unused": s.prefetch_unused,
            "steps_without_reading_ahead": s.prefetch_steps_off,
            "precision_by_rank": np.mean(full, axis=0).round(3).tolist() if full else [],
            "predictions_by_rank": len(full),
            # the predictions that were not resident (the reads ahead a step would issue), by rank
            "read_precision_by_rank": [round(u / n, 3) if n else None for u, n in reads_by_rank],
            "reads_by_rank": [n for _, n in reads_by_rank],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
