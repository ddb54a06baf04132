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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .checkpoint import Checkpoint
from .config import eos_token_ids, read_json
from .errors import ColibriError, ModelFormatError, UsageError
from .experts.store import ExpertStore
from .experts.tiers import DiskTier, RamTier
from .generation import Generation, GenerationResult, TokenEvent
from .nn.layers import CausalLM
from .nn.weights import Weights
from .placement import Placement, plan
from .plugins import get_registry
from .quant import FormatResolver
from .registry import Entry
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .units import parse_size

BACKEND_BYTES_PER_PARAM = 4  # the CPU backend computes in float32


@dataclass
class LoadProgress:
    """Callbacks for long loads: ``start(total_bytes, what)`` then ``advance(n)``."""

    start: Callable[[int, str], None]
    advance: Callable[[int], None]


class Model:
    """A loaded model: family, weights placed, tokenizer (if any), ready to generate."""

    def __init__(self, *, model_dir: Path, config: dict, family: Entry, lm: CausalLM, backend, checkpoint: Checkpoint,
                 store: ExpertStore | None, placement: Placement, tokenizer: Tokenizer | None, eos_ids: list[int],
                 load_seconds: float, dense_bytes_read: int):
        self.model_dir = model_dir
        self.config = config
        self.family = family
        self.lm = lm
        self.backend = backend
        self.checkpoint = checkpoint
        self.store = store
        self.placement = placement
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.load_seconds = load_seconds
        self.dense_bytes_read = dense_bytes_read

    # -- information -----------------------------------------------------------------
    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def resident_bytes(self) -> int:
        return self.placement.dense_bytes + (self.store.resident_bytes if self.store else 0)

    def store_counters(self) -> dict[str, int]:
        if self.store is None:
            return {"hits": 0, "misses": 0, "bytes_read": 0, "reads": 0}
        return {"hits": self.store.stats.hits, "misses": self.store.stats.misses,
                "bytes_read": self.store.disk.bytes_read, "reads": self.store.disk.reads}

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
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
               return_logits: bool = False) -> Generation:
        """Start generating; iterate the returned Generation for TokenEvents, then call
        its ``result()`` for the token ids, text and statistics."""
        ids = self._prompt_ids(prompt, token_ids, messages)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        stop = frozenset() if ignore_eos else frozenset(self.eos_ids)
        return Generation(self, ids, max_tokens, sampling, stop, return_logits)

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
        bad = [t for t in ids if not 0 <= t < self.lm.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{self.lm.vocab_size - 1})")
        self.lm.check_prompt(ids)
        cache = self.lm.new_cache(self.backend)
        from .generation import PREFILL_CHUNK

        chunks = [self.lm.forward(np.asarray(ids[i : i + PREFILL_CHUNK]), cache, self.backend, all_logits=True)
                  for i in range(0, len(ids), PREFILL_CHUNK)]
        return np.concatenate(chunks, axis=0)

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(model_dir: str | Path, *, ram: int | str | None = None, cap: int | None = None, backend: str = "cpu",
         preload: bool = False, progress: LoadProgress | None = None) -> Model:
    """Load a Hugging Face model directory.

    ram: RAM budget for weights (bytes or "4G"); dense weights are resident and what is
         left becomes expert cache. Default: 80% of available memory.
    cap: at most this many cached experts per MoE layer.
    backend: compute backend name (see ``colibri list-backends``).
    preload: fill the expert cache up to its slots before returning.
    """
    started = time.perf_counter()
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir}: not a directory")
    config = read_json(model_dir / "config.json", "model config")
    registry = get_registry()
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise ModelFormatError(f"{model_dir / 'config.json'}: 'architectures' must be a list of strings")
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFormatError(f"{model_dir / 'config.json'}: 'model_type' must be a string")
    family_entry = registry.family_for(model_type, architectures)
    backend_obj = _backend(registry, backend)
    budget = parse_size(ram) if ram is not None else None

    checkpoint = Checkpoint(model_dir)
    try:
        family = family_entry.spec.load()()
        weights = Weights(checkpoint)
        lm = family.build(config, weights)
        resolver = FormatResolver(registry, checkpoint, config)
        for p in weights.params.values():
            resolver.format_for(p.info)
        for decl in weights.experts:
            for info in decl.matrices[0].values():
                resolver.format_for(info)

        moe = weights.experts
        experts_per_layer = max((d.count for d in moe), default=0)
        expert_bytes = max((d.numel_per_expert for d in moe), default=0) * BACKEND_BYTES_PER_PARAM
        placement = plan(dense_bytes=weights.dense_numel * BACKEND_BYTES_PER_PARAM, expert_bytes=expert_bytes,
                         moe_layers=len(moe), experts_per_layer=experts_per_layer, ram=budget, cap=cap)

        if progress:
            progress.start(sum(p.info.nbytes for p in weights.params.values()), "dense weights")
        dense_read = weights.load_dense(resolver, backend_obj, progress.advance if progress else None)

        store = None
        if moe:
            for i, decl in enumerate(moe):
                decl.moe_index = i
            store = ExpertStore([d.matrices for d in moe], DiskTier(checkpoint, resolver, backend_obj),
                                RamTier(len(moe), placement.slots))
            for experts in lm.routed_experts():
                experts.store = store
            if preload:
                if progress:
                    progress.start(placement.slots * len(moe), "experts")
                store.warm(progress=(lambda: progress.advance(1)) if progress else None)
        tokenizer = Tokenizer.from_dir(model_dir)
        eos = eos_token_ids(model_dir, config)
    except BaseException:
        checkpoint.close()
        raise
    return Model(model_dir=model_dir, config=config, family=family_entry, lm=lm, backend=backend_obj,
                 checkpoint=checkpoint, store=store, placement=placement, tokenizer=tokenizer, eos_ids=eos,
                 load_seconds=time.perf_counter() - started, dense_bytes_read=dense_read)


def _backend(registry, name: str):
    entry = registry.get("backend", name)
    reason = entry.spec.unavailable_reason()
    if reason:
        raise ColibriError(f"backend {name!r} is not available here: {reason}")
    return entry.spec.load()()


__all__ = ["GenerationResult", "LoadProgress", "Model", "TokenEvent", "load"]
