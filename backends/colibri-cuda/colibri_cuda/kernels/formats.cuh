// One warp's share of a row product for every weight layout colibri-cuda computes with.
//
// Format::row<MT>(data, scales, n, K, p0, p1, x, T, lane, acc) adds, for each token
// t < T (T <= MT), the sum over the inputs this lane handles of W[n, k] * x[t * K + k]
// to acc[t]; the caller sums the 32 lanes. The layouts are the stored ones of
// colibri_core.formats, as colibri_cuda.layouts prepares them:
//
//   F32    float32 (N, K)
//   BF16   bfloat16 bits (N, K)
//   Q8     int8 (N, K), one float32 scale per row                  w = q * s[n]
//   Q4     per row G groups of 32 bytes; byte j of a group holds input j (low nibble)
//          and input j + 32 (high); float32 scales (N, G)          w = (nibble - 8) * s
//   MXFP4  per row G groups of 16 bytes; byte j holds input j (low) and j + 16 (high);
//          one UE8M0 exponent byte per group (N, G)                w = e2m1 * 2^(e - 127)
//   FP8    e4m3 bytes (N, K); one float32 scale per p0 x p1 block, (ceil(N/p0), ceil(K/p1))
//
// The last group of a row may be partial: inputs k >= K are skipped, never read.
#pragma once
#include "common.cuh"

template <int MT>
__device__ __forceinline__ void add_weight(float w, const float* x, int k, int K, int T, float (&acc)[MT]) {
#pragma unroll
    for (int t = 0; t < MT; ++t)
        if (t < T) acc[t] += w * x[(u64)t * K + k];
}

struct F32 {
    __device__ static float decode(const u8* data, const float*, int n, int k, int K, int, int) {
        return ((const float*)data)[(u64)n * K + k];
    }
    template <int MT>
    __device__ static void row(const u8* data, const float*, int n, int K, int, int, const float* x, int T, int lane,
                               float (&acc)[MT]) {
        const float* w = (const float*)data + (u64)n * K;
        for (int k = lane; k < K; k += WARP) add_weight<MT>(w[k], x, k, K, T, acc);
    }
};

struct BF16 {
    __device__ static float decode(const u8* data, const float*, int n, int k, int K, int, int) {
        return bf16_value(((const u16*)data)[(u64)n * K + k]);
    }
    template <int MT>
    __device__ static void row(const u8* data, const float*, int n, int K, int, int, const float* x, int T, int lane,
                               float (&acc)[MT]) {
        const u16* w = (const u16*)data + (u64)n * K;
        for (int k = lane; k < K; k += WARP) add_weight<MT>(bf16_value(w[k]), x, k, K, T, acc);
    }
};

struct Q8 {
    __device__ static float decode(const u8* data, const float* scales, int n, int k, int K, int, int) {
        return (float)((const signed char*)data)[(u64)n * K + k] * scales[n];
    }
    template <int MT>
    __device__ static void row(const u8* data, const float* scales, int n, int K, int, int, const float* x, int T,
                               int lane, float (&acc)[MT]) {
        const signed char* q = (const signed char*)data + (u64)n * K;
        const float s = scales[n];
        for (int k = lane; k < K; k += WARP) add_weight<MT>((float)q[k] * s, x, k, K, T, acc);
    }
};

struct Q4 {  // p0: groups per row
    __device__ static float decode(const u8* data, const float* scales, int n, int k, int, int G, int) {
        const int g = k / 64, j = k % 64;
        const u32 byte = data[(u64)n * G * 32 + g * 32 + (j % 32)];
        const u32 code = j < 32 ? (byte & 15u) : (byte >> 4);
        return (float)((int)code - 8) * scales[(u64)n * G + g];
    }
    template <int MT>
    __device__ static void row(const u8* data, const float* scales, int n, int K, int G, int, const float* x, int T,
                               int lane, float (&acc)[MT]) {
        // a unit is 4 bytes of a group: inputs 4u'..4u'+3 (low nibbles) and 32 + the same (high)
        const u32* words = (const u32*)(data + (u64)n * G * 32);
        const float* s = scales + (u64)n * G;
        for (int u = lane; u < G * 8; u += WARP) {
            const int g = u >> 3, k0 = g * 64 + (u & 7) * 4;
            const u32 word = words[u];
            const float scale = s[g];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 byte = (word >> (8 * i)) & 0xffu;
                if (k0 + i < K) add_weight<MT>((float)((int)(byte & 15u) - 8) * scale, x, k0 + i, K, T, acc);
                if (k0 + 32 + i < K) add_weight<MT>((float)((int)(byte >> 4) - 8) * scale, x, k0 + 32 + i, K, T, acc);
            }
        }
    }
};

struct MXFP4 {  // p0: groups per row; `scales` points at the exponent bytes
    __device__ static float decode(const u8* data, const float* scales, int n, int k, int, int G, int) {
        const int g = k / 32, j = k % 32;
        const u32 byte = data[(u64)n * G * 16 + g * 16 + (j % 16)];
        const u32 code = j < 16 ? (byte & 15u) : (byte >> 4);
        return e2m1_value(code) * e8m0_value(((const u8*)scales)[(u64)n * G + g]);
    }
    template <int MT>
    __device__ static void row(const u8* data, const float* scales, int n, int K, int G, int, const float* x, int T,
                               int lane, float (&acc)[MT]) {
        const u32* words = (const u32*)(data + (u64)n * G * 16);
        const u8* exponents = (const u8*)scales + (u64)n * G;
        for (int u = lane; u < G * 4; u += WARP) {
            const int g = u >> 2, k0 = g * 32 + (u & 3) * 4;
            const u32 word = words[u];
            const float scale = e8m0_value(exponents[g]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 byte = (word >> (8 * i)) & 0xffu;
                if (k0 + i < K) add_weight<MT>(e2m1_value(byte & 15u) * scale, x, k0 + i, K, T, acc);
                if (k0 + 16 + i < K) add_weight<MT>(e2m1_value(byte >> 4) * scale, x, k0 + 16 + i, K, T, acc);
            }
        }
    }
};

struct FP8 {  // p0 x p1: the scale block (rows, columns)
    __device__ static float decode(const u8* data, const float* scales, int n, int k, int K, int block_rows,
                                   int block_cols) {
        const int scale_cols = (K + block_cols - 1) / block_cols;
        return e4m3_value(data[(u64)n * K + k]) * scales[(u64)(n / block_rows) * scale_cols + k / block_cols];
    }
    template <int MT>
    __device__ static void row(const u8* data, const float* scales, int n, int K, int block_rows, int block_cols,
                               const float* x, int T, int lane, float (&acc)[MT]) {
        const u8* w = data + (u64)n * K;
        const int scale_cols = (K + block_cols - 1) / block_cols;
        const float* s = scales + (u64)(n / block_rows) * scale_cols;
        for (int k = lane; k < K; k += WARP) add_weight<MT>(e4m3_value(w[k]) * s[k / block_cols], x, k, K, T, acc);
    }
};
