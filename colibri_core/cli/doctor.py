"""``colibri doctor``: read-only readiness checks of a model directory.

Each check has a status (pass, warn or fail), a detail and, when it does not pass, a
hint. Nothing is written, except the integrity manifest when ``--write-manifest`` asks
for it. The default checks parse every shard header (cheap, and what ``colibri run``
needs anyway); ``--deep`` also reads every tensor's bytes once, proving the files are
readable to the end and float weights hold no NaN, no infinity and no magnitude beyond
MAX_WEIGHT_MAGNITUDE, and checks them against the integrity manifest
(``io/integrity.py``) when there is one.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from colibri_core.errors import BudgetError, ColibriError
from colibri_core.units import format_bytes

LOW_DISK_BYTES = 64 << 20
# Larger than any trained weight: float16's largest finite value. Released models run in
# float16 somewhere, which such a weight could not, and the largest real weights (norm
# gains) are orders of magnitude smaller. Corrupt bytes look like this: one flipped
# exponent bit makes a bf16 weight of 0.02 about 1e36, and its products overflow to
# infinity a layer or two later.
MAX_WEIGHT_MAGNITUDE = 65504.0


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    hint: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def run_checks(model_dir: str | Path, *, ram: int | None = None, deep: bool = False,
               write_manifest: bool = False) -> list[Check]:
    checks: list[Check] = []
    add = checks.append
    from colibri_core.io.hub_cache import model_directory

    try:
        model_dir = model_directory(model_dir)  # a hub cache repo root stands for its refs/main snapshot
    except ColibriError as exc:
        add(Check("model directory", "fail", str(exc), "point --model at the snapshot directory, or download the model again"))
        return checks
    if not model_dir.is_dir():
        problem = "is not a directory" if model_dir.exists() else "does not exist"
        add(Check("model directory", "fail", f"{model_dir} {problem}", "point --model at a Hugging Face model directory"))
        return checks
    add(Check("model directory", "pass", str(model_dir)))

    from colibri_core.model.config import check_family_keys, read_json

    try:
        config = read_json(model_dir / "config.json", "model config")
    except ColibriError as exc:
        add(Check("config.json", "fail", str(exc), "the directory needs a valid config.json from the model's release"))
        return checks
    model_type = config.get("model_type")
    try:
        check_family_keys(model_dir / "config.json", config)
    except ColibriError as exc:
        add(Check("config.json", "fail", str(exc), "restore config.json from the model's release"))
        return checks
    add(Check("config.json", "pass" if model_type else "warn", f"model_type {model_type!r}",
              "" if model_type else "config.json has no model_type; the family is chosen from 'architectures'"))
    from colibri_core.model.config import eos_token_ids

    try:
        eos_token_ids(model_dir, config)  # what loading reads of generation_config.json
    except ColibriError as exc:
        add(Check("generation_config.json", "fail", str(exc), "restore generation_config.json from the model's release"))

    from colibri_core.plugins.discovery import get_registry

    try:
        family = get_registry().family_for(model_type, config.get("architectures"))
        add(Check("family plugin", "pass", f"{family.spec.name} (plugin {family.plugin})"))
    except ColibriError as exc:
        add(Check("family plugin", "fail", str(exc), f"a family plugin for {model_type!r}: colibri list-families shows the "
                                                     "installed families, colibri plugins the disabled ones"))
        family = None

    checks.extend(_tokenizer_checks(model_dir))

    from colibri_core.io.checkpoint import INDEX_NAME, read_index
    from colibri_core.io.smallfile import present

    index = model_dir / INDEX_NAME
    shards = sorted(model_dir.glob("*.safetensors"))
    if present(index):
        try:
            weight_map = read_index(index)
        except ColibriError as exc:
            add(Check("weight shards", "fail", str(exc), "restore the index file from the release"))
        else:
            listed = sorted(set(weight_map.values()))
            missing = [s for s in listed if not (model_dir / s).is_file()]
            add(Check("weight shards", "fail" if missing else "pass",
                      f"{len(listed)} shards in {INDEX_NAME}" + (f"; missing: {', '.join(missing[:5])}" if missing else ""),
                      "copy the missing shards from the model's release" if missing else ""))
    elif shards:
        add(Check("weight shards", "pass", f"{len(shards)} safetensors files, no index"))
    else:
        add(Check("weight shards", "fail", "no *.safetensors files", "download the model's safetensors weights into this directory"))

    bp = None
    if family is not None:
        from colibri_core.model.blueprint import inspect_model

        try:
            bp = inspect_model(model_dir)
            add(Check("headers and tensors", "pass",
                      f"{len(bp.checkpoint.files)} shard headers valid, {len(bp.weights.params)} dense tensors and "
                      f"{sum(d.count for d in bp.moe)} experts match the config"))
        except ColibriError as exc:
            add(Check("headers and tensors", "fail", str(exc), _headers_hint(exc)))
    try:
        if bp is not None:
            checks.append(_budget_check(bp, ram))
            checks.append(_history_check(bp))
            if deep:
                checks.append(_data_check(bp))
            checks.append(_integrity_check(bp, deep=deep, write=write_manifest))
        checks.append(_disk_space_check(model_dir))
    finally:
        if bp is not None:
            bp.close()
    return checks


def _headers_hint(exc: ColibriError) -> str:
    from colibri_core.io.checkpoint import INDEX_NAME, ShardOutsideModelError

    if isinstance(exc, ShardOutsideModelError):
        return (f"{INDEX_NAME} may name only files inside the model directory (symlinks there are fine, as in the "
                "Hugging Face cache): put the shard in the directory, or link it there, and name it in weight_map")
    return "the named file is damaged or does not belong to this config: re-download it"


def _tokenizer_checks(model_dir: Path) -> list[Check]:
    from colibri_core.io.smallfile import present
    from colibri_core.model.tokenizer import Tokenizer

    if not present(model_dir / "tokenizer.json"):
        return [Check("tokenizer", "warn", "no tokenizer.json: the model runs from token ids only",
                      "copy tokenizer.json from the model's release to use text prompts")]
    try:
        tok = Tokenizer(model_dir)
    except ColibriError as exc:
        return [Check("tokenizer", "fail", str(exc), "re-download tokenizer.json")]
    out = [Check("tokenizer", "pass", f"{tok.vocab_size} tokens")]
    if tok.chat_template is None:
        out.append(Check("chat template", "warn", "none: --chat and chat APIs are unavailable",
                         "add chat_template to tokenizer_config.json or a chat_template.jinja"))
    else:
        out.append(Check("chat template", "pass", f"from {Path(tok.chat_template.origin).name}"))
    return out


def _budget_check(bp, ram: int | None) -> Check:
    try:
        p = bp.placement(ram=ram, cap=None)
    except BudgetError as exc:
        return Check("RAM budget", "fail", str(exc), "give a larger --ram, or run on a machine with more memory")
    detail = (f"{format_bytes(p.budget)} ({p.budget_source}): dense {format_bytes(p.dense_bytes)}, "
              f"{p.slots} of {p.experts_per_layer} experts per layer cached")
    from colibri_core.model.placement import budget_beyond_memory

    beyond = budget_beyond_memory(p.budget) if ram is not None else None
    if beyond:
        return Check("RAM budget", "warn", f"{detail}; {beyond}", "give a --ram within the memory available")
    if p.moe_layers and p.slots < bp.top_k:
        return Check("RAM budget", "warn", detail, f"fewer cached experts than top-k ({bp.top_k}): expect most expert reads from disk")
    return Check("RAM budget", "pass", detail)


def _history_check(bp) -> Check:
    from colibri_core.experts.history import FILENAME, RoutingHistory
    from colibri_core.warn import ColibriWarning

    if not bp.moe:
        return Check("routing history", "pass", "no routed experts")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ColibriWarning)
        history = RoutingHistory.open(bp.model_dir, bp.family.spec.name, bp.config.get("model_type"), len(bp.moe),
                                      bp.experts_per_layer)
    problems = [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]
    if problems:
        return Check("routing history", "warn", problems[0], f"delete {FILENAME}: colibri starts a new one")
    if history.path is None:
        return Check("routing history", "pass", "none yet (it is saved after the first run)")
    return Check("routing history", "pass", f"{history.total_tokens:.0f} tokens in {history.path}")


def _disk_space_check(model_dir: Path) -> Check:
    free = shutil.disk_usage(model_dir).free
    if free < LOW_DISK_BYTES:
        return Check("disk space", "warn", f"{format_bytes(free)} free next to the model",
                     "the routing history is saved next to the model (or in the cache dir); free some space")
    return Check("disk space", "pass", f"{format_bytes(free)} free")


def _data_check(bp) -> Check:
    """Read every tensor; float weights must be finite and below MAX_WEIGHT_MAGNITUDE."""
    nan, inf, huge = [], [], []
    total = 0
    for name, info in bp.checkpoint.tensors.items():
        raw = bp.checkpoint.read_many([info])[name]
        total += info.nbytes
        if info.dtype in ("F32", "F16", "BF16"):
            fmt = bp.resolver._by_dtype.get(info.dtype)
            values = fmt.decode(info, raw, {}) if fmt is not None else raw
            if np.isnan(values).any():
                nan.append(name)
            elif np.isinf(values).any():
                inf.append(name)
            elif values.size and float(np.abs(values).max()) > MAX_WEIGHT_MAGNITUDE:
                huge.append(f"{name} ({float(np.abs(values).max()):.3g})")
    problems = [f"{len(found)} tensors hold {what}, first {found[0]!r}" if what != "huge" else
                f"{len(found)} tensors hold values beyond +-{MAX_WEIGHT_MAGNITUDE:g}, which no trained weight has, "
                f"first {found[0]}" for what, found in (("NaN", nan), ("infinity", inf), ("huge", huge)) if found]
    if problems:
        return Check("tensor data (--deep)", "fail", "; ".join(problems),
                     "the weights are damaged: re-download the shards holding them")
    return Check("tensor data (--deep)", "pass", f"read all {format_bytes(total)}: every tensor readable, float weights "
                                                 f"finite and within +-{MAX_WEIGHT_MAGNITUDE:g}")


def _integrity_check(bp, *, deep: bool, write: bool) -> Check:
    from colibri_core.io import integrity
    from colibri_core.warn import ColibriWarning

    name = "integrity manifest"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ColibriWarning)
        manifest = integrity.Manifest.read(bp.checkpoint)
    problems = [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]
    if deep and manifest is not None:
        bad = integrity.mismatches(bp.checkpoint, manifest)
        if bad and not write:
            return Check(name, "fail", f"{len(bad)} tensors differ from {integrity.MANIFEST_NAME}, first {bad[0]!r}",
                         "the shards changed since the manifest was written: re-download them, or, if the change is "
                         "yours, rewrite it with colibri doctor --deep --write-manifest")
    if write:
        try:
            path = integrity.write(bp.checkpoint)
        except ColibriError as exc:
            return Check(name, "fail", str(exc), "make the model directory writable to store the manifest there")
        return Check(name, "pass", f"written: {path} ({len(bp.checkpoint.tensors)} tensors, {integrity.ALGORITHM})")
    if problems:
        return Check(name, "warn", problems[0], "rewrite it with colibri doctor --deep --write-manifest")
    if manifest is None:
        return Check(name, "pass", f"none: reads from mirrors are not verified ({integrity.MANIFEST_NAME} is written by "
                                   "colibri convert and colibri doctor --deep --write-manifest)")
    checked = " and every tensor matches" if deep else " (--deep checks every tensor against it)"
    return Check(name, "pass", f"{len(manifest.digests)} tensors hashed{checked}")
