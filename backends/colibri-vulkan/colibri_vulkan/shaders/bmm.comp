#version 450
// Batched float32 product over strided views: C[b, m, n] = sum_k A[b, m, k] * B[b, k, n]
// (strides in floats), one thread per output element. MLA's absorption and expansion use it.
layout(local_size_x = 256) in;
layout(std430, binding = 0) writeonly buffer C { float c[]; };
layout(std430, binding = 1) readonly buffer A { float a[]; };
layout(std430, binding = 2) readonly buffer B { float b[]; };
layout(push_constant) uniform P {
    int nb; int m; int n; int k;
    int ao; int ab; int am; int ak;
    int bo; int bb; int bk; int bn;
    int co; int cb; int cm; int cn;
} p;

void main() {
    uint id = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * 256u + gl_LocalInvocationID.x;
    if (id >= uint(p.nb * p.m * p.n)) return;
    int j = int(id) % p.n, i = (int(id) / p.n) % p.m, bi = int(id) / (p.n * p.m);
    int ia = p.ao + bi * p.ab + i * p.am, ib = p.bo + bi * p.bb + j * p.bn;
    float s = 0.0;
    for (int kk = 0; kk < p.k; ++kk) s += a[ia + kk * p.ak] * b[ib + kk * p.bk];
    c[p.co + bi * p.cb + i * p.cm + j * p.cn] = s;
}
