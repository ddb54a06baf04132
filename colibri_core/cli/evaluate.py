"""``colibri eval``: teacher-forced perplexity of a model on text, optionally against a
reference model (KL divergence and top-1 agreement: what a conversion cost)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from colibri_core.cli.modelarg import model_option
from colibri_core.cli.run import _stderr_console, load_with_progress, placement_kwargs, placement_options
from colibri_core.errors import UsageError

# held-out text a model directory may carry, one file per domain (as in engine/perplexity.py,
# which this module imports only when it runs: listing commands stay free of numpy)
HELDOUT_DIR = "heldout"
DATA_BYTES = 64 << 20  # a text file to score; more is a corpus, not an evaluation set


def domain_file(name: str, *model_dirs) -> Path:
    """``heldout/NAME.txt`` of the first model directory that has it."""
    for d in model_dirs:
        if d is not None and (Path(d) / HELDOUT_DIR / f"{name}.txt").is_file():
            return Path(d) / HELDOUT_DIR / f"{name}.txt"
    have = sorted({p.stem for d in model_dirs if d is not None for p in (Path(d) / HELDOUT_DIR).glob("*.txt")})
    hint = f"the domains there are: {', '.join(have)}" if have else f"it carries no {HELDOUT_DIR}/ directory: use --data FILE"
    raise UsageError(f"--domain {name}: no held-out text of that name in the model directory ({hint})")


@click.command("eval")
@model_option()
@click.option("--perplexity", "want_perplexity", is_flag=True, required=True,
              help="Score the text teacher-forced: perplexity (and, with --reference, KL and top-1 agreement).")
@click.option("--data", "data_files", multiple=True, metavar="FILE", help="UTF-8 text to score (repeatable).")
@click.option("--domain", "domains", multiple=True, metavar="NAME",
              help="Held-out text the model directory carries under heldout/NAME.txt (repeatable).")
@click.option("--reference", "reference_dir", default=None, metavar="DIR",
              help="Also run this model (e.g. the source of a conversion) and report KL(reference || model) and "
                   "top-1 agreement.")
@click.option("--window", type=int, default=256, show_default=True, help="Tokens per scored window (each from an empty cache).")
@click.option("--batch", type=int, default=8, show_default=True, help="Windows per batched forward.")
@click.option("--max-tokens", type=int, default=32768, show_default=True, help="Score at most this many tokens of each text.")
@placement_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def evaluate(model_dir, want_perplexity, data_files, domains, reference_dir, window, batch, max_tokens, as_json, quiet,
             **placement):
    """Teacher-forced perplexity of a model on text files or held-out domains; with
    --reference, how far its predictions are from another model's. Numbers are the same
    under every placement."""
    from contextlib import ExitStack

    from colibri_core.cli import progress
    from colibri_core.engine import perplexity as ppl
    from colibri_core.io import smallfile

    if not data_files and not domains:
        raise UsageError("give the text to score: --data FILE or --domain NAME")
    if not isinstance(max_tokens, int) or max_tokens < 2:
        raise UsageError(f"--max-tokens must be an integer >= 2, got {max_tokens!r}")
    texts = {}
    for f in data_files:
        texts[f] = f
    for name in domains:
        texts[name] = str(domain_file(name, model_dir, reference_dir))
    contents = {label: smallfile.read_text(path, DATA_BYTES, "text to score") for label, path in texts.items()}
    options = placement_kwargs(**placement)
    console = _stderr_console()
    results = {}
    with ExitStack() as stack:
        model = stack.enter_context(load_with_progress(model_dir, quiet=quiet or as_json, **options))
        reference = None
        if reference_dir is not None:
            reference = stack.enter_context(load_with_progress(reference_dir, quiet=quiet or as_json, history=False,
                                                               backend=options["backend"], vram=options["vram"]))
        for label, text in contents.items():
            wins = ppl.windows(model.encode(text), window, max_tokens)
            if not wins:
                raise UsageError(f"{texts[label]}: too short to score (fewer than 2 tokens)")
            total = sum(len(w) for w in wins)
            with progress.token_bar(console, f"scoring {label}", total, quiet=quiet or as_json) as advance:
                if reference is None:
                    results[label] = ppl.score(model, wins, batch, advance).as_dict()
                else:
                    results[label] = ppl.compare(model, reference, wins, batch, advance).as_dict()
    if as_json:
        click.echo(json.dumps({"model": str(model_dir), "reference": reference_dir, "window": window, "batch": batch,
                               "results": results}))
        return
    _print_table(console, results, reference_dir is not None)


def _print_table(console, results: dict, compared: bool) -> None:
    from rich.table import Table

    table = Table(title="teacher-forced scores", title_justify="left")
    columns = ["text", "tokens", "perplexity"] + (["reference", "delta", "KL (nats/token)", "top-1 agreement"] if compared else [])
    for c in columns:
        table.add_column(c, justify="left" if c == "text" else "right")
    for label, r in results.items():
        row = [label, str(r["tokens"]), f"{r['perplexity']:.3f}"]
        if compared:
            row += [f"{r['reference_perplexity']:.3f}", f"{r['perplexity_delta']:+.3f}", f"{r['kl']:.5f}",
                    f"{100 * r['top1_agreement']:.2f}%"]
        table.add_row(*row)
    console.print(table)
