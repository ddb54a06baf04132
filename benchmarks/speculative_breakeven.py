"""Speculative decoding's break-even map: decode speed with drafts over acceptance rate x
draft depth x expert budget, against no drafts in the same process.

The acceptance rate is the controlled variable here: a draft source that knows the
continuation (the run without drafts made it) drafts each token right with probability
``p`` (else a random token), so what is measured is the cost side: the verification's
rows, the union of their experts read from disk, the rejected drafts' extra reads. What
acceptance a real source gets comes from trained models (``--ngram``: prompt lookup on
the trained OLMoE-geometry model, on a code-copying prompt; ``--p mtp``: the model's own
MTP layer, loaded with it). Tokens are checked equal to the run without drafts in every row.

    .venv/bin/python benchmarks/speculative_breakeven.py --model /work/models/olmoe-r75-q4q4 \\
        --ram 8G --ram 1.5G --p 0 0.5 0.8 1 --depth 2 4 --tokens 32

Each budget runs in a fresh process (a memory cgroup with ``--cgroup``); experts are
read with O_DIRECT, so a miss is a disk read, not a page-cache copy. Within a process:
one warm-up run, then no-draft and drafted runs interleaved, each repeated; medians.
Writes JSON and Markdown to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.hostinfo import write_record  # noqa: E402
from benchmarks.trace_streaming import git_head, machine  # noqa: E402


class ControlledSource:
    """Drafts the known continuation, each token right with probability ``p``; with
    ``gated``, behind the DraftGate of ``--draft auto``."""

    name = "controlled"

    def __init__(self, prompt, continuation, p: float, vocab: int, seed: int = 0, gated: bool = False):
        self.script, self.start = [*prompt, *continuation], len(prompt)
        self.p, self.vocab, self.gated = p, vocab, gated
        self.rng = np.random.default_rng(seed)

    def new_drafter(self):
        return self

    def propose(self, tokens, k):
        n = len(tokens)
        if tokens[: self.start] != self.script[: self.start] or n >= len(self.script):
            return []
        out = []
        for at in range(n, min(n + k, len(self.script))):
            right = self.rng.random() < self.p
            out.append(self.script[at] if right else int(self.rng.integers(self.vocab)))
        return out


def copy_prompt(heldout: Path, chars: int = 1500, restart: int = 200) -> str:
    """A code-copying task: the first ``chars`` characters of a held-out file, then the
    request to write it again and its first ``restart`` characters (the model goes on)."""
    source = heldout.read_text()[:chars]
    return source + "\n\n# The same code again, unchanged:\n\n" + source[:restart]


def one_run(model, prompt, tokens, seed, draft=None, depth=4, temperature=1.0) -> dict:
    started = time.perf_counter()
    result = model.generate(token_ids=prompt, max_tokens=tokens, ignore_eos=True, temperature=temperature, seed=seed,
                            draft=draft, draft_depth=depth)
    s = result.stats
    return {"token_ids": result.token_ids, "decode_tok_s": s.decode_tok_s, "tokens_per_forward": s.tokens_per_forward,
            "acceptance": s.draft_acceptance if s.drafted_tokens else None, "drafted": s.drafted_tokens,
            "decode_mib_per_token": s.decode_bytes_read / max(1, s.generated_tokens - 1) / 2**20,
            "hit_rate": s.hit_rate, "wall_s": time.perf_counter() - started}


def child(spec: dict) -> dict:
    import colibri_core
    from colibri_core.cli.bench import prompt_ids

    rows = []
    with colibri_core.load(spec["model"], ram=spec["ram"], direct_io=True, history=False, mtp="mtp" in spec["ps"]) as model:
        if spec.get("copy_heldout"):
            prompt = model.encode(copy_prompt(Path(spec["model"]) / "heldout" / f"{spec['copy_heldout']}.txt"))
        elif spec.get("prompt_file"):
            prompt = model.encode(Path(spec["prompt_file"]).read_text())
        else:
            prompt = prompt_ids(model.lm.vocab_size, spec["prompt_tokens"], 0)
        tokens, seed, temperature = spec["tokens"], 1, spec["temperature"]
        one_run(model, prompt, tokens, seed, temperature=temperature)  # warm-up: the LRU and the allocator settle
        for repeat in range(spec["repeats"]):
            plain = one_run(model, prompt, tokens, seed, temperature=temperature)
            rows.append({"p": None, "depth": 0, "repeat": repeat, **plain})
            for depth in spec["depths"]:
                for p in spec["ps"]:
                    for gated in (False, True) if spec["gate"] else (False,):
                        if p in ("ngram", "mtp"):
                            if gated and p == "mtp":
                                continue  # auto gates prompt lookup only
                            source = "auto" if gated else p
                        else:
                            source = ControlledSource(prompt, plain["token_ids"], p, model.lm.vocab_size, seed=repeat,
                                                      gated=gated)
                        run = one_run(model, prompt, tokens, seed, draft=source, depth=depth, temperature=temperature)
                        if run["token_ids"] != plain["token_ids"]:
                            raise RuntimeError(f"p={p} depth={depth}: other tokens with drafts than without")
                        label = f"{p} auto" if gated else p
                        rows.append({"p": label, "depth": depth, "repeat": repeat, **run})
    for r in rows:
        del r["token_ids"]
    return {"ram": spec["ram"], "rows": rows, "prompt_tokens": len(prompt)}


def summarise(budget: dict) -> list[dict]:
    rows = budget["rows"]
    plain = statistics.median(r["decode_tok_s"] for r in rows if r["depth"] == 0)
    out = [{"ram": budget["ram"], "p": "off", "depth": 0, "decode_tok_s": plain, "ratio": 1.0,
            "tokens_per_forward": 1.0, "acceptance": None,
            "decode_mib_per_token": statistics.median(r["decode_mib_per_token"] for r in rows if r["depth"] == 0)}]
    keys = sorted({(str(r["p"]), r["depth"]) for r in rows if r["depth"]}, key=lambda k: (k[1], k[0]))
    for p, depth in keys:
        mine = [r for r in rows if str(r["p"]) == p and r["depth"] == depth]
        speed = statistics.median(r["decode_tok_s"] for r in mine)
        acc = [r["acceptance"] for r in mine if r["acceptance"] is not None]
        out.append({"ram": budget["ram"], "p": p, "depth": depth, "decode_tok_s": speed, "ratio": speed / plain,
                    "tokens_per_forward": statistics.median(r["tokens_per_forward"] for r in mine),
                    "acceptance": statistics.median(acc) if acc else None,
                    "decode_mib_per_token": statistics.median(r["decode_mib_per_token"] for r in mine)})
    return out


def markdown(report: dict) -> str:
    lines = [f"# Speculative decoding break-even, {report['date']}", "",
             f"`{report['command']}`", "",
             f"Machine: {report['machine']}; commit {report['commit']}; experts read with O_DIRECT; "
             f"cgroup: {report['cgroup'] or 'none'}; temperature {report['temperature']}; {report['tokens']} tokens per "
             f"run, {report['repeats']} repeats, "
             "medians; tokens checked equal to the run without drafts in every row.", "",
             "| RAM budget | draft p | depth | decode tok/s | vs off | tokens / forward | acceptance | MiB read / token |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["summary"]:
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        lines.append(f"| {r['ram']} | {r['p']} | {r['depth'] or '-'} | {r['decode_tok_s']:.2f} | {r['ratio']:.2f}x | "
                     f"{r['tokens_per_forward']:.2f} | {acc} | {r['decode_mib_per_token']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ram", action="append", required=True, help="an expert budget (repeat for several)")
    ap.add_argument("--p", nargs="+", default=["0", "0.5", "0.8", "1"],
                    help="draft accuracies to measure, 'ngram' for prompt lookup, 'mtp' for the model's MTP layer")
    ap.add_argument("--depth", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--prompt-file", default=None, help="a text prompt (the model's tokenizer) instead of random ids")
    ap.add_argument("--copy-heldout", default=None, metavar="DOMAIN",
                    help="a code-copying prompt from the model's heldout/DOMAIN.txt (a trained model's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gate", action="store_true", help="also each source behind --draft auto's gate")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="sampling temperature (seeded; 0: greedy). Random-weight models want 1: greedy, they repeat one token")
    ap.add_argument("--cgroup", default=None, help="memory cgroup size per budget's process (e.g. 3G; needs root)")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    from colibri_core.cli.bench import run_json_child
    from colibri_core.units import parse_size

    ps = [p if p in ("ngram", "mtp") else float(p) for p in a.p]
    budgets = []
    for ram in a.ram:
        spec = {"model": a.model, "ram": ram, "ps": ps, "depths": a.depth, "tokens": a.tokens,
                "prompt_tokens": a.prompt_tokens, "prompt_file": a.prompt_file, "copy_heldout": a.copy_heldout,
                "repeats": a.repeats, "temperature": a.temperature, "gate": a.gate}
        run = run_json_child([sys.executable, str(Path(__file__).resolve()), "child", json.dumps(spec)],
                             cgroup=parse_size(a.cgroup) if a.cgroup else None)
        if "error" in run:
            raise SystemExit(f"budget {ram}: {run['error']}\n" + "\n".join(run.get("stderr_tail", [])))
        budgets.append(run)
        print(markdown({"summary": summarise(run), "date": "", "command": "", "machine": "", "commit": "",
                        "cgroup": a.cgroup, "tokens": a.tokens, "repeats": a.repeats, "temperature": a.temperature}),
              flush=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    report = {"date": stamp, "command": " ".join(["benchmarks/speculative_breakeven.py", *(argv or sys.argv[1:])]),
              "machine": machine(), "commit": git_head(), "cgroup": a.cgroup, "tokens": a.tokens, "temperature": a.temperature,
              "repeats": a.repeats, "budgets": budgets, "summary": [r for b in budgets for r in summarise(b)]}
    write_record(Path(a.out), f"{stamp}-speculative-{Path(a.model).name}", report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
