#version 450
// RoPE on the first `rot` features of x (T, H, D), contiguous; cos/sin (T, rot).
// mode 0: rotate-half; mode 1: interleaved pairs, rotated features de-interleaved.
layout(local_size_x = 256) in;
layout(std430, binding = 0) writeonly buffer Out { float o[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) readonly buffer Cos { float c[]; };
layout(std430, binding = 3) readonly buffer Sin { float s[]; };
layout(push_constant) uniform P { int t; int h; int d; int rot; int mode; } p;

void main() {
    uint id = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * 256u + gl_LocalInvocationID.x;
    if (id >= uint(p.t * p.h * p.d)) return;
    int j = int(id) % p.d, row = int(id) / p.d, t = row / p.h, base = row * p.d, half_ = p.rot / 2;
    float r;
    if (j >= p.rot) r = x[id];
    else if (p.mode == 0) {
        float cj = c[t * p.rot + j], sj = s[t * p.rot + j];
        r = j < half_ ? x[base + j] * cj - x[base + j + half_] * sj : x[base + j] * cj + x[base + j - half_] * sj;
    } else {
        int i = j < half_ ? j : j - half_;
        float ci = c[t * p.rot + i], si = s[t * p.rot + i];
        float first = x[base + 2 * i], second = x[base + 2 * i + 1];
        r = j < half_ ? first * ci - second * si : second * ci + first * si;
    }
    o[id] = r;
}
