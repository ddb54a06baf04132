#version 450
// y (T, N) = x (T, K) @ W.T (+ bias) for W (N, K) in one of colibri's stored forms, decoded
// element by element in the product (KIND, set when compiling): 0 float32, 1 bfloat16,
// 2 int8-row, 3 int4-gs64, 4 mxfp4, 5 fp8-e4m3 with block scales. Packed bytes are read
// from 32-bit words (no 8/16-bit storage needed); scales arrive as float32; `lut` is the
// e2m1 (mxfp4) or e4m3 (fp8) value table.
#ifndef KIND
#define KIND 0
#endif
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { float y[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) readonly buffer Wd { uint w[]; };
layout(std430, binding = 3) readonly buffer Sc { float sc[]; };
layout(std430, binding = 4) readonly buffer Lut { float lut[]; };
layout(std430, binding = 5) readonly buffer Bias { float bias[]; };
// g: scale groups per row (q4, mxfp4) or scale columns (fp8); bo, bi: fp8 block shape
layout(push_constant) uniform P { int t; int n; int k; int g; int bo; int bi; int has_bias; int xo; } p;
const int TT = 8;

uint byte_at(uint b) { return (w[b >> 2] >> ((b & 3u) * 8u)) & 255u; }

float weight(int o, int i) {
#if KIND == 0
    return uintBitsToFloat(w[o * p.k + i]);
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
}
