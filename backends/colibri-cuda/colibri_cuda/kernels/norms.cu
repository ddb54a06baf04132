// Norms over the last axis, one block of NORM_THREADS threads per row of C features,
// as colibri_core.compute.reference computes them (weight and bias may be null).
#include "common.cuh"

#define NORM_THREADS 256

// x / sqrt(mean(x^2) + eps) * weight
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* x, const float* weight, float* out, int C, float eps) {
    __shared__ float scratch[32];
    const float* row = x + (u64)blockIdx.x * C;
    float* dst = out + (u64)blockIdx.x * C;
    float squares = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) squares += row[c] * row[c];
    const float inverse = 1.0f / sqrtf(block_sum(squares, scratch) / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float y = row[c] * inverse;
        dst[c] = weight ? y * weight[c] : y;
    }
}

// (x - mean) / sqrt(var + eps) * weight + bias, the biased variance
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    layer_norm(const float* x, const float* weight, const float* bias, float* out, int C, float eps) {
    __shared__ float scratch[32];
    const float* row = x + (u64)blockIdx.x * C;
    float* dst = out + (u64)blockIdx.x * C;
    float total = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) total += row[c];
    const float mean = block_sum(total, scratch) / (float)C;
    float squares = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) squares += (row[c] - mean) * (row[c] - mean);
    const float deviation = sqrtf(block_sum(squares, scratch) / (float)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float y = (row[c] - mean) / deviation;
        if (weight) y = y * weight[c];
        if (bias) y = y + bias[c];
        dst[c] = y;
    }
}
