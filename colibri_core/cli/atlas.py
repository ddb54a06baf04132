"""``colibri atlas``: the expert atlas of a model, from its routing on labelled text (one
domain per file or subdirectory of ``--prompts``), written as JSON beside the model's
routing history for ``colibri serve``'s /atlas page."""

from __future__ import annotations

import json
from pathlib import Path

import click

from colibri_core.cli.modelarg import model_option
from colibri_core.cli.run import load_with_progress, placement_kwargs, placement_options
from colibri_core.errors import UsageError

TEXT_BYTES = 64 << 20  # one prompt file; more is a corpus
HELDOUT_DIR = "heldout"  # the held-out text a model directory may carry (colibri-trained's do): the default prompts


def domain_files(prompts: Path) -> dict[str, list[Path]]:
    """Domain -> its files: each ``NAME.txt`` directly in ``prompts`` is domain NAME, each
    subdirectory a domain of every file under it (hidden names skipped)."""
    from colibri_core.io import smallfile

    if not smallfile.present(prompts):
        raise UsageError(f"--prompts {prompts}: not found")
    if not prompts.is_dir():
        raise UsageError(f"--prompts {prompts}: not a directory (give a directory of NAME.txt files or of one "
                         "subdirectory per domain)")
    domains: dict[str, list[Path]] = {}
    for child in sorted(prompts.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            files = sorted(p for p in child.rglob("*") if not any(part.startswith(".") for part in p.relative_to(child).parts)
                           and not p.is_dir())
            if not files:
                raise UsageError(f"{child}: a domain directory with no files")
            domains[child.name] = files
        elif child.suffix == ".txt":
            domains.setdefault(child.stem, []).append(child)
    if len(domains) < 2:
        found = f"only {', '.join(domains)}" if domains else "none"
        raise UsageError(f"--prompts {prompts}: an atlas compares domains, at least 2 are needed and there are {found} "
                         "(a domain is a NAME.txt file or a subdirectory of text files)")
    return domains


def read_domains(model, domains: dict[str, list[Path]], max_tokens: int, window: int):
    """Domain -> (its token windows, what was read of each file), every file checked."""
    import numpy as np

    from colibri_core.engine import perplexity as ppl
    from colibri_core.io import smallfile

    out = {}
    for name, files in domains.items():
        wins, read = [], []
        for path in files:
            text = smallfile.read_text(path, TEXT_BYTES, "prompt text")
            if not text.strip():
                raise UsageError(f"{path}: empty (a prompt file needs text)")
            ids = np.asarray(model.encode(text)[:max_tokens], dtype=np.int64)
            cut = ppl.windows(ids, window)
            if not cut:
                raise UsageError(f"{path}: too short (fewer than 2 tokens)")
            wins += cut
            read.append({"file": str(path), "tokens": int(sum(len(w) for w in cut))})
        out[name] = (wins, read)
    return out


@click.command("atlas")
@model_option()
@click.option("--prompts", "prompts_dir", default=None, metavar="DIR",
              help="Labelled text: NAME.txt files (domain NAME) or one subdirectory of text files per domain. "
                   "Default: the model directory's heldout/.")
@click.option("--max-tokens", type=click.IntRange(2), default=16384, show_default=True,
              help="Tokens read from each file at most.")
@click.option("--window", type=click.IntRange(2), default=None,
              help="Tokens per prefill window, each from an empty cache (default: 256, or the model's context if shorter).")
@click.option("--out", "out_file", default=None, metavar="FILE",
              help="Write the atlas here instead of beside the model's routing history.")
@placement_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (where it was written and the verdict).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@click.option("--progress", "show_progress", is_flag=True, help="Show progress on stderr even when it is not a terminal.")
def atlas(model_dir, prompts_dir, max_tokens, window, out_file, as_json, quiet, show_progress, **placement):
    """The expert atlas: run the model's prefill over labelled text and count, per MoE
    layer and expert, the tokens of each domain its router chose it for; per expert its
    domain shares, affinities and entropy, specialist or generalist, and whether the
    routing is specialised at all (against random routers on the same hidden states).
    Written as JSON beside the model's routing history, where colibri serve's /atlas
    page finds it."""
    from colibri_core.cli import progress
    from colibri_core.engine.domain_routing import DomainRouting
    from colibri_core.experts import atlas as atlas_file

    prompts = Path(prompts_dir) if prompts_dir is not None else Path(model_dir) / HELDOUT_DIR
    if prompts_dir is None and not prompts.is_dir():
        raise UsageError(f"--prompts: give a directory of labelled text ({model_dir} carries no {HELDOUT_DIR}/ to use)")
    domains = domain_files(prompts)
    if out_file is not None and Path(out_file).is_dir():
        raise UsageError(f"--out {out_file}: a directory; give the file to write")
    options = placement_kwargs(**placement) | {"history": False}  # an atlas run teaches the routing history nothing
    quiet_bars = quiet or as_json
    console = progress.stderr_console()
    with load_with_progress(model_dir, quiet=quiet_bars, show_progress=show_progress, **options) as model:
        if model.store is None:
            raise UsageError(f"{model_dir}: the model has no routed experts, so no atlas")
        window = window or min(256, model.lm.max_context)
        texts = read_domains(model, domains, max_tokens, window)
        total = sum(len(w) for wins, _ in texts.values() for w in wins)
        with DomainRouting(model, len(texts)) as routing, \
                progress.token_bar(console, "routing", total, quiet=quiet_bars, asked=show_progress) as advance:
            for d, (wins, _) in enumerate(texts.values()):
                routing.add(d, wins, progress=advance)
        names = list(texts)
        stats = atlas_file.build(routing.counts, routing.null, names)
        inputs = [{"name": n, "tokens": int(routing.tokens[d]), "files": read} for d, (n, (_, read)) in enumerate(texts.items())]
        doc = atlas_file.document(model, routing, inputs, stats, window=window, max_tokens=max_tokens)
    path = atlas_file.write(doc, Path(model_dir), Path(out_file) if out_file is not None else None)
    if as_json:
        click.echo(json.dumps({"path": str(path), "verdict": doc["verdict"], "summary": doc["summary"]}))
    elif not quiet:
        _print_summary(console, path, doc)


def _print_summary(console, path: Path, doc: dict) -> None:
    v, s = doc["verdict"], doc["summary"]
    tokens = ", ".join(f"{d['name']} {d['tokens']}" for d in doc["input"]["domains"])
    console.print(f"atlas of {doc['model']['name']}: {s['experts_routed']} of {s['experts']} experts routed ({tokens} tokens)")
    z = "n/a" if v["z"] is None else f"{v['z']:.1f}"
    if v["specialised"]:
        console.print(f"specialised: the routers carry {v['observed_bits']:.4f} bits of domain information per layer, "
                      f"random routers on the same inputs {v['random_mean_bits']:.4f} (z = {z}); "
                      f"{s['specialists']} specialists ({100 * s['specialist_share']:.1f} %), "
                      f"median normalised entropy {s['median_entropy']:.3f}")
    else:
        console.print(f"nothing to show: the routing is no more domain-specific than random routers on the same inputs "
                      f"({v['observed_bits']:.4f} against {v['random_mean_bits']:.4f} bits, z = {z})")
    console.print(f"wrote {path}")
