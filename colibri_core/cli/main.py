"""The ``colibri`` command line.

Listing commands import only the plugin registry (no numpy, no GPU stacks); commands
that run a model import the runtime when they start. Errors caused by input print one
line and exit non-zero; set COLIBRI_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import json
import os
import sys

import click

from colibri_core import __version__, interrupts
from colibri_core.errors import ColibriError, cli_spelling, out_of_memory
from colibri_core.plugins.discovery import get_manager


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _emit_json(data) -> None:
    click.echo(json.dumps(data, indent=2))


def _warn_plugin_problems() -> None:
    manager = get_manager()
    err = _console(stderr=True)
    failed = [p for p in manager.plugins.values() if p.status in ("failed", "unavailable")]
    for p in failed:
        err.print(f"[yellow]warning:[/] plugin {p.name!r} {p.status}: {p.error} (see 'colibri plugins')", markup=True)
    for message in manager.conflict_messages():
        err.print(f"[red]error:[/] {message}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="colibri")
def cli():
    """colibri: run Mixture-of-Experts models larger than memory.

    Dense weights stay in RAM; routed experts stream from disk through a cache that
    fits your RAM budget. Placement changes speed only, never the tokens.
    """


# -- listings -------------------------------------------------------------------------
def _table(title: str, columns: list[str], rows: list[list[str]]):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*r)
    return table


def _plugin_meta(plugin_name: str) -> tuple[str, str]:
    info = get_manager().plugins.get(plugin_name)
    if info is None:
        return plugin_name, "?"
    return info.distribution or info.name, info.version or "?"


@cli.command("list-families")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_families(as_json):
    """Model families and the Hugging Face model_types they run."""
    registry = get_manager().registry
    rows = []
    for entry in registry.all("family"):
        dist, version = _plugin_meta(entry.plugin)
        conflict = any(registry.conflict_for(k, key) for k, key in
                       [("family", entry.spec.name)] + [("model_type", t) for t in entry.spec.model_types])
        rows.append({"family": entry.spec.name, "model_types": list(entry.spec.model_types),
                     "architectures": list(entry.spec.architectures), "plugin": entry.plugin,
                     "distribution": dist, "version": version, "description": entry.spec.description,
                     "status": "conflict" if conflict else "ok"})
    if as_json:
        _emit_json(rows)
    else:
        table = _table("Model families", ["family", "model_types", "distribution", "version", "status"],
                       [[r["family"], ", ".join(r["model_types"]), r["distribution"], r["version"], r["status"]] for r in rows])
        from colibri_core.plugins.known import FAMILY_DISTRIBUTIONS

        _console().print(table if rows else "No model families installed. Install one, e.g. pip install colibri-olmoe (published: "
                         + ", ".join(sorted(set(FAMILY_DISTRIBUTIONS.values()))) + ")")
    _warn_plugin_problems()


@cli.command("list-backends")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_backends(as_json):
    """Compute backends and whether they can run on this machine."""
    rows = []
    for entry in get_manager().registry.all("backend"):
        reason = entry.spec.unavailable_reason()
        rows.append({"backend": entry.spec.name, "available": reason is None, "reason": reason,
                     "device": entry.spec.device_kind() if reason is None else None,
                     "plugin": entry.plugin, "description": entry.spec.description})
    if as_json:
        _emit_json(rows)
    else:
        _console().print(_table("Compute backends", ["backend", "status", "plugin", "description"], [
            [r["backend"], _backend_status(r), r["plugin"], r["description"]] for r in rows]))
    _warn_plugin_problems()


def _backend_status(row: dict) -> str:
    if not row["available"]:
        from rich.markup import escape  # a reason may hold brackets (pip extras) that are not markup

        return escape(f"unavailable: {row['reason']}")
    return f"available ({row['device']})" if row["device"] else "available"


def _list_entries(kind: str, as_json: bool, title: str, headers: tuple[str, str], field: str, extra) -> None:
    """The registered entries of one ``kind`` (``list-quants``, ``list-tiers``), each with
    ``extra(spec)``'s fields: as JSON, or a table of the name, ``field``, plugin and
    description (``headers``: the first two columns' titles)."""
    rows = []
    for entry in get_manager().registry.all(kind):
        rows.append({"name": entry.spec.name, "plugin": entry.plugin, "description": entry.spec.description,
                     **extra(entry.spec)})
    if as_json:
        _emit_json(rows)
    else:
        _console().print(_table(title, [*headers, "plugin", "description"],
                                [[r["name"], r[field], r["plugin"], r["description"]] for r in rows]))
    _warn_plugin_problems()


@cli.command("list-quants")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_quants(as_json):
    """Weight formats colibri can read."""
    _list_entries("quant", as_json, "Weight formats", ("format", "stored as"), "storage",
                  lambda s: {"dtypes": list(s.dtypes), "storage": s.storage or ", ".join(s.dtypes)})


@cli.command("list-tiers")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_tiers(as_json):
    """Storage tiers experts can be served from."""
    _list_entries("tier", as_json, "Storage tiers", ("tier", "role"), "role", lambda s: {"role": s.role})


@cli.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins(as_json):
    """Every plugin found: version, hooks, status and error."""
    manager = get_manager()
    manager.registry  # run the registration hooks so their failures show
    rows = [p.as_dict() for p in manager.plugins.values()]
    conflicts = manager.conflict_messages()
    if as_json:
        _emit_json({"plugins": rows, "conflicts": conflicts})
        return
    styles = {"loaded": "green", "failed": "red", "unavailable": "yellow", "disabled": "dim"}
    table = _table("Plugins", ["plugin", "version", "hooks", "status", "error"], [
        [r["name"], r["version"] or "?", ", ".join(h.removeprefix("colibri_") for h in r["hooks"]),
         f"[{styles.get(r['status'], '')}]{r['status']}[/]", r["error"] or ""] for r in rows])
    console = _console()
    console.print(table)
    for message in conflicts:
        console.print(f"[red]conflict:[/] {message}")


def build_cli() -> click.Group:
    """The command group with the core's commands and every plugin's commands."""
    from colibri_core.cli.evaluate import evaluate
    from colibri_core.cli.run import demo, run
    from colibri_core.cli.scaffold import new_family_command
    from colibri_core.cli.tools import bench, convert, doctor, plan

    for command in (run, demo, plan, doctor, convert, bench, evaluate, new_family_command):
        cli.add_command(command)
    get_manager().add_commands(cli)
    return cli


def _show_warning(message, category, filename, lineno, file=None, line=None):
    from colibri_core.warn import ColibriWarning

    if issubclass(category, ColibriWarning):
        click.echo(f"warning: {message}", err=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


def _interrupted(exc: KeyboardInterrupt) -> None:
    note = str(exc)
    click.echo("interrupted" + (f": {note}" if note else ""), err=True)
    sys.exit(130)


def main(argv=None) -> None:
    import warnings

    global _default_showwarning
    _default_showwarning = warnings.showwarning
    warnings.showwarning = _show_warning
    interrupts.install()
    try:
        with cli_spelling():
            build_cli()
            cli.main(args=argv, prog_name="colibri", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort as exc:  # click turns Ctrl-C into Abort
        if not isinstance(exc.__cause__, KeyboardInterrupt):
            click.echo("aborted", err=True)
            sys.exit(1)
        _interrupted(exc.__cause__)
    except KeyboardInterrupt as exc:
        _interrupted(exc)
    except ColibriError as exc:
        if os.environ.get("COLIBRI_DEBUG"):
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:
        if os.environ.get("COLIBRI_DEBUG"):
            raise
        with cli_spelling():  # the exception left the command's block: its message names flags all the same
            memory = out_of_memory(exc)
        if memory is not None:
            click.echo(f"error: {memory}", err=True)
            sys.exit(memory.exit_code)
        click.echo(f"internal error: {type(exc).__name__}: {exc} (this is a bug in colibri; COLIBRI_DEBUG=1 shows the traceback)", err=True)
        sys.exit(70)
