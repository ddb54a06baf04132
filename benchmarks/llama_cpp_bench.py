"""llama.cpp beside colibri, for the record (not run by CI).

Three steps, each its own subcommand, because they need different environments:

1. ``gguf`` (an environment with torch, transformers and the ``gguf`` package): convert
   an OLMoE checkpoint with the ``convert_hf_to_gguf.py`` that llama-cpp-python's sdist
   ships (``pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36``). A
   synthetic checkpoint has no tokenizer, which the converter needs: a substitute byte-level
   BPE vocabulary is written (the benchmark feeds token ids, so which vocabulary does not
   matter), and the converter's pre-tokenizer detection is told "default".
2. ``quantize`` (an environment with llama-cpp-python built from source:
   ``CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36``):
   Q8_0 -> Q4_0 through ``llama_cpp.llama_model_quantize`` (the pip build has no
   llama-quantize program).
3. ``run`` (the llama-cpp-python environment): the same measurement as ``colibri bench``:
   the same seeded 32-token prompt, prefill timed apart from loading, decode as
   (N - 1) / (time of the last token - time of the first), peak RSS, disk bytes; optionally
   in a memory cgroup after dropping the page cache.

    python benchmarks/llama_cpp_bench.py gguf --model /data/olmoe-full --sdist /tmp/llama.cpp --out /data/olmoe-q8_0.gguf
    python benchmarks/llama_cpp_bench.py quantize --gguf /data/olmoe-q8_0.gguf --out /data/olmoe-q4_0.gguf --type q4_0
    python benchmarks/llama_cpp_bench.py run --gguf /data/olmoe-q4_0.gguf --tokens 32 --repeats 3 [--cgroup 3G --cold]

``--no-repack`` keeps the weights in the mmap (``use_extra_bufts`` off): llama.cpp's CPU
repacking of Q4_0 copies them to anonymous memory, which a small cgroup cannot hold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def substitute_tokenizer(dest: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer with at most ``vocab`` tokens (the converter pads the rest)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 1024), special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["a substitute vocabulary for a benchmark that feeds token ids"] * 4, trainer=trainer)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "eos_token": "<|endoftext|>"}))


def cmd_gguf(a) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "model"
        work.mkdir()
        for item in a.model.iterdir():  # the checkpoint by links, plus a tokenizer
            if item.is_file() and not item.name.startswith("tokenizer"):
                (work / item.name).symlink_to(item.resolve())
        config = json.loads((a.model / "config.json").read_text())
        if not (a.model / "tokenizer.json").exists():
            substitute_tokenizer(work, config["vocab_size"])
        else:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if (a.model / name).exists():
                    shutil.copy(a.model / name, work / name)
        dense_out = a.out.with_name(f".{a.out.name}.dense-{os.getpid()}") if a.experts_apart else a.out
        skip = ""
        if a.experts_apart:  # the converter writes all but the routed experts
            skip = ("""
import re
_get = base.ModelBase.get_tensors
base.ModelBase.get_tensors = lambda self: ((n, t) for n, t in _get(self) if not re.search(r"\\.mlp\\.experts\\.\\d+\\.", n))
""")
        driver = f"""
import sys
sys.path.insert(0, {str(a.sdist)!r})
sys.path.insert(0, {str(a.sdist / "gguf-py")!r})
sys.argv = ["convert_hf_to_gguf.py", {str(work)!r}, "--outfile", {str(dense_out)!r}, "--outtype", {a.outtype!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # a substitute vocabulary: no known hash
{skip}
import runpy
runpy.run_path({str(a.sdist / "convert_hf_to_gguf.py")!r}, run_name="__main__")
"""
        subprocess.run([sys.executable, "-c", driver], check=True)
    if a.experts_apart:
        try:
            add_experts(dense_out, a.model, a.out, a.sdist)
        finally:
            dense_out.unlink(missing_ok=True)
    print(f"{a.out}: {a.out.stat().st_size / 1e9:.2f} GB", file=sys.stderr)


EXPERT_NAME = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def add_experts(dense: Path, model: Path, out: Path, sdist: Path | None = None) -> None:
    """``dense`` (a GGUF of everything but the routed experts) plus each MoE layer's
    ``ffn_{gate,up,down}_exps`` in Q4_0, made one expert at a time, into ``out``: the
    converter stacks a layer's experts in float32 before quantizing (15 GB per tensor at
    DeepSeek-V3's shape), this holds one quantized tensor. Q4_0 of a stack is the stack
    of each expert's Q4_0 (blocks run along the rows), so the bytes are the converter's.
    fp8 experts with ``_scale_inv`` block scales are dequantized as the converter does."""
    import re

    import numpy as np
    import torch
    from safetensors import safe_open

    if sdist is not None:  # the converter's own gguf-py (else the installed gguf package)
        sys.path.insert(0, str(sdist / "gguf-py"))
    import gguf
    from gguf.quants import quantize

    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    config = json.loads((model / "config.json").read_text())
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    experts: dict[int, int] = {}
    for name in index:
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.", name)
        if m:
            experts[int(m.group(1))] = max(experts.get(int(m.group(1)), 0), int(m.group(2)) + 1)
    handles: dict[str, object] = {}

    def tensor(name: str) -> torch.Tensor:
        shard = index[name]
        if shard not in handles:
            handles[shard] = safe_open(str(model / shard), framework="pt")
        return handles[shard].get_tensor(name)

    def expert_f32(name: str) -> np.ndarray:
        w = tensor(name)
        if name + "_scale_inv" in index:
            scale = tensor(name + "_scale_inv").float()
            for dim, size in enumerate(block):
                scale = scale.repeat_interleave(size, dim)
            w = w.float() * scale[: w.shape[0], : w.shape[1]]
        return w.float().numpy()

    reader = gguf.GGUFReader(str(dense))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    planned = []
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for layer in sorted(experts):
        for proj, gname in EXPERT_NAME.items():
            first = f"model.layers.{layer}.mlp.experts.0.{proj}.weight"
            shard = index[first]
            if shard not in handles:
                handles[shard] = safe_open(str(model / shard), framework="pt")
            rows, cols = handles[shard].get_slice(first).get_shape()
            if cols % 32:
                raise SystemExit(f"{first}: {cols} inputs, not a multiple of Q4_0's 32-weight blocks")
            shape = (experts[layer], rows, cols // 32 * 18)  # Q4_0: 18 bytes per 32 weights
            writer.add_tensor_info(f"blk.{layer}.{gname}.weight", shape, np.dtype(np.uint8), int(np.prod(shape)),
                                   gguf.GGMLQuantizationType.Q4_0)
            planned.append((layer, proj, shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    for layer, proj, shape in planned:
        stacked = np.empty(shape, dtype=np.uint8)
        for e in range(shape[0]):
            stacked[e] = quantize(expert_f32(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"),
                                  gguf.GGMLQuantizationType.Q4_0)
        writer.write_tensor_data(stacked)
        print(f"  layer {layer} {proj}: {shape[0]} experts", file=sys.stderr, flush=True)
    writer.close()
    os.replace(tmp, out)


def cmd_quantize(a) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[a.type]
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(str(a.gguf).encode(), str(a.out).encode(), params)
    if status != 0:
        raise SystemExit(f"llama_model_quantize failed with status {status}")
    print(f"{a.out}: {a.out.stat().st_size / 1e9:.2f} GB", file=sys.stderr)


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def disable_repacking() -> None:
    """Models llama.cpp loads from now on keep their weights in the mmap: its CPU repacking
    (``use_extra_bufts``) copies them to anonymous memory, which a small cgroup cannot hold.
    llama-cpp-python exposes no option for it, so its defaults are changed where
    ``llama_cpp.Llama`` (and its server) take them."""
    import llama_cpp.llama_cpp as bindings

    defaults = bindings.llama_model_default_params

    def no_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = no_repack


def one_run(gguf: str, tokens: int, prompt_tokens: int, seed: int, threads: int, repack: bool = True) -> dict:
    import llama_cpp

    if not repack:
        disable_repacking()
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_ctx=prompt_tokens + tokens + 8, verbose=False,
                          use_mmap=True)
    load_s = time.perf_counter() - started
    before = _io_read_bytes()
    timed = timed_generation(llm, tokens, prompt_tokens, seed)
    return {"engine": "llama.cpp", "repack": repack, "load_s": load_s, **timed,
            "disk_read_bytes": _io_read_bytes() - before, "peak_rss_bytes": _peak_rss()}


def last_logits(llm):
    """The logits of the last token ``llm`` evaluated. (``llm.scores`` is filled only with
    ``logits_all``: without it, it held whatever its memory held, and a row past its
    n_batch rows did not exist, so a prompt of 512 tokens failed.)"""
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy()


def timed_generation(llm, tokens: int, prompt_tokens: int, seed: int) -> dict:
    """``tokens`` tokens from a loaded ``llama_cpp.Llama`` after ``colibri bench``'s prompt
    (seeded random ids), timed as ``colibri bench`` times colibri: prefill_s,
    decode_tok_s ((tokens - 1) / time from the first token to the last), distinct_tokens.
    The model's context starts empty, so a loaded model can be timed again."""
    import numpy as np
    from colibri_core.engine.sampling import Sampler, SamplingParams

    llm.reset()
    ids = np.random.default_rng(seed).integers(0, llm.n_vocab(), prompt_tokens).tolist()
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))  # colibri's sampler: both engines pay the same for it
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    times, generated = [], []
    for _ in range(tokens):
        token = sampler(last_logits(llm))  # temperature 1, as the colibri runs
        times.append(time.perf_counter())
        generated.append(int(token))
        if len(times) == tokens:
            break
        llm.eval([token])
    return {"prefill_s": prefill_s, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "distinct_tokens": len(set(generated))}


def cmd_run(a) -> None:
    if a.child:
        print(json.dumps(one_run(str(a.gguf), a.tokens, a.prompt_tokens, a.seed, a.threads, a.repack)))
        return
    from colibri_core.cli.bench import Cgroup, drop_page_cache

    results = []
    for r in range(a.repeats):
        if a.cold:
            drop_page_cache(a.gguf.parent)
            subprocess.run(["sync"], check=False)
        group = Cgroup.create(int(a.cgroup)) if a.cgroup else None
        try:
            cmd = [sys.executable, __file__, "run", "--gguf", str(a.gguf), "--tokens", str(a.tokens), "--prompt-tokens",
                   str(a.prompt_tokens), "--seed", str(r), "--threads", str(a.threads), "--child"]
            cmd += [] if a.repack else ["--no-repack"]
            out = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=(lambda: group.add(os.getpid())) if group else None)
            result = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-500:]}
            if group:
                result["cgroup_peak_bytes"] = group.peak()
        finally:
            if group:
                group.remove()
        results.append(result)
        print(json.dumps(result), file=sys.stderr)
    ok = [x for x in results if "error" not in x]
    summary = {k: statistics.median(x[k] for x in ok) for k in ("decode_tok_s", "prefill_s", "load_s")} if ok else {}
    print(json.dumps({"gguf": str(a.gguf), "summary": summary, "runs": results}, indent=1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gguf")
    g.add_argument("--model", required=True, type=Path)
    g.add_argument("--sdist", required=True, type=Path, help="vendor/llama.cpp of the llama-cpp-python sdist")
    g.add_argument("--out", required=True, type=Path)
    g.add_argument("--outtype", default="q8_0")
    g.add_argument("--experts-apart", action="store_true",
                   help="write the routed experts one at a time as Q4_0 (the converter stacks a layer's experts "
                        "in float32 in memory, which DeepSeek-V3-sized layers do not fit)")
    q = sub.add_parser("quantize")
    q.add_argument("--gguf", required=True, type=Path)
    q.add_argument("--out", required=True, type=Path)
    q.add_argument("--type", choices=["q4_0", "q8_0"], default="q4_0")
    r = sub.add_parser("run")
    r.add_argument("--gguf", required=True, type=Path)
    r.add_argument("--tokens", type=int, default=32)
    r.add_argument("--prompt-tokens", type=int, default=32)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--cgroup", default=None, help="bytes, e.g. 3221225472")
    r.add_argument("--cold", action="store_true")
    r.add_argument("--repack", action=argparse.BooleanOptionalAction, default=True,
                   help="llama.cpp's weight repacking (--no-repack: weights stay in the mmap, which a small cgroup needs)")
    r.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    {"gguf": cmd_gguf, "quantize": cmd_quantize, "run": cmd_run}[a.command](a)


if __name__ == "__main__":
    main()
