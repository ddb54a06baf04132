// Rotary position embeddings, one thread per output feature. x and out (T, H, Dh),
// cos and sin (T, R) for a rotary part of R = 2 * half features; features past R are
// copied. Both as colibri_core.compute.reference computes them.
#include "common.cuh"

// The two layouts differ only in which inputs a rotated feature pairs:
// rotate-half: out[i] = x[i] cos[i] - x[i + half] sin[i];
//              out[half + i] = x[half + i] cos[half + i] + x[i] sin[half + i]
// interleaved: pairs (x0, x1), (x2, x3) ... turned by the angle of column j < half, the
//              result de-interleaved: out[j] = x[2j] cos[j] - x[2j+1] sin[j];
//                                     out[half + j] = x[2j+1] cos[j] + x[2j] sin[j]
template <bool Interleaved>
__device__ __forceinline__ void rope(const float* x, const float* cos, const float* sin, float* out, int T, int H,
                                     int Dh, int R) {
    const u64 index = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= (u64)T * H * Dh) return;
    const int i = (int)(index % Dh), t = (int)(index / ((u64)H * Dh)), half = R / 2;
    const float* row = x + (index - i);
    const float* c = cos + (u64)t * R;
    const float* s = sin + (u64)t * R;
    float value = row[i];
    if (Interleaved) {
        if (i < half) value = row[2 * i] * c[i] - row[2 * i + 1] * s[i];
        else if (i < R) value = row[2 * (i - half) + 1] * c[i - half] + row[2 * (i - half)] * s[i - half];
    } else {
        if (i < half) value = row[i] * c[i] - row[i + half] * s[i];
        else if (i < R) value = row[i] * c[i] + row[i - half] * s[i];
    }
    out[index] = value;
}

extern "C" __global__ void rope_half(const float* x, const float* cos, const float* sin, float* out, int T, int H,
                                     int Dh, int R) {
    rope<false>(x, cos, sin, out, T, H, Dh, R);
}

extern "C" __global__ void rope_interleaved(const float* x, const float* cos, const float* sin, float* out, int T,
                                            int H, int Dh, int R) {
    rope<true>(x, cos, sin, out, T, H, Dh, R);
}
