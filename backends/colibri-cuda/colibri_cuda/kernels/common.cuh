// Shared by every kernel source of colibri-cuda. Compiled by NVRTC at first use
// (cupy.RawModule, with this folder on the include path) and by nvcc in CI, so it
// includes no host header: NVRTC has none.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;  // also for sizes and offsets: NVRTC may lack size_t

#define WARP 32
#define FULL_MASK 0xffffffffu
// tokens one matrix-vector launch computes at once (colibri_cuda.geometry.GEMV_MAX_TOKENS)
#define GEMV_MAX_TOKENS 8
// output rows per block of the matrix-vector kernels: one warp each
#define ROWS_PER_BLOCK 4

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = WARP / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = WARP / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// Block-wide sum / max for blocks of whole warps (at most 32 of them); every thread
// gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -__int_as_float(0x7f800000);
    return warp_max(v);
}

__device__ __forceinline__ float negative_infinity() { return -__int_as_float(0x7f800000); }

// -- decodes: each exactly the numbers of colibri_core.formats (mirrored in numpy by
//    colibri_cuda.layouts, tested against the reference decode) -------------------------

// bfloat16 bits -> float32: the top half of a float32
__device__ __forceinline__ float bf16_value(u16 bits) { return __uint_as_float(((u32)bits) << 16); }

// float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal
// (m * 2^-9); S.1111.111 is NaN; no infinity
__device__ __forceinline__ float e4m3_value(u32 byte) {
    const u32 exponent = (byte >> 3) & 15u, mantissa = byte & 7u;
    if ((byte & 0x7fu) == 0x7fu) return __int_as_float(0x7fc00000);
    float magnitude = exponent == 0 ? (float)mantissa * 0.001953125f
                                    : __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
    return (byte & 0x80u) ? -magnitude : magnitude;
}

// e2m1 (mxfp4 values): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (bit 3 the sign)
__device__ __forceinline__ float e2m1_value(u32 code) {
    const u32 exponent = (code >> 1) & 3u, mantissa = code & 1u;
    float magnitude = exponent == 0 ? 0.5f * (float)mantissa
                                    : __uint_as_float(((exponent + 126u) << 23) | (mantissa << 22));
    return (code & 8u) ? -magnitude : magnitude;
}

// UE8M0 exponent e -> 2^(e - 127) as float32, as numpy's ldexp(float32(1), e - 127) gives
// it: 2^-127 is subnormal, e = 255 overflows to infinity
__device__ __forceinline__ float e8m0_value(u32 e) {
    return e == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(e << 23);
}
