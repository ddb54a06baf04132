"""Launch geometry and the limits the kernel sources assume, in plain Python (tested
without a GPU). The constants repeat the sources' #defines; tests/test_cuda_sources.py
checks that they agree."""

from __future__ import annotations

from dataclasses import dataclass

WARP = 32
GEMV_MAX_TOKENS = 8  # common.cuh: tokens one matrix-vector launch computes
ROWS_PER_BLOCK = 4  # common.cuh: output rows per block (a warp each)
# above this many tokens a packed product decodes the weight once and multiplies in cuBLAS
GEMV_TOKEN_LIMIT = 16
ATTENTION_THREADS = 128
ATTENTION_MAX_CHUNK = 1024  # attention.cu: keys one block scores (shared memory)
ATTENTION_MAX_DIM = 1024  # attention.cu: query features held in shared memory
ATTENTION_MIN_CHUNK = 64  # fewer keys per block than this costs more in launches than it gains
NORM_THREADS = 256
ROUTER_THREADS = 128
ROUTER_MAX_EXPERTS = 4096
ELEMENTWISE_THREADS = 256
DELTA_THREADS = 128  # delta.cu: value columns per block
EXPERT_WINDOW_LIMIT = 64  # experts of one fused launch at most (the pointer table is uploaded per launch)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def token_slices(tokens: int) -> list[tuple[int, int]]:
    """(first, end) slices of at most GEMV_MAX_TOKENS tokens covering ``tokens``."""
    return [(t, min(tokens, t + GEMV_MAX_TOKENS)) for t in range(0, tokens, GEMV_MAX_TOKENS)]


def gemv_grid(rows: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of a matrix-vector launch over ``rows`` output rows."""
    return (ceil_div(rows, ROWS_PER_BLOCK), 1, 1), (ROWS_PER_BLOCK * WARP, 1, 1)


def uses_gemv(tokens: int) -> bool:
    """Whether a packed product of this many tokens runs in the matrix-vector kernels
    (else: decode to float32 once, then cuBLAS)."""
    return tokens <= GEMV_TOKEN_LIMIT


def elementwise_grid(count: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return (max(1, ceil_div(count, ELEMENTWISE_THREADS)), 1, 1), (ELEMENTWISE_THREADS, 1, 1)


@dataclass(frozen=True)
class AttentionSplit:
    splits: int
    chunk: int  # keys per split: splits * chunk >= S > (splits - 1) * chunk


def attention_split(seq: int, heads: int, tokens: int, multiprocessors: int) -> AttentionSplit:
    """How ``attention_split`` divides S keys: enough blocks to fill the GPU about twice
    (``multiprocessors``), no split longer than ATTENTION_MAX_CHUNK, none shorter than
    ATTENTION_MIN_CHUNK unless the sequence is, and no empty split."""
    if seq < 1:
        raise ValueError(f"attention over {seq} keys")
    wanted = max(1, ceil_div(2 * multiprocessors, max(1, heads * tokens)))
    chunk = max(ATTENTION_MIN_CHUNK, ceil_div(seq, wanted))
    chunk = min(chunk, ATTENTION_MAX_CHUNK, seq)
    return AttentionSplit(ceil_div(seq, chunk), chunk)


def delta_grid(value_heads: int, value_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of gated_delta_step: a thread per (value head, value column)."""
    return (ceil_div(value_dim, DELTA_THREADS), value_heads, 1), (DELTA_THREADS, 1, 1)


def rows_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether a (heads, S, D) array has contiguous rows of D and S rows after one
    another in each head, heads any (non-negative) distance apart: what attention_split reads."""
    heads, seq, dim = shape
    return (strides[2] == itemsize or dim <= 1) and (strides[1] == dim * itemsize or seq <= 1) and strides[0] >= 0 \
        and strides[0] % itemsize == 0


def attention_fits(head_dim: int) -> bool:
    return head_dim <= ATTENTION_MAX_DIM


def router_fits(experts: int, k: int) -> bool:
    return 0 < k <= experts <= ROUTER_MAX_EXPERTS
