"""Chunked attention (Llama 4's ``attention_chunk_size``) and per-position query scales
(Llama 4's attention temperature tuning), two options of ``nn.layers.Attention``.

Chunked attention cuts the sequence into chunks of ``chunk`` positions counted from
position 0: the query at position p sees the keys at positions c..p, c = p - p % chunk
(the start of its chunk), itself included. Every such key is among the last ``chunk``
positions, so the layer's cache is a sliding window of ``chunk`` positions
(``SlidingKVCache``, bounded by the chunk, not the sequence). A step's queries are cut
where a chunk begins, and each piece is plain causal attention (``Backend.attention``)
over the rows of its chunk: every backend runs it with its own attention kernel, and no
operation is added to the compute contract."""

from __future__ import annotations

from typing import Callable

import numpy as np


def chunk_pieces(start: int, t: int, chunk: int) -> list[tuple[int, int, int]]:
    """The queries of a step (positions start .. start + t - 1) cut where chunks begin:
    (first row, end row, position of the chunk's start) per piece."""
    if chunk < 1:
        raise ValueError(f"attention chunk must be >= 1, got {chunk}")
    pieces, i = [], 0
    while i < t:
        p = start + i
        begin = p - p % chunk
        end = min(t, begin + chunk - start)
        pieces.append((i, end, begin))
        i = end
    return pieces


def chunked_attention(ops, q, keys, values, start: int, first: int, scale: float, chunk: int):
    """Chunked causal attention. q (T, Hq, D) are the queries at positions start ..
    start + T - 1; keys and values (Hkv, S, D / Dv) the rows a cache returned, row j at
    position ``first`` + j (``first`` at most the start of the first query's chunk: a
    ``SlidingKVCache`` of ``chunk`` positions holds it). Returns (T, Hq, Dv)."""
    outs = []
    for i, end, begin in chunk_pieces(start, q.shape[0], chunk):
        a, b = begin - first, start + end - first
        if a < 0:
            raise ValueError(f"chunked attention: the keys start at position {first}, after the chunk start {begin}")
        outs.append(ops.attention(q[i:end], keys[:, a:b], values[:, a:b], start + i - begin, scale))
    return outs[0] if len(outs) == 1 else ops.concat(outs, 0)


def query_scales(fn: Callable[[np.ndarray], np.ndarray], step):
    """``fn``'s factor for each of the step's positions as a backend (T, 1, 1) array that
    multiplies the queries (T, heads, dim); computed once per step and shared by the
    layers given the same ``fn``."""
    key = ("query_scale", id(fn))
    scales = step.memo.get(key)
    if scales is None:
        host = np.asarray(fn(np.asarray(step.positions)), dtype=np.float32).reshape(-1, 1, 1)
        if host.shape[0] != len(step.positions):
            raise ValueError(f"a query scale gave {host.shape[0]} factors for {len(step.positions)} positions")
        scales = step.memo[key] = step.ops.asarray(np.ascontiguousarray(host))
    return scales


def temperature_tuning(floor_scale: float, attn_scale: float) -> Callable[[np.ndarray], np.ndarray]:
    """Llama 4's attention temperature tuning of NoPE layers (transformers'
    ``Llama4TextAttention``): the query at position p is multiplied by
    log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, in float32 as transformers
    computes it."""
    if not floor_scale > 0:
        raise ValueError(f"temperature tuning needs floor_scale > 0, got {floor_scale}")
    floor_scale, attn_scale = np.float32(floor_scale), np.float32(attn_scale)

    def scales(positions: np.ndarray) -> np.ndarray:
        p = np.asarray(positions).astype(np.float32)
        return (np.log1p(np.floor((p + np.float32(1.0)) / floor_scale)) * attn_scale + np.float32(1.0)).astype(np.float32)

    return scales
