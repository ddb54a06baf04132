#version 450
// Row operations over the last axis of a contiguous (rows, cols) array starting at element
// xo, one workgroup per row: 0 RMS norm, 1 layer norm, 2 L2 norm, 3 softmax (a row out per
// row), 4 sum, 5 max (one value out per row).
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { float o[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) readonly buffer W { float w[]; };
layout(std430, binding = 3) readonly buffer Bias { float bias[]; };
layout(push_constant) uniform P { int rows; int cols; int mode; int has_w; int has_b; float eps; int xo; } p;
shared float red[64];

float reduce_sum(float v) {
    uint l = gl_LocalInvocationID.x;
    red[l] = v;
    barrier();
    for (uint s = 32u; s > 0u; s >>= 1) {
        if (l < s) red[l] += red[l + s];
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

float reduce_max(float v) {
    uint l = gl_LocalInvocationID.x;
    red[l] = v;
    barrier();
    for (uint s = 32u; s > 0u; s >>= 1) {
        if (l < s) red[l] = max(red[l], red[l + s]);
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

void main() {
    uint row = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (row >= uint(p.rows)) return;  // uniform over the workgroup
    int base = p.xo + int(row) * p.cols, ob = int(row) * p.cols;
    int l = int(gl_LocalInvocationID.x);
    if (p.mode == 4 || p.mode == 5) {
        bool sum = p.mode == 4;
        float v = sum ? 0.0 : -1.0 / 0.0;
        for (int c = l; c < p.cols; c += 64) v = sum ? v + x[base + c] : max(v, x[base + c]);
        v = sum ? reduce_sum(v) : reduce_max(v);
        if (l == 0) o[row] = v;
        return;
    }
    if (p.mode == 3) {
        float m = -1.0 / 0.0;
        for (int c = l; c < p.cols; c += 64) m = max(m, x[base + c]);
        m = reduce_max(m);
        float s = 0.0;
        for (int c = l; c < p.cols; c += 64) s += exp(x[base + c] - m);
        s = reduce_sum(s);
        for (int c = l; c < p.cols; c += 64) o[ob + c] = exp(x[base + c] - m) / s;
        return;
    }
    float mean = 0.0;
    if (p.mode == 1) {
        float s = 0.0;
        for (int c = l; c < p.cols; c += 64) s += x[base + c];
        mean = reduce_sum(s) / float(p.cols);
    }
    float sq = 0.0;
    for (int c = l; c < p.cols; c += 64) { float d = x[base + c] - mean; sq += d * d; }
    sq = reduce_sum(sq);
    float inv;
    if (p.mode == 2) inv = 1.0 / sqrt(sq + p.eps);
    else inv = 1.0 / sqrt(sq / float(p.cols) + p.eps);
    for (int c = l; c < p.cols; c += 64) {
        float y = (x[base + c] - mean) * inv;
        if (p.has_w != 0) y *= w[c];
        if (p.has_b != 0) y += bias[c];
        o[ob + c] = y;
    }
}
