#version 450
// y (T, N) = x (T, K) @ W.T (+ bias) for W (N, K) in one of colibri's stored forms, decoded
// element by element in the product (KIND, set when compiling): 0 float32, 1 bfloat16,
// 2 int8-row, 3 int4-gs64, 4 mxfp4, 5 fp8-e4m3 with block scales. Scales arrive as float32;
// `lut` is the e2m1 (mxfp4) or e4m3 (fp8) value table.
//
// Variants (defines, set when compiling; the device's features choose one, device.py):
// - plain (neither): one invocation per (output row, 8 tokens), packed bytes read from 32-bit
//   words; Vulkan 1.0 with no optional feature.
// - SUBGROUP: one subgroup per (output row, 8 tokens), each invocation summing a strided part
//   of the row (adjacent invocations read adjacent weights), reduced with subgroupAdd; a
//   workgroup (its size a specialization constant) takes p.rpg consecutive rows, its subgroups
//   one row after another. Needs subgroup basic and arithmetic operations in compute shaders
//   (Vulkan 1.1). No shared memory, no barriers, and no assumption on the subgroup size: an
//   invocation's part is its rank among the subgroup's active invocations.
// - NARROW (with SUBGROUP): packed bytes read through 8-bit storage (int8, int4, mxfp4, fp8)
//   or 16-bit storage (bf16) instead of being picked out of 32-bit words.
// Every variant decodes the same numbers exactly; they differ in float32 summation order only.
#ifndef KIND
#define KIND 0
#endif
#ifdef SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
layout(local_size_x_id = 0) in;
#else
layout(local_size_x = 64) in;
#endif
#if defined(NARROW) && KIND == 1
#extension GL_EXT_shader_16bit_storage : require
#define WORDS uint16_t w16[]
#elif defined(NARROW) && KIND >= 2
#extension GL_EXT_shader_8bit_storage : require
#define WORDS uint8_t w8[]
#else
#define WORDS uint w[]
#endif
layout(std430, binding = 0) writeonly buffer Out { float y[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) readonly buffer Wd { WORDS; };
layout(std430, binding = 3) readonly buffer Sc { float sc[]; };
layout(std430, binding = 4) readonly buffer Lut { float lut[]; };
layout(std430, binding = 5) readonly buffer Bias { float bias[]; };
// g: scale groups per row (q4, mxfp4) or scale columns (fp8); bo, bi: fp8 block shape;
// rpg: rows per workgroup (SUBGROUP only)
layout(push_constant) uniform P { int t; int n; int k; int g; int bo; int bi; int has_bias; int xo; int rpg; } p;
const int TT = 8;

#if defined(NARROW) && KIND >= 2
uint byte_at(uint b) { return uint(w8[b]); }
#elif KIND >= 2
uint byte_at(uint b) { return (w[b >> 2] >> ((b & 3u) * 8u)) & 255u; }
#endif

float weight(int o, int i) {
#if KIND == 0
    return uintBitsToFloat(w[o * p.k + i]);
#elif KIND == 1 && defined(NARROW)
    return uintBitsToFloat(uint(w16[o * p.k + i]) << 16);
#elif KIND == 1
    uint e = uint(o * p.k + i);
    uint word = w[e >> 1];
    return uintBitsToFloat(((e & 1u) == 1u ? word >> 16 : word & 65535u) << 16);
#elif KIND == 2
    return float(int(byte_at(uint(o * p.k + i)) << 24) >> 24) * sc[o];
#elif KIND == 3
    int gi = i >> 6, j = i & 63;
    uint byte_ = byte_at(uint(o * p.g * 32 + gi * 32 + (j & 31)));
    uint code = j < 32 ? byte_ & 15u : byte_ >> 4;
    return float(int(code) - 8) * sc[o * p.g + gi];
#elif KIND == 4
    int gi = i >> 5, j = i & 31;
    uint byte_ = byte_at(uint(o * p.g * 16 + gi * 16 + (j & 15)));
    uint code = j < 16 ? byte_ & 15u : byte_ >> 4;
    return lut[code] * sc[o * p.g + gi];
#else
    return lut[byte_at(uint(o * p.k + i))] * sc[(o / p.bo) * p.g + i / p.bi];
#endif
}

void main() {
#ifdef SUBGROUP
    // every invocation of a subgroup takes part in every subgroupAdd: the loops' bounds are
    // the same across the subgroup (rows and tokens per workgroup, strides per subgroup)
    int lanes = int(subgroupAdd(1u)), lane = int(subgroupExclusiveAdd(1u));
    int t0 = int(gl_WorkGroupID.y) * TT;
    int tn = min(TT, p.t - t0);
    int last = min((int(gl_WorkGroupID.x) + 1) * p.rpg, p.n);
    for (int o = int(gl_WorkGroupID.x) * p.rpg + int(gl_SubgroupID); o < last; o += int(gl_NumSubgroups)) {
        float acc[TT];
        for (int j = 0; j < TT; ++j) acc[j] = 0.0;
        for (int i = lane; i < p.k; i += lanes) {
            float wi = weight(o, i);
            for (int j = 0; j < tn; ++j) acc[j] += wi * x[p.xo + (t0 + j) * p.k + i];
        }
        float b = p.has_bias != 0 ? bias[o] : 0.0;
        for (int j = 0; j < tn; ++j) {
            float s = subgroupAdd(acc[j]);
            if (subgroupElect()) y[(t0 + j) * p.n + o] = s + b;
        }
    }
#else
    // one invocation per (output row, 8 tokens): no shared memory, no barriers (lavapipe runs
    // barriers as coroutine switches, which cost more than the arithmetic here)
    int o = int(gl_GlobalInvocationID.x), t0 = int(gl_GlobalInvocationID.y) * TT;
    if (o >= p.n || t0 >= p.t) return;
    int tn = min(TT, p.t - t0);
    float acc[TT];
    for (int j = 0; j < TT; ++j) acc[j] = 0.0;
    for (int i = 0; i < p.k; ++i) {
        float wi = weight(o, i);
        for (int j = 0; j < tn; ++j) acc[j] += wi * x[p.xo + (t0 + j) * p.k + i];
    }
    float b = p.has_bias != 0 ? bias[o] : 0.0;
    for (int j = 0; j < tn; ++j) y[(t0 + j) * p.n + o] = acc[j] + b;
#endif
}
