#version 450
// Row gather and scatter-add on contiguous (rows, width) arrays: mode 0 out[i] = x[idx[i]]
// (take_rows, embedding); mode 1 out[idx[i]] += x[i] * scale[i] (add_rows; distinct rows).
layout(local_size_x = 256) in;
layout(std430, binding = 0) buffer Out { float o[]; };
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) readonly buffer Idx { int idx[]; };
layout(std430, binding = 3) readonly buffer Scale { float scale[]; };
layout(push_constant) uniform P { int rows; int width; int mode; int xo; int oo; } p;

void main() {
    uint id = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * 256u + gl_LocalInvocationID.x;
    if (id >= uint(p.rows * p.width)) return;
    int i = int(id) / p.width, c = int(id) % p.width, r = idx[i];
    if (p.mode == 0) o[p.oo + i * p.width + c] = x[p.xo + r * p.width + c];
    else o[p.oo + r * p.width + c] += x[p.xo + i * p.width + c] * scale[i];
}
