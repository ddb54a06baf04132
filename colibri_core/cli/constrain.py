"""The structured-output flags of ``colibri run`` and ``colibri chat``: ``--json-schema
FILE``, ``--regex RE``, ``--grammar FILE`` (.lark or .gbnf), at most one."""

from __future__ import annotations

import click

from colibri_core.errors import UsageError

GRAMMAR_BYTES = 1 << 20  # a schema or grammar larger than this is refused, not read on


def constraint_options(f):
    for option in reversed([
        click.option("--json-schema", default=None, metavar="FILE",
                     help="Constrain the output to JSON fitting the JSON Schema in FILE (docs/structured.md)."),
        click.option("--regex", default=None, metavar="RE",
                     help="Constrain the output to text the regular expression RE matches in full."),
        click.option("--grammar", default=None, metavar="FILE",
                     help="Constrain the output to the grammar in FILE: Lark (.lark) or llama.cpp GBNF (.gbnf)."),
    ]):
        f = option(f)
    return f


def constraint_from_options(json_schema: str | None, regex: str | None, grammar: str | None):
    """The ``ConstraintSpec`` the flags ask for (None: none), checked before loading: the
    file read and the schema, regex or grammar compiled far enough to name what is wrong."""
    from colibri_core.engine.constraints import ConstraintSpec

    given = [(flag, value) for flag, value in (("--json-schema", json_schema), ("--regex", regex),
                                               ("--grammar", grammar)) if value is not None]
    if len(given) > 1:
        raise UsageError(f"give at most one of --json-schema, --regex and --grammar (got {' and '.join(f for f, _ in given)})")
    if not given:
        return None
    if regex is not None:
        spec = ConstraintSpec.regex(regex, name="--regex")
    elif json_schema is not None:
        spec = ConstraintSpec.json_schema(_read(json_schema, "--json-schema"), name=f"--json-schema {json_schema}")
    else:
        kind = "gbnf" if grammar.endswith(".gbnf") else "lark" if grammar.endswith(".lark") else None
        if kind is None:
            raise UsageError(f"--grammar {grammar}: name a .lark or .gbnf file (the extension says which grammar it is)")
        spec = ConstraintSpec.grammar(_read(grammar, "--grammar"), kind, name=f"--grammar {grammar}")
    spec.grammar_text()  # a bad schema, regex or grammar fails now, not after the model has loaded
    return spec


def _read(path: str, flag: str) -> str:
    """The schema or grammar file's text (a regular file, UTF-8, at most GRAMMAR_BYTES)."""
    from colibri_core.io import smallfile

    return smallfile.read_text(path, GRAMMAR_BYTES, f"{flag} file").removeprefix("\ufeff")
