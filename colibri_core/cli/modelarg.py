"""``--model`` and ``--revision``, shared by every command that reads a model.

``--model`` is a model directory (a Hugging Face hub cache repo root included) or a
Hugging Face repo id found in the local hub cache; ``--revision`` picks a branch, tag or
commit of a repo. The command receives ``model_dir`` as a local directory: resolving
happens before the command body runs, offline (colibri never downloads a model).
"""

from __future__ import annotations

import functools

import click

MODEL_HELP = ("Model directory, or a Hugging Face repo id (org/name) in the local Hugging Face cache "
              "(never downloaded).")


def model_option(help: str = MODEL_HELP):
    """``--model`` (into ``model_dir``) and ``--revision``, resolved to a local directory."""

    def decorate(command):
        @functools.wraps(command)
        def resolved(*args, model_dir, revision, **kwargs):
            from colibri_core.io.hub_cache import resolve_model

            from pathlib import Path

            path = resolve_model(model_dir, revision)
            ctx = click.get_current_context(silent=True)
            if ctx is not None:  # where the options that follow the model find it (a tuned profile)
                ctx.meta["colibri.model_dir"] = path
            # a path given as such stays as the user spelled it (messages name it so)
            return command(*args, model_dir=model_dir if path == Path(model_dir) else str(path), **kwargs)

        resolved = click.option("--revision", default=None, metavar="REV",
                                help="With a repo id: the branch, tag or commit to use (default: main).")(resolved)
        return click.option("--model", "model_dir", required=True, metavar="DIR|REPO_ID", help=help)(resolved)

    return decorate
