// The gated delta rule position by position (decode), float32, the recurrent state
// updated in place. q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv); state (Hv, Dk, Dv);
// out (T, Hv, Dv). Value head h reads key head h / (Hv / Hk). Per position, as
// colibri_core.compute.reference computes it:
//     S = exp(g) S;  delta = (v - S^T k) beta;  S += k delta^T;  out = S^T q
// One thread per (value head, value column j): column j of S is all it reads and writes.
// grid (ceil(Dv / DELTA_THREADS), Hv), DELTA_THREADS threads.
#include "common.cuh"

#define DELTA_THREADS 128

extern "C" __global__ void __launch_bounds__(DELTA_THREADS)
    gated_delta_step(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                     float* out, int T, int Hk, int Hv, int Dk, int Dv) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
    if (j >= Dv) return;
    const int key_head = h / (Hv / Hk);
    float* s = state + (u64)h * Dk * Dv + j;  // s[i * Dv]: row i of column j
    for (int t = 0; t < T; ++t) {
        const float* kt = k + ((u64)t * Hk + key_head) * Dk;
        const float* qt = q + ((u64)t * Hk + key_head) * Dk;
        const float decay = expf(g[(u64)t * Hv + h]);
        float memory = 0.0f;
        for (int i = 0; i < Dk; ++i) {
            const float decayed = s[(u64)i * Dv] * decay;
            s[(u64)i * Dv] = decayed;
            memory += decayed * kt[i];
        }
        const float delta = (v[((u64)t * Hv + h) * Dv + j] - memory) * beta[(u64)t * Hv + h];
        float result = 0.0f;
        for (int i = 0; i < Dk; ++i) {
            const float updated = s[(u64)i * Dv] + kt[i] * delta;
            s[(u64)i * Dv] = updated;
            result += updated * qt[i];
        }
        out[((u64)t * Hv + h) * Dv + j] = result;
    }
}
