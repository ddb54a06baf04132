"""The expert store: tiers, mirrors and their faults, routing history, pinning,
prefetch, batch-union, O_DIRECT and the page cache."""

import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections import deque

import numpy as np
import pytest

import colibri_core
from colibri_core.cli.demo import DemoSpec
from colibri_core.errors import BudgetError, UsageError
from colibri_core.io.drives import drop_page_cache
from colibri_core.experts.history import FILENAME, RoutingHistory, cache_path
from colibri_core.experts.prefetch import MeasuredGate
from colibri_core.experts.store import ExpertStore
from colibri_core.warn import ColibriWarning

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=30_000, router_std=1.0)
PROMPT = list(range(5, 25))


@pytest.fixture
def model_dir(model_dir, tmp_path, monkeypatch):
    """tests/conftest.py's copy of the model, read with this test's own settings."""
    assert len(list(model_dir.glob("*.safetensors"))) >= 3  # shards to mirror, fail and read apart
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the user cache dir of this test
    # tiny shards make bandwidth measurements meaningless: the primary reads at 1 GiB/s here
    monkeypatch.setattr("colibri_core.engine.api.measure_bandwidth", lambda drive: float(1 << 30))
    return model_dir


def generate(path, max_tokens=12, **options):
    options.setdefault("history", False)
    with colibri_core.load(path, **options) as model:
        result = model.generate(token_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True, return_logits=True)
        result.model_store = model.store
        return result


def same(a, b):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logits, b.logits):
        assert np.array_equal(x, y)


def make_mirror(model_dir, dest, shards=None):
    dest.mkdir()
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files if shards is None else [files[i] for i in shards]:
        shutil.copy(f, dest / f.name)
    return dest


# -- mirrors -----------------------------------------------------------------------------
def test_full_and_partial_mirrors_share_the_reads_and_change_nothing(model_dir, tmp_path):
    reference = generate(model_dir, cap=1)
    full = make_mirror(model_dir, tmp_path / "full")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ColibriWarning)  # a healthy mirror warns about nothing
        mirrored = generate(model_dir, cap=1, mirrors=[f"{full}@1G"])
    same(mirrored, reference)
    by_drive = mirrored.stats.bytes_read_by_drive
    assert set(by_drive) == {"primary", str(full)} and all(n > 0 for n in by_drive.values())
    assert sum(by_drive.values()) == reference.stats.bytes_read

    partial = make_mirror(model_dir, tmp_path / "partial", shards=[0])
    same(generate(model_dir, cap=1, mirrors=[f"{partial}@1G"]), reference)


def test_drive_choice_follows_bandwidth(model_dir, tmp_path):
    fast = make_mirror(model_dir, tmp_path / "fast")
    result = generate(model_dir, cap=1, mirrors=[f"{fast}@64G"], max_tokens=24)
    by_drive = result.stats.bytes_read_by_drive
    # the primary is measured (~1-2 GB/s here), the mirror is declared far faster
    assert by_drive[str(fast)] > 3 * by_drive["primary"]


@pytest.mark.parametrize("damage", ["size", "header"])
def test_a_mismatched_mirror_shard_is_not_used(model_dir, tmp_path, damage):
    reference = generate(model_dir, cap=1)
    mirror = make_mirror(model_dir, tmp_path / "mirror")
    victim = sorted(mirror.glob("*.safetensors"))[1]
    raw = bytearray(victim.read_bytes())
    if damage == "size":
        raw += b"\0" * 16
    else:
        raw[10] = ord("X") if raw[10] != ord("X") else ord("Y")  # same size, header bytes differ
    victim.write_bytes(bytes(raw))
    with pytest.warns(ColibriWarning, match=victim.name):
        same(generate(model_dir, cap=1, mirrors=[f"{mirror}@8G"]), reference)


def test_a_mirror_failing_mid_run_falls_back_with_one_warning(model_dir, tmp_path):
    reference = generate(model_dir, cap=1, max_tokens=16)
    mirror = make_mirror(model_dir, tmp_path / "mirror")
    with colibri_core.load(model_dir, cap=1, mirrors=[f"{mirror}@64G"], history=False) as model:
        first = model.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True, return_logits=True)
        for shard in mirror.glob("*.safetensors"):
            os.truncate(shard, 100)  # the drive goes bad under the running model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = model.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True, return_logits=True)
        mirror_drive = model.store.disk.drives[1]
        assert mirror_drive.failed
    ours = [w for w in caught if issubclass(w.category, ColibriWarning)]
    assert len(ours) == 1 and "reading from the primary" in str(ours[0].message)
    same(first, reference)
    same(second, reference)
    assert second.stats.bytes_read_by_drive[str(mirror)] == 0


def test_cli_prints_a_mirror_warning_on_one_line(model_dir, tmp_path):
    from colibri_core.testing.cli import run_colibri

    mirror = make_mirror(model_dir, tmp_path / "mirror")
    victim = sorted(mirror.glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes() + b"\0")
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1,2,3", "--max-tokens", "2", "--mirror", mirror,
                      "--history", "off", "-q")
    assert out.returncode == 0, out.stderr
    warnings_printed = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings_printed) == 1 and victim.name in warnings_printed[0]


# -- integrity manifest ------------------------------------------------------------------
def tensor_spans(shard):
    """(name, start, end) of every tensor's bytes in a shard file."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return [(name, 8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1]) for name, e in header.items()
            if name != "__metadata__"]


def corrupt_in_place(shard, only=lambda name: True):
    """Change one byte in the middle of every (chosen) tensor: same size, same header."""
    raw = bytearray(shard.read_bytes())
    for name, start, end in tensor_spans(shard):
        if end > start and only(name):
            raw[(start + end) // 2] ^= 0x5A
    shard.write_bytes(bytes(raw))


def truncate_and_reextend(shard):
    """Cut the shard just after its header, then grow it back to its size with zeros."""
    size = shard.stat().st_size
    first = min(start for _, start, _ in tensor_spans(shard))
    os.truncate(shard, first + 8)
    os.truncate(shard, size)


def write_manifest(model_dir):
    from colibri_core.testing.cli import run_colibri

    out = run_colibri("doctor", "--model", model_dir, "--deep", "--write-manifest", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (model_dir / "colibri-integrity.json").is_file()


def integrity_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ColibriWarning)]


@pytest.mark.parametrize("damage", [corrupt_in_place, truncate_and_reextend], ids=["corrupted", "truncated_and_zeroed"])
def test_a_damaged_mirror_is_caught_by_the_manifest_and_the_primary_serves(model_dir, tmp_path, damage):
    reference = generate(model_dir, cap=1, max_tokens=16)
    write_manifest(model_dir)
    mirror = make_mirror(model_dir, tmp_path / "mirror")
    with colibri_core.load(model_dir, cap=1, mirrors=[f"{mirror}@64G"], history=False) as model:
        first = model.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True, return_logits=True)
        assert first.stats.bytes_read_by_drive[str(mirror)] > 0
        for shard in mirror.glob("*.safetensors"):
            damage(shard)  # same size, same header: only the bytes differ
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = model.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True, return_logits=True)
        assert model.store.disk.drives[1].failed
    ours = integrity_warnings(caught)
    assert len(ours) == 1 and "integrity manifest" in ours[0] and "reading from the primary" in ours[0], ours
    same(first, reference)
    same(second, reference)


def test_a_mirror_damaged_before_the_run_gives_the_primary_tokens_with_one_warning(model_dir, tmp_path):
    reference = generate(model_dir, cap=1, max_tokens=16)
    write_manifest(model_dir)
    mirror = make_mirror(model_dir, tmp_path / "mirror")
    for shard in mirror.glob("*.safetensors"):
        corrupt_in_place(shard)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = generate(model_dir, cap=1, max_tokens=16, mirrors=[f"{mirror}@64G"])
    assert len(integrity_warnings(caught)) == 1
    same(result, reference)


def test_verify_checks_the_primary_and_a_mirror_serves_its_damaged_experts(model_dir, tmp_path):
    from colibri_core.testing.cli import run_colibri

    reference = generate(model_dir, cap=1, max_tokens=16)
    with pytest.raises(colibri_core.errors.UsageError, match="no integrity manifest"):
        colibri_core.load(model_dir, verify=True, history=False)
    write_manifest(model_dir)
    mirror = make_mirror(model_dir, tmp_path / "mirror")
    for shard in model_dir.glob("*.safetensors"):
        corrupt_in_place(shard, only=lambda name: ".mlp.experts." in name)
    unverified = generate(model_dir, cap=1, max_tokens=16)
    assert any(not np.array_equal(x, y) for x, y in zip(unverified.logits, reference.logits))  # the damage shows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = generate(model_dir, cap=1, max_tokens=16, verify=True, mirrors=[f"{mirror}@1K"])
    ours = integrity_warnings(caught)
    assert len(ours) == 1 and "integrity manifest" in ours[0] and str(mirror) in ours[0], ours
    same(served, reference)
    # without a mirror to serve them, damaged bytes are one clear error naming the tensor
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1,2,3", "--max-tokens", "2", "--verify",
                      "--history", "off", "--cap", "1")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1, out.stderr
    assert ".mlp.experts." in out.stderr and "integrity manifest" in out.stderr


def test_verify_checks_the_dense_weights_read_at_load(model_dir):
    from colibri_core.io.integrity import IntegrityError

    write_manifest(model_dir)
    shard = sorted(model_dir.glob("*.safetensors"))[0]
    corrupt_in_place(shard, only=lambda name: ".mlp.experts." not in name)
    generate(model_dir)  # unverified, it loads
    with pytest.raises(IntegrityError, match="does not match the integrity manifest"):
        generate(model_dir, verify=True)


def test_doctor_deep_checks_the_manifest_and_rewrites_it_on_request(model_dir):
    from colibri_core.testing.cli import run_colibri

    def doctor(*args):
        out = run_colibri("doctor", "--model", model_dir, "--json", *args)
        return out.returncode, {c["name"]: c for c in json.loads(out.stdout)["checks"]} if out.stdout else out.stderr

    code, checks = doctor()
    assert code == 0 and checks["integrity manifest"]["detail"].startswith("none")
    out = run_colibri("doctor", "--model", model_dir, "--write-manifest")
    assert out.returncode == 2 and "--deep" in out.stderr
    write_manifest(model_dir)
    code, checks = doctor("--deep")
    assert code == 0 and "every tensor matches" in checks["integrity manifest"]["detail"]
    shard = sorted(model_dir.glob("*.safetensors"))[1]
    victim = next(name for name, start, end in tensor_spans(shard) if end > start)
    corrupt_in_place(shard, only=lambda name: name == victim)
    code, checks = doctor("--deep")
    assert code == 1 and checks["integrity manifest"]["status"] == "fail" and victim in checks["integrity manifest"]["detail"]
    code, checks = doctor("--deep", "--write-manifest")
    assert code == 0 and checks["integrity manifest"]["detail"].startswith("written")
    assert doctor("--deep")[0] == 0


def test_a_manifest_that_no_longer_describes_a_shard_leaves_it_unverified_with_one_warning(model_dir):
    from colibri_core.io import integrity
    from colibri_core.io.checkpoint import Checkpoint

    write_manifest(model_dir)
    path = model_dir / integrity.MANIFEST_NAME
    data = json.loads(path.read_text())
    changed = sorted(data["shards"])[1]
    data["shards"][changed]["header"] = "0" * 32  # as if the shard had been replaced since
    path.write_text(json.dumps(data))
    with Checkpoint(model_dir) as checkpoint:
        with pytest.warns(ColibriWarning, match=f"does not describe {changed}") as caught:
            manifest = integrity.Manifest.read(checkpoint)
        assert len([w for w in caught if issubclass(w.category, ColibriWarning)]) == 1
        assert set(manifest.digests) == set(checkpoint.tensors) - set(checkpoint.files[changed].tensors)
    path.write_text("{broken")
    with pytest.warns(ColibriWarning, match="unreadable and is ignored"):
        assert generate(model_dir, mirrors=[str(make_mirror(model_dir, model_dir.parent / "m"))]).token_ids


# -- O_DIRECT and the page cache -----------------------------------------------------------
def resident_pages(path, offset, length):
    """How many pages of [offset, offset+length) are in the page cache (mmap + mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = offset // page * page
    n = -(-(offset + length - start) // page)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, n * page, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * n)()
            assert libc.mincore(addr, n * page, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, n * page)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("fadvise", [True, False])
def test_expert_reads_do_not_stay_in_the_page_cache(model_dir, direct, fadvise):
    with colibri_core.load(model_dir, cap=1, direct_io=direct, history=False) as model:
        infos = list(model.store.layouts[1][3].values())
        path = infos[0].path
        os.sync()  # dirty pages (the copy was just written) cannot be dropped
        drop_page_cache(path)
        assert resident_pages(path, 0, os.path.getsize(path)) == 0
        model.store.disk.primary.fadvise = fadvise
        model.store.get(1, 3)
        left = resident_pages(path, 0, os.path.getsize(path))
        if direct:
            assert model.store.disk.primary._fds[path][1] is not None  # an O_DIRECT descriptor was used
            assert left == 0  # O_DIRECT never goes through the page cache
        elif fadvise:
            assert left == 0
        else:
            assert left > 0  # the control: without fadvise the pages stay


def test_o_direct_reads_equal_buffered_reads(model_dir):
    same(generate(model_dir, cap=1, direct_io=True), generate(model_dir, cap=1))


# -- batch-union -------------------------------------------------------------------------
def test_each_unique_expert_is_read_once_per_layer_and_batch(model_dir):
    with colibri_core.load(model_dir, cap=SPEC.num_experts, history=False) as model:
        cache = model.lm.new_cache(model.backend)
        routing = []
        model.lm.forward(np.asarray(PROMPT), cache, model.backend, routing=routing)
        unique = sum(len(np.unique(indices)) for _, indices in routing)
        tokens_times_k = sum(indices.size for _, indices in routing)
        assert model.store.stats.misses == unique < tokens_times_k
        # one merged read per expert, two when its matrices straddle two shards
        expected_reads = sum(len({info.path for info in model.store.layouts[layer][e].values()})
                             for layer, (_, indices) in enumerate(routing) for e in np.unique(indices))
        assert model.store.disk.reads == expected_reads


# -- routing history ---------------------------------------------------------------------
def test_history_is_saved_atomically_and_counts_every_routed_token(model_dir):
    with colibri_core.load(model_dir, history=True) as model:
        model.generate(token_ids=PROMPT, max_tokens=6, ignore_eos=True)
    saved = json.loads((model_dir / FILENAME).read_text())
    assert saved["family"] == "olmoe" and saved["layers"] == SPEC.num_hidden_layers and saved["experts"] == SPEC.num_experts
    counts = np.asarray(saved["counts"])
    tokens = len(PROMPT) + 5  # the last generated token is never fed back
    assert saved["tokens"] == tokens
    assert np.all(counts.sum(axis=1) == tokens * SPEC.num_experts_per_tok)
    assert not [p for p in model_dir.iterdir() if ".tmp-" in p.name]

    with colibri_core.load(model_dir, history=True, history_decay=0.5) as model:
        model.generate(token_ids=PROMPT, max_tokens=6, ignore_eos=True)
    again = json.loads((model_dir / FILENAME).read_text())
    assert again["tokens"] == tokens * 0.5 + tokens


@pytest.mark.parametrize("content", ["", "{not json", json.dumps({"format": 1, "counts": "x", "tokens": 1}),
                                     json.dumps({"format": 1, "family": "olmoe", "counts": [[-1] * 8] * 3, "tokens": 5})])
def test_a_corrupt_history_is_ignored_with_a_warning(model_dir, content):
    reference = generate(model_dir, cap=1)
    (model_dir / FILENAME).write_text(content)
    with pytest.warns(ColibriWarning, match="ignored"):
        result = generate(model_dir, cap=1, history=True, pin="on")
    same(result, reference)
    assert json.loads((model_dir / FILENAME).read_text())["format"] == 1  # replaced by a valid one


@pytest.mark.parametrize("family, shape", [("qwen3_moe", (3, 8)), ("olmoe", (4, 8)), ("olmoe", (3, 16))])
def test_a_history_for_another_model_is_refused(model_dir, family, shape):
    (model_dir / FILENAME).write_text(json.dumps({"format": 1, "family": family, "tokens": 100,
                                                  "counts": np.ones(shape).tolist()}))
    with pytest.warns(ColibriWarning, match="refused"):
        history = RoutingHistory.open(model_dir, "olmoe", "olmoe", 3, 8)
    assert history.total_tokens == 0


def _make_immutable(path):
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)  # root ignores permission bits
    else:
        os.chmod(path, 0o555)


def _make_mutable(path):
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        os.chmod(path, 0o755)


def test_a_read_only_model_dir_keeps_its_history_in_the_cache_dir(model_dir, tmp_path):
    _make_immutable(model_dir)
    try:
        with pytest.raises(OSError):
            (model_dir / "probe").write_text("x")
        with colibri_core.load(model_dir, history=True) as model:
            model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True)
        assert not (model_dir / FILENAME).exists()
        saved = cache_path(model_dir)
        assert saved.is_relative_to(tmp_path / "cache") and json.loads(saved.read_text())["tokens"] > 0
        history = RoutingHistory.open(model_dir, "olmoe", "olmoe", SPEC.num_hidden_layers, SPEC.num_experts)
        assert history.path == saved
    finally:
        _make_mutable(model_dir)


def test_a_model_dir_marked_read_only_keeps_its_history_in_the_cache_dir(model_dir, tmp_path):
    """colibri-trained's models are package data: a ``colibri-read-only`` file keeps every
    write (history, lock) out of them, writable or not."""
    from colibri_core.experts.history import READ_ONLY_MARKER

    (model_dir / READ_ONLY_MARKER).write_text("")
    before = sorted(p.name for p in model_dir.iterdir())
    with colibri_core.load(model_dir, history=True) as model:
        model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True)
    assert sorted(p.name for p in model_dir.iterdir()) == before
    saved = cache_path(model_dir)
    assert saved.is_relative_to(tmp_path / "cache") and json.loads(saved.read_text())["tokens"] > 0


# -- routing history: concurrent runs, killed saves, read-only model directories ----------
_SAVER = """
import sys, time, pathlib
import numpy as np
from colibri_core.experts.history import RoutingHistory
model_dir, worker, go = pathlib.Path(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
history = RoutingHistory.open(model_dir, "olmoe", "olmoe", 3, 8)
for layer in range(3):
    history.record(layer, np.full(worker + 1, worker % 8))  # worker w routes w+1 tokens to expert w % 8
history.record_tokens(worker + 1)
pathlib.Path(sys.argv[4]).touch()  # loaded: every worker read the same saved counts
while not go.exists():
    time.sleep(0.005)
history.save()
"""


def test_concurrent_runs_add_up_their_routing_counts(model_dir, tmp_path):
    workers = 8
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _SAVER, str(model_dir), str(w), str(go), str(tmp_path / f"ready{w}")])
             for w in range(workers)]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{w}").exists() for w in range(workers)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a worker did not start"
            time.sleep(0.01)
        go.touch()
        assert all(p.wait(timeout=60) == 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    saved = json.loads((model_dir / FILENAME).read_text())
    expected = np.zeros((3, 8))
    for w in range(workers):
        expected[:, w % 8] += w + 1
    assert saved["tokens"] == sum(w + 1 for w in range(workers))
    assert np.array_equal(np.asarray(saved["counts"]), expected)
    assert not [p for p in model_dir.iterdir() if ".tmp-" in p.name]


def test_a_save_killed_midway_leaves_no_temp_file_after_the_next_save(model_dir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID that no longer runs, like a writer killed during its save
    stale = model_dir / f".{FILENAME}.tmp-{dead.pid}"
    stale.write_text('{"format": 1, "counts": [[0.0')
    live = model_dir / f".{FILENAME}.tmp-1"  # init: alive, its file is left alone
    live.write_text("")
    with colibri_core.load(model_dir, history=True) as model:
        model.generate(token_ids=PROMPT, max_tokens=3, ignore_eos=True)
    assert not stale.exists()
    assert live.exists()
    assert json.loads((model_dir / FILENAME).read_text())["tokens"] > 0


def test_a_read_only_model_dir_with_a_history_accumulates_in_the_cache_copy(model_dir, tmp_path):
    shipped = {"format": 1, "family": "olmoe", "model_type": "olmoe", "layers": 3, "experts": 8, "tokens": 1000.0,
               "counts": np.full((3, 8), 250.0).tolist()}
    (model_dir / FILENAME).write_text(json.dumps(shipped))
    _make_immutable(model_dir)
    try:
        per_run = len(PROMPT) + 3  # tokens fed through the model by one run of 4 tokens
        for run in range(1, 4):
            with colibri_core.load(model_dir, history=True) as model:
                model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True)
            cached = json.loads(cache_path(model_dir).read_text())
            assert cached["tokens"] == 1000 + run * per_run
            assert np.all(np.asarray(cached["counts"]).sum(axis=1) == 1000 * 2 + run * per_run * SPEC.num_experts_per_tok)
        assert json.loads((model_dir / FILENAME).read_text()) == shipped  # untouched
        assert RoutingHistory.open(model_dir, "olmoe", "olmoe", 3, 8).path == cache_path(model_dir)
    finally:
        _make_mutable(model_dir)


# -- pinning -----------------------------------------------------------------------------
def test_hottest_experts_are_pinned_and_serve_hits(model_dir):
    with colibri_core.load(model_dir, history=True) as model:
        for _ in range(4):
            model.generate(token_ids=PROMPT, max_tokens=10, ignore_eos=True)
    history = RoutingHistory.open(model_dir, "olmoe", "olmoe", SPEC.num_hidden_layers, SPEC.num_experts)
    assert history.total_tokens >= 64  # enough for automatic pinning
    with colibri_core.load(model_dir, cap=2, history=True) as model:  # pin="auto"
        pinned = model.store.ram.pinned_set()
        assert len(pinned) == model.placement.pinned == 3  # half of 2 experts x 3 layers
        scores = history.scores()
        coldest_pinned = min(scores[p] for p in pinned)
        assert all(scores[le] <= coldest_pinned for le in np.ndindex(scores.shape) if le not in pinned)
        result = model.generate(token_ids=PROMPT, max_tokens=10, ignore_eos=True)
        assert result.stats.hits_pinned > 0 and result.stats.pinned_experts == 3
        assert model.store.ram.pinned_set() == pinned  # LRU pressure never evicts the pinned set


def test_live_repinning_swaps_only_past_the_margin(model_dir):
    with colibri_core.load(model_dir, cap=2, pin="on", history=True) as model:
        store = model.store
        history = store.history
        history.counts[:] = 0
        history.counts[0, 0] = history.counts[1, 1] = history.counts[2, 2] = 10
        store.ram._pinned = [{} for _ in range(SPEC.num_hidden_layers)]
        store.ram.pinned_bytes = 0
        store.apply_pins()
        assert store.ram.pinned_set() == {(0, 0), (1, 1), (2, 2)}
        history.counts[0, 5] = 12  # hotter, but not by the 1.25 margin
        assert store.repin() == 0
        history.counts[0, 5] = 13  # beats the coldest pinned (10) by more than 25%
        history.counts[1, 6] = 20
        assert store.repin() == 2
        assert store.ram.pinned_set() == {(1, 6), (0, 5), (2, 2)} or store.ram.pinned_set() == {(1, 6), (0, 5), (1, 1)} \
            or store.ram.pinned_set() == {(1, 6), (0, 5), (0, 0)}
        assert len(store.ram.pinned_set()) == 3
        history.counts[:, 7] = 100
        assert store.repin() <= store.pin_policy.max_swaps


# -- prefetch ----------------------------------------------------------------------------
class FixedGate(MeasuredGate):
    """Reads ahead on one-row steps or not, as told (the timing is tested on its own)."""

    def __init__(self, ahead: bool):
        super().__init__()
        self.ahead = ahead

    def begin(self, rows):
        return self.ahead if rows == 1 else True


def test_prefetch_reads_ahead_and_reports_its_precision(model_dir, monkeypatch):
    monkeypatch.setattr(MeasuredGate, "begin", lambda self, rows: True)  # always read ahead,
    monkeypatch.setattr(ExpertStore, "prefetch_pays", lambda self, rank, several=False: True)  # every rank
    reference = generate(model_dir, cap=2, max_tokens=16)
    result = generate(model_dir, cap=2, max_tokens=16, prefetch=True)
    same(result, reference)
    s = result.stats
    assert s.prefetch_issued > 0 and s.hits_prefetched > 0
    assert 0 < s.prefetch_precision <= 1 and 0 < s.prefetch_recall <= 1
    assert s.hits_prefetched <= s.prefetch_issued
    assert s.expert_misses < reference.stats.expert_misses  # misses saved
    assert s.prefetch_steps_off == 0


def test_predicted_reads_a_layer_does_not_use_are_cancelled_when_it_asks_for_its_experts(model_dir):
    import threading

    from colibri_core.experts.reads import ReadPool

    with colibri_core.load(model_dir, cap=4, history=False) as model:  # room for 4 reads ahead a layer
        store = model.store
        store.prefetch_min_precision = 0.0  # read every prediction (the rank gate is tested apart)
        store._pool.shutdown()
        store._pool = ReadPool(1)  # one worker: the order of the reads is the order they run in
        plain, read = store._read, []

        def recording(layer, expert):
            read.append((layer, expert))
            return plain(layer, expert)

        store._read = recording
        busy = threading.Event()
        blocker = store._pool.submit((0, -1), busy.wait, 10)  # the worker is busy: what follows queues
        store.prefetch(1, [0, 1, 2, 3])
        store.request(1, [0, 1])  # the layer turns out to use 0 and 1
        busy.set()
        blocker.result()
        for e in (0, 1):
            store.get(1, e)
        store._pool.submit((9,), lambda: None).result()  # after every read queued before it
        store.end_layer(1, np.array([[0, 1]]), np.array([0, 1]))
        assert read == [(1, 0), (1, 1)]  # 2 and 3 were never read
        assert store.stats.hits_prefetched == 2 and store.stats.prefetch_unused == 0


def test_a_running_read_ahead_its_layer_does_not_use_stops_midway(model_dir, monkeypatch):
    import threading

    from colibri_core.experts.reads import ReadPool
    from colibri_core.io import drives

    with colibri_core.load(model_dir, cap=1, history=False) as model:
        store = model.store
        store.prefetch_min_precision = 0.0  # read every prediction (the rank gate is tested apart)
        store._pool.shutdown()
        store._pool = ReadPool(1)
        monkeypatch.setattr(drives, "STOP_CHUNK", 256)  # the demo's experts span several chunks
        infos = store.layouts[1][2].values()
        lo, hi = min(t.offset for t in infos), max(t.offset + t.nbytes for t in infos)
        assert hi - lo > 3 * 256
        plain, offsets, started, go = os.preadv, [], threading.Event(), threading.Event()

        def preadv(fd, buffers, offset):
            offsets.append(offset)
            if offset == lo:  # expert 2's first chunk: its layer's routing arrives meanwhile
                started.set()
                go.wait(10)
            return plain(fd, buffers, offset)

        monkeypatch.setattr(drives.os, "preadv", preadv)
        store.prefetch(1, [2])
        assert started.wait(10)
        store.request(1, [0])  # the layer uses expert 0, not 2
        go.set()
        store.get(1, 0)
        assert isinstance(store._staged[1][2].exception(10), drives.ReadStopped)
        assert [o for o in offsets if lo <= o < hi] == [lo]  # one chunk of expert 2 read, not all
        store.end_layer(1, np.array([[0]]), np.array([0]))
        assert store.stats.prefetch_unused == 1


def test_reads_ahead_stopped_midway_change_no_token(model_dir, monkeypatch):
    from colibri_core.io import drives

    reference = generate(model_dir, cap=2, max_tokens=12)
    monkeypatch.setattr(drives, "STOP_CHUNK", 256)
    # hopeless predictions: every read ahead is one its layer does not use
    monkeypatch.setattr("colibri_core.experts.prefetch.ranked",
                        lambda indices, weights: [e for e in range(SPEC.num_experts) if e not in set(np.ravel(indices))])
    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        model.lm.prefetcher.gate = FixedGate(ahead=True)
        model.store.prefetch_min_precision = 0.0  # keep issuing them (whether one is running when
        # its layer asks is up to the threads: the test above stops one for certain)
        result = model.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True, return_logits=True)
    same(result, reference)
    assert result.stats.prefetch_issued > 11


def test_the_time_spent_waiting_for_reads_is_counted(model_dir):
    streamed = generate(model_dir, cap=1, max_tokens=8).stats
    assert streamed.misses > 0 and streamed.read_wait_s > 0
    assert 0 < streamed.decode_read_wait_s <= streamed.read_wait_s and streamed.decode_read_wait_s < streamed.decode_s
    resident = generate(model_dir, preload=True, max_tokens=8).stats
    assert resident.misses == 0 and resident.read_wait_s == 0 and resident.decode_read_wait_s == 0


def test_measured_gate_keeps_the_faster_way_and_measures_again():
    now = [0.0]
    gate = MeasuredGate(samples=3, hold=4, block=4, settle=1, clock=lambda: now[0])

    def step(rows, cost):  # cost(ahead) -> seconds the step takes
        ahead = gate.begin(rows)
        now[0] += cost(ahead)
        gate.end()
        return ahead

    slower_ahead = lambda ahead: 2.0 if ahead else 1.0  # noqa: E731
    trial = [step(1, slower_ahead) for _ in range(8)]
    assert trial == [True] * 4 + [False] * 4  # a block each way, reading ahead first
    assert gate._times == {True: [], False: []} and gate.chosen is False  # 3 timed steps each: decided
    assert [step(1, slower_ahead) for _ in range(4)] == [False] * 4  # the faster way, held
    assert step(7, slower_ahead) is False  # a prompt runs the way chosen, untimed
    # measured again: now reading ahead is faster (a tie also reads ahead)
    faster_ahead = lambda ahead: 1.0 if ahead else 3.0  # noqa: E731
    assert [step(1, faster_ahead) for _ in range(8)] == [True] * 4 + [False] * 4
    assert [step(1, faster_ahead) for _ in range(4)] == [True] * 4
    # a block's first step is not timed; an untimed step of several rows inside a block
    # neither counts nor ends the block
    assert step(1, lambda ahead: 50.0) is True and gate._times == {True: [], False: []}
    assert step(1, lambda ahead: 5.0) is True and step(3, lambda ahead: 100.0) is True
    assert gate._times == {True: [5.0], False: []}
    # medians, not means: one slow outlier does not decide
    gate = MeasuredGate(samples=3, hold=4, block=4, settle=1, clock=lambda: now[0])
    costs = iter([9.0, 1.0, 1.0, 50.0, 9.0, 2.0, 2.0, 2.0])  # ahead: 1, 1, 50 (median 1); without: 2, 2, 2
    assert [step(1, lambda ahead: next(costs)) for _ in range(8)] == [True] * 4 + [False] * 4
    assert gate.chosen is True
    with pytest.raises(ValueError, match="settle"):
        MeasuredGate(block=2, settle=2)


def test_measured_gate_charges_reading_ahead_with_the_costs_it_puts_on_later_steps():
    """A step that reads ahead saves its own wait but leaves a cost on the next step (an
    expert evicted for a wrong prediction is read again; reads still queued). Steadily
    reading ahead then loses: every step pays the cost of the one before. Single steps
    alternating charged that cost to the steps without reads ahead and kept reading
    ahead; blocks whose first steps go untimed see it."""
    now = [0.0]

    def run(gate, steps):
        ways, owed = [], 0.0
        for _ in range(steps):
            ahead = gate.begin(1)
            now[0] += 1.0 + owed - (0.2 if ahead else 0.0)  # saves 0.2 now ...
            owed = 0.5 if ahead else 0.0  # ... and costs the next step 0.5
            gate.end()
            ways.append(ahead)
        return ways

    blocks = MeasuredGate(samples=4, hold=20, block=6, settle=2, clock=lambda: now[0])
    run(blocks, 12)
    assert blocks.chosen is False and run(blocks, 20) == [False] * 20
    single_steps = MeasuredGate(samples=4, hold=20, block=1, settle=0, clock=lambda: now[0])
    run(single_steps, 8)
    assert single_steps.chosen is True  # the blind spot: a cost landing on the next step
    # where reading ahead leaves nothing behind, blocks keep it
    kept = MeasuredGate(samples=4, hold=20, block=6, settle=2, clock=lambda: now[0])
    for _ in range(12):
        ahead = kept.begin(1)
        now[0] += 0.8 if ahead else 1.0
        kept.end()
    assert kept.chosen is True


def _run_gate(gate, steps, now, ahead_cost):
    """``steps`` one-row steps of 1 s on the simulated clock ``now`` (plus ``ahead_cost``
    for one reading ahead): the ways the gate chose, as (way, run length) pairs."""
    import itertools

    ways = []
    for _ in range(steps):
        ahead = gate.begin(1)
        now[0] += 1.0 + (ahead_cost if ahead else 0.0)
        gate.end()
        ways.append(ahead)
    return [(way, len(list(group))) for way, group in itertools.groupby(ways)]


def test_the_gate_measures_less_often_while_measurements_confirm_its_choice():
    now, ahead_costs = [0.0], [0.3]  # what a step reading ahead costs more than one without
    run = lambda gate, steps: _run_gate(gate, steps, now, ahead_costs[0])  # noqa: E731

    gate = MeasuredGate(samples=4, hold=72, block=6, settle=2, clock=lambda: now[0], longest_hold=576)
    # each trial: a block reading ahead, a block without, then the hold without; the hold
    # doubles each time a trial confirms the choice
    assert run(gate, 1716) == [(True, 6), (False, 6 + 72), (True, 6), (False, 6 + 144), (True, 6), (False, 6 + 288),
                               (True, 6), (False, 6 + 576), (True, 6), (False, 6 + 576)]
    ahead_costs[0] = -0.3  # the phase changes: reading ahead now pays; the next trial sees it
    assert run(gate, 12 + 72 + 12 + 144) == [(True, 6), (False, 6), (True, 72 + 6), (False, 6), (True, 144)]


def test_a_bound_that_rules_reading_ahead_out_spares_the_trial_its_block_reading_ahead():
    now, rules_out, ahead_costs = [0.0], [True], [0.3]
    run = lambda gate, steps: _run_gate(gate, steps, now, ahead_costs[0])  # noqa: E731

    gate = MeasuredGate(samples=4, hold=72, block=6, settle=2, clock=lambda: now[0], cannot_pay=lambda: rules_out[0])
    # the first trial is measured (nothing to go by yet); once "without" is held, each trial
    # asks the bound first, and runs no block reading ahead
    assert run(gate, 12 + 72 + 144) == [(True, 6), (False, 6 + 72 + 144)]
    assert gate.chosen is False and gate.spared == 1  # it confirmed the way held: a longer hold
    ahead_costs[0] = -0.3  # reading ahead would now pay, but the bound still rules it out
    assert run(gate, 288) == [(False, 288)] and gate.spared == 2
    rules_out[0] = False  # the bound no longer rules it out: the clock decides again
    assert run(gate, 12 + 72) == [(True, 6), (False, 6), (True, 72)]
    assert gate.chosen is True and gate.spared == 2


def _prefetcher_with(quiet):
    from colibri_core.experts.prefetch import QUIET_STEPS, Prefetcher

    prefetcher = Prefetcher.__new__(Prefetcher)
    prefetcher._quiet = deque(quiet, maxlen=QUIET_STEPS)
    return prefetcher


def test_reading_ahead_cannot_pay_when_its_unused_reads_would_outlast_the_disk_s_idle_time():
    ms = 1_000_000
    # steps of 100 ms with the disk busy 90 of them reading 90 MB (1 GB/s): 10 ms idle a step
    wasteful = [(100 * ms, 90 * ms, 90_000_000, 25_000_000)] * 4  # 25 ms of unused reads a step
    thrifty = [(100 * ms, 90 * ms, 90_000_000, 15_000_000)] * 4  # 15 ms: within the margin (BOUND_MARGIN)
    assert _prefetcher_with(wasteful).cannot_pay() is True
    assert _prefetcher_with(thrifty).cannot_pay() is False
    assert _prefetcher_with(wasteful[:3]).cannot_pay() is False  # too few steps to go by
    assert _prefetcher_with([(100 * ms, 0, 0, 25_000_000)] * 4).cannot_pay() is False  # no reads: no rate known


def test_the_disk_tier_counts_overlapping_reads_once_in_its_busy_time(model_dir):
    import threading

    with colibri_core.load(model_dir, cap=1, history=False) as model:
        disk, layouts = model.store.disk, model.store.layouts
        plain = type(disk)._read
        assert disk.busy_ns() == 0
        both_reading = threading.Barrier(2)

        def slow(drive, infos):
            both_reading.wait(timeout=10)
            time.sleep(0.2)
            return plain(drive, infos)

        disk._read = slow
        readers = [threading.Thread(target=disk.load, args=(0, e, layouts[0][e])) for e in (0, 1)]
        started = time.perf_counter_ns()
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        elapsed = time.perf_counter_ns() - started
        assert 200_000_000 <= disk.busy_ns() <= elapsed  # two reads of 0.2 s at once: ~0.2 s busy, not 0.4
        assert disk.busy_ns() == disk.busy_ns()  # nothing in flight: it stands still


def test_on_a_disk_kept_busy_by_demand_reads_the_gate_makes_no_trial_reading_ahead(model_dir, monkeypatch):
    from colibri_core.experts.tiers import DiskTier

    reference = generate(model_dir, cap=2, max_tokens=20)
    # hopeless predictions: always the experts the router did not choose
    monkeypatch.setattr("colibri_core.experts.prefetch.ranked",
                        lambda indices, weights: [e for e in range(SPEC.num_experts) if e not in set(np.ravel(indices))])
    plain = DiskTier._read

    def slow(drive, infos):  # a disk far slower than the computation
        time.sleep(0.2)
        return plain(drive, infos)

    def holding_without(prefetcher):  # a short gate, as after a trial that chose not to read ahead
        gate = MeasuredGate(samples=2, hold=4, block=3, settle=1, cannot_pay=prefetcher.cannot_pay)
        gate.chosen, gate._measured, gate._hold_left = False, True, 4
        return gate

    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        monkeypatch.setattr(model.store.disk, "_read", slow)
        gate = model.lm.prefetcher.gate = holding_without(model.lm.prefetcher)
        result = model.generate(token_ids=PROMPT, max_tokens=20, ignore_eos=True, return_logits=True)
    same(result, reference)
    assert gate.spared >= 2 and gate.chosen is False
    assert result.stats.prefetch_steps_off == 20  # every step (the prompt's ran the way held): no trial read ahead
    # where the disk is fast (the page cache), the same unused reads cost little: the gate measures
    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        gate = model.lm.prefetcher.gate = holding_without(model.lm.prefetcher)
        fast = model.generate(token_ids=PROMPT, max_tokens=20, ignore_eos=True, return_logits=True)
    same(fast, reference)
    assert gate.spared == 0 and fast.stats.prefetch_steps_off < 20

def test_steps_the_gate_runs_without_reading_ahead_read_nothing_ahead(model_dir):
    reference = generate(model_dir, cap=2, max_tokens=12)
    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        model.lm.prefetcher.gate = FixedGate(ahead=False)
        result = model.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True, return_logits=True)
    same(result, reference)
    s = result.stats
    assert s.prefetch_steps_off == 11  # every decode step; the prompt's step read ahead
    assert s.prefetch_skipped > 0 and 0 < s.prefetch_precision <= 1  # predictions still scored
    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        model.lm.prefetcher.gate = FixedGate(ahead=True)
        ahead = model.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True, return_logits=True)
    same(ahead, reference)
    assert ahead.stats.prefetch_steps_off == 0 and ahead.stats.prefetch_issued > s.prefetch_issued


def test_reads_ahead_borrow_their_layers_cache_slots_and_the_ram_budget_holds(model_dir):
    """With ``--prefetch`` the cache keeps the slots of the whole budget; a read ahead takes
    one of its layer's slots while staged (evicting an expert if the layer's are full), so
    at no moment do a layer's cached experts and its staged reads exceed its slots."""
    from colibri_core.experts.tiers import CachedTier
    from colibri_core.model.blueprint import inspect_model

    bp = inspect_model(model_dir)

    def slots(budget, ahead):
        try:
            return bp.placement(ram=budget, cap=None, prefetch_slots=ahead).slots
        except BudgetError:
            return 0

    try:  # a budget whose cache holds 3 of a layer's experts: reads ahead must evict
        budget = next(b for b in range(bp.dense_bytes, bp.dense_bytes + (1 << 20), 256) if slots(b, 0) == 3)
        assert slots(budget, SPEC.num_experts_per_tok) == 3  # nothing is reserved for reads ahead
    finally:
        bp.close()
    reference = generate(model_dir, ram=budget, max_tokens=16)
    with colibri_core.load(model_dir, ram=budget, prefetch=True, history=False) as model:
        store, ram = model.store, model.store.ram
        assert ram.slots == reference.model_store.ram.slots == 3
        store.prefetch_min_precision = 0.0  # read every prediction ahead
        model.lm.prefetcher.gate = FixedGate(ahead=True)
        lent_seen, most_cached = [], []

        def check(layer):
            staged, cached = len(store._staged[layer]), len(ram.cached(layer))
            assert ram.lent_slots(layer) == staged and cached + staged <= ram.slots, (layer, cached, staged)
            lent_seen.append(staged)
            most_cached.append(cached)

        submit, put = store._submit_prefetch, ram.put

        def checked_submit(layer, reads):
            submit(layer, reads)
            check(layer)

        def checked_put(layer, expert, weights):
            held = put(layer, expert, weights)
            check(layer)
            return held

        store._submit_prefetch, ram.put = checked_submit, checked_put
        on = model.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True, return_logits=True)
        assert max(lent_seen) >= 1 and max(most_cached) == 3  # reads ahead, and a cache using all its slots
        assert all(ram.lent_slots(layer) == 0 for layer in range(len(store.layouts)))  # all given back
        assert on.stats.prefetch_issued > 0
    same(on, reference)


def test_prefetch_warns_when_the_budget_leaves_no_slot_for_a_read_ahead(model_dir):
    from colibri_core.model.blueprint import inspect_model

    bp = inspect_model(model_dir)
    try:
        budget = next(b for b in range(bp.dense_bytes, bp.dense_bytes + (1 << 20), 256)
                      if _slots_or_none(bp, b) == 0)
    finally:
        bp.close()
    with pytest.warns(ColibriWarning, match="no LRU slot per layer for a read ahead to borrow"):
        model = colibri_core.load(model_dir, ram=budget, prefetch=True, history=False)
    with model:
        result = model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True)
    assert result.stats.prefetch_issued == 0


def _slots_or_none(bp, budget):
    try:
        return bp.placement(ram=budget, cap=None).slots
    except BudgetError:
        return None


def test_a_layers_slot_lent_to_a_read_ahead_evicts_an_expert_the_prediction_does_not_name():
    from colibri_core.experts.tiers import ExpertWeights, RamTier

    tier = RamTier(2, slots=3)
    weights = {e: ExpertWeights({"w": np.zeros(4, np.float32)}, 16) for e in range(6)}
    for e in (0, 1, 2):
        tier.put(0, e, weights[e])
    assert tier.lend_slot(0, keep={0, 5})  # 0 is the least recently used, but predicted: 1 goes
    assert tier.cached(0) == [0, 2] and tier.lent_slots(0) == 1 and tier.evictions == 1
    tier.put(0, 3, weights[3])  # the layer's cache now holds 2: 0 goes
    assert tier.cached(0) == [2, 3]
    assert not tier.lend_slot(0, keep={2, 3})  # nothing left it may evict
    assert tier.lend_slot(0) and tier.lent_slots(0) == 2 and tier.cached(0) == [3]
    assert tier.lend_slot(0) and tier.cached(0) == [] and not tier.lend_slot(0)  # all 3 lent
    tier.put(0, 4, weights[4])  # no slot left: used, not kept
    assert tier.cached(0) == [] and tier.lent_slots(1) == 0
    for _ in range(3):
        tier.return_slot(0)
    tier.put(0, 4, weights[4])
    assert tier.cached(0) == [4] and tier.lent_slots(0) == 0


def test_a_smaller_cache_evicts_its_least_recently_used_experts_at_once():
    from colibri_core.experts.tiers import ExpertWeights, RamTier

    tier = RamTier(2, slots=3)
    weights = {e: ExpertWeights({"w": np.zeros(4, np.float32)}, 16) for e in range(4)}
    for e in (0, 1, 2):
        tier.put(0, e, weights[e])
    tier.put(1, 3, weights[3])
    tier.get(0, 0)  # 1 is now the least recently used of layer 0
    bytes_before = tier.resident_bytes
    tier.resize(1)
    assert tier.cached(0) == [0] and tier.cached(1) == [3] and tier.evictions == 2
    assert tier.resident_bytes == bytes_before - 2 * weights[1].nbytes
    tier.resize(3)
    tier.put(0, 1, weights[1])
    tier.put(0, 2, weights[2])
    assert tier.cached(0) == [0, 1, 2] and tier.evictions == 2


def test_a_prefetch_window_in_bytes_sets_the_experts_read_ahead(model_dir):
    with colibri_core.load(model_dir, prefetch=True, history=False) as model:
        one, default = model.placement.expert_bytes, model.placement
    assert default.prefetch_slots == SPEC.num_experts_per_tok
    for window, slots in ((one, 1), (3 * one + one // 2, 3), (100 * one, SPEC.num_experts)):
        with colibri_core.load(model_dir, prefetch=True, prefetch_window=window, history=False) as model:
            assert model.placement.prefetch_slots == slots
            assert model.lm.prefetcher._next and all(n.slots == slots for n in model.lm.prefetcher._next.values())
    with pytest.raises(UsageError, match="prefetch_window.*holds no expert"):
        colibri_core.load(model_dir, prefetch=True, prefetch_window=one - 1, history=False)
    # a window of one expert reads ahead only the likeliest one, and the tokens do not change
    reference = generate(model_dir, cap=2, max_tokens=12)
    narrow = generate(model_dir, cap=2, max_tokens=12, prefetch=True, prefetch_window=one)
    same(narrow, reference)
    assert 0 < narrow.stats.prefetch_issued <= 12 * (SPEC.num_hidden_layers - 1)


def test_predicted_experts_are_ranked_by_routing_weight_then_votes():
    from colibri_core.experts.prefetch import ranked

    # one row: the router's weights decide, not the ids
    assert ranked(np.array([[5, 2]]), np.array([[0.7, 0.3]])) == [5, 2]
    assert ranked(np.array([[5, 2]]), np.array([[0.2, 0.8]])) == [2, 5]
    # rows: weight summed over them; equal weight goes to more votes, then lower ids
    indices = np.array([[1, 4], [4, 6], [3, 6]])
    weights = np.array([[0.9, 0.1], [0.5, 0.5], [0.5, 0.5]])
    assert ranked(indices, weights) == [6, 1, 4, 3]
    assert ranked(np.array([[3, 1], [1, 3]]), np.array([[0.5, 0.5], [0.5, 0.5]])) == [1, 3]
    # no usable weights: votes, then lower ids
    assert ranked(np.array([[2, 7], [7, 0]]), None) == [7, 0, 2]


# the device tier: tests/test_tiers.py


def test_prefetch_stops_while_its_reads_go_unused_and_resumes_when_they_pay(model_dir):
    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        store = model.store
        experts = len(store.layouts[0])
        assert experts >= 4 and not store.prefetch_pays(0)  # nothing scored yet: nothing read

        def predict(predicted, used):
            store.prefetch(0, predicted)
            store.end_layer(0, np.asarray(used), np.asarray(used))

        for _ in range(3):  # scored, not read: a rank must come true about four times running first
            predict([0, 1], [0, 1])
        assert not store.prefetch_pays(0)
        predict([0, 1], [0, 1])
        assert store.stats.prefetch_issued == 0 and store.stats.prefetch_skipped == 8
        assert store.prefetch_pays(0) and store.prefetch_pays(1)
        predict([2, 3], [0, 1])  # read, and both wasted
        issued = store.stats.prefetch_issued
        assert issued == 2 and not store.prefetch_pays(0) and not store.prefetch_pays(1)
        predict([2, 3], [0, 1])  # scored, not read
        assert store.stats.prefetch_issued == issued and store.stats.prefetch_skipped == 10
        predict([0, 1], [0, 1])  # predictions come true: scored though not read
        assert store.stats.prefetch_issued == issued and store.stats.prefetch_skipped == 12
        for _ in range(12):
            predict([2, 3], [2, 3])
        assert store.prefetch_pays(0) and store.stats.prefetch_issued > issued  # reading ahead again
        # a prompt's (several rows') scores are its own: one-row ranks are unchanged by them
        before = store.prefetch_precision_by_rank()
        store.prefetch(0, [0, 1], several=True)
        store.end_layer(0, np.asarray([[0, 1], [1, 2]]), np.asarray([0, 1, 2]))
        assert store.prefetch_precision_by_rank() == before
        assert store.prefetch_precision_by_rank(several=True) == pytest.approx([1 / 1.98, 1 / 1.98])


def test_prefetch_reads_ahead_only_the_ranks_whose_predictions_are_mostly_used(model_dir):
    """The surest prediction comes true, the second never: only the first rank is read
    ahead, and the second is still scored (so it would come back if it paid)."""
    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        store = model.store
        for step in range(12):
            sure, wrong = (0, 1) if step % 2 else (1, 0)  # each expert takes both ranks in turn
            store.prefetch(0, [sure, wrong])
            store.end_layer(0, np.asarray([sure, 2]), np.asarray(sorted([sure, 2])))
        assert store.prefetch_pays(0) and not store.prefetch_pays(1)
        precision = store.prefetch_precision_by_rank()
        assert precision[0] > 0.9 and precision[1] < 0.2
        issued, skipped = store.stats.prefetch_issued, store.stats.prefetch_skipped
        store.prefetch(0, [3, 1])
        assert store.stats.prefetch_issued == issued + 1 and store.stats.prefetch_skipped == skipped + 1
        assert set(store._staged[0]) == {3}
        store.end_layer(0, np.asarray([3, 2]), np.asarray([2, 3]))


def test_reads_run_most_urgent_first_and_a_queued_read_can_be_hurried():
    import threading

    from colibri_core.experts.reads import ReadPool

    pool = ReadPool(1)
    gate, ran = threading.Event(), []
    try:
        blocker = pool.submit((0, 0), gate.wait)  # holds the one worker while the others queue
        later = [pool.submit((1, layer), ran.append, f"prefetch {layer}") for layer in (3, 2)]
        hurried = pool.submit((1, 4), ran.append, "prefetch 4, then needed")
        dropped = pool.submit((1, 1), ran.append, "never")
        demand = pool.submit((0, 1), ran.append, "demand 1")
        pool.hurry(hurried, (0, 1))
        pool.hurry(later[1], (9, 9))  # a lower priority is not taken
        assert dropped.cancel()
        gate.set()
        for f in (blocker, *later, hurried, demand):
            f.result(timeout=10)
        assert ran == ["prefetch 4, then needed", "demand 1", "prefetch 2", "prefetch 3"]
        failing = pool.submit((0, 0), int, "not a number")
        with pytest.raises(ValueError):
            failing.result(timeout=10)
    finally:
        gate.set()
        pool.shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit((0, 0), ran.append, "after")


def test_a_layers_misses_are_read_before_the_next_layers_prefetch(model_dir):
    """The miss a computation waits for must not queue behind speculative reads."""
    import threading

    from colibri_core.experts.reads import ReadPool

    with colibri_core.load(model_dir, cap=2, prefetch=True, history=False) as model:
        store = model.store
        store.prefetch_min_precision = 0.0  # read every prediction (the rank gate is tested apart)
        store._pool.shutdown()
        store._pool = ReadPool(1)  # one reader, held while the reads queue
        gate, order = threading.Event(), []
        read = store._read

        def logged(layer, expert):
            order.append((layer, expert))
            return read(layer, expert)

        cold = [[e for e in range(len(store.layouts[layer])) if not store._resident(layer, e)] for layer in (0, 1)]
        assert len(cold[0]) >= 4 and len(cold[1]) >= 4
        store._read = logged
        try:
            store._pool.submit((0, -1), gate.wait, 10)
            store.prefetch(1, cold[1][:2])  # predicted for the next layer, queued first
            assert not store.request(0, cold[0][:2])  # then this layer's misses
            gate.set()
            weights = [store.get(0, e) for e in cold[0][:2]]
            store.end_layer(0, np.asarray(cold[0][:2]), np.asarray(cold[0][:2]))
            weights += [store.get(1, e) for e in cold[1][:2]]
        finally:
            gate.set()
            store._read = read
        assert order == [(0, e) for e in cold[0][:2]] + [(1, e) for e in cold[1][:2]], order
        assert store.stats.hits_prefetched == 2

        # predicted by a MoE layer before its own routing is known: held until its misses are queued
        order.clear()
        store._read = logged
        issued = store.stats.prefetch_issued
        try:
            store.prefetch(1, cold[1][2:4], behind=0)
            assert store.stats.prefetch_issued == issued and not order  # nothing read yet
            assert not store.request(0, cold[0][2:4])
            weights += [store.get(0, e) for e in cold[0][2:4]]
            store.end_layer(0, np.asarray(cold[0][2:4]), np.asarray(cold[0][2:4]))
            weights += [store.get(1, e) for e in cold[1][2:4]]
        finally:
            store._read = read
        assert store.stats.prefetch_issued == issued + 2 and store.stats.hits_prefetched == 4
        assert order == [(0, e) for e in cold[0][2:4]] + [(1, e) for e in cold[1][2:4]], order


def test_expert_buffers_are_reused_only_when_no_array_views_them():
    import gc

    from colibri_core.io.buffers import BufferPool

    pool = BufferPool(chunk=1 << 16)  # 16 slots of 4 KiB per mapping
    a = pool.take(5000)  # two pages
    assert a.nbytes == 5000 and a.ctypes.data % 4096 == 0
    a[:] = 7
    view = a[100:200]
    address = a.ctypes.data
    del a
    gc.collect()
    others = [pool.take(5000) for _ in range(8)]  # the viewed slot is not handed out again
    assert address not in {o.ctypes.data for o in others}
    assert np.all(view == 7)
    del view, others
    gc.collect()
    again = [pool.take(5000) for _ in range(9)]  # every slot mapped so far, the freed ones included
    assert address in {o.ctypes.data for o in again}
    del again
    mapped = pool.mapped_bytes
    for _ in range(100):  # taking and dropping slots does not map more memory
        pool.take(5000)[0] = 1
    assert pool.mapped_bytes == mapped


def test_dense_weights_are_read_into_aligned_mappings_that_views_keep_alive(tmp_path):
    """load_dense reads into huge_buffer mappings: 2 MiB-aligned, and a tensor kept as a
    view keeps its bytes when everything else of the read is gone."""
    import gc
    import mmap

    from colibri_core.io.checkpoint import Checkpoint
    from colibri_core.io.buffers import HUGE, huge_buffer
    from colibri_core.io.safetensors import write_safetensors

    b = huge_buffer(3 * HUGE + 5)
    assert b.nbytes == 3 * HUGE + 5 and b.flags.writeable
    if hasattr(mmap, "MAP_ANONYMOUS"):
        assert b.ctypes.data % HUGE == 0
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((64, 33)).astype(np.float32), "b": rng.integers(0, 255, (9, 70), dtype=np.uint8)}
    write_safetensors(tmp_path / "m.safetensors", tensors)
    with Checkpoint(tmp_path) as ckpt:
        raw = ckpt.read_many(list(ckpt.tensors.values()), buffer=huge_buffer)
    kept = raw["b"]
    del raw
    gc.collect()
    np.testing.assert_array_equal(kept, tensors["b"])


def test_a_shard_truncated_under_a_running_model_is_named_in_the_error(model_dir):
    """An expert read that comes up short (the shard was truncated since it was opened)
    is one error naming the shard, not just an offset."""
    from colibri_core.errors import ColibriError

    with colibri_core.load(model_dir, cap=1, history=False) as model:
        model.generate(token_ids=PROMPT, max_tokens=2, ignore_eos=True)
        shards = sorted(model_dir.glob("*.safetensors"))
        for shard in shards:
            os.truncate(shard, 100)
        with pytest.raises(ColibriError) as info:
            model.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True)
    message = str(info.value)
    assert "short read" in message and any(str(shard) in message for shard in shards), message
