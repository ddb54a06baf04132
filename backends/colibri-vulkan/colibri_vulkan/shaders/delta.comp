#version 450
// The gated delta rule, position by position, one thread per (value head h, value column j):
// the thread owns column j of head h's state (Dk floats, updated in place in `st`).
// q, k (T, Hk, Dk); v (T, Hv, Dv); g, beta (T, Hv); st (Hv, Dk, Dv); out (T, Hv, Dv).
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { float o[]; };
layout(std430, binding = 1) buffer St { float st[]; };
layout(std430, binding = 2) readonly buffer Q { float q[]; };
layout(std430, binding = 3) readonly buffer K { float k[]; };
layout(std430, binding = 4) readonly buffer V { float v[]; };
layout(std430, binding = 5) readonly buffer G { float g[]; };
layout(std430, binding = 6) readonly buffer Beta { float beta[]; };
layout(push_constant) uniform P { int t; int hk; int hv; int dk; int dv; } p;

void main() {
    uint id = gl_GlobalInvocationID.x;
    if (id >= uint(p.hv * p.dv)) return;
    int h = int(id) / p.dv, j = int(id) % p.dv, kh = h / (p.hv / p.hk);
    int sb = h * p.dk * p.dv + j;
    for (int t = 0; t < p.t; ++t) {
        float decay = exp(g[t * p.hv + h]);
        int qk = (t * p.hk + kh) * p.dk;
        float mem = 0.0;
        for (int i = 0; i < p.dk; ++i) {
            float s = st[sb + i * p.dv] * decay;
            st[sb + i * p.dv] = s;
            mem += s * k[qk + i];
        }
        float delta = (v[(t * p.hv + h) * p.dv + j] - mem) * beta[t * p.hv + h];
        float out_ = 0.0;
        for (int i = 0; i < p.dk; ++i) {
            float s = st[sb + i * p.dv] + k[qk + i] * delta;
            st[sb + i * p.dv] = s;
            out_ += s * q[qk + i];
        }
        o[(t * p.hv + h) * p.dv + j] = out_;
    }
}
