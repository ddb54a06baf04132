"""colibri's safetensors reader against the safetensors library, on fuzzed files.

A few hundred files (seeded) start as valid safetensors files and get one or two header
or data mutations each: offsets shifted, swapped, past the end, overlapping, leaving gaps;
dtypes changed (to ours, to dtypes only the library knows, to nonsense); shapes changed,
negative, non-integer, overflowing, of high rank; trailing or missing bytes; broken JSON
(cut, a character replaced, NaN, a lone surrogate, a byte-order mark, garbage after it);
header lengths from 0 to 2**64 - 1; duplicate keys; bad metadata; extra fields, deep
nesting. colibri's ``SafetensorsFile`` (the range reader every read goes through) and the
library (``safe_open``, the loader transformers uses, and ``deserialize``) must accept
and refuse the same files, and agree on every tensor's name, dtype, shape and bytes and
on the metadata.

Where they disagree, colibri is the stricter, by design, and only in these ways (each is
asserted to occur, in this direction only; docs/formats.md lists them too):

- DUPLICATE: a key named twice in the header (two tensors of one name, a metadata key
  twice). The library keeps one of them silently; colibri refuses to guess which.
- DTYPE: dtypes the library knows but no colibri weight format reads (F4, F6_E2M3,
  F6_E3M2, F8_E4M3FNUZ, F8_E5M2FNUZ, C64): refused at the header, naming the tensor,
  rather than failing later when a format is looked for.
- RANK: more than MAX_TENSOR_RANK (8) dimensions: no weight has them.
- DEPTH: JSON nested deeper than MAX_HEADER_DEPTH (64); the library allows 128. A real
  header nests 3 levels.

colibri never accepts a file the library refuses.
"""

from __future__ import annotations

import json
import random
import struct
from collections import Counter
from pathlib import Path

import pytest
import safetensors

from colibri_core.errors import ModelFormatError
from colibri_core.io.safetensors import DTYPES, MAX_HEADER_DEPTH, MAX_TENSOR_RANK, SafetensorsFile

SEED = 43
FILES = 500
# dtypes only the library knows, with their bits per element
LIBRARY_ONLY = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "C64": 64}
NAMES = ["w", "model.layers.0.mlp.experts.3.up_proj.weight", "b", "é", "a/b", "lm_head.weight", "x y", "q"]


class Doc:
    """A file being built: header (a dict, in order), data, then raw edits of the
    serialized header and an optional header length that lies."""

    def __init__(self, header: dict, data: bytes, ensure_ascii: bool, pad: bool):
        self.header, self.data = header, bytearray(data)
        self.ensure_ascii, self.pad = ensure_ascii, pad
        self.raw_edits: list = []
        self.header_len: int | None = None
        self.labels: list[str] = []

    def tensors(self) -> list[str]:
        """Names of the entries that are still well-formed tensors."""
        return [k for k, v in self.header.items() if k != "__metadata__" and isinstance(v, dict)
                and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
                and all(type(o) is int for o in v["data_offsets"])]

    def resize(self, name: str, nbytes: int, rng: random.Random) -> None:
        """Give tensor ``name`` ``nbytes`` of new data, moving the tensors after it: the
        data section stays tiled."""
        begin, end = self.header[name]["data_offsets"]
        self.data[begin:end] = rng.randbytes(nbytes)
        for other in self.tensors():
            b, e = self.header[other]["data_offsets"]
            if other != name and b >= end and (b > begin or e > b):
                self.header[other]["data_offsets"] = [b + nbytes - (end - begin), e + nbytes - (end - begin)]
        self.header[name]["data_offsets"] = [begin, begin + nbytes]

    def build(self) -> bytes:
        blob = json.dumps(self.header, ensure_ascii=self.ensure_ascii).encode("utf-8", "surrogatepass")
        for edit in self.raw_edits:
            blob = edit(blob)
        if self.pad:
            blob += b" " * (-len(blob) % 8)
        n = len(blob) if self.header_len is None else self.header_len
        return struct.pack("<Q", n) + blob + bytes(self.data)


def valid_doc(rng: random.Random) -> Doc:
    header: dict = {}
    data = bytearray()
    if rng.random() < 0.5:
        header["__metadata__"] = {"format": rng.choice(["pt", "np", "mlx"])}
        if rng.random() < 0.3:
            header["__metadata__"]["note"] = "é ☃"
    for name in rng.sample(NAMES, rng.randint(1, 5)):
        dtype = rng.choice(sorted(DTYPES))
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += rng.randbytes(nbytes)
    if rng.random() < 0.3:  # the library writes __metadata__ first; other writers need not
        items = list(header.items())
        rng.shuffle(items)
        header = dict(items)
    return Doc(header, bytes(data), ensure_ascii=rng.random() < 0.5, pad=rng.random() < 0.7)


# -- mutations: each edits a Doc in place ---------------------------------------------------
def pick(doc: Doc, rng: random.Random) -> str | None:
    names = doc.tensors()
    return rng.choice(names) if names else None


def offsets(doc, rng):
    name = pick(doc, rng)
    if name is None:
        return
    entry = doc.header[name]
    begin, end = entry["data_offsets"]
    choice = rng.randrange(8)
    if choice == 0:
        entry["data_offsets"] = [begin + rng.choice([-3, -1, 1, 2, 8]), end]
    elif choice == 1:
        entry["data_offsets"] = [begin, end + rng.choice([-3, -1, 1, 2, 8])]
    elif choice == 2:
        entry["data_offsets"] = [end, begin]
    elif choice == 3:
        entry["data_offsets"] = [len(doc.data), len(doc.data) + end - begin]
    elif choice == 4:
        entry["data_offsets"] = rng.choice([[begin], [begin, end, end], [], None, f"{begin},{end}", [float(begin), end],
                                            [True, end], [-1, end]])
    elif choice == 5:  # the same numbers written differently
        doc.raw_edits.append(lambda blob: blob.replace(b'"data_offsets": [0,', b'"data_offsets": [-0,', 1))
    elif choice == 6:
        doc.raw_edits.append(lambda blob: blob.replace(b'"data_offsets": [0,', b'"data_offsets": [0e0,', 1))
    else:
        entry["data_offsets"] = [begin, end + 2**64]


def dtypes(doc, rng):
    name = pick(doc, rng)
    if name is None:
        return
    entry = doc.header[name]
    nbytes = entry["data_offsets"][1] - entry["data_offsets"][0] if isinstance(entry["data_offsets"], list) else 0
    choice = rng.randrange(3)
    if choice == 0:  # another of ours, its bytes resized to fit or not
        entry["dtype"] = rng.choice(sorted(DTYPES))
        shape = entry["shape"]
        if isinstance(shape, list) and all(type(d) is int and 0 <= d < 64 for d in shape) and rng.random() < 0.5:
            numel = 1
            for d in shape:
                numel *= d
            doc.resize(name, numel * DTYPES[entry["dtype"]][1], rng)
    elif choice == 1:  # one only the library reads, shaped to fit the bytes when it can
        dtype = rng.choice(sorted(LIBRARY_ONLY))
        entry["dtype"] = dtype
        if (8 * nbytes) % LIBRARY_ONLY[dtype] == 0 and rng.random() < 0.8:
            entry["shape"] = [8 * nbytes // LIBRARY_ONLY[dtype]]
    else:
        entry["dtype"] = rng.choice(["bf16", "F128", "", 5, None, ["F32"], "U8 "])


def shapes(doc, rng):
    name = pick(doc, rng)
    if name is None:
        return
    entry = doc.header[name]
    shape = list(entry["shape"]) if isinstance(entry["shape"], list) else []
    choice = rng.randrange(9)
    if choice == 0 and shape:
        shape[rng.randrange(len(shape))] += rng.choice([-1, 1, 2])
    elif choice == 1:
        shape = shape + [1]  # same bytes: both accept
    elif choice in (2, 8):  # a rank about ours and above it, same bytes
        shape = [1] * max(rng.choice([MAX_TENSOR_RANK, MAX_TENSOR_RANK + 1, 18]) - len(shape), 0) + shape
    elif choice == 3:
        shape = rng.choice([[-4], [4.0], ["4"], [True], [None], 4, None, {"0": 4}])
    elif choice == 4:  # no element, but a product past 64 bits on the way (or not)
        shape = rng.choice([[2**40, 2**40, 0], [0, 2**40, 2**40], [2**64, 0], [0, 2**64]])
        doc.resize(name, 0, rng)
    elif choice == 5:
        shape = [2**33, 2**33]
    elif choice == 6:
        shape = list(reversed(shape))  # same bytes: both accept
    else:
        shape = []
    entry["shape"] = shape


def overlaps(doc, rng):
    names = doc.tensors()
    if len(names) < 2:
        return
    a, b = rng.sample(names, 2)
    if rng.random() < 0.5:
        doc.header[b]["data_offsets"] = list(doc.header[a]["data_offsets"])
    else:
        begin, end = doc.header[b]["data_offsets"]
        doc.header[b]["data_offsets"] = [max(begin - 1, 0), end - 1] if begin else [begin + 1, end + 1]


def gaps(doc, rng):
    at = rng.randint(0, len(doc.data))
    k = rng.choice([1, 3, 8])
    doc.data[at:at] = bytes(k)
    for name in doc.tensors():
        begin, end = doc.header[name]["data_offsets"]
        if begin >= at and (begin > at or end > begin or rng.random() < 0.5):
            doc.header[name]["data_offsets"] = [begin + k, end + k]
        elif end > at:  # the bytes went inside this tensor: it now spans them
            doc.header[name]["data_offsets"] = [begin, end + k]


def trailing(doc, rng):
    doc.data += rng.randbytes(rng.choice([1, 7, 64]))


def truncated(doc, rng):
    cut = rng.choice([1, 2, len(doc.data)])
    del doc.data[max(len(doc.data) - cut, 0):]


def empty_tensor(doc, rng):
    """A zero-byte tensor at a random offset: between tensors or at the end both accept it,
    inside another's bytes neither does."""
    at = rng.randint(0, len(doc.data))
    doc.header[rng.choice(["z0", "z1"])] = {"dtype": rng.choice(sorted(DTYPES)), "shape": [0, 3], "data_offsets": [at, at]}


def bad_json(doc, rng):
    choice = rng.randrange(12)
    if choice == 0:
        where = rng.random()
        doc.raw_edits.append(lambda blob: blob[: max(1, int(len(blob) * where))])
    elif choice == 1:
        where = rng.random()
        char = rng.choice([b"{", b"}", b"[", b",", b":", b'"', b"\\", b"x", b"0", b"\x01", b"\xff"])

        def replace(blob):
            at = int(len(blob) * where)
            return blob[:at] + char + blob[at + 1:]
        doc.raw_edits.append(replace)
    elif choice == 2:
        name = pick(doc, rng)
        if name is not None:
            doc.header[name]["extra"] = float(rng.choice(["nan", "inf", "-inf"]))  # json.dumps writes NaN, Infinity
    elif choice == 3:
        name = pick(doc, rng)
        if name is not None:
            doc.header[name + "\ud800"] = doc.header.pop(name)  # a lone surrogate, escaped by json.dumps
            doc.ensure_ascii = True
    elif choice == 4:
        name = pick(doc, rng)
        if name is not None:
            doc.header[name + "\U0001F600"] = doc.header.pop(name)  # a surrogate pair: valid
    elif choice == 5:
        doc.raw_edits.append(lambda blob: b"\xef\xbb\xbf" + blob)
    elif choice == 6:
        garbage = rng.choice([b"x", b"}", b"\x00", b" {}"])
        doc.raw_edits.append(lambda blob: blob + garbage)
    elif choice == 7:
        space = rng.choice([b" ", b"\n\t"])
        doc.raw_edits.append(lambda blob: space + blob + b"\r\n")  # whitespace: valid
    elif choice == 8:
        doc.raw_edits.append(lambda blob: blob.replace(b'"', b'"\x1f', 1))
    elif choice == 9:
        name = pick(doc, rng)
        if name is not None:
            doc.raw_edits.append(lambda blob: blob.replace(b'"dtype"', b'"extra": 1e400, "dtype"', 1))
    elif choice == 10:
        name = pick(doc, rng)
        if name is not None:
            doc.header[name]["extra"] = 2**70  # a big integer in an ignored field: valid
    else:
        doc.raw_edits.append(lambda blob: blob.replace(b": ", b":", 3))  # valid


def header_length(doc, rng):
    blob_len = len(doc.build()) - 8 - len(doc.data)
    doc.header_len = rng.choice([0, 1, blob_len - 1, blob_len + 1, blob_len + len(doc.data) + 1, 2**64 - 1,
                                 100_000_001, 100_000_000, 2**63])


def duplicates(doc, rng):
    name = pick(doc, rng)
    choice = rng.randrange(5)
    if name is not None and choice == 0:  # the same tensor twice, the same entry
        entry = json.dumps({name: doc.header[name]}, ensure_ascii=True)[1:-1].encode()
        doc.ensure_ascii = True
        doc.raw_edits.append(lambda blob: blob[:1] + entry + b", " + blob[1:])
    elif name is not None and choice == 1:  # twice, differing
        other = dict(doc.header[name], dtype="U8", shape=[0], data_offsets=[0, 0])
        entry = json.dumps({name: other}, ensure_ascii=True)[1:-1].encode()
        doc.ensure_ascii = True
        doc.raw_edits.append(lambda blob: blob[:1] + entry + b", " + blob[1:])
    elif name is not None and choice == 2:  # a field twice in one entry
        doc.raw_edits.append(lambda blob: blob.replace(b'"dtype": ', b'"dtype": "U8", "dtype": ', 1))
    elif choice == 3:  # a metadata key twice
        doc.header["__metadata__"] = {"format": "pt"}
        doc.raw_edits.append(lambda blob: blob.replace(b'"format": "pt"', b'"format": "pt", "format": "np"', 1))
    else:  # __metadata__ twice
        doc.header["__metadata__"] = {"format": "pt"}
        doc.raw_edits.append(lambda blob: blob[:1] + b'"__metadata__": {}, ' + blob[1:])


def metadata(doc, rng):
    doc.header["__metadata__"] = rng.choice([{"k": 1}, {"k": None}, {"k": ["v"]}, {"k": {"a": "b"}}, None, [], "k=v", {},
                                             {"ключ": "значение"}, 0])


def extra_fields(doc, rng):
    name = pick(doc, rng)
    if name is None:
        return
    depth = rng.choice([1, 3, MAX_HEADER_DEPTH + 10, 200])
    doc.header[name]["extra"] = json.loads("[" * depth + "]" * depth)


def not_objects(doc, rng):
    choice = rng.randrange(3)
    if choice == 0:
        text = json.dumps(rng.choice([[], "header", 3, None, [doc.header]])).encode()
        doc.raw_edits.append(lambda blob: text)
    elif (name := pick(doc, rng)) is not None and choice == 1:
        doc.header[name] = rng.choice([5, None, [], "U8"])
    elif (name := pick(doc, rng)) is not None:
        del doc.header[name][rng.choice(["dtype", "shape", "data_offsets"])]


MUTATIONS = [offsets, dtypes, shapes, overlaps, gaps, trailing, truncated, empty_tensor, bad_json, header_length,
             duplicates, metadata, extra_fields, not_objects]


def fuzzed_files(seed: int, count: int):
    rng = random.Random(seed)
    for i in range(count):
        doc = valid_doc(rng)
        for mutation in rng.sample(MUTATIONS, rng.choice([0, 1, 1, 1, 2])):
            mutation(doc, rng)
            doc.labels.append(mutation.__name__)
        raw = doc.build()
        if rng.random() < 0.01:
            raw = raw[: rng.randrange(8)]
            doc.labels.append("shorter than 8 bytes")
        yield i, doc.labels, raw


# -- the two readers ---------------------------------------------------------------------
def library_read(path: Path, raw: bytes):
    """(metadata, {name: (dtype, shape, bytes)}) through the library, or None if it refuses.
    ``safe_open`` (the loader) and ``deserialize`` must agree with each other too."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            meta, keys = f.metadata(), sorted(f.keys())
    except Exception:
        opened = None
    else:
        opened = (meta or {}, keys)
    try:
        tensors = {name: (t["dtype"], tuple(t["shape"]), bytes(t["data"])) for name, t in safetensors.deserialize(raw)}
    except Exception:
        assert opened is None, f"safe_open accepts {path.name}, deserialize refuses it"
        return None
    assert opened is not None and opened[1] == sorted(tensors), f"deserialize accepts {path.name}, safe_open does not"
    return opened[0], tensors


def colibri_read(path: Path):
    """(metadata, {name: (dtype, shape, bytes)}) through colibri's reader, or the error."""
    try:
        sf = SafetensorsFile(path)
    except ModelFormatError as exc:
        return exc
    try:
        out = {}
        for name, info in sf.tensors.items():
            buf = bytearray(info.nbytes)
            if info.nbytes:
                sf.read_into(info.offset, memoryview(buf))
            out[name] = (info.dtype, info.shape, bytes(buf))
        return sf.metadata, out
    finally:
        sf.close()


def has_duplicate_key(raw: bytes) -> bool:
    found = []

    def hook(pairs):
        keys = [k for k, _ in pairs]
        found.extend(k for k in set(keys) if keys.count(k) > 1)
        return dict(pairs)

    n = struct.unpack("<Q", raw[:8])[0]
    json.loads(raw[8 : 8 + n].decode("utf-8"), object_pairs_hook=hook)
    return bool(found)


def stricter_by_design(message: str, raw: bytes, library_tensors: dict) -> str | None:
    """Which documented reason explains colibri refusing a file the library reads; None
    if none does."""
    if "appears twice" in message and has_duplicate_key(raw):
        return "DUPLICATE"
    if "unknown dtype" in message and any(dtype in LIBRARY_ONLY for dtype, _, _ in library_tensors.values()):
        return "DTYPE"
    if "bad shape" in message and any(len(shape) > MAX_TENSOR_RANK for _, shape, _ in library_tensors.values()):
        return "RANK"
    if "nests deeper" in message:
        return "DEPTH"
    return None


def test_colibri_and_the_safetensors_library_agree_on_fuzzed_files(tmp_path):
    outcomes: Counter = Counter()
    for i, labels, raw in fuzzed_files(SEED, FILES):
        path = tmp_path / f"f{i:04d}.safetensors"
        path.write_bytes(raw)
        library, ours = library_read(path, raw), colibri_read(path)
        what = f"file {i} ({', '.join(labels) or 'unmutated'})"
        if isinstance(ours, ModelFormatError):
            assert str(path) in str(ours), f"{what}: the error does not name the file: {ours}"
        if library is None and isinstance(ours, ModelFormatError):
            outcomes["both refuse"] += 1
        elif library is None:
            pytest.fail(f"{what}: colibri accepts a file the safetensors library refuses")
        elif isinstance(ours, ModelFormatError):
            reason = stricter_by_design(str(ours), raw, library[1])
            assert reason is not None, f"{what}: colibri refuses a file the library reads, for no documented reason: {ours}"
            outcomes[reason] += 1
        else:
            assert ours[0] == library[0], f"{what}: metadata differs"
            assert ours[1] == library[1], f"{what}: tensors differ"
            outcomes["both read"] += 1
    # the corpus exercises every side: agreement both ways, and each documented disagreement
    assert outcomes["both read"] >= FILES // 5 and outcomes["both refuse"] >= FILES // 5, outcomes
    assert all(outcomes[reason] for reason in ("DUPLICATE", "DTYPE", "RANK", "DEPTH")), outcomes
