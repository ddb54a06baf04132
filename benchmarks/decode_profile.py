"""Decode speed in one process, generation after generation, and where a token's time
goes: each compiled-kernel call of the CPU backend timed (calls per token, microseconds
per call, milliseconds per token), and what is left outside them (Python, numpy, the
store's bookkeeping, sampling). Used while developing the fast CPU path; `colibri bench`
(one generation per fresh process, beside a peer) is the record.

    python benchmarks/decode_profile.py --model DIR [--generations 4] [--tokens 64] [--prompt-tokens 1] [--breakdown]
"""

from __future__ import annotations

import argparse
import collections
import time

import colibri_core
from colibri_core.cli.bench import prompt_ids


class TimedKernels:
    """Stands in for ``colibri_core.compute.cpu._kernels`` and times every call."""

    def __init__(self, kernels):
        self._kernels = kernels
        self.calls = collections.defaultdict(lambda: [0, 0.0])

    def __getattr__(self, name):
        attr = getattr(self._kernels, name)
        if not callable(attr):
            return attr

        def timed(*args):
            started = time.perf_counter()
            try:
                return attr(*args)
            finally:
                entry = self.calls[name]
                entry[0] += 1
                entry[1] += time.perf_counter() - started

        return timed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1)
    p.add_argument("--breakdown", action="store_true", help="time each kernel call (adds a little overhead)")
    a = p.parse_args(argv)
    model = colibri_core.load(a.model, preload=True, history=False)
    timed = None
    if a.breakdown:
        if getattr(model.backend, "kernels", None) is None:
            raise SystemExit("--breakdown needs the CPU backend with its compiled kernels")
        timed = model.backend.kernels = TimedKernels(model.backend.kernels)
    ids = prompt_ids(model.lm.vocab_size, a.prompt_tokens)
    model.generate(token_ids=ids, max_tokens=4, temperature=1, seed=0, ignore_eos=True)  # warm-up
    for g in range(a.generations):
        if timed is not None:
            timed.calls.clear()
        started = time.perf_counter()
        r = model.generate(token_ids=ids, max_tokens=a.tokens, temperature=1, seed=0, ignore_eos=True)
        wall = time.perf_counter() - started
        print(f"generation {g + 1}: decode {r.stats.decode_tok_s:.2f} tok/s, prefill {r.stats.prefill_s:.3f} s "
              f"({a.prompt_tokens} tokens), {wall / a.tokens * 1e3:.2f} ms per forward pass")
        if timed is not None:
            total = 0.0
            for name, (calls, seconds) in sorted(timed.calls.items(), key=lambda kv: -kv[1][1]):
                total += seconds
                print(f"  {name:12s} {calls / a.tokens:6.1f} calls/token {seconds / calls * 1e6:9.1f} us/call "
                      f"{seconds / a.tokens * 1e3:7.2f} ms/token")
            print(f"  outside the kernels: {(wall - total) / a.tokens * 1e3:.2f} ms/token")
    model.close()


if __name__ == "__main__":
    main()
