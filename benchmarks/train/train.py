"""Train a small MoE language model on CPU, reproducibly, and report on it.

    python benchmarks/train/train.py olmoe --out DIR [--steps N] [--seed 0]

Builds (once, under --work) the corpus and the tokenizer, trains the recipe's model with
transformers' own modelling code, saves it with ``save_pretrained`` in bf16 beside its
tokenizer, and writes ``training.json``: the command, machine, corpus and weight hashes,
training tokens and wall time, validation perplexity per domain beside a unigram
baseline, expert-load balance per layer and a greedy sample per domain.

Same machine, same seed, same step count: same weights (torch runs deterministic
algorithms on a fixed thread count). Not part of colibri; needs torch + transformers
(the test extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/: hostinfo

import numpy as np  # noqa: E402

import corpus as corpus_mod  # noqa: E402
import tokenizer as tokenizer_mod  # noqa: E402
from hostinfo import cpu_name  # noqa: E402
from models import RECIPES, SEQ_LEN, mtp_module  # noqa: E402

DEFAULT_WORK = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "colibri" / "train"
EVAL_WINDOWS = 48  # per domain, SEQ_LEN tokens each
SAMPLE_PROMPTS = {
    "python": "def read_config(path):\n",
    "c": "#include <stdio.h>\n\nstatic int",
    "prose": "The function returns",
    "data": '{\n  "pagination": {\n',
}


def log(msg: str) -> None:
    print(msg, flush=True)


def _file_hash(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def prepare(work: Path):
    """The corpus, the tokenizer and each split's token ids (built once, reused)."""
    corpus_dir = work / "corpus"
    if not (corpus_dir / "manifest.json").exists():
        log(f"building the corpus in {corpus_dir}")
        corpus_mod.build(corpus_dir, log=log)
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    tok_dir = work / f"tokenizer-{manifest['sha256'][:12]}"
    if not (tok_dir / "tokenizer.json").exists():
        log(f"training the tokenizer in {tok_dir}")
        tokenizer_mod.train(corpus_dir, tok_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids_dir = tok_dir / "ids"
    ids_dir.mkdir(exist_ok=True)
    tokens = {}
    for domain in corpus_mod.DOMAINS:
        for split in ("train", "valid"):
            path = ids_dir / f"{domain}.{split}.npy"
            if not path.exists():
                text = (corpus_dir / f"{domain}.{split}.txt").read_text(encoding="utf-8")
                docs = text.split(corpus_mod.DOC_SEPARATOR)
                eos = tok.token_to_id(corpus_mod.DOC_SEPARATOR)
                ids = []
                for enc in tok.encode_batch(docs):
                    ids.extend(enc.ids)
                    ids.append(eos)
                np.save(path.with_suffix(".tmp.npy"), np.asarray(ids, dtype=np.uint16))
                os.replace(path.with_suffix(".tmp.npy"), path)
            tokens[(domain, split)] = np.load(path)
    return manifest, tok_dir, tokens


def domain_weights(tokens) -> dict[str, float]:
    # sqrt of each domain's size: the small domains (prose) are seen a few times over,
    # the large one (Python) is not allowed to crowd them out
    raw = {d: math.sqrt(len(tokens[(d, "train")])) for d in corpus_mod.DOMAINS}
    total = sum(raw.values())
    return {d: v / total for d, v in raw.items()}


def batches(tokens, weights, steps: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    domains = list(weights)
    p = np.array([weights[d] for d in domains])
    for _ in range(steps):
        rows = []
        for d in rng.choice(len(domains), size=batch, p=p):
            ids = tokens[(domains[d], "train")]
            start = int(rng.integers(0, len(ids) - SEQ_LEN))
            rows.append(ids[start:start + SEQ_LEN].astype(np.int64))
        yield np.stack(rows)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class RoutingRecorder:
    """The experts each router chose in the last forward (OLMoE's and DeepSeek-V3's
    routers both return the chosen indices third), for load statistics and for
    DeepSeek-V3's auxiliary-loss-free balancing."""

    def __init__(self, model, mtp=None):
        import torch

        self.routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
        if mtp is not None:
            self.routers += [m for m in mtp.modules() if type(m).__name__.lower().endswith("topkrouter")]
        self.chosen: dict[int, list] = {}
        self.counting = True
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))
        self._torch = torch

    def _hook(self, i):
        def hook(module, inputs, output):
            self.chosen.setdefault(i, []).append(output[2].detach().reshape(-1))
        return hook

    def loads(self, num_experts: int) -> np.ndarray:
        """Per router, how often each expert was chosen since the last call."""
        out = np.zeros((len(self.routers), num_experts), dtype=np.int64)
        for i, picks in self.chosen.items():
            for p in picks:
                out[i] += np.bincount(p.numpy(), minlength=num_experts)
        self.chosen = {}
        return out

    def update_biases(self, rate: float) -> None:
        if not rate:
            self.chosen = {}
            return
        # DeepSeek-V3: raise the bias of under-loaded experts, lower the over-loaded ones'
        loads = self.loads(self.routers[0].e_score_correction_bias.numel())
        with self._torch.no_grad():
            for router, load in zip(self.routers, loads):
                sign = np.sign(load.mean() - load).astype(np.float32)
                router.e_score_correction_bias += rate * self._torch.from_numpy(sign)


def training_loss(model, mtp, x, recipe) -> dict:
    import torch.nn.functional as F

    if mtp is None:
        out = model(input_ids=x, labels=x)
        return {"loss": out.loss, "aux": out.aux_loss} if out.aux_loss is not None else {"loss": out.loss}
    main, mtp_logits = forward_with_mtp(model, mtp, x)
    vocab = main.shape[-1]
    main_loss = F.cross_entropy(main[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
    mtp_loss = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, vocab), x[:, 2:].reshape(-1))
    return {"loss": main_loss + recipe.mtp_weight * mtp_loss, "main": main_loss, "mtp": mtp_loss}


def forward_with_mtp(model, mtp, x):
    """Main logits for every position, and the MTP layer's logits for positions
    0..T-2 (each predicting the token two ahead)."""
    import torch

    hidden = model.model(input_ids=x).last_hidden_state
    logits = model.lm_head(hidden)
    positions = torch.arange(x.shape[1] - 1).unsqueeze(0)
    nxt = model.model.embed_tokens(x[:, 1:])
    rope = model.model.rotary_emb(nxt, positions)
    mtp_hidden = mtp(hidden[:, :-1], nxt, rope, positions)
    return logits, model.lm_head(mtp_hidden)


def evaluate(model, tokens, tok, mtp=None) -> dict:
    """Validation perplexity per domain beside a unigram baseline, expert load per layer,
    the MTP layer's accuracy, and a greedy sample per domain."""
    import torch
    import torch.nn.functional as F

    model.eval()
    vocab = model.config.vocab_size
    num_experts = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
    routing = RoutingRecorder(model, mtp)
    result = {"perplexity": {}, "unigram_perplexity": {}, "validation_tokens": {}}
    if mtp is not None:
        result["mtp_top1_accuracy"], result["mtp_agrees_with_main"] = {}, {}
    loads = np.zeros((len(routing.routers), num_experts), dtype=np.int64)
    with torch.no_grad():
        for domain in corpus_mod.DOMAINS:
            valid = tokens[(domain, "valid")]
            n = min(EVAL_WINDOWS, len(valid) // SEQ_LEN)
            x = torch.from_numpy(valid[: n * SEQ_LEN].astype(np.int64).reshape(n, SEQ_LEN))
            nll, count, mtp_hits, agree = 0.0, 0, 0, 0
            for i in range(0, n, 8):
                xb = x[i:i + 8]
                if mtp is None:
                    logits = model(input_ids=xb).logits.float()
                else:
                    logits, mtp_logits = forward_with_mtp(model, mtp, xb)
                    # the draft for token i+2 against the text, and against the main model's own
                    # prediction at i+1 (what greedy verification would accept on this text)
                    draft = mtp_logits[:, :-1].argmax(-1)
                    mtp_hits += int((draft == xb[:, 2:]).sum())
                    agree += int((draft == logits[:, 1:-1].argmax(-1)).sum())
                target = xb[:, 1:]
                nll += float(F.cross_entropy(logits[:, :-1].reshape(-1, vocab), target.reshape(-1), reduction="sum"))
                count += target.numel()
                loads += routing.loads(num_experts)
            result["perplexity"][domain] = round(math.exp(nll / count), 3)
            result["validation_tokens"][domain] = count
            if mtp is not None:
                drafts = n * (SEQ_LEN - 2)
                result["mtp_top1_accuracy"][domain] = round(mtp_hits / drafts, 4)
                result["mtp_agrees_with_main"][domain] = round(agree / drafts, 4)
            # the unigram baseline: the domain's own training frequencies (add-one smoothed)
            freq = np.bincount(tokens[(domain, "train")], minlength=vocab).astype(np.float64) + 1.0
            logp = np.log(freq / freq.sum())
            result["unigram_perplexity"][domain] = round(math.exp(-logp[x[:, 1:].numpy().reshape(-1)].mean()), 3)
        share = loads / loads.sum(axis=1, keepdims=True)
        entropy = -(share * np.log(np.maximum(share, 1e-12))).sum(axis=1) / math.log(share.shape[1])
        result["expert_load"] = {
            "routers": len(routing.routers),
            "max_over_mean": [round(float(v), 3) for v in share.max(axis=1) * share.shape[1]],
            "min_over_mean": [round(float(v), 3) for v in share.min(axis=1) * share.shape[1]],
            "normalised_entropy": [round(float(v), 4) for v in entropy],
        }
        samples = {}
        for domain, prompt in SAMPLE_PROMPTS.items():
            ids = torch.tensor([tok.encode(prompt).ids])
            out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
            samples[domain] = tok.decode(out[0].tolist())
            routing.loads(num_experts)
        result["greedy_samples"] = samples
    return result


MTP_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


def save(model, mtp, tok_dir: Path, out: Path) -> str:
    """The model in bf16 as ``save_pretrained`` writes it, plus (DeepSeek-V3) the MTP
    layer as ``model.layers.{N}.*`` in the same file, as the published checkpoints have it:
    its decoder layer in the layout transformers writes for layer N, its own norms and
    projection, and copies of the embedding and LM head it shares."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    model.to(torch.float32)
    if mtp is not None:
        weights = tmp / "model.safetensors"
        tensors = load_file(weights)
        n = model.config.num_hidden_layers
        # the decoder layer's names as transformers saves layer n: save a model one layer deeper
        from transformers import AutoModelForCausalLM

        probe = AutoModelForCausalLM.from_config(copy_config(model.config, num_hidden_layers=n + 1))
        probe.model.layers[n].load_state_dict(mtp.block.state_dict())
        layer_dir = tmp / "mtp-layer"
        probe.to(torch.bfloat16).save_pretrained(layer_dir, safe_serialization=True)
        block = {k: v for k, v in load_file(layer_dir / "model.safetensors").items() if k.startswith(f"model.layers.{n}.")}
        shutil.rmtree(layer_dir)
        own = {f"model.layers.{n}.{name}.weight": getattr_path(mtp, name).weight.detach().to(torch.bfloat16).clone()
               for name in MTP_OWN}
        shared = {f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                  f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"].clone()}
        save_file({**tensors, **block, **own, **shared}, weights, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp / name)
    eos = [0, 2]  # <|endoftext|>, <|im_end|>
    GenerationConfig(eos_token_id=eos, pad_token_id=0, do_sample=False).save_pretrained(tmp)
    weights = sorted(tmp.glob("*.safetensors"))
    digest = hashlib.sha256("".join(_file_hash(p) for p in weights).encode()).hexdigest()
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return digest


def load_saved(out: Path):
    """The saved model (and MTP layer) back in float32: what is evaluated is what users get."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the MTP tensors are "unexpected" to the main model: expected here
    config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    mtp = None
    if getattr(config, "num_nextn_predict_layers", 0) and config.model_type == "deepseek_v3":
        n = config.num_hidden_layers
        tensors = load_file(out / "model.safetensors")
        deeper = copy_config(config, num_hidden_layers=n + 1)
        deeper._experts_implementation = "grouped_mm"
        block_dir = out.with_name(out.name + ".mtp-probe")
        from safetensors.torch import save_file
        import shutil

        # transformers reads layer n's decoder layer (in whatever layout it saved it) when
        # the model is one layer deeper; the MTP's own tensors are read by name
        save_file({k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{n}.")
                   or not any(k.startswith(f"model.layers.{n}.{m}") for m in MTP_OWN + ("embed_tokens", "shared_head"))},
                  block_dir.with_suffix(".safetensors"), metadata={"format": "pt"})
        block_dir.mkdir(exist_ok=True)
        os.replace(block_dir.with_suffix(".safetensors"), block_dir / "model.safetensors")
        deeper.save_pretrained(block_dir)
        probe = AutoModelForCausalLM.from_pretrained(block_dir, dtype=torch.float32)
        shutil.rmtree(block_dir)
        mtp = mtp_module(config)
        mtp.block = probe.model.layers[n]
        for name in MTP_OWN:
            getattr_path(mtp, name).weight.data.copy_(tensors[f"model.layers.{n}.{name}.weight"].float())
        mtp.eval()
    model.eval()
    return model, mtp


def copy_config(config, **changes):
    new = type(config).from_dict({**config.to_dict(), **changes})
    return new


def getattr_path(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="corpus, tokenizer and token ids")
    parser.add_argument("--steps", type=int, help="training steps (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evaluate-only", action="store_true", help="re-evaluate the model already in --out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    recipe = RECIPES[args.recipe]
    steps = args.steps or recipe.steps
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    manifest, tok_dir, tokens = prepare(args.work)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    if args.evaluate_only:
        return report_on(args.out, tokens, tok, args.work / "corpus")
    weights = domain_weights(tokens)
    log(f"domains (train tokens, weight): " + ", ".join(
        f"{d} {len(tokens[(d, 'train')]) / 1e6:.2f} M {w:.2f}" for d, w in weights.items()))

    torch.manual_seed(args.seed)
    config = recipe.config()
    config._experts_implementation = "grouped_mm"  # 3x eager's speed on CPU, same arithmetic
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mtp = None
    if recipe.mtp_weight:
        mtp = mtp_module(config)
        mtp.apply(model._init_weights)
    routing = RoutingRecorder(model, mtp)
    trained = list(model.named_parameters()) + ([(f"mtp.{n}", p) for n, p in mtp.named_parameters()] if mtp else [])
    params = sum(p.numel() for _, p in trained)
    log(f"{recipe.name}: {params / 1e6:.2f} M parameters, {steps} steps of {recipe.batch} x {SEQ_LEN} tokens")
    decay = [p for n, p in trained if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in trained if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    start = time.time()
    history = []
    for step, batch in enumerate(batches(tokens, weights, steps, recipe.batch, args.seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, recipe.lr, recipe.warmup)
        x = torch.from_numpy(batch)
        losses = training_loss(model, mtp, x, recipe)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        routing.update_biases(recipe.bias_update)
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.time() - start
            rate = (step + 1) * recipe.batch * SEQ_LEN / elapsed
            eta = elapsed / (step + 1) * (steps - step - 1)
            shown = {k: round(float(v.detach()), 4) for k, v in losses.items()}
            history.append({"step": step, **shown})
            log(f"step {step + 1}/{steps}  " + "  ".join(f"{k} {v:.3f}" for k, v in shown.items())
                + f"  {rate:.0f} tok/s  {elapsed / 60:.1f} min, {eta / 60:.1f} min to go")
    wall = time.time() - start
    digest = save(model, mtp, tok_dir, args.out)
    report = {
        "command": " ".join(["python benchmarks/train/train.py"] + (argv if argv is not None else sys.argv[1:])),
        "recipe": recipe.name, "model_type": recipe.model_type, "seed": args.seed, "steps": steps,
        "threads": recipe.threads, "parameters": params,
        "training_tokens": steps * recipe.batch * SEQ_LEN, "wall_s": round(wall, 1),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "corpus_sha256": manifest["sha256"], "tokenizer_sha256": _file_hash(tok_dir / "tokenizer.json"),
        "weights_sha256": digest, "domain_weights": weights, "loss_history": history,
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"weights sha256 {digest}; wall {wall / 60:.1f} min")
    return report_on(args.out, tokens, tok, args.work / "corpus")


HELDOUT_CHARS = 48_000  # per domain: whole validation documents up to this many characters


def write_heldout(out: Path, corpus_dir: Path) -> None:
    """A sample of each domain's validation text (whole documents) as ``heldout/NAME.txt``
    in the model directory, for ``colibri eval --domain`` and ``convert --report``, with
    the files it came from and their licences in ``heldout/SOURCES.json``."""
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    heldout = out / "heldout"
    heldout.mkdir(exist_ok=True)
    sources = {}
    for domain in corpus_mod.DOMAINS:
        docs = (corpus_dir / f"{domain}.valid.txt").read_text(encoding="utf-8").split(
            "\n" + corpus_mod.DOC_SEPARATOR + "\n")
        taken, size = [], 0
        for doc in docs:
            room = HELDOUT_CHARS - size
            if len(doc) > room:
                # the rest of the room from a document too long for it, cut at a line's end
                doc = doc[:doc.rfind("\n", 0, room) + 1]
                if doc:
                    taken.append(doc)
                    size += len(doc)
                break
            taken.append(doc)
            size += len(doc)
        (heldout / f"{domain}.txt").write_text(("\n" + corpus_mod.DOC_SEPARATOR + "\n").join(taken), encoding="utf-8")
        valid = [f for f in manifest["files"] if f["domain"] == domain and f["split"] in ("valid", "both")]
        sources[domain] = [{"path": f["path"], "license": f["license"], "sha256": f["sha256"]} for f in valid[:len(taken)]]
    (heldout / "SOURCES.json").write_text(json.dumps(sources, indent=1) + "\n")


def report_on(out: Path, tokens, tok, corpus_dir: Path) -> int:
    """Evaluate the saved model and add the figures to its training.json."""
    write_heldout(out, corpus_dir)
    # the models are shipped as package data (colibri-trained): colibri keeps its routing
    # history for them in its cache dir, never in the package
    (out / "colibri-read-only").write_text("")
    for path in [out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # package data: readable by every user
    log("evaluating the saved model")
    model, mtp = load_saved(out)
    metrics = evaluate(model, tokens, tok, mtp)
    path = out / "training.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report.update(metrics)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)
    for d in corpus_mod.DOMAINS:
        extra = f", MTP top-1 {metrics['mtp_top1_accuracy'][d]:.3f}" if mtp is not None else ""
        log(f"{d}: validation perplexity {metrics['perplexity'][d]:.2f} "
            f"(unigram {metrics['unigram_perplexity'][d]:.1f}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
