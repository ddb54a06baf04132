"""Tuned profiles: the placement options ``colibri tune`` measured fastest for one model on
one machine, which ``run``, ``chat``, ``serve``, ``eval``, ``atlas`` and ``bench`` then
apply to the options not given on their command line (``--profile NAME|none``).

A profile is ``NAME.json`` in colibri's config dir (``profiles/``), written atomically:
the model's key (the SHA-256 of its config.json and its shards' names and sizes), the
machine's fingerprint (CPU, cores, memory, the model's drive), the options chosen, the
budget and the table that chose them. Without ``--profile`` a command takes the newest
profile of this model on this machine, if any, and says so in one line; ``--profile
none`` takes none; ``--profile NAME`` (or a path) takes that one (refused for another
model; applied with a warning when measured on another machine). Options are placement
only: a profile changes speed, never tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from colibri_core.errors import ColibriError, ModelFormatError, UsageError, write_error
from colibri_core.io import smallfile

FORMAT = "colibri-profile"
VERSION = 1
PROFILE_BYTES = 4 << 20
# the options a profile may set: option dest -> (flag for messages, type)
TUNABLE = {"prefetch": ("--prefetch", bool), "prefetch_slots": ("--prefetch-slots", int),
           "direct_io": ("--direct-io", bool), "pin_share": ("--pin-share", float),
           "mirrors": ("--mirror", list),  # DIR[@BW] values, as given to colibri tune
           "slots": ("--slots", int)}  # serve's, applied by serve and web only


def profiles_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("colibri")) / "profiles"


def model_key(model_dir: Path) -> str:
    """Who a profile belongs to: the model's identity (config.json, shard names and sizes),
    the one saved states and spilled prefixes are keyed by."""
    from colibri_core.engine.state import directory_identity

    return directory_identity(model_dir)["sha256"]


def machine(model_dir: Path) -> dict:
    """This machine as a profile knows it, and its key."""
    st = os.stat(model_dir)
    facts = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
             os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
             "drive": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"}
    facts["key"] = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return facts


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else the platform's."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


@dataclass
class Profile:
    name: str
    path: Path
    doc: dict

    @property
    def options(self) -> dict:
        return self.doc["options"]

    def describe(self, options: dict) -> str:
        """The options as flags: ``--prefetch --pin-share 0.25``."""
        return describe(options)


def describe(options: dict) -> str:
    """Tunable options as flags: ``--prefetch --pin-share 0.25``; a false flag as
    ``--no-prefetch`` / ``no --direct-io``."""
    parts = []
    for dest, value in options.items():
        flag, kind = TUNABLE[dest]
        if kind is bool:
            parts.append(flag if value else "--no-prefetch" if dest == "prefetch" else f"no {flag}")
        elif kind is list:
            parts += [f"{flag} {item}" for item in value or ()]
        elif value is not None:
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(parts) or "the defaults"


def write(doc: dict, name: str) -> Path:
    """Write a profile atomically to the profiles dir; returns its path."""
    target = profiles_dir() / f"{name}.json"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        smallfile.write_atomic(target, json.dumps(doc, indent=1))
    except OSError as exc:
        raise write_error(exc, target, "the profile") from None
    return target


def read(path: Path) -> Profile:
    """A profile file, checked: one ModelFormatError naming it otherwise."""
    doc = smallfile.read_json(path, PROFILE_BYTES, "colibri profile")

    def fail(what):
        return ModelFormatError(f"{path}: colibri profile {what}")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail(f"is not a {FORMAT} document")
    if doc.get("version") != VERSION:
        raise fail(f"has version {doc.get('version')!r}; this colibri reads version {VERSION}")
    for key, kind in (("model_key", str), ("machine", dict), ("options", dict), ("created", str)):
        if not isinstance(doc.get(key), kind):
            raise fail(f"needs {key} ({kind.__name__})")
    for dest, value in doc["options"].items():
        if dest not in TUNABLE:
            raise fail(f"sets {dest!r}, which a profile may not (only {', '.join(sorted(TUNABLE))})")
        kind = TUNABLE[dest][1]
        ok = value is None or (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))) or (
            kind is float and isinstance(value, int) and not isinstance(value, bool))
        if kind is list and ok and not all(isinstance(item, str) and item for item in value or ()):
            ok = False
        if not ok or (dest == "pin_share" and value is not None and not 0 <= value <= 1) or (
                dest in ("prefetch_slots", "slots") and value is not None and value < 1):
            raise fail(f"option {dest} has the bad value {value!r}")
    return Profile(Path(path).stem, Path(path), doc)


def resolve(model_dir: Path, choice: str | None) -> tuple[Profile | None, str | None]:
    """The profile to apply (None for none) and a warning, if any. ``choice``: None (the
    newest of this model on this machine), "none", a name in the profiles dir or a path."""
    if choice == "none":
        return None, None
    try:
        key = model_key(model_dir)
    except (ColibriError, OSError):  # no readable model: loading it says so, after every option is checked
        return None, None
    if choice is not None:
        path = Path(choice) if ("/" in choice or choice.endswith(".json")) else profiles_dir() / f"{choice}.json"
        if not smallfile.present(path):
            raise UsageError(f"--profile {choice}: no profile at {path} (colibri tune writes them; none: without)")
        profile = read(path)
        if profile.doc["model_key"] != key:
            raise UsageError(f"--profile {choice}: {path} was tuned for another model "
                             f"({profile.doc.get('model_dir', '?')}); tune this one with colibri tune")
        here = machine(model_dir)["key"]
        warning = None if profile.doc["machine"].get("key") == here else (
            f"profile {profile.name} was measured on another machine ({profile.doc['machine'].get('cpu', '?')})")
        return profile, warning
    directory = profiles_dir()
    if not directory.is_dir():
        return None, None
    here = machine(model_dir)["key"]
    found = []
    for path in directory.glob("*.json"):
        try:
            profile = read(path)
        except (ModelFormatError, OSError):
            continue  # another's damaged file is not this command's business; --profile NAME says why
        if profile.doc["model_key"] == key and profile.doc["machine"].get("key") == here:
            found.append((profile.doc["created"], profile))
    return (max(found, key=lambda item: item[0])[1] if found else None), None


def apply(ctx, model_dir: Path, choice: str | None, values: dict) -> dict | None:
    """Put the profile's options into ``values`` (option dest -> value) where the command
    line left them at their defaults; say so in one line on stderr. Returns what was
    applied (``{"name", "path", "options"}``) or None."""
    from click.core import ParameterSource

    profile, warning = resolve(Path(model_dir), choice)
    if profile is None:
        return None
    import click

    applied = {}  # options this command does not have (serve's slots for run) are left out
    for dest, value in profile.options.items():
        source = ctx.get_parameter_source(dest) if dest in ctx.params else None
        if dest in values and source in (ParameterSource.DEFAULT, None):
            if dest == "mirrors":  # a mirror's drive may be gone since: read without it, and say so
                gone = [m for m in value if not _mirror_dir(m).is_dir()]
                for m in gone:
                    click.echo(f"profile {profile.name}: mirror {_mirror_dir(m)} is not there; not used", err=True)
                value = tuple(m for m in value if m not in gone)
                if not value:
                    continue
            values[dest] = value
            applied[dest] = value

    note = f" ({warning})" if warning else ""
    kept = sorted(d for d in profile.options if d in values and d not in applied)  # given on the command line
    given = f"; {', '.join(TUNABLE[d][0] for d in kept)} as given" if kept else ""
    click.echo(f"profile {profile.name}: {profile.describe(applied)} (colibri tune, {profile.doc['created'][:10]}"
               f"{given}){note}; --profile none: without", err=True)
    return {"name": profile.name, "path": str(profile.path), "options": applied}


def _mirror_dir(value: str) -> Path:
    from colibri_core.io.drives import MirrorSpec

    return MirrorSpec.parse(value).path


def new_document(model_dir: Path, options: dict, *, budget: dict, table: list, facts: dict, seconds: float) -> dict:
    return {"format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model_dir": str(Path(model_dir).resolve()), "model_key": model_key(model_dir), "machine": machine(model_dir),
            "options": options, "budget": budget, "facts": facts, "tuned_s": round(seconds, 1), "table": table}
