#version 450
// Causal attention with an online softmax, one invocation per (query t, query head h, chunk
// of 32 value features): no shared memory and no barriers (lavapipe runs barriers as
// coroutine switches); each chunk recomputes its scores. q (T, Hq, D) contiguous; k (Hkv, S, D)
// and v (Hkv, S, Dv) are strided views (head and position strides in floats, features
// contiguous), so a KV cache slice needs no copy. With `nsel` > 0, query t attends only to
// the positions listed in sel[t, :nsel] (int64, from top_k) that causality allows. Options
// (windowed_attention, attention_relative_bias): `window` > 0 keeps the last `window`
// positions, itself included; `sinks` adds sink[h] to the softmax (the running max starts
// there, carrying no value: gpt-oss); `nrel` > 0 adds bias = rel[t, h, :] . table[:, d] at
// backward distance d < `extent` (rel (T, Hq, nrel), table (nrel, extent): Inkling), summed
// here per score rather than as a (T, Hq, extent) array, as nrel is small.
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { float o[]; };
layout(std430, binding = 1) readonly buffer Q { float q[]; };
layout(std430, binding = 2) readonly buffer K { float k[]; };
layout(std430, binding = 3) readonly buffer V { float v[]; };
layout(std430, binding = 4) readonly buffer Sel { int sel[]; };
layout(std430, binding = 5) readonly buffer Sink { float sink[]; };
layout(std430, binding = 6) readonly buffer Rel { float rel[]; };
layout(std430, binding = 7) readonly buffer Table { float table[]; };
layout(push_constant) uniform P {
    int t; int hq; int hkv; int d; int dv; int s; int start; float scale;
    int ko; int khs; int kss; int vo; int vhs; int vss; int nsel; int selo;
    int window; int sinks; int nrel; int extent;
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
    int first = p.window > 0 ? max(0, last - p.window + 1) : 0;  // the first position it sees
    int n = p.nsel > 0 ? p.nsel : min(p.s, last + 1);
    float acc[CHUNK];
    for (int j = 0; j < CHUNK; ++j) acc[j] = 0.0;
    float m = -1.0 / 0.0, lsum = 0.0;
    if (p.sinks != 0) { m = sink[h]; lsum = 1.0; }  // exp(sink - m)
    for (int idx = p.nsel > 0 ? 0 : first; idx < n; ++idx) {
        int kp = p.nsel > 0 ? sel[2 * (p.selo + t * p.nsel + idx)] : idx;  // the low word of an int64
        if (kp < first || kp > last || kp >= p.s) continue;
        int kb = p.ko + kvh * p.khs + kp * p.kss;
        float dot_ = 0.0;
        for (int i = 0; i < p.d; ++i) dot_ += q[qb + i] * k[kb + i];
        float score = dot_ * p.scale;
        int dist = last - kp;
        if (p.nrel > 0 && dist < p.extent) {
            float bias = 0.0;
            int rb = (t * p.hq + h) * p.nrel;
            for (int r = 0; r < p.nrel; ++r) bias += rel[rb + r] * table[r * p.extent + dist];
            score += bias;
        }
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
