"""Every launch ``colibri_cuda.kernels`` makes, checked against the kernel's C signature
without a GPU: a stand-in ``cupy`` module (numpy arrays, recorded launches) replaces CuPy,
each ``CudaKernels`` method runs once per layout, and each launch must name a kernel of
its source, pass as many arguments as the kernel takes, each of the C type's kind (a
device array of the pointer's element type, or a null pointer where the kernel accepts
one; int32 for int; float32 for float), a block within the kernel's launch bounds and a
grid that is not empty. Argument order and type mistakes are the bugs a first GPU run
would otherwise find by crashing or by computing garbage."""

import importlib
import re
import sys
import types

import numpy as np
import pytest

from colibri_core.testing.backend_kit import pack
from colibri_cuda import geometry, layouts
from colibri_cuda.sources import kernel_files, source

POINTER_DTYPES = {"float": {np.float32}, "u64": {np.uint64}, "u8": None}  # None: any bytes
NULLABLE = {"scales", "weight", "bias"}  # parameters the kernels test for null


def signatures() -> dict[str, tuple[list[tuple[str, str]], int | None]]:
    """kernel name -> ([(C type, parameter name)], launch bound or None), from the sources,
    macro-made kernels expanded for each instantiation."""
    found = {}
    for path in kernel_files():
        text = source(path.name).replace("\\\n", " ")
        defines = dict(re.findall(r"^#define (\w+) (\d+)\s*$", text, re.M))
        pattern = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\(([^)]*)\)\s*)?(\w+?)(##name)?\s*\(([^)]*)\)')
        for bound, name, macro, params in pattern.findall(text):
            args = []
            for param in params.split(","):
                words = param.replace("*", " * ").split()
                args.append((" ".join(w for w in words[:-1] if w != "const"), words[-1]))
            limit = eval(bound, {}, {k: int(v) for k, v in defines.items()}) if bound else None  # noqa: S307 (our own #defines)
            if macro:
                macro_name = re.search(rf"#define (\w+)\(name, \w+\)[^\n]*{re.escape(name)}##name", text).group(1)
                for suffix in re.findall(rf"^{macro_name}\((\w+),", text, re.M):
                    found[name + suffix] = (args, limit)
            else:
                found[name] = (args, limit)
    return found


SIGNATURES = signatures()


def test_the_signatures_are_read():
    assert {"gemv_q4", "dequantize_fp8", "experts_gate_up_mxfp4", "experts_down_bf16", "attention_split",
            "attention_combine", "rope_half", "rope_interleaved", "rms_norm", "layer_norm", "softmax_top_k",
            "gated_delta_step"} <= set(SIGNATURES)
    assert SIGNATURES["gemv_q4"][0][0] == ("u8 *", "data") and SIGNATURES["gemv_q4"][1] == 128
    assert SIGNATURES["rms_norm"][0][-1] == ("float", "eps") and SIGNATURES["rms_norm"][1] == geometry.NORM_THREADS


class Launch:
    def __init__(self, name, grid, block, args):
        self.name, self.grid, self.block, self.args = name, grid, block, args


class FakeCupy(types.ModuleType):
    """As much of CuPy as colibri_cuda.kernels uses; arrays are numpy arrays."""

    float32, uint8, uint64 = np.float32, np.uint8, np.uint64

    def __init__(self):
        super().__init__("cupy")
        self.launches: list[Launch] = []
        fake = self

        class RawModule:
            def __init__(self, code, options=()):
                assert "#include" not in code
                self.code = code

            def get_function(self, name):
                assert re.search(rf"\b{name}\b|{name[: name.rfind('_') + 1]}##name", self.code), name

                def launch(grid, block, args):
                    fake.launches.append(Launch(name, grid, block, args))

                return launch

        self.RawModule = RawModule

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def empty_like(a):
        return np.empty_like(a)

    @staticmethod
    def asarray(a):
        return np.array(a, copy=True)


@pytest.fixture
def fake(monkeypatch):
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    import colibri_cuda.kernels

    module = importlib.reload(colibri_cuda.kernels)
    yield cupy, module
    module.module.cache_clear()
    module.kernel.cache_clear()
    monkeypatch.delitem(sys.modules, "cupy")
    sys.modules.pop("colibri_cuda.kernels", None)


def check(launch: Launch):
    assert launch.name in SIGNATURES, f"{launch.name}: no such kernel"
    params, bound = SIGNATURES[launch.name]
    assert len(launch.args) == len(params), f"{launch.name}: {len(launch.args)} arguments for {len(params)} parameters"
    for (ctype, pname), arg in zip(params, launch.args):
        where = f"{launch.name}({pname})"
        if ctype.endswith("*"):
            if isinstance(arg, np.uint64):
                assert arg == 0 and pname in NULLABLE, f"{where}: a null pointer where the kernel needs an array"
                continue
            assert isinstance(arg, np.ndarray), f"{where}: {type(arg).__name__}, not a device array"
            wanted = POINTER_DTYPES[ctype[:-1].strip()]
            if wanted is not None and pname != "scales":  # scales may be exponent bytes (mxfp4)
                assert arg.dtype.type in wanted, f"{where}: {arg.dtype} array for {ctype}"
            if pname in ("k", "v"):  # the KV cache's views: rows contiguous, heads apart
                assert geometry.rows_contiguous(arg.shape, arg.strides, arg.itemsize), f"{where}: rows not contiguous"
            else:
                assert arg.flags.c_contiguous, f"{where}: not contiguous"
        elif ctype == "int":
            assert isinstance(arg, np.int32), f"{where}: {type(arg).__name__}, not int32"
        elif ctype == "long long":
            assert isinstance(arg, np.int64), f"{where}: {type(arg).__name__}, not int64"
        elif ctype == "float":
            assert isinstance(arg, np.float32), f"{where}: {type(arg).__name__}, not float32"
        else:
            raise AssertionError(f"{where}: unexpected C type {ctype}")
    assert len(launch.grid) == 3 and all(isinstance(g, int) and g >= 1 for g in launch.grid), launch.grid
    assert len(launch.block) == 3 and all(isinstance(b, int) and b >= 1 for b in launch.block), launch.block
    threads = launch.block[0] * launch.block[1] * launch.block[2]
    assert threads % 32 == 0 and threads <= (bound or 1024), f"{launch.name}: {threads} threads, bound {bound}"


class Device:
    multiprocessors = 132

    @staticmethod
    def pointer(a):
        return a.__array_interface__["data"][0]


def prepared(kind, shape, rng):
    w = rng.standard_normal(shape).astype(np.float32)
    if kind == "f32":
        return w
    p = layouts.host_pack(pack(kind, w))
    return layouts.PackedWeight(p.kind, p.shape, p.data, p.scales, p.p0, p.p1)


@pytest.mark.parametrize("kind", ["f32", *layouts.KINDS])
def test_product_and_expert_launches(fake, kind):
    cupy, module = fake
    kernels = module.CudaKernels(Device())
    rng = np.random.default_rng(0)
    w = prepared(kind, (40, 130), rng)
    if kind != "f32":
        y = kernels.gemv(w, rng.standard_normal((11, 130)).astype(np.float32))
        assert y.shape == (11, 40) and y.dtype == np.float32
        assert [launch.args[-1] for launch in cupy.launches] == [np.int32(8), np.int32(3)]  # token slices
        assert kernels.dequantize(w).shape == (40, 130)
    experts = [{"gate": prepared(kind, (24, 96), rng), "up": prepared(kind, (24, 96), rng),
                "down": prepared(kind, (96, 24), rng)} for _ in range(3)]
    out = np.zeros((1, 96), np.float32)
    kernels.experts_token(rng.standard_normal((1, 96)).astype(np.float32), experts, np.ones(3, np.float32), out)
    gate_up, down = cupy.launches[-2:]
    assert gate_up.grid[1] == 3 and gate_up.args[0].dtype == np.uint64 and gate_up.args[0].shape == (18,)
    # the gate_up table: gate data, gate scales, up data, up scales; down's: data, scales
    table = gate_up.args[0]
    assert table[0] == Device.pointer(layouts_data(experts[0]["gate"]))
    assert table[6] == Device.pointer(layouts_data(experts[0]["up"]))
    assert down.args[0][0] == Device.pointer(layouts_data(experts[0]["down"]))
    for launch in cupy.launches:
        check(launch)


def layouts_data(w):
    return w.data if isinstance(w, layouts.PackedWeight) else w


def test_attention_rope_norm_and_router_launches(fake):
    cupy, module = fake
    kernels = module.CudaKernels(Device())
    rng = np.random.default_rng(1)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    cache_k, cache_v = f(2, 4096, 64), f(2, 4096, 32)  # a KV cache of capacity 4096 holding 3000 positions
    assert kernels.attention(f(2, 8, 64), cache_k[:, :3000], cache_v[:, :3000], 2998, 0.125).shape == (2, 8, 32)
    for interleaved in (False, True):
        assert kernels.rope(f(3, 4, 64), f(3, 32), f(3, 32), 32, interleaved).shape == (3, 4, 64)
    assert kernels.rms_norm(f(5, 100), f(100), 1e-6).shape == (5, 100)
    assert kernels.rms_norm(f(5, 100), None, 1e-6).shape == (5, 100)
    assert kernels.layer_norm(f(5, 100), None, f(100), 1e-5).shape == (5, 100)
    assert kernels.softmax_top_k(f(4, 64), 8, True).shape == (4, 2, 8)
    state = f(8, 32, 48)
    out, new_state = kernels.gated_delta_step(f(3, 2, 32), f(3, 2, 32), f(3, 8, 48), f(3, 8), f(3, 8), state)
    assert out.shape == (3, 8, 48) and new_state.shape == state.shape and new_state is not state
    names = [launch.name for launch in cupy.launches]
    assert names == ["attention_split", "attention_combine", "rope_half", "rope_interleaved", "rms_norm", "rms_norm",
                     "layer_norm", "softmax_top_k", "gated_delta_step"]
    split = cupy.launches[0]
    assert split.grid[1:] == (8, 2) and split.grid[0] * split.args[-4] >= 3000  # splits x chunk cover the keys
    assert split.args[-2:] == (4096 * 64, 4096 * 32)  # head strides of the cache, in floats
    for launch in cupy.launches:
        check(launch)


def test_a_wrong_launch_fails_the_check():
    params, _ = SIGNATURES["rms_norm"]
    x = np.zeros((2, 4), np.float32)
    good = Launch("rms_norm", (2, 1, 1), (256, 1, 1), (x, x[0], x, np.int32(4), np.float32(1e-6)))
    check(good)
    for bad in (Launch("rms_norm", (2, 1, 1), (256, 1, 1), (x, x[0], x, 4, np.float32(1e-6))),  # a Python int
                Launch("rms_norm", (2, 1, 1), (256, 1, 1), (x, x[0], x, np.float32(1e-6), np.int32(4))),  # swapped
                Launch("rms_norm", (2, 1, 1), (512, 1, 1), (x, x[0], x, np.int32(4), np.float32(1e-6))),  # too many threads
                Launch("rms_norm", (2, 1, 1), (256, 1, 1), (x.astype(np.float64), x[0], x, np.int32(4), np.float32(1))),
                Launch("rms_norm", (2, 1, 1), (256, 1, 1), (np.uint64(0), x[0], x, np.int32(4), np.float32(1)))):
        with pytest.raises(AssertionError):
            check(bad)
