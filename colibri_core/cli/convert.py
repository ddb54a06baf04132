"""``colibri convert``: rewrite a model's weights into a colibri container.

Routed experts and/or the dense linear weights are quantised (int4-gs64, int8-row,
mxfp4) or recast (bf16, f32), experts stored fused (one (experts, rows, cols) tensor)
one expert at a time into a fused tensor of the target format; everything else (embeddings, norms, routers, tensors a
block reads as arrays) is copied byte for byte. The work goes shard by shard, tensor by
tensor, so memory holds one tensor, and every output shard is written atomically. A
manifest (``colibri-convert.json``) records the source, the choices and the finished
shards, each with the source shards it was made from (size, modification and change
times, a hash of the header): an interrupted conversion resumes where it stopped and
gives the same bytes as an uninterrupted one, a finished shard whose sources changed
since is converted again, and a directory converted with other choices is refused. The
finished directory gets an integrity manifest (``colibri-integrity.json``, see
``io/integrity.py``) hashing every tensor written.

``--report`` loads both models and compares their next-token distributions on fixed
prompts: cosine similarity of the logits, KL divergence, and how often the greedy token
agrees.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from colibri_core.model.blueprint import inspect_model
from colibri_core.engine import perplexity as ppl
from colibri_core.io.checkpoint import INDEX_NAME
from colibri_core.io import integrity
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.container import metadata as container_metadata, stamp_of
from colibri_core.errors import ModelFormatError, ResourceError, UnsupportedModelError, UsageError
from colibri_core.formats.base import f32_to_bf16
from colibri_core.formats.integer import FORMATS, StampedFormat
from colibri_core.io import smallfile
from colibri_core.io.safetensors import StreamWriter, TensorInfo
from colibri_core.warn import warn

MANIFEST = "colibri-convert.json"
MANIFEST_VERSION = 2  # 2: every finished shard records its sources; a version-1 manifest's shards are redone
TARGETS = {"int4": "int4-gs64", "int8": "int8-row", "mxfp4": "mxfp4", "bf16": "bf16", "f32": "f32", "keep": "keep"}
SKIP_FILES = {INDEX_NAME, MANIFEST, "colibri-usage.json", integrity.MANIFEST_NAME}
MAX_COPIED_FILE = 256 << 20


@dataclass
class ConvertResult:
    out: Path
    shards_written: int
    shards_resumed: int
    tensors_converted: int
    bytes_in: int
    bytes_out: int
    report: dict | None = None
    notes: list[str] = field(default_factory=list)


def _target_specs(target: str, name: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    if target in FORMATS:
        return FORMATS[target]().specs(name, shape)
    return [(name, "BF16" if target == "bf16" else "F32", shape)]


def _encode(target: str, name: str, weight: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
    if target in FORMATS:
        return FORMATS[target]().encode(name, weight)
    if target == "bf16":
        return {name: ("BF16", f32_to_bf16(weight))}
    return {name: ("F32", np.ascontiguousarray(weight, dtype=np.float32))}


def convert(src: str | Path, out: str | Path, *, experts: str = "int4", dense: str = "keep",
            progress: Callable[[int, int], None] | None = None) -> ConvertResult:
    """Convert ``src`` into ``out``. ``progress(done_bytes, total_bytes)`` is called as
    source bytes are processed."""
    for what, choice in (("experts", experts), ("dense", dense)):
        if choice not in TARGETS:
            raise UsageError(f"--{what} {choice!r}: choose one of {', '.join(TARGETS)}")
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise UsageError("--out must be a different directory from --model")
    bp = _inspect_with_mtp(src)
    try:
        copied = _files_to_copy(bp.model_dir)  # a FIFO or device among them is refused now, not after the work
        notes: list[str] = []
        plan = _plan(bp, TARGETS[experts], TARGETS[dense], notes)
        with _storage_errors(out), _only_writer(out):
            manifest = _open_manifest(bp, out, experts, dense)
            return _run(bp, out, plan, manifest, copied, progress, notes)
    finally:
        bp.close()


@contextmanager
def _storage_errors(out: Path):
    """What the machine refuses while we write (disk full, read-only, no permission) is a
    ResourceError saying what to do; the finished shards stay, so a re-run resumes."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:
            raise
        where = exc.filename or out
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceError(f"disk full while writing {out} ({exc.strerror}): free space and re-run the same "
                                "command: it resumes from the last finished shard") from None
        if exc.errno == errno.EROFS:
            raise ResourceError(f"{where}: read-only file system; choose an --out on a writable drive") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ResourceError(f"{where}: permission denied; choose an --out you can write") from None
        raise ResourceError(f"{where}: {exc.strerror} while converting into {out}; re-running resumes from the last "
                            "finished shard") from None


@contextmanager
def _only_writer(out: Path):
    """Hold an exclusive lock on ``out`` while converting: two conversions into one
    directory would otherwise delete each other's temporary files and overwrite each
    other's manifest. The lock is on the directory itself (nothing extra is left in it)
    and goes with the process, however it ends."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ResourceError(f"another colibri convert is writing {out}; wait for it to finish (then re-running "
                                "finds the work done) or choose another --out") from None
        yield
    finally:
        os.close(fd)


def _inspect_with_mtp(src: Path):
    """The model with its multi-token-prediction layers declared where it has them and its
    family builds them (so that they are converted under the MTP rule of ``_plan``); a
    model without (or whose family reads no MTP layers) as it is: its MTP tensors, if any,
    are then copied unchanged."""
    try:
        return inspect_model(src, mtp=True, mtp_int4=True)
    except (UsageError, UnsupportedModelError, ModelFormatError):
        return inspect_model(src)


# formats too coarse for a multi-token-prediction layer, and what such a layer gets instead
# (the original engine measured 0-4% acceptance for int4 MTP heads)
MTP_INSTEAD = {"int4-gs64": "int8-row", "mxfp4": "int8-row"}


def _plan(bp, experts: str, dense: str, notes: list[str] | None = None) -> dict[str, str]:
    """tensor name -> target (a format name, "bf16", "f32" or "keep"). A tensor already
    stored in its target format is left out (copied as it is, stamp and all): decoding
    and encoding it again could only lose precision. One stored in another quantised
    format (colibri's, or a checkpoint's own: fp8, MXFP4, int4) is requantised, and
    ``notes`` says so."""
    plan: dict[str, str] = {}
    same: dict[str, int] = {}
    requantised: dict[tuple[str, str], int] = {}

    mtp_prefixes = tuple(p for m in bp.lm.mtp for p in m.prefixes)
    kept_for_mtp = 0

    def choose(info, target: str, what: str) -> None:
        nonlocal kept_for_mtp
        if mtp_prefixes and info.name.startswith(mtp_prefixes) and target in MTP_INSTEAD:
            target, kept_for_mtp = MTP_INSTEAD[target], kept_for_mtp + 1
        stored = bp.resolver.format_for(info)
        if stored.name == target:
            same[what] = same.get(what, 0) + 1
            return
        if isinstance(stored, StampedFormat) or getattr(stored, "from_quantization_config", False):
            requantised[(what, stored.name)] = requantised.get((what, stored.name), 0) + 1
        plan[info.name] = target

    if experts != "keep":
        arrays: set[str] = set()
        seen: set[str] = set()
        for decl in bp.moe:
            for matrices in decl.matrices:
                for role, info in matrices.items():
                    # a fused tensor (experts, rows, cols) is converted whole, one expert at a time
                    whole = bp.checkpoint.tensors.get(info.name) or bp.checkpoint.tensors[info.name.split("[")[0]]
                    if matrices.use_of(role) != "linear":  # biases, transposed slices: read as arrays, copied
                        arrays.add(whole.name)
                    elif whole.name not in seen:
                        seen.add(whole.name)
                        choose(whole, experts, "expert")
        if arrays and notes is not None:
            notes.append(f"{len(arrays)} expert tensors are read as arrays (biases, or stored transposed): copied "
                         "unchanged")
    if dense != "keep":
        for p in bp.weights.params.values():
            if p.role == "linear" and len(p.shape) == 2:
                choose(p.info, dense, "dense")
    if notes is not None:
        if kept_for_mtp:
            notes.append(f"{kept_for_mtp} tensors of the multi-token-prediction layer are int8-row, not 4-bit: "
                         "4-bit MTP layers draft poorly")
        for what, n in same.items():
            target = experts if what == "expert" else dense
            notes.append(f"{n} {what} tensors are already {target}: copied unchanged, not requantised")
        for (what, stored), n in requantised.items():
            target = experts if what == "expert" else dense
            notes.append(f"{n} {what} tensors stored as {stored} are requantised to {target}: the rounding errors add up "
                         "(convert from the original weights for the best quality)")
    return plan


def _source_files(bp) -> dict[str, int]:
    return {name: sf.file_size for name, sf in sorted(bp.checkpoint.files.items())}


def _files_to_copy(model_dir: Path) -> list[Path]:
    """The model directory's files other than weights and colibri's own, which the
    conversion copies (subdirectories are not part of the model). Each must be a regular
    file once links are followed: anything else is refused before it is opened."""
    files = []
    for item in sorted(model_dir.iterdir()):
        if item.suffix == ".safetensors" or item.name in SKIP_FILES or item.is_dir():
            continue
        smallfile.check_regular(item, "model file")
        files.append(item)
    return files


def _open_manifest(bp, out: Path, experts: str, dense: str) -> dict:
    wanted = {"source": str(bp.model_dir.resolve()), "experts": experts, "dense": dense}
    path = out / MANIFEST
    if smallfile.present(path):
        try:
            manifest = smallfile.read_json(path, smallfile.MANIFEST_BYTES, "conversion manifest")
        except ModelFormatError:
            manifest = None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("done"), dict):
            raise UsageError(f"{path}: unreadable conversion manifest; delete {out} and convert again")
        if manifest.get("colibri_convert") not in (1, MANIFEST_VERSION):
            raise UsageError(f"{path}: written by another colibri (manifest version "
                             f"{manifest.get('colibri_convert')!r}); delete {out} and convert again")
        for key, value in wanted.items():
            if manifest.get(key) != value:
                raise UsageError(f"{out} holds a conversion with {key} = {manifest.get(key)!r}, not {value!r}; "
                                 "refusing to mix: choose another --out or delete it")
        manifest["colibri_convert"] = MANIFEST_VERSION
        manifest.pop("source_files", None)  # version 1's sizes: each shard's sources replace them
        return manifest
    if any(out.iterdir()):  # _only_writer made it
        raise UsageError(f"{out} exists and is not a colibri conversion in progress; choose an empty or new --out")
    manifest = {"colibri_convert": MANIFEST_VERSION, **wanted, "done": {}, "complete": False}
    _write_json(path, manifest)
    return manifest


def _fingerprint(sf) -> dict:
    """What tells this version of a source shard from any other: its size, modification
    and change times (of the file as it was opened) and a hash of its header. A tensor
    rewritten in place changes the times; one whose times were restored (``cp -p``)
    still changes the change time."""
    return {"size": sf.stat.st_size, "mtime_ns": sf.stat.st_mtime_ns, "ctime_ns": sf.stat.st_ctime_ns,
            "header_sha256": hashlib.sha256(sf.header_bytes()).hexdigest()}


def _plan_digest(specs, meta: dict, targets: list) -> str:
    """Hash of what an output shard is made to hold (tensors, stamps, each source tensor's
    target): a config change that alters it redoes the shard even if no source did."""
    blob = json.dumps([specs, meta, targets], sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _still_valid(recorded, target_path: Path, plan_digest: str, fingerprint) -> bool:
    """Whether a shard the manifest lists as finished can be kept: the file is there
    with the size written, made for the same plan from sources that have not changed
    since (``fingerprint(name)``: a source shard's fingerprint now, None if it is gone)."""
    if not isinstance(recorded, dict) or recorded.get("plan") != plan_digest:
        return False  # a version-1 entry (a bare size) says nothing of its sources
    sources = recorded.get("sources")
    if not isinstance(sources, dict) or not sources:
        return False
    if any(fingerprint(name) != value for name, value in sources.items()):
        return False
    try:
        st = os.stat(target_path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == recorded.get("size")


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _run(bp, out: Path, plan: dict[str, str], manifest: dict, copied: list[Path], progress,
         notes: list[str] = ()) -> ConvertResult:
    for stale in out.glob("*.tmp-*"):
        stale.unlink()
    resolver, checkpoint = bp.resolver, bp.checkpoint
    for gone in [shard for shard in manifest["done"] if shard not in checkpoint.files]:
        (out / gone).unlink(missing_ok=True)  # its source shard is no longer in the model
        del manifest["done"][gone]
    shard_of_path = {sf.path: shard for shard, sf in checkpoint.files.items()}
    fingerprints: dict[str, dict] = {}

    def fingerprint(shard: str) -> dict | None:
        if shard not in checkpoint.files:
            return None
        if shard not in fingerprints:
            fingerprints[shard] = _fingerprint(checkpoint.files[shard])
        return fingerprints[shard]
    # companions of converted tensors (e.g. fp8 scale_inv) are not carried over
    dropped = {c.name for name in plan for c in resolver.companions(checkpoint.info(name))}
    files = _source_files(bp)
    total, done_bytes = sum(files.values()), 0
    result = ConvertResult(out, 0, 0, 0, total, 0, notes=list(notes))
    weight_map: dict[str, str] = {}
    keeps_config = False  # whether a copied tensor still needs quantization_config (fp8, compressed-tensors, MXFP4 blocks)
    for shard, sf in sorted(checkpoint.files.items()):
        tensors = sorted(sf.tensors.values(), key=lambda t: t.offset)
        specs, stamps = [], {}
        for t in tensors:
            if t.name in dropped and t.name not in plan:
                continue
            target = plan.get(t.name)
            if target is None:
                specs.append((t.name, t.dtype, t.shape))
                keeps_config = keeps_config or getattr(resolver.claimant(t), "from_quantization_config", False)
                stamp = stamp_of(checkpoint, t)
                if stamp is not None:  # a quantised tensor copied as it is keeps its stamp
                    stamps[t.name] = dict(stamp)
            else:
                shape = resolver.logical_shape(t)
                # written under its unpacked name (compressed-tensors X.weight_packed -> X.weight)
                specs.extend(_target_specs(target, resolver.logical_name(t), shape))
                if target in FORMATS:
                    stamps[resolver.logical_name(t)] = {"fmt": target, "shape": list(shape)}
        for name, _, _ in specs:
            weight_map[name] = shard
        target_path = out / shard
        meta = container_metadata(stamps) if stamps else {"format": "pt"}
        plan_digest = _plan_digest(specs, meta, [[t.name, plan.get(t.name)] for t in tensors])
        recorded = manifest["done"].get(shard)
        if _still_valid(recorded, target_path, plan_digest, fingerprint):
            result.shards_resumed += 1
            result.bytes_out += recorded["size"]
            done_bytes += files[shard]
            if progress:
                progress(done_bytes, total)
            continue
        read_from = {sf.path}  # the source shards this output shard's bytes come from
        shard_start = done_bytes

        def read(infos: list[TensorInfo]) -> dict[str, np.ndarray]:
            read_from.update(t.path for t in infos)
            return checkpoint.read_many(infos)

        with StreamWriter(target_path, specs, meta) as writer:
            for t in tensors:
                if t.name in dropped and t.name not in plan:
                    continue
                target = plan.get(t.name)
                if target is None:
                    writer.write(t.name, (t.dtype, read([t])[t.name]))
                elif len(resolver.logical_shape(t)) == 3:
                    _write_fused(writer, resolver, read, t, target)
                    result.tensors_converted += 1
                else:
                    raw = read(resolver.with_companions([t]))
                    weight = resolver.decode_all([t], {k: v for k, v in raw.items()})[t.name]
                    for name, value in _encode(target, resolver.logical_name(t), weight).items():
                        writer.write(name, value)
                    result.tensors_converted += 1
                done_bytes += t.nbytes
                if progress:
                    progress(done_bytes, total)
            size = writer.commit()
        # the total counts whole files (headers, dropped tensors): a finished shard is all of its file
        done_bytes = shard_start + files[shard]
        if progress:
            progress(done_bytes, total)
        sources = sorted(shard_of_path[path] for path in read_from)
        for name in sources:
            if checkpoint.files[name].changed_since_open():
                raise ModelFormatError(f"{checkpoint.files[name].path}: changed while it was being converted; run the same "
                                       "command again once it is complete: what was made from it is redone")
        manifest["done"][shard] = {"size": size, "plan": plan_digest,
                                   "sources": {name: fingerprint(name) for name in sources}}
        _write_json(out / MANIFEST, manifest)
        result.shards_written += 1
        result.bytes_out += size
    _finish(bp, out, weight_map, result, manifest, copied, keeps_config)
    return result


def _write_fused(writer: StreamWriter, resolver, read, t, target: str) -> None:
    """Experts stored fused, (experts, rows, cols): each expert's slice decoded and encoded
    on its own (memory holds one expert), the packed rows written as they come and the
    scales (1/16 of them or less) after them."""
    count = resolver.logical_shape(t)[0]
    stride = t.nbytes // count
    name = resolver.logical_name(t)
    held: dict[str, list] = {}

    def pieces():
        for e in range(count):
            piece = TensorInfo(f"{t.name}[{e}]", t.path, t.dtype, t.shape[1:], t.offset + e * stride, stride)
            raw = read(resolver.with_companions([piece]))
            weight = resolver.decode_all([piece], raw)[piece.name]
            # each piece one expert along the fused tensor's first axis
            encoded = {key: (dtype, array[None]) for key, (dtype, array) in _encode(target, name, weight).items()}
            for other, value in encoded.items():
                if other != name:
                    held.setdefault(other, []).append(value)
            yield encoded[name]

    writer.write_parts(name, pieces())
    for other, values in held.items():
        writer.write_parts(other, values)


def _finish(bp, out: Path, weight_map: dict[str, str], result: ConvertResult, manifest: dict, copied: list[Path],
            keeps_config: bool = False) -> None:
    index = {"metadata": {"total_size": result.bytes_out, "colibri_convert": {k: manifest[k] for k in ("experts", "dense")}},
             "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / INDEX_NAME, index)
    for item in copied:
        if smallfile.check_regular(item, "model file").st_size > MAX_COPIED_FILE:
            result.notes.append(f"not copied (larger than {MAX_COPIED_FILE >> 20} MiB): {item.name}")
            continue
        if item.name == "config.json":
            config = smallfile.read_json(item, smallfile.CONFIG_BYTES, "model config")
            if not keeps_config:  # no tensor the config describes is left
                for holder in (config, config.get("text_config")):
                    if isinstance(holder, dict):
                        holder.pop("quantization_config", None)
            _write_json(out / item.name, config)
        else:
            shutil.copyfile(item, out / item.name)
    with Checkpoint(out) as written:  # hashes what is on disk now: resumed shards included
        integrity.write(written)
    manifest["complete"] = True
    _write_json(out / MANIFEST, manifest)
    for note in result.notes:
        warn(note)


# -- quality report --------------------------------------------------------------------
def quality_report(src: str | Path, out: str | Path, *, prompts: int = 4, length: int = 24, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None, **load_options) -> dict:
    """Next-token distributions of the converted model against the source on fixed
    prompts (random token ids from ``seed``): cosine similarity of the logits, KL(source
    || converted) of the softmax, and greedy agreement, over every position; and, when the
    source carries held-out text (``heldout/NAME.txt``, as colibri-trained's models do),
    perplexity, KL and top-1 agreement on each domain of it (``heldout``).
    ``progress(done, total)`` counts the prompts compared (0 once both models loaded)."""
    import colibri_core

    cos, kl, agree = [], [], []
    with colibri_core.load(src, history=False, **load_options) as a, colibri_core.load(out, history=False, **load_options) as b:
        vocab = a.lm.vocab_size
        rng = np.random.default_rng(seed)
        length = min(length, a.lm.max_context)
        if progress:
            progress(0, prompts)
        for done in range(1, prompts + 1):
            ids = rng.integers(0, vocab, length).tolist()
            x, y = a.logits(ids).astype(np.float64), b.logits(ids).astype(np.float64)
            cos.extend(np.sum(x * y, axis=1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)))
            p, q = ppl.log_softmax(x), ppl.log_softmax(y)
            kl.extend(np.sum(np.exp(p) * (p - q), axis=1))
            agree.extend(x.argmax(axis=1) == y.argmax(axis=1))
            if progress:
                progress(done, prompts)
        heldout = heldout_report(a, b, Path(src)) if (Path(src) / ppl.HELDOUT_DIR).is_dir() else {}
    return {"positions": len(cos), "cosine_mean": float(np.mean(cos)), "cosine_min": float(np.min(cos)),
            "kl_mean": float(np.mean(kl)), "kl_max": float(np.max(kl)), "greedy_agreement": float(np.mean(agree)),
            "heldout": heldout}


HELDOUT_TOKENS = 8192  # scored per domain: enough for a perplexity to two decimals
HELDOUT_WINDOW = 256


def heldout_report(source, converted, src_dir: Path) -> dict:
    """Per held-out domain the source carries (``heldout/NAME.txt``): the converted
    model's teacher-forced perplexity beside the source's, KL(source || converted) per
    token and top-1 agreement (colibri_core/engine/perplexity.py)."""
    from colibri_core.io import smallfile

    out = {}
    for path in sorted((src_dir / ppl.HELDOUT_DIR).glob("*.txt")):
        text = smallfile.read_text(path, 64 << 20, "held-out text")
        wins = ppl.windows(source.encode(text), min(HELDOUT_WINDOW, source.lm.max_context), HELDOUT_TOKENS)
        if wins:
            out[path.stem] = ppl.compare(converted, source, wins).as_dict()
    return out
