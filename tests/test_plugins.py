"""The plugin system: discovery, isolation, in-process registration, conflicts, env vars."""

import inspect
import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import colibri_core
from colibri_core.plugins import hookspecs
from colibri_core.cli.main import build_cli
from colibri_core.errors import PluginError, UnsupportedModelError
from colibri_core.plugins.discovery import get_manager, get_registry
from colibri_core.plugins.registry import FamilySpec
from colibri_core.testing import registered_plugin

from colibri_core.testing.cli import run_colibri
from toy_family import MODEL_TYPE, ToyPlugin, write_toy_model

REPO = Path(__file__).resolve().parents[1]


def invoke(*args):
    result = CliRunner().invoke(build_cli(), list(args), catch_exceptions=False)
    return result


# -- in-process, nothing installed -----------------------------------------------------
def test_third_party_family_registered_in_process_is_listed_and_runnable(tmp_path):
    model_dir = write_toy_model(tmp_path / "toy")
    with registered_plugin(ToyPlugin(), "toy-plugin"):
        listing = json.loads(invoke("list-families", "--json").stdout)
        toy = [row for row in listing if row["family"] == "toy"]
        assert toy and toy[0]["model_types"] == [MODEL_TYPE] and toy[0]["plugin"] == "toy-plugin"

        with colibri_core.load(model_dir, cap=1) as model:
            result = model.generate(token_ids=[1, 2, 3], max_tokens=6)
            assert len(result.token_ids) == 6
            assert all(0 <= t < 32 for t in result.token_ids)
            assert result.stats.expert_misses > 0  # experts streamed through the store

        run = invoke("run", "--model", str(model_dir), "--token-ids", "1,2,3", "--max-tokens", "6", "--json")
        assert run.exit_code == 0, run.output
        assert json.loads(run.stdout)["token_ids"] == result.token_ids
    # unregistered: the model type is unknown again
    with pytest.raises(UnsupportedModelError, match=MODEL_TYPE):
        colibri_core.load(model_dir)


def test_duplicate_names_are_an_error_naming_both_plugins(tmp_path):
    model_dir = write_toy_model(tmp_path / "toy")

    class Clone:
        @colibri_core.hookimpl
        def colibri_register_families(self, register):
            register(FamilySpec("toy-clone", (MODEL_TYPE,), "toy_family:ToyFamily"))

    with registered_plugin(ToyPlugin(), "first-plugin"), registered_plugin(Clone(), "second-plugin"):
        with pytest.raises(PluginError) as err:
            colibri_core.load(model_dir)
        assert "first-plugin" in str(err.value) and "second-plugin" in str(err.value)
        assert any("first-plugin" in m and "second-plugin" in m for m in get_manager().conflict_messages())
        rows = json.loads(invoke("list-families", "--json").stdout)
        assert {r["family"]: r["status"] for r in rows}["toy"] == "conflict"


def test_same_family_name_twice_is_a_conflict():
    class A:
        @colibri_core.hookimpl
        def colibri_register_backends(self, register):
            from colibri_core.plugins.registry import BackendSpec

            register(BackendSpec("cpu", "colibri_core.compute.cpu.backend:CpuBackend"))

    with registered_plugin(A(), "impostor"):
        with pytest.raises(PluginError, match="colibri-core.*impostor"):
            get_registry().get("backend", "cpu")


def test_list_backends_shows_what_each_computes_on():
    class Accelerated:
        @colibri_core.hookimpl
        def colibri_register_backends(self, register):
            from colibri_core.plugins.registry import BackendSpec

            register(BackendSpec("fast", "nowhere:Fast", device=lambda: "gpu"))
            register(BackendSpec("vague", "nowhere:Vague"))
            register(BackendSpec("broken", "nowhere:Broken", device="nowhere:probe"))
            register(BackendSpec("absent", "nowhere:Absent", probe=lambda: "not here", device="gpu"))

    with registered_plugin(Accelerated(), "accelerated"):
        rows = {r["backend"]: r for r in json.loads(invoke("list-backends", "--json").stdout)}
        assert {name: rows[name]["device"] for name in ("cpu", "fast", "vague", "broken", "absent")} == {
            "cpu": "cpu", "fast": "gpu", "vague": None, "broken": None, "absent": None}
        table = invoke("list-backends").stdout
        assert "available (cpu)" in table and "available (gpu)" in table and "unavailable: not here" in table


def test_a_hook_that_raises_marks_only_its_plugin_failed():
    class Exploding:
        @colibri_core.hookimpl
        def colibri_register_families(self, register):
            register(FamilySpec("half", ("half_registered",), "nowhere:Nothing"))
            raise RuntimeError("boom while registering")

    with registered_plugin(Exploding(), "exploding"), registered_plugin(ToyPlugin(), "toy-plugin"):
        registry = get_registry()
        info = get_manager().plugins["exploding"]
        assert info.status == "failed" and "boom while registering" in info.error
        assert "half_registered" not in registry.model_types  # no half registrations left behind
        assert MODEL_TYPE in registry.model_types


def test_a_plugin_cannot_take_over_a_core_command():
    class Hijacker:
        @colibri_core.hookimpl
        def colibri_register_commands(self, cli):
            @cli.command("run")
            def evil():
                pass

    with registered_plugin(Hijacker(), "hijacker"):
        cli = build_cli()
        assert cli.commands["run"].callback.__module__ == "colibri_core.cli.run"
        assert "already exists" in get_manager().plugins["hijacker"].error


def test_plugins_can_add_commands():
    import click

    class Adds:
        @colibri_core.hookimpl
        def colibri_register_commands(self, cli):
            @cli.command("hello-plugin")
            def hello():
                click.echo("hello from a plugin")

    with registered_plugin(Adds(), "adds"):
        assert invoke("hello-plugin").output.strip() == "hello from a plugin"


# -- through entry points, in a subprocess ----------------------------------------------
def make_entry_point_plugins(root):
    """A directory on PYTHONPATH holding distributions with colibri entry points."""
    plugins = {
        "broken_plugin": ("colibri-broken", 'raise RuntimeError("this plugin is broken on purpose")\n'),
        "needs_dep_plugin": ("colibri-needs-dep", "import a_dependency_that_is_not_installed\n"),
        "bad_hook_plugin": ("colibri-bad-hook", textwrap.dedent("""
            from colibri_core import hookimpl

            @hookimpl
            def colibri_register_families(wrong_argument_name):
                pass
        """)),
        "good_plugin": ("colibri-good", textwrap.dedent("""
            from colibri_core import hookimpl
            from colibri_core.plugins.registry import FamilySpec

            @hookimpl
            def colibri_register_families(register):
                register(FamilySpec("goodfam", ("good_type",), "good_plugin.model:Model"))
        """)),
    }
    for module, (dist, source) in plugins.items():
        (root / f"{module}.py").write_text(source)
        info = root / f"{dist.replace('-', '_')}-0.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
        (info / "entry_points.txt").write_text(f"[colibri]\n{module} = {module}\n")
    return root


def test_broken_plugins_are_listed_as_failed_while_everything_else_works(tmp_path):
    env = {"PYTHONPATH": str(make_entry_point_plugins(tmp_path))}
    families = run_colibri("list-families", "--json", env=env)
    assert families.returncode == 0, families.stderr
    names = {row["family"] for row in json.loads(families.stdout)}
    assert {"olmoe", "goodfam"} <= names
    assert "colibri-broken" in families.stderr and "Traceback" not in families.stderr

    listing = json.loads(run_colibri("plugins", "--json", env=env).stdout)
    status = {p["name"]: p for p in listing["plugins"]}
    assert status["colibri-broken"]["status"] == "failed"
    assert "broken on purpose" in status["colibri-broken"]["error"]
    assert status["colibri-needs-dep"]["status"] == "unavailable"
    assert "a_dependency_that_is_not_installed" in status["colibri-needs-dep"]["error"]
    assert status["colibri-bad-hook"]["status"] == "failed"
    assert status["colibri-good"]["status"] == "loaded" and status["colibri-good"]["version"] == "0.3"
    assert status["colibri-good"]["hooks"] == ["colibri_register_families"]

    for command in ("list-backends", "list-quants", "list-tiers"):
        assert run_colibri(command, env=env).returncode == 0


def test_environment_restricts_and_disables_plugins(tmp_path):
    root = make_entry_point_plugins(tmp_path)
    disabled = run_colibri("list-families", "--json", env={"PYTHONPATH": str(root), "COLIBRI_DISABLE_PLUGINS": "colibri-olmoe, colibri-broken"})
    names = {row["family"] for row in json.loads(disabled.stdout)}
    assert "olmoe" not in names and "goodfam" in names
    assert "colibri-broken" not in disabled.stderr

    only = run_colibri("plugins", "--json", env={"PYTHONPATH": str(root), "COLIBRI_PLUGINS": "colibri-good"})
    status = {p["name"]: p["status"] for p in json.loads(only.stdout)["plugins"]}
    assert status["colibri-good"] == "loaded" and status["colibri-core"] == "loaded"
    assert status["colibri-olmoe"] == "disabled" and status["colibri-broken"] == "disabled"
    only_families = run_colibri("list-families", "--json", env={"COLIBRI_PLUGINS": "nothing-matches"})
    assert json.loads(only_families.stdout) == []


def test_listing_commands_import_no_heavy_stacks():
    import subprocess
    import sys

    code = textwrap.dedent("""
        import sys
        from colibri_core.cli.main import build_cli
        from click.testing import CliRunner
        cli = build_cli()
        for args in (["list-families"], ["list-backends"], ["list-quants"], ["list-tiers"], ["plugins"], ["list-families", "--json"]):
            result = CliRunner().invoke(cli, args)
            assert result.exit_code == 0, result.output
        heavy = sorted(m for m in ("numpy", "torch", "cupy", "mlx", "vulkan", "tokenizers", "jinja2", "transformers") if m in sys.modules)
        print(",".join(heavy))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_every_hook_is_documented_with_its_signature():
    doc = (REPO / "docs" / "plugins.md").read_text()
    specs = [(name, fn) for name, fn in vars(hookspecs).items() if name.startswith("colibri_") and callable(fn)]
    assert len(specs) == 7
    for name, fn in specs:
        assert fn.__doc__, f"{name} has no docstring"
        signature = f"{name}{inspect.signature(fn)}"
        assert signature in doc, f"docs/plugins.md does not show {signature}"
