"""``colibri tune`` and its profiles (colibri_core.cli.tune, colibri_core.cli.profiles):
durations, the profile file and its refusals, a profile filling only the options not
given (run picks it up, --profile none and NAME), the same tokens with and without it,
and a whole tune within its budget on the demo-sized model."""

import json
import time

import pytest

from colibri_core.cli import profiles
from colibri_core.cli.tune import choose_slots, parse_duration
from colibri_core.errors import ModelFormatError, UsageError
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.tiny_models import model_dir


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    home = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return {"XDG_CONFIG_HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_durations():
    assert parse_duration("90s") == 90 and parse_duration("5m") == 300 and parse_duration("1.5h") == 5400
    assert parse_duration("42") == 42
    for bad in ("", "5 minutes", "-3s", "0"):
        with pytest.raises(UsageError, match="--time"):
            parse_duration(bad)


def test_the_fewest_slots_within_5_percent_of_the_best_aggregate_speed():
    rows = [{"slots": n, "aggregate_tok_s": v} for n, v in ((1, 50.0), (2, 90.0), (4, 97.0), (8, 100.0))]
    assert choose_slots(rows) == 4  # 97 >= 0.95 * 100; 90 is not
    rows[2]["aggregate_tok_s"] = None  # failed
    assert choose_slots(rows) == 8 and choose_slots([{"slots": 1, "aggregate_tok_s": None}]) is None


def write_profile(path, options, **changes):
    doc = profiles.new_document(path, options, budget={}, table=[], facts={}, seconds=1.0) | changes
    return profiles.write(doc, "tiny")


def test_profile_file_round_trip_and_refusals(tmp_path_factory, config_home):
    import colibri_core
    from colibri_core.engine.state import model_identity

    path = model_dir("demo_int4", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:  # one identity for states, prefixes and profiles
        assert profiles.model_key(path) == model_identity(model)["sha256"]
    target = write_profile(path, {"prefetch": True, "pin_share": 0.25})
    assert profiles.read(target).options == {"prefetch": True, "pin_share": 0.25}
    found, warning = profiles.resolve(path, None)
    assert found is not None and found.path == target and warning is None
    assert profiles.resolve(path, "none") == (None, None)
    good = json.loads(target.read_text())
    for bad, why in (({"format": "x"}, "is not a colibri-profile"), ({"version": 7}, "has version 7"),
                     ({"options": {"ram": "2G"}}, "sets 'ram'"), ({"options": {"pin_share": 1.5}}, "pin_share"),
                     ({"options": {"prefetch_slots": 0}}, "prefetch_slots"), ({"options": {"prefetch": "yes"}}, "prefetch"),
                     ({"options": {"mirrors": "/m"}}, "mirrors"), ({"options": {"mirrors": [1]}}, "mirrors")):
        target.write_text(json.dumps(good | bad))
        with pytest.raises(ModelFormatError, match=why) as exc:
            profiles.read(target)
        assert str(target) in str(exc.value)
    other = model_dir("olmoe", tmp_path_factory)
    write_profile(path, {"prefetch": True})
    with pytest.raises(UsageError, match="tuned for another model"):
        profiles.resolve(other, "tiny")
    assert profiles.resolve(other, None) == (None, None)  # another model's profile is not this one's default
    with pytest.raises(UsageError, match="no profile at"):
        profiles.resolve(path, "missing")


def test_run_applies_the_profile_to_the_options_not_given_and_tokens_do_not_change(tmp_path_factory, config_home):
    path = model_dir("demo_int4", tmp_path_factory)
    ram = 3 << 20  # experts stream: prefetch and pinning act
    args = ["run", "--model", path, "--token-ids", "1,2,3,4", "--max-tokens", 12, "--ram", ram, "--json"]
    plain = run_colibri(*args, env=config_home)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["profile"] is None and "profile" not in plain.stderr
    write_profile(path, {"prefetch": True, "prefetch_slots": 3, "pin_share": 0.25, "direct_io": True})
    tuned = run_colibri(*args, env=config_home)
    assert tuned.returncode == 0, tuned.stderr
    got = json.loads(tuned.stdout)
    assert got["profile"]["options"] == {"prefetch": True, "prefetch_slots": 3, "pin_share": 0.25, "direct_io": True}
    assert "profile tiny: --prefetch --prefetch-slots 3 --pin-share 0.25 --direct-io" in tuned.stderr
    def prefetching(stats):  # read ahead, skipped or timed: the prefetcher ran
        return stats["prefetch_issued"] + stats["prefetch_skipped"] + stats["prefetch_steps_off"] > 0

    assert prefetching(got["stats"]) and not prefetching(json.loads(plain.stdout)["stats"])
    assert got["token_ids"] == json.loads(plain.stdout)["token_ids"], "a profile changed the tokens"
    given = run_colibri(*args, "--no-prefetch", "--pin-share", "0.5", env=config_home)
    assert json.loads(given.stdout)["profile"]["options"] == {"prefetch_slots": 3, "direct_io": True}
    assert "--pin-share, --prefetch as given" in given.stderr
    assert not prefetching(json.loads(given.stdout)["stats"])
    # a tuned mirror is read from (the profile's, where the command line gives none); one gone since is skipped
    mirror = path.parent / f"{path.name}-mirror"
    mirror.mkdir(exist_ok=True)
    for shard in path.glob("*.safetensors"):
        (mirror / shard.name).write_bytes(shard.read_bytes())
    write_profile(path, {"mirrors": [str(mirror), str(path.parent / "gone")]})
    mirrored = run_colibri(*args, "--direct-io", env=config_home)
    assert mirrored.returncode == 0, mirrored.stderr
    got = json.loads(mirrored.stdout)
    assert got["profile"]["options"] == {"mirrors": [str(mirror)]} and f"--mirror {mirror}" in mirrored.stderr
    assert f"mirror {path.parent / 'gone'} is not there; not used" in mirrored.stderr
    assert len([n for n in got["stats"]["bytes_read_by_drive"].values() if n > 0]) == 2, got["stats"]
    assert got["token_ids"] == json.loads(plain.stdout)["token_ids"]
    none = run_colibri(*args, "--profile", "none", env=config_home)
    assert json.loads(none.stdout)["profile"] is None
    named = run_colibri(*args, "--profile", "missing", env=config_home)
    assert named.returncode == 2 and "--profile missing" in named.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_tune_finishes_within_its_budget_and_saves_a_profile_run_uses(tmp_path_factory, config_home):
    path = model_dir("demo_int4", tmp_path_factory)
    mirror = path.parent / f"{path.name}-tune-mirror"
    mirror.mkdir(exist_ok=True)
    for shard in path.glob("*.safetensors"):
        (mirror / shard.name).write_bytes(shard.read_bytes())
    started = time.perf_counter()
    out = run_colibri("tune", "--model", path, "--ram", 3 << 20, "--time", "25s", "--tokens", 8, "--prompt-tokens", 8,
                      "--mirror", mirror, "--json", env=config_home, timeout=300)
    took = time.perf_counter() - started
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert took < 25 + 15  # the budget, plus the process's start and the machine's facts
    names = [row["name"] for row in doc["table"]]
    assert names[:4] == ["defaults", "direct I/O", "prefetch top-k", "prefetch 4"] and "pin share 0.25" in names
    assert "1 mirror" in names and doc["facts"]["mirrors"][0]["path"] == str(mirror)
    assert doc["facts"]["mirrors"][0]["read_buffered_bytes_s"] > 0
    assert all(row["rounds"] >= 1 and row["decode_tok_s"] > 0 for row in doc["table"])
    assert all(len(row["runs_tok_s"]) == row["rounds"] == row["paired_rounds"] for row in doc["table"])
    defaults = doc["table"][0]
    assert defaults["paired_ratio"] == 1.0 and defaults["paired_wins"] == 0
    assert doc["facts"]["read_buffered_bytes_s"] > 0 and doc["facts"]["memory_copy_bytes_s"] > 0
    placement = {k: v for k, v in doc["options"].items() if k != "slots"}
    assert sum(row["chosen"] for row in doc["table"]) == (1 if placement else 0)
    slots = doc["facts"]["slots"]
    assert [row["slots"] for row in slots["rows"]] == [1, 2, 4, 8] and all(r["rounds"] >= 1 for r in slots["rows"])
    assert doc["options"].get("slots") == slots["chosen"] and (slots["chosen"] is None) == (slots["rounds"] < 2)
    run = run_colibri("run", "--model", path, "--token-ids", "1,2,3", "--max-tokens", 4, "--json", env=config_home)
    assert json.loads(run.stdout)["profile"]["name"] == path.name
    bad = run_colibri("tune", "--model", path, "--time", "soon", env=config_home)
    assert bad.returncode == 2 and "--time" in bad.stderr
    bad = run_colibri("tune", "--model", path, "--mirror", path / "nowhere", env=config_home)
    assert bad.returncode == 2 and "--mirror" in bad.stderr and "not a directory" in bad.stderr
