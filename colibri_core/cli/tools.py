"""``colibri plan`` and ``colibri doctor``."""

from __future__ import annotations

import json
import sys

import click

from colibri_core.cli.run import backend_options
from colibri_core.errors import Interrupted, UsageError
from colibri_core.units import format_bytes, parse_size


@click.command("plan")
@click.option("--model", "model_dir", required=True, help="Hugging Face model directory.")
@click.option("--ram", default=None, help="RAM budget for weights, e.g. 8G (default: 80% of available memory).")
@click.option("--cap", type=int, default=None, help="At most N experts per MoE layer in each tier.")
@click.option("--pin", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True)
@click.option("--pin-share", type=float, default=0.5, show_default=True)
@click.option("--prefetch/--no-prefetch", default=False, show_default=True)
@click.option("--context", type=int, default=None, help="Context length for the KV estimate (default: the model's).")
@click.option("--disk-bw", default=None, help="Disk bandwidth per second, e.g. 1.2G (default: measured).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@backend_options
def plan(model_dir, ram, cap, pin, pin_share, prefetch, context, disk_bw, as_json, backend, vram):
    """Show how a model would be placed, tier by tier (device memory, RAM, disk), its
    projected expert hit rate per tier and its bottleneck."""
    from colibri_core.cli.plan import make_plan
    from colibri_core.engine.api import check_load_options, open_backend
    from colibri_core.model.blueprint import inspect_model

    check_load_options(cap=cap, pin=pin, pin_share=pin_share)
    backend_obj, vram_budget = open_backend(backend, vram)
    ram_budget = parse_size(ram) if ram else None
    disk_budget = float(parse_size(disk_bw)) if disk_bw else None
    bp = inspect_model(model_dir, backend_obj)
    try:
        report = make_plan(bp, ram=ram_budget, cap=cap, pin=pin, pin_share=pin_share, prefetch=prefetch,
                           context=context, disk_bw=disk_budget, vram=vram_budget)
    finally:
        bp.close()
    d = report.data
    from colibri_core.engine.placement import budget_beyond_memory

    d["ram_budget_warning"] = budget_beyond_memory(d["ram_budget"]) if ram_budget is not None else None
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plan for {d['model_dir']} ({d['family']})", title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    memory = "no device memory: computes from RAM"
    if d["device_memory"] is not None:
        memory = f"{format_bytes(d['device_memory'])} device memory" + (
            ", unified with RAM: the device and RAM tiers share the RAM budget (--vram is the device tier's part of it)"
            if d["unified_memory"] else "")
    rows = [
        ("backend", f"{d['backend']} ({memory})"),
        ("RAM budget", f"{format_bytes(d['ram_budget'])} ({d['ram_budget_source']})"),
    ]
    if d["vram_budget"] is not None:
        rows.append(("device budget", f"{format_bytes(d['vram_budget'])} for experts ({d['vram_budget_source']})"
                     + ("" if d["vram_budget_source"] == "--vram" or d["unified_memory"]
                        else ": 80% of the device memory less the dense weights")))
    rows += [
        ("dense weights", f"{format_bytes(d['dense_bytes'])} resident in {'device memory' if d['dense_in'] == 'device' else 'RAM'} "
                          f"({format_bytes(d['dense_disk_bytes'])} on disk)"),
        ("KV cache", f"{format_bytes(d['kv_bytes_per_token'])}/token, {format_bytes(d['kv_bytes_at_context'])} at {d['context_length']} tokens"),
        ("experts", f"{d['moe_layers']} layers x {d['experts_per_layer']}, top-{d['top_k']}, "
                    f"{format_bytes(d['expert_disk_bytes'])} each on disk"),
    ]
    for t in d["tiers"]:
        if t["role"] == "disk":
            rows.append(("disk tier", f"serves {t['projected_hit_rate']:.1%} of lookups"))
            continue
        rows.append((f"{t['role']} tier", f"{t['slots_per_layer']} LRU slots per layer, {t['pinned_experts']} pinned "
                                          f"(of {t['pinned_capacity']}), {format_bytes(t['expert_bytes'])} each, "
                                          f"{format_bytes(t['cache_bytes'])} of {format_bytes(t['budget'])}; "
                                          f"serves {t['projected_hit_rate']:.1%} of lookups"))
    rows += [
        ("prefetch", f"{d['prefetch_slots']} experts per layer read ahead" if d["prefetch_slots"] else "off"),
        ("projected hit rate", f"{d['projected_hit_rate']:.1%}" + (f" (history: {d['history_tokens']:.0f} tokens)" if d["history_tokens"] else " (no history: uniform routing assumed)")),
        ("disk per token", f"{format_bytes(d['missed_bytes_per_token'])} at {format_bytes(d['disk_bandwidth'])}/s ({d['disk_bandwidth_source']})"),
        ("seconds per token", ", ".join(f"{k} {v:.3f}" for k, v in d["seconds_per_token"].items())),
        ("bottleneck", d["bottleneck"]),
        ("projected decode", f"{d['projected_decode_tok_s']:.2f} tok/s" if d["projected_decode_tok_s"] else "?"),
    ]
    for row in rows:
        table.add_row(*row)
    console = Console(highlight=False)
    console.print(table)
    if d["ram_budget_warning"]:
        console.print(f"  [yellow]warning:[/] {d['ram_budget_warning']}")
    for tip in d["recommended"]:
        console.print(f"  - {tip}")


@click.command("doctor")
@click.option("--model", "model_dir", required=True, help="Hugging Face model directory.")
@click.option("--ram", default=None, help="RAM budget to check (default: 80% of available memory).")
@click.option("--deep", is_flag=True, help="Also read every tensor once: readable to the end, no NaN or infinity.")
@click.option("--write-manifest", is_flag=True,
              help="With --deep: write the integrity manifest (colibri-integrity.json) that mirror reads and --verify check.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of checks.")
def doctor(model_dir, ram, deep, write_manifest, as_json):
    """Readiness checks of a model directory; exits 1 if any check fails. Nothing is
    written unless --write-manifest asks for the integrity manifest."""
    from colibri_core.cli.doctor import run_checks
    from colibri_core.errors import UsageError

    if write_manifest and not deep:
        raise UsageError("--write-manifest reads every tensor: give it with --deep")
    checks = run_checks(model_dir, ram=parse_size(ram) if ram else None, deep=deep, write_manifest=write_manifest)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"ok": not failed, "checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        styles = {"pass": "green", "warn": "yellow", "fail": "red"}
        table = Table(title=f"doctor: {model_dir}", title_justify="left")
        for column in ("check", "status", "detail", "fix"):
            table.add_column(column, overflow="fold")
        for c in checks:
            table.add_row(c.name, f"[{styles[c.status]}]{c.status}[/]", c.detail, c.hint)
        Console(highlight=False).print(table)
    if failed:
        sys.exit(1)


@click.command("convert")
@click.option("--model", "model_dir", required=True, help="Source Hugging Face model directory.")
@click.option("--out", "out_dir", required=True, help="Where to write the converted model (new, or an interrupted conversion to resume).")
@click.option("--experts", type=click.Choice(["int4", "int8", "mxfp4", "bf16", "f32", "keep"]), default="int4", show_default=True,
              help="Format of the routed experts.")
@click.option("--dense", type=click.Choice(["int4", "int8", "mxfp4", "bf16", "f32", "keep"]), default="keep", show_default=True,
              help="Format of the dense linear weights (attention, shared experts, dense MLPs, LM head).")
@click.option("--report", is_flag=True, help="Compare next-token distributions with the source on fixed prompts.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--progress", "show_progress", is_flag=True, help="Show progress bars on stderr even when it is not a terminal.")
def convert(model_dir, out_dir, experts, dense, report, as_json, show_progress):
    """Quantise a model into a colibri container, shard by shard (resumable)."""
    from rich.console import Console

    from colibri_core.cli import progress
    from colibri_core.cli.convert import convert as run_convert, quality_report

    console = progress.stderr_console(force=show_progress)
    enabled = progress.wanted(console, asked=show_progress, quiet=as_json)
    with progress.bar(console, enabled=enabled) as bar:
        task = bar.add_task("converting", total=None)
        try:
            result = run_convert(model_dir, out_dir, experts=experts, dense=dense,
                                 progress=lambda done, total: bar.update(task, completed=done, total=total))
        except KeyboardInterrupt:
            raise Interrupted(f"the finished shards in {out_dir} are kept: run the same command again and it "
                              "resumes") from None
    data = {"out": str(result.out), "shards_written": result.shards_written, "shards_resumed": result.shards_resumed,
            "tensors_converted": result.tensors_converted, "bytes_in": result.bytes_in, "bytes_out": result.bytes_out,
            "experts": experts, "dense": dense}
    if report:
        with progress.bar(console, enabled=enabled) as bar:
            task = bar.add_task("comparing with the source", total=None, unit="prompts")
            data["report"] = quality_report(model_dir, out_dir,
                                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    console = Console(highlight=False)
    console.print(f"{result.out}: {result.tensors_converted} tensors converted (experts {experts}, dense {dense}), "
                  f"{format_bytes(result.bytes_in)} -> {format_bytes(result.bytes_out)}"
                  + (f"; {result.shards_resumed} shards already done" if result.shards_resumed else ""))
    if report:
        r = data["report"]
        console.print(f"quality over {r['positions']} positions: logit cosine mean {r['cosine_mean']:.5f} (min "
                      f"{r['cosine_min']:.5f}), KL mean {r['kl_mean']:.5f} (max {r['kl_max']:.5f}), greedy agreement "
                      f"{r['greedy_agreement']:.1%}")


@click.command("bench")
@click.option("--model", "model_dir", required=True, help="Hugging Face model directory.")
@click.option("--tokens", type=int, default=32, show_default=True, help="Tokens to generate per run.")
@click.option("--prompt-tokens", type=int, default=32, show_default=True, help="Prompt length (seeded random token ids).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Runs per engine (medians are reported).")
@click.option("--cold", is_flag=True, help="Drop the page cache before each run (root), else fadvise the shards away.")
@click.option("--vs", "vs", multiple=True, type=click.Choice(["transformers", "accelerate-offload"]),
              help="Also run this engine on the same checkpoint, interleaved with colibri. Repeatable.")
@click.option("--ram", default=None, help="RAM budget: colibri's --ram and accelerate's CPU memory.")
@click.option("--cap", type=int, default=None, help="colibri: at most N experts per MoE layer in each tier.")
@click.option("--cgroup", default=None, help="Run every engine inside a memory cgroup of this size (page cache included).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Sampling temperature (seeded); above 0 keeps random-weight models from repeating one token.")
@click.option("--prefetch/--no-prefetch", default=False, show_default=True)
@click.option("--preload", is_flag=True, help="colibri: fill the expert cache before generating.")
@click.option("--direct-io", is_flag=True, help="colibri: read experts with O_DIRECT.")
@click.option("--peer-model", default=None, help="Run the --vs engines on this checkpoint instead (e.g. the bf16 source).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@backend_options
def bench(model_dir, tokens, prompt_tokens, repeats, cold, vs, ram, cap, cgroup, temperature, prefetch, preload, direct_io,
          peer_model, as_json, backend, vram):
    """Measure prefill and decode speed, time to first token, disk reads and peak memory,
    beside transformers (resident) or transformers + accelerate disk offload."""
    from rich.console import Console
    from rich.table import Table

    from colibri_core.cli.bench import bench as run_bench

    err = Console(stderr=True, highlight=False)
    from colibri_core.engine.api import check_load_options, open_backend
    from colibri_core.engine.sampling import SamplingParams

    # bad options fail here, before any engine runs
    for name, value in (("--tokens", tokens), ("--prompt-tokens", prompt_tokens), ("--repeats", repeats)):
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    SamplingParams(temperature=temperature)
    check_load_options(cap=cap)
    open_backend(backend, vram)
    options = {"history": "read", "prefetch": prefetch, "preload": preload, "direct_io": direct_io, "backend": backend}
    if cap is not None:
        options["cap"] = cap
    if vram is not None:
        options["vram"] = vram

    def report(engine, r, result):
        if not as_json:
            what = result.get("error") or f"decode {result['decode_tok_s']:.2f} tok/s, prefill {result['prefill_s']:.2f} s"
            err.print(f"[dim]run {r + 1} {engine}: {what}[/]")

    data = run_bench(model_dir, tokens=tokens, prompt_tokens=prompt_tokens, repeats=repeats, cold=cold, vs=tuple(vs),
                     ram=ram, cgroup=cgroup, temperature=temperature, options=options, report=report, peer_model=peer_model)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    table = Table(title=f"bench {model_dir}: {prompt_tokens}-token prompt, {tokens} tokens, {data['cache']} cache"
                        + (f", cgroup {format_bytes(data['cgroup_bytes'])}" if data["cgroup_bytes"] else ""),
                  title_justify="left")
    for column in ("engine", "decode tok/s (median)", "prefill s", "TTFT s", "disk/token", "peak RSS", "hit rate"):
        table.add_column(column)
    for engine, s in data["summary"].items():
        if "error" in s:
            table.add_row(engine, f"[red]{s['error']}[/]", "", "", "", "", "")
            continue
        peak = s.get("cgroup_peak_bytes") or s.get("peak_rss_bytes", 0)
        table.add_row(engine, f"{s['decode_tok_s']:.2f} (±{s['decode_spread'] / 2:.2f})", f"{s['prefill_s']:.2f}",
                      f"{s['ttft_s']:.2f}", format_bytes(s["disk_bytes_per_token"]), format_bytes(peak),
                      f"{s['hit_rate']:.1%}" if "hit_rate" in s else "")
    console = Console(highlight=False)
    console.print(table)
    for engine, r in data["ratios"].items():
        prefill = f", prefill {r['prefill']:.2f}x" if r.get("prefill") else ""
        console.print(f"colibri vs {engine}: decode {r['decode']:.2f}x{prefill}")
