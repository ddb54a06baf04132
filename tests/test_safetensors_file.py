"""Our safetensors reader and writer, and the multi-shard Checkpoint built on them.

Round trips (our writer -> our reader, the safetensors library <-> ours), merged range
reads, atomic writes, and every header validation error: each must be a
ModelFormatError naming the file and, where one is involved, the tensor.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from colibri_core.io import safetensors as safetensors_file
from colibri_core.io.checkpoint import INDEX_NAME, MERGE_GAP_BYTES, Checkpoint
from colibri_core.errors import ModelFormatError
from colibri_core.io.safetensors import DTYPES, MAX_HEADER_BYTES, SafetensorsFile, write_safetensors


# -- helpers ---------------------------------------------------------------------------
def write_raw(path: Path, header, data: bytes = b"", *, header_len: int | None = None) -> Path:
    """A safetensors file with exactly this header (a dict, or raw bytes) and data section."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def good_header() -> tuple[dict, bytes]:
    """Two valid tensors: 'a' F32 [2, 3] at [0, 24) and 'b' U8 [4] at [24, 28)."""
    return {"a": entry("F32", [2, 3], 0, 24), "b": entry("U8", [4], 24, 28)}, bytes(range(28))


def expect_format_error(path: Path, tensor: str | None = None, *fragments: str) -> ModelFormatError:
    with pytest.raises(ModelFormatError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert str(path) in message, message
    if tensor is not None:
        assert repr(tensor) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


def read_all(path) -> dict[str, tuple[str, tuple, bytes]]:
    """name -> (safetensors dtype, shape, raw bytes), through our reader."""
    sf = SafetensorsFile(path)
    try:
        out = {}
        for name, info in sf.tensors.items():
            buf = np.empty(info.nbytes, dtype=np.uint8)
            sf.read_into(info.offset, memoryview(buf))
            arr = safetensors_file.as_array(info, buf)
            assert arr.shape == info.shape
            out[name] = (info.dtype, info.shape, arr.tobytes())
        return out
    finally:
        sf.close()


def raw_le(array: np.ndarray, st_dtype: str) -> bytes:
    """The little-endian bytes a tensor of this safetensors dtype must hold."""
    return np.ascontiguousarray(array, dtype=np.dtype(DTYPES[st_dtype][0])).tobytes()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


# numpy dtypes the writer maps by itself, with the safetensors name it must choose
NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
    "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
# dtypes given explicitly as (safetensors dtype, storage array)
STORAGE_DTYPES = {"BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8}

shapes = array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz._0123456789", min_size=1, max_size=12).filter(lambda s: s != "__metadata__")


@st.composite
def tensor_values(draw):
    """(expected safetensors dtype, value to pass to the writer, storage array)."""
    if draw(st.booleans()):
        st_dtype = draw(st.sampled_from(sorted(NUMPY_DTYPES)))
        array = draw(arrays(NUMPY_DTYPES[st_dtype], shapes))
        if draw(st.booleans()) and array.dtype.itemsize > 1:
            array = array.astype(array.dtype.newbyteorder(">"))  # big-endian input must be swapped
        if draw(st.booleans()) and array.ndim >= 2:
            array = array.T  # non-contiguous input
        return st_dtype, array, array
    st_dtype = draw(st.sampled_from(sorted(STORAGE_DTYPES)))
    array = draw(arrays(STORAGE_DTYPES[st_dtype], shapes))
    return st_dtype, (st_dtype, array), array


# -- round trips -----------------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names, tensor_values(), min_size=1, max_size=4),
       st.dictionaries(names, st.text(max_size=8), max_size=2))
def test_writer_round_trips_through_our_reader(tensors, metadata):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.safetensors"
        size = write_safetensors(path, {n: v for n, (_, v, _) in tensors.items()}, metadata=metadata)
        assert size == path.stat().st_size
        assert leftovers(Path(d)) == []
        got = read_all(path)
        assert SafetensorsFile(path).metadata == metadata
        assert set(got) == set(tensors)
        for name, (st_dtype, _, array) in tensors.items():
            dtype, shape, raw = got[name]
            assert dtype == st_dtype
            assert shape == array.shape
            assert raw == raw_le(array, st_dtype), name
        # and the same bytes through Checkpoint.read_many, in the storage dtype
        with Checkpoint(d) as ckpt:
            arrays_ = ckpt.read_many(list(ckpt.tensors.values()))
            for name, (st_dtype, _, array) in tensors.items():
                assert arrays_[name].dtype == np.dtype(DTYPES[st_dtype][0])
                assert arrays_[name].shape == array.shape
                assert arrays_[name].tobytes() == raw_le(array, st_dtype)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names, tensor_values(), min_size=1, max_size=4),
       st.dictionaries(names, st.text(max_size=8), max_size=2))
def test_save_file_writes_through_the_safetensors_library(tensors, metadata):
    """``save_file`` (the demo's shards): the library's serializer, our dtypes (BF16 and
    fp8 given as storage arrays, big-endian or strided input), atomically."""
    import safetensors

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.safetensors"
        size = safetensors_file.save_file(path, {n: v for n, (_, v, _) in tensors.items()}, metadata=metadata)
        assert size == path.stat().st_size and leftovers(Path(d)) == []
        got = read_all(path)
        assert SafetensorsFile(path).metadata == metadata
        library = dict(safetensors.deserialize(path.read_bytes()))
        assert set(got) == set(library) == set(tensors)
        for name, (st_dtype, _, array) in tensors.items():
            assert got[name] == (st_dtype, array.shape, raw_le(array, st_dtype)), name
            assert (library[name]["dtype"], tuple(library[name]["shape"]), bytes(library[name]["data"])) == got[name]


def test_save_file_leaves_nothing_behind_when_it_fails(tmp_path):
    with pytest.raises(ValueError, match="metadata"):
        safetensors_file.save_file(tmp_path / "m.safetensors", {"a": np.zeros(2, np.float32)}, metadata={"k": 1})
    with pytest.raises(ValueError, match="'b'"):
        safetensors_file.save_file(tmp_path / "d.safetensors", {"b": np.zeros(2, np.complex64)})
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names, st.sampled_from(sorted(NUMPY_DTYPES)).flatmap(
    lambda d: arrays(NUMPY_DTYPES[d], shapes)), min_size=1, max_size=4))
def test_files_of_the_safetensors_library_read_identically(tensors):
    from safetensors.numpy import save_file

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lib.safetensors"
        save_file(tensors, str(path), metadata={"format": "np"})
        got = read_all(path)
        assert SafetensorsFile(path).metadata == {"format": "np"}
        assert set(got) == set(tensors)
        for name, array in tensors.items():
            dtype, shape, raw = got[name]
            assert dtype == {v: k for k, v in NUMPY_DTYPES.items()}[array.dtype.type]
            assert shape == array.shape
            assert raw == np.ascontiguousarray(array).tobytes()


def test_bf16_and_fp8_of_the_safetensors_library_read_identically(tmp_path):
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, generator=g).to(torch.float16),
        "e4m3": torch.randn(2, 3, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(7, generator=g).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    }
    path = tmp_path / "pt.safetensors"
    save_file(tensors, str(path))
    got = read_all(path)
    expected_dtype = {"bf16": "BF16", "f16": "F16", "e4m3": "F8_E4M3", "e5m2": "F8_E5M2", "scalar": "F32", "empty": "BF16"}
    for name, t in tensors.items():
        dtype, shape, raw = got[name]
        assert dtype == expected_dtype[name]
        assert shape == tuple(t.shape)
        assert raw == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_our_files_read_identically_by_the_safetensors_library(tmp_path):
    import torch
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, size=(3, 4), dtype=np.uint16)
    values = {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "h": rng.standard_normal(5).astype(">f2"),
        "i": rng.integers(-100, 100, size=(2, 2, 2), dtype=np.int8),
        "scalar": np.array(7, dtype=np.int64),
        "bf": ("BF16", bits),
    }
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, values, metadata={"format": "pt"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(values)
        for name in ("w", "h", "i", "scalar"):
            t = f.get_tensor(name)
            assert tuple(t.shape) == values[name].shape
            np.testing.assert_array_equal(t.numpy(), values[name])
        bf = f.get_tensor("bf")
        assert bf.dtype == torch.bfloat16
        assert bf.view(torch.int16).numpy().view(np.uint16).tolist() == bits.tolist()


def test_writer_keeps_zero_dim_and_empty_shapes(tmp_path):
    path = tmp_path / "s.safetensors"
    write_safetensors(path, [("scalar", np.float32(1.5)), ("empty", np.zeros((0, 4), np.float16)),
                             ("bf_scalar", ("BF16", np.array(0x3FC0, dtype=np.uint16)))])
    sf = SafetensorsFile(path)
    assert sf.tensors["scalar"].shape == ()
    assert sf.tensors["empty"].shape == (0, 4)
    assert sf.tensors["bf_scalar"].shape == ()
    with Checkpoint(tmp_path) as ckpt:
        assert ckpt.read("scalar").shape == () and float(ckpt.read("scalar")) == 1.5
        assert ckpt.read("empty").shape == (0, 4)
        assert int(ckpt.read("bf_scalar")) == 0x3FC0


def test_writer_refuses_what_it_cannot_write_faithfully(tmp_path):
    path = tmp_path / "x.safetensors"
    for bad in (
        [("a", np.zeros(2, np.float32)), ("a", np.ones(2, np.float32))],  # duplicate name would drop one
        [("__metadata__", np.zeros(1, np.float32))],
        [("c", np.zeros(2, np.complex64))],
        [("bf", ("BF16", np.zeros(2, np.float32)))],  # wrong storage width
        [("q", ("Q4", np.zeros(2, np.uint8)))],  # unknown safetensors dtype
    ):
        with pytest.raises(ValueError):
            write_safetensors(path, bad)
        assert not path.exists()
    with pytest.raises(ValueError):
        write_safetensors(path, {"a": np.zeros(1, np.float32)}, metadata={"k": 1})
    assert not path.exists()
    assert leftovers(tmp_path) == []


# -- atomic writes ---------------------------------------------------------------------
def test_writer_leaves_no_partial_file_on_a_bad_value(tmp_path):
    path = tmp_path / "w.safetensors"
    good = {"a": np.arange(6, dtype=np.float32)}
    write_safetensors(path, good)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="'bad'"):
        write_safetensors(path, {"a": np.zeros(3, np.float32), "bad": np.array(["x"], dtype=object), "c": np.ones(2)})
    assert path.read_bytes() == before  # the old file is untouched
    assert leftovers(tmp_path) == []
    fresh = tmp_path / "fresh.safetensors"
    with pytest.raises(ValueError):
        write_safetensors(fresh, {"a": np.zeros(3, np.float32), "bad": np.array([1j])})
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


@pytest.mark.parametrize("fail_in", ["fsync", "replace", "data"])
def test_writer_removes_its_temporary_file_when_writing_fails_midway(tmp_path, monkeypatch, fail_in):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"old": np.arange(4, dtype=np.int32)})
    before = path.read_bytes()
    seen_tmp = []

    def boom(*args, **kwargs):
        seen_tmp.extend(leftovers(tmp_path))  # the temporary file exists when the failure hits
        raise OSError(28, "No space left on device")

    tensors = {"first": np.arange(10, dtype=np.float32), "second": np.arange(1000, dtype=np.float32)}
    if fail_in == "data":
        # the disk fills up after the header and the first tensor are written
        class Filling:
            def __init__(self, f):
                self.f, self.writes = f, 0

            def write(self, data):
                self.writes += 1
                if self.writes > 3:  # length, header, first tensor
                    boom()
                return self.f.write(data)

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        monkeypatch.setattr(safetensors_file, "open", lambda *a, **k: Filling(open(*a, **k)), raising=False)
    else:
        monkeypatch.setattr(safetensors_file.os, fail_in, boom)
    with pytest.raises(OSError, match="No space"):
        write_safetensors(path, tensors)
    assert seen_tmp, "the failure was injected before the temporary file existed"
    assert leftovers(tmp_path) == []
    assert path.read_bytes() == before
    monkeypatch.undo()
    assert read_all(path)["old"][2] == np.arange(4, dtype=np.int32).tobytes()


# -- validation errors -----------------------------------------------------------------
def test_a_valid_header_is_accepted(tmp_path):
    header, data = good_header()
    header["__metadata__"] = {"format": "pt"}
    header["z"] = entry("BF16", [0, 5], 28, 28)  # empty tensors may sit at the end
    header["e"] = entry("F32", [0], 24, 24)  # or between two tensors
    path = write_raw(tmp_path / "ok.safetensors", header, data)
    sf = SafetensorsFile(path)
    assert sf.metadata == {"format": "pt"}
    assert sf.tensors["a"].offset == 8 + len(json.dumps(header).encode())
    assert sf.tensors["b"].shape == (4,)
    assert sf.tensors["z"].nbytes == 0


def test_the_tensors_must_tile_the_data_section(tmp_path):
    """As the safetensors library requires: from the first byte to the last, each tensor
    beginning where the one before ends; no gap, no trailing bytes, no empty tensor
    inside another's bytes."""
    header, data = good_header()
    expect_format_error(write_raw(tmp_path / "trailing.safetensors", header, data + b"x"), None, "last 1 bytes",
                        "belong to no tensor")
    gap = {"a": entry("F32", [2, 3], 0, 24), "b": entry("U8", [4], 25, 29)}
    expect_format_error(write_raw(tmp_path / "gap.safetensors", gap, bytes(29)), "b", "[24, 25)", "belong to no tensor")
    late = {"a": entry("F32", [2, 3], 4, 28)}
    expect_format_error(write_raw(tmp_path / "late.safetensors", late, bytes(28)), "a", "[0, 4)")
    header["e"] = entry("F32", [0], 4, 4)
    expect_format_error(write_raw(tmp_path / "inside.safetensors", header, data), "a", "overlap tensor 'e'")
    empty = write_raw(tmp_path / "empty.safetensors", {"__metadata__": {"k": "v"}}, b"")
    assert SafetensorsFile(empty).tensors == {}


def test_a_shape_overflowing_64_bits_is_refused_even_when_it_holds_no_element(tmp_path):
    # the safetensors library multiplies the dimensions in order and refuses an overflow
    expect_format_error(write_raw(tmp_path / "o.safetensors", {"a": entry("U8", [2**40, 2**40, 0], 0, 0)}), "a",
                        "overflows 64 bits")
    assert SafetensorsFile(write_raw(tmp_path / "z.safetensors", {"a": entry("U8", [0, 2**40, 2**40], 0, 0)})).tensors


def test_file_shorter_than_8_bytes(tmp_path):
    for size in (0, 1, 7):
        path = tmp_path / f"short{size}.safetensors"
        path.write_bytes(b"\x01" * size)
        expect_format_error(path, None, "too short")


def test_header_length_past_end_of_file(tmp_path):
    header, data = good_header()
    blob = json.dumps(header).encode()
    path = write_raw(tmp_path / "h.safetensors", blob, data, header_len=len(blob) + len(data) + 1)
    expect_format_error(path, None, "past the end")
    path = write_raw(tmp_path / "h2.safetensors", b"", b"", header_len=2**64 - 1)
    expect_format_error(path, None, "past the end")


def test_header_larger_than_the_limit(tmp_path):
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(8 + MAX_HEADER_BYTES + 1)  # sparse: costs no disk
    expect_format_error(path, None, "limit")


@pytest.mark.parametrize("blob", [b"{not json", b"\xff\xfe{}", b'{"a": ', b""], ids=["syntax", "utf8", "cut", "empty"])
def test_header_not_json(tmp_path, blob):
    path = write_raw(tmp_path / "j.safetensors", blob)
    expect_format_error(path, None, "not valid JSON")


@pytest.mark.parametrize("header", [[], [1, 2], "str", 3, None], ids=["list", "list2", "str", "int", "null"])
def test_header_not_an_object(tmp_path, header):
    path = write_raw(tmp_path / "o.safetensors", header)
    expect_format_error(path, None, "not a JSON object")


def test_entry_not_an_object(tmp_path):
    path = write_raw(tmp_path / "e.safetensors", {"w": [0, 4]})
    expect_format_error(path, "w", "not an object")


@pytest.mark.parametrize("dtype", ["F128", "bf16", "", None, 4, ["F32"]])
def test_unknown_dtype(tmp_path, dtype):
    header, data = good_header()
    header["b"]["dtype"] = dtype
    path = write_raw(tmp_path / "d.safetensors", header, data)
    expect_format_error(path, "b", "unknown dtype")


@pytest.mark.parametrize("shape", [[-4], [2, -3], [4.0], ["4"], [True, 4], [None], 4, None, {"0": 4}, [1] * 9],
                         ids=["neg", "neg2", "float", "str", "bool", "null", "scalar", "missing", "dict", "rank9"])
def test_bad_shape(tmp_path, shape):
    header, data = good_header()
    header["b"]["shape"] = shape
    path = write_raw(tmp_path / "s.safetensors", header, data)
    expect_format_error(path, "b", "bad shape")


@pytest.mark.parametrize("offsets", [[24], [24, 28, 28], [], "24,28", None, [24.0, 28], [24, True], [False, 28]],
                         ids=["one", "three", "empty", "str", "missing", "float", "bool", "bool0"])
def test_bad_data_offsets(tmp_path, offsets):
    header, data = good_header()
    header["b"]["data_offsets"] = offsets
    path = write_raw(tmp_path / "o.safetensors", header, data)
    expect_format_error(path, "b", "bad data_offsets")


@pytest.mark.parametrize("offsets", [[28, 24], [-4, 0], [-1, 3]], ids=["decreasing", "negative", "negative_span"])
def test_data_offsets_not_increasing(tmp_path, offsets):
    header, data = good_header()
    header["b"]["data_offsets"] = offsets
    path = write_raw(tmp_path / "o.safetensors", header, data)
    expect_format_error(path, "b", "not an increasing pair")


def test_offsets_past_the_data_section(tmp_path):
    header, data = good_header()
    # the file is cut inside tensor 'b': 'a' is whole, 'b' runs past the end
    path = write_raw(tmp_path / "t.safetensors", header, data[:26])
    expect_format_error(path, "b", "26-byte data section", "truncated")
    header["b"]["data_offsets"] = [10**18, 10**18 + 4]
    path = write_raw(tmp_path / "t2.safetensors", header, data)
    expect_format_error(path, "b", "data section")


@pytest.mark.parametrize("dtype,shape,span", [("F32", [2, 3], 20), ("F32", [2, 4], 24), ("F16", [2, 3], 24),
                                              ("F32", [10**6, 10**6], 24), ("BF16", [0], 24)])
def test_dtype_times_shape_differs_from_span(tmp_path, dtype, shape, span):
    data = bytes(28)
    header = {"a": entry(dtype, shape, 0, span), "b": entry("U8", [4], 24, 28)}
    path = write_raw(tmp_path / "m.safetensors", header, data)
    expect_format_error(path, "a", "bytes but data_offsets span")


@pytest.mark.parametrize("second", [[20, 44], [0, 24], [4, 28], [23, 47]], ids=["tail", "same", "inside", "one_byte"])
def test_overlapping_tensors(tmp_path, second):
    header = {"a": entry("F32", [6], 4, 28), "c": entry("F32", [6], *second)}
    path = write_raw(tmp_path / "ov.safetensors", header, bytes(48))
    err = expect_format_error(path, None, "overlap")
    assert "'a'" in str(err) and "'c'" in str(err)


def test_overlap_found_between_non_neighbours(tmp_path):
    # 'big' covers 'x' and 'y', which do not overlap each other
    header = {"big": entry("U8", [40], 0, 40), "x": entry("U8", [4], 10, 14), "y": entry("U8", [4], 30, 34)}
    path = write_raw(tmp_path / "ov.safetensors", header, bytes(40))
    expect_format_error(path, "big", "overlap")


@pytest.mark.parametrize("metadata", [{"k": 1}, {"k": None}, {"k": ["v"]}, [["k", "v"]], "k=v", [], 0, False, ""],
                         ids=["int", "null", "list_value", "pairs", "str", "empty_list", "zero", "false", "empty_str"])
def test_metadata_not_str_to_str(tmp_path, metadata):
    header, data = good_header()
    header["__metadata__"] = metadata
    path = write_raw(tmp_path / "md.safetensors", header, data)
    expect_format_error(path, None, "__metadata__")


def test_not_a_regular_file(tmp_path):
    d = tmp_path / "dir.safetensors"
    d.mkdir()
    expect_format_error(d, None, "not a regular file")
    expect_format_error(tmp_path / "absent.safetensors", None, "not found")


# -- Checkpoint ------------------------------------------------------------------------
def test_read_many_merges_nearby_tensors_into_one_read(tmp_path):
    rng = np.random.default_rng(1)
    values = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "odd": rng.integers(0, 255, size=7, dtype=np.uint8),  # leaves the next tensor unaligned
        "b": rng.standard_normal(9).astype(np.float32),
        "skip": rng.integers(0, 1 << 16, size=100, dtype=np.uint16),
        "c": rng.integers(-50, 50, size=(2, 2), dtype=np.int64),
        "gap": np.zeros(MERGE_GAP_BYTES // 4 + 16, dtype=np.float32),  # more than the merge gap
        "far": rng.standard_normal(4).astype(np.float16),
    }
    bf = rng.integers(0, 1 << 16, size=(2, 3), dtype=np.uint16)
    write_safetensors(tmp_path / "one.safetensors", {**values, "bf": ("BF16", bf)})
    other = rng.standard_normal(6).astype(np.float32)
    write_safetensors(tmp_path / "two.safetensors", {"other": other})

    with Checkpoint(tmp_path) as ckpt:
        assert ckpt.tensors["b"].offset % 4  # really unaligned
        got = ckpt.read_many([ckpt.info(n) for n in ("c", "a", "b")])
        assert ckpt.reads == 1
        span = ckpt.info("c").offset + ckpt.info("c").nbytes - ckpt.info("a").offset
        assert ckpt.bytes_read == span
        for name in ("a", "b", "c"):
            assert got[name].dtype == values[name].dtype
            np.testing.assert_array_equal(got[name], values[name])

        ckpt.reads = ckpt.bytes_read = 0
        got = ckpt.read_many([ckpt.info(n) for n in ("a", "far", "other", "bf")])
        assert ckpt.reads == 3  # 'a'; 'far' + 'bf' (neighbours past the gap); the other file
        np.testing.assert_array_equal(got["a"], values["a"])
        np.testing.assert_array_equal(got["far"], values["far"])
        np.testing.assert_array_equal(got["other"], other)
        assert got["bf"].dtype == np.uint16 and got["bf"].tolist() == bf.tolist()
        assert ckpt.read("odd").tolist() == values["odd"].tolist()
        assert ckpt.total_bytes == sum(v.nbytes for v in values.values()) + bf.nbytes + other.nbytes
        with pytest.raises(ModelFormatError, match="'nope'"):
            ckpt.read("nope")


def _two_shards(tmp_path: Path) -> tuple[Path, dict]:
    d = tmp_path / "model"
    d.mkdir()
    write_safetensors(d / "model-00001-of-00002.safetensors", {"x": np.arange(4, dtype=np.float32), "y": np.ones(2, np.int8)})
    write_safetensors(d / "model-00002-of-00002.safetensors", {"z": np.arange(3, dtype=np.int32)})
    weight_map = {"x": "model-00001-of-00002.safetensors", "y": "model-00001-of-00002.safetensors",
                  "z": "model-00002-of-00002.safetensors"}
    return d, weight_map


def _write_index(d: Path, weight_map) -> Path:
    path = d / INDEX_NAME
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def expect_checkpoint_error(d: Path, *fragments: str) -> str:
    with pytest.raises(ModelFormatError) as info:
        Checkpoint(d)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_checkpoint_with_and_without_index(tmp_path):
    d, weight_map = _two_shards(tmp_path)
    with Checkpoint(d) as ckpt:
        assert sorted(ckpt.tensors) == ["x", "y", "z"]
    _write_index(d, weight_map)
    with Checkpoint(d) as ckpt:
        assert ckpt.read("z").tolist() == [0, 1, 2]


@pytest.mark.parametrize("with_index", [False, True])
def test_duplicate_tensor_across_shards(tmp_path, with_index):
    d, weight_map = _two_shards(tmp_path)
    write_safetensors(d / "model-00002-of-00002.safetensors", {"z": np.arange(3, dtype=np.int32), "y": np.ones(2, np.int8)})
    if with_index:
        _write_index(d, weight_map)
    expect_checkpoint_error(d, "'y'", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def test_index_maps_a_tensor_to_the_wrong_shard(tmp_path):
    d, weight_map = _two_shards(tmp_path)
    weight_map["y"] = "model-00002-of-00002.safetensors"
    index = _write_index(d, weight_map)
    expect_checkpoint_error(d, str(index), "'y'", "model-00002-of-00002.safetensors", "is in model-00001-of-00002.safetensors")


def test_index_names_a_tensor_no_shard_has(tmp_path):
    d, weight_map = _two_shards(tmp_path)
    weight_map["ghost"] = "model-00002-of-00002.safetensors"
    index = _write_index(d, weight_map)
    expect_checkpoint_error(d, str(index), "'ghost'", "in no shard")


def test_index_names_a_missing_shard(tmp_path):
    d, weight_map = _two_shards(tmp_path)
    weight_map["w"] = "model-00003-of-00003.safetensors"
    index = _write_index(d, weight_map)
    expect_checkpoint_error(d, str(index), "'model-00003-of-00003.safetensors'", "missing")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/abs/outside.safetensors", ".", ""])
def test_index_shard_path_escaping_the_directory(tmp_path, shard):
    d, weight_map = _two_shards(tmp_path)
    write_safetensors(tmp_path / "outside.safetensors", {"evil": np.zeros(1, np.float32)})  # exists, readable
    if shard.startswith("/abs"):
        shard = str(tmp_path / "outside.safetensors")
    weight_map["evil"] = shard
    index = _write_index(d, weight_map)
    expect_checkpoint_error(d, str(index), repr(shard), "outside the model directory")


def test_a_shard_symlink_named_inside_is_the_shard_wherever_it_points(tmp_path):
    # the Hugging Face hub cache: snapshots/REV/NAME -> ../../blobs/HASH (issue 19 item 11)
    d, weight_map = _two_shards(tmp_path)
    write_safetensors(tmp_path / "outside.safetensors", {"w": np.arange(2, dtype=np.float32)})
    (d / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    weight_map["w"] = "link.safetensors"
    _write_index(d, weight_map)
    with Checkpoint(d) as checkpoint:
        assert checkpoint.info("w").path == str(d / "link.safetensors")  # named as linked: mirrors match by name
        np.testing.assert_array_equal(checkpoint.read("w").view(np.float32), [0, 1])


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", "./../outside.safetensors", ".."])
def test_index_entries_naming_paths_outside_the_directory_are_refused(tmp_path, entry):
    d, weight_map = _two_shards(tmp_path)
    write_safetensors(tmp_path / "outside.safetensors", {"evil": np.zeros(1, np.float32)})
    weight_map["evil"] = str(tmp_path / "outside.safetensors") if entry == "ABSOLUTE" else entry
    _write_index(d, weight_map)
    expect_checkpoint_error(d, "outside the model directory")


@pytest.mark.parametrize("text", ["{not json", "\udcff", "[1, 2]", '{"weight_map": []}', '{"weight_map": {"x": 3}}',
                                  '{"weight_map": {}}', '{"metadata": {}}'],
                         ids=["syntax", "utf8", "list", "map_list", "map_value", "map_empty", "no_map"])
def test_bad_index(tmp_path, text):
    d, _ = _two_shards(tmp_path)
    index = d / INDEX_NAME
    index.write_bytes(text.encode("utf-8", "surrogateescape"))
    message = expect_checkpoint_error(d, str(index))
    if text.startswith("{not") or text == "\udcff":
        assert "not valid JSON" in message


def test_directory_without_safetensors_files(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.bin").write_bytes(b"\0" * 16)
    expect_checkpoint_error(d, str(d), "no *.safetensors")


def test_invalid_shard_is_reported_by_checkpoint(tmp_path):
    d, weight_map = _two_shards(tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2])
    expect_checkpoint_error(d, "model-00002-of-00002.safetensors", "'z'", "truncated")
    _write_index(d, weight_map)
    expect_checkpoint_error(d, "model-00002-of-00002.safetensors", "'z'", "truncated")


def test_directory_named_like_a_shard(tmp_path):
    d, _ = _two_shards(tmp_path)
    (d / "zz.safetensors").mkdir()
    message = expect_checkpoint_error(d, str(d), "'zz.safetensors'", "not a regular file")
    assert INDEX_NAME not in message  # there is no index to blame


def test_failed_open_does_not_close_a_reused_descriptor_later(tmp_path):
    # A SafetensorsFile whose header is refused must not keep its (closed) fd number:
    # its __del__ would later close whatever file reused that number.
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"short")
    with pytest.raises(ModelFormatError) as info:
        SafetensorsFile(bad)
    other = os.open(tmp_path / "bad.safetensors", os.O_RDONLY)
    try:
        del info  # drops the traceback, the last reference to the half-built object
        gc.collect()
        os.fstat(other)  # EBADF if the half-built object closed it
    finally:
        os.close(other)
