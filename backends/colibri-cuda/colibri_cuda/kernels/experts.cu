// The routed experts of one token, fused: two launches per window of experts.
//
//   experts_gate_up_<fmt>: h[e, i] = silu(gate_e[i] . x) * (up_e[i] . x)
//       grid (ceil(I / ROWS_PER_BLOCK), E), one warp per (expert, row i)
//   experts_down_<fmt>:    out[j] = out[j] + w[0] * (down_0[j] . h[0]) + w[1] * (...) ...
//       grid ceil(H / ROWS_PER_BLOCK), one warp per output row j, the experts added in
//       the order given (the host passes them in ascending expert order), each term
//       rounded as numpy's out += y * w rounds it (no fused multiply-add), so windows of
//       any size give the same bits.
//
// `table` holds device pointers, E per row: gate data, gate scales, up data, up scales
// (gate_up); down data, down scales (down). Scales of layouts without any are null.
#include "formats.cuh"

template <class Format>
__device__ void experts_gate_up(const u64* table, const float* x, float* h, int E, int I, int K, int p0, int p1) {
    const int lane = threadIdx.x % WARP, e = blockIdx.y;
    const int i = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP;
    if (i >= I) return;
    const u8* gate = (const u8*)table[e];
    const float* gate_scales = (const float*)table[E + e];
    const u8* up = (const u8*)table[2 * E + e];
    const float* up_scales = (const float*)table[3 * E + e];
    float g[1] = {0.0f}, u[1] = {0.0f};
    Format::template row<1>(gate, gate_scales, i, K, p0, p1, x, 1, lane, g);
    Format::template row<1>(up, up_scales, i, K, p0, p1, x, 1, lane, u);
    const float gate_total = warp_sum(g[0]), up_total = warp_sum(u[0]);
    // silu(g) * u written as the reference writes it: g / (1 + exp(-g)) * u
    if (lane == 0) h[(u64)e * I + i] = gate_total / (1.0f + expf(-gate_total)) * up_total;
}

template <class Format>
__device__ void experts_down(const u64* table, const float* h, const float* weights, float* out, int E, int H, int I,
                             int p0, int p1) {
    const int lane = threadIdx.x % WARP;
    const int j = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP;
    if (j >= H) return;
    float total = out[j];
    for (int e = 0; e < E; ++e) {
        float d[1] = {0.0f};
        Format::template row<1>((const u8*)table[e], (const float*)table[E + e], j, I, p0, p1, h + (u64)e * I, 1, lane,
                                d);
        total = __fadd_rn(total, __fmul_rn(warp_sum(d[0]), weights[e]));
    }
    if (lane == 0) out[j] = total;
}

#define EXPERT_KERNELS(name, Format)                                                                             \
    extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)                                           \
        experts_gate_up_##name(const u64* table, const float* x, float* h, int E, int I, int K, int p0, int p1) { \
        experts_gate_up<Format>(table, x, h, E, I, K, p0, p1);                                                   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)                                           \
        experts_down_##name(const u64* table, const float* h, const float* weights, float* out, int E, int H,     \
                            int I, int p0, int p1) {                                                             \
        experts_down<Format>(table, h, weights, out, E, H, I, p0, p1);                                           \
    }

EXPERT_KERNELS(f32, F32)
EXPERT_KERNELS(bf16, BF16)
EXPERT_KERNELS(q8, Q8)
EXPERT_KERNELS(q4, Q4)
EXPERT_KERNELS(mxfp4, MXFP4)
EXPERT_KERNELS(fp8, FP8)
