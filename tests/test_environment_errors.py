"""What the machine refuses (a full disk, a read-only --out, no memory to map, another
convert in the same directory) and Ctrl-C: one line saying what happened and what to
do, the exit statuses of colibri_core/errors.py (3 for the environment, 130 for Ctrl-C),
never 70 ("a bug in colibri"). Faults are injected by monkeypatching the os calls; the
two-converts race and Ctrl-C of a running generation are real."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import warnings

import pytest

import colibri_core
from colibri_core.cli import convert as convert_module
from colibri_core.cli.convert import MANIFEST, convert
from colibri_core.cli.demo import DemoSpec
from colibri_core.cli.main import main
from colibri_core.errors import ResourceError
from colibri_core.io import buffers
from colibri_core.warn import ColibriWarning

from colibri_core.testing.cli import run_colibri

SPEC = DemoSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=96, tokenizer_vocab=300, shard_bytes=60_000, router_std=1.0,
                max_position_embeddings=65536)  # room for a run that Ctrl-C must interrupt


@pytest.fixture(scope="module")
def source(demo_model):
    """The model converted, over several shards."""
    assert len(list(demo_model.glob("*.safetensors"))) >= 3
    return demo_model


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory):
    """An uninterrupted int4 conversion, to compare resumed ones with."""
    out = tmp_path_factory.mktemp("env-ref") / "out"
    convert(source, out, experts="int4")
    return out


def tree_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def cli(capsys, monkeypatch, *args) -> tuple[int, list[str]]:
    """The command line in this process (so monkeypatched faults reach it): exit status
    and stderr lines."""
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() replaces it
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([*map(str, args)])
    return info.value.code, capsys.readouterr().err.strip().splitlines()


def fail_on_commit(monkeypatch, n: int, exc: BaseException):
    """StreamWriter.commit raises ``exc`` on its n-th call (that shard never lands)."""
    real = convert_module.StreamWriter.commit
    calls = {"n": 0}

    def commit(self):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(self)

    monkeypatch.setattr(convert_module.StreamWriter, "commit", commit)
    return real


# -- disk full, read-only ---------------------------------------------------------------
def test_disk_full_during_convert_says_free_space_and_resume(source, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real = fail_on_commit(monkeypatch, 2, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(ResourceError) as info:
        convert(source, out, experts="int4")
    assert "free space" in str(info.value) and "resumes" in str(info.value) and str(out) in str(info.value)
    assert not list(out.glob("*.tmp-*"))  # the half-written shard is gone
    fail_on_commit(monkeypatch, 1, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    code, lines = cli(capsys, monkeypatch, "convert", "--model", source, "--out", out, "--experts", "int4")
    assert code == 3 and len(lines) == 1 and lines[0].startswith("error: disk full") and "resumes" in lines[0]
    monkeypatch.setattr(convert_module.StreamWriter, "commit", real)
    result = convert(source, out, experts="int4")  # space freed: it resumes
    assert result.shards_resumed == 1
    assert tree_bytes(out) == tree_bytes(reference)


def test_a_read_only_out_is_named(source, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ro" / "out"
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(ResourceError, match="read-only file system; choose an --out"):
        convert(source, out, experts="int4")
    code, lines = cli(capsys, monkeypatch, "convert", "--model", source, "--out", out)
    assert code == 3 and len(lines) == 1 and "read-only" in lines[0] and "ro" in lines[0]


# -- two converts into one --out --------------------------------------------------------
def test_a_convert_into_a_directory_another_convert_holds_is_refused(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running convert holds it
        proc = run_colibri("convert", "--model", source, "--out", out)
        assert proc.returncode == 3 and "another colibri convert is writing" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert list(out.iterdir()) == []  # the loser wrote nothing
    finally:
        os.close(fd)


def test_two_converts_racing_into_one_out(source, reference, tmp_path):
    """Real processes started together: each finishes the conversion or says another
    holds the directory; none crashes, and the result is the uninterrupted bytes."""
    for round_ in range(5):
        out = tmp_path / f"out{round_}"
        env = {k: v for k, v in os.environ.items() if k != "COLIBRI_DEBUG"}
        procs = [subprocess.Popen([sys.executable, "-m", "colibri_core", "convert", "--model", str(source), "--out",
                                   str(out), "--experts", "int4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(2)]
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
        for code, err in results:
            assert "internal error" not in err and "Traceback" not in err, err
            assert code == 0 or (code == 3 and "another colibri convert is writing" in err), (code, err)
        assert any(code == 0 for code, _ in results)
        again = convert(source, out, experts="int4")  # whatever happened, a re-run completes it
        assert again.shards_written == 0
        assert tree_bytes(out) == tree_bytes(reference)


# -- no memory to map -------------------------------------------------------------------
def test_mmap_refused_is_a_resource_error_naming_the_budget(source, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(buffers, "_POOL", buffers.BufferPool())  # no free slots left from earlier tests
    monkeypatch.setattr(buffers.mmap, "mmap", refuse)
    with pytest.raises(ResourceError) as info:
        colibri_core.load(source, history=False)
    assert "ulimit -v" in str(info.value) and "ram=" in str(info.value)
    code, lines = cli(capsys, monkeypatch, "run", "--model", source, "--token-ids", "1", "--max-tokens", "1")
    assert code == 3 and len(lines) == 1 and "--ram" in lines[0] and "ulimit -v" in lines[0]


# -- Ctrl-C -----------------------------------------------------------------------------
def test_ctrl_c_during_convert_exits_130_and_says_it_resumes(source, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real = fail_on_commit(monkeypatch, 2, KeyboardInterrupt())
    code, lines = cli(capsys, monkeypatch, "convert", "--model", source, "--out", out, "--experts", "int4")
    assert code == 130
    assert lines[-1].startswith("interrupted: ") and "resumes" in lines[-1] and str(out) in lines[-1]
    monkeypatch.setattr(convert_module.StreamWriter, "commit", real)
    assert convert(source, out, experts="int4").shards_resumed == 1
    assert tree_bytes(out) == tree_bytes(reference)


def test_an_interrupted_generation_keeps_the_statistics_of_its_tokens(source, monkeypatch):
    with colibri_core.load(source, history=False) as model:
        real = model.lm.forward
        calls = {"n": 0}

        def forward(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 5:  # the prefill, then 3 decode steps, then Ctrl-C
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(model.lm, "forward", forward)
        generation = model.stream(token_ids=[1, 2, 3], max_tokens=50, ignore_eos=True)
        seen = []
        with pytest.raises(KeyboardInterrupt):
            for event in generation:
                seen.append(event.token_id)
        result = generation.result()
    assert result.finish_reason == "interrupted" and result.token_ids == seen and len(seen) == 4
    assert result.stats.generated_tokens == 4 and result.stats.prompt_tokens == 3 and result.stats.ttft_s is not None


def test_ctrl_c_during_run_prints_the_statistics_so_far_and_exits_130(source):
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_DEBUG"}
    proc = subprocess.Popen([sys.executable, "-m", "colibri_core", "run", "--model", str(source), "--token-ids", "1,2,3",
                             "--max-tokens", "60000", "--ignore-eos", "--history", "off"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = proc.stdout.read(8)  # tokens are streaming
        assert first, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 130, err
    assert "statistics" in err and "decode" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted"
    generated = int(re.search(r"decode\s+(\d+) tokens", err).group(1))
    assert 0 < generated < 60000  # the tokens made before Ctrl-C


def test_a_ctrl_c_that_lands_in_a_finalizer_still_stops_the_generation(source):
    """Python drops a KeyboardInterrupt raised inside a finalizer ("Exception ignored"),
    and the expert buffers run finalizers on every eviction: with the command line's
    handler installed, the next step raises the Ctrl-C the finalizer swallowed."""
    import weakref

    from colibri_core import interrupts

    class Evicted:
        pass

    before = signal.getsignal(signal.SIGINT)
    interrupts.install()
    try:
        with colibri_core.load(source, history=False) as model:
            events = iter(model.stream(token_ids=[1, 2, 3], max_tokens=50, ignore_eos=True))
            next(events)
            gone = Evicted()
            weakref.finalize(gone, os.kill, os.getpid(), signal.SIGINT)  # the signal arrives inside the finalizer
            del gone
            with pytest.raises(KeyboardInterrupt):
                for _ in events:
                    pass
            # the next generation is not interrupted by the Ctrl-C already dealt with
            assert len(model.generate(token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True).token_ids) == 3
            # one swallowed before the generation began (while the model loaded) stops it at its first step
            interrupts._pending = True
            with pytest.raises(KeyboardInterrupt):
                model.generate(token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True)
    finally:
        signal.signal(signal.SIGINT, before)
        interrupts.clear()


def test_an_expert_buffer_runs_no_python_code_when_it_is_released():
    """Slots go back to the pool on every eviction; a Python finalizer there would be where
    a Ctrl-C lands and is dropped. Their release is a C call (list.append), and the next
    ``take`` hands the slot out again."""
    calls = []
    pool = buffers.BufferPool(chunk=1 << 16)
    a = pool.take(5000)
    address = a.ctypes.data
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        del a  # the last reference: the slot dies here (no cycle, no collection needed)
    finally:
        sys.setprofile(None)
    assert calls == [], calls
    assert pool.take(5000).ctypes.data == address

# -- converting a container into its own format -----------------------------------------
def test_converting_a_container_into_its_own_format_copies_it(reference, tmp_path):
    again = tmp_path / "again"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ColibriWarning)
        result = convert(reference, again, experts="int4")
    assert result.tensors_converted == 0
    assert any("already int4-gs64: copied unchanged" in str(w.message) for w in caught)
    shards = [p.name for p in reference.glob("*.safetensors")]
    assert all((again / s).read_bytes() == (reference / s).read_bytes() for s in shards)
    kept = tmp_path / "kept"
    convert(reference, kept, experts="keep")  # the quantised tensors keep their stamps
    with colibri_core.load(reference, history=False) as a, colibri_core.load(kept, history=False) as b:
        assert a.generate(token_ids=[1, 2], max_tokens=4).token_ids == b.generate(token_ids=[1, 2], max_tokens=4).token_ids
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ColibriWarning)
        convert(reference, tmp_path / "int8", experts="int8")
    assert any("requantised to int8-row" in str(w.message) for w in caught)
    assert json.loads((again / MANIFEST).read_text())["complete"]


# -- out of memory in the math libraries (OpenBLAS, OpenMP): exit 3, never their exit 1 ---------
VM_SIZE = '''
def vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
'''

LIMITED_AFTER_LOAD = VM_SIZE + '''
import resource, sys
import colibri_core.engine.api as api

slack, real_load = int(sys.argv[1]) << 20, api.load

def load(*args, **kwargs):  # the address space capped once the model holds its memory
    model = real_load(*args, **kwargs)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + slack, resource.RLIM_INFINITY))
    return model

api.load = load
from colibri_core.cli.main import main
main(sys.argv[2:])
'''


BLAS_AFTER_LOAD = VM_SIZE + '''
import resource, sys
import numpy.random  # the sampler imports it late: here, so that what runs out is BLAS's buffer
import colibri_core
from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.errors import out_of_memory

# a ulimit -v in place from the start, as a user's is (far above what loading takes)
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (64 << 30), resource.RLIM_INFINITY))
# no compiled kernels: every projection is a BLAS product
with colibri_core.load(sys.argv[1], backend=CpuBackend(kernels=False), history=False, preload=True) as model:
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (int(sys.argv[2]) << 20), resource.RLIM_INFINITY))
    try:
        model.generate(token_ids=[5 + i % 250 for i in range(200)], max_tokens=2)
    except Exception as exc:
        error = out_of_memory(exc)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
'''


@pytest.mark.parametrize("slack_mib", [1, 4, 16])
def test_openblas_out_of_address_space_after_loading_is_an_exception(source, tmp_path, slack_mib):
    """OpenBLAS maps its work buffer at its first product; after the weights took the
    address space that printed "OpenBLAS error: Memory allocation still failed after 10
    retries, giving up." and exited 1, from C. Started at load, it needs nothing more on
    one thread; its threaded products malloc a job table per call ("OpenBLAS: malloc
    failed in gemm_driver", exit 1, in 1 run of 3 here with 1 MiB left), so under a
    limit seen at load it runs on one thread."""
    script = tmp_path / "blas.py"
    script.write_text(BLAS_AFTER_LOAD)
    out = subprocess.run([sys.executable, str(script), str(source), str(slack_mib)], capture_output=True, text=True,
                         timeout=120)
    assert "OpenBLAS" not in out.stderr and out.returncode in (0, 3), out.stderr  # it may fit; never OpenBLAS's exit
    if out.returncode == 3:
        assert out.stderr.startswith("error: out of memory") and len(out.stderr.strip().splitlines()) == 1, out.stderr


BLAS_WITH_NOTHING_LEFT = VM_SIZE + '''
import resource, sys
import numpy as np
import colibri_core
from colibri_core.compute.cpu.backend import CpuBackend

resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (64 << 30), resource.RLIM_INFINITY))  # a ulimit -v
with colibri_core.load(sys.argv[1], backend=CpuBackend(kernels=False), history=False, preload=True) as model:
    a = np.ones((512, 512), dtype=np.float32)  # big enough for every BLAS thread
    out = np.empty_like(a)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (1 << 20), resource.RLIM_INFINITY))
    hog = []
    try:  # take the address space down to less than 16 KiB
        while True:
            hog.append(np.ones(16 << 10, np.uint8))
    except MemoryError:
        pass
    for _ in range(3):
        np.matmul(a, a, out=out)
    del hog
    print(float(out[0, 0]))
'''


def test_blas_products_after_a_limited_load_need_no_more_memory(source, tmp_path):
    """The race above made certain: once a load under an address-space limit is done, a
    BLAS product into a given array needs no new memory (threaded, OpenBLAS's job table
    made it exit 1 here every time)."""
    script = tmp_path / "nothing_left.py"
    script.write_text(BLAS_WITH_NOTHING_LEFT)
    out = subprocess.run([sys.executable, str(script), str(source)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "512.0", out.stderr


@pytest.mark.parametrize("slack_mib", [1, 4, 8])  # not 0: the stack could not grow, and a segfault proves nothing
def test_running_out_of_address_space_after_loading_is_exit_3(source, tmp_path, slack_mib):
    """Without the math libraries started at load, a matmul or a parallel region after the
    weights took the memory ended the process from C: OpenBLAS's "Memory allocation still
    failed ... giving up" or libgomp's "Thread creation failed", exit 1 (and a module
    imported late could not be mapped: exit 70)."""
    script = tmp_path / "limited.py"
    script.write_text(LIMITED_AFTER_LOAD)
    ids = ",".join(str(5 + i % 250) for i in range(60))
    out = subprocess.run([sys.executable, str(script), str(slack_mib), "run", "--model", str(source), "--token-ids",
                          ids, "--max-tokens", "2", "-q"], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert "OpenBLAS" not in out.stderr and "libgomp" not in out.stderr and "internal error" not in out.stderr, out.stderr
    assert out.returncode in (0, 3), out.stderr  # it may fit; what it must never do is die in C
    if out.returncode == 3:
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "memory" in lines[0], out.stderr
        assert "--ram" in lines[0] and "ram=" not in lines[0]


def test_a_limit_too_tight_for_the_math_libraries_is_a_resource_error(tmp_path):
    """Even the first use of OpenBLAS may not fit (the address space nearly full at load):
    it is tried in a forked child, and its failure is a ResourceError here."""
    script = tmp_path / "tight.py"
    script.write_text(VM_SIZE + '''
import resource, sys
import numpy as np
from colibri_core.engine import math_libraries
from colibri_core.errors import ResourceError
from colibri_core.engine.api import open_backend

backend, _ = open_backend("cpu")
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (48 << 20), resource.RLIM_INFINITY))
hog = []
try:
    while True:
        hog.append(np.ones(1 << 20, np.uint8))
except MemoryError:
    pass
try:
    math_libraries.reserve(backend)
except ResourceError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)
''')
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3 and "OpenBLAS error" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: out of memory: the address-space limit (") and "ulimit -v" in out.stderr


def test_memory_errors_the_machine_causes_are_resource_errors():
    from colibri_core.errors import out_of_memory

    assert isinstance(out_of_memory(MemoryError()), ResourceError)
    assert "thread" in str(out_of_memory(RuntimeError("can't start new thread")))
    mapped = out_of_memory(ImportError("/x/y.so: failed to map segment from shared object", name="numpy.random._generator"))
    assert mapped.exit_code == 3 and "numpy.random._generator" in str(mapped)
    assert out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory")) is not None
    assert out_of_memory(RuntimeError("something else")) is None and out_of_memory(OSError(errno.ENOENT, "x")) is None
