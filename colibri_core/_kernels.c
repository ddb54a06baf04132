/* colibri_core._kernels: fused dequantise + matmul kernels for the CPU backend.
 *
 * Plain C loops written so the compiler vectorises them; GCC/Clang compile each hot
 * function for several x86 levels (x86-64-v4 = AVX-512, v3 = AVX2 + FMA, baseline) and
 * pick one at load time. OpenMP splits output rows across cores. The GIL is released
 * while a kernel runs, so the expert prefetch threads keep reading meanwhile.
 *
 * Weight layouts (one row = one output feature, K inputs):
 *   q8     int8 [N, K], one float32 scale per row                       w = q * s[n]
 *   q4     uint8 [N, G*32], G = ceil(K/64), float32 scales [N, G]      w = (nibble - 8) * s
 *          byte j of group g holds input 64g+j (low nibble) and 64g+j+32 (high nibble)
 *   mxfp4  uint8 [N, G*16], G = ceil(K/32), uint8 E8M0 exponents [N, G] w = e2m1 * 2^(E-127)
 *          byte j of group g holds input 32g+j (low nibble) and 32g+j+16 (high nibble)
 *   fp8    uint8 e4m3 [N, K], float32 scales [ceil(N/bm), ceil(K/bn)]  w = e4m3 * s[n/bm, k/bn]
 *   bf16   uint16 [N, K]                                                w = bf16
 * Padding inputs of a last partial group are stored as zeros.
 *
 * matmul(kind, x, data, scales, out, n, k[, bm, bn]): out[M, N] = x[M, K] @ W^T for a
 * few rows M (decode); dequantize(kind, data, scales, out, n, k[, bm, bn]) writes W as
 * float32 [N, K] (the caller then uses BLAS for many rows, i.e. prefill).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(COLIBRI_NO_CLONES)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define MAX_ROWS 8  /* matmul handles up to this many x rows per weight pass */

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t bits_of(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* e4m3 byte -> float32. Normal values are assembled from their bits with the exponent
 * rebiased (7 -> 127); subnormal bytes (exponent 0) are m * 2^-9, computed from the
 * integer. No float32 subnormal is ever formed: x86 would take a microcode assist on each. */
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xF, m = b & 7, sign = (uint32_t)(b & 0x80) << 24;
    const float normal = bits_to_float(sign | ((e + 120) << 23) | (m << 20));
    const float small = bits_to_float(sign | bits_of((float)m * 0.001953125f));  /* m * 2^-9 */
    return e ? normal : small;
}

/* ---- decode one group of a row into tmp (float32), returning the group's width ---- */

static inline void decode_q4_group(const uint8_t *b, float *tmp) {
    for (int j = 0; j < 32; j++) {
        tmp[j] = (float)((int)(b[j] & 15) - 8);
        tmp[j + 32] = (float)((int)(b[j] >> 4) - 8);
    }
}


static inline float e8m0_to_float(uint8_t e) {
    /* 2^(e-127) from its exponent bits; e = 0 (2^-127) would be subnormal: use ldexpf */
    return e ? bits_to_float((uint32_t)e << 23) : ldexpf(1.0f, -127);
}

/* ---- matmul: a few x rows against the whole weight, one pass over W ---- */

CLONES static void mm_q8(const float *x, int64_t M, const int8_t *q, const float *s, float *out, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = q + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += (float)row[k] * xm[k];
            out[m * N + n] = acc * s[n];
        }
    }
}

CLONES static void mm_bf16(const float *x, int64_t M, const uint16_t *w, float *out, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *row = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += bits_to_float((uint32_t)row[k] << 16) * xm[k];
            out[m * N + n] = acc;
        }
    }
}

CLONES static void mm_q4(const float *x, int64_t M, const uint8_t *q, const float *s, float *out, int64_t N, int64_t K) {
    const int64_t G = (K + 63) / 64;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = q + n * G * 32;
        const float *sc = s + n * G;
        float acc[MAX_ROWS] = {0};
        float tmp[64];
        for (int64_t g = 0; g < G; g++) {
            decode_q4_group(row + g * 32, tmp);
            const int64_t base = g * 64, width = K - base < 64 ? K - base : 64;
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * K + base;
                float part = 0.f;
                for (int64_t j = 0; j < width; j++) part += tmp[j] * xm[j];
                acc[m] += part * sc[g];
            }
        }
        for (int64_t m = 0; m < M; m++) out[m * N + n] = acc[m];
    }
}

/* e2m1 values times 2, as int8: the nibble indexes this table (sign bit = 8). */
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Decode one 32-input MXFP4 group (16 bytes) times ``scale`` into dst[0..31]. The AVX2
 * version looks the nibbles up with a byte shuffle, which compilers do not derive from C. */
static inline void mxfp4_group_portable(const uint8_t *b, float scale, float *dst) {
    const float half = 0.5f * scale;
    for (int j = 0; j < 16; j++) {
        dst[j] = (float)E2M1_X2[b[j] & 15] * half;
        dst[j + 16] = (float)E2M1_X2[b[j] >> 4] * half;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
__attribute__((target("avx2"))) static void mxfp4_row_avx2(const uint8_t *row, const uint8_t *ex, int64_t G, float *out) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)E2M1_X2);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; g++) {
        const __m256 half = _mm256_set1_ps(0.5f * e8m0_to_float(ex[g]));
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + g * 16));
        const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4));
        const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
        float *dst = out + g * 32;
        _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), half));
        _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), half));
        _mm256_storeu_ps(dst + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), half));
        _mm256_storeu_ps(dst + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), half));
    }
}
static int have_avx2(void) { return __builtin_cpu_supports("avx2"); }
#else
static void mxfp4_row_avx2(const uint8_t *row, const uint8_t *ex, int64_t G, float *out) { (void)row; (void)ex; (void)G; (void)out; }
static int have_avx2(void) { return 0; }
#endif

static int use_avx2 = 0;  /* set at import */

static void mxfp4_row(const uint8_t *row, const uint8_t *ex, int64_t G, float *out) {
    if (use_avx2) {
        mxfp4_row_avx2(row, ex, G, out);
        return;
    }
    for (int64_t g = 0; g < G; g++) mxfp4_group_portable(row + g * 16, e8m0_to_float(ex[g]), out + g * 32);
}

CLONES static float dot_f32(const float *a, const float *b, int64_t K) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; k++) acc += a[k] * b[k];
    return acc;
}

static void mm_mxfp4(const float *x, int64_t M, const uint8_t *q, const uint8_t *e, float *out, int64_t N, int64_t K) {
    const int64_t G = (K + 31) / 32;
    #pragma omp parallel
    {
        float *row_f = malloc(sizeof(float) * G * 32);  /* one decoded row, reused for every row of this thread */
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            mxfp4_row(q + n * G * 16, e + n * G, G, row_f);
            for (int64_t m = 0; m < M; m++) out[m * N + n] = dot_f32(row_f, x + m * K, K);
        }
        free(row_f);
    }
}

CLONES static void mm_fp8(const float *x, int64_t M, const uint8_t *q, const float *s, float *out, int64_t N, int64_t K,
                          int64_t bm, int64_t bn) {
    const int64_t KB = (K + bn - 1) / bn;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = q + n * K;
        const float *sc = s + (n / bm) * KB;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t b = 0; b < KB; b++) {
                const int64_t lo = b * bn, hi = lo + bn < K ? lo + bn : K;
                float part = 0.f;
                for (int64_t k = lo; k < hi; k++) part += e4m3_to_float(row[k]) * xm[k];
                acc += part * sc[b];
            }
            out[m * N + n] = acc;
        }
    }
}

/* ---- dequantise the whole weight (for BLAS on many rows) ---- */

CLONES static void dq_q8(const int8_t *q, const float *s, float *w, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) w[n * K + k] = (float)q[n * K + k] * s[n];
}

CLONES static void dq_bf16(const uint16_t *q, float *w, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N * K; i++) w[i] = bits_to_float((uint32_t)q[i] << 16);
}

CLONES static void dq_q4(const uint8_t *q, const float *s, float *w, int64_t N, int64_t K) {
    const int64_t G = (K + 63) / 64;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float tmp[64];
        for (int64_t g = 0; g < G; g++) {
            decode_q4_group(q + (n * G + g) * 32, tmp);
            const int64_t base = g * 64, width = K - base < 64 ? K - base : 64;
            const float sc = s[n * G + g];
            for (int64_t j = 0; j < width; j++) w[n * K + base + j] = tmp[j] * sc;
        }
    }
}

static void dq_mxfp4(const uint8_t *q, const uint8_t *e, float *w, int64_t N, int64_t K) {
    const int64_t G = (K + 31) / 32;
    #pragma omp parallel
    {
        float *row_f = malloc(sizeof(float) * G * 32);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            mxfp4_row(q + n * G * 16, e + n * G, G, row_f);
            memcpy(w + n * K, row_f, sizeof(float) * K);
        }
        free(row_f);
    }
}

CLONES static void dq_fp8(const uint8_t *q, const float *s, float *w, int64_t N, int64_t K, int64_t bm, int64_t bn) {
    const int64_t KB = (K + bn - 1) / bn;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
            w[n * K + k] = e4m3_to_float(q[n * K + k]) * s[(n / bm) * KB + k / bn];
}

/* ---- Python glue ---- */

typedef struct { Py_buffer b; int held; } Buf;

static int get_buf(PyObject *o, Buf *buf, int writable, Py_ssize_t min_bytes, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &buf->b, flags) != 0) return -1;
    buf->held = 1;
    if (buf->b.len < min_bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, buf->b.len, min_bytes);
        return -1;
    }
    return 0;
}

static void release(Buf *bufs, int n) {
    for (int i = 0; i < n; i++) if (bufs[i].held) PyBuffer_Release(&bufs[i].b);
}

static Py_ssize_t weight_bytes(const char *kind, int64_t N, int64_t K, int64_t bm, int64_t bn, Py_ssize_t *scale_bytes) {
    if (!strcmp(kind, "q8")) { *scale_bytes = N * 4; return N * K; }
    if (!strcmp(kind, "q4")) { int64_t G = (K + 63) / 64; *scale_bytes = N * G * 4; return N * G * 32; }
    if (!strcmp(kind, "mxfp4")) { int64_t G = (K + 31) / 32; *scale_bytes = N * G; return N * G * 16; }
    if (!strcmp(kind, "fp8")) { *scale_bytes = ((N + bm - 1) / bm) * ((K + bn - 1) / bn) * 4; return N * K; }
    if (!strcmp(kind, "bf16")) { *scale_bytes = 0; return N * K * 2; }
    return -1;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    const char *kind; PyObject *xo, *wo, *so, *oo; long long n, k, bm = 128, bn = 128;
    if (!PyArg_ParseTuple(args, "sOOOOLL|LL", &kind, &xo, &wo, &so, &oo, &n, &k, &bm, &bn)) return NULL;
    if (n <= 0 || k <= 0 || bm <= 0 || bn <= 0) { PyErr_SetString(PyExc_ValueError, "sizes must be positive"); return NULL; }
    Py_ssize_t sbytes; Py_ssize_t wbytes = weight_bytes(kind, n, k, bm, bn, &sbytes);
    if (wbytes < 0) { PyErr_Format(PyExc_ValueError, "unknown kernel kind %s", kind); return NULL; }
    Buf b[4] = {{0}};
    if (get_buf(xo, &b[0], 0, 0, "x") || get_buf(wo, &b[1], 0, wbytes, "weight") ||
        (sbytes && get_buf(so, &b[2], 0, sbytes, "scales")) || get_buf(oo, &b[3], 1, 0, "out")) { release(b, 4); return NULL; }
    Py_ssize_t M = b[0].b.len / (Py_ssize_t)(k * 4);
    if (M < 1 || M > MAX_ROWS || b[0].b.len != M * k * 4 || b[3].b.len < M * n * 4) {
        release(b, 4);
        PyErr_Format(PyExc_ValueError, "x must be 1..%d rows of %lld float32 and out %lld per row", MAX_ROWS, k, n);
        return NULL;
    }
    const float *x = b[0].b.buf; float *out = b[3].b.buf; const void *w = b[1].b.buf; const void *s = sbytes ? b[2].b.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (!strcmp(kind, "q8")) mm_q8(x, M, w, s, out, n, k);
    else if (!strcmp(kind, "q4")) mm_q4(x, M, w, s, out, n, k);
    else if (!strcmp(kind, "mxfp4")) mm_mxfp4(x, M, w, s, out, n, k);
    else if (!strcmp(kind, "fp8")) mm_fp8(x, M, w, s, out, n, k, bm, bn);
    else mm_bf16(x, M, w, out, n, k);
    Py_END_ALLOW_THREADS
    release(b, 4);
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    const char *kind; PyObject *wo, *so, *oo; long long n, k, bm = 128, bn = 128;
    if (!PyArg_ParseTuple(args, "sOOOLL|LL", &kind, &wo, &so, &oo, &n, &k, &bm, &bn)) return NULL;
    if (n <= 0 || k <= 0 || bm <= 0 || bn <= 0) { PyErr_SetString(PyExc_ValueError, "sizes must be positive"); return NULL; }
    Py_ssize_t sbytes; Py_ssize_t wbytes = weight_bytes(kind, n, k, bm, bn, &sbytes);
    if (wbytes < 0) { PyErr_Format(PyExc_ValueError, "unknown kernel kind %s", kind); return NULL; }
    Buf b[3] = {{0}};
    if (get_buf(wo, &b[0], 0, wbytes, "weight") || (sbytes && get_buf(so, &b[1], 0, sbytes, "scales")) ||
        get_buf(oo, &b[2], 1, (Py_ssize_t)(n * k * 4), "out")) { release(b, 3); return NULL; }
    const void *w = b[0].b.buf; const void *s = sbytes ? b[1].b.buf : NULL; float *out = b[2].b.buf;
    Py_BEGIN_ALLOW_THREADS
    if (!strcmp(kind, "q8")) dq_q8(w, s, out, n, k);
    else if (!strcmp(kind, "q4")) dq_q4(w, s, out, n, k);
    else if (!strcmp(kind, "mxfp4")) dq_mxfp4(w, s, out, n, k);
    else if (!strcmp(kind, "fp8")) dq_fp8(w, s, out, n, k, bm, bn);
    else dq_bf16(w, out, n, k);
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(kind, x, data, scales, out, n, k[, bm, bn]): out = x @ W^T for 1..8 rows"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(kind, data, scales, out, n, k[, bm, bn]): W as float32"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "colibri's CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    use_avx2 = have_avx2();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyModule_AddIntConstant(m, "MAX_ROWS", MAX_ROWS);
#ifdef _OPENMP
    PyModule_AddIntConstant(m, "OPENMP", 1);
#else
    PyModule_AddIntConstant(m, "OPENMP", 0);
#endif
    return m;
}
