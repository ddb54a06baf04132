"""The Python API.

    import colibri_core as colibri
    model = colibri.load("path/to/model", ram="4G")
    result = model.generate("The capital of France is", max_tokens=32)
    print(result.text, result.stats.decode_tok_s)
    for event in model.stream(token_ids=[1, 2, 3], max_tokens=8):
        print(event.token_id)
    logits = model.logits([1, 2, 3])  # (3, vocab) float32

The CLI is a thin layer over this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from colibri_core.model.blueprint import Blueprint, inspect_model
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.model.config import eos_token_ids
from colibri_core.errors import UsageError, option
from colibri_core.io.drives import Drive, MirrorSpec, measure_bandwidth, validate_mirror
from colibri_core.io.integrity import MANIFEST_NAME, Manifest
from colibri_core.experts.history import RoutingHistory
from colibri_core.experts.prefetch import Prefetcher
from colibri_core.experts.store import ExpertStore, PinPolicy
from colibri_core.compute.backend import Backend
from colibri_core.engine.generation import Generation, GenerationResult, TokenEvent
from colibri_core.nn.layers import CausalLM
from colibri_core.engine.math_libraries import reserve as reserve_math_libraries
from colibri_core.model.placement import Placement, budget_beyond_memory
from colibri_core.formats.base import QuantTensor
from colibri_core.plugins.discovery import create_backend, get_registry
from colibri_core.plugins.registry import Entry, import_object
from colibri_core.engine.sampling import SamplingParams, check_max_tokens
from colibri_core.engine.state import SequenceState, bind, check_saveable, load_state, resumed_sampler
from colibri_core.engine.speculative import (DEFAULT_DRAFT_DEPTH, DraftGate, Speculation, check_depth,
                                             open_draft_source)
from colibri_core.model.tokenizer import Tokenizer
from colibri_core.units import parse_size
from colibri_core.warn import warn


@dataclass
class LoadProgress:
    """Callbacks for long loads: ``start(total, what, unit)`` (unit: "bytes" or "experts")
    then ``advance(n)`` in that unit."""

    start: Callable[[int, str], None]
    advance: Callable[[int], None]


@dataclass(kw_only=True, eq=False, repr=False)
class Model:
    """A loaded model: family, weights placed, tokenizer (if any), ready to generate."""

    model_dir: Path
    config: dict
    family: Entry
    lm: CausalLM
    backend: Any
    checkpoint: Checkpoint
    store: ExpertStore | None
    placement: Placement
    tokenizer: Tokenizer | None
    eos_ids: list[int]
    load_seconds: float
    dense_bytes_read: int
    _draft_sources: dict[str, Any] = field(default_factory=dict, init=False)  # name -> DraftSource built for it

    # -- information -----------------------------------------------------------------
    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def resident_bytes(self) -> int:
        """Dense weights + experts held in the RAM and device tiers."""
        return self.placement.dense_bytes + (self.store.resident_bytes if self.store else 0)

    @property
    def device_resident_bytes(self) -> int:
        """Weights in the backend's own memory: the dense weights and the device tier's experts."""
        if self.placement.device is None:
            return 0
        return self.placement.dense_bytes + (self.store.device_resident_bytes if self.store else 0)

    def store_counters(self) -> dict:
        """Cumulative expert-store counters (the generation loop reports differences)."""
        syncs = {"host_syncs": self.backend.host_syncs}
        if self.store is None:
            return {"bytes_by_drive": {}, **syncs}
        disk = self.store.disk
        compute = self.store.compute.counters() if self.store.compute is not None else {}
        return {**self.store.stats.snapshot(), "bytes_by_drive": {d.name: d.bytes_read for d in disk.drives},
                "reads": disk.reads, **syncs, "compute": compute}

    # -- text ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UsageError(f"{self.model_dir} has no tokenizer.json: give token ids instead of text")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise UsageError(f"{self.model_dir} has no tokenizer.json: cannot turn token ids into text")
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        if self.tokenizer is None:
            raise UsageError(f"{self.model_dir} has no tokenizer.json: chat needs a tokenizer")
        return self.tokenizer.render_chat(messages)

    def _prompt_ids(self, prompt, token_ids, messages) -> list[int]:
        given = [x is not None for x in (prompt, token_ids, messages)]
        if sum(given) != 1:
            raise UsageError("give exactly one of prompt text, token_ids or messages")
        if token_ids is not None:
            return [int(t) for t in token_ids]
        if messages is not None:
            text = self.chat_prompt(messages)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.encode(prompt)

    # -- generation ------------------------------------------------------------------
    def stream(self, prompt: str | None = None, *, token_ids: list[int] | None = None,
               messages: list[dict[str, Any]] | None = None, max_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
               ignore_eos: bool = False, return_logits: bool = False,
               prefill_progress: Callable[[int, int], None] | None = None, draft: Any = None,
               draft_depth: int = DEFAULT_DRAFT_DEPTH, keep_state: bool = False, constraint: Any = None) -> Generation:
        """Start generating; iterate the returned Generation for TokenEvents, then call
        its ``result()`` for the token ids, text and statistics. ``prefill_progress(done,
        total)`` is told how many prompt tokens are through the model, layer by layer.
        ``logit_bias``, the penalties and ``logprobs`` as OpenAI's (colibri_core.engine.sampling).
        ``draft``: a draft source for speculative decoding, by name (``"ngram"``; None or
        ``"off"``: none) or as an object (``colibri_core.engine.speculative.DraftSource``),
        up to ``draft_depth`` drafted tokens per forward pass; the tokens are the same
        with or without. ``keep_state``: the result's ``state`` is the sequence's state
        (a ``SequenceState``: ``state.save(path)``, then ``resume``), see docs/state.md.
        ``constraint``: what the output must fit (``colibri_core.engine.constraints.ConstraintSpec``:
        a JSON Schema, a regex, a Lark or GBNF grammar); the grammar's end stops it (docs/structured.md)."""
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                  logit_bias=logit_bias, logprobs=logprobs)
        check_max_tokens(max_tokens)
        ids = self._prompt_ids(prompt, token_ids, messages)
        stop = frozenset() if ignore_eos else frozenset(self.eos_ids)
        if keep_state:
            self._check_keep_state(draft, constraint)
        speculation = self.speculation(draft, draft_depth)
        return Generation(self, ids, max_tokens, sampling, stop, return_logits, prefill_progress, speculation,
                          keep_state=keep_state, constraint=self.constraint(constraint))

    def constraint(self, constraint: Any):
        """``constraint`` (a ``ConstraintSpec``, or one already compiled for this model)
        compiled for this model; None stays None."""
        from colibri_core.engine.constraints import CompiledConstraint, ConstraintSpec, for_model

        if constraint is None or isinstance(constraint, CompiledConstraint):
            return constraint
        if not isinstance(constraint, ConstraintSpec):
            raise UsageError(f"{option('constraint')}: a colibri_core.engine.constraints.ConstraintSpec, got "
                             f"{type(constraint).__name__}")
        return for_model(self, constraint)

    # -- saved sequences (colibri_core.engine.state, docs/state.md) ------------------------
    def _check_keep_state(self, draft: Any, constraint: Any = None) -> None:
        if draft is not None and draft != "off":
            raise UsageError(f"{option('keep_state', keyword=True)} cannot be combined with drafts ({option('draft')}): "
                             "a verification ends with drafted positions in the caches")
        if constraint is not None:
            raise UsageError(f"{option('keep_state', keyword=True)} cannot be combined with a constraint: a saved "
                             "state does not hold the constraint's progress, so a resumed run would be unconstrained")
        check_saveable(self.lm.new_cache(self.backend))

    def load_state(self, path: str | Path) -> SequenceState:
        """Read a saved state and check it against this model (identity, context, vocabulary,
        every layer's kind and shapes); a one-line error naming the file otherwise."""
        state = load_state(path)
        bind(state, self)
        return state

    def resume_stream(self, state: str | Path | SequenceState, *, max_tokens: int = 128, ignore_eos: bool | None = None,
                      return_logits: bool = False, draft: Any = None, draft_depth: int = DEFAULT_DRAFT_DEPTH, keep_state: bool = False,
                      **sampling) -> Generation:
        """Continue a saved sequence (a path, or a ``SequenceState``) for up to ``max_tokens``
        more tokens, without computing its prompt again: the saved caches hold every token
        but the last, which is fed first. The sampling parameters and ``ignore_eos`` are the
        saved ones unless given (``temperature``, ``top_p``, ``top_k``, ``seed``, the
        penalties, ``logit_bias``, ``logprobs``); the sampler's random generator continues
        where it stopped unless another ``seed`` is given. The result's ``token_ids`` are
        the new tokens."""
        saved = load_state(state)
        check_max_tokens(max_tokens)
        unknown = set(sampling) - set(SamplingParams().as_dict())
        if unknown:
            raise UsageError(f"resume: unknown keyword {sorted(unknown)[0]!r}")
        if keep_state:
            self._check_keep_state(draft)
        cache = bind(saved, self)
        params, sampler = resumed_sampler(saved, sampling)
        ignore = saved.ignore_eos if ignore_eos is None else ignore_eos
        stop = frozenset() if ignore else frozenset(self.eos_ids)
        speculation = self.speculation(draft, draft_depth)
        return Generation(self, list(saved.token_ids), max_tokens, params, stop, return_logits, None, speculation,
                          keep_state=keep_state, resume=(saved, cache, sampler))

    def resume(self, state: str | Path | SequenceState, **kwargs) -> GenerationResult:
        """Continue a saved sequence to completion. Same arguments as ``resume_stream``."""
        return self.resume_stream(state, **kwargs).run()

    def speculation(self, draft: Any, depth: int = DEFAULT_DRAFT_DEPTH) -> Speculation | None:
        """A new sequence's drafting with the draft source ``draft``: a name (None or
        "off": none) or a ``DraftSource``."""
        if draft is None or draft == "off":
            return None
        check_depth(depth)
        probe = self.lm.new_cache(self.backend)
        if not (probe.rewindable() or probe.restorable()):
            raise UsageError(f"{option('draft')}: this model's sequence state cannot go back to an earlier position, "
                             "which verifying drafts needs; run it without drafts")
        if isinstance(draft, str):
            source = self._draft_sources.get(draft)
            if source is None:
                source = self._draft_sources[draft] = open_draft_source(draft, self)
            inner = getattr(source, "name", draft)  # auto says which source it picked
            name = draft if inner == draft else f"{draft} ({inner})"
        else:
            source, name = draft, getattr(draft, "name", type(draft).__name__)
        gate = DraftGate() if getattr(source, "gated", False) else None
        return Speculation(self.lm, self.backend, source.new_drafter(), depth, name, gate)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Generate to completion. Same arguments as ``stream``."""
        return self.stream(prompt, **kwargs).run()

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Next-token logits after every position of ``token_ids``: (T, vocab) float32."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise UsageError("logits() needs at least one token id")
        if len(ids) > self.lm.max_context:
            raise UsageError(f"{len(ids)} tokens do not fit the context of {self.lm.max_context}")
        self.lm.check_prompt(ids)
        cache = self.lm.new_cache(self.backend)
        from colibri_core.engine.generation import PREFILL_CHUNK

        chunks = [self.lm.forward(np.asarray(ids[i : i + PREFILL_CHUNK]), cache, self.backend, all_logits=True)
                  for i in range(0, len(ids), PREFILL_CHUNK)]
        if self.store is not None:
            self.store.after_tokens(len(ids))
        return np.concatenate(chunks, axis=0)

    def close(self) -> None:
        """Stop the prefetch pool, save the routing history, close the files."""
        if self.store is not None:
            self.store.close()
            self.store = None
        self.checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_backend(name: str | Backend, vram: int | str | None = None):
    """The installed backend ``name`` (or ``name`` itself, a ``Backend`` instance) and the
    ``--vram`` budget in bytes, checked before anything is loaded: an unknown or
    unavailable backend, or a device budget for a backend without device memory, is a
    one-line UsageError."""
    backend = name if isinstance(name, Backend) else create_backend(get_registry(), name)
    budget = parse_size(vram) if vram is not None else None
    if budget is not None and backend.device_memory() is None:
        raise UsageError(f"{option('vram')}: backend {backend.name!r} has no device memory (its experts live in RAM: "
                         f"use {option('ram')})")
    return backend, budget


def check_load_options(*, cap=None, pin="auto", pin_share=0.5, prefetch_slots=None, prefetch_window=None,
                       history=True, history_decay=1.0) -> None:
    """The placement options of ``load``, checked before anything is read."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if pin not in ("auto", "on", "off"):
        raise UsageError(f"{option('pin')} must be 'auto', 'on' or 'off', got {pin!r}")
    if history not in (True, False, "read"):
        raise UsageError(f"history must be True, False or 'read', got {history!r}")
    if not is_number(history_decay) or not 0 < history_decay <= 1:
        raise UsageError(f"{option('history_decay')} must be in (0, 1], got {history_decay!r}")
    if cap is not None and (not is_int(cap) or cap < 0):
        raise UsageError(f"{option('cap')} must be an integer >= 0, got {cap!r}")
    if not is_number(pin_share) or not 0 <= pin_share < 1:
        raise UsageError(f"{option('pin_share')} must be in [0, 1), got {pin_share!r}")
    if prefetch_slots is not None and (not is_int(prefetch_slots) or prefetch_slots < 1):
        raise UsageError(f"{option('prefetch_slots')} must be an integer >= 1 (experts read ahead per layer), "
                         f"got {prefetch_slots!r}")
    if prefetch_window is not None:
        if prefetch_slots is not None:
            raise UsageError(f"{option('prefetch_slots')} and {option('prefetch_window')} both bound the read-ahead: "
                             "give one of them")
        try:
            if not isinstance(prefetch_window, str) and not is_int(prefetch_window):
                raise UsageError("not a size")
            window = parse_size(prefetch_window)
        except UsageError:
            window = -1
        if window < 1:
            raise UsageError(f"{option('prefetch_window')} must be a size above 0 (bytes, or e.g. 512M), "
                             f"got {prefetch_window!r}")


KV_CACHE_DTYPES = ("float32", "float16")


def set_kv_cache(backend: Backend, dtype: str) -> None:
    """Keep attention keys and values in ``dtype`` on ``backend`` (``load(kv_cache=)``)."""
    if dtype not in KV_CACHE_DTYPES:
        raise UsageError(f"--kv-cache {dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    if dtype not in backend.kv_dtypes:
        raise UsageError(f"--kv-cache {dtype}: the {backend.name} backend keeps keys and values in "
                         f"{' or '.join(backend.kv_dtypes)} only")
    backend.kv_dtype = None if dtype == backend.cache_dtype else dtype


def load(model_dir: str | Path, *, ram: int | str | None = None, cap: int | None = None, backend: str | Backend = "cpu",
         vram: int | str | None = None, preload: bool = False, progress: LoadProgress | None = None,
         direct_io: bool = False, mirrors: tuple = (), pin: str = "auto", pin_share: float = 0.5,
         prefetch: bool = False, prefetch_slots: int | None = None, prefetch_window: int | str | None = None,
         history: bool | str = True,
         history_decay: float = 1.0, verify: bool = False, compute: str | None = None,
         compute_options: dict | None = None, mtp: bool | str = False, mtp_int4: bool = False,
         kv_cache: str = "float32") -> Model:
    """Load a Hugging Face model directory.

    ram: RAM budget for weights (bytes or "4G"); dense weights (on a backend computing
         from RAM) and the RAM tier's experts. Default: 80% of available memory.
    cap: limit the experts held in each tier to N per MoE layer (pinned + LRU).
    backend: compute backend name (see ``colibri list-backends``), or a ``Backend``
         instance (the conformance kit loads models on the backend it tests).
    vram: on a backend with device memory, the device tier's budget for prepared experts
         (default: 80% of the device memory less the dense weights, which live there).
         On unified memory it is the part of ``ram`` the device tier gets (default: all
         the experts' part). An error on a backend without device memory.
    preload: fill the LRUs up to their slots before returning.
    direct_io: read experts with O_DIRECT (aligned reads that bypass the page cache).
    mirrors: read-only copies of the model on other drives: paths, "PATH@BANDWIDTH"
         strings or MirrorSpec objects.
    pin: "auto" (pin the hottest experts once the routing history holds enough tokens),
         "on" or "off"; pin_share is the part of the expert budget they may take.
    prefetch: read the predicted experts of the next layer while this one computes;
         prefetch_slots experts per layer, or as many as prefetch_window bytes hold
         (e.g. "512M"; default: the router's top-k).
    history: True reads and saves the routing history (colibri-usage.json), "read" only
         reads it, False ignores it; history_decay multiplies the saved counts at each save.
    verify: check every read from the model directory against the integrity manifest
         (colibri-integrity.json; reads from mirrors are checked whenever it exists).
    compute: a compute tier (``colibri list-tiers``, role "compute") computing the routed
         experts instead of the backend, e.g. on other machines; compute_options are its
         options. The local store still serves every expert, for the tier to fall back on.
    mtp: also load the checkpoint's multi-token-prediction layers, for the ``mtp`` draft
         source (``generate(draft="mtp")``); they must be int8 or better unless mtp_int4.
         "if-usable": load them where the checkpoint has a usable one (int8 or better, a
         layout its family reads), else go on without (what ``--draft auto`` asks).
    kv_cache: the dtype attention layers keep keys and values in: "float32" (exact, the
         default) or "float16" (half the bytes a decode step reads per position of context,
         at half precision's rounding, as llama.cpp's default cache; backends that take it
         list it in ``kv_dtypes``). MLA latents and recurrent states stay float32.
    """
    check_load_options(cap=cap, pin=pin, pin_share=pin_share, prefetch_slots=prefetch_slots,
                       prefetch_window=prefetch_window, history=history, history_decay=history_decay)
    started = time.perf_counter()
    registry = get_registry()
    compute_tier = _compute_tier(registry, compute) if compute is not None else None
    backend_obj, vram_budget = open_backend(backend, vram)
    set_kv_cache(backend_obj, kv_cache)
    budget = parse_size(ram) if ram is not None else None
    mirror_specs = [m if isinstance(m, MirrorSpec) else MirrorSpec.parse(str(m)) for m in mirrors]
    reserve_math_libraries(backend_obj)  # before the weights take the memory: see math_libraries.py

    bp = inspect_model(model_dir, backend_obj, mtp=mtp, mtp_int4=mtp_int4)
    store = None
    try:
        manifest = Manifest.read(bp.checkpoint) if verify or mirror_specs else None
        if verify:
            if manifest is None:
                raise UsageError(f"--verify: {bp.model_dir} has no integrity manifest ({MANIFEST_NAME}); "
                                 "write one with colibri doctor --deep --write-manifest")
            bp.checkpoint.integrity = manifest
        moe = bp.moe
        main_moe = sum(d.layer < len(bp.lm.layers) for d in moe)  # the history leaves MTP layers out
        routing = (RoutingHistory.open(bp.model_dir, bp.family.spec.name, bp.config.get("model_type"), main_moe,
                                       bp.experts_per_layer) if history and moe else None)
        policy = PinPolicy(mode=pin, share=pin_share)
        pinning = routing is not None and (pin == "on" or (pin == "auto" and routing.total_tokens >= policy.min_tokens))
        slots_ahead = bp.prefetch_slots(prefetch=prefetch, slots=prefetch_slots,
                                        window=parse_size(prefetch_window) if prefetch_window is not None else None)
        placement = bp.placement(ram=budget, cap=cap, pin_share=pin_share if pinning else 0.0,
                                 prefetch_slots=slots_ahead, vram=vram_budget)
        beyond = budget_beyond_memory(budget) if budget is not None else None
        if beyond:
            warn(beyond)

        if progress:
            progress.start(bp.dense_disk_bytes, "dense weights", "bytes")
        dense_read = bp.weights.load_dense(bp.resolver, backend_obj, progress.advance if progress else None)

        if moe:
            drives = _drives(bp, mirror_specs, direct_io, manifest, verify)
            disk_tier, ram_tier = (registry.tier(role).spec.load() for role in ("disk", "ram"))
            device = None
            if placement.device is not None:
                device = _device_tier(registry, backend_obj)(len(moe), placement.device.slots, backend_obj,
                                                              pinned_capacity=placement.device.pinned)
            store = ExpertStore([d.matrices for d in moe], disk_tier(drives, bp.resolver, backend_obj),
                                ram_tier(len(moe), placement.slots, pinned_capacity=placement.pinned), history=routing,
                                pin_policy=policy, io_window=placement.io_window, history_decay=history_decay,
                                save_history=history is True, device=device)
            for experts in bp.lm.routed_experts():
                experts.store = store
            if compute_tier is not None:
                store.compute = compute_tier.open(bp.model_dir, bp, backend_obj, store, dict(compute_options or {}))
            if store.pinned_capacity:
                if progress:
                    progress.start(store.pinned_capacity, "pinned experts", "experts")
                store.apply_pins(progress=(lambda: progress.advance(1)) if progress else None)
            if slots_ahead and store.compute is None:  # a compute tier reads its experts where it computes them
                if placement.slots == 0:  # a read ahead borrows an LRU slot of its layer: there is none
                    warn(f"{option('prefetch')}: the RAM budget leaves no LRU slot per layer for a read ahead "
                         f"to borrow, so nothing will be read ahead; give a larger {option('ram')}")
                bp.lm.prefetcher = Prefetcher(bp.lm, store, slots_ahead)
            if preload:
                if progress:
                    progress.start(store.warm_slots * len(moe), "experts", "experts")
                store.warm(progress=(lambda: progress.advance(1)) if progress else None)
        elif compute_tier is not None:
            raise UsageError(f"compute tier {compute!r}: {bp.model_dir} has no routed experts to compute")
        expert_kinds = {bp.resolver.format_for(i).kernel for d in moe for i in d.matrices[0].values()}
        backend_obj.placed(any(isinstance(p.value, QuantTensor) for p in bp.weights.params.values())
                           or any(k is not None and backend_obj.keeps_stored(k, "linear") for k in expert_kinds))
        tokenizer = Tokenizer.from_dir(bp.model_dir)
        eos = eos_token_ids(bp.model_dir, bp.config)
    except BaseException:
        if store is not None:
            if store.compute is not None:
                store.compute.close()
            store.disk.close()
        bp.close()
        raise
    return Model(model_dir=bp.model_dir, config=bp.config, family=bp.family, lm=bp.lm, backend=backend_obj,
                 checkpoint=bp.checkpoint, store=store, placement=placement, tokenizer=tokenizer, eos_ids=eos,
                 load_seconds=time.perf_counter() - started, dense_bytes_read=dense_read)


def _compute_tier(registry, name: str):
    """The compute tier class registered as ``name`` (role "compute")."""
    entry = registry.get("tier", name)
    if entry.spec.role != "compute":
        computing = ", ".join(e.spec.name for e in registry.all("tier") if e.spec.role == "compute") or "none installed"
        raise UsageError(f"tier {name!r} plays the role {entry.spec.role!r}, not 'compute' (compute tiers: {computing})")
    return entry.spec.load()


def _device_tier(registry, backend):
    """The device tier class: the backend's own, else the registered one."""
    own = backend.device_tier
    if own is None:
        return registry.tier("device").spec.load()
    return import_object(own) if isinstance(own, str) else own


def _drives(bp: Blueprint, mirrors: list[MirrorSpec], direct_io: bool, manifest, verify: bool) -> list[Drive]:
    """The primary (its reads checked against ``manifest`` with ``verify``) and the usable
    mirrors (their reads always checked against it, when there is one)."""
    files = {sf.path: sf for sf in bp.checkpoint.files.values()}
    drives = [Drive("primary", {path: path for path in files}, direct=direct_io, integrity=manifest if verify else None)]
    for spec in mirrors:
        usable, skipped = validate_mirror(files, spec)
        for reason in skipped:
            warn(f"mirror shard not used: {reason}")
        if not usable:
            warn(f"mirror {spec.path} holds no usable shard of this model; not used")
            continue
        drives.append(Drive(str(spec.path), usable, direct=direct_io, bandwidth=spec.bandwidth, integrity=manifest))
    if len(drives) > 1:
        for drive in drives:
            if drive.bandwidth is None:
                drive.bandwidth = measure_bandwidth(drive)
    return drives


__all__ = ["Blueprint", "GenerationResult", "LoadProgress", "Model", "SequenceState", "TokenEvent", "inspect_model", "load",
           "open_backend"]
