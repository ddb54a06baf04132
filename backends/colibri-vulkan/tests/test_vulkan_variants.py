"""The products' device-feature variants: each weight kind's shader chosen from what the
device reports (subgroup operations, 8/16-bit storage), the plain shader where it lacks
them or under COLIBRI_VULKAN_PLAIN=1; the subgroup shaders right for any rows per workgroup
(what a device whose subgroups differ from the reported size gets); and the conformance
kit's products passing on the plain path too, in a child process held to it."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_vulkan import probe
from colibri_vulkan.device import ENV_PLAIN, PRODUCT_KINDS, Features, product_program
from colibri_vulkan.shaders import build

REASON = probe.unavailable_reason()
needs_vulkan = pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}")
ALL_OPS = frozenset({"basic", "vote", "arithmetic", "ballot", "shuffle"})


def test_variant_choice_follows_the_features():
    full = Features(api=(1, 3), subgroup_size=32, subgroup_ops=ALL_OPS, storage8=True, storage16=True)
    assert {k: product_program(k, full) for k in PRODUCT_KINDS} == {
        "f32": "linear_f32_subgroup", "bf16": "linear_bf16_subgroup_16bit", "q8": "linear_q8_subgroup_8bit",
        "q4": "linear_q4_subgroup_8bit", "mxfp4": "linear_mxfp4_subgroup_8bit", "fp8": "linear_fp8_subgroup_8bit"}
    only8 = Features(api=(1, 2), subgroup_size=64, subgroup_ops=ALL_OPS, storage8=True)
    assert product_program("bf16", only8) == "linear_bf16_subgroup" and product_program("q4", only8).endswith("_8bit")
    words = Features(api=(1, 1), subgroup_size=16, subgroup_ops=frozenset({"basic", "arithmetic"}))
    assert {product_program(k, words) for k in PRODUCT_KINDS} == {f"linear_{k}_subgroup" for k in PRODUCT_KINDS}
    for lacking in (Features(api=(1, 0), subgroup_size=32, subgroup_ops=ALL_OPS, storage8=True),  # Vulkan 1.0
                    Features(api=(1, 3), subgroup_size=32, subgroup_ops=frozenset({"basic", "vote"}), storage8=True),
                    Features(api=(1, 3), subgroup_size=0, subgroup_ops=ALL_OPS),
                    Features(api=(1, 3), subgroup_size=256, subgroup_ops=ALL_OPS, max_workgroup=128)):
        assert {product_program(k, lacking) for k in PRODUCT_KINDS} == {f"linear_{k}" for k in PRODUCT_KINDS}, lacking
    assert {product_program(k, full, plain=True) for k in PRODUCT_KINDS} == {f"linear_{k}" for k in PRODUCT_KINDS}
    # every program the choice can name is compiled (and so in the SPIR-V check)
    names = {product_program(k, f, plain) for k in PRODUCT_KINDS for f in (full, only8, words) for plain in (0, 1)}
    assert names <= set(build.PROGRAMS)
    assert not {n for n in build.PROGRAMS if n.startswith("linear_")} - names


def test_plain_environment(monkeypatch):
    from colibri_vulkan.device import plain_requested

    for value, plain in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(ENV_PLAIN, value)
        assert plain_requested() is plain


def _packed(backend, kind, shape, rng):
    from colibri_core.testing.backend_kit import dequantize, host_form, pack

    w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    if kind == "f32":
        return backend.prepare_weight(w), w
    packed = pack(kind, w)
    return backend.prepare_weight(host_form(backend, packed, "linear")), dequantize(packed)


@needs_vulkan
def test_products_run_the_variant_the_features_choose():
    from colibri_vulkan.backend import VulkanBackend
    from colibri_vulkan.device import plain_requested

    backend = VulkanBackend()
    ctx = backend.ctx
    assert ctx.plain is plain_requested()
    assert backend.product_programs == {k: product_program(k, ctx.features, ctx.plain) for k in PRODUCT_KINDS}
    if ctx.features.subgroups and not ctx.plain:  # lavapipe 22.3.6 has them all
        assert all("_subgroup" in p for p in backend.product_programs.values())
    rng = np.random.default_rng(1)
    for kind in PRODUCT_KINDS:
        w, truth = _packed(backend, kind, (24, 160), rng)
        x = rng.standard_normal((2, 160)).astype(np.float32)
        got = backend.to_host(backend.linear(backend.asarray(x), w))
        np.testing.assert_allclose(got, x @ truth.T, rtol=0, atol=2e-5 * np.abs(x @ truth.T).max())
        assert backend.product_programs[kind] in ctx.pipelines  # it ran
    assert kind in ctx.describe_products() and ctx.features.describe().startswith("Vulkan ")


@needs_vulkan
@pytest.mark.parametrize("rows_per_group", [1, 3, 20])
def test_subgroup_products_cover_any_rows_per_group(rows_per_group, monkeypatch):
    """A workgroup's subgroups take its rows one after another: fewer rows than subgroups,
    more, and one each all give every row once."""
    from colibri_vulkan.backend import VulkanBackend

    backend = VulkanBackend()
    if "_subgroup" not in backend.product_programs["q4"]:
        pytest.skip(f"no subgroup products on this device or path: {backend.ctx.describe_products()}")
    monkeypatch.setattr(backend.ctx, "rows_per_group", rows_per_group)
    rng = np.random.default_rng(rows_per_group)
    for kind in ("q4", "bf16", "f32"):
        w, truth = _packed(backend, kind, (45, 200), rng)
        x = rng.standard_normal((11, 200)).astype(np.float32)  # two tiles of tokens, one partial
        b = rng.standard_normal(45).astype(np.float32)
        got = backend.to_host(backend.linear(backend.asarray(x), w, backend.asarray(b)))
        want = x @ truth.T + b
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@needs_vulkan
def test_more_rows_than_workgroups_in_one_dimension():
    """Past 65535 workgroups, each takes more rows (the x dimension's limit)."""
    from colibri_vulkan.backend import VulkanBackend

    backend = VulkanBackend()
    rng = np.random.default_rng(2)
    n = 65535 * backend.ctx.rows_per_group + 5
    w = rng.standard_normal((n, 4)).astype(np.float32)
    x = rng.standard_normal((1, 4)).astype(np.float32)
    got = backend.to_host(backend.linear(backend.asarray(x), backend.prepare_weight(w)))
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)


@needs_vulkan
def test_the_plain_path_passes_the_kits_products():
    """COLIBRI_VULKAN_PLAIN=1 holds a child process to the plain shaders; the conformance
    kit's products (and this file's device tests) pass there too."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, ENV_PLAIN: "1"}
    selection = "linear or swiglu or routed or embedding or variant or rows_per_group or workgroups"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(here / "test_vulkan_conformance.py"), __file__, "-k",
                          f"({selection}) and not plain_path"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" in run.stdout, run.stdout[-500:]  # rows_per_group: no subgroups
