// Causal attention split over the sequence (flash-decoding), float32.
//
// q (T, Hq, D) contiguous; k (Hkv, S, D) and v (Hkv, S, Dv) with contiguous rows, head h
// starting k_heads * h (v_heads * h) floats in: the KV cache's view, uncopied (its
// capacity is larger than S). Query t sits at position
// start + t and sees keys 0 .. start + t; query head h reads KV head h / (Hq / Hkv).
//
//   attention_split:   grid (splits, Hq, T), ATTENTION_THREADS threads. Block (c, h, t)
//       scores keys c*chunk .. c*chunk + chunk - 1 (one warp per key, lanes over D), and
//       writes its partial result: m (the largest visible score, -inf if none), l (the
//       sum of exp(score - m)) and o[d] = sum exp(score - m) * v[d].
//   attention_combine: grid (Hq, T), ATTENTION_THREADS threads: out = sum_c exp(m_c - M)
//       o_c / sum_c exp(m_c - M) l_c with M the largest m_c (every query sees key 0, so
//       M is finite; a split that sees nothing weighs 0).
//
// chunk <= ATTENTION_MAX_CHUNK and D <= ATTENTION_MAX_DIM (colibri_cuda.geometry checks).
#include "common.cuh"

#define ATTENTION_THREADS 128
#define ATTENTION_MAX_CHUNK 1024
#define ATTENTION_MAX_DIM 1024

extern "C" __global__ void __launch_bounds__(ATTENTION_THREADS)
    attention_split(const float* q, const float* k, const float* v, float* partial_o, float* partial_ml, int T, int Hq,
                    int Hkv, int S, int D, int Dv, int start, int chunk, float scale, long long k_heads,
                    long long v_heads) {
    __shared__ float query[ATTENTION_MAX_DIM];
    __shared__ float weight[ATTENTION_MAX_CHUNK];
    __shared__ float scratch[32];
    const int split = blockIdx.x, h = blockIdx.y, t = blockIdx.z, splits = gridDim.x;
    const int kv_head = h / (Hq / Hkv);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    const int first = split * chunk;
    const int end = min(S, first + chunk);
    const int visible_end = min(end, start + t + 1);  // keys first .. visible_end - 1 are seen

    for (int d = threadIdx.x; d < D; d += blockDim.x) query[d] = q[((u64)t * Hq + h) * D + d];
    __syncthreads();

    const float* keys = k + (u64)kv_head * (u64)k_heads;
    for (int s = first + warp; s < end; s += warps) {
        float dot = 0.0f;
        if (s < visible_end)
            for (int d = lane; d < D; d += WARP) dot += query[d] * keys[(u64)s * D + d];
        dot = warp_sum(dot);
        if (lane == 0) weight[s - first] = s < visible_end ? dot * scale : negative_infinity();
    }
    __syncthreads();

    float local_max = negative_infinity();
    for (int s = first + threadIdx.x; s < end; s += blockDim.x) local_max = fmaxf(local_max, weight[s - first]);
    const float m = block_max(local_max, scratch);
    float local_sum = 0.0f;
    for (int s = first + threadIdx.x; s < end; s += blockDim.x) {
        const float p = s < visible_end ? expf(weight[s - first] - m) : 0.0f;
        weight[s - first] = p;
        local_sum += p;
    }
    const float l = block_sum(local_sum, scratch);  // its __syncthreads also publishes `weight`

    const float* values = v + (u64)kv_head * (u64)v_heads;
    float* o = partial_o + (((u64)t * Hq + h) * splits + split) * Dv;
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = first; s < visible_end; ++s) acc += weight[s - first] * values[(u64)s * Dv + d];
        o[d] = acc;
    }
    if (threadIdx.x == 0) {
        float* ml = partial_ml + (((u64)t * Hq + h) * splits + split) * 2;
        ml[0] = m;
        ml[1] = l;
    }
}

extern "C" __global__ void __launch_bounds__(ATTENTION_THREADS)
    attention_combine(const float* partial_o, const float* partial_ml, float* out, int Hq, int Dv, int splits) {
    const int h = blockIdx.x, t = blockIdx.y;
    const float* ml = partial_ml + ((u64)t * Hq + h) * splits * 2;
    const float* o = partial_o + ((u64)t * Hq + h) * splits * Dv;
    float m = negative_infinity();
    for (int c = 0; c < splits; ++c) m = fmaxf(m, ml[2 * c]);
    float l = 0.0f;
    for (int c = 0; c < splits; ++c)
        if (ml[2 * c + 1] > 0.0f) l += expf(ml[2 * c] - m) * ml[2 * c + 1];
    for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < splits; ++c)
            if (ml[2 * c + 1] > 0.0f) acc += expf(ml[2 * c] - m) * o[(u64)c * Dv + d];
        out[((u64)t * Hq + h) * Dv + d] = acc / l;
    }
}
