"""Backend-aware tiers: a device tier of prepared experts fed from the RAM tier, per-tier
placement and statistics, --backend / --vram, and the plan per tier.

The device is a test backend: the numpy reference whose ``device_memory()`` says it has
memory of its own and whose prepared linear weights are recognisable copies, so the
tests see which tier holds which form and that experts are computed only prepared."""

import json
import shutil

import numpy as np
import pytest

import colibri_core
from colibri_core import hookimpl
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.errors import BudgetError, PluginError, UsageError
from colibri_core.experts.tiers import DeviceTier
from colibri_core.formats.base import QuantTensor
from colibri_core.model.blueprint import inspect_model
from colibri_core.plugins.discovery import register_plugin
from colibri_core.plugins.registry import BackendSpec, TierSpec

from colibri_core.testing.cli import run_colibri
from toy_family import ToyPlugin, write_toy_model

LAYERS, EXPERTS, TOP_K = 2, 8, 2
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


class Prepared(np.ndarray):
    """A linear weight as the test device holds it."""


class VramBackend(ReferenceBackend):
    name = "testvram"
    memory = 1 << 30

    def __init__(self):
        super().__init__()
        self.prepared = 0  # linear weights prepared (uploads)

    def device_memory(self):
        return self.memory

    def prepare_weight(self, w, use="linear"):
        host = super().prepare_weight(w, use)
        if use != "linear":
            return host.copy()
        self.prepared += 1
        return host.copy().view(Prepared)

    def linear(self, x, weight, bias=None):
        return super().linear(x, np.asarray(weight), bias)

    def swiglu_expert(self, x, gate, up, down):
        assert all(type(m) is Prepared for m in (gate, up, down)), "an expert was computed unprepared"
        return super().swiglu_expert(x, gate, up, down)


class UnifiedBackend(VramBackend):
    name = "testunified"
    unified_memory = True


class CountingDeviceTier(DeviceTier):
    """A backend's own device tier: the generic one, counting what reaches it."""

    created = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountingDeviceTier.created += 1


class OwnTierBackend(VramBackend):
    name = "testowntier"
    device_tier = CountingDeviceTier


class TestBackends:
    @hookimpl
    def colibri_register_backends(self, register):
        for cls in (VramBackend, UnifiedBackend, OwnTierBackend):
            register(BackendSpec(cls.name, f"{__name__}:{cls.__name__}", description="test device"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_toy_model(tmp_path_factory.mktemp("tiers") / "model", layers=LAYERS, experts=EXPERTS, top_k=TOP_K)


@pytest.fixture
def model_dir(base, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    register_plugin(ToyPlugin(), "toy")
    register_plugin(TestBackends(), "test-backends")
    d = tmp_path / "model"
    shutil.copytree(base, d)
    return d


def expert_sizes(model_dir, backend="testvram"):
    """(bytes of one expert in RAM, on the device, dense bytes)."""
    bp = inspect_model(model_dir, backend)
    try:
        return bp.expert_ram_bytes, bp.expert_bytes, bp.dense_bytes
    finally:
        bp.close()


def counted_generate(model, max_tokens=12, **kwargs):
    """Generate, counting the store's lookups independently of its statistics."""
    store, calls = model.store, [0]
    get = store.get

    def counting(layer, expert):
        calls[0] += 1
        return get(layer, expert)

    store.get = counting
    try:
        result = model.generate(token_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True, return_logits=True, **kwargs)
    finally:
        del store.get
    return result, calls[0]


def held_arrays(tier):
    for table in tier._pinned + tier._lru:
        for weights in table.values():
            yield from weights.arrays.values()


# -- the device tier ------------------------------------------------------------------
def test_the_device_tier_is_consulted_first_fed_from_ram_and_holds_within_vram(model_dir):
    _, device_bytes, _ = expert_sizes(model_dir)
    vram = 2 * LAYERS * device_bytes  # two experts per layer
    with colibri_core.load(model_dir, backend="testvram", vram=vram, history=False) as model:
        store, device = model.store, model.store.device
        assert device.slots == 2 and model.placement.slots == EXPERTS  # RAM holds every expert
        fed = []
        put = device.put

        def checked_put(layer, expert, weights):
            fed.append(weights is store.ram.lookup(layer, expert))  # the RAM tier's own copy
            return put(layer, expert, weights)

        device.put = checked_put
        result, lookups = counted_generate(model)
        s = result.stats
        assert fed and all(fed)
        assert s.hits_device > 0 and device.evictions > 0  # LRU: holds 2 per layer, evicts the oldest
        assert all(len(lru) <= 2 for lru in device._lru)
        assert device.resident_bytes <= vram and s.device_resident_bytes == model.placement.dense_bytes + device.resident_bytes
        device_misses = lookups - s.hits_device
        assert device_misses == len(fed) and s.hits_ram > 0
        # every device miss was served by RAM or a disk read into RAM; the disk read each expert once
        assert s.hits_ram + s.misses == device_misses and store.disk.loads == s.misses <= LAYERS * EXPERTS
        assert s.hits_device + s.hits_ram + s.hits_prefetched + s.misses == lookups
        assert s.expert_hits == s.hits_device + s.hits_ram and s.expert_misses == s.misses
        # RAM holds host forms only; the device, prepared forms only
        assert all(type(a) is np.ndarray or isinstance(a, QuantTensor) for a in held_arrays(store.ram))
        assert all(type(a) is Prepared for a in held_arrays(device))
        assert s.resident_bytes == model.placement.dense_bytes + store.ram.resident_bytes + device.resident_bytes


def test_the_device_tier_pins_the_hottest_and_ram_the_next(model_dir):
    _, device_bytes, _ = expert_sizes(model_dir)
    with colibri_core.load(model_dir, backend="testvram", vram=4 * device_bytes, cap=4, pin="on",
                           history=True) as model:
        store, device = model.store, model.store.device
        assert device.pinned_capacity == 2 and store.ram.pinned_capacity == 4
        history = store.history
        history.counts[:] = 0
        for rank, le in enumerate([(0, 5), (1, 2), (0, 1), (1, 7), (0, 3), (1, 0)]):
            history.counts[le] = 100 - rank
        for tier in (device, store.ram):
            for le in tier.pinned_set():
                tier.unpin(*le)
        store.apply_pins()
        assert device.pinned_set() == {(0, 5), (1, 2)}  # the hottest, prepared
        assert store.ram.pinned_set() == {(0, 1), (1, 7), (0, 3), (1, 0)}  # the next ones, host forms
        assert all(type(a) is Prepared for a in held_arrays(device))
        history.counts[1, 7] = 200  # now the hottest by far: it moves up to the device
        assert store.repin() >= 1
        assert (1, 7) in device.pinned_set() and (1, 7) not in store.ram.pinned_set()
        assert not device.pinned_set() & store.ram.pinned_set()
        result, lookups = counted_generate(model, max_tokens=6)
        assert result.stats.pinned_experts == 6
        assert result.stats.hits_device + result.stats.hits_ram + result.stats.hits_prefetched + result.stats.misses == lookups


def test_tokens_and_logits_are_identical_across_vram_ram_and_prefetch(model_dir):
    ram_bytes, device_bytes, dense = expert_sizes(model_dir)
    vrams = {"all": None, "quarter": LAYERS * (EXPERTS // 4) * device_bytes, "none": 0}
    reference = None
    for vname, vram in vrams.items():
        for rname, prefetch in (("all", False), ("all", True), ("small", False), ("small", True)):
            # small: the layer's window and one expert per layer (a read ahead borrows it)
            ram = None if rname == "all" else (TOP_K + LAYERS) * ram_bytes
            result, reference = check_run(model_dir, vname, vram, rname, ram, prefetch, reference)


def check_run(model_dir, vname, vram, rname, ram, prefetch, reference):
    with colibri_core.load(model_dir, backend="testvram", vram=vram, ram=ram, prefetch=prefetch, history=False) as model:
        result, lookups = counted_generate(model)
        slots, ram_slots = model.store.device.slots, model.placement.slots
    label = f"vram={vname} ram={rname} prefetch={prefetch}"
    s = result.stats
    assert slots == {"all": EXPERTS, "quarter": EXPERTS // 4, "none": 0}[vname], label
    assert ram_slots == (EXPERTS if rname == "all" else 1), label
    assert (s.hits_device > 0) == (vname != "none"), label
    assert s.hits_device + s.hits_ram + s.hits_prefetched + s.misses == lookups, label
    if reference is None:
        return result, result
    assert result.token_ids == reference.token_ids, label
    for a, b in zip(result.logits, reference.logits):
        assert np.array_equal(a, b), label
    return result, reference


def test_no_device_tier_gives_the_same_tokens(model_dir):
    with colibri_core.load(model_dir, backend="testvram", history=False) as model:
        reference = model.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True)
    with colibri_core.load(model_dir, backend="cpu", history=False) as model:  # no device tier: the same numbers
        cpu = model.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True)
    assert cpu.token_ids == reference.token_ids


def test_unified_memory_keeps_both_tiers_within_the_ram_budget(model_dir):
    ram_bytes, device_bytes, dense = expert_sizes(model_dir, "testunified")
    window = TOP_K * ram_bytes
    ram = dense + window + 3 * LAYERS * ram_bytes + 2 * LAYERS * device_bytes  # 3 per layer in RAM + 2 on the device
    with colibri_core.load(model_dir, backend="testunified", ram=ram, vram=2 * LAYERS * device_bytes, history=False) as model:
        p = model.placement
        assert p.unified and p.dense_in == "device" and p.device.slots == 2 and p.slots == 3
        assert dense + window + sum(t.cache_bytes(LAYERS) for t in p.tiers) <= ram
        result, _ = counted_generate(model)
        assert result.stats.hits_device > 0
        assert result.stats.resident_bytes + window <= ram
    with colibri_core.load(model_dir, backend="testunified", ram=ram, history=False) as model:
        p = model.placement  # default: the device tier gets the experts' whole part
        assert p.device.slots == 5 and p.slots == 0
        assert dense + window + sum(t.cache_bytes(LAYERS) for t in p.tiers) <= ram
    with pytest.raises(BudgetError, match=r"\(vram=\)"):
        colibri_core.load(model_dir, backend="testunified", ram=ram, vram=ram, history=False)


def test_the_cpu_keeps_one_form_and_reuses_what_it_derived(model_dir):
    with colibri_core.load(model_dir, history=False) as model:
        store = model.store
        assert store.device is None and model.placement.device is None and model.placement.dense_in == "ram"
        first = store.get(0, 1)
        first.derived["probe"] = True
        assert store.get(0, 1) is first  # no re-preparing per lookup: derived kernel arguments stay
        assert first.prepared(model.backend) is first
        result = model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True)
        assert result.stats.hits_device == 0 and result.stats.device_resident_bytes == 0


def test_a_backend_may_bring_its_own_device_tier(model_dir):
    CountingDeviceTier.created = 0
    with colibri_core.load(model_dir, backend="testowntier", history=False) as model:
        assert type(model.store.device) is CountingDeviceTier and CountingDeviceTier.created == 1
        assert model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True).stats.hits_device > 0


def test_tiers_are_found_by_role_and_a_plugin_replaces_the_core_one(model_dir):
    from colibri_core.plugins.discovery import get_registry

    registry = get_registry()
    assert {role: registry.tier(role).spec.name for role in ("disk", "ram", "device")} == \
        {"disk": "disk", "ram": "ram", "device": "device"}

    class FasterRam:
        @hookimpl
        def colibri_register_tiers(self, register):
            register(TierSpec("big-ram", "colibri_core.experts.tiers:RamTier", "test", role="ram"))

    register_plugin(FasterRam(), "faster-ram")
    assert get_registry().tier("ram").spec.name == "big-ram"

    class OtherRam(FasterRam):
        @hookimpl
        def colibri_register_tiers(self, register):
            register(TierSpec("other-ram", "colibri_core.experts.tiers:RamTier", "test", role="ram"))

    register_plugin(OtherRam(), "other-ram")
    with pytest.raises(PluginError, match="role 'ram'"):
        get_registry().tier("ram")
    with pytest.raises(PluginError, match="role"):
        TierSpec("odd", "x:y", role="tape")


# -- statistics and the command line -----------------------------------------------------
def run_in_process(capsys, *args):
    from colibri_core.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main([*map(str, args)])
        raise SystemExit(0)
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out, out.err


def test_run_json_reports_the_tiers(model_dir, capsys):
    code, out, err = run_in_process(capsys, "run", "--model", model_dir, "--token-ids", "3,1,4", "--max-tokens", "6",
                                    "--ignore-eos", "--json", "--backend", "testvram", "--vram", "1K", "--history", "off")
    assert code == 0, err
    s = json.loads(out)["stats"]
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_s", "hit_rate", "bytes_read", "resident_bytes", "hits_device",
                "hits_ram", "misses", "host_syncs_per_token", "device_resident_bytes"):
        assert key in s, key
    assert s["hits_ram"] == s["hits_pinned"] + s["hits_lru"] and s["misses"] == s["expert_misses"]
    # the reference computes on the host: one sync per forward pass, for the logits
    assert s["host_syncs_per_token"] == 1.0 and s["host_syncs"] == 6
    assert s["device_cache_slots"] == 0  # 1K holds no expert: every lookup prepares afresh


def test_plan_shows_the_placement_per_tier(model_dir, capsys):
    _, device_bytes, dense = expert_sizes(model_dir)
    vram = LAYERS * 2 * device_bytes
    code, out, err = run_in_process(capsys, "plan", "--model", model_dir, "--backend", "testvram", "--vram", vram,
                                    "--disk-bw", "1G", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["backend"] == "testvram" and d["dense_in"] == "device" and d["device_memory"] == VramBackend.memory
    assert [t["role"] for t in d["tiers"]] == ["device", "ram", "disk"]
    device, ram, disk = d["tiers"]
    assert device["slots_per_layer"] == 2 and device["budget"] == vram and d["vram_budget_source"] == "--vram"
    # after warm-up (uniform routing, no history): the device tier's share is its slots, the RAM tier the rest
    assert device["steady_hit_rate"] == pytest.approx(2 / EXPERTS)
    assert ram["steady_hit_rate"] == pytest.approx(1 - 2 / EXPERTS) and disk["steady_hit_rate"] == pytest.approx(0)
    assert d["steady_hit_rate"] == pytest.approx(1.0) and "upload" in d["seconds_per_token"]
    # a run from empty caches: every tier's first lookups miss, so the disk serves some of them
    assert 0 < device["projected_hit_rate"] <= 2 / EXPERTS and disk["projected_hit_rate"] > 0
    assert sum(t["projected_hit_rate"] for t in d["tiers"]) == pytest.approx(1.0)
    assert d["projected_hit_rate"] == pytest.approx(1 - disk["projected_hit_rate"])
    with colibri_core.load(model_dir, backend="testvram", vram=vram, history=False) as model:
        assert model.placement.device.slots == 2 and model.placement.slots == ram["slots_per_layer"]
    code, out, err = run_in_process(capsys, "plan", "--model", model_dir, "--backend", "testunified", "--disk-bw", "1G")
    assert code == 0, err
    assert "device tier" in out and "ram tier" in out and "unified with RAM" in out


@pytest.mark.parametrize("args, message", [
    (["--backend", "nope"], "error: no backend named 'nope' is installed (installed: cpu"),
    (["--vram", "1G"], "error: --vram: backend 'cpu' has no device memory"),
    (["--backend", "cpu", "--vram", "lots"], "error: cannot read size 'lots'"),
])
@pytest.mark.parametrize("command", ["run", "plan", "bench", "demo"])
def test_a_bad_backend_or_vram_is_one_line_before_anything_loads(tmp_path, command, args, message):
    missing = tmp_path / "never-read"
    extra = {"run": ["--model", missing, "--token-ids", "1"], "plan": ["--model", missing], "bench": ["--model", missing],
             "demo": ["--size", "full", "--dir", missing]}[command]
    out = run_colibri(command, *extra, *args)
    assert out.returncode == 2 and out.stderr.startswith(message) and len(out.stderr.splitlines()) == 1, out.stderr
    assert not missing.exists()  # nothing was built or read


def test_vram_without_device_memory_is_refused_by_the_api(model_dir):
    with pytest.raises(UsageError, match="no device memory"):
        colibri_core.load(model_dir, vram="1G")
    with pytest.raises(UsageError, match="no backend named"):
        colibri_core.load(model_dir, backend="nope")
