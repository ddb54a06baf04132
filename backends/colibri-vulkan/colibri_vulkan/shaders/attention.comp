#version 450
// Causal attention, one workgroup per (query t, query head h), keys in tiles of 64 with an
// online softmax. q (T, Hq, D) contiguous; k (Hkv, S, D) and v (Hkv, S, Dv) are strided
// views (head and position strides in floats; features contiguous), so a KV cache slice
// needs no copy. With `nsel` > 0, query t attends only to the positions listed in
// sel[t, :nsel] (int64, from top_k) that causality allows.
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
const int MAXD = 1024;
const int PER = MAXD / 64;
shared float qs[MAXD];
shared float sc[64];
shared int pos[64];

void main() {
    int t = int(gl_WorkGroupID.x), h = int(gl_WorkGroupID.y), l = int(gl_LocalInvocationID.x);
    int kvh = h / (p.hq / p.hkv);
    for (int i = l; i < p.d; i += 64) qs[i] = q[(t * p.hq + h) * p.d + i];
    barrier();
    float acc[PER];
    for (int i = 0; i < PER; ++i) acc[i] = 0.0;
    float m = -1.0 / 0.0, lsum = 0.0;
    int last = p.start + t;  // the last position query t sees
    int n = p.nsel > 0 ? p.nsel : min(p.s, last + 1);
    for (int base = 0; base < n; base += 64) {
        int idx = base + l;
        float score = -1.0 / 0.0;
        int kp = -1;
        if (idx < n) {
            kp = p.nsel > 0 ? sel[2 * (p.selo + t * p.nsel + idx)] : idx;  // the low word of an int64
            if (kp >= 0 && kp <= last && kp < p.s) {
                int kb = p.ko + kvh * p.khs + kp * p.kss;
                float dot_ = 0.0;
                for (int i = 0; i < p.d; ++i) dot_ += qs[i] * k[kb + i];
                score = dot_ * p.scale;
            } else kp = -1;
        }
        sc[l] = score;
        pos[l] = kp;
        barrier();
        float tm = m;
        for (int i = 0; i < 64; ++i) tm = max(tm, sc[i]);
        if (tm > -1.0 / 0.0) {
            float corr = exp(m - tm);
            lsum *= corr;
            for (int j = 0; j < PER; ++j) acc[j] *= corr;
            for (int i = 0; i < 64; ++i) {
                if (pos[i] < 0) continue;
                float pr = exp(sc[i] - tm);
                lsum += pr;
                int vb = p.vo + kvh * p.vhs + pos[i] * p.vss;
                for (int j = 0; j < PER; ++j) {
                    int c = l + 64 * j;
                    if (c < p.dv) acc[j] += pr * v[vb + c];
                }
            }
            m = tm;
        }
        barrier();
    }
    for (int j = 0; j < PER; ++j) {
        int c = l + 64 * j;
        if (c < p.dv) o[(t * p.hq + h) * p.dv + c] = acc[j] / lsum;
    }
}
