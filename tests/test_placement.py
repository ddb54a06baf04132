import pytest

from colibri_core.errors import BudgetError, UsageError
from colibri_core.model.placement import plan
from colibri_core.units import format_bytes, parse_size


def test_parse_size():
    assert parse_size("2G") == 2 << 30
    assert parse_size("512m") == 512 << 20
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_size("1000") == 1000
    assert format_bytes(1536) == "1.5 KiB"
    with pytest.raises(UsageError, match="lots"):
        parse_size("lots")


def test_budget_left_after_dense_weights_becomes_expert_slots():
    p = plan(dense_bytes=1000, expert_bytes=100, moe_layers=4, experts_per_layer=64, ram=1000 + 100 + 4 * 100 * 10 + 50,
             cap=None)
    assert p.slots == 10 and not p.all_resident  # one expert computing lives beyond the cache
    read_ahead = plan(dense_bytes=1000, expert_bytes=100, moe_layers=4, experts_per_layer=64, ram=1000 + 800 + 4000,
                      cap=None, io_window=8)
    assert read_ahead.slots == 10 and read_ahead.io_window == 8  # a layer's 8 misses read at once
    assert plan(dense_bytes=1000, expert_bytes=100, moe_layers=4, experts_per_layer=8, ram=10**9, cap=None).slots == 8
    assert plan(dense_bytes=1000, expert_bytes=100, moe_layers=4, experts_per_layer=8, ram=10**9, cap=3).slots == 3


def test_pinning_takes_a_share_and_cap_limits_the_whole_expert_budget():
    p = plan(dense_bytes=0, expert_bytes=10, moe_layers=4, experts_per_layer=16, ram=10 * 41, cap=None, pin_share=0.5)
    assert p.pinned == 20 and p.slots == 5 and p.expert_cache_bytes == 400
    capped = plan(dense_bytes=0, expert_bytes=10, moe_layers=4, experts_per_layer=16, ram=10**6, cap=2, pin_share=0.5)
    assert capped.pinned == 4 and capped.slots == 1  # cap 2 per layer = 8 experts in all
    everything = plan(dense_bytes=0, expert_bytes=10, moe_layers=4, experts_per_layer=16, ram=10**6, cap=None, pin_share=0.5)
    assert everything.pinned == 0 and everything.all_resident  # nothing to choose when all fit


def test_prefetch_reserves_nothing_its_reads_borrow_the_caches_slots():
    ram = 100 + 10 + 80  # dense, one expert being read, 4 slots in each of 2 layers
    with_prefetch = plan(dense_bytes=100, expert_bytes=10, moe_layers=2, experts_per_layer=8, ram=ram, cap=None,
                         prefetch_slots=2)
    without = plan(dense_bytes=100, expert_bytes=10, moe_layers=2, experts_per_layer=8, ram=ram, cap=None)
    assert with_prefetch.prefetch_slots == 2 and with_prefetch.slots == without.slots == 4


def test_a_budget_below_dense_weights_plus_one_expert_is_refused_clearly():
    with pytest.raises(BudgetError, match="dense weights"):
        plan(dense_bytes=1000, expert_bytes=100, moe_layers=4, experts_per_layer=8, ram=1050, cap=None)
    assert plan(dense_bytes=1000, expert_bytes=100, moe_layers=4, experts_per_layer=8, ram=1100, cap=None).slots == 0


def test_a_device_backend_keeps_dense_weights_in_device_memory_and_plans_each_tier():
    p = plan(dense_bytes=1000, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=200 + 2 * 100 * 3, cap=None,
             io_window=2, device_memory=10_000, device_expert_bytes=50)
    assert p.dense_in == "device" and p.slots == 3  # RAM: the window (2 experts) + 3 per layer; no dense weights
    assert p.device.budget == 8000 - 1000 and p.device.budget_source == "default" and p.device.slots == 8
    small = plan(dense_bytes=1000, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=10**6, cap=None,
                 device_memory=10_000, vram=2 * 50 * 3 + 49, device_expert_bytes=50, pin_share=0.5)
    assert small.device.budget_source == "--vram" and small.device.pinned == 3 and small.device.slots == 1
    assert [t.role for t in small.tiers] == ["device", "ram"]
    with pytest.raises(BudgetError, match="device memory"):
        plan(dense_bytes=1000, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=10**6, cap=None,
             device_memory=10_000, vram=9500)
    with pytest.raises(BudgetError, match="dense weights"):
        plan(dense_bytes=9000, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=10**6, cap=None, device_memory=10_000)
    with pytest.raises(UsageError, match="vram: the backend has no device memory"):
        plan(dense_bytes=0, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=10**6, cap=None, vram=100)


def test_unified_memory_plans_both_tiers_within_one_budget():
    ram = 1000 + 100 + 100 * 10
    p = plan(dense_bytes=1000, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=ram, cap=None,
             device_memory=ram, unified=True, vram=400)
    assert p.unified and p.device.slots == 2 and p.slots == 3  # 4 experts on the device, 6 in RAM
    assert p.dense_bytes + 100 + p.device.cache_bytes(2) + p.expert_cache_bytes <= ram
    default = plan(dense_bytes=1000, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=ram, cap=None,
                   device_memory=ram, unified=True)
    assert default.device.slots == 5 and default.slots == 0
    with pytest.raises(BudgetError, match="unified"):
        plan(dense_bytes=1000, expert_bytes=100, moe_layers=2, experts_per_layer=8, ram=ram, cap=None,
             device_memory=ram, unified=True, vram=1001)
