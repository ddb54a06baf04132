// Matrix-vector and small-batch products with packed weights: y (T, N) = x (T, K) @ W.T
// for T <= GEMV_MAX_TOKENS, one warp per output row, float32 accumulation. The host
// (colibri_cuda.kernels) launches ceil(N / ROWS_PER_BLOCK) blocks of ROWS_PER_BLOCK warps
// per slice of at most GEMV_MAX_TOKENS tokens. Also the decodes to float32 (dequantize_*)
// that larger batches multiply through cuBLAS.
#include "formats.cuh"

template <class Format>
__device__ void gemv(const u8* data, const float* scales, const float* x, float* y, int N, int K, int p0, int p1,
                     int T) {
    const int lane = threadIdx.x % WARP;
    const int n = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / WARP;
    if (n >= N) return;  // a whole warp leaves together: the shuffles below see all 32 lanes
    float acc[GEMV_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] = 0.0f;
    Format::template row<GEMV_MAX_TOKENS>(data, scales, n, K, p0, p1, x, T, lane, acc);
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
        const float total = warp_sum(acc[t]);
        if (t < T && lane == 0) y[(u64)t * N + n] = total;
    }
}

// W[n, k] for every (n, k): a product with a one-hot x, one thread per element
template <class Format>
__device__ void dequantize(const u8* data, const float* scales, float* out, int N, int K, int p0, int p1) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)N * K) return;
    const int n = (int)(i / K), k = (int)(i % K);
    out[i] = Format::decode(data, scales, n, k, K, p0, p1);
}

#define GEMV_KERNEL(name, Format)                                                                              \
    extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * WARP)                                         \
        gemv_##name(const u8* data, const float* scales, const float* x, float* y, int N, int K, int p0, int p1, \
                    int T) {                                                                                   \
        gemv<Format>(data, scales, x, y, N, K, p0, p1, T);                                                     \
    }

GEMV_KERNEL(f32, F32)
GEMV_KERNEL(bf16, BF16)
GEMV_KERNEL(q8, Q8)
GEMV_KERNEL(q4, Q4)
GEMV_KERNEL(mxfp4, MXFP4)
GEMV_KERNEL(fp8, FP8)

#define DEQUANTIZE_KERNEL(name, Format)                                                                      \
    extern "C" __global__ void dequantize_##name(const u8* data, const float* scales, float* out, int N, int K, \
                                                 int p0, int p1) {                                           \
        dequantize<Format>(data, scales, out, N, K, p0, p1);                                                 \
    }

DEQUANTIZE_KERNEL(bf16, BF16)
DEQUANTIZE_KERNEL(q8, Q8)
DEQUANTIZE_KERNEL(q4, Q4)
DEQUANTIZE_KERNEL(mxfp4, MXFP4)
DEQUANTIZE_KERNEL(fp8, FP8)
