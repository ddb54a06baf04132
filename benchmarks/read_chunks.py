"""How fast the disk tier reads experts in one request each against reads in chunks of
``STOP_CHUNK`` (how reads ahead are read, so they can stop midway: ``io/drives.py``).
Batches of distinct experts are read by the store's number of I/O threads through the
model's own disk tier (O_DIRECT), the page cache dropped before each batch (root), the
ways rotated round by round. Prints GB/s per batch and each chunk size's ratio to one
request, per round and median.

    python benchmarks/read_chunks.py --model frontier-0.25-int4 --experts 40 --rounds 8 --chunks 4,8,16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import colibri_core  # noqa: E402
from colibri_core.io import drives  # noqa: E402
from store_bench import drop_caches  # noqa: E402  (this directory is on the path of a script run)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--experts", type=int, default=40, help="experts read per batch")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--chunks", default="4,8,16", help="chunk sizes in MiB, beside one request per expert")
    ap.add_argument("--ram", default="1G", help="colibri's --ram (only the disk tier is used)")
    a = ap.parse_args(argv)
    ways = ["whole"] + [int(c) for c in a.chunks.split(",")]
    with colibri_core.load(a.model, ram=a.ram, direct_io=True, history=False) as model:
        store = model.store
        every = [(layer, e) for layer in range(len(store.layouts)) for e in range(len(store.layouts[layer]))]
        rng, pending, rates = random.Random(0), [], {w: [] for w in ways}

        def read(pair, chunk):
            layer, expert = pair
            if chunk == "whole":
                return store.disk.load(layer, expert, store.layouts[layer][expert]).nbytes
            with drives.stop_reads_when(lambda: False):  # never stops: only the chunking is measured
                return store.disk.load(layer, expert, store.layouts[layer][expert]).nbytes

        for rnd in range(a.rounds):
            for way in ways[rnd % len(ways):] + ways[: rnd % len(ways)]:
                if len(pending) < a.experts:  # the page cache is dropped: experts read before are cold again
                    pending = rng.sample(every, len(every))
                batch, pending = pending[: a.experts], pending[a.experts:]
                drop_caches()
                if way != "whole":
                    drives.STOP_CHUNK = way << 20
                started = time.perf_counter()
                with ThreadPoolExecutor(store.io_workers) as pool:
                    nbytes = sum(pool.map(lambda p: read(p, way), batch))
                rate = nbytes / (time.perf_counter() - started) / 1e9
                rates[way].append(rate)
                print(f"round {rnd + 1} {way if way == 'whole' else f'{way} MiB'}: {nbytes / 2**20:.0f} MiB, {rate:.3f} GB/s",
                      flush=True)
    print(f"one request: median {statistics.median(rates['whole']):.2f} GB/s")
    for way in ways[1:]:
        ratios = [c / w for c, w in zip(rates[way], rates["whole"])]
        print(f"{way} MiB / one request: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
