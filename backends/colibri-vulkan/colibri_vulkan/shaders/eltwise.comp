#version 450
// Elementwise operations over strided views (up to 6 dimensions): copies (raw 32-bit words,
// bit-exact for every dtype), arithmetic with broadcasting, scalars, activations, exp, maximum. Every
// operand has its own offset and strides (in 32-bit words; a stride of 0 broadcasts), so
// views, transposes and slice assignment need no extra copies. `opdim` is the operation
// and (above 8 bits) the dimension count, which leaves room for three scalars in 128 bytes.
layout(local_size_x = 256) in;
layout(std430, binding = 0) buffer Out { uint o[]; };
layout(std430, binding = 1) readonly buffer A { uint a[]; };
layout(std430, binding = 2) readonly buffer B { uint b[]; };
layout(push_constant) uniform P {
    int n; int opdim; float s; float s2; float s3;
    int shape[6]; int so[6]; int sa[6]; int sb[6];
    int oo; int oa; int ob;
} p;

float log1p_accurate(float x) {  // log(1 + x) without losing small x (GLSL has no log1p)
    float u = 1.0 + x;
    return u == 1.0 ? x : log(u) * (x / (u - 1.0));
}

void main() {
    uint id = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * 256u + gl_LocalInvocationID.x;
    if (id >= uint(p.n)) return;
    int op = p.opdim & 255, ndim = p.opdim >> 8;
    int rest = int(id), io = p.oo, ia = p.oa, ib = p.ob;
    for (int d = ndim - 1; d >= 0; --d) {
        int c = rest % p.shape[d];
        rest /= p.shape[d];
        io += c * p.so[d]; ia += c * p.sa[d]; ib += c * p.sb[d];
    }
    if (op == 0) { o[io] = a[ia]; return; }  // copy, bit for bit
    float x = uintBitsToFloat(a[ia]);
    float y = (op >= 1 && op <= 4) || op == 16 || op == 17 ? uintBitsToFloat(b[ib]) : 0.0;
    float r;
    switch (op) {
        case 1: r = x + y; break;
        case 2: r = x - y; break;
        case 3: r = x * y; break;
        case 4: r = x / y; break;
        case 5: r = x + p.s; break;
        case 6: r = x * p.s; break;
        case 7: r = x - p.s; break;
        case 8: r = p.s - x; break;
        case 9: r = x / p.s; break;
        case 10: r = p.s / x; break;
        case 11: r = -x; break;
        case 12: r = x / (1.0 + exp(-x)); break;                       // silu
        case 13: r = 1.0 / (1.0 + exp(-x)); break;                     // sigmoid
        case 14: r = x > 20.0 ? x : log1p_accurate(exp(min(x, 20.0))); break;  // softplus
        case 15: r = clamp(x, -p.s, p.s); break;                       // clip
        case 16: r = x / (1.0 + exp(-x)) * y; break;                   // silu(x) * y
        case 17: {  // gated activation: g = min(x, limit), u = clip(y, limit); g * sigmoid(alpha g) * (u + offset)
            float g = min(x, p.s);
            r = g / (1.0 + exp(-(p.s2 * g))) * (clamp(y, -p.s, p.s) + p.s3);
            break;
        }
        case 18: r = exp(x); break;
        case 19: r = max(x, p.s); break;                               // maximum(x, floor)
        default: r = x;
    }
    o[io] = floatBitsToUint(r);
}
