#version 450
// Causal attention with an online softmax, one invocation per (query t, query head h, chunk
// of 32 value features): no shared memory and no barriers (lavapipe runs barriers as
// coroutine switches); each chunk recomputes its scores. q (T, Hq, D) contiguous; k (Hkv, S, D)
// and v (Hkv, S, Dv) are strided views (head and position strides in floats, features
// contiguous), so a KV cache slice needs no copy. With `nsel` > 0, query t attends only to
// the positions listed in sel[t, :nsel] (int64, from top_k) that causality allows.
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { float o[]; };
layout(std430, binding = 1) readonly buffer Q { float q[]; };
layout(std430, binding = 2) readonly buffer K { float k[]; };
layout(std430, binding = 3) readonly buffer V { float v[]; };
layout(std430, binding = 4) readonly buffer Sel { int sel[]; };
layout(push_constant) uniform P {
    int t; int hq; int hkv; int d; int dv; int s; int start; float scale;
    int ko; int khs; int kss; int vo; int vhs; int vss; int nsel; int selo;
} p;
const int CHUNK = 32;

void main() {
    int chunks = (p.dv + CHUNK - 1) / CHUNK;
    int id = int(gl_GlobalInvocationID.x), t = int(gl_GlobalInvocationID.y);
    int h = id / chunks, c0 = (id % chunks) * CHUNK;
    if (h >= p.hq || t >= p.t) return;
    int width = min(CHUNK, p.dv - c0);
    int kvh = h / (p.hq / p.hkv), qb = (t * p.hq + h) * p.d;
    int last = p.start + t;  // the last position query t sees
    int n = p.nsel > 0 ? p.nsel : min(p.s, last + 1);
    float acc[CHUNK];
    for (int j = 0; j < CHUNK; ++j) acc[j] = 0.0;
    float m = -1.0 / 0.0, lsum = 0.0;
    for (int idx = 0; idx < n; ++idx) {
        int kp = p.nsel > 0 ? sel[2 * (p.selo + t * p.nsel + idx)] : idx;  // the low word of an int64
        if (kp < 0 || kp > last || kp >= p.s) continue;
        int kb = p.ko + kvh * p.khs + kp * p.kss;
        float dot_ = 0.0;
        for (int i = 0; i < p.d; ++i) dot_ += q[qb + i] * k[kb + i];
        float score = dot_ * p.scale;
        if (score > m) {
            float corr = exp(m - score);
            lsum *= corr;
            for (int j = 0; j < CHUNK; ++j) acc[j] *= corr;
            m = score;
        }
        float pr = exp(score - m);
        lsum += pr;
        int vb = p.vo + kvh * p.vhs + kp * p.vss + c0;
        for (int j = 0; j < width; ++j) acc[j] += pr * v[vb + j];
    }
    for (int j = 0; j < width; ++j) o[(t * p.hq + h) * p.dv + c0 + j] = acc[j] / lsum;
}
