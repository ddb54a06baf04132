"""A sequence's state saved to a file and resumed: the per-layer caches, the token ids
and the sampler, so that a conversation continues later (in another process, on another
backend) exactly as if it had never stopped. See docs/state.md.

What a saved state holds (the continuation rule): every token id so far (the prompt, the
tokens generated, and the stop token that ended the generation, if one did) and the
caches after feeding all of them **but the last**, the last sampled token, which the
generation that stopped had not fed yet. Resuming feeds exactly that token, then samples
on: what the uninterrupted generation would have done next. The sampler's random
generator and penalty counts come along, so a seeded sampled run continues identically.

The file is a safetensors file (any safetensors reader opens it): its ``__metadata__``
holds ``colibri_state``, a JSON document (format, version, the model's identity, the
token ids, the sampling parameters and sampler state, and per layer its kind, meta and
arrays with dtype, shape and byte offsets), and ``colibri_state_sha256``, the SHA-256
of that document's bytes followed by the whole data section. The arrays are the positions
in use only, in host (numpy) form: a state saved on one backend resumes on any other.
Reading checks everything (``read_state``: the file, the document, the digest;
``bind``: the model's identity and every layer's kind and shapes) and refuses with one
line naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri_core.errors import ColibriError, ModelFormatError, UsageError, write_error
from colibri_core.io import smallfile
from colibri_core.io.jsontext import parse_json
from colibri_core.io.safetensors import DTYPES, SafetensorsFile, as_array, write_safetensors
from colibri_core.nn.cache import Cache, LayerStates
from colibri_core.engine.sampling import Sampler, SamplingParams

FORMAT = "colibri-sequence-state"
VERSION = 1
DOC_KEY = "colibri_state"
DIGEST_KEY = "colibri_state_sha256"
# the float dtypes a saved array may have (the host forms of the backends' cache dtypes)
FLOAT_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64"}
_ST_FLOATS = {v: k for k, v in FLOAT_DTYPES.items()}
_READ_CHUNK = 16 << 20


def model_identity(model) -> dict:
    """Who a state belongs to: the SHA-256 of config.json's bytes and of the checkpoint's
    shard names and sizes (a state of another model, or of the same model re-quantised,
    is refused), with the model type and directory name for messages."""
    shards = {name: shard.file_size for name, shard in model.checkpoint.files.items()}
    return _identity(Path(model.model_dir), _config_bytes(model.model_dir), shards, model.config.get("model_type"))


def directory_identity(model_dir: str | os.PathLike) -> dict:
    """``model_identity`` of a model directory without loading the model (its shards'
    headers are read): what a tuned profile is keyed by."""
    from colibri_core.io.checkpoint import Checkpoint
    from colibri_core.io.jsontext import parse_json

    model_dir = Path(model_dir)
    config = _config_bytes(model_dir)
    doc = parse_json(config, str(model_dir / "config.json"))
    checkpoint = Checkpoint(model_dir)
    try:
        shards = {name: shard.file_size for name, shard in checkpoint.files.items()}
    finally:
        checkpoint.close()
    return _identity(model_dir, config, shards, doc.get("model_type") if isinstance(doc, dict) else None)


def _config_bytes(model_dir) -> bytes:
    return smallfile.read_bytes(Path(model_dir) / "config.json", smallfile.CONFIG_BYTES, "config.json")


def _identity(model_dir: Path, config: bytes, shards: dict[str, int], model_type) -> dict:
    h = hashlib.sha256(b"colibri model identity 1\0config.json\0")
    h.update(config)
    for name, size in sorted(shards.items()):
        h.update(f"\0{name}\0{size}".encode())
    return {"sha256": h.hexdigest(), "model_type": str(model_type), "dir": model_dir.name}


@dataclass(frozen=True, eq=False)
class SequenceState:
    """One sequence's state in host memory: ``save(path)`` writes it, ``read_state``
    reads one back, ``Model.resume`` continues it.

    token_ids: every id so far (prompt, generated tokens, and the stop token if one ended
    the generation); the caches hold all of them but the last (``positions``).
    layers: per layer None, ``{"kind", "meta", "arrays"}`` (host arrays by name) or, for a
    layer of several stateful blocks, ``{"kind": "parts", "parts": {name: ...}}``."""

    token_ids: tuple[int, ...]
    prompt_tokens: int  # how many of token_ids were the first prompt
    model: dict  # model_identity
    sampling: dict  # SamplingParams.as_dict()
    ignore_eos: bool
    sampler: dict  # Sampler.state()
    layers: list
    source: str | None = None  # the file it was read from

    @property
    def positions(self) -> int:
        """Positions in the caches: every token id but the last."""
        return len(self.token_ids) - 1

    @property
    def generated_ids(self) -> list[int]:
        return list(self.token_ids[self.prompt_tokens:])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in layer_arrays(self.layers))

    def save(self, path: str | os.PathLike) -> int:
        """Write the state to ``path`` atomically (a temporary file beside it, synced,
        renamed over it). Returns the file's size."""
        doc = {"format": FORMAT, "version": VERSION, "model": self.model, "positions": self.positions,
               "token_ids": list(self.token_ids), "prompt_tokens": self.prompt_tokens, "sampling": self.sampling,
               "ignore_eos": self.ignore_eos, "sampler": self.sampler}
        return write_layers(path, doc, self.layers)


def write_layers(path: str | os.PathLike, doc: dict, layers: list) -> int:
    """Write ``doc`` (a JSON object: format, version, positions, ...) with per-layer host
    arrays ``layers`` (SequenceState.layers' form) as a state file: the document gains the
    layout, the metadata its digest. Atomic; returns the file's size."""
    path = os.fspath(path)
    layout, tensors, offset = [], [], 0
    digest = hashlib.sha256()
    for i, node in enumerate(layers):
        entry, offset = _layout(node, f"layers.{i}", tensors, offset)
        layout.append(entry)
    text = _dumps({**doc, "layers": layout})
    digest.update(text.encode("utf-8"))
    for _, array in tensors:
        digest.update(array.reshape(-1).view(np.uint8))
    metadata = {DOC_KEY: text, DIGEST_KEY: digest.hexdigest()}
    try:
        return write_safetensors(path, tensors, metadata)
    except OSError as exc:
        raise write_error(exc, path, "the saved state") from None


def _dumps(doc) -> str:
    import json

    return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def _layout(node, prefix: str, tensors: list, offset: int):
    """The document's entry for one layer's node, appending its arrays to ``tensors``."""
    if node is None:
        return None, offset
    if node["kind"] == "parts":
        parts = {}
        for name, part in node["parts"].items():
            parts[name], offset = _layout(part, f"{prefix}.{name}", tensors, offset)
        return {"kind": "parts", "parts": parts}, offset
    arrays = {}
    for name, a in node["arrays"].items():
        dtype = FLOAT_DTYPES[a.dtype.name]
        end = offset + a.nbytes
        arrays[name] = {"tensor": f"{prefix}.{name}", "dtype": dtype, "shape": list(a.shape), "offsets": [offset, end]}
        tensors.append((f"{prefix}.{name}", np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))))
        offset = end
    return {"kind": node["kind"], "meta": node["meta"], "arrays": arrays}, offset


def layer_arrays(layers):
    """(name, host array) of every saved array, in file order."""
    def walk(node, prefix):
        if node is None:
            return
        if node["kind"] == "parts":
            for name, part in node["parts"].items():
                yield from walk(part, f"{prefix}.{name}")
        else:
            for name, a in node["arrays"].items():
                yield f"{prefix}.{name}", a
    for i, node in enumerate(layers):
        yield from walk(node, f"layers.{i}")


# -- capturing a live cache --------------------------------------------------------------
def check_saveable(cache: Cache) -> None:
    """A UsageError unless every layer's state kind can be saved (``export_state``)."""
    for i, layer in enumerate(cache.layers):
        for where, leaf in _leaves(layer, f"layer {i}"):
            if not (hasattr(leaf, "export_state") and hasattr(leaf, "import_state") and hasattr(leaf, "state_kind")):
                raise UsageError(f"{where}: its state ({type(leaf).__name__}) cannot be saved to a file")


def _leaves(state, where: str):
    if state is None:
        return
    if isinstance(state, LayerStates):
        for name, part in state.parts.items():
            yield from _leaves(part, f"{where} part {name!r}")
    else:
        yield where, state


def capture(model, cache: Cache, token_ids: list[int], prompt_tokens: int, sampling: SamplingParams,
            ignore_eos: bool, sampler: Sampler) -> SequenceState:
    """The host copy of a sequence whose ``cache`` holds every id of ``token_ids`` but the
    last. A ValueError (saying why) when it does not: a step left unfinished."""
    if len(token_ids) < 2 or cache.length != len(token_ids) - 1:
        raise ValueError(f"the caches hold {cache.length} positions, not the {len(token_ids) - 1} before the last "
                         "sampled token (the generation stopped inside a step)")
    layers = export_layers(model.backend, cache)
    return SequenceState(tuple(int(t) for t in token_ids), int(prompt_tokens), model_identity(model), sampling.as_dict(),
                         bool(ignore_eos), sampler.state(), layers)


def export_layers(ops, cache: Cache) -> list:
    """Host copies of every layer's state of ``cache`` (SequenceState.layers' form); a
    ValueError when a layer holds another number of positions than the cache."""

    def export(state, where):
        if state is None:
            return None
        if isinstance(state, LayerStates):
            return {"kind": "parts", "parts": {name: export(part, f"{where} part {name!r}")
                                               for name, part in state.parts.items()}}
        meta, arrays = state.export_state()
        if meta.get("length") != cache.length:
            raise ValueError(f"{where} holds {meta.get('length')} positions, not {cache.length} (the generation "
                             "stopped inside a step)")
        host = {}
        for name, a in arrays.items():
            h = np.array(ops.to_host(a))  # a copy: the host form may share the live cache's memory
            if h.dtype.name not in FLOAT_DTYPES:
                raise ValueError(f"{where}: array {name!r} is {h.dtype}, which a saved state does not hold")
            host[name] = h
        return {"kind": state.state_kind, "meta": dict(meta), "arrays": host}

    return [export(layer, f"layer {i}") for i, layer in enumerate(cache.layers)]


# -- reading -----------------------------------------------------------------------------
def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 a state file records over its document and data, from its header alone
    (``read_state`` checks that it covers them): names the file's content cheaply."""
    path = os.fspath(path)
    smallfile.check_regular(path, "saved state")
    try:
        sf = SafetensorsFile(path)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{path}: not a readable saved state: {str(exc).removeprefix(f'{path}: ')}") from None
    try:
        digest = sf.metadata.get(DIGEST_KEY)
    finally:
        sf.close()
    if not isinstance(digest, str):
        raise _fail(path, "has no digest")
    return digest


def read_state(path: str | os.PathLike) -> SequenceState:
    """Read and check a saved state: a regular file, a colibri state of a version this
    colibri reads, a well-formed document whose layout is exactly the file's tensors, and
    the digest of the document and the data. Anything else is one ModelFormatError naming
    the file. The model's identity and shapes are ``bind``'s."""
    keys = {"format", "version", "model", "positions", "token_ids", "prompt_tokens", "sampling", "ignore_eos", "sampler"}
    path = os.fspath(path)
    doc, layers = read_layers(path, FORMAT, VERSION, keys, _check_sequence)
    return SequenceState(tuple(doc["token_ids"]), doc["prompt_tokens"], doc["model"], doc["sampling"], doc["ignore_eos"],
                         doc["sampler"], layers, source=path)


def read_layers(path: str | os.PathLike, format: str, version: int, keys: set, check_doc) -> tuple[dict, list]:
    """A state file's document (of ``format`` and ``version``, with exactly ``keys`` and
    ``layers``; ``check_doc(doc, path)`` checks the rest) and its layers' host arrays, every
    check of ``read_state`` made."""
    path = os.fspath(path)
    smallfile.check_regular(path, "saved state")
    try:
        sf = SafetensorsFile(path)
    except ModelFormatError as exc:
        text = str(exc).removeprefix(f"{path}: ")
        raise ModelFormatError(f"{path}: not a readable saved state: {text}") from None
    try:
        return _read(sf, path, format, version, keys | {"layers"}, check_doc)
    finally:
        sf.close()


def _fail(path: str, what: str) -> ModelFormatError:
    return ModelFormatError(f"{path}: saved state {what}")


def _read(sf: SafetensorsFile, path: str, format: str, version: int, keys: set, check_doc) -> tuple[dict, list]:
    meta = sf.metadata
    if DOC_KEY not in meta:
        raise ModelFormatError(f"{path}: not a colibri saved state (no {DOC_KEY!r} in its metadata)")
    if set(meta) != {DOC_KEY, DIGEST_KEY}:
        raise _fail(path, f"has metadata keys {sorted(meta)}, expected exactly {[DOC_KEY, DIGEST_KEY]}")
    text = meta[DOC_KEY]
    doc = parse_json(text, f"{path}: saved state document", object_pairs_hook=_unique_keys)
    if not isinstance(doc, dict):
        raise _fail(path, "document is not a JSON object")
    if doc.get("format") != format:
        raise _fail(path, f"has format {doc.get('format')!r}, not {format!r}")
    found = doc.get("version")
    if found != version:
        newer = isinstance(found, int) and not isinstance(found, bool) and found > version
        raise _fail(path, f"has format version {found!r}; this colibri reads version {version}"
                          + (" (written by a newer colibri)" if newer else ""))
    if set(doc) != keys:
        raise _fail(path, f"document has keys {sorted(doc)}, expected {sorted(keys)}")
    digest = meta[DIGEST_KEY]
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise _fail(path, f"digest {digest[:80]!r} is not a SHA-256 in hex")

    model = doc["model"]
    if not (isinstance(model, dict) and set(model) == {"sha256", "model_type", "dir"}
            and all(isinstance(v, str) for v in model.values())):
        raise _fail(path, "model identity must be {sha256, model_type, dir} strings")
    check_doc(doc, path)
    positions = doc["positions"]
    if not isinstance(doc["layers"], list) or not doc["layers"]:
        raise _fail(path, "layers must be a non-empty list")

    # the layout names exactly the file's tensors, with their dtype, shape and place
    data_start = 8 + sf.header_length
    declared: dict[str, Any] = {}
    layers = [_check_node(node, f"layer {i}", f"layers.{i}", positions, declared, path)
              for i, node in enumerate(doc["layers"])]
    if set(declared) != set(sf.tensors):
        extra = sorted(set(sf.tensors) - set(declared))
        missing = sorted(set(declared) - set(sf.tensors))
        raise _fail(path, f"tensors do not match its layout (in the file only: {extra[:3]}, in the layout only: "
                          f"{missing[:3]})")
    for name, (dtype, shape, (begin, end)) in declared.items():
        info = sf.tensors[name]
        if (info.dtype, info.shape, info.offset - data_start, info.nbytes) != (dtype, shape, begin, end - begin):
            raise _fail(path, f"tensor {name!r} is {info.dtype} {list(info.shape)} at {info.offset - data_start} in the "
                              f"file but {dtype} {list(shape)} at {begin} in its layout")

    # the digest covers the document and every byte of the data
    size = sf.file_size - data_start
    data = np.empty(size, dtype=np.uint8)
    h = hashlib.sha256(text.encode("utf-8"))
    view = memoryview(data)
    for at in range(0, size, _READ_CHUNK):
        chunk = view[at : at + _READ_CHUNK]
        sf.read_into(data_start + at, chunk)
        h.update(chunk)
    if h.hexdigest() != digest:
        raise _fail(path, "is damaged: the SHA-256 of its document and data differs from the one recorded")
    if sf.changed_since_open():
        raise _fail(path, "changed while it was read")
    for name, info in sf.tensors.items():
        begin = info.offset - data_start
        declared[name] = as_array(info, data[begin : begin + info.nbytes])
    return doc, [_fill(node, declared) for node in layers]


def _check_sequence(doc: dict, path: str) -> None:
    """A sequence state's own fields: token ids, positions, the sampler."""
    ids = doc["token_ids"]
    if not isinstance(ids, list) or len(ids) < 2 or not all(_is_count(t) for t in ids):
        raise _fail(path, "token_ids must be a list of at least 2 integers >= 0 (a prompt and a sampled token)")
    positions, prompt_tokens = doc["positions"], doc["prompt_tokens"]
    if positions != len(ids) - 1 or not _is_count(positions):
        raise _fail(path, f"holds {positions!r} positions for {len(ids)} token ids (every id but the last is fed)")
    if not _is_count(prompt_tokens) or not 1 <= prompt_tokens < len(ids):
        raise _fail(path, f"prompt_tokens {prompt_tokens!r} is not from 1 to {len(ids) - 1}")
    if not isinstance(doc["ignore_eos"], bool):
        raise _fail(path, "ignore_eos must be true or false")
    try:
        params = SamplingParams.from_dict(doc["sampling"])
        Sampler(params).restore(doc["sampler"])
    except (ValueError, TypeError, ColibriError) as exc:
        raise _fail(path, f"sampling: {exc}") from None


def _unique_keys(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice in one object")  # parse_json makes it one line naming the file
    return out


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_node(node, where: str, prefix: str, positions: int, declared: dict, path: str):
    """A layer's document entry checked (kind, meta, arrays: tensor names, float dtypes,
    shapes, offsets); the meta's length must be the state's positions."""
    if node is None:
        return None
    if not isinstance(node, dict) or not isinstance(node.get("kind"), str):
        raise _fail(path, f"{where}: entry must be null or an object with a kind")
    if node["kind"] == "parts":
        if set(node) != {"kind", "parts"} or not isinstance(node["parts"], dict) or not node["parts"]:
            raise _fail(path, f"{where}: a 'parts' entry holds exactly kind and a non-empty parts object")
        return {"kind": "parts", "parts": {name: _check_node(part, f"{where} part {name!r}", f"{prefix}.{name}", positions,
                                                              declared, path)
                                           for name, part in node["parts"].items()}}
    if set(node) != {"kind", "meta", "arrays"} or not isinstance(node["meta"], dict) or not isinstance(node["arrays"], dict):
        raise _fail(path, f"{where}: entry must hold exactly kind, meta and arrays")
    if node["meta"].get("length") != positions:
        raise _fail(path, f"{where} holds {node['meta'].get('length')!r} positions, not the state's {positions}")
    arrays = {}
    for name, spec in node["arrays"].items():
        tensor = f"{prefix}.{name}"
        ok = (isinstance(spec, dict) and set(spec) == {"tensor", "dtype", "shape", "offsets"} and spec["tensor"] == tensor
              and spec["dtype"] in _ST_FLOATS and isinstance(spec["shape"], list) and len(spec["shape"]) <= 8
              and all(_is_count(d) for d in spec["shape"]) and isinstance(spec["offsets"], list)
              and len(spec["offsets"]) == 2 and all(_is_count(o) for o in spec["offsets"]))
        if not ok:
            raise _fail(path, f"{where}: array {name!r} needs tensor {tensor!r}, a float dtype, a shape and two offsets")
        if tensor in declared:
            raise _fail(path, f"{where}: tensor {tensor!r} is declared twice")
        begin, end = spec["offsets"]
        if end - begin != math.prod(spec["shape"]) * DTYPES[spec["dtype"]][1]:
            raise _fail(path, f"{where}: array {name!r}: offsets {spec['offsets']} do not span {spec['dtype']} x "
                              f"{spec['shape']}")
        declared[tensor] = (spec["dtype"], tuple(spec["shape"]), (begin, end))
        arrays[name] = tensor
    return {"kind": node["kind"], "meta": node["meta"], "arrays": arrays}


def _fill(node, arrays: dict):
    if node is None:
        return None
    if node["kind"] == "parts":
        return {"kind": "parts", "parts": {name: _fill(part, arrays) for name, part in node["parts"].items()}}
    return {"kind": node["kind"], "meta": node["meta"], "arrays": {name: arrays[t] for name, t in node["arrays"].items()}}


# -- binding to a model --------------------------------------------------------------------
def check_model(state: SequenceState, model) -> None:
    """Refuse a state of another model, or one the model cannot continue (its context is
    full, an id outside the vocabulary)."""
    where = state.source or "the saved state"
    mine = model_identity(model)
    if state.model["sha256"] != mine["sha256"]:
        raise UsageError(f"{where}: saved state belongs to another model ({state.model['dir']}, model_type "
                         f"{state.model['model_type']}, identity {state.model['sha256'][:12]}), not {model.model_dir} "
                         f"(identity {mine['sha256'][:12]}: config.json and shard names and sizes)")
    lm = model.lm
    if state.positions >= lm.max_context:
        raise UsageError(f"{where}: saved state holds {state.positions} positions: the context of {lm.max_context} "
                         "has no room for its last token")
    bad = next((t for t in state.token_ids if t >= lm.vocab_size), None)
    if bad is not None:
        raise UsageError(f"{where}: saved state holds token id {bad}, outside the vocabulary (0..{lm.vocab_size - 1})")


def bind(state: SequenceState, model) -> Cache:
    """A fresh cache of ``model`` holding the saved state (identity, then every layer's
    kind and shapes checked against what this model's cache holds)."""
    check_model(state, model)
    return bind_layers(state.layers, state.positions, model, state.source or "the saved state")


def bind_layers(layers: list, positions: int, model, where: str) -> Cache:
    """A fresh cache of ``model`` holding ``layers`` (host arrays of ``positions``
    positions), every layer's kind and shapes checked; ``where`` names the source."""
    cache = model.lm.new_cache(model.backend)
    if len(layers) != len(cache.layers):
        raise ModelFormatError(f"{where}: saved state has {len(layers)} layers, this model {len(cache.layers)}")
    for i, (node, layer) in enumerate(zip(layers, cache.layers)):
        _import(node, layer, f"layer {i}", where)
    cache.length = positions
    return cache


def _import(node, layer, at: str, where: str) -> None:
    if (node is None) != (layer is None):
        raise ModelFormatError(f"{where}: saved state's {at} is {'empty' if node is None else 'not empty'}; this model's "
                               f"is {'empty' if layer is None else 'not'}")
    if node is None:
        return
    if isinstance(layer, LayerStates):
        if node["kind"] != "parts" or set(node["parts"]) != set(layer.parts):
            got = sorted(node["parts"]) if node["kind"] == "parts" else node["kind"]
            raise ModelFormatError(f"{where}: saved state's {at} holds {got}; this model's holds parts {sorted(layer.parts)}")
        for name, part in layer.parts.items():
            _import(node["parts"][name], part, f"{at} part {name!r}", where)
        return
    kind = getattr(layer, "state_kind", None)
    if kind is None:
        raise UsageError(f"{where}: this model's {at} state ({type(layer).__name__}) cannot be restored from a file")
    if node["kind"] != kind:
        raise ModelFormatError(f"{where}: saved state's {at} is a {node['kind']!r} state; this model's is {kind!r}")
    try:
        layer.import_state(node["meta"], node["arrays"])
    except ValueError as exc:
        raise ModelFormatError(f"{where}: saved state's {at} ({kind}) does not fit this model: {exc}") from None


def resumed_sampler(state: SequenceState, overrides: dict) -> tuple[SamplingParams, Sampler]:
    """The sampling parameters (the saved ones, ``overrides`` replacing some) and a sampler
    continuing the saved one: its penalty counts, and its random generator unless
    ``overrides`` gives another seed than the saved one."""
    params = SamplingParams.from_dict(state.sampling, **overrides)
    sampler = Sampler(params)
    try:
        sampler.restore(state.sampler, rng=params.seed == state.sampling["seed"])
    except ValueError as exc:
        raise ModelFormatError(f"{state.source or 'the saved state'}: saved state's sampler: {exc}") from None
    return params, sampler


def load_state(source) -> SequenceState:
    """A SequenceState as given, or read from a path."""
    if isinstance(source, SequenceState):
        return source
    if isinstance(source, (str, os.PathLike)):
        return read_state(source)
    raise UsageError(f"resume takes a saved state's path or a SequenceState, got {type(source).__name__}")


__all__ = ["FORMAT", "VERSION", "SequenceState", "bind", "bind_layers", "capture", "check_model", "check_saveable",
           "directory_identity", "export_layers", "file_digest", "layer_arrays", "load_state", "model_identity", "read_layers", "read_state",
           "resumed_sampler", "write_layers"]
