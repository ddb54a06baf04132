"""What checking the integrity manifest costs per expert read.

Three measurements on one model (its manifest is written first if it has none):

1. hashing alone: XXH3-128 (what colibri uses) and, if the ``blake3`` package is
   installed, BLAKE3 single-threaded, over every expert's bytes held in memory (MB/s);
2. uncached expert reads through a ``Drive`` (the page cache dropped for the shards
   first, and fadvise(DONTNEED) after every read, as the store reads), with and without
   the manifest check, interleaved rounds: MB/s of each and the overhead per read;
3. decode through a full mirror on the same disk (declared fast, so it serves nearly
   every expert) with and without the manifest beside the model: tok/s, interleaved.

    python benchmarks/integrity_cost.py --model /data/olmoe-syn --reads 400 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

import colibri_core
from colibri_core.io import integrity
from colibri_core.io.checkpoint import Checkpoint, merge_ranges
from colibri_core.io.drives import Drive
from colibri_core.io.pagecache import drop_page_cache
from colibri_core.model.blueprint import inspect_model


def experts_of(model_dir: Path) -> list[list]:
    bp = inspect_model(model_dir)
    try:
        return [list(m.values()) for decl in bp.moe for m in decl.matrices]
    finally:
        bp.close()


def hash_speed(checkpoint: Checkpoint, experts: list[list], limit: int) -> dict:
    """MB/s of each hash over expert bytes already in memory."""
    data = [checkpoint.read_many(e) for e in experts[:limit]]
    buffers = [np.ascontiguousarray(a).view(np.uint8) for d in data for a in d.values()]
    total = sum(b.nbytes for b in buffers)
    hashes = {"xxh3_128": lambda b: xxhash.xxh3_128_hexdigest(memoryview(b))}
    try:
        import blake3

        hashes["blake3 (1 thread)"] = lambda b: blake3.blake3(memoryview(b)).hexdigest()
    except ImportError:
        pass
    out = {}
    for name, fn in hashes.items():
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for b in buffers:
                fn(b)
            best = min(best, time.perf_counter() - started)
        out[name] = total / best / 1e6
    return out


class TimedManifest:
    """The manifest, timing its checks (the hashing) apart from the reads."""

    def __init__(self, manifest):
        self.manifest, self.seconds = manifest, 0.0

    def check(self, info, data, where):
        started = time.perf_counter()
        self.manifest.check(info, data, where)
        self.seconds += time.perf_counter() - started


def read_round(checkpoint: Checkpoint, experts: list[list], manifest) -> tuple[float, int]:
    for sf in checkpoint.files.values():
        drop_page_cache(sf.path)
    drive = Drive("primary", {sf.path: sf.path for sf in checkpoint.files.values()}, integrity=manifest)
    nbytes = 0
    started = time.perf_counter()
    try:
        for infos in experts:
            for group in merge_ranges(infos):
                nbytes += sum(a.nbytes for a in drive.read(group).values())
    finally:
        drive.close()
    return time.perf_counter() - started, nbytes


def decode_speed(model_dir: Path, mirror: Path, ram: str, tokens: int) -> float:
    with colibri_core.load(model_dir, ram=ram, mirrors=[f"{mirror}@64G"], history=False) as model:
        result = model.generate(token_ids=list(range(5, 37)), max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=0)
        assert result.stats.bytes_read_by_drive[str(mirror)] > 0.9 * result.stats.bytes_read
        return result.stats.decode_tok_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--reads", type=int, default=400, help="experts read per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ram", default="600M", help="RAM budget of the decode runs (small: experts stream)")
    parser.add_argument("--tokens", type=int, default=24)
    a = parser.parse_args()

    with Checkpoint(a.model) as checkpoint:
        if integrity.Manifest.read(checkpoint) is None:
            started = time.perf_counter()
            integrity.write(checkpoint)
            print(f"wrote {a.model / integrity.MANIFEST_NAME} in {time.perf_counter() - started:.1f} s")
        manifest = integrity.Manifest.read(checkpoint)
        experts = experts_of(a.model)
        rng = np.random.default_rng(0)
        sample = [experts[i] for i in rng.choice(len(experts), size=min(a.reads, len(experts)), replace=False)]
        print(f"{len(sample)} experts of {sum(t.nbytes for t in sample[0]) / 2**20:.2f} MiB each")
        for name, speed in hash_speed(checkpoint, sample, 64).items():
            print(f"hash in memory: {name} {speed:,.0f} MB/s")
        plain, checked, hashing = [], [], []
        for _ in range(a.rounds):
            seconds, nbytes = read_round(checkpoint, sample, None)
            plain.append(nbytes / seconds / 1e6)
            timed = TimedManifest(manifest)
            seconds, nbytes = read_round(checkpoint, sample, timed)
            checked.append(nbytes / seconds / 1e6)
            hashing.append(timed.seconds / seconds)
        p, c = statistics.median(plain), statistics.median(checked)
        print(f"uncached reads: {p:,.0f} MB/s unchecked, {c:,.0f} MB/s checked (medians of {a.rounds}: "
              f"{[round(x) for x in plain]} / {[round(x) for x in checked]})")
        print(f"hashing took {statistics.median(hashing):.1%} of the checked reads' time "
              f"(per round: {', '.join(f'{h:.1%}' for h in hashing)})")

    with tempfile.TemporaryDirectory(dir=a.model.parent) as tmp:
        mirror = Path(tmp) / "mirror"
        mirror.mkdir()
        for shard in a.model.glob("*.safetensors"):
            shutil.copy(shard, mirror / shard.name)
        manifest_path = a.model / integrity.MANIFEST_NAME
        aside = Path(tmp) / "manifest-aside.json"
        without, with_ = [], []
        for _ in range(a.rounds):
            os.replace(manifest_path, aside)
            try:
                without.append(decode_speed(a.model, mirror, a.ram, a.tokens))
            finally:
                os.replace(aside, manifest_path)
            with_.append(decode_speed(a.model, mirror, a.ram, a.tokens))
        w, v = statistics.median(without), statistics.median(with_)
        print(f"decode via a mirror: {w:.2f} tok/s unverified, {v:.2f} tok/s verified (medians of {a.rounds}: "
              f"{[round(x, 2) for x in without]} / {[round(x, 2) for x in with_]}); {v / w - 1:+.1%}")


if __name__ == "__main__":
    main()
