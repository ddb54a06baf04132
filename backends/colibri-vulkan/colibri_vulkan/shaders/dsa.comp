#version 450
// DSA indexer scores: score(t, s) = sum_h w[t, h] * relu(scale * q[t, h] . k[s]); positions
// after start + t are -inf. q (T, H, D), k (S, D), w (T, H), contiguous; one thread per (t, s).
layout(local_size_x = 256) in;
layout(std430, binding = 0) writeonly buffer Out { float o[]; };
layout(std430, binding = 1) readonly buffer Q { float q[]; };
layout(std430, binding = 2) readonly buffer K { float k[]; };
layout(std430, binding = 3) readonly buffer W { float w[]; };
layout(push_constant) uniform P { int t; int h; int d; int s; int start; float scale; int ko; int kss; } p;

void main() {
    uint id = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * 256u + gl_LocalInvocationID.x;
    if (id >= uint(p.t * p.s)) return;
    int t = int(id) / p.s, s = int(id) % p.s;
    if (s > p.start + t) { o[id] = -1.0 / 0.0; return; }
    float total = 0.0;
    for (int h = 0; h < p.h; ++h) {
        float d = 0.0;
        for (int i = 0; i < p.d; ++i) d += q[(t * p.h + h) * p.d + i] * k[p.ko + s * p.kss + i];
        total += w[t * p.h + h] * max(d * p.scale, 0.0);
    }
    o[id] = total;
}
