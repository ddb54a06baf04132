#version 450
// y (T, N) = x (T, K) @ W.T (+ bias) for W (N, K) in one of colibri's stored forms, decoded
// element by element in the product (KIND, set when compiling): 0 float32, 1 bfloat16,
// 2 int8-row, 3 int4-gs64, 4 mxfp4, 5 fp8-e4m3 with block scales. Packed bytes are read
// from 32-bit words (no 8/16-bit storage needed); scales arrive as float32; `lut` is the
// e2m1 (mxfp4) or e4m3 (fp8) value table. One workgroup per output row, 8 tokens at a time.
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
shared float red[TT][64];

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
    int o = int(gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x);
    if (o >= p.n) return;  // uniform over the workgroup
    int l = int(gl_LocalInvocationID.x);
    for (int t0 = 0; t0 < p.t; t0 += TT) {
        int tn = min(TT, p.t - t0);
        float acc[TT];
        for (int j = 0; j < TT; ++j) acc[j] = 0.0;
        for (int i = l; i < p.k; i += 64) {
            float wi = weight(o, i);
            for (int j = 0; j < tn; ++j) acc[j] += wi * x[p.xo + (t0 + j) * p.k + i];
        }
        for (int j = 0; j < TT; ++j) red[j][l] = acc[j];
        barrier();
        for (uint s = 32u; s > 0u; s >>= 1) {
            if (l < int(s)) for (int j = 0; j < TT; ++j) red[j][l] += red[j][l + int(s)];
            barrier();
        }
        if (l < tn) y[(t0 + l) * p.n + o] = red[l][0] + (p.has_bias != 0 ? bias[o] : 0.0);
        barrier();
    }
}
