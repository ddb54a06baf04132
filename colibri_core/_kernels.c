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

/* ---- a weight, and output rows [n0, n1) of x @ W^T for a few x rows ---- */

enum { K_Q8, K_Q4, K_MXFP4, K_FP8, K_BF16, K_KINDS };
static const char *KIND_NAMES[K_KINDS] = {"q8", "q4", "mxfp4", "fp8", "bf16"};

typedef struct {
    int kind;
    const void *data, *scales;
    int64_t N, K, bm, bn;
} Weight;

/* out[m * ld + n] for m < M and n in [n0, n1) */
typedef void (*rows_fn)(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1);

CLONES static void rows_q8(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    const int8_t *q = W->data; const float *s = W->scales; const int64_t K = W->K;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = q + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += (float)row[k] * xm[k];
            out[m * ld + n] = acc * s[n];
        }
    }
}

CLONES static void rows_bf16(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    const uint16_t *w = W->data; const int64_t K = W->K;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *row = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += bits_to_float((uint32_t)row[k] << 16) * xm[k];
            out[m * ld + n] = acc;
        }
    }
}

CLONES static void rows_q4(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    const uint8_t *q = W->data; const float *s = W->scales; const int64_t K = W->K, G = (K + 63) / 64;
    for (int64_t n = n0; n < n1; n++) {
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
        for (int64_t m = 0; m < M; m++) out[m * ld + n] = acc[m];
    }
}

CLONES static void rows_fp8(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    const uint8_t *q = W->data; const float *s = W->scales;
    const int64_t K = W->K, bm = W->bm, bn = W->bn, KB = (K + bn - 1) / bn;
    for (int64_t n = n0; n < n1; n++) {
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
            out[m * ld + n] = acc;
        }
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

/* Activations for the int4 integer path: x quantised to int8 per 64-input group (as
 * llama.cpp does for its 4-bit formats), with the group's scale and the sum of its
 * int8 values (for the "- 8" of the weights' offset). */
typedef struct {
    int8_t *q;      /* M x G*64 */
    float *scale;   /* M x G */
    int32_t *sum;   /* M x G */
} QuantX;

static int quantize_x(const float *x, int64_t M, int64_t K, QuantX *out) {
    const int64_t G = (K + 63) / 64;
    out->q = calloc((size_t)(M * G * 64), 1);
    out->scale = malloc(sizeof(float) * M * G);
    out->sum = malloc(sizeof(int32_t) * M * G);
    if (!out->q || !out->scale || !out->sum) { free(out->q); free(out->scale); free(out->sum); return -1; }
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * K + g * 64;
            const int64_t width = K - g * 64 < 64 ? K - g * 64 : 64;
            float amax = 0.f;
            for (int64_t j = 0; j < width; j++) amax = fabsf(xg[j]) > amax ? fabsf(xg[j]) : amax;
            const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            int8_t *qg = out->q + (m * G + g) * 64;
            int32_t total = 0;
            for (int64_t j = 0; j < width; j++) {
                const int v = (int)lrintf(xg[j] * inv);
                qg[j] = (int8_t)v;
                total += v;
            }
            out->scale[m * G + g] = d;
            out->sum[m * G + g] = total;
        }
    return 0;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) static void rows_q4_avx2(const Weight *W, const QuantX *X, int64_t M, float *out,
                                                             int64_t ld, int64_t n0, int64_t n1) {
    const uint8_t *q = W->data; const float *s = W->scales; const int64_t K = W->K, G = (K + 63) / 64;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = q + n * G * 32;
        const float *sc = s + n * G;
        __m256 acc[MAX_ROWS];
        float fix[MAX_ROWS];
        for (int64_t m = 0; m < M; m++) { acc[m] = _mm256_setzero_ps(); fix[m] = 0.f; }
        for (int64_t g = 0; g < G; g++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + g * 32));
            const __m256i lo = _mm256_and_si256(bytes, low4);                       /* inputs 0..31 */
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);  /* inputs 32..63 */
            for (int64_t m = 0; m < M; m++) {
                const int8_t *xq = X->q + (m * G + g) * 64;
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                                                   _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))));
                const float d = X->scale[m * G + g] * sc[g];
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(d), acc[m]);
                fix[m] += 8.f * (float)X->sum[m * G + g] * d;  /* the nibbles' offset of 8 */
            }
        }
        for (int64_t m = 0; m < M; m++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            out[m * ld + n] = _mm_cvtss_f32(v) - fix[m];
        }
    }
}
#else
static void rows_q4_avx2(const Weight *W, const QuantX *X, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    (void)W; (void)X; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
#endif

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

static void rows_mxfp4(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    const uint8_t *q = W->data, *e = W->scales; const int64_t K = W->K, G = (K + 31) / 32;
    float *row_f = malloc(sizeof(float) * G * 32);  /* one decoded row, reused for every row */
    if (row_f == NULL) return;
    for (int64_t n = n0; n < n1; n++) {
        mxfp4_row(q + n * G * 16, e + n * G, G, row_f);
        for (int64_t m = 0; m < M; m++) out[m * ld + n] = dot_f32(row_f, x + m * K, K);
    }
    free(row_f);
}

static const rows_fn ROWS[K_KINDS] = {rows_q8, rows_q4, rows_mxfp4, rows_fp8, rows_bf16};

#ifdef _OPENMP
#include <omp.h>
#endif

/* this thread's share of n rows */
static void my_rows(int64_t n, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    const int64_t t = 0, T = 1;
#endif
    const int64_t chunk = (n + T - 1) / T;
    *lo = t * chunk < n ? t * chunk : n;
    *hi = *lo + chunk < n ? *lo + chunk : n;
}

/* rows [n0, n1) of x @ W^T; int4 weights take the integer path on AVX2 machines, with x
 * quantised once per call (qx) */
static void weight_rows(const Weight *W, const float *x, const QuantX *qx, int64_t M, float *out, int64_t ld, int64_t n0,
                        int64_t n1) {
    if (W->kind == K_Q4 && qx != NULL) rows_q4_avx2(W, qx, M, out, ld, n0, n1);
    else ROWS[W->kind](W, x, M, out, ld, n0, n1);
}

static int wants_qx(const Weight *W) { return W->kind == K_Q4 && use_avx2; }

static int matmul_rows(const Weight *W, const float *x, int64_t M, float *out) {
    QuantX qx, *pq = NULL;
    if (wants_qx(W)) {
        if (quantize_x(x, M, W->K, &qx)) return -1;
        pq = &qx;
    }
    #pragma omp parallel
    {
        int64_t lo, hi;
        my_rows(W->N, &lo, &hi);
        weight_rows(W, x, pq, M, out, W->N, lo, hi);
    }
    if (pq) { free(qx.q); free(qx.scale); free(qx.sum); }
    return 0;
}

/* down(silu(gate x) * up x) for a few x rows, in one parallel region: the threads wake
 * once per expert, not once per matrix. g and h are M x I scratch. */
static int swiglu_rows(const Weight *G, const Weight *U, const Weight *D, const float *x, int64_t M, float *g, float *h,
                       float *out) {
    const int64_t I = G->N;
    QuantX qx, qh;
    int have_qx = 0, have_qh = 0, failed = 0;
    if (wants_qx(G) || wants_qx(U)) {
        if (quantize_x(x, M, G->K, &qx)) return -1;
        have_qx = 1;
    }
    #pragma omp parallel
    {
        int64_t lo, hi;
        my_rows(I, &lo, &hi);
        weight_rows(G, x, have_qx && G->kind == K_Q4 ? &qx : NULL, M, g, I, lo, hi);
        weight_rows(U, x, have_qx && U->kind == K_Q4 ? &qx : NULL, M, h, I, lo, hi);
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = lo; i < hi; i++) {
                const float a = g[m * I + i];
                h[m * I + i] *= a / (1.0f + expf(-a));
            }
        #pragma omp barrier
        #pragma omp single
        {
            if (wants_qx(D)) {
                if (quantize_x(h, M, I, &qh) == 0) have_qh = 1;
                else failed = 1;
            }
        }
        if (!failed) {
            my_rows(D->N, &lo, &hi);
            weight_rows(D, h, have_qh ? &qh : NULL, M, out, D->N, lo, hi);
        }
    }
    if (have_qx) { free(qx.q); free(qx.scale); free(qx.sum); }
    if (have_qh) { free(qh.q); free(qh.scale); free(qh.sum); }
    return failed ? -1 : 0;
}

/* ---- dequantise the whole weight (for BLAS on many rows) ----
 * Serial on purpose: BLAS multiplies right after with its own threads, and OpenMP
 * threads spinning beside them would take the cores BLAS needs. */

CLONES static void dq_q8(const int8_t *q, const float *s, float *w, int64_t N, int64_t K) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) w[n * K + k] = (float)q[n * K + k] * s[n];
}

CLONES static void dq_bf16(const uint16_t *q, float *w, int64_t N, int64_t K) {
    for (int64_t i = 0; i < N * K; i++) w[i] = bits_to_float((uint32_t)q[i] << 16);
}

CLONES static void dq_q4(const uint8_t *q, const float *s, float *w, int64_t N, int64_t K) {
    const int64_t G = (K + 63) / 64;
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
    float *row_f = malloc(sizeof(float) * G * 32);
    if (row_f == NULL) return;
    for (int64_t n = 0; n < N; n++) {
        mxfp4_row(q + n * G * 16, e + n * G, G, row_f);
        memcpy(w + n * K, row_f, sizeof(float) * K);
    }
    free(row_f);
}

CLONES static void dq_fp8(const uint8_t *q, const float *s, float *w, int64_t N, int64_t K, int64_t bm, int64_t bn) {
    const int64_t KB = (K + bn - 1) / bn;
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < KB; b++) {
            const float sc = s[(n / bm) * KB + b];
            const int64_t lo = b * bn, hi = lo + bn < K ? lo + bn : K;
            for (int64_t k = lo; k < hi; k++) w[n * K + k] = e4m3_to_float(q[n * K + k]) * sc;
        }
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

static int kind_of(const char *name) {
    for (int i = 0; i < K_KINDS; i++) if (!strcmp(name, KIND_NAMES[i])) return i;
    return -1;
}

static Py_ssize_t weight_bytes(int kind, int64_t N, int64_t K, int64_t bm, int64_t bn, Py_ssize_t *scale_bytes) {
    switch (kind) {
    case K_Q8: *scale_bytes = N * 4; return N * K;
    case K_Q4: { int64_t G = (K + 63) / 64; *scale_bytes = N * G * 4; return N * G * 32; }
    case K_MXFP4: { int64_t G = (K + 31) / 32; *scale_bytes = N * G; return N * G * 16; }
    case K_FP8: *scale_bytes = ((N + bm - 1) / bm) * ((K + bn - 1) / bn) * 4; return N * K;
    default: *scale_bytes = 0; return N * K * 2;
    }
}

/* Fill W from (kind, data, scales, n, k, bm, bn); bufs[0..1] receive data and scales. */
static int parse_weight(const char *kind_name, PyObject *data, PyObject *scales, long long n, long long k, long long bm,
                        long long bn, Weight *W, Buf *bufs) {
    W->kind = kind_of(kind_name);
    if (W->kind < 0) { PyErr_Format(PyExc_ValueError, "unknown kernel kind %s", kind_name); return -1; }
    if (n <= 0 || k <= 0 || bm <= 0 || bn <= 0) { PyErr_SetString(PyExc_ValueError, "sizes must be positive"); return -1; }
    Py_ssize_t sbytes, wbytes = weight_bytes(W->kind, n, k, bm, bn, &sbytes);
    if (get_buf(data, &bufs[0], 0, wbytes, "weight")) return -1;
    if (sbytes && get_buf(scales, &bufs[1], 0, sbytes, "scales")) return -1;
    W->data = bufs[0].b.buf;
    W->scales = sbytes ? bufs[1].b.buf : NULL;
    W->N = n; W->K = k; W->bm = bm; W->bn = bn;
    return 0;
}

static int rows_of(Buf *x, int64_t k, Py_ssize_t *M) {
    *M = x->b.len / (Py_ssize_t)(k * 4);
    if (*M < 1 || *M > MAX_ROWS || x->b.len != *M * k * 4) {
        PyErr_Format(PyExc_ValueError, "x must be 1..%d rows of %lld float32", MAX_ROWS, (long long)k);
        return -1;
    }
    return 0;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    const char *kind; PyObject *xo, *wo, *so, *oo; long long n, k, bm = 128, bn = 128;
    if (!PyArg_ParseTuple(args, "sOOOOLL|LL", &kind, &xo, &wo, &so, &oo, &n, &k, &bm, &bn)) return NULL;
    Buf b[4] = {{0}};
    Weight W;
    Py_ssize_t M;
    if (parse_weight(kind, wo, so, n, k, bm, bn, &W, &b[1]) || get_buf(xo, &b[0], 0, 0, "x") || rows_of(&b[0], k, &M) ||
        get_buf(oo, &b[3], 1, 0, "out")) { release(b, 4); return NULL; }
    if (b[3].b.len < M * n * 4) { release(b, 4); PyErr_SetString(PyExc_ValueError, "out is too small"); return NULL; }
    const float *x = b[0].b.buf; float *out = b[3].b.buf;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = matmul_rows(&W, x, M, out);
    Py_END_ALLOW_THREADS
    release(b, 4);
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* swiglu(x, (kind, data, scales, n, k, bm, bn) x 3 for gate, up, down, out) */
static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    PyObject *xo, *oo; const char *kinds[3]; PyObject *data[3], *scales[3]; long long n[3], k[3], bm[3], bn[3];
    if (!PyArg_ParseTuple(args, "O(sOOLLLL)(sOOLLLL)(sOOLLLL)O", &xo,
                          &kinds[0], &data[0], &scales[0], &n[0], &k[0], &bm[0], &bn[0],
                          &kinds[1], &data[1], &scales[1], &n[1], &k[1], &bm[1], &bn[1],
                          &kinds[2], &data[2], &scales[2], &n[2], &k[2], &bm[2], &bn[2], &oo)) return NULL;
    Buf b[8] = {{0}};
    Weight W[3];
    Py_ssize_t M;
    for (int i = 0; i < 3; i++)
        if (parse_weight(kinds[i], data[i], scales[i], n[i], k[i], bm[i], bn[i], &W[i], &b[2 * i])) { release(b, 8); return NULL; }
    if (W[0].N != W[1].N || W[0].K != W[1].K || W[2].K != W[0].N) {
        release(b, 8);
        PyErr_SetString(PyExc_ValueError, "gate and up must be (I, H) and down (H, I)");
        return NULL;
    }
    if (get_buf(xo, &b[6], 0, 0, "x") || rows_of(&b[6], W[0].K, &M) || get_buf(oo, &b[7], 1, M * W[2].N * 4, "out")) {
        release(b, 8);
        return NULL;
    }
    float *scratch = malloc(sizeof(float) * 2 * M * W[0].N);
    if (scratch == NULL) { release(b, 8); return PyErr_NoMemory(); }
    const float *x = b[6].b.buf; float *out = b[7].b.buf;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = swiglu_rows(&W[0], &W[1], &W[2], x, M, scratch, scratch + M * W[0].N, out);
    Py_END_ALLOW_THREADS
    free(scratch);
    release(b, 8);
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    const char *kind; PyObject *wo, *so, *oo; long long n, k, bm = 128, bn = 128;
    if (!PyArg_ParseTuple(args, "sOOOLL|LL", &kind, &wo, &so, &oo, &n, &k, &bm, &bn)) return NULL;
    Buf b[3] = {{0}};
    Weight W;
    if (parse_weight(kind, wo, so, n, k, bm, bn, &W, &b[0]) || get_buf(oo, &b[2], 1, (Py_ssize_t)(n * k * 4), "out")) {
        release(b, 3);
        return NULL;
    }
    float *out = b[2].b.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (W.kind) {
    case K_Q8: dq_q8(W.data, W.scales, out, n, k); break;
    case K_Q4: dq_q4(W.data, W.scales, out, n, k); break;
    case K_MXFP4: dq_mxfp4(W.data, W.scales, out, n, k); break;
    case K_FP8: dq_fp8(W.data, W.scales, out, n, k, bm, bn); break;
    default: dq_bf16(W.data, out, n, k);
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(kind, x, data, scales, out, n, k[, bm, bn]): out = x @ W^T for 1..8 rows"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(kind, data, scales, out, n, k[, bm, bn]): W as float32"},
    {"swiglu", py_swiglu, METH_VARARGS,
     "swiglu(x, gate, up, down, out): down(silu(gate x) * up x), each weight (kind, data, scales, n, k, bm, bn)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "colibri's CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    use_avx2 = have_avx2();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyModule_AddIntConstant(m, "MAX_ROWS", MAX_ROWS);
    PyModule_AddIntConstant(m, "INT4_INTEGER_PATH", use_avx2);
#ifdef _OPENMP
    PyModule_AddIntConstant(m, "OPENMP", 1);
#else
    PyModule_AddIntConstant(m, "OPENMP", 0);
#endif
    return m;
}
