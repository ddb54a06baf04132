"""What constrained decoding costs: llguidance's token mask per token for a 20-property
JSON Schema on an 8k and a 150k vocabulary, and decode speed with a schema against
without on the resident demo model (the trained OLMoE-geometry one).

    .venv/bin/python benchmarks/constraint_cost.py --tokens 64 --repeats 5

The 8k vocabulary is colibri-trained's tokenizer; no 150k tokenizer ships offline, so a
byte-level BPE of 150k tokens is trained (``tokenizers``) on this Python installation's
standard library sources (code-heavy, like the 150k vocabularies of Qwen or DeepSeek in
that it holds many long identifiers and whitespace runs). The mask is timed the way the
engine computes it (``Constraint.allowed``: llguidance's bitmask, unpacked to a bool per
token) while a valid instance of the schema is consumed token by token. Decode speed:
the same prompt and token budget with a schema whose one string property (minLength 1000) is long enough
to last the whole run, and without, interleaved, medians. Writes JSON and Markdown to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.hostinfo import write_record  # noqa: E402
from benchmarks.trace_streaming import git_head, machine  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        **{f"name_{i}": {"type": "string"} for i in range(5)},
        **{f"count_{i}": {"type": "integer"} for i in range(5)},
        **{f"ratio_{i}": {"type": "number"} for i in range(3)},
        **{f"flag_{i}": {"type": "boolean"} for i in range(3)},
        "kind": {"enum": ["module", "script", "package", "test"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                  "required": ["id"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": [f"name_{i}" for i in range(5)] + [f"count_{i}" for i in range(5)] + ["kind", "owner"],
    "additionalProperties": False,
}
INSTANCE = {**{f"name_{i}": f"value number {i}" for i in range(5)}, **{f"count_{i}": 10 ** i for i in range(5)},
            **{f"ratio_{i}": 0.25 * i for i in range(3)}, **{f"flag_{i}": i % 2 == 0 for i in range(3)},
            "kind": "package", "tags": ["io", "net"], "owner": {"id": 7, "email": "a@b.org"}, "notes": None}


def big_tokenizer(vocab: int, cache: Path) -> str:
    """A byte-level BPE tokenizer of ``vocab`` tokens trained on the standard library."""
    if cache.exists():
        return cache.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.rglob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="replace") for f in files), trainer)
    text = tok.to_str()
    cache.write_text(text)
    return text


def mask_cost(tokenizer_json: str, repeats: int) -> dict:
    from tokenizers import Tokenizer

    from colibri_core.engine.constraints import ConstraintSpec, compile_constraint, grammar_tokenizer

    hf = Tokenizer.from_str(tokenizer_json)
    vocab = hf.get_vocab_size(with_added_tokens=True)
    started = time.perf_counter()
    llg_tok = grammar_tokenizer(tokenizer_json, vocab, [0])
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compile_constraint(ConstraintSpec.json_schema(SCHEMA), llg_tok, vocab)
    compile_s = time.perf_counter() - started
    ids = hf.encode(json.dumps(INSTANCE), add_special_tokens=False).ids
    times = []
    for _ in range(repeats):
        c = compiled.new()
        for t in ids:
            t0 = time.perf_counter()
            allowed = c.allowed()
            times.append(time.perf_counter() - t0)
            assert allowed[t], f"token {t} refused"
            c.advance(t)
        assert c.finished or c.matcher.is_accepting()
    us = np.asarray(times) * 1e6
    return {"vocab": vocab, "instance_tokens": len(ids), "median_us": float(np.median(us)),
            "p99_us": float(np.percentile(us, 99)), "mean_us": float(us.mean()), "tokenizer_s": tokenizer_s,
            "compile_s": compile_s}


def decode_speed(tokens: int, repeats: int) -> dict:
    import colibri_core
    from colibri_core.engine.constraints import ConstraintSpec
    from colibri_trained import path

    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}}, "required": ["text"]}
    with colibri_core.load(path("olmoe"), history=False, preload=True) as model:
        compiled = model.constraint(ConstraintSpec.json_schema(schema))
        prompt = model.encode('{"text": "def read_config(path):\\n    """Return the')
        runs = {"off": [], "schema": []}
        model.generate(token_ids=prompt, max_tokens=tokens, ignore_eos=True)  # warm-up
        for _ in range(repeats):
            for label, constraint in (("off", None), ("schema", compiled)):
                r = model.generate(token_ids=prompt, max_tokens=tokens, ignore_eos=True, constraint=constraint)
                if r.stats.generated_tokens < tokens:
                    raise RuntimeError(f"{label}: stopped after {r.stats.generated_tokens} tokens")
                runs[label].append(r.stats.decode_tok_s)
    off, on = statistics.median(runs["off"]), statistics.median(runs["schema"])
    return {"off_tok_s": off, "schema_tok_s": on, "ratio": on / off, "runs": runs}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big-vocab", type=int, default=150_000)
    ap.add_argument("--cache", default="/tmp/colibri-bpe-150k.json", help="where the trained 150k tokenizer is kept")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--decode-only", action="store_true", help="measure decode speed only, not the masks")
    a = ap.parse_args(argv)
    from colibri_trained import path

    masks = []
    if not a.decode_only:
        small = (path("olmoe") / "tokenizer.json").read_text()
        masks = [mask_cost(small, a.repeats), mask_cost(big_tokenizer(a.big_vocab, Path(a.cache)), a.repeats)]
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "commit": git_head(),
              "command": " ".join(["benchmarks/constraint_cost.py", *(argv or sys.argv[1:])]),
              "mask": masks, "decode": decode_speed(a.tokens, a.repeats)}
    lines = [f"# Constrained decoding cost, {report['date']}", "", f"`{report['command']}`", "",
             f"Machine: {report['machine']}; commit {report['commit']}; llguidance; a 20-property JSON Schema.", ""]
    if masks:
        lines += ["| vocabulary | tokens of the instance | mask median µs | p99 µs | tokenizer load s | schema compile s |",
                  "|---|---|---|---|---|---|"]
    for m in report["mask"]:
        lines.append(f"| {m['vocab']} | {m['instance_tokens']} | {m['median_us']:.1f} | {m['p99_us']:.1f} | "
                     f"{m['tokenizer_s']:.2f} | {m['compile_s']:.3f} |")
    d = report["decode"]
    lines += ["", f"Decode, trained OLMoE-geometry model resident, {a.tokens} tokens x {a.repeats} (medians): "
                  f"{d['off_tok_s']:.1f} tok/s without, {d['schema_tok_s']:.1f} with a schema: {d['ratio']:.3f}x."]
    write_record(Path(a.out), f"{report['date']}-constraint-cost", report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
