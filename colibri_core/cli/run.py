"""``colibri run`` and ``colibri demo``: generate text and report statistics."""

from __future__ import annotations

import json
import sys

import click

from colibri_core.cli.constrain import constraint_from_options, constraint_options
from colibri_core.cli.modelarg import model_option
from colibri_core.errors import UsageError


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def load_with_progress(model_dir, *, quiet: bool, show_progress: bool = False, **options):
    """Load a model, showing a progress bar on a terminal (or anywhere with ``show_progress``)."""
    from colibri_core.cli import progress
    from colibri_core.engine.api import LoadProgress, load

    console = progress.stderr_console()
    if not progress.wanted(console, asked=show_progress, quiet=quiet):
        return load(model_dir, **options)
    with progress.bar(console, enabled=True, label="loading {task.description}") as bar:
        task = {"id": None}

        def start(total, what, unit):
            if task["id"] is not None:
                bar.remove_task(task["id"])
            task["id"] = bar.add_task(what, total=total, unit=unit)

        return load(model_dir, progress=LoadProgress(start, lambda n: bar.advance(task["id"], n)), **options)


def parse_token_ids(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if parts and not parts[-1]:
        parts.pop()  # a trailing comma
    # digits only: int() would also take "1_0" (as 10), "+1", "-1" and non-ASCII digits
    bad = next((part for part in parts if not (part.isascii() and part.isdigit())), None)
    if bad is not None:
        raise UsageError(f"--token-ids takes comma-separated non-negative integers (digits only), got {bad!r} in {text!r}")
    if not parts:
        raise UsageError("--token-ids is empty")
    return [int(part) for part in parts]


# far more text than any context holds (a million tokens are a few MB), yet a bound on
# what `yes | colibri run` or a mistaken --prompt-file /dev/zero can make colibri read
PROMPT_BYTES = 64 << 20


def read_prompt(source: str) -> str:
    """The prompt text from ``source``: a file name, or "-" for stdin. Read to at most
    PROMPT_BYTES (so an endless source is an error, not a hang that fills memory),
    decoded as UTF-8 (a leading byte-order mark dropped), one final newline dropped (echo
    and editors add it; the tokens should be those of the text typed on the command line)."""
    name = "stdin" if source == "-" else f"--prompt-file {source}"
    try:
        if source == "-":
            if sys.stdin is None:
                raise UsageError("stdin is closed: give a PROMPT, --prompt-file or --token-ids")
            data = sys.stdin.buffer.read(PROMPT_BYTES + 1)
        else:
            # a pipe (--prompt-file <(cmd)) is read as stdin is; a directory, a missing file or a
            # link loop fails in open() with its reason
            with open(source, "rb") as f:
                data = f.read(PROMPT_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{name}: cannot read the prompt: {exc.strerror or exc}") from None
    if len(data) > PROMPT_BYTES:
        raise UsageError(f"{name}: the prompt is larger than {PROMPT_BYTES} bytes, more than any context holds")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{name}: the prompt is not valid UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                         f"{exc.start}); give UTF-8 text") from None
    text = text.removesuffix("\r\n") if text.endswith("\r\n") else text.removesuffix("\n")
    if not text:
        raise UsageError(f"{name}: the prompt is empty; give a PROMPT, --prompt-file or --token-ids")
    return text


def stdin_is_piped() -> bool:
    """Whether stdin is something other than a terminal (a pipe, a file), to read a prompt from."""
    return sys.stdin is not None and not sys.stdin.isatty()


def stats_table(stats, model, profile: dict | None = None):
    from rich.table import Table

    from colibri_core.units import format_bytes

    s = stats
    table = Table(title="statistics", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("prompt", f"{s.prompt_tokens} tokens, prefill {s.prefill_s:.2f} s ({s.prefill_tok_s:.1f} tok/s)")
    table.add_row("time to first token", f"{s.ttft_s:.2f} s" if s.ttft_s is not None else "none (no token generated)")
    table.add_row("decode", f"{s.generated_tokens} tokens, {s.decode_tok_s:.2f} tok/s")
    if s.draft_source:
        table.add_row("drafts", drafts_summary(s))
    p = model.placement
    if p.moe_layers:
        store = model.store
        for tier in p.tiers:
            held = store.device if tier.role == "device" else store.ram
            pinned = f" + {len(held.pinned_set())} pinned" if held.pinned_set() else ""
            table.add_row(f"{tier.role} experts", f"LRU {tier.slots} of {p.experts_per_layer} per layer x {p.moe_layers} layers{pinned} "
                                                 f"({format_bytes(tier.cache_bytes(p.moe_layers))} of budget "
                                                 f"{format_bytes(tier.budget)} {tier.budget_source})")
        lookups = s.expert_hits + s.hits_prefetched + s.misses
        device = f"{s.hits_device} device, " if p.device is not None else ""
        table.add_row("expert hit rate", f"{s.hit_rate:.1%} of {lookups} lookups: {device}{s.hits_pinned} RAM pinned, "
                                         f"{s.hits_lru} RAM LRU, {s.hits_prefetched} prefetched, {s.misses} misses")
        # per generated token: decode reads only (the prompt's reads are the prefill's, not the tokens')
        split = (f": prefill {format_bytes(s.bytes_read - s.decode_bytes_read)}, decode "
                 f"{format_bytes(s.decode_bytes_read)}" + (f" ({format_bytes(s.decode_bytes_per_token)}/token)"
                                                          if s.decode_bytes_per_token else ""))
        drives = ""
        if len(s.bytes_read_by_drive) > 1:
            drives = " (" + ", ".join(f"{name}: {format_bytes(n)}" for name, n in s.bytes_read_by_drive.items()) + ")"
        table.add_row("read from disk", f"{format_bytes(s.bytes_read)} in {s.disk_reads} reads{split}{drives}")
        if s.read_wait_s > 0:
            share = f" ({s.decode_read_wait_s / s.decode_s:.0%} of decode)" if s.decode_s > 0 else ""
            table.add_row("waited for reads", f"{s.read_wait_s:.2f} s: decode {s.decode_read_wait_s:.2f} s{share}")
        if p.prefetch_slots:
            skipped = f", {s.prefetch_skipped} not read" if s.prefetch_skipped else ""
            if s.prefetch_steps_off:
                skipped += f"; {s.prefetch_steps_off} steps without, measured faster or being timed"
            table.add_row("prefetch", f"{s.prefetch_issued} read ahead ({s.prefetch_unused} unused{skipped}), "
                                      f"precision {s.prefetch_precision:.0%}, recall {s.prefetch_recall:.0%}")
    for label, text in compute_rows(s.compute):
        table.add_row(label, text)
    table.add_row("resident weights", f"{format_bytes(s.resident_bytes)} (dense {format_bytes(p.dense_bytes)} in {p.dense_in}"
                                      + (f"; {format_bytes(s.device_resident_bytes)} in device memory" if p.device else "") + ")")
    if p.device is not None:
        table.add_row("host syncs", f"{s.host_syncs_per_token:.1f} per token")
    table.add_row("KV cache", f"{format_bytes(s.kv_bytes)} ({format_bytes(s.kv_bytes_per_token)}/token)")
    if profile is not None:
        from colibri_core.cli.profiles import describe

        table.add_row("profile", f"{profile['name']}: {describe(profile['options'])} (colibri tune)")
    return table


def drafts_summary(s) -> str:
    """Speculative decoding's statistics on one line."""
    parts = [f"{s.draft_source}: {s.accepted_tokens} of {s.drafted_tokens} accepted ({s.draft_acceptance:.0%}) "
             f"in {s.draft_verifications} verifications"]
    if s.draft_replayed_tokens:
        parts.append(f"{s.draft_replayed_tokens} tokens fed again")
    if s.draft_gated_steps:
        parts.append(f"{s.draft_gated_steps} steps without (not expected to pay)")
    if s.draft_forced_tokens:
        parts.append(f"{s.draft_forced_tokens} forced by the constraint")
    parts.append(f"{s.tokens_per_forward:.2f} tokens per forward pass")
    return "; ".join(parts)


def compute_rows(counters: dict) -> list[tuple[str, str]]:
    """A compute tier's counters (GenerationStats.compute) as table rows: its own
    counters on one row, then one row per dict of them (e.g. per worker)."""
    def line(d):
        return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d.items() if not isinstance(v, dict))

    if not counters:
        return []
    name = counters.get("tier", "compute")
    rows = [(f"{name} tier", line({k: v for k, v in counters.items() if k != "tier"}))]
    for key, value in counters.items():
        if isinstance(value, dict):
            for sub, d in value.items():
                rows.append((f"  {sub}", line(d) if isinstance(d, dict) else str(d)))
    return rows


def stream_to_terminal(generation, model, *, show_ids: bool) -> None:
    out = sys.stdout
    events = iter(generation)
    try:
        for event in events:
            if show_ids:
                if event.token_id >= 0:
                    out.write(f"{event.token_id} ")
            else:
                out.write(event.text)
            out.flush()
    finally:  # interrupted while writing: close the generation now, so its statistics are recorded
        events.close()
    out.write("\n")
    out.flush()


def _apply(f, options):
    for option in reversed(options):  # decorators apply bottom-up; keep --help in this order
        f = option(f)
    return f


def placement_options(f):
    return _apply(f, [
        click.option("--ram", default=None, help="RAM budget for weights, e.g. 2G (default: 80% of available memory)."),
        click.option("--cap", type=int, default=None, help="At most N experts per MoE layer in each tier (pinned + LRU)."),
        click.option("--pin", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
                     help="Pin the hottest experts from the routing history (auto: once it holds enough tokens)."),
        click.option("--pin-share", type=float, default=0.5, show_default=True, help="Part of the expert budget for pinned experts."),
        click.option("--prefetch/--no-prefetch", default=False, show_default=True,
                     help="Read the next layer's predicted experts while this layer computes."),
        click.option("--prefetch-slots", type=int, default=None, help="Experts read ahead per layer (default: top-k)."),
        click.option("--prefetch-window", default=None, metavar="SIZE",
                     help="Bytes of experts read ahead per layer, e.g. 256M, instead of --prefetch-slots."),
        click.option("--direct-io", is_flag=True, help="Read experts with O_DIRECT (bypasses the page cache)."),
        click.option("--mirror", "mirrors", multiple=True, metavar="DIR[@BW]",
                     help="A read-only copy of the model on another drive, optionally with its bandwidth (e.g. @2G per second). Repeatable."),
        click.option("--verify", is_flag=True,
                     help="Check every read from the model directory against its integrity manifest too (mirror reads always are)."),
        click.option("--history", type=click.Choice(["save", "read", "off"]), default="save", show_default=True,
                     help="Routing history: read and save it, only read it, or ignore it."),
        click.option("--history-decay", type=float, default=1.0, show_default=True, help="Multiply saved routing counts by this at each save."),
        click.option("--preload", is_flag=True, help="Fill the expert caches before generating."),
        KV_CACHE_OPTION,
        PROFILE_OPTION,
        *BACKEND_OPTIONS,
        *_plugin_decorators(),
    ])


PROFILE_OPTION = click.option(
    "--profile", default=None, metavar="NAME|none",
    help="Placement options tuned by colibri tune: by default the newest profile of this model on this machine fills the "
         "options not given (a line says which); NAME (or a path) picks one; none takes none.")


KV_CACHE_OPTION = click.option(
    "--kv-cache", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
    help="Keep attention keys and values in this dtype: float16 halves what each decoded token reads per position of "
         "context (long prompts decode faster), at half precision's rounding, so tokens may differ from float32's.")


def _plugin_decorators() -> list:
    """The options plugins add to the commands that load a model (cli/extend.py)."""
    from colibri_core.cli.extend import plugin_options

    return [option for obj, _ in plugin_options() for option in obj.options()]


BACKEND_OPTIONS = [
    click.option("--backend", default="cpu", show_default=True, help="Compute backend (see colibri list-backends)."),
    click.option("--vram", default=None,
                 help="Device memory for prepared experts, e.g. 8G, on a backend that has some (default: 80% of it less "
                      "the dense weights; on unified memory: the part of --ram the device tier gets, default all)."),
]


def backend_options(f):
    return _apply(f, BACKEND_OPTIONS)


def placement_kwargs(ram, cap, pin, pin_share, prefetch, prefetch_slots, direct_io, mirrors, history, history_decay,
                     preload, backend, vram, verify=False, prefetch_window=None, kv_cache="float32", profile=None,
                     **plugin_values) -> dict:
    from colibri_core.cli.extend import plugin_load_kwargs, split_plugin_values

    rest, values = split_plugin_values(plugin_values)
    if rest:
        raise TypeError(f"placement_kwargs() got unexpected options {sorted(rest)}")
    tuned = dict(prefetch=prefetch, prefetch_slots=prefetch_slots, direct_io=direct_io, pin_share=pin_share,
                 mirrors=tuple(mirrors))
    ctx = click.get_current_context(silent=True)
    if ctx is not None and "colibri.model_dir" in ctx.meta:  # a tuned profile fills the options not given
        from colibri_core.cli.profiles import apply

        if prefetch_window is not None:  # a window given replaces the profile's slot count
            tuned.pop("prefetch_slots")
        extra = ctx.meta.get("colibri.profile_extra", {})  # a command's own tunables (serve's slots), filled in place
        tuned.update(extra)
        ctx.meta["colibri.profile"] = apply(ctx, ctx.meta["colibri.model_dir"], profile, tuned)
        extra.update({k: tuned[k] for k in extra})
        prefetch, direct_io, pin_share, mirrors = (tuned[k] for k in ("prefetch", "direct_io", "pin_share", "mirrors"))
        prefetch_slots = tuned.get("prefetch_slots", prefetch_slots)
    return dict(ram=ram, cap=cap, pin=pin, pin_share=pin_share, prefetch=prefetch, prefetch_slots=prefetch_slots,
                prefetch_window=prefetch_window, direct_io=direct_io, mirrors=tuple(mirrors), history={"save": True, "read": "read", "off": False}[history], history_decay=history_decay,
                preload=preload, backend=backend, vram=vram, verify=verify, kv_cache=kv_cache, **plugin_load_kwargs(values))


def sampling_options(f):
    return _apply(f, [
        click.option("--max-tokens", type=int, default=128, show_default=True, help="Tokens to generate at most."),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass."),
        click.option("--top-k", type=int, default=0, show_default=True, help="Sample among the k likeliest; 0 = no limit."),
        click.option("--seed", type=int, default=None, help="Seed for sampling."),
    ])


def draft_options(f):
    return _apply(f, [
        click.option("--draft", default="off", show_default=True, metavar="SOURCE",
                     help="Speculative decoding: draft tokens with SOURCE (ngram: prompt lookup; mtp: the model's own "
                          "multi-token-prediction layer; auto: the MTP layer if the model has one, else ngram, while "
                          "it pays; plugins add others) and verify them in one forward pass; off: none. The tokens "
                          "are the same either way."),
        click.option("--draft-depth", type=int, default=4, show_default=True,
                     help="With --draft: drafted tokens per forward pass, at most (1 to 16)."),
        click.option("--mtp-int4", is_flag=True,
                     help="With --draft mtp: load a multi-token-prediction layer stored in 4 bits anyway "
                          "(refused by default: its drafts are rarely right)."),
    ])


def draft_load_options(draft: str, mtp_int4: bool) -> dict:
    """What ``load`` needs for a draft source: ``--draft mtp`` loads the MTP layers,
    ``--draft auto`` those the checkpoint has in a usable form."""
    if mtp_int4 and draft not in ("mtp", "auto"):
        raise UsageError("--mtp-int4 is for --draft mtp or auto")
    return {"mtp": True if draft == "mtp" else "if-usable" if draft == "auto" else False, "mtp_int4": mtp_int4}


def check_draft_options(draft: str, draft_depth: int) -> None:
    """A draft source that is not installed, or a depth out of range: one line, before loading."""
    from colibri_core.engine.speculative import check_depth, draft_sources

    check_depth(draft_depth)
    if draft != "off" and draft not in draft_sources():
        raise UsageError(f"--draft: no draft source named {draft!r} is installed (installed: "
                         f"{', '.join(sorted(draft_sources())) or 'none'}; off turns drafting off)")


@click.command("run")
@model_option()
@click.argument("prompt", required=False)
@click.option("--prompt-file", default=None, metavar="FILE",
              help="Read the prompt from FILE (UTF-8; - for stdin).")
@click.option("--token-ids", default=None, help="Prompt as comma-separated token ids (for models without a tokenizer).")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the model's chat template.")
@click.option("--system", default=None, help="System message (with --chat).")
@sampling_options
@draft_options
@constraint_options
@placement_options
@click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-sequence tokens.")
@click.option("--save-state", default=None, metavar="FILE",
              help="After the run, save the sequence's state (caches, token ids, sampler) to FILE, for --resume.")
@click.option("--resume", "resume_file", default=None, metavar="FILE",
              help="Continue the sequence saved in FILE (by --save-state) instead of a prompt, without computing it "
                   "again; sampling options and --ignore-eos not given are the saved ones.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: token_ids, text, stats.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or statistics.")
@click.option("--progress", "show_progress", is_flag=True,
              help="Show progress (loading, the prompt's prefill) on stderr even when it is not a terminal "
                   "(there as plain lines every few seconds).")
def run(model_dir, prompt, prompt_file, token_ids, chat, system, max_tokens, temperature, top_p, top_k, seed, draft,
        draft_depth, mtp_int4, json_schema, regex, grammar, ignore_eos, save_state, resume_file, as_json, quiet,
        show_progress, **placement):
    """Generate from PROMPT (or --prompt-file, or --token-ids) with the model in --model.
    PROMPT "-", or no prompt at all with stdin not a terminal, reads the prompt from stdin.
    --resume FILE continues a sequence saved with --save-state instead."""
    from colibri_core.engine.api import check_load_options
    from colibri_core.engine.sampling import SamplingParams, check_max_tokens
    from colibri_core.model.tokenizer import check_text

    # every option is checked before anything is loaded (a large model takes minutes)
    given = [prompt is not None, prompt_file is not None, token_ids is not None]
    if sum(given) > 1:
        raise UsageError("give a PROMPT, --prompt-file or --token-ids (exactly one)")
    check_state_options(save_state, resume_file, draft, any(given) or chat or system is not None)
    prompt_source = prompt_file if prompt_file is not None else "-" if prompt == "-" else None
    if resume_file is not None:
        pass  # no prompt: the saved sequence continues
    elif not any(given):
        if not stdin_is_piped():
            raise UsageError("give a PROMPT, --prompt-file or --token-ids (exactly one), or pipe the prompt on stdin")
        prompt_source = "-"
    if chat and token_ids is not None:
        raise UsageError("--chat needs a text PROMPT")
    # an error, not a warning: without --chat the system message would silently not reach the model
    if system is not None and not chat:
        raise UsageError("--system is a chat message: add --chat (the model's chat template places it)")
    ids = parse_token_ids(token_ids) if token_ids is not None else None
    if prompt is not None and prompt_source is None:
        check_text(prompt, "PROMPT")
    if system is not None:
        check_text(system, "--system")
    SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    check_max_tokens(max_tokens)
    check_draft_options(draft, draft_depth)
    constraint = constraint_from_options(json_schema, regex, grammar)
    if constraint is not None and resume_file is not None:
        raise UsageError("--json-schema, --regex and --grammar do not combine with --resume yet")
    options = placement_kwargs(**placement) | draft_load_options(draft, mtp_int4)
    check_load_options(**{k: options[k] for k in ("cap", "pin", "pin_share", "prefetch_slots", "prefetch_window", "history",
                                             "history_decay")})
    if prompt_source is not None:  # read last: every option above is checked before waiting on stdin
        prompt = read_prompt(prompt_source)
    saved = None
    if resume_file is not None:  # the whole file is checked (but for the model's identity) before loading
        from colibri_core.engine.state import read_state

        saved = read_state(resume_file)

    model = load_with_progress(model_dir, quiet=quiet or as_json, show_progress=show_progress, **options)
    from colibri_core.cli import progress

    console = progress.stderr_console()
    prefill = progress.PrefillBar(console, progress.wanted(console, asked=show_progress, quiet=quiet or as_json))
    with model:
        kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                      ignore_eos=ignore_eos, prefill_progress=prefill, draft=draft, draft_depth=draft_depth,
                      keep_state=save_state is not None, constraint=constraint)
        if saved is not None:
            generation = model.resume_stream(saved, **resume_kwargs(kwargs))
        elif ids is not None:
            generation = model.stream(token_ids=ids, **kwargs)
        elif chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            generation = model.stream(messages=messages, **kwargs)
        else:
            generation = model.stream(prompt, **kwargs)
        try:
            if as_json:
                generation.run()
            else:
                stream_to_terminal(generation, model, show_ids=model.tokenizer is None)
        except KeyboardInterrupt:
            # the statistics of the tokens made so far, then exit 130 (main says "interrupted")
            prefill.close()
            if as_json:
                click.echo(json.dumps(generation.result().as_dict()))
            else:
                sys.stdout.write("\n")
                if not quiet:
                    _stderr_console().print(stats_table(generation.result().stats, model))
            raise
        finally:
            prefill.close()
        result = generation.result()
        out = result.as_dict()
        profile = click.get_current_context().meta.get("colibri.profile")
        out["profile"] = profile
        if save_state is not None:
            if result.state is None:
                raise UsageError(f"--save-state {save_state}: {result.state_error}")
            size = result.state.save(save_state)
            out["saved_state"] = {"path": save_state, "positions": result.state.positions, "bytes": size}
            if not (quiet or as_json):
                from colibri_core.units import format_bytes

                _stderr_console().print(f"saved state: {save_state} ({result.state.positions} positions, "
                                        f"{format_bytes(size)})")
        if as_json:
            click.echo(json.dumps(out))
        elif not quiet:
            _stderr_console().print(stats_table(result.stats, model, profile))


def check_state_options(save_state, resume_file, draft: str, prompt_given: bool):
    """--save-state and --resume, checked before the model loads: a prompt beside --resume,
    drafts beside --save-state, a place that cannot take the file are one line (the saved
    file itself is read and checked after the other options, still before loading)."""
    import os

    if save_state is not None:
        if draft != "off":
            raise UsageError("--save-state cannot be combined with --draft: a verification ends with drafted positions "
                             "in the caches")
        parent = os.path.dirname(os.path.abspath(save_state))
        if os.path.isdir(save_state):
            raise UsageError(f"--save-state {save_state}: is a directory")
        if not os.path.isdir(parent):
            raise UsageError(f"--save-state {save_state}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise UsageError(f"--save-state {save_state}: directory {parent} is not writable")
    if resume_file is not None and prompt_given:
        raise UsageError("--resume continues a saved sequence: give no PROMPT, --prompt-file, --token-ids, --chat "
                         "or --system")


def resume_kwargs(kwargs: dict) -> dict:
    """``Model.resume_stream``'s arguments from ``run``'s: the sampling options and
    --ignore-eos only where given on the command line (the saved ones otherwise)."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    out = {k: kwargs[k] for k in ("max_tokens", "draft", "draft_depth", "keep_state")}
    for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None):
            out[name] = kwargs[name]
    return out


@click.command("demo")
@click.option("--size", type=click.Choice(["trained", "full"]), default="trained", show_default=True,
              help="trained: a small OLMoE-geometry model trained on code and prose (colibri-trained), whose text makes "
                   "sense; full: a synthetic OLMoE-shaped model of 1.3 GB with random weights, built once (its text is noise).")
@click.option("--prompt", default=None, help="What to continue (default: a Python function for trained, a story for full).")
@click.option("--max-tokens", type=int, default=None, help="Tokens to generate (default: 64 trained, 48 full).")
@click.option("--ram", default=None, help="RAM budget for weights (default: dense weights + 1/4 of the experts).")
@click.option("--dir", "demo_dir", default=None, help="With --size full: where to build it (default: the user cache dir).")
@click.option("--rebuild", is_flag=True, help="With --size full: build it again even if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: token_ids, text, stats.")
@backend_options
def demo(size, prompt, max_tokens, ram, demo_dir, rebuild, as_json, backend, vram):
    """Generate from a model with a RAM budget small enough that its experts stream from
    disk: by default a small trained model (recognisable code and prose), with --size full
    a synthetic model of real size (random weights, >1 GB, built once)."""
    from colibri_core.cli.demo import (DEFAULT_SPEC, TRAINED_PROMPT, check_family, default_demo_dir, ensure_demo_model,
                                       quarter_budget, trained_demo_path)
    from colibri_core.engine.api import open_backend
    from colibri_core.engine.sampling import check_max_tokens
    from colibri_core.model.tokenizer import check_text

    full = size == "full"
    if not full and (demo_dir is not None or rebuild):
        raise UsageError(f"{'--dir' if demo_dir is not None else '--rebuild'} builds the full-size demo: add --size full")
    prompt = prompt if prompt is not None else (TRAINED_PROMPT if not full else "Once upon a time, a small bird")
    max_tokens = max_tokens if max_tokens is not None else (48 if full else 64)
    check_max_tokens(max_tokens)  # bad options fail before the model is built
    check_text(prompt, "--prompt")
    backend_obj, _ = open_backend(backend, vram)
    console = _stderr_console()
    if full:
        path = ensure_demo_model(demo_dir or default_demo_dir(), DEFAULT_SPEC, rebuild=rebuild, console=console,
                                 quiet=as_json)
    else:
        check_family()
        path = trained_demo_path()
    budget = ram if ram is not None else quarter_budget(path, backend_obj, DEFAULT_SPEC.cached_experts_per_layer)
    model = load_with_progress(path, quiet=as_json, ram=budget, backend=backend, vram=vram)
    with model:
        # the trained model is small: a greedy continuation soon repeats itself; a seeded
        # draw at a moderate temperature reads better and is the same on every run
        sampling = {"seed": 0} if full else {"seed": 0, "temperature": 0.7, "top_p": 0.95}
        generation = model.stream(prompt, max_tokens=max_tokens, **sampling)
        if as_json:
            result = generation.run()
            click.echo(json.dumps({"model_dir": str(path), "size": size, **result.as_dict()}))
            return
        from colibri_core.units import format_bytes

        p = model.placement
        if full:
            console.print(f"[bold]demo model[/] {path}  (random weights: the text below is noise)")
        else:
            console.print(f"[bold]demo model[/] {path}  (OLMoE's routing geometry, 16 layers x 64 experts, top-8, "
                          f"trained for 45 minutes on two CPU cores on Python, C, manual pages and JSON/YAML: expect "
                          f"code-like text, not a chatbot)")
        device = f"{p.device.slots} in device memory, " if p.device is not None else ""
        console.print(f"RAM budget {format_bytes(p.budget)}: dense weights {format_bytes(p.dense_bytes)} resident in "
                      f"{p.dense_in}, {device}{p.slots} of {p.experts_per_layer} experts per layer cached in RAM; "
                      f"the rest stream from disk.\n")
        sys.stdout.write(prompt)
        stream_to_terminal(generation, model, show_ids=False)
        console.print(stats_table(generation.result().stats, model))
