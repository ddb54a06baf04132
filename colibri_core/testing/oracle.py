"""Oracle testing against transformers.

A family proves itself by building tiny random-initialised models with transformers
(CPU, float32, eager attention), saving them with ``save_pretrained`` and comparing
colibri's greedy tokens and per-step logits with transformers' ``generate``, under
several placements. Subclass ``FamilyOracleSuite`` and list the configs:

    class TestOlmoe(FamilyOracleSuite):
        model_class = "OlmoeForCausalLM"
        cases = {"small": OracleCase(lambda: OlmoeConfig(...)), ...}

Every test runs once per backend (``colibri_core.testing.backends``: each installed
one, restricted by COLIBRI_TEST_BACKENDS; a suite may name its own with ``backends``),
against the same oracle fixtures, built once per session. Logits must stay within
``max(tolerance, backend.logits_tolerance)``; greedy tokens must be identical.

torch and transformers are imported only when a case is built.
"""

from __future__ import annotations

import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import colibri_core

_cache: dict[tuple[str, str], "OracleFixture"] = {}
DRAFTED_TOKENS = 16  # generated with and without drafts (every third drafted token wrong): five verifications
_lock = threading.Lock()


@dataclass
class OracleCase:
    """One tiny model: a transformers config factory and how to save and prompt it."""

    make_config: Callable[[], Any]
    seed: int = 0
    prompt: tuple[int, ...] = (5, 17, 99, 3, 42, 7, 64)
    new_tokens: int = 32
    max_shard_size: str | None = None  # e.g. "20KB" saves several shards with an index
    perturb: float = 0.05  # added noise so constant-initialised tensors (norms) matter
    # prepare(model): change the built model before it is saved (e.g. randomise buffers
    # such as a router's score-correction bias, which perturbation leaves alone)
    prepare: Callable[[Any], None] | None = None
    # rewrite(path): change the saved checkpoint colibri loads (e.g. quantise it); may
    # return the directory of a float32 checkpoint transformers should load as the reference
    # instead (e.g. the dequantised weights)
    rewrite: Callable[[Path], Path | None] | None = None


@dataclass
class OracleFixture:
    path: Path
    prompt: list[int]
    tokens: list[int]  # transformers' greedy continuation
    step_logits: np.ndarray  # (new_tokens, vocab): the logits each token was chosen from
    full_logits: np.ndarray  # (len(prompt + tokens) - 1, vocab): one teacher-forced pass
    num_experts: int


def build_oracle(case: OracleCase, model_class: str, path: Path) -> OracleFixture:
    import torch
    import transformers

    torch.manual_seed(case.seed)
    config = case.make_config()
    config._attn_implementation = "eager"
    cls = getattr(transformers, model_class)
    model = cls(config).eval().to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * case.perturb)
    if case.prepare is not None:
        with torch.no_grad():
            case.prepare(model)
    kwargs = {"max_shard_size": case.max_shard_size} if case.max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if case.rewrite is not None:
        reference = case.rewrite(path)
        if reference is not None:
            model = cls.from_pretrained(reference, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, step_logits, full = transformers_reference(model, case.prompt, case.new_tokens)
    # wrapped models (vision-language) keep the expert count in their text config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_experts = next((n for n in (getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")) if n), 0)
    return OracleFixture(path, list(case.prompt), tokens, step_logits, full, int(n_experts))


def transformers_reference(model, prompt, new_tokens: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """transformers' greedy continuation of ``prompt`` (token ids), the logits each token
    was chosen from, and one teacher-forced pass over prompt + continuation."""
    import torch

    prompt_ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        # an explicit mask: otherwise a prompt token equal to pad_token_id counts as padding
        out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        if len(tokens) != new_tokens:
            raise AssertionError(f"transformers stopped after {len(tokens)} tokens: give the config an eos id outside the vocabulary")
        full = model(out.sequences[:, :-1]).logits[0].numpy()
    return tokens, torch.cat(out.logits, dim=0).numpy(), full


def random_correction_bias(scale: float = 0.3, seed: int = 1234):
    """An ``OracleCase.prepare`` hook for sigmoid routers: give every router a random
    ``e_score_correction_bias``, so that choosing with the bias but weighting without it
    is tested (the perturbation only touches parameters, and the bias is a buffer)."""

    def prepare(model):
        import torch

        g = torch.Generator().manual_seed(seed)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * scale)

    return prepare


def oracle_fixture(suite: str, name: str, case: OracleCase, model_class: str, root: Path) -> OracleFixture:
    """Build (once per session) the oracle model of a case and its reference outputs."""
    key = (suite, name)
    with _lock:
        if key not in _cache:
            _cache[key] = build_oracle(case, model_class, root / f"{suite}-{name}")
        return _cache[key]


def placements(fixture: OracleFixture, backend: str = "cpu") -> dict[str, dict[str, Any]]:
    """The placements every oracle runs under on ``backend``: all resident, one cached
    expert per layer, and budgets holding about half of the experts (RAM, and device
    memory on a backend with a device tier of its own)."""
    with colibri_core.load(fixture.path, history=False, backend=backend) as probe:
        p = probe.placement
    half = max(1, fixture.num_experts // 2)
    dense_in_ram = p.dense_bytes if p.device is None or p.unified else 0
    between = {"ram": dense_in_ram + (half * p.moe_layers + p.io_window) * p.expert_bytes + p.expert_bytes // 2}
    if p.device is not None and not p.unified:
        between["vram"] = half * p.moe_layers * p.device.expert_bytes + p.device.expert_bytes // 2
    # no routing history: these placements must not depend on what earlier runs left behind
    return {"resident": {"history": False}, "cap1": {"cap": 1, "history": False}, "between": {**between, "history": False}}


def assert_same_logits(logits, reference, label: str) -> None:
    """Each step's logits bit-identical to the reference's; a failure names the first
    step that differs, by how much and in how many entries (a rounding difference looks
    unlike a wrong expert)."""
    for step, (a, b) in enumerate(zip(logits, reference)):
        if not np.array_equal(a, b):
            a, b = np.asarray(a), np.asarray(b)
            differ = int(np.count_nonzero(a != b)) if a.shape == b.shape else -1
            worst = float(np.abs(a - b).max()) if a.shape == b.shape else float("nan")
            raise AssertionError(f"{label}: step {step} of {len(reference)}: {differ} of {a.size} logits differ, "
                                 f"by up to {worst:.3e}")


def expert_slots(placement) -> int:
    """LRU slots per layer of the resident tier holding the most experts."""
    return max(t.slots for t in placement.tiers)


class FamilyOracleSuite:
    """Conformance tests a family subclasses: set ``model_class`` and ``cases``."""

    model_class: str = ""
    cases: dict[str, OracleCase] = {}
    tolerance: float = 1e-4
    pieces_tolerance: float = 1e-5  # one sequence fed at once vs in pieces, through colibri alone
    placement_names = ("resident", "cap1", "between")
    backends: tuple[str, ...] | None = None  # None: every installed backend

    def pytest_generate_tests(self, metafunc):
        if "backend" in metafunc.fixturenames:
            from colibri_core.testing.backends import backend_params, matrix_beyond_cpu

            metafunc.parametrize("backend", matrix_beyond_cpu(backend_params(self.backends)))
        if "case_name" in metafunc.fixturenames:
            metafunc.parametrize("case_name", sorted(self.cases))
        if "placement" in metafunc.fixturenames:
            metafunc.parametrize("placement", self.placement_names)

    @classmethod
    def oracle(cls, case_name: str, tmp_path_factory) -> OracleFixture:
        """The case's saved model and transformers' reference outputs (built once per session)."""
        root = tmp_path_factory.getbasetemp() / "oracles"
        root.mkdir(exist_ok=True)
        return oracle_fixture(cls.__name__, case_name, cls.cases[case_name], cls.model_class, root)

    def _fixture(self, case_name: str, tmp_path_factory) -> OracleFixture:
        return self.oracle(case_name, tmp_path_factory)

    def check_rewritten(self, fx: OracleFixture, path: Path, backend: str, what: str, check_model=None) -> None:
        """``fx``'s checkpoint rewritten in another layout at ``path``: transformers reads
        it to the same logits (a layout mistake shows as O(1)), and colibri, streaming one
        cached expert per layer, gives its tokens and logits, stepwise and teacher-forced.
        ``check_model(model)``: more checks on the loaded model."""
        import torch
        import transformers

        reference = getattr(transformers, self.model_class).from_pretrained(path, dtype=torch.float32,
                                                                          attn_implementation="eager").eval()
        with torch.no_grad():
            full = reference(torch.tensor([fx.prompt + fx.tokens[:-1]])).logits[0].numpy()
        worst = float(np.abs(full - fx.full_logits).max())
        assert worst < self.tolerance, f"transformers reads {what} differently: {worst:.2e}"
        with colibri_core.load(path, cap=1, history=False, backend=backend) as model:
            if check_model is not None:
                check_model(model)
            result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
            forced = model.logits(fx.prompt + fx.tokens[:-1])
            bound = self.bound(model)
        assert result.token_ids == fx.tokens
        worst = max(float(np.abs(np.stack(result.logits) - fx.step_logits).max()),
                    float(np.abs(forced - fx.full_logits).max()))
        assert worst < bound, f"logits differ by {worst:.2e}"

    def bound(self, model, tolerance: float | None = None) -> float:
        """The largest logits difference allowed on the model's backend."""
        return max(self.tolerance if tolerance is None else tolerance, model.backend.logits_tolerance)

    def test_greedy_tokens_and_logits_match_transformers(self, backend, case_name, placement, tmp_path_factory):
        fx = self._fixture(case_name, tmp_path_factory)
        options = placements(fx, backend)[placement]
        with colibri_core.load(fx.path, backend=backend, **options) as model:
            result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
            if placement == "cap1":
                assert expert_slots(model.placement) == 1
            elif placement == "between":
                assert 1 < expert_slots(model.placement) < fx.num_experts
            bound = self.bound(model)
        assert result.token_ids == fx.tokens
        ours = np.stack(result.logits)
        assert ours.shape == fx.step_logits.shape
        worst = float(np.abs(ours - fx.step_logits).max())
        assert worst < bound, f"logits differ by {worst:.2e}"

    def test_decode_stays_on_the_device_but_for_ids_and_logits(self, backend, case_name, tmp_path_factory):
        """Host synchronisations per decode step: one for the logits, one per MoE router
        (the store reads experts by id), two per sparse-attention indexer (its scores, and
        its selection where the attention is a composite); none elsewhere
        (``colibri_core.testing.syncs``)."""
        from colibri_core.testing.syncs import SyncAudit, disallowed

        fx = self._fixture(case_name, tmp_path_factory)
        steps = 3
        runs = []
        for tokens in (1, 1 + steps):  # the difference is the decode steps alone
            with colibri_core.load(fx.path, backend=backend, history=False) as model:
                audit = SyncAudit(model.backend)
                model.generate(token_ids=fx.prompt, max_tokens=tokens, ignore_eos=True)
                runs.append(audit.snapshot())
                routers = len(model.lm.routed_experts())
        sites = runs[1][0] - runs[0][0]
        indexer_calls = (runs[1][1] - runs[0][1])["dsa_index_scores"] / steps
        assert not disallowed(sites), f"host syncs outside the allowed blocks during decode: {disallowed(sites)}"
        budget = 1 + routers + 2 * indexer_calls
        per_step = sum(sites.values()) / steps
        assert per_step <= budget, (f"{per_step:g} host syncs per decode step, more than {budget:g} (1 + {routers} "
                                    f"routers + 2 x {indexer_calls:g} indexers): {dict(sites)}")

    def test_drafted_tokens_change_nothing(self, backend, case_name, tmp_path_factory):
        """Speculative decoding with drafts that are partly wrong (every third): the
        same tokens and bit-identical logits as without, greedy and seeded sampling, on
        a streaming budget (colibri_core.engine.speculative)."""
        from colibri_core.testing.drafts import ScriptedSource

        fx = self._fixture(case_name, tmp_path_factory)
        options = placements(fx, backend)["between"]
        with colibri_core.load(fx.path, backend=backend, **options) as model:
            for sampling in ({}, {"temperature": 0.8, "top_k": 12, "seed": 5}):
                plain = model.generate(token_ids=fx.prompt, max_tokens=DRAFTED_TOKENS, ignore_eos=True,
                                       return_logits=True, **sampling)
                source = ScriptedSource([(fx.prompt, plain.token_ids)], model.lm.vocab_size)
                run = model.generate(token_ids=fx.prompt, max_tokens=DRAFTED_TOKENS, ignore_eos=True,
                                     return_logits=True, draft=source, **sampling)
                label = f"drafts, {sampling or 'greedy'}"
                assert run.token_ids == plain.token_ids, label
                assert_same_logits(run.logits, plain.logits, label)
                stats = run.stats
                assert 0 < stats.accepted_tokens < stats.drafted_tokens, label
                assert stats.tokens_per_forward > 1.5, label

    def test_saved_state_resumes_exactly(self, backend, case_name, tmp_path_factory, tmp_path):
        """A sequence saved after k of N tokens (colibri_core.engine.state) and resumed by
        a fresh load of the model for N - k more gives the uninterrupted run's tokens and
        bit-identical logits, greedy and seeded sampling (the sampler's generator and
        penalty counts are saved too), without computing the prompt again; the file holds
        the positions in use only, not the room the caches reserved."""
        fx = self._fixture(case_name, tmp_path_factory)
        total, first = 8, 3
        samplings = ({}, {"temperature": 0.8, "top_k": 12, "seed": 5, "frequency_penalty": 0.5})
        runs = []
        with colibri_core.load(fx.path, backend=backend, history=False) as model:
            for n, sampling in enumerate(samplings):
                whole = model.generate(token_ids=fx.prompt, max_tokens=total, ignore_eos=True, return_logits=True,
                                       **sampling)
                part = model.generate(token_ids=fx.prompt, max_tokens=first, ignore_eos=True, keep_state=True,
                                      **sampling)
                state = part.state
                assert state is not None, part.state_error
                assert part.token_ids == whole.token_ids[:first]
                assert state.token_ids == tuple(fx.prompt + part.token_ids) and state.positions == len(state.token_ids) - 1
                bound = model.lm.new_cache(model.backend).bytes_for(state.positions)
                assert state.nbytes <= bound, f"the state holds {state.nbytes} bytes, more than {state.positions} positions take"
                state.save(tmp_path / f"state-{n}")
                runs.append((sampling, whole))
        for n, (sampling, whole) in enumerate(runs):
            with colibri_core.load(fx.path, backend=backend, history=False) as fresh:  # a new model object
                rest = fresh.resume(tmp_path / f"state-{n}", max_tokens=total - first, return_logits=True)
            label = f"saved after {first} of {total} tokens, {sampling or 'greedy'}"
            assert rest.stats.prompt_tokens == 1 and rest.stats.resumed_tokens == len(fx.prompt) + first - 1, label
            assert rest.token_ids == whole.token_ids[first:], label
            assert_same_logits(rest.logits, whole.logits[first:], label)

    def test_teacher_forced_logits_match_transformers(self, backend, case_name, tmp_path_factory):
        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path, cap=1, history=False, backend=backend) as model:
            ours = model.logits(fx.prompt + fx.tokens[:-1])
            bound = self.bound(model)
        worst = float(np.abs(ours - fx.full_logits).max())
        assert worst < bound, f"logits differ by {worst:.2e}"

    @pytest.mark.matrix  # budgets x pinning x prefetch x O_DIRECT x mirror, per case
    def test_every_store_option_gives_identical_tokens(self, backend, case_name, tmp_path_factory, tmp_path):
        """Budget (cap 1 .. all resident) x pinning x prefetch, x O_DIRECT x mirror on cpu (once
        elsewhere), and on a backend with device memory x --vram (all, a quarter, none): the
        tokens and logits never change."""
        import itertools
        import shutil

        fx = self._fixture(case_name, tmp_path_factory)
        model_dir = tmp_path / "model"
        shutil.copytree(fx.path, model_dir)
        shards = sorted(model_dir.glob("*.safetensors"))
        mirror = tmp_path / "mirror"
        mirror.mkdir()
        for shard in shards[: max(1, (len(shards) + 1) // 2)]:  # a partial mirror when sharded
            shutil.copy(shard, mirror / shard.name)
        with colibri_core.load(model_dir, history=True, backend=backend) as model:  # leaves a routing history to pin from
            reference = model.generate(token_ids=fx.prompt, max_tokens=8, ignore_eos=True, return_logits=True)
            device = model.placement.device
        half = max(1, fx.num_experts // 2)
        budgets = {"cap1": {"cap": 1}, "half": {"cap": half}, "all": {}}
        vrams = {"default": {}}
        if device is not None:  # a device tier: all of it, a quarter of the experts, none
            quarter = max(1, fx.num_experts // 4) * model.placement.moe_layers * device.expert_bytes
            vrams = {"vram-all": {}, "vram-quarter": {"vram": quarter}, "vram-none": {"vram": 0}}
        pinned_somewhere = False
        # the drive options (O_DIRECT, a mirror) act below the tiers, on the host, whatever
        # the backend: crossed with everything on cpu, once more elsewhere
        drives = ((True, False), (True, False)) if backend == "cpu" else ((False,), (False,))
        combos = list(itertools.product(budgets.items(), list(vrams.items())[:1], ("on", "off"), (True, False), *drives))
        if backend != "cpu":
            combos.append((("cap1", budgets["cap1"]), list(vrams.items())[0], "on", True, True, True))
        # the other device budgets against every RAM budget, pinning and prefetch
        combos += itertools.product(budgets.items(), list(vrams.items())[1:], ("on", "off"), (True, False), (False,),
                                    (False,))
        for (budget, opts), (vram, vram_opts), pin, prefetch, direct, use_mirror in combos:
            options = dict(opts, **vram_opts, pin=pin, prefetch=prefetch, direct_io=direct,
                           mirrors=[mirror] if use_mirror else [], history=pin == "on")
            with colibri_core.load(model_dir, backend=backend, **options) as model:
                run = model.generate(token_ids=fx.prompt, max_tokens=8, ignore_eos=True, return_logits=True)
                if pin == "on":
                    store = model.store
                    pinned = store.ram.pinned_set() | (store.device.pinned_set() if store.device is not None else set())
                    assert bool(pinned) == (store.pinned_capacity > 0)
                    pinned_somewhere |= store.pinned_capacity > 0
            label = f"{budget} {vram} pin={pin} prefetch={prefetch} direct={direct} mirror={use_mirror}"
            assert run.token_ids == reference.token_ids, label
            assert_same_logits(run.logits, reference.logits, label)
        assert pinned_somewhere, "no budget left room for a pinned set"

    def test_placement_changes_nothing(self, backend, case_name, tmp_path_factory):
        """The promise: every placement gives bit-identical logits and tokens."""
        fx = self._fixture(case_name, tmp_path_factory)
        runs = {}
        for name, options in placements(fx, backend).items():
            with colibri_core.load(fx.path, backend=backend, **options) as model:
                runs[name] = model.generate(token_ids=fx.prompt, max_tokens=8, ignore_eos=True, return_logits=True)
        reference = runs.pop("resident")
        for name, run in runs.items():
            assert run.token_ids == reference.token_ids, name
            assert_same_logits(run.logits, reference.logits, f"{name}: logits are not bit-identical to all-resident")

    def test_prompt_in_pieces_matches_prompt_at_once(self, backend, case_name, tmp_path_factory):
        """Feeding a sequence in pieces (a prefix, single tokens, a chunk, then decoding
        token by token) gives the logits and per-layer state of feeding it at once: KV
        caches and recurrent states carry everything between forward passes, and chunked
        and stepwise forms of a layer agree."""
        fx = self._fixture(case_name, tmp_path_factory)
        ids = fx.prompt + fx.tokens
        first = max(1, len(fx.prompt) // 3)
        cuts = [first, first + 1, first + 2, first + 3, len(fx.prompt)] + list(range(len(fx.prompt) + 1, len(ids) + 1))
        with colibri_core.load(fx.path, history=False, backend=backend) as model:
            lm, ops = model.lm, model.backend
            bound = self.bound(model, self.pieces_tolerance)
            whole = lm.new_cache(ops)
            at_once = lm.forward(np.asarray(ids), whole, ops, all_logits=True)
            pieces, start, parts = lm.new_cache(ops), 0, []
            for end in sorted(set(c for c in cuts if 0 < c <= len(ids))):
                parts.append(lm.forward(np.asarray(ids[start:end]), pieces, ops, all_logits=True))
                start = end
            in_pieces = np.concatenate(parts, axis=0)
            assert whole.length == pieces.length == len(ids)
            worst = float(np.abs(in_pieces - at_once).max())
            assert worst < bound, f"logits differ by {worst:.2e}"
            for i, (a, b) in enumerate(zip(whole.layers, pieces.layers)):
                for name, (x, y) in _state_pairs(a, b, ops).items():
                    worst = float(np.abs(x - y).max()) if x.size else 0.0
                    assert worst < bound, f"layer {i} {name}: state differs by {worst:.2e}"

    def test_small_prefill_chunks_match_transformers(self, backend, case_name, tmp_path_factory, monkeypatch):
        """A prompt prefilled in many small chunks still gives transformers' tokens."""
        from colibri_core.engine import generation

        monkeypatch.setattr(generation, "PREFILL_CHUNK", 5)
        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path, cap=1, history=False, backend=backend) as model:
            result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
            forced = model.logits(fx.prompt + fx.tokens[:-1])
            bound = self.bound(model)
        assert result.token_ids == fx.tokens
        worst = max(float(np.abs(np.stack(result.logits) - fx.step_logits).max()), float(np.abs(forced - fx.full_logits).max()))
        assert worst < bound, f"logits differ by {worst:.2e}"

class FusedLayoutCheck:
    """Mix into a FamilyOracleSuite whose model type also ships (or transformers saves)
    fused experts; set ``fused_case`` to the case to rewrite in that layout."""

    fused_case: str = ""

    def test_fused_expert_layout_matches_transformers(self, backend, tmp_path_factory):
        """The experts of ``fused_case`` rewritten as transformers 5 keeps them in memory
        (``experts.gate_up_proj`` / ``experts.down_proj``, the layout some published
        checkpoints use): transformers loads them to the same logits, and colibri, streaming
        one cached expert per layer, gives its tokens and logits."""
        fx = self._fixture(self.fused_case, tmp_path_factory)
        fused = tmp_path_factory.mktemp("fused") / "model"
        assert fuse_experts(fx.path, fused) > 0
        self.check_rewritten(fx, fused, backend, "the fused checkpoint")


def save_in_memory_layout(model_class: str, src: Path, dst: Path) -> set[str]:
    """The model saved at ``src`` written to ``dst`` under the tensor names and layout
    transformers keeps it in memory (its state dict: fused experts where it fuses them),
    one safetensors file; returns the names."""
    import torch
    import transformers
    from safetensors.torch import save_file

    model = getattr(transformers, model_class).from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    dst.mkdir(parents=True)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return set(state)


def fuse_experts(src: Path, dst: Path) -> int:
    """Copy a saved model, rewriting per-expert ``...experts.{e}.{gate,up,down}_proj.weight``
    into fused ``...experts.gate_up_proj`` (E, 2I, H; gate rows first) and
    ``...experts.down_proj`` (E, H, I), all in one safetensors file, each tensor in its
    stored dtype. Returns the number of expert layers fused."""
    from colibri_core.io.checkpoint import Checkpoint
    from colibri_core.io.safetensors import write_safetensors

    with Checkpoint(src) as ck:
        dtypes = {name: info.dtype for name, info in ck.tensors.items()}
        tensors = {name: ck.read(name) for name in ck.tensors}
    pattern = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    out = {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if m:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[name] = t
    for prefix, roles in groups.items():
        n = len(roles["down"])
        dtype = dtypes[f"{prefix}.0.down_proj.weight"]
        out[f"{prefix}.gate_up_proj"] = np.stack([np.concatenate([roles["gate"][e], roles["up"][e]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = np.stack([roles["down"][e] for e in range(n)])
        dtypes[f"{prefix}.gate_up_proj"] = dtypes[f"{prefix}.down_proj"] = dtype
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    write_safetensors(dst / "model.safetensors", {name: (dtypes[name], t) for name, t in out.items()}, {"format": "pt"})
    return len(groups)


def _state_pairs(a, b, ops) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Host arrays of two per-layer states of the same kind, by name."""
    if hasattr(a, "parts"):  # LayerStates: each part's, under its slot name
        return {f"{slot}.{name}": pair for slot in a.parts
                for name, pair in _state_pairs(a.parts[slot], b.parts[slot], ops).items()}
    if hasattr(a, "window") and hasattr(a, "kept"):  # SlidingKVCache: the positions a later query still sees
        n = min(a.kept, b.kept, a.window - 1)
        return {"keys": (ops.to_host(a._k[:, a.kept - n : a.kept]), ops.to_host(b._k[:, b.kept - n : b.kept])),
                "values": (ops.to_host(a._v[:, a.kept - n : a.kept]), ops.to_host(b._v[:, b.kept - n : b.kept]))}
    if hasattr(a, "arrays"):  # RecurrentState
        return {name: (ops.to_host(a[name]), ops.to_host(b[name])) for name in a.arrays}
    if hasattr(a, "_k"):  # KVCache
        n = a.length
        return {"keys": (ops.to_host(a._k[:, :n]), ops.to_host(b._k[:, :n])),
                "values": (ops.to_host(a._v[:, :n]), ops.to_host(b._v[:, :n]))}
    return {}
