/* colibri_core.compute.cpu._kernels: fused dequantise + matmul kernels for the CPU backend.
 *
 * Plain C loops written so the compiler vectorises them; GCC/Clang compile each hot
 * function for several x86 levels (x86-64-v4 = AVX-512, v3 = AVX2 + FMA, baseline) and
 * pick one at load time. OpenMP splits output rows across cores. The GIL is released
 * while a kernel runs, so the expert prefetch threads keep reading meanwhile.
 *
 * Weight layouts (one row = one output feature, K inputs):
 *   q8     int8 [N, K], one float32 scale per row                       w = q * s[n]
 *   q4     uint8 [N, G*32], G = ceil(K/64), scales [N, G]              w = (nibble - 8) * s
 *          (scales as bfloat16 bits, uint16, or as float32)
 *          byte j of group g holds input 64g+j (low nibble) and 64g+j+32 (high nibble)
 *   mxfp4  uint8 [N, G*16], G = ceil(K/32), uint8 E8M0 exponents [N, G] w = e2m1 * 2^(E-127)
 *          byte j of group g holds input 32g+j (low nibble) and 32g+j+16 (high nibble)
 *   fp8    uint8 e4m3 [N, K], float32 scales [ceil(N/bm), ceil(K/bn)]  w = e4m3 * s[n/bm, k/bn]
 *   bf16   uint16 [N, K]                                                w = bf16
 *   q4g32      uint8 [N, G*16], G = ceil(K/32), scales [N, G] (bf16 bits or float32)
 *              w = (nibble - 8) * s; byte j of group g holds input 32g+2j (low nibble)
 *              and 32g+2j+1 (high): compressed-tensors pack-quantized int4 read as bytes
 *   mxfp4pair  uint8 [N, G*16], uint8 E8M0 exponents [N, G]            w = e2m1 * 2^(E-127)
 *              with the same pair order (gpt-oss's *_blocks / *_scales)
 * Padding inputs of a last partial group are stored as zeros.
 *
 * weight(kind, data, scales, n, k[, bm, bn]) checks a packed weight once and returns its
 * prepared form; matmul(x, w, out): out[M, N] = x[M, K] @ W^T, passing over the packed
 * weight once per MAX_ROWS rows of x (decode, short prompts); linears() does several
 * weights sharing x at once; moe() a layer's routed SwiGLU experts; route() the softmax
 * top-k router; dequantize(kind, data, scales, out, n, k[, bm, bn]) writes W as float32
 * [N, K] (the caller then uses BLAS for many rows, i.e. long prompts); rms_norm(),
 * rope() and attention() do the rest of a decoder layer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

/* The x86 vector paths (AVX2, AVX-512) are compiled where GCC or Clang targets x86-64;
 * -DCOLIBRI_NO_X86 leaves them out, building the kernels as on any other CPU (tested). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(COLIBRI_NO_X86)
#define COLIBRI_X86 1
#endif

#if defined(COLIBRI_X86) && !defined(COLIBRI_NO_CLONES)
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

enum { K_Q8, K_Q4, K_MXFP4, K_FP8, K_BF16, K_Q4G32, K_MXFP4P, K_KINDS };
static const char *KIND_NAMES[K_KINDS] = {"q8", "q4", "mxfp4", "fp8", "bf16", "q4g32", "mxfp4pair"};

typedef struct {
    int kind;
    const void *data, *scales;
    int64_t N, K, bm, bn;
    int bf16_scales;  /* q4, q4g32: scales are bfloat16 bits (uint16), not float32 */
} Weight;

#define MAX_Q4_GROUPS 2048  /* q4 rows with bf16 scales: at most this many groups (131072 inputs) */

/* row n's q4 group scales as float32: a pointer into W's scales, or, for bf16 scales,
 * widened into buf (MAX_Q4_GROUPS floats) */
static inline const float *q4_row_scales(const Weight *W, int64_t n, int64_t G, float *buf) {
    if (!W->bf16_scales) return (const float *)W->scales + n * G;
    const uint16_t *s = (const uint16_t *)W->scales + n * G;
    for (int64_t g = 0; g < G; g++) buf[g] = bits_to_float((uint32_t)s[g] << 16);
    return buf;
}

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
    const uint8_t *q = W->data; const int64_t K = W->K, G = (K + 63) / 64;
    float buf[MAX_Q4_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = q + n * G * 32;
        const float *sc = q4_row_scales(W, n, G, buf);
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

/* The pair-order 4-bit kinds (q4g32, mxfp4pair): nibble -> int8 value, and the factor
 * that makes it the weight together with the group's scale (e2m1 values are stored
 * times 2). Group g's 16 bytes hold inputs 32g+2j (low nibble) and 32g+2j+1 (high). */
static const int8_t Q4_MINUS8[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

static inline const int8_t *pair4_table(const Weight *W) { return W->kind == K_MXFP4P ? E2M1_X2 : Q4_MINUS8; }

/* row n's group factors as float32 into buf (G floats): q4g32 its scales, mxfp4pair
 * 2^(E-127) / 2 */
static inline const float *pair4_row_scales(const Weight *W, int64_t n, int64_t G, float *buf) {
    if (W->kind == K_Q4G32) return q4_row_scales(W, n, G, buf);
    const uint8_t *e = (const uint8_t *)W->scales + n * G;
    for (int64_t g = 0; g < G; g++) buf[g] = 0.5f * e8m0_to_float(e[g]);
    return buf;
}

/* one pair-order group as float32 values (unscaled) */
static inline void pair4_group(const int8_t *table, const uint8_t *b, float *dst) {
    for (int j = 0; j < 16; j++) {
        dst[2 * j] = (float)table[b[j] & 15];
        dst[2 * j + 1] = (float)table[b[j] >> 4];
    }
}


/* Decode one 32-input MXFP4 group (16 bytes) times ``scale`` into dst[0..31]. The AVX2
 * version looks the nibbles up with a byte shuffle, which compilers do not derive from C. */
static inline void mxfp4_group_portable(const uint8_t *b, float scale, float *dst) {
    const float half = 0.5f * scale;
    for (int j = 0; j < 16; j++) {
        dst[j] = (float)E2M1_X2[b[j] & 15] * half;
        dst[j + 16] = (float)E2M1_X2[b[j] >> 4] * half;
    }
}

#ifdef COLIBRI_X86
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
static int have_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
static void mxfp4_row_avx2(const uint8_t *row, const uint8_t *ex, int64_t G, float *out) { (void)row; (void)ex; (void)G; (void)out; }
static int have_avx2(void) { return 0; }
#endif

static int use_avx2 = 0;  /* set at import */

/* ---- scratch memory, kept per thread between calls ----
 * A token's kernel calls ask for the same sizes every time: each thread keeps one buffer
 * per use (slot) that only grows, so decoding allocates nothing after the first token.
 * Requests above SCRATCH_KEEP bytes (long prompts, whose compute dwarfs an allocation)
 * are allocated and freed per call, so a long prompt leaves no large buffers behind. A
 * thread's buffers are freed when it exits. */
#define SCRATCH_KEEP ((size_t)4 << 20)
enum { SC_XG, SC_G, SC_H, SC_Y, SC_QX, SC_QXG, SC_QH, SC_ROUTE, SC_SCORES, SC_EXPERTS, SC_XP, SC_SLOTS };
typedef struct { void *p; size_t n; } Slot;
typedef struct { void *p; int owned; } Scratch;

#ifndef _WIN32
#include <pthread.h>
static pthread_key_t slots_key;
static pthread_once_t slots_once = PTHREAD_ONCE_INIT;
static int slots_ready = 0;

static void slots_free(void *p) {
    Slot *slots = p;
    for (int i = 0; i < SC_SLOTS; i++) free(slots[i].p);
    free(slots);
}
static void slots_make_key(void) { slots_ready = pthread_key_create(&slots_key, slots_free) == 0; }

static Slot *thread_slots(void) {
    pthread_once(&slots_once, slots_make_key);
    if (!slots_ready) return NULL;
    Slot *slots = pthread_getspecific(slots_key);
    if (slots == NULL && (slots = calloc(SC_SLOTS, sizeof(Slot))) != NULL && pthread_setspecific(slots_key, slots) != 0) {
        free(slots);
        slots = NULL;
    }
    return slots;
}
#else
static Slot *thread_slots(void) { return NULL; }  /* Windows: plain allocations per call */
#endif

/* ``bytes`` of scratch for ``slot`` (contents undefined); NULL when out of memory */
static void *scratch_get(int slot, size_t bytes, Scratch *s) {
    bytes = bytes ? bytes : 1;
    Slot *slots = bytes <= SCRATCH_KEEP ? thread_slots() : NULL;
    if (slots != NULL) {
        Slot *sl = &slots[slot];
        if (sl->n < bytes) {
            void *p = malloc(bytes);
            if (p == NULL) return NULL;
            free(sl->p);
            sl->p = p;
            sl->n = bytes;
        }
        s->owned = 0;
        return s->p = sl->p;
    }
    s->owned = 1;
    return s->p = malloc(bytes);
}

static void scratch_put(Scratch *s) {
    if (s->owned) free(s->p);
    s->p = NULL;
    s->owned = 0;
}

/* Activations for the integer paths, per 64-input group. int4 weights take x as int8
 * (as llama.cpp does for its 4-bit formats); int8 weights take x as int16, whose error
 * (1/65534 of the group's largest value) is far below the weights' own (1/254 of the
 * row's), where int8 activations doubled the container's error (measured). Each form is
 * made only when some weight wants it; a partial last group is zero-padded. */
typedef struct {
    int8_t *q;       /* M x G*64: int8 form */
    float *scale;    /* M x G */
    float *offset;   /* M x G: 8 * scale * (sum of the group's int8 values), for the int4 weights' "- 8" */
    int16_t *q16;    /* M x G*64: int16 form */
    float *scale16;  /* M x G */
    Scratch mem;     /* where the arrays above live */
    int8_t *qp;      /* M x G*64: the int8 form in pair order, for q4g32 (scale and offset as q's): per
                        64 inputs the even inputs of the first 32, of the second 32, then their odd inputs */
} QuantX;

enum { QX8 = 1, QX16 = 2, QX8P = 4 };  /* the forms a weight wants (QX8P goes with QX8) */

static int use_vnni = 0;  /* AVX-512 VNNI int4 path, set at import */
static int use_vbmi = 0;  /* AVX-512 VBMI mxfp4pair path, set at import */

static int64_t groups64(int64_t K) { return (K + 63) / 64; }

/* Software prefetch for the AVX2 streaming kernels (int8, int4, compressed-tensors int4
 * and fp8; the AVX-512 int8 and int4 paths take none: on an AMD EPYC Zen 4 it slowed the
 * int8 kernel and did not move the int4 one, 1-16 KiB ahead, either locality, see the
 * int8 kernel below): every 64 bytes of weights read
 * ask for the line PREFETCH_AHEAD bytes further on, up to the end of this thread's rows
 * (which lie one after another). A row's lines asked for all at once at the row's start
 * (into L1) had lifted the int8 kernel from ~72% to ~85% of a plain load loop's rate on
 * an Intel Xeon, but gained nothing on an AMD EPYC Zen 2; one line per 64 bytes gives
 * there int8 ~0.81 (from ~0.70), int4 ~0.66 (~0.57), and ~12% more GB/s for the
 * compressed-tensors int4 and fp8 kernels; 8-32 KiB ahead measured alike. The hint is
 * non-temporal (PREFETCH_HINT 0, __builtin_prefetch's locality): on one core it streams
 * weights from memory 9-40% faster than into L1 or L2, though weights already held in
 * L2 or L3 then read up to twice as slowly; decode reads its weights from memory
 * (benchmarks/kernel_bandwidth.py, kernel_rows.py; docs/benchmarks.md). */
#define PREFETCH_AHEAD (16 << 10)
#define PREFETCH_AHEAD_INT8 (8 << 10)  /* per stream: the AVX2 int8 kernel reads two (below) */
#ifndef PREFETCH_HINT
#define PREFETCH_HINT 0
#endif

static inline __attribute__((always_inline)) void prefetch_ahead_by(const void *at, const void *end, int64_t ahead) {
    if ((const char *)end - (const char *)at > ahead)  /* (no pointer formed past the rows) */
        __builtin_prefetch((const char *)at + ahead, 0, PREFETCH_HINT);
}

static inline __attribute__((always_inline)) void prefetch_ahead(const void *at, const void *end) {
    prefetch_ahead_by(at, end, PREFETCH_AHEAD);
}

static void quantx_free(QuantX *X) { scratch_put(&X->mem); }

/* room for M rows of K activations in the given forms, in scratch slot ``slot`` (the
 * contents are undefined until quantize_rows or quantx_copy_row fill them) */
static int quantx_alloc(int64_t M, int64_t K, int forms, int slot, QuantX *out) {
    const size_t cells = (size_t)(M * groups64(K)), q8 = forms & QX8 ? cells * 72 : 0, q16 = forms & QX16 ? cells * 132 : 0,
                 q8p = forms & QX8P ? cells * 64 : 0;
    memset(out, 0, sizeof(*out));
    char *p = scratch_get(slot, q8 + q16 + q8p, &out->mem);  /* per group: 64 values + 2 floats (int8), 64 + 1 float (int16) */
    if (p == NULL) return -1;
    if (forms & QX8P) out->qp = (int8_t *)(p + q8 + q16);
    if (forms & QX16) {  /* the int16 values first: they need 2-byte alignment */
        out->q16 = (int16_t *)p; out->scale16 = (float *)(p + cells * 128);
        p += q16;
    }
    if (forms & QX8) {
        out->scale = (float *)p; out->offset = (float *)(p + cells * 4); out->q = (int8_t *)(p + cells * 8);
    }
    return 0;
}

/* the rows from ``row`` on, as a QuantX of their own */
static QuantX quantx_at(const QuantX *X, int64_t row, int64_t K) {
    const int64_t G = groups64(K);
    QuantX v = {X->q ? X->q + row * G * 64 : NULL, X->scale ? X->scale + row * G : NULL,
                X->offset ? X->offset + row * G : NULL, X->q16 ? X->q16 + row * G * 64 : NULL,
                X->scale16 ? X->scale16 + row * G : NULL};
    v.qp = X->qp ? X->qp + row * G * 64 : NULL;
    return v;
}

/* copy row ``from`` of X into row ``to`` of Y (both of K activations, same forms) */
static void quantx_copy_row(const QuantX *X, int64_t from, QuantX *Y, int64_t to, int64_t K) {
    const int64_t G = groups64(K);
    if (X->q) {
        memcpy(Y->q + to * G * 64, X->q + from * G * 64, (size_t)(G * 64));
        memcpy(Y->scale + to * G, X->scale + from * G, sizeof(float) * G);
        memcpy(Y->offset + to * G, X->offset + from * G, sizeof(float) * G);
    }
    if (X->qp) memcpy(Y->qp + to * G * 64, X->qp + from * G * 64, (size_t)(G * 64));
    if (X->q16) {
        memcpy(Y->q16 + to * G * 64, X->q16 + from * G * 64, sizeof(int16_t) * G * 64);
        memcpy(Y->scale16 + to * G, X->scale16 + from * G, sizeof(float) * G);
    }
}

/* quantise rows [r0, r1) of x (K floats each) into the forms out has room for */
static void quantize_rows(const float *x, int64_t r0, int64_t r1, int64_t K, QuantX *out) {
    const int64_t G = groups64(K);
    for (int64_t m = r0; m < r1; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * K + g * 64;
            const int64_t width = K - g * 64 < 64 ? K - g * 64 : 64;
            float amax = 0.f;
            for (int64_t j = 0; j < width; j++) amax = fabsf(xg[j]) > amax ? fabsf(xg[j]) : amax;
            if (out->q) {
                const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
                int8_t *qg = out->q + (m * G + g) * 64;
                int32_t total = 0;
                for (int64_t j = 0; j < width; j++) {
                    const int v = (int)lrintf(xg[j] * inv);
                    qg[j] = (int8_t)v;
                    total += v;
                }
                for (int64_t j = width; j < 64; j++) qg[j] = 0;  /* the kernels read whole groups */
                out->scale[m * G + g] = d;
                out->offset[m * G + g] = 8.f * d * (float)total;
                if (out->qp) {
                    int8_t *pg = out->qp + (m * G + g) * 64;
                    for (int j = 0; j < 16; j++) {
                        pg[j] = qg[2 * j]; pg[16 + j] = qg[32 + 2 * j];
                        pg[32 + j] = qg[2 * j + 1]; pg[48 + j] = qg[32 + 2 * j + 1];
                    }
                }
            }
            if (out->q16) {
                const float inv = amax > 0.f ? 32767.f / amax : 0.f;
                int16_t *qg = out->q16 + (m * G + g) * 64;
                for (int64_t j = 0; j < width; j++) qg[j] = (int16_t)lrintf(xg[j] * inv);
                for (int64_t j = width; j < 64; j++) qg[j] = 0;
                out->scale16[m * G + g] = amax / 32767.f;
            }
        }
}

static int quantize_x(const float *x, int64_t M, int64_t K, int forms, int slot, QuantX *out) {
    if (quantx_alloc(M, K, forms, slot, out)) return -1;
    quantize_rows(x, 0, M, K, out);
    return 0;
}

#ifdef COLIBRI_X86
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Call fn(args..., m) with m = M as a compile-time constant 1..8: each row count gets
 * its own copy of the always-inline kernel body, whose per-row accumulators then live in
 * registers. */
#define BY_ROWS(M, fn, ...)                                                                                            \
    do {                                                                                                               \
        switch (M) {                                                                                                   \
        case 1: fn(__VA_ARGS__, 1); break;                                                                             \
        case 2: fn(__VA_ARGS__, 2); break;                                                                             \
        case 3: fn(__VA_ARGS__, 3); break;                                                                             \
        case 4: fn(__VA_ARGS__, 4); break;                                                                             \
        case 5: fn(__VA_ARGS__, 5); break;                                                                             \
        case 6: fn(__VA_ARGS__, 6); break;                                                                             \
        case 7: fn(__VA_ARGS__, 7); break;                                                                             \
        default: fn(__VA_ARGS__, 8);                                                                                   \
        }                                                                                                              \
    } while (0)

AVX2_INLINE float hsum256(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

/* sum over g < G of a[g] * b[g] */
AVX2_INLINE float dot_g(const float *a, const float *b, int64_t G) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), acc);
    float total = hsum256(acc);
    for (; g < G; g++) total += a[g] * b[g];
    return total;
}

/* one group of 64 int4 inputs of a row times x row m's int8 group, into acc: the low
 * nibbles hold inputs 0..31, the high ones 32..63 (their offset of 8 is taken off per row) */
AVX2_INLINE __m256 q4_group(__m256i bytes, const int8_t *xq, float d, __m256 acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1))), _mm256_set1_ps(d), acc);
}

/* int4 row times int8 activations, M a compile-time constant once inlined. Groups go two
 * at a time into two accumulators per x row, so that one fused multiply-add need not wait
 * for the previous one; the accumulators are named, not indexed by the group's parity,
 * which kept them in memory (a store-to-load round trip on every group: the kernel ran
 * at ~12 GB/s per core even from L2). */
AVX2_INLINE void q4_rows_m(const Weight *W, const QuantX *X, float *out, int64_t ld, int64_t n0, int64_t n1,
                           const int M) {
    const uint8_t *q = W->data; const int64_t K = W->K, G = groups64(K);
    float buf[MAX_Q4_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = q + n * G * 32;
        const float *sc = q4_row_scales(W, n, G, buf);
        __m256 even[MAX_ROWS], odd[MAX_ROWS];
        for (int m = 0; m < M; m++) even[m] = odd[m] = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 2 <= G; g += 2) {
            prefetch_ahead(row + g * 32, q + n1 * G * 32);
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)(row + g * 32));
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(row + g * 32 + 32));
            for (int m = 0; m < M; m++) {
                even[m] = q4_group(b0, X->q + (m * G + g) * 64, X->scale[m * G + g] * sc[g], even[m]);
                odd[m] = q4_group(b1, X->q + (m * G + g + 1) * 64, X->scale[m * G + g + 1] * sc[g + 1], odd[m]);
            }
        }
        if (g < G) {
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)(row + g * 32));
            for (int m = 0; m < M; m++) even[m] = q4_group(b0, X->q + (m * G + g) * 64, X->scale[m * G + g] * sc[g], even[m]);
        }
        for (int m = 0; m < M; m++)  /* minus the nibbles' offset of 8, via the precomputed 8 * scale * sum per group */
            out[m * ld + n] = hsum256(_mm256_add_ps(even[m], odd[m])) - dot_g(sc, X->offset + m * G, G);
    }
}


/* sum of row[k] * x[k] for k in [from, K): the int8 kernels' inputs past the last whole
 * group, in one function for every path (not inlined, so not vectorised for each path's
 * own width: a different order of the float sums would make machines differ) */
__attribute__((noinline)) static float q8_tail(const int8_t *row, const float *x, int64_t from, int64_t K) {
    float t = 0.f;
    for (int64_t k = from; k < K; k++) t += (float)row[k] * x[k];
    return t;
}

/* The AVX2 int8 kernel takes a thread's rows [n0, n1) from two streams in turn, its
 * first and second halves (n0, n0 + h, n0 + 1, n0 + h + 1, ...): two sequential streams
 * keep more lines in flight from memory than one. Measured on an AMD EPYC Zen 2
 * (benchmarks/kernel_bandwidth.py, 2 threads, ratio to a plain load loop): int8
 * ~0.80 -> ~0.88; four streams were slower than one. The int4 kernels lost with two
 * (int4 ~0.88 -> ~0.81, compressed-tensors int4 ~0.77 -> ~0.71) and fp8 did not move,
 * so they take one. Each of the two streams asks PREFETCH_AHEAD_INT8 (8 KiB) ahead:
 * 4-8 KiB measured ~3% above 16 KiB there, 32 KiB ~6% below. On an AMD EPYC Zen 4 the
 * AVX-512 path streamed best with neither: one stream without software prefetch ~31
 * GB/s of weights against ~25 with both (medians of 6 alternated runs; the prefetch
 * alone or the second stream alone cost about half of that each; 2-32 KiB ahead and
 * locality 3 alike), so it takes one stream and leaves the reading ahead to the
 * hardware (docs/benchmarks.md). A row's result does not depend on the order of the rows.
 *
 * Per row: int8 weights times int16 activations, per 16 inputs one sign extension of
 * the weights, shared by the x rows, and one multiply-add of int16 pairs per row
 * (vpmaddwd + vpaddd on AVX2; vpdpwssd on 32 inputs at a time with AVX-512 VNNI); int32
 * sums per 64-input group, then scaled. Inputs past the last whole group take the float
 * path (the weight rows are not padded). */
#define Q8I_BODY(GROUP_SUMS, TWO_STREAMS, PREFETCH)                                                            \
    const int8_t *q = W->data; const float *s = W->scales; const int64_t K = W->K, G = groups64(K), Gw = K / 64;     \
    for (int64_t i = 0, h = (n1 - n0 + 1) / 2; i < n1 - n0; i++) {  /* TWO_STREAMS: n0, n0 + h, n0 + 1, ... */   \
        const int64_t n = TWO_STREAMS ? n0 + i / 2 + (i % 2 ? h : 0) : n0 + i;                                        \
        const int8_t *row = q + n * K;                                                                                 \
        __m256 acc[MAX_ROWS];                                                                                          \
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();                                                      \
        for (int64_t g = 0; g < Gw; g++) {                                                                             \
            __m256i isum[MAX_ROWS];                                                                                    \
            if (PREFETCH) prefetch_ahead_by(row + g * 64, q + n1 * K, PREFETCH_AHEAD_INT8);                            \
            GROUP_SUMS(isum, row + g * 64, X->q16 + g * 64, G * 64);                                                   \
            for (int m = 0; m < M; m++)                                                                                \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(X->scale16[m * G + g]), acc[m]); \
        }                                                                                                              \
        for (int m = 0; m < M; m++) {                                                                                  \
            float t = hsum256(acc[m]);                                                                                 \
            if (Gw * 64 < K) t += q8_tail(row, xf + m * K, Gw * 64, K);                                                 \
            out[m * ld + n] = t * s[n];                                                                                \
        }                                                                                                              \
    }

/* isum[m] (8 int32 lanes) = one 64-input group of int8 weights w times x row m's int16
 * activations (x + m * stride): lane l sums the pairs of inputs 16j + 2l, 16j + 2l + 1 */
#define Q8_GROUP_SUMS_AVX2(isum, w, x, stride)                                                                         \
    do {                                                                                                               \
        for (int m = 0; m < M; m++) isum[m] = _mm256_setzero_si256();                                                  \
        for (int j = 0; j < 4; j++) {                                                                                  \
            const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((w) + 16 * j)));              \
            for (int m = 0; m < M; m++)                                                                                \
                isum[m] = _mm256_add_epi32(                                                                            \
                    isum[m], _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)((x) + m * (stride) + 16 * j)))); \
        }                                                                                                              \
    } while (0)

AVX2_INLINE void q8i_rows_m(const Weight *W, const QuantX *X, const float *xf, float *out, int64_t ld, int64_t n0,
                            int64_t n1, const int M) {
    Q8I_BODY(Q8_GROUP_SUMS_AVX2, 1, 1)
}

AVX2_FN static void rows_q8i_avx2(const Weight *W, const QuantX *X, const float *xf, int64_t M, float *out, int64_t ld,
                                  int64_t n0, int64_t n1) {
    BY_ROWS(M, q8i_rows_m, W, X, xf, out, ld, n0, n1);
}

/* fp8 e4m3 on AVX2 + F16C: (byte & 0x7F) << 7 is the half-precision number with the
 * same exponent and mantissa bits, 2^8 times too small (e4m3's bias is 7, half's 15;
 * subnormal bytes become half subnormals of the same ratio), and the sign moves from bit
 * 14 to 15 by adding bit 14 to itself. vcvtph2ps then widens 8 at a time, exactly; the
 * 2^8 joins the block scale. NaN bytes (0x7F, 0xFF) read as +-480, as the scalar path. */
AVX2_INLINE __m256i e4m3_to_half16(__m128i bytes) {
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 7);
    return _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
}

AVX2_INLINE void fp8_rows_m(const Weight *W, const float *x, float *out, int64_t ld, int64_t n0, int64_t n1,
                            const int M) {
    const uint8_t *q = W->data; const float *s = W->scales;
    const int64_t K = W->K, bm = W->bm, bn = W->bn, KB = (K + bn - 1) / bn;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = q + n * K;
        const float *sc = s + (n / bm) * KB;
        __m256 acc[MAX_ROWS];
        float tail[MAX_ROWS];
        for (int m = 0; m < M; m++) { acc[m] = _mm256_setzero_ps(); tail[m] = 0.f; }
        for (int64_t b = 0; b < KB; b++) {
            const int64_t lo = b * bn, hi = lo + bn < K ? lo + bn : K;
            __m256 part[MAX_ROWS][2];
            for (int m = 0; m < M; m++) part[m][0] = part[m][1] = _mm256_setzero_ps();
            int64_t k = lo;
            for (; k + 16 <= hi; k += 16) {
                if (!(k & 63)) prefetch_ahead(row + k, q + n1 * K);
                const __m256i h = e4m3_to_half16(_mm_loadu_si128((const __m128i *)(row + k)));
                const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
                const __m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
                for (int m = 0; m < M; m++) {
                    part[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), part[m][0]);
                    part[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), part[m][1]);
                }
            }
            const __m256 scale = _mm256_set1_ps(sc[b] * 256.f);
            for (int m = 0; m < M; m++) {
                acc[m] = _mm256_fmadd_ps(_mm256_add_ps(part[m][0], part[m][1]), scale, acc[m]);
                float rest = 0.f;
                for (int64_t j = k; j < hi; j++) rest += e4m3_to_float(row[j]) * x[m * K + j];
                tail[m] += rest * sc[b];
            }
        }
        for (int m = 0; m < M; m++) out[m * ld + n] = hsum256(acc[m]) + tail[m];
    }
}

__attribute__((target("avx2,fma,f16c"))) static void rows_fp8_avx2(const Weight *W, const float *x, int64_t M, float *out,
                                                                    int64_t ld, int64_t n0, int64_t n1) {
    BY_ROWS(M, fp8_rows_m, W, x, out, ld, n0, n1);
}

AVX2_FN static void rows_q4_avx2(const Weight *W, const QuantX *X, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    BY_ROWS(M, q4_rows_m, W, X, out, ld, n0, n1);
}

/* q4g32 times int8 activations (as q4), two 32-input groups per step: 32 bytes are
 * the two groups' nibbles, each lane one group, low nibbles its even inputs and high
 * nibbles its odd ones; the activations come in the matching pair order (QuantX.qp), so
 * no shuffle is needed. The nibbles become int8 (code - 8) and the weight's sign moves
 * onto the activations, so vpmaddubsw can take |w| as its unsigned operand (as
 * llama.cpp does for Q4_0); each lane's sums then take its own group's scale. */
AVX2_INLINE void pair4_rows_m(const Weight *W, const QuantX *X, float *out, int64_t ld, int64_t n0, int64_t n1,
                              const int M) {
    const uint8_t *q = W->data; const int64_t K = W->K, G = (K + 31) / 32, G64 = groups64(K);
    const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
    float buf[MAX_Q4_GROUPS + 1];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = q + n * G * 16;
        const float *sc = pair4_row_scales(W, n, G, buf);
        if (G & 1 && sc != buf) { memcpy(buf, sc, sizeof(float) * G); sc = buf; }
        buf[G] = 0.f;  /* an odd group count: the missing second group's scale */
        __m256 even[MAX_ROWS], odd[MAX_ROWS];  /* by g2's parity, named so that they stay in registers */
        for (int m = 0; m < M; m++) even[m] = odd[m] = _mm256_setzero_ps();
#define PAIR4_GROUPS(g2, acc)                                                                                          \
        do {                                                                                                           \
            const __m256i v = 2 * (g2) + 1 < G ? _mm256_loadu_si256((const __m256i *)(row + (g2) * 32))               \
                                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(row + (g2) * 32))); \
            const __m256i we = _mm256_sub_epi8(_mm256_and_si256(v, low4), eight);                                      \
            const __m256i wo = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), eight);                \
            const __m256i ae = _mm256_abs_epi8(we), ao = _mm256_abs_epi8(wo);                                          \
            const __m256 s2 = _mm256_set_m128(_mm_set1_ps(sc[2 * (g2) + 1]), _mm_set1_ps(sc[2 * (g2)]));               \
            for (int m = 0; m < M; m++) {                                                                              \
                const int64_t cell = m * G64 + (g2);                                                                   \
                const int8_t *xq = X->qp + cell * 64;                                                                  \
                const __m256i xe = _mm256_loadu_si256((const __m256i *)xq);                                            \
                const __m256i xo = _mm256_loadu_si256((const __m256i *)(xq + 32));                                     \
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(ae, _mm256_sign_epi8(xe, we)),                 \
                                                   _mm256_maddubs_epi16(ao, _mm256_sign_epi8(xo, wo)));                \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),                               \
                                         _mm256_mul_ps(s2, _mm256_set1_ps(X->scale[cell])), acc[m]);                   \
            }                                                                                                          \
        } while (0)
        int64_t g2 = 0;
        for (; g2 + 2 <= G64; g2 += 2) {
            prefetch_ahead(row + g2 * 32, q + n1 * G * 16);
            PAIR4_GROUPS(g2, even);
            PAIR4_GROUPS(g2 + 1, odd);
        }
        if (g2 < G64) PAIR4_GROUPS(g2, even);
#undef PAIR4_GROUPS
        for (int m = 0; m < M; m++) out[m * ld + n] = hsum256(_mm256_add_ps(even[m], odd[m]));
    }
}

AVX2_FN static void rows_pair4_avx2(const Weight *W, const QuantX *X, int64_t M, float *out, int64_t ld, int64_t n0,
                                    int64_t n1) {
    BY_ROWS(M, pair4_rows_m, W, X, out, ld, n0, n1);
}

/* 2 * e2m1 as float32, by nibble: the bit patterns' top byte (sign, exponent) and next
 * byte (the exponent's last bit, the mantissa's top bits); their low two bytes are zero
 * for every value, so two byte shuffles and two unpacks with zeros make the floats
 * (nibble 8, -0, reads as +0 as in E2M1_X2) */
static const uint8_t E2M1_X2_TOP[16] = {0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41,
                                        0x00, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0, 0xC1, 0xC1};
static const uint8_t E2M1_X2_NEXT[16] = {0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40,
                                         0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40};

/* x rows' whole groups (M rows of K / 32 * 32, at xo) in the order the AVX2 mxfp4pair
 * kernel's unpacks leave a group's weights in: per 8 inputs, the 4 even ones, then the 4
 * odd ones */
AVX2_FN static void mxfp4p_order_x_avx2(const float *x, int64_t M, int64_t K, float *xo) {
    const int64_t KO = K / 32 * 32;
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < KO; k += 8)
            _mm256_store_ps(xo + m * KO + k, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + m * K + k), order));
}

/* mxfp4pair in float32 (the activations are not rounded: gpt-oss-style checkpoints then
 * compute the products transformers computes from the same blocks, in another order).
 * A group's 16 bytes, broadcast to both lanes, give its even inputs' nibbles in one lane
 * and its odd inputs' in the other (a per-lane shift); two byte shuffles look up the
 * floats' top two bytes, and unpacks with zeros make 32 float32 weights: 9 vector
 * operations per group, shared by the x rows, where widening int8 values to float took
 * 17 (and cost twice as much at one x row). Each x row's group sum is then scaled once
 * and added to one of two accumulators by group parity (groups in pairs, so that the
 * accumulators' indices are constants and they stay in registers), so the chains of dependent
 * multiply-adds are one per group, not four. A row's sums take the same order whatever
 * the number of x rows. A last partial group (K not a multiple of 32) takes the scalar
 * path. */
AVX2_INLINE void mxfp4p_rows_m(const Weight *W, const float *x, const float *xo, float *out, int64_t ld, int64_t n0,
                               int64_t n1, const int M) {
    const uint8_t *q = W->data; const int64_t K = W->K, G = (K + 31) / 32, Gw = K / 32, KO = Gw * 32;
    const __m256i top = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_X2_TOP));
    const __m256i next = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_X2_NEXT));
    const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), low4 = _mm256_set1_epi8(0x0F);
    const __m256i zero = _mm256_setzero_si256();
    float buf[MAX_Q4_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = q + n * G * 16;
        const float *sc = pair4_row_scales(W, n, G, buf);
        __m256 acc[MAX_ROWS][2];
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
#define MX4_GROUP(g, a)                                                                                                \
        do {                                                                                                           \
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + (g) * 16)));         \
            const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(v, lanes), low4);                                   \
            const __m256i hi = _mm256_shuffle_epi8(top, nib), mid = _mm256_shuffle_epi8(next, nib);                    \
            const __m256i h01 = _mm256_unpacklo_epi8(mid, hi), h23 = _mm256_unpackhi_epi8(mid, hi);                    \
            const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h01));                                   \
            const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h01));                                   \
            const __m256 w2 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h23));                                   \
            const __m256 w3 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h23));                                   \
            const __m256 s = _mm256_set1_ps(sc[g]);                                                                    \
            for (int m = 0; m < M; m++) {                                                                              \
                const float *xm = xo + m * KO + (g) * 32;                                                              \
                __m256 t = _mm256_mul_ps(w0, _mm256_load_ps(xm));                                                      \
                t = _mm256_fmadd_ps(w1, _mm256_load_ps(xm + 8), t);                                                    \
                t = _mm256_fmadd_ps(w2, _mm256_load_ps(xm + 16), t);                                                   \
                t = _mm256_fmadd_ps(w3, _mm256_load_ps(xm + 24), t);                                                   \
                acc[m][a] = _mm256_fmadd_ps(t, s, acc[m][a]);                                                          \
            }                                                                                                          \
        } while (0)
        int64_t g = 0;
        for (; g + 2 <= Gw; g += 2) { MX4_GROUP(g, 0); MX4_GROUP(g + 1, 1); }  /* constant indices: acc stays in registers */
        if (g < Gw) MX4_GROUP(g, 0);
#undef MX4_GROUP
        float tail[MAX_ROWS] = {0};
        if (Gw < G) {
            float tmp[32];
            pair4_group(E2M1_X2, row + Gw * 16, tmp);
            for (int m = 0; m < M; m++)
                for (int64_t k = Gw * 32; k < K; k++) tail[m] += tmp[k - Gw * 32] * x[m * K + k];
        }
        for (int m = 0; m < M; m++) out[m * ld + n] = hsum256(_mm256_add_ps(acc[m][0], acc[m][1])) + tail[m] * (Gw < G ? sc[Gw] : 0.f);
    }
}

static void rows_pair4(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1);

AVX2_FN static void rows_mxfp4p_avx2(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0,
                                     int64_t n1) {
    const int64_t KO = W->K / 32 * 32;
    Scratch mem;
    char *raw = scratch_get(SC_XP, sizeof(float) * (size_t)(M * KO) + 32, &mem);
    if (raw == NULL) {  /* out of memory for the reordered x: the portable path needs none */
        rows_pair4(W, x, M, out, ld, n0, n1);
        return;
    }
    float *xo = (float *)(raw + (32 - (uintptr_t)raw % 32) % 32);
    mxfp4p_order_x_avx2(x, M, W->K, xo);
    BY_ROWS(M, mxfp4p_rows_m, W, x, xo, out, ld, n0, n1);
    scratch_put(&mem);
}


#define V4_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c"
#define V4_INLINE __attribute__((target(V4_TARGET), always_inline)) static inline
#define MX4_TILE 8  /* weight rows per pass over a K chunk */

/* 2 * e2m1 as float32, indexed by the nibble (the sign bit's zero reads as +0, as E2M1_X2) */
static const float E2M1_X2F[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* the 16 weights a nibble can mean for each E8M0 exponent, e2m1 * 2^(E-127) (filled at
 * import: 16 KiB, of which a row's few exponents keep a few lines in L1) */
static float MX4_TABLES[256][16] __attribute__((aligned(64)));

static void mx4_tables_fill(void) {
    for (int e = 0; e < 256; e++)
        for (int c = 0; c < 16; c++) MX4_TABLES[e][c] = E2M1_X2F[c] * (0.5f * e8m0_to_float((uint8_t)e));
}

/* sum of a[j] * b[j] over 32 floats, in one order whatever the caller: not inlined, so
 * not vectorised per x-row count (inlined into each M's copy of a kernel, -fassociative-math
 * let each copy order the sums its own way, and a row in a batch differed from itself alone) */
__attribute__((noinline)) static float dot32(const float *a, const float *b) {
    float t = 0.f;
    for (int j = 0; j < 32; j++) t += a[j] * b[j];
    return t;
}

/* mxfp4pair with AVX-512, still float32 throughout. The x rows are first copied, once
 * per call, into the weights' pair order (per 32 inputs: the 16 even ones, then the 16
 * odd ones; 64-byte aligned, so no load splits a cache line), so that a group's 16 bytes
 * widened to 32-bit lanes index a 16-entry table (vpermps reads the low 4 bits: the low
 * nibbles as they are, the high ones after a shift) for its even and odd weights. The
 * table is the e2m1 values already scaled by the group's power of two, read from
 * MX4_TABLES by the exponent byte: a load, where making it per group (an exponent add to
 * the bits of a register table, a multiply for extreme exponents) took a vector operation
 * and about a tenth of the one-row time, for the same values. A group thus costs three
 * vector operations before its two FMAs, where the AVX2 path's shuffles and unpacks take
 * nine. The
 * products and sums are float32 ones as on the AVX2 path; only their order differs. Two
 * groups per step, with their own accumulators, hide the FMA latency. A row's sums take
 * the same order whatever the number of x rows (the batch must not change a token): the
 * four accumulators are kept across K chunks and added only at the end, so the chunk
 * size may follow M. (Until 2026-12-04 rows past four shared two accumulators, and the
 * partial sums were added at each chunk's end: a row in a batch of five to eight
 * differed in its last bits from the same row alone.) */
V4_INLINE void mxfp4p_rows_v4_m(const Weight *W, const float *xp, float *out, int64_t ld, int64_t n0, int64_t n1,
                                const int M) {
    const uint8_t *q = W->data, *ex = W->scales;
    const int64_t K = W->K, G = (K + 31) / 32, Gw = K / 32, KP = G * 32;
    /* groups per K chunk: the chunk's x rows (16 KiB) stay in L1 while MX4_TILE weight rows
       pass over them (whole rows of x for several x rows did not fit: 3 rows ran 2x slower
       than 2) */
    const int64_t CH = (128 / M) & ~(int64_t)1;  /* even: a pair of groups never straddles two chunks */
    __m512 state[MX4_TILE][MAX_ROWS][4];
    for (int64_t t0 = n0; t0 < n1; t0 += MX4_TILE) {
        const int64_t t1 = t0 + MX4_TILE < n1 ? t0 + MX4_TILE : n1;
        for (int64_t n = t0; n < t1; n++)
            for (int m = 0; m < M; m++)
                for (int a = 0; a < 4; a++) state[n - t0][m][a] = _mm512_setzero_ps();
        for (int64_t c0 = 0; c0 < Gw; c0 += CH) {
            const int64_t c1 = c0 + CH < Gw ? c0 + CH : Gw;
            for (int64_t n = t0; n < t1; n++) {
                const uint8_t *row = q + n * G * 16, *e = ex + n * G;
                __m512 acc[MAX_ROWS][4];
                for (int m = 0; m < M; m++)
                    for (int a = 0; a < 4; a++) acc[m][a] = state[n - t0][m][a];
#define MX4_GROUP(g, o, TABLE)                                                                                        \
                do {                                                                                                   \
                    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + (g) * 16)));       \
                    const __m512 t = TABLE;                                                                            \
                    const __m512 we = _mm512_permutexvar_ps(d, t), wo = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t); \
                    for (int m = 0; m < M; m++) {                                                                      \
                        const float *xm = xp + m * KP + (g) * 32;                                                      \
                        acc[m][o] = _mm512_fmadd_ps(we, _mm512_load_ps(xm), acc[m][o]);                                \
                        acc[m][o + 1] = _mm512_fmadd_ps(wo, _mm512_load_ps(xm + 16), acc[m][o + 1]);                   \
                    }                                                                                                  \
                } while (0)
#define MX4_TABLE(g) _mm512_load_ps(MX4_TABLES[e[g]])
                int64_t g = c0;
                for (; g + 2 <= c1; g += 2) { MX4_GROUP(g, 0, MX4_TABLE(g)); MX4_GROUP(g + 1, 2, MX4_TABLE(g + 1)); }
                if (g < c1) MX4_GROUP(g, 0, MX4_TABLE(g));
#undef MX4_GROUP
#undef MX4_TABLE
                for (int m = 0; m < M; m++)
                    for (int a = 0; a < 4; a++) state[n - t0][m][a] = acc[m][a];
            }
        }
        for (int64_t n = t0; n < t1; n++) {
            const uint8_t *row = q + n * G * 16, *e = ex + n * G;
            float tail[MAX_ROWS] = {0};
            if (Gw < G) {  /* a partial last group: its pair-ordered x is zero-padded */
                float tmp[32];
                const uint8_t *last = row + Gw * 16;
                for (int j = 0; j < 16; j++) { tmp[j] = (float)E2M1_X2[last[j] & 15]; tmp[16 + j] = (float)E2M1_X2[last[j] >> 4]; }
                for (int m = 0; m < M; m++) tail[m] = dot32(tmp, xp + m * KP + Gw * 32);
            }
            const float last_scale = Gw < G ? 0.5f * e8m0_to_float(e[Gw]) : 0.f;
            for (int m = 0; m < M; m++)
                out[m * ld + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(state[n - t0][m][0], state[n - t0][m][2]),
                                                                     _mm512_add_ps(state[n - t0][m][1], state[n - t0][m][3]))) +
                                  tail[m] * last_scale;
        }
    }
}

/* x (M rows of K) into pair order at xp (M rows of G * 32, zero-padded) */
__attribute__((target(V4_TARGET))) static void mxfp4p_pair_x(const float *x, int64_t M, int64_t K, float *xp) {
    const int64_t G = (K + 31) / 32, Gw = K / 32;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float *pm = xp + m * G * 32;
        for (int64_t g = 0; g < Gw; g++) {
            const __m512 a = _mm512_loadu_ps(xm + g * 32), b = _mm512_loadu_ps(xm + g * 32 + 16);
            _mm512_store_ps(pm + g * 32, _mm512_permutex2var_ps(a, even, b));
            _mm512_store_ps(pm + g * 32 + 16, _mm512_permutex2var_ps(a, odd, b));
        }
        if (Gw < G) {
            float *pg = pm + Gw * 32;
            for (int j = 0; j < 32; j++) pg[j] = 0.f;
            for (int64_t k = Gw * 32; k < K; k++) pg[(k & 1) * 16 + (k - Gw * 32) / 2] = xm[k];
        }
    }
}

static void rows_mxfp4p_avx2(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1);

__attribute__((target(V4_TARGET))) static void rows_mxfp4p_v4(const Weight *W, const float *x, int64_t M, float *out,
                                                                 int64_t ld, int64_t n0, int64_t n1) {
    const int64_t KP = (W->K + 31) / 32 * 32;
    Scratch mem;
    char *raw = scratch_get(SC_XP, sizeof(float) * (size_t)(M * KP) + 64, &mem);
    if (raw == NULL) {  /* out of memory for the copy: the AVX2 path needs none */
        rows_mxfp4p_avx2(W, x, M, out, ld, n0, n1);
        return;
    }
    float *xp = (float *)(raw + (64 - (uintptr_t)raw % 64) % 64);
    mxfp4p_pair_x(x, M, W->K, xp);
    BY_ROWS(M, mxfp4p_rows_v4_m, W, xp, out, ld, n0, n1);
    scratch_put(&mem);
}

static int have_vbmi(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi");
}


#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"
#define VNNI_INLINE __attribute__((target(VNNI_TARGET), always_inline)) static inline

/* The int4 path with AVX-512 VNNI (on 256-bit vectors): per group of 64 inputs, two
 * vpdpbusd (unsigned nibbles times signed int8 activations, four products summed into
 * each int32 lane) replace the AVX2 path's four multiply-adds; the weight x activation
 * scales of eight groups are multiplied at once and picked out by a lane permute.
 * Measured on Zen 4: clearly faster than the AVX2 path from cache. A 512-bit variant
 * taking two groups per step was slower (Zen 4 splits 512-bit operations in two, and
 * spreading two groups' scales over one vector cost more than it saved). */
VNNI_INLINE void q4_rows_vnni_m(const Weight *W, const QuantX *X, float *out, int64_t ld, int64_t n0, int64_t n1,
                                const int M) {
    const uint8_t *q = W->data;
    const int64_t K = W->K, G = groups64(K);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    float buf[MAX_Q4_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = q + n * G * 32;
        const float *sc = q4_row_scales(W, n, G, buf);
        __m256 even[MAX_ROWS], odd[MAX_ROWS];  /* by the group's parity (gn is even but for a row's last block) */
        for (int m = 0; m < M; m++) even[m] = odd[m] = _mm256_setzero_ps();
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const int64_t gn = G - g0 < 8 ? G - g0 : 8;
            __m256 d8[MAX_ROWS];
            if (gn == 8) {
                const __m256 w8 = _mm256_loadu_ps(sc + g0);
                for (int m = 0; m < M; m++) d8[m] = _mm256_mul_ps(w8, _mm256_loadu_ps(X->scale + m * G + g0));
            } else {
                float t[MAX_ROWS][8] = {{0}};
                for (int m = 0; m < M; m++) {
                    for (int64_t j = 0; j < gn; j++) t[m][j] = sc[g0 + j] * X->scale[m * G + g0 + j];
                    d8[m] = _mm256_loadu_ps(t[m]);
                }
            }
#define Q4_VNNI_GROUP(j, acc)                                                                                          \
            do {                                                                                                       \
                const int64_t g = g0 + (j);                                                                            \
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + g * 32));                             \
                const __m256i lo = _mm256_and_si256(bytes, low4);                                                      \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);                                \
                const __m256i lane = _mm256_set1_epi32((int)(j));                                                      \
                for (int m = 0; m < M; m++) {                                                                          \
                    const int8_t *xq = X->q + (m * G + g) * 64;                                                        \
                    __m256i i = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)xq)); \
                    i = _mm256_dpbusd_epi32(i, hi, _mm256_loadu_si256((const __m256i *)(xq + 32)));                    \
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_permutevar8x32_ps(d8[m], lane), acc[m]);    \
                }                                                                                                      \
            } while (0)
            int64_t j = 0;
            for (; j + 2 <= gn; j += 2) { Q4_VNNI_GROUP(j, even); Q4_VNNI_GROUP(j + 1, odd); }
            if (j < gn) Q4_VNNI_GROUP(j, even);
#undef Q4_VNNI_GROUP
        }
        for (int m = 0; m < M; m++)
            out[m * ld + n] = hsum256(_mm256_add_ps(even[m], odd[m])) - dot_g(sc, X->offset + m * G, G);
    }
}

__attribute__((target(VNNI_TARGET))) static void rows_q4_vnni(const Weight *W, const QuantX *X, int64_t M, float *out,
                                                                   int64_t ld, int64_t n0, int64_t n1) {
    BY_ROWS(M, q4_rows_vnni_m, W, X, out, ld, n0, n1);
}
/* The same group sums with 512-bit vpdpwssd: 32 inputs per step, two steps a group
 * (half the AVX2 path's instructions); lane L < 8 of the 512-bit sum takes the pairs lane
 * L of the 256-bit path takes from inputs 32j.., lane L + 8 those from 32j + 16.., so
 * adding the two halves (integers: exact) gives the AVX2 path's lanes and the same floats
 * after. */
#define Q8_GROUP_SUMS_VNNI512(isum, w, x, stride)                                                                      \
    do {                                                                                                               \
        __m512i wide[MAX_ROWS];                                                                                        \
        for (int m = 0; m < M; m++) wide[m] = _mm512_setzero_si512();                                                  \
        for (int j = 0; j < 2; j++) {                                                                                  \
            const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((w) + 32 * j)));           \
            for (int m = 0; m < M; m++)                                                                                \
                wide[m] = _mm512_dpwssd_epi32(wide[m], w16, _mm512_loadu_si512((const void *)((x) + m * (stride) + 32 * j))); \
        }                                                                                                              \
        for (int m = 0; m < M; m++)                                                                                    \
            isum[m] = _mm256_add_epi32(_mm512_castsi512_si256(wide[m]), _mm512_extracti64x4_epi64(wide[m], 1));        \
    } while (0)

VNNI_INLINE void q8i_rows_vnni_m(const Weight *W, const QuantX *X, const float *xf, float *out, int64_t ld,
                                 int64_t n0, int64_t n1, const int M) {
    Q8I_BODY(Q8_GROUP_SUMS_VNNI512, 0, 0)
}

/* x rows go through the int8 kernel at most this many bytes of int16 activations at a
 * time: 8 rows of 2048 inputs (32 KiB, all of Zen 4's L1) pushed the weight lines out;
 * in halves it ran 96 GMAC/s against 76 at 128 rows and 2048 x 2048 (AMD EPYC Zen 4,
 * 2 threads; 8 KiB 89). Each row's sums are the same whatever the step. */
#define Q8_X_BYTES (16 << 10)
__attribute__((target(VNNI_TARGET))) static void rows_q8i_vnni(const Weight *W, const QuantX *X, const float *xf, int64_t M,
                                                                 float *out, int64_t ld, int64_t n0, int64_t n1) {
    int64_t step = M;
    while (step > 1 && step * W->K * 2 > Q8_X_BYTES) step = (step + 1) / 2;
    for (int64_t r = 0; r < M; r += step) {
        const int64_t rows = M - r < step ? M - r : step;
        const QuantX v = quantx_at(X, r, W->K);
        BY_ROWS(rows, q8i_rows_vnni_m, W, &v, xf + r * W->K, out + r * ld, ld, n0, n1);
    }
}
static int have_vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}
#else
static void rows_q4_avx2(const Weight *W, const QuantX *X, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    (void)W; (void)X; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static void rows_q4_vnni(const Weight *W, const QuantX *X, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    (void)W; (void)X; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static void rows_pair4_avx2(const Weight *W, const QuantX *X, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    (void)W; (void)X; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static void rows_mxfp4p_avx2(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    (void)W; (void)x; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static void rows_q8i_avx2(const Weight *W, const QuantX *X, const float *xf, int64_t M, float *out, int64_t ld, int64_t n0,
                          int64_t n1) {
    (void)W; (void)X; (void)xf; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static void rows_q8i_vnni(const Weight *W, const QuantX *X, const float *xf, int64_t M, float *out, int64_t ld, int64_t n0,
                          int64_t n1) {
    (void)W; (void)X; (void)xf; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static void rows_fp8_avx2(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    (void)W; (void)x; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static void rows_mxfp4p_v4(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    (void)W; (void)x; (void)M; (void)out; (void)ld; (void)n0; (void)n1;
}
static int have_vnni(void) { return 0; }
static int have_vbmi(void) { return 0; }
static void mx4_tables_fill(void) {}
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

#define MXFP4_CHUNK 64  /* groups decoded at a time, on the stack (8 KiB) */

/* a row is decoded MXFP4_CHUNK groups at a time, then dotted with each x row */
static void rows_mxfp4(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    const uint8_t *q = W->data, *e = W->scales; const int64_t K = W->K, G = (K + 31) / 32;
    float chunk[MXFP4_CHUNK * 32];
    for (int64_t n = n0; n < n1; n++) {
        float acc[MAX_ROWS] = {0};
        for (int64_t g0 = 0; g0 < G; g0 += MXFP4_CHUNK) {
            const int64_t gn = G - g0 < MXFP4_CHUNK ? G - g0 : MXFP4_CHUNK, width = K - g0 * 32 < gn * 32 ? K - g0 * 32 : gn * 32;
            mxfp4_row(q + (n * G + g0) * 16, e + n * G + g0, gn, chunk);
            for (int64_t m = 0; m < M; m++) acc[m] += dot_f32(chunk, x + m * K + g0 * 32, width);
        }
        for (int64_t m = 0; m < M; m++) out[m * ld + n] = acc[m];
    }
}

static void rows_pair4(const Weight *W, const float *x, int64_t M, float *out, int64_t ld, int64_t n0, int64_t n1) {
    const uint8_t *q = W->data; const int64_t K = W->K, G = (K + 31) / 32;
    const int8_t *table = pair4_table(W);
    float buf[MAX_Q4_GROUPS];
    for (int64_t n = n0; n < n1; n++) {
        const float *sc = pair4_row_scales(W, n, G, buf);
        float acc[MAX_ROWS] = {0};
        float tmp[32];
        for (int64_t g = 0; g < G; g++) {
            pair4_group(table, q + (n * G + g) * 16, tmp);
            const int64_t base = g * 32, width = K - base < 32 ? K - base : 32;
            for (int64_t m = 0; m < M; m++) acc[m] += dot_f32(tmp, x + m * K + base, width) * sc[g];
        }
        for (int64_t m = 0; m < M; m++) out[m * ld + n] = acc[m];
    }
}

static const rows_fn ROWS[K_KINDS] = {rows_q8, rows_q4, rows_mxfp4, rows_fp8, rows_bf16, rows_pair4, rows_pair4};

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

/* rows [n0, n1) of x @ W^T; int4 and int8 weights take the integer paths on AVX2
 * machines, with x quantised once per call (qx, in the form wants_qx says) */
static void weight_rows(const Weight *W, const float *x, const QuantX *qx, int64_t M, float *out, int64_t ld, int64_t n0,
                        int64_t n1) {
    if (W->kind == K_Q4 && qx != NULL && use_vnni) rows_q4_vnni(W, qx, M, out, ld, n0, n1);
    else if (W->kind == K_Q4 && qx != NULL) rows_q4_avx2(W, qx, M, out, ld, n0, n1);
    else if (W->kind == K_Q8 && qx != NULL && use_vnni) rows_q8i_vnni(W, qx, x, M, out, ld, n0, n1);
    else if (W->kind == K_Q8 && qx != NULL) rows_q8i_avx2(W, qx, x, M, out, ld, n0, n1);
    else if (W->kind == K_FP8 && use_avx2) rows_fp8_avx2(W, x, M, out, ld, n0, n1);
    else if (W->kind == K_Q4G32 && qx != NULL) rows_pair4_avx2(W, qx, M, out, ld, n0, n1);
    else if (W->kind == K_MXFP4P && use_vbmi) rows_mxfp4p_v4(W, x, M, out, ld, n0, n1);
    else if (W->kind == K_MXFP4P && use_avx2) rows_mxfp4p_avx2(W, x, M, out, ld, n0, n1);
    else ROWS[W->kind](W, x, M, out, ld, n0, n1);
}

static int wants_qx(const Weight *W) {
    if (!use_avx2) return 0;
    return W->kind == K_Q4 ? QX8 : W->kind == K_Q4G32 ? QX8 | QX8P : W->kind == K_Q8 ? QX16 : 0;
}

/* out_i = x @ W_i^T for several weights taking the same x (e.g. the q, k and v
 * projections) in one parallel region, x quantised once; any number of x rows, taken
 * MAX_ROWS at a time. */
static int linears_rows(const Weight *W, int nW, const float *x, int64_t M, float *const *outs) {
    const int64_t K = W[0].K;
    QuantX qx = {0};
    int need_qx = 0;
    for (int i = 0; i < nW; i++) need_qx |= wants_qx(&W[i]);
    if (need_qx && quantize_x(x, M, K, need_qx, SC_QX, &qx)) return -1;
    #pragma omp parallel
    {
        for (int i = 0; i < nW; i++) {
            int64_t lo, hi;
            my_rows(W[i].N, &lo, &hi);
            for (int64_t r = 0; r < M; r += MAX_ROWS) {
                const int64_t rows = M - r < MAX_ROWS ? M - r : MAX_ROWS;
                const QuantX v = need_qx ? quantx_at(&qx, r, K) : qx;
                weight_rows(&W[i], x + r * K, wants_qx(&W[i]) ? &v : NULL, rows, outs[i] + r * W[i].N, W[i].N, lo, hi);
            }
        }
    }
    if (need_qx) quantx_free(&qx);
    return 0;
}

/* RMSNorm of each row: x / sqrt(mean(x^2) + eps) * weight (weight may be NULL) */
CLONES static void rms_norm_rows(const float *x, const float *w, float eps, int64_t T, int64_t D, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *o = out + t * D;
        float ss = 0.f;
        for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        if (w) for (int64_t d = 0; d < D; d++) o[d] = xr[d] * inv * w[d];
        else for (int64_t d = 0; d < D; d++) o[d] = xr[d] * inv;
    }
}

/* All the routed experts of one MoE layer (or a batch of them) in one parallel region:
 * gate and up of every expert, then down of every expert, two synchronisations in all.
 * Expert e takes the token rows rows[off[e] .. off[e+1]) with routing weights wts[...];
 * out[T, H] += wts * expert(x[row]), summed in the given (ascending) expert order. Each
 * thread owns a slice of the output columns, so the sums need no locks and do not depend
 * on the thread count. */
typedef struct { Weight gate, up, down; } Expert;

static int moe_rows(const Expert *E, int64_t nE, const float *x, int64_t T, const int32_t *rows, const float *wts,
                    const int64_t *off, float *out) {
    const int64_t H = E[0].gate.K, I = E[0].gate.N, R = off[nE];
    int need_qx = 0, need_qh = 0;
    for (int64_t e = 0; e < nE; e++) {
        need_qx |= wants_qx(&E[e].gate) | wants_qx(&E[e].up);
        need_qh |= wants_qx(&E[e].down);
    }
    Scratch mem[4] = {{0}};
    float *xg = scratch_get(SC_XG, sizeof(float) * R * H, &mem[0]), *g = scratch_get(SC_G, sizeof(float) * R * I, &mem[1]),
          *h = scratch_get(SC_H, sizeof(float) * R * I, &mem[2]), *y = scratch_get(SC_Y, sizeof(float) * R * H, &mem[3]);
    QuantX qx = {0}, qxg = {0}, qh = {0};
    int failed = !xg || !g || !h || !y;
    if (!failed && need_qx) failed = quantize_x(x, T, H, need_qx, SC_QX, &qx) || quantx_alloc(R, H, need_qx, SC_QXG, &qxg);
    if (!failed && need_qh) failed = quantx_alloc(R, I, need_qh, SC_QH, &qh);
    if (failed) {
        for (int i = 0; i < 4; i++) scratch_put(&mem[i]);
        quantx_free(&qx); quantx_free(&qxg); quantx_free(&qh);
        return -1;
    }
    for (int64_t r = 0; r < R; r++) {  /* each expert's rows side by side (x is quantised once for all) */
        memcpy(xg + r * H, x + (int64_t)rows[r] * H, sizeof(float) * H);
        if (need_qx) quantx_copy_row(&qx, rows[r], &qxg, r, H);
    }
    #pragma omp parallel
    {
        int64_t lo, hi;
        my_rows(I, &lo, &hi);
        for (int64_t e = 0; e < nE; e++)
            for (int64_t r = off[e]; r < off[e + 1]; r += MAX_ROWS) {
                const int64_t M = off[e + 1] - r < MAX_ROWS ? off[e + 1] - r : MAX_ROWS;
                const QuantX v = need_qx ? quantx_at(&qxg, r, H) : qxg;
                weight_rows(&E[e].gate, xg + r * H, wants_qx(&E[e].gate) ? &v : NULL, M, g + r * I, I, lo, hi);
                weight_rows(&E[e].up, xg + r * H, wants_qx(&E[e].up) ? &v : NULL, M, h + r * I, I, lo, hi);
                for (int64_t m = r; m < r + M; m++)
                    for (int64_t i = lo; i < hi; i++) {
                        const float a = g[m * I + i];
                        h[m * I + i] *= a / (1.0f + expf(-a));
                    }
            }
        #pragma omp barrier
        if (need_qh) {
            int64_t r0, r1;
            my_rows(R, &r0, &r1);
            quantize_rows(h, r0, r1, I, &qh);
        }
        #pragma omp barrier
        my_rows(H, &lo, &hi);
        for (int64_t e = 0; e < nE; e++)
            for (int64_t r = off[e]; r < off[e + 1]; r += MAX_ROWS) {
                const int64_t M = off[e + 1] - r < MAX_ROWS ? off[e + 1] - r : MAX_ROWS;
                const QuantX v = need_qh ? quantx_at(&qh, r, I) : qh;
                weight_rows(&E[e].down, h + r * I, wants_qx(&E[e].down) ? &v : NULL, M, y + r * H, H, lo, hi);
                for (int64_t m = r; m < r + M; m++) {
                    float *o = out + (int64_t)rows[m] * H;
                    const float *ym = y + m * H, w = wts[m];
                    for (int64_t n = lo; n < hi; n++) o[n] += w * ym[n];
                }
            }
    }
    for (int i = 0; i < 4; i++) scratch_put(&mem[i]);
    quantx_free(&qx); quantx_free(&qxg); quantx_free(&qh);
    return 0;
}

typedef struct { const char *base; int64_t head, pos; } KVView;  /* byte strides */

/* exp(x) for the softmax's x <= 0, in arithmetic a compiler vectorises (libm's expf is a
 * call per score: ~2.7 s of a 2048-token prefill over the full OLMoE shape): Cephes'
 * expf, 2^n times a degree-7 polynomial on [-ln2/2, ln2/2], within 2 ulp of expf; below
 * -87 (where expf is denormal or zero) it gives zero. */
static inline float softmax_exp(float x) {
    const float below = x < -87.f ? 0.f : 1.f;
    x = x < -87.f ? -87.f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return y * scale * below;
}

/* Attention of one KV head for a block of query rows: rows[i] is query row i (D floats)
 * seeing keys 0..n[i]-1 (those ``visible[i]`` marks, when given), written to outs[i] (Dv
 * floats). Each key and value row is read once for the whole block, the work in register
 * tiles of up to 4 rows, the values in spans of ATT_SPAN positions that stay in L1 across
 * the output's vectors (one position at a time for one or two rows: a decode step streams
 * them). Yet every number of a row comes from the same operations in the same order as
 * for the row alone: a score is two chains of multiply-adds over the vectors of d (even,
 * odd; the inputs past the last whole vector as one more, zero-padded) summed by one
 * fixed tree, an output value a chain over the positions (a row's probabilities past its
 * own keys are zeros). So a row's result does not depend on the rows beside it, the chunk
 * or the thread count: a decode step's row is the prefill's, and a verified draft's; and
 * float16 keys and values give what their float32 values give. Before, each query row
 * re-read its head's keys and values, with a call to expf per score (2048-token prompt,
 * full OLMoE shape: ~1 s per layer against ~0.2 now; docs/benchmarks.md). GCC's vector
 * types compile to one 512-bit, two 256-bit or four 128-bit vectors per clone; one key at
 * a time (ATT_KEYS): four keys' rows read side by side streamed slower from memory. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  /* 512-bit vectors pass through the (inlined) helpers of the baseline clone */
#endif
#define ATT_BLOCK 8
#define ATT_W 16
#define ATT_KEYS 1
#define ATT_SPAN 16  /* (positions per pass when the block has more than two rows; else one) */
typedef float att_vec __attribute__((vector_size(ATT_W * 4)));
typedef float att_uvec __attribute__((vector_size(ATT_W * 4), aligned(4)));  /* unaligned loads and stores */
typedef float att_half __attribute__((vector_size(ATT_W * 2)));
typedef float att_quarter __attribute__((vector_size(ATT_W)));

/* the sum of a vector's lanes by one fixed tree: lanes i and i + 8, then j and j + 4, then
 * (0 + 2) + (1 + 3) (a macro: a function taking a 512-bit vector draws an ABI note from GCC
 * in the baseline clone; by lanes where __builtin_shufflevector is missing, GCC < 12, with
 * the same sums in the same order) */
#if defined(__clang__) || __GNUC__ >= 12
#define ATT_HSUM(v)                                                                                                    \
    ({                                                                                                                 \
        const att_vec v_ = (v);                                                                                        \
        const att_half h_ = __builtin_shufflevector(v_, v_, 0, 1, 2, 3, 4, 5, 6, 7) +                                  \
                            __builtin_shufflevector(v_, v_, 8, 9, 10, 11, 12, 13, 14, 15);                             \
        const att_quarter g_ = __builtin_shufflevector(h_, h_, 0, 1, 2, 3) + __builtin_shufflevector(h_, h_, 4, 5, 6, 7); \
        (g_[0] + g_[2]) + (g_[1] + g_[3]);                                                                             \
    })
#else
#define ATT_HSUM(v)                                                                                                    \
    ({                                                                                                                 \
        const att_vec v_ = (v);                                                                                        \
        float g_[4];                                                                                                   \
        for (int j_ = 0; j_ < 4; j_++) g_[j_] = (v_[j_] + v_[j_ + 8]) + (v_[j_ + 4] + v_[j_ + 12]);                   \
        (g_[0] + g_[2]) + (g_[1] + g_[3]);                                                                             \
    })
#endif

/* Keys and values are float32 or float16 (a cache kept in half precision: half the bytes
 * a decode step reads per position); ATT_LOAD reads ATT_W of them as floats and ATT_AT one,
 * exactly. A half widens by integer operations (the compilers' own _Float16 conversions
 * may call a library function per number): its exponent and mantissa moved to a float's
 * place and scaled by 2^112 (exact, subnormal halves included), the sign put back, and
 * the top exponent (infinity, NaN) set to a float's. */
typedef uint16_t att_h16 __attribute__((vector_size(ATT_W * 2), aligned(2)));
typedef uint32_t att_u32 __attribute__((vector_size(ATT_W * 4)));

#define ATT_FROM_HALF(p)                                                                                               \
    ({                                                                                                                 \
        const att_u32 w_ = __builtin_convertvector(*(const att_h16 *)(p), att_u32);                                    \
        const att_vec scaled_ = (att_vec)((w_ & 0x7fff) << 13) * 0x1p112f;                                             \
        const att_u32 top_ = (att_u32)((w_ & 0x7c00) == 0x7c00) & 0x7f800000;                                          \
        (att_vec)((att_u32)scaled_ | ((w_ & 0x8000) << 16) | top_);                                                    \
    })

static inline float half_to_float(uint16_t h) {
    uint32_t magnitude = (uint32_t)(h & 0x7fff) << 13, bits;
    float scaled;
    memcpy(&scaled, &magnitude, 4);
    scaled *= 0x1p112f;
    memcpy(&bits, &scaled, 4);
    bits |= (uint32_t)(h & 0x8000) << 16 | ((h & 0x7c00) == 0x7c00 ? 0x7f800000u : 0u);
    memcpy(&scaled, &bits, 4);
    return scaled;
}

#define ATT_LOAD_f32(p) (*(const att_uvec *)(p))
#define ATT_LOAD_f16(p) ATT_FROM_HALF(p)
#define ATT_AT_f32(p, i) ((p)[i])
#define ATT_AT_f16(p, i) half_to_float((p)[i])

/* scores of rows i0..i0+R-1 for keys s0..s0+ATT_KEYS-1 (R a constant: the tile in registers) */
#define ATT_SCORES(R, E)                                                                                               \
    do {                                                                                                               \
        att_vec a[ATT_KEYS][R], b[ATT_KEYS][R];  /* even and odd vectors of d: two chains, half as long */           \
        for (int j = 0; j < ATT_KEYS; j++)                                                                             \
            for (int r = 0; r < (R); r++) a[j][r] = b[j][r] = (att_vec){0};                                            \
        int64_t d = 0;                                                                                                 \
        for (; d + 2 * ATT_W <= Dw; d += 2 * ATT_W) {                                                                  \
            att_vec ka[ATT_KEYS], kb[ATT_KEYS];                                                                        \
            for (int j = 0; j < ATT_KEYS; j++) { ka[j] = ATT_LOAD_##E(k[j] + d); kb[j] = ATT_LOAD_##E(k[j] + d + ATT_W); } \
            for (int r = 0; r < (R); r++) {                                                                            \
                const att_vec qa = *(const att_uvec *)(rows[i0 + r] + d), qb = *(const att_uvec *)(rows[i0 + r] + d + ATT_W); \
                for (int j = 0; j < ATT_KEYS; j++) { a[j][r] += qa * ka[j]; b[j][r] += qb * kb[j]; }                   \
            }                                                                                                          \
        }                                                                                                              \
        if (d < Dw)                                                                                                    \
            for (int j = 0; j < ATT_KEYS; j++) {                                                                       \
                const att_vec kv = ATT_LOAD_##E(k[j] + d);                                                             \
                for (int r = 0; r < (R); r++) a[j][r] += *(const att_uvec *)(rows[i0 + r] + d) * kv;                  \
            }                                                                                                          \
        if (Dw < D)  /* inputs past the last whole vector: one more, zero-padded (lane sums, as the others) */       \
            for (int j = 0; j < ATT_KEYS; j++) {                                                                       \
                att_vec kv = {0};                                                                                      \
                for (int64_t e = Dw; e < D; e++) kv[e - Dw] = ATT_AT_##E(k[j], e);                                     \
                for (int r = 0; r < (R); r++) {                                                                        \
                    att_vec qv = {0};                                                                                  \
                    for (int64_t e = Dw; e < D; e++) qv[e - Dw] = rows[i0 + r][e];                                     \
                    b[j][r] += qv * kv;                                                                                \
                }                                                                                                      \
            }                                                                                                          \
        for (int r = 0; r < (R); r++)                                                                                  \
            for (int j = 0; j < ATT_KEYS; j++)                                                                         \
                if (s0 + j < n[i0 + r]) scores[(i0 + r) * S + s0 + j] = ATT_HSUM(a[j][r] + b[j][r]) * scale;          \
    } while (0)

/* outs[i0..i0+R-1][d0..d0+ATT_W) += their probabilities over positions s0..s1 times the values */
#define ATT_VALUES(R, E)                                                                                               \
    do {                                                                                                               \
        att_vec a[R];                                                                                                  \
        for (int r = 0; r < (R); r++) a[r] = *(const att_uvec *)(outs[i0 + r] + d0);                                  \
        for (int64_t s = s0; s < s1; s++) {                                                                            \
            const att_vec v = ATT_LOAD_##E((const elem_##E *)(vbase + s * vpos) + d0);                                \
            for (int r = 0; r < (R); r++) a[r] += scores[(i0 + r) * S + s] * v;                                       \
        }                                                                                                              \
        for (int r = 0; r < (R); r++) *(att_uvec *)(outs[i0 + r] + d0) = a[r];                                         \
    } while (0)

#define ATT_BY_ROWS(R, MACRO, E)                                                                                       \
    switch (R) {                                                                                                       \
    case 1: MACRO(1, E); break;                                                                                        \
    case 2: MACRO(2, E); break;                                                                                        \
    case 3: MACRO(3, E); break;                                                                                        \
    default: MACRO(4, E);                                                                                              \
    }

typedef float elem_f32;
typedef uint16_t elem_f16;

#define ATTEND_BLOCK(E, ATTRS)                                                                                         \
ATTRS static void attend_block_##E(const float *const *rows, const int64_t *n, const uint8_t *const *visible, int B,   \
                                    const char *kbase, int64_t kpos, const char *vbase, int64_t vpos, int64_t D,       \
                                    int64_t Dv, float scale, float *scores, int64_t S, float *const *outs) {           \
    int64_t most = 0;                                                                                                  \
    for (int i = 0; i < B; i++) most = n[i] > most ? n[i] : most;                                                      \
    const int64_t Dw = D / ATT_W * ATT_W;                                                                              \
    for (int64_t s0 = 0; s0 < most; s0 += ATT_KEYS) {                                                                  \
        const elem_##E *k[ATT_KEYS];  /* keys past the last repeat it, unused */                                      \
        for (int j = 0; j < ATT_KEYS; j++) k[j] = (const elem_##E *)(kbase + (s0 + j < most ? s0 + j : most - 1) * kpos); \
        for (int i0 = 0; i0 < B; i0 += 4) ATT_BY_ROWS(B - i0, ATT_SCORES, E)                                           \
    }                                                                                                                  \
    attend_softmax(n, visible, B, most, scores, S, outs, Dv);                                                          \
    const int64_t Dvw = Dv / ATT_W * ATT_W;                                                                            \
    const int64_t span = B > 2 ? ATT_SPAN : 1;  /* a decode step's values stream best one row at a time */          \
    for (int64_t s0 = 0; s0 < most; s0 += span) {                                                                      \
        const int64_t s1 = s0 + span < most ? s0 + span : most;                                                        \
        for (int64_t d0 = 0; d0 < Dvw; d0 += ATT_W)                                                                    \
            for (int i0 = 0; i0 < B; i0 += 4) ATT_BY_ROWS(B - i0, ATT_VALUES, E)                                       \
        for (int i = 0; i < B && Dvw < Dv; i++)  /* Dv past the last whole vector */                                   \
            for (int64_t s = s0; s < s1; s++) {                                                                        \
                const elem_##E *v = (const elem_##E *)(vbase + s * vpos);                                              \
                const float p = scores[i * S + s];                                                                     \
                for (int64_t d = Dvw; d < Dv; d++) outs[i][d] += p * ATT_AT_##E(v, d);                                 \
            }                                                                                                          \
    }                                                                                                                  \
}

/* each row's scores -> its probabilities (past its own keys: zeros), its output zeroed */
CLONES static void attend_softmax(const int64_t *n, const uint8_t *const *visible, int B, int64_t most, float *scores,
                                  int64_t S, float *const *outs, int64_t Dv) {
    for (int i = 0; i < B; i++) {
        float *sc = scores + i * S;
        if (visible[i])
            for (int64_t s = 0; s < n[i]; s++) sc[s] = visible[i][s] ? sc[s] : -INFINITY;
        float top = -INFINITY;
        for (int64_t s = 0; s < n[i]; s++) top = sc[s] > top ? sc[s] : top;
        for (int64_t d = 0; d < Dv; d++) outs[i][d] = 0.f;
        if (top == -INFINITY) {  /* no key visible: zeros */
            for (int64_t s = 0; s < most; s++) sc[s] = 0.f;
            continue;
        }
        float total = 0.f;
        for (int64_t s = 0; s < n[i]; s++) {
            sc[s] = softmax_exp(sc[s] - top);  /* a masked score (-inf) gives zero */
            total += sc[s];
        }
        for (int64_t s = 0; s < n[i]; s++) sc[s] = sc[s] / total;
        for (int64_t s = n[i]; s < most; s++) sc[s] = 0.f;
    }
}

ATTEND_BLOCK(f32, CLONES)
ATTEND_BLOCK(f16, CLONES)

#ifdef COLIBRI_X86
/* halves widened by AVX-512's vcvtph2ps, 16 at a time: the integer widening above costs
 * a decode step more than the bytes it saves */
typedef uint16_t elem_f16x;
#define ATT_LOAD_f16x(p) ((att_vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))))
#define ATT_AT_f16x(p, i) half_to_float((p)[i])
ATTEND_BLOCK(f16x, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))))
#define ATTEND_HALF (use_vnni ? attend_block_f16x : attend_block_f16)
#else
#define ATTEND_HALF attend_block_f16
#endif


/* Causal attention with grouped KV heads: query t of T sits at position start + t and
 * sees keys 0..start+t (and of those only the ones ``visible`` (T, S) marks, when
 * given: DeepSeek's sparse attention; a query left with no key gets zeros). q is (T, Hq, D); keys and values (Hkv, S, D|Dv) are read
 * through their strides (the KV cache's views over a longer buffer); out is (T, Hq, Dv).
 * softmax(q.k * scale) @ v, as the numpy path computes it: max subtracted, exponentials
 * divided by their sum before the values are weighed. A task is one KV head and a few
 * consecutive queries with all the query heads sharing it (ATT_BLOCK rows at most). */
static int attention_rows(const float *q, int64_t T, int64_t Hq, int64_t D, KVView K, KVView V, int64_t Hkv, int64_t S,
                          int64_t Dv, int64_t start, float scale, const uint8_t *visible, int half, float *out) {
    const int64_t group = Hq / Hkv;
    const int64_t per_block = group >= ATT_BLOCK ? 1 : ATT_BLOCK / group;  /* queries per task */
    const int64_t hblocks = (group + ATT_BLOCK - 1) / ATT_BLOCK;  /* a group wider than a block: in parts */
    const int64_t tblocks = (T + per_block - 1) / per_block, tasks = Hkv * tblocks * hblocks;
    int failed = 0;
    /* small problems (tiny models, the first tokens) stay on this thread: waking the
     * other would cost more than it saves */
    #pragma omp parallel if (T * Hq * S * (D + Dv) >= (1 << 16))
    {
        Scratch mem = {0};
        float *scores = scratch_get(SC_SCORES, sizeof(float) * ATT_BLOCK * (S > 0 ? S : 1), &mem);
        if (scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        } else {
            #pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++) {
                const int64_t hk = task / (tblocks * hblocks), rest = task % (tblocks * hblocks);
                const int64_t t0 = (rest / hblocks) * per_block, g0 = (rest % hblocks) * ATT_BLOCK;
                const int64_t t1 = t0 + per_block < T ? t0 + per_block : T, g1 = g0 + ATT_BLOCK < group ? g0 + ATT_BLOCK : group;
                const float *rows[ATT_BLOCK];
                float *outs[ATT_BLOCK];
                const uint8_t *vis[ATT_BLOCK];
                int64_t n[ATT_BLOCK];
                int B = 0;
                for (int64_t t = t0; t < t1; t++)
                    for (int64_t h = hk * group + g0; h < hk * group + g1; h++, B++) {
                        rows[B] = q + (t * Hq + h) * D;
                        outs[B] = out + (t * Hq + h) * Dv;
                        vis[B] = visible ? visible + t * S : NULL;
                        n[B] = start + t + 1 < S ? start + t + 1 : S;
                    }
                (half ? ATTEND_HALF : attend_block_f32)(rows, n, vis, B, K.base + hk * K.head, K.pos, V.base + hk * V.head,
                                                             V.pos, D, Dv, scale, scores, S, outs);
            }
        }
        scratch_put(&mem);
    }
    return failed ? -1 : 0;
}

/* The softmax top-k router of most MoE layers, for each of T rows of x: logits = W x
 * (W: E x H float32), probabilities softmax(logits), the k largest (largest first; of
 * equal ones the lower index, as a stable sort), and their probabilities, renormalised
 * to sum 1 when asked. */
#define MAX_ROUTED 4096
static int route_rows(const float *x, int64_t T, const float *w, int64_t E, int64_t H, int64_t k, int renormalise,
                      int64_t *indices, float *weights) {
    Scratch mem = {0};
    float *logits = scratch_get(SC_ROUTE, sizeof(float) * (size_t)(T * E), &mem);
    if (logits == NULL) return -1;
    #pragma omp parallel for schedule(static) if (T * E * H >= (1 << 16))
    for (int64_t i = 0; i < T * E; i++) logits[i] = dot_f32(w + (i % E) * H, x + (i / E) * H, H);
    for (int64_t t = 0; t < T; t++) {
        float *p = logits + t * E, top = p[0], total = 0.f, picked = 0.f;
        uint8_t taken[MAX_ROUTED];
        memset(taken, 0, (size_t)E);
        for (int64_t e = 1; e < E; e++) top = p[e] > top ? p[e] : top;
        for (int64_t e = 0; e < E; e++) { p[e] = expf(p[e] - top); total += p[e]; }
        for (int64_t e = 0; e < E; e++) p[e] /= total;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            indices[t * k + j] = best;
            weights[t * k + j] = p[best];
            picked += p[best];
        }
        if (renormalise)
            for (int64_t j = 0; j < k; j++) weights[t * k + j] /= picked;
    }
    scratch_put(&mem);
    return 0;
}

/* The k of E highest scores of a row, highest first, the lower index first among equal
 * ones (a stable sort's order); -inf ones are taken last, still in index order */
static void top_k_of(const float *score, int64_t E, int64_t k, int64_t *picked) {
    uint8_t taken[MAX_ROUTED];
    memset(taken, 0, (size_t)E);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || score[e] > score[best])) best = e;
        taken[best] = 1;
        picked[j] = best;
    }
}

/* DeepSeek-V3's noaux_tc router on T rows of host logits (E each): scores sigmoid(logits);
 * bias (or NULL) added for choosing only; with G > 1 groups of E / G experts, each group
 * scored by the sum of its two best biased scores and only the topk_group best groups
 * compete; the k best, their unbiased scores divided by their sum (+ 1e-20) when asked,
 * times scaling. Each row on its own (host.sigmoid_grouped_top_k is the same in numpy). */
static void sigmoid_route_rows(const float *logits, int64_t T, int64_t E, const float *bias, int64_t k, int64_t G,
                               int64_t topk_group, int renormalise, float scaling, int64_t *indices, float *weights) {
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        float score[MAX_ROUTED], choice[MAX_ROUTED];
        for (int64_t e = 0; e < E; e++) {
            score[e] = 1.f / (1.f + expf(-l[e]));
            choice[e] = bias ? score[e] + bias[e] : score[e];
        }
        if (G > 1) {
            const int64_t per = E / G;
            float group_score[MAX_ROUTED];
            int64_t groups[MAX_ROUTED];
            for (int64_t g = 0; g < G; g++) {
                const float *c = choice + g * per;
                int64_t first = 0;
                for (int64_t e = 1; e < per; e++) if (c[e] > c[first]) first = e;
                int64_t second = first == 0 ? 1 : 0;
                for (int64_t e = 0; e < per; e++) if (e != first && c[e] > c[second]) second = e;
                group_score[g] = c[first] + c[second];
            }
            top_k_of(group_score, G, topk_group, groups);
            uint8_t keep[MAX_ROUTED];
            memset(keep, 0, (size_t)G);
            for (int64_t j = 0; j < topk_group; j++) keep[groups[j]] = 1;
            for (int64_t e = 0; e < E; e++) if (!keep[e / per]) choice[e] = -INFINITY;
        }
        int64_t *idx = indices + t * k;
        float *w = weights + t * k, total = 0.f;
        top_k_of(choice, E, k, idx);
        for (int64_t j = 0; j < k; j++) { w[j] = score[idx[j]]; total += w[j]; }
        for (int64_t j = 0; j < k; j++) w[j] = (renormalise ? w[j] / (total + 1e-20f) : w[j]) * scaling;
    }
}

/* Per-group float32 products for T rows of G groups: out[t, g, :] = x[t, g, :] @ W_g, with W_g
 * (K, N) read through strides (transposed 0), or x[t, g, :] @ W_g^T with W_g (N, K) (transposed 1).
 * Each output is summed in the same order whatever the rows beside it (no blocking over
 * rows), so a row comes out as it would alone: the routers' logits and absorbed MLA's
 * per-head products, where a verification's rows must equal decode steps. */
CLONES static void head_matmul_rows(const float *x, int64_t T, int64_t G, int64_t K, int64_t N, KVView W, int transposed,
                                    float *out) {
    #pragma omp parallel for schedule(static) if (T * G * K * N >= (1 << 18))
    for (int64_t i = 0; i < T * G; i++) {
        const float *xr = x + i * K;
        float *o = out + i * N;
        const char *w = W.base + (i % G) * W.head;
        if (transposed) {
            for (int64_t n = 0; n < N; n++) o[n] = dot_f32((const float *)(w + n * W.pos), xr, K);
        } else {
            for (int64_t n = 0; n < N; n++) o[n] = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const float xk = xr[k], *wr = (const float *)(w + k * W.pos);
                for (int64_t n = 0; n < N; n++) o[n] += xk * wr[n];
            }
        }
    }
}

/* Rotate-half RoPE on the first R features of each head: x (T, H, D), cos/sin (T, R); with
 * ``interleaved`` the R features are pairs (x0, x1), (x2, x3), ... taken apart first (all
 * first members, then all second members: transformers' apply_rotary_pos_emb_interleave) */
CLONES static void rope_rows(const float *x, const float *cos, const float *sin, int64_t T, int64_t H, int64_t D, int64_t R,
                             int interleaved, float *out) {
    const int64_t half = R / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const float *xi = x + (t * H + h) * D, *c = cos + t * R, *sn = sin + t * R;
            float *o = out + (t * H + h) * D;
            if (interleaved) {
                for (int64_t i = 0; i < half; i++) {
                    const float a = xi[2 * i], b = xi[2 * i + 1];
                    o[i] = a * c[i] + (-b) * sn[i];
                    o[half + i] = b * c[half + i] + a * sn[half + i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) o[i] = xi[i] * c[i] + (-xi[i + half]) * sn[i];
                for (int64_t i = half; i < R; i++) o[i] = xi[i] * c[i] + xi[i - half] * sn[i];
            }
            for (int64_t i = R; i < D; i++) o[i] = xi[i];
        }
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

CLONES static void dq_q4(const Weight *W, float *w) {
    const uint8_t *q = W->data; const int64_t N = W->N, K = W->K, G = (K + 63) / 64;
    float buf[MAX_Q4_GROUPS];
    for (int64_t n = 0; n < N; n++) {
        float tmp[64];
        const float *s = q4_row_scales(W, n, G, buf);
        for (int64_t g = 0; g < G; g++) {
            decode_q4_group(q + (n * G + g) * 32, tmp);
            const int64_t base = g * 64, width = K - base < 64 ? K - base : 64;
            const float sc = s[g];
            for (int64_t j = 0; j < width; j++) w[n * K + base + j] = tmp[j] * sc;
        }
    }
}

static void dq_mxfp4(const uint8_t *q, const uint8_t *e, float *w, int64_t N, int64_t K) {
    const int64_t G = (K + 31) / 32;
    float chunk[MXFP4_CHUNK * 32];
    for (int64_t n = 0; n < N; n++)
        for (int64_t g0 = 0; g0 < G; g0 += MXFP4_CHUNK) {
            const int64_t gn = G - g0 < MXFP4_CHUNK ? G - g0 : MXFP4_CHUNK, width = K - g0 * 32 < gn * 32 ? K - g0 * 32 : gn * 32;
            mxfp4_row(q + (n * G + g0) * 16, e + n * G + g0, gn, chunk);
            memcpy(w + n * K + g0 * 32, chunk, sizeof(float) * (size_t)width);
        }
}

static void dq_pair4(const Weight *W, float *w) {
    const uint8_t *q = W->data; const int64_t N = W->N, K = W->K, G = (K + 31) / 32;
    const int8_t *table = pair4_table(W);
    float buf[MAX_Q4_GROUPS], tmp[32];
    for (int64_t n = 0; n < N; n++) {
        const float *s = pair4_row_scales(W, n, G, buf);
        for (int64_t g = 0; g < G; g++) {
            pair4_group(table, q + (n * G + g) * 16, tmp);
            const int64_t base = g * 32, width = K - base < 32 ? K - base : 32;
            for (int64_t j = 0; j < width; j++) w[n * K + base + j] = tmp[j] * s[g];
        }
    }
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

/* what an entry point returns once its kernel ran: None, or MemoryError when the kernel
 * could not get its scratch memory */
static PyObject *kernel_result(int status) {
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* whether a buffer (taken with PyBUF_FORMAT) holds elements of struct code c, in native
 * or explicitly little-endian order */
static int format_is(const Py_buffer *b, char c) {
    const char *f = b->format != NULL ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[0] == c && f[1] == '\0';
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
    case K_Q4G32: { int64_t G = (K + 31) / 32; *scale_bytes = N * G * 4; return N * G * 16; }
    case K_MXFP4P: { int64_t G = (K + 31) / 32; *scale_bytes = N * G; return N * G * 16; }
    default: *scale_bytes = 0; return N * K * 2;
    }
}

/* Fill W from (kind, data, scales, n, k, bm, bn); bufs[0..1] receive data and scales.
 * q4 scales are float32 or bfloat16 bits (uint16), told apart by the array's type. */
static int parse_weight(const char *kind_name, PyObject *data, PyObject *scales, long long n, long long k, long long bm,
                        long long bn, Weight *W, Buf *bufs) {
    W->kind = kind_of(kind_name);
    if (W->kind < 0) { PyErr_Format(PyExc_ValueError, "unknown kernel kind %s", kind_name); return -1; }
    if (n <= 0 || k <= 0 || bm <= 0 || bn <= 0) { PyErr_SetString(PyExc_ValueError, "sizes must be positive"); return -1; }
    Py_ssize_t sbytes, wbytes = weight_bytes(W->kind, n, k, bm, bn, &sbytes);
    if (get_buf(data, &bufs[0], 0, wbytes, "weight")) return -1;
    W->bf16_scales = 0;
    if (W->kind == K_MXFP4P && (k + 31) / 32 > MAX_Q4_GROUPS) {
        PyErr_Format(PyExc_ValueError, "mxfp4pair rows take at most %d inputs", MAX_Q4_GROUPS * 32);
        return -1;
    }
    if (W->kind == K_Q4 || W->kind == K_Q4G32) {
        const int64_t group = W->kind == K_Q4 ? 64 : 32;
        if (PyObject_GetBuffer(scales, &bufs[1].b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
        bufs[1].held = 1;
        W->bf16_scales = format_is(&bufs[1].b, 'H');
        if (!W->bf16_scales && !format_is(&bufs[1].b, 'f')) {
            PyErr_Format(PyExc_ValueError, "%s scales must be float32 or bfloat16 bits (uint16)", kind_name);
            return -1;
        }
        if (W->bf16_scales) sbytes /= 2;
        if ((W->bf16_scales || W->kind == K_Q4G32) && (k + group - 1) / group > MAX_Q4_GROUPS) {
            PyErr_Format(PyExc_ValueError, "%s rows with bfloat16 scales take at most %lld inputs", kind_name,
                         (long long)(MAX_Q4_GROUPS * group));
            return -1;
        }
        if (bufs[1].b.len < sbytes) {
            PyErr_Format(PyExc_ValueError, "scales holds %zd bytes, needs %zd", bufs[1].b.len, sbytes);
            return -1;
        }
    } else if (sbytes && get_buf(scales, &bufs[1], 0, sbytes, "scales")) return -1;
    W->data = bufs[0].b.buf;
    W->scales = sbytes ? bufs[1].b.buf : NULL;
    W->N = n; W->K = k; W->bm = bm; W->bn = bn;
    return 0;
}

/* x holds M rows of k float32, 1 <= M <= most */
static int rows_of(Buf *x, int64_t k, Py_ssize_t most, Py_ssize_t *M) {
    *M = x->b.len / (Py_ssize_t)(k * 4);
    if (*M < 1 || *M > most || x->b.len != *M * k * 4) {
        PyErr_Format(PyExc_ValueError, "x must be 1..%zd rows of %lld float32", most, (long long)k);
        return -1;
    }
    return 0;
}

/* ---- weights prepared once ----
 * weight(kind, data, scales, n, k[, bm, bn]) checks a packed weight's sizes and returns a
 * capsule holding its description and its buffers (which keep the arrays alive and
 * unresizable). The hot entry points take these, so a token's kernel calls do no
 * argument parsing per weight. */
#define WEIGHT_CAPSULE "colibri_core.compute.cpu._kernels.weight"
typedef struct { Weight W; Buf bufs[2]; } Prepared;

static void prepared_free(PyObject *capsule) {
    Prepared *p = PyCapsule_GetPointer(capsule, WEIGHT_CAPSULE);
    if (p != NULL) { release(p->bufs, 2); free(p); }
}

static PyObject *py_weight(PyObject *self, PyObject *args) {
    const char *kind; PyObject *wo, *so; long long n, k, bm = 128, bn = 128;
    if (!PyArg_ParseTuple(args, "sOOLL|LL", &kind, &wo, &so, &n, &k, &bm, &bn)) return NULL;
    Prepared *p = calloc(1, sizeof(Prepared));
    if (p == NULL) return PyErr_NoMemory();
    PyObject *capsule = NULL;
    if (parse_weight(kind, wo, so, n, k, bm, bn, &p->W, p->bufs) == 0)
        capsule = PyCapsule_New(p, WEIGHT_CAPSULE, prepared_free);
    if (capsule == NULL) { release(p->bufs, 2); free(p); }
    return capsule;
}

static const Weight *weight_of(PyObject *o, const char *what, Py_ssize_t i) {
    if (!PyCapsule_IsValid(o, WEIGHT_CAPSULE)) {
        PyErr_Format(PyExc_TypeError, "%s %zd is not a weight made by _kernels.weight()", what, i);
        return NULL;
    }
    return &((Prepared *)PyCapsule_GetPointer(o, WEIGHT_CAPSULE))->W;
}

/* matmul(x, w, out): out[M, N] = x[M, K] @ W^T */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    PyObject *xo, *wo, *oo;
    if (!PyArg_ParseTuple(args, "OOO", &xo, &wo, &oo)) return NULL;
    const Weight *W = weight_of(wo, "weight", 0);
    if (W == NULL) return NULL;
    Buf b[2] = {{{0}}};
    Py_ssize_t M;
    if (get_buf(xo, &b[0], 0, 0, "x") || rows_of(&b[0], W->K, PY_SSIZE_T_MAX / 4, &M) ||
        get_buf(oo, &b[1], 1, (Py_ssize_t)(M * W->N * 4), "out")) { release(b, 2); return NULL; }
    const float *x = b[0].b.buf; float *out = b[1].b.buf;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = linears_rows(W, 1, x, M, &out);
    Py_END_ALLOW_THREADS
    release(b, 2);
    return kernel_result(status);
}

#define MAX_LINEARS 16
#define MAX_MOE_EXPERTS 1024

/* moe(x, experts, rows, wts, off, out): experts is a sequence of (gate, up, down)
 * prepared weights; see moe_rows. */
static PyObject *py_moe(PyObject *self, PyObject *args) {
    PyObject *xo, *eo, *ro, *wo, *offo, *oo;
    if (!PyArg_ParseTuple(args, "OOOOOO", &xo, &eo, &ro, &wo, &offo, &oo)) return NULL;
    PyObject *seq = PySequence_Fast(eo, "experts must be a sequence");
    if (seq == NULL) return NULL;
    const Py_ssize_t nE = PySequence_Fast_GET_SIZE(seq);
    Buf b[5] = {{{0}}};
    Expert *E = NULL;
    Scratch mem = {0};
    PyObject *result = NULL;
    if (nE < 1 || nE > MAX_MOE_EXPERTS) {
        PyErr_Format(PyExc_ValueError, "moe takes 1..%d experts per call", MAX_MOE_EXPERTS);
        goto done;
    }
    E = scratch_get(SC_EXPERTS, sizeof(Expert) * (size_t)nE, &mem);
    if (E == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t e = 0; e < nE; e++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, e);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_TypeError, "expert %zd must be a (gate, up, down) tuple", e);
            goto done;
        }
        const Weight *g = weight_of(PyTuple_GET_ITEM(item, 0), "expert", e), *u, *d;
        if (g == NULL || (u = weight_of(PyTuple_GET_ITEM(item, 1), "expert", e)) == NULL ||
            (d = weight_of(PyTuple_GET_ITEM(item, 2), "expert", e)) == NULL) goto done;
        E[e].gate = *g; E[e].up = *u; E[e].down = *d;
        if (g->N != E[0].gate.N || g->K != E[0].gate.K || u->N != g->N || u->K != g->K || d->N != g->K || d->K != g->N) {
            PyErr_Format(PyExc_ValueError, "expert %zd: gate and up must be (I, H) and down (H, I), the same for all", e);
            goto done;
        }
    }
    const int64_t H = E[0].gate.K;
    if (get_buf(xo, &b[0], 0, 0, "x") || get_buf(offo, &b[3], 0, (Py_ssize_t)(8 * (nE + 1)), "off")) goto done;
    const int64_t T = b[0].b.len / (Py_ssize_t)(4 * H);
    if (T < 1 || b[0].b.len != T * H * 4) { PyErr_Format(PyExc_ValueError, "x must be rows of %lld float32", (long long)H); goto done; }
    const int64_t *off = b[3].b.buf;
    for (Py_ssize_t e = 0; e < nE; e++)
        if (off[0] != 0 || off[e + 1] < off[e]) { PyErr_SetString(PyExc_ValueError, "off must rise from 0"); goto done; }
    const int64_t R = off[nE];
    if (get_buf(ro, &b[1], 0, (Py_ssize_t)(4 * R), "rows") || get_buf(wo, &b[2], 0, (Py_ssize_t)(4 * R), "wts") ||
        get_buf(oo, &b[4], 1, (Py_ssize_t)(T * H * 4), "out")) goto done;
    const int32_t *rows = b[1].b.buf;
    for (int64_t r = 0; r < R; r++)
        if (rows[r] < 0 || rows[r] >= T) { PyErr_Format(PyExc_ValueError, "row %d is outside x's %lld rows", rows[r], (long long)T); goto done; }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = R > 0 ? moe_rows(E, nE, b[0].b.buf, T, rows, b[2].b.buf, off, b[4].b.buf) : 0;
    Py_END_ALLOW_THREADS
    result = kernel_result(status);
done:
    release(b, 5);
    scratch_put(&mem);
    Py_DECREF(seq);
    return result;
}

/* linears(x, weights, outs): outs[i] = x @ W_i^T for prepared weights of the same input width */
static PyObject *py_linears(PyObject *self, PyObject *args) {
    PyObject *xo, *so, *oo;
    if (!PyArg_ParseTuple(args, "OOO", &xo, &so, &oo)) return NULL;
    PyObject *specs = PySequence_Fast(so, "weights must be a sequence");
    if (specs == NULL) return NULL;
    PyObject *outs = PySequence_Fast(oo, "outs must be a sequence");
    if (outs == NULL) { Py_DECREF(specs); return NULL; }
    const Py_ssize_t nW = PySequence_Fast_GET_SIZE(specs);
    Buf b[MAX_LINEARS + 1] = {{{0}}};
    Weight W[MAX_LINEARS];
    float *out[MAX_LINEARS];
    PyObject *result = NULL;
    Py_ssize_t M;
    if (nW < 1 || nW > MAX_LINEARS || PySequence_Fast_GET_SIZE(outs) != nW) {
        PyErr_Format(PyExc_ValueError, "linears needs 1..%d weights and as many outputs", MAX_LINEARS);
        goto done;
    }
    for (Py_ssize_t i = 0; i < nW; i++) {
        const Weight *w = weight_of(PySequence_Fast_GET_ITEM(specs, i), "weight", i);
        if (w == NULL) goto done;
        W[i] = *w;
        if (W[i].K != W[0].K) { PyErr_Format(PyExc_ValueError, "weight %zd takes %lld inputs, weight 0 %lld", i, (long long)W[i].K, (long long)W[0].K); goto done; }
    }
    if (get_buf(xo, &b[nW], 0, 0, "x") || rows_of(&b[nW], W[0].K, PY_SSIZE_T_MAX / 4, &M)) goto done;
    for (Py_ssize_t i = 0; i < nW; i++) {
        if (get_buf(PySequence_Fast_GET_ITEM(outs, i), &b[i], 1, (Py_ssize_t)(M * W[i].N * 4), "out")) goto done;
        out[i] = b[i].b.buf;
    }
    int status;
    const float *x = b[nW].b.buf;
    Py_BEGIN_ALLOW_THREADS
    status = linears_rows(W, (int)nW, x, M, out);
    Py_END_ALLOW_THREADS
    result = kernel_result(status);
done:
    release(b, MAX_LINEARS + 1);
    Py_DECREF(specs); Py_DECREF(outs);
    return result;
}

/* route(x, w, k, renormalise, indices, weights): the softmax top-k router; see route_rows */
static PyObject *py_route(PyObject *self, PyObject *args) {
    PyObject *xo, *wo, *io, *po; long long k; int renormalise;
    if (!PyArg_ParseTuple(args, "OOLpOO", &xo, &wo, &k, &renormalise, &io, &po)) return NULL;
    Buf b[4] = {{{0}}};
    PyObject *result = NULL;
    Py_ssize_t T;
    if (PyObject_GetBuffer(wo, &b[1].b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) goto done;
    b[1].held = 1;
    if (b[1].b.ndim != 2 || !format_is(&b[1].b, 'f')) { PyErr_SetString(PyExc_ValueError, "weight must be (experts, hidden) float32"); goto done; }
    const int64_t E = b[1].b.shape[0], H = b[1].b.shape[1];
    if (k < 1 || k > E || E > MAX_ROUTED) { PyErr_Format(PyExc_ValueError, "route picks 1..experts (at most %d) of %lld", MAX_ROUTED, (long long)E); goto done; }
    if (get_buf(xo, &b[0], 0, 0, "x") || rows_of(&b[0], H, PY_SSIZE_T_MAX / 4, &T) ||
        get_buf(io, &b[2], 1, (Py_ssize_t)(T * k * 8), "indices") || get_buf(po, &b[3], 1, (Py_ssize_t)(T * k * 4), "weights")) goto done;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = route_rows(b[0].b.buf, T, b[1].b.buf, E, H, k, renormalise, b[2].b.buf, b[3].b.buf);
    Py_END_ALLOW_THREADS
    result = kernel_result(status);
done:
    release(b, 4);
    return result;
}

/* rms_norm(x, weight or None, eps, out) over rows of x's last dimension D = len(out row) */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    PyObject *xo, *wo, *oo; float eps; long long D;
    if (!PyArg_ParseTuple(args, "OOfOL", &xo, &wo, &eps, &oo, &D)) return NULL;
    Buf b[3] = {{{0}}};
    PyObject *result = NULL;
    if (D < 1 || get_buf(xo, &b[0], 0, 0, "x") || b[0].b.len % (D * 4) != 0 ||
        get_buf(oo, &b[2], 1, b[0].b.len, "out") || (wo != Py_None && get_buf(wo, &b[1], 0, D * 4, "weight"))) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "x must be rows of %lld float32", D);
        goto done;
    }
    const int64_t T = b[0].b.len / (D * 4);
    const float *x = b[0].b.buf, *w = wo != Py_None ? b[1].b.buf : NULL; float *out = b[2].b.buf;
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows(x, w, eps, T, D, out);
    Py_END_ALLOW_THREADS
    result = kernel_result(0);
done:
    release(b, 3);
    return result;
}

/* a float32 array of 3 dimensions with its last one contiguous, read through strides */
/* a 3-d float32 array (or float16, where ``half`` is given: set to whether it is) with
 * contiguous rows, as a view */
static int get_view3(PyObject *o, Buf *buf, const char *what, int64_t shape[3], KVView *view, int *half) {
    if (PyObject_GetBuffer(o, &buf->b, PyBUF_RECORDS_RO) != 0) return -1;
    buf->held = 1;
    const int is_half = half != NULL && format_is(&buf->b, 'e');
    if (buf->b.ndim != 3 || !(format_is(&buf->b, 'f') || is_half) || buf->b.strides[2] != (is_half ? 2 : 4) ||
        buf->b.strides[0] < 0 || buf->b.strides[1] < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a 3-d float32%s array with contiguous rows", what,
                     half != NULL ? " or float16" : "");
        return -1;
    }
    if (half != NULL) *half = is_half;
    for (int i = 0; i < 3; i++) shape[i] = buf->b.shape[i];
    view->base = buf->b.buf; view->head = buf->b.strides[0]; view->pos = buf->b.strides[1];
    return 0;
}

/* attention(q, k, v, start, scale, out[, visible]): see attention_rows */
static PyObject *py_attention(PyObject *self, PyObject *args) {
    PyObject *qo, *ko, *vo, *oo, *mo = Py_None; long long start; float scale;
    if (!PyArg_ParseTuple(args, "OOOLfO|O", &qo, &ko, &vo, &start, &scale, &oo, &mo)) return NULL;
    Buf b[5] = {{{0}}};
    int64_t qs[3], ks[3], vs[3];
    KVView qv, K, V;
    PyObject *result = NULL;
    int khalf = 0, vhalf = 0;
    if (get_view3(qo, &b[0], "q", qs, &qv, NULL) || get_view3(ko, &b[1], "k", ks, &K, &khalf) ||
        get_view3(vo, &b[2], "v", vs, &V, &vhalf))
        goto done;
    if (khalf != vhalf) {
        PyErr_SetString(PyExc_ValueError, "attention wants k and v of one dtype (float32 or float16)");
        goto done;
    }
    if (qv.pos != qs[2] * 4 || qv.head != qs[1] * qs[2] * 4 || qs[2] != ks[2] || ks[0] != vs[0] || ks[1] != vs[1] ||
        ks[0] < 1 || qs[1] % ks[0] != 0 || start < 0 || start + qs[0] < ks[1]) {
        PyErr_SetString(PyExc_ValueError, "attention wants contiguous q (T, Hq, D), k (Hkv, S, D), v (Hkv, S, Dv), "
                                          "Hq a multiple of Hkv and start + T >= S");
        goto done;
    }
    if (get_buf(oo, &b[3], 1, (Py_ssize_t)(qs[0] * qs[1] * vs[2] * 4), "out")) goto done;
    if (mo != Py_None && get_buf(mo, &b[4], 0, (Py_ssize_t)(qs[0] * ks[1]), "visible")) goto done;
    int status;
    float *out = b[3].b.buf;
    const uint8_t *visible = mo != Py_None ? b[4].b.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    status = attention_rows((const float *)qv.base, qs[0], qs[1], qs[2], K, V, ks[0], ks[1], vs[2], start, scale, visible,
                            khalf, out);
    Py_END_ALLOW_THREADS
    result = kernel_result(status);
done:
    release(b, 5);
    return result;
}

/* sigmoid_route(logits, bias or None, k, n_group, topk_group, renormalise, scaling, indices, weights):
 * see sigmoid_route_rows; logits (T, E) float32 */
static PyObject *py_sigmoid_route(PyObject *self, PyObject *args) {
    PyObject *lo, *bo, *io, *wo; long long k, G, topk_group; int renormalise; float scaling;
    if (!PyArg_ParseTuple(args, "OOLLLpfOO", &lo, &bo, &k, &G, &topk_group, &renormalise, &scaling, &io, &wo)) return NULL;
    Buf b[4] = {{{0}}};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(lo, &b[0].b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) goto done;
    b[0].held = 1;
    if (b[0].b.ndim != 2 || !format_is(&b[0].b, 'f')) { PyErr_SetString(PyExc_ValueError, "logits must be (T, experts) float32"); goto done; }
    const int64_t T = b[0].b.shape[0], E = b[0].b.shape[1];
    if (E < 1 || E > MAX_ROUTED || k < 1 || k > E || G < 1 || E % G != 0 || (G > 1 && E / G < 2) || topk_group < 1 ||
        topk_group > G || k > topk_group * (E / G)) {
        PyErr_Format(PyExc_ValueError, "sigmoid_route: %lld experts (at most %d) in %lld groups, k %lld of the best %lld "
                     "groups", (long long)E, MAX_ROUTED, G, k, topk_group);
        goto done;
    }
    if ((bo != Py_None && get_buf(bo, &b[1], 0, (Py_ssize_t)(E * 4), "bias")) ||
        get_buf(io, &b[2], 1, (Py_ssize_t)(T * k * 8), "indices") || get_buf(wo, &b[3], 1, (Py_ssize_t)(T * k * 4), "weights"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    sigmoid_route_rows(b[0].b.buf, T, E, bo != Py_None ? b[1].b.buf : NULL, k, G, topk_group, renormalise, scaling,
                       b[2].b.buf, b[3].b.buf);
    Py_END_ALLOW_THREADS
    result = kernel_result(0);
done:
    release(b, 4);
    return result;
}

/* head_matmul(x, w, out, transposed): see head_matmul_rows; x (T, G, K) contiguous, w (G, K, N)
 * or (G, N, K) with contiguous rows (a view of a larger array), out (T, G, N) */
static PyObject *py_head_matmul(PyObject *self, PyObject *args) {
    PyObject *xo, *wo, *oo; int transposed;
    if (!PyArg_ParseTuple(args, "OOOp", &xo, &wo, &oo, &transposed)) return NULL;
    Buf b[3] = {{{0}}};
    int64_t ws[3];
    KVView W;
    PyObject *result = NULL;
    if (get_view3(wo, &b[1], "w", ws, &W, NULL)) goto done;
    const int64_t G = ws[0], K = transposed ? ws[2] : ws[1], N = transposed ? ws[1] : ws[2];
    if (PyObject_GetBuffer(xo, &b[0].b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) goto done;
    b[0].held = 1;
    if (b[0].b.ndim != 3 || !format_is(&b[0].b, 'f') || b[0].b.shape[1] != G || b[0].b.shape[2] != K) {
        PyErr_Format(PyExc_ValueError, "head_matmul wants x (T, %lld, %lld) float32 for that w", (long long)G,
                     (long long)K);
        goto done;
    }
    const int64_t T = b[0].b.shape[0];
    if (get_buf(oo, &b[2], 1, (Py_ssize_t)(T * G * N * 4), "out")) goto done;
    Py_BEGIN_ALLOW_THREADS
    head_matmul_rows(b[0].b.buf, T, G, K, N, W, transposed, b[2].b.buf);
    Py_END_ALLOW_THREADS
    result = kernel_result(0);
done:
    release(b, 3);
    return result;
}

/* rope(x, cos, sin, rotary_dim, out[, interleaved]): x (T, H, D) contiguous, cos/sin (T, rotary_dim) */
static PyObject *py_rope(PyObject *self, PyObject *args) {
    PyObject *xo, *co, *so, *oo; long long R; int interleaved = 0;
    if (!PyArg_ParseTuple(args, "OOOLO|p", &xo, &co, &so, &R, &oo, &interleaved)) return NULL;
    Buf b[4] = {{{0}}};
    int64_t xs[3];
    KVView xv;
    PyObject *result = NULL;
    if (get_view3(xo, &b[0], "x", xs, &xv, NULL)) goto done;
    if (xv.pos != xs[2] * 4 || xv.head != xs[1] * xs[2] * 4 || R < 2 || R % 2 || R > xs[2]) {
        PyErr_SetString(PyExc_ValueError, "rope wants a contiguous x (T, H, D) and an even rotary_dim <= D");
        goto done;
    }
    if (get_buf(co, &b[1], 0, (Py_ssize_t)(xs[0] * R * 4), "cos") || get_buf(so, &b[2], 0, (Py_ssize_t)(xs[0] * R * 4), "sin") ||
        get_buf(oo, &b[3], 1, (Py_ssize_t)(xs[0] * xs[1] * xs[2] * 4), "out")) goto done;
    const float *x = (const float *)xv.base, *c = b[1].b.buf, *sn = b[2].b.buf; float *out = b[3].b.buf;
    Py_BEGIN_ALLOW_THREADS
    rope_rows(x, c, sn, xs[0], xs[1], xs[2], R, interleaved, out);
    Py_END_ALLOW_THREADS
    result = kernel_result(0);
done:
    release(b, 4);
    return result;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    const char *kind; PyObject *wo, *so, *oo; long long n, k, bm = 128, bn = 128;
    if (!PyArg_ParseTuple(args, "sOOOLL|LL", &kind, &wo, &so, &oo, &n, &k, &bm, &bn)) return NULL;
    Buf b[3] = {{{0}}};
    Weight W;
    if (parse_weight(kind, wo, so, n, k, bm, bn, &W, &b[0]) || get_buf(oo, &b[2], 1, (Py_ssize_t)(n * k * 4), "out")) {
        release(b, 3);
        return NULL;
    }
    float *out = b[2].b.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (W.kind) {
    case K_Q8: dq_q8(W.data, W.scales, out, n, k); break;
    case K_Q4: dq_q4(&W, out); break;
    case K_MXFP4: dq_mxfp4(W.data, W.scales, out, n, k); break;
    case K_FP8: dq_fp8(W.data, W.scales, out, n, k, bm, bn); break;
    case K_Q4G32: case K_MXFP4P: dq_pair4(&W, out); break;
    default: dq_bf16(W.data, out, n, k);
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"weight", py_weight, METH_VARARGS,
     "weight(kind, data, scales, n, k[, bm, bn]): a packed weight checked once, for matmul, linears and moe"},
    {"matmul", py_matmul, METH_VARARGS, "matmul(x, w, out): out = x @ W^T"},
    {"linears", py_linears, METH_VARARGS, "linears(x, weights, outs): outs[i] = x @ W_i^T, one parallel region for all"},
    {"route", py_route, METH_VARARGS,
     "route(x, w, k, renormalise, indices, weights): softmax(x @ w^T), its k largest per row and their probabilities"},
    {"sigmoid_route", py_sigmoid_route, METH_VARARGS,
     "sigmoid_route(logits, bias, k, n_group, topk_group, renormalise, scaling, indices, weights): noaux_tc routing"},
    {"head_matmul", py_head_matmul, METH_VARARGS,
     "head_matmul(x, w, out, transposed): out[t, g] = x[t, g] @ w[g] (or @ w[g]^T), each row as alone"},
    {"attention", py_attention, METH_VARARGS, "attention(q, k, v, start, scale, out[, visible]): causal attention, grouped KV heads"},
    {"rope", py_rope, METH_VARARGS, "rope(x, cos, sin, rotary_dim, out[, interleaved]): rotate-half RoPE"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, weight or None, eps, out, d): RMSNorm over rows of d floats"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(kind, data, scales, out, n, k[, bm, bn]): W as float32"},
    {"moe", py_moe, METH_VARARGS,
     "moe(x, experts, rows, wts, off, out): out[rows] += wts * expert(x[rows]) for a batch of (gate, up, down) experts"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "colibri's CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    /* COLIBRI_KERNEL_PATH=avx2 or =portable holds the kernels to a lower level than the
     * machine has (to test those paths, or to rule them out when hunting a bug) */
    const char *path = getenv("COLIBRI_KERNEL_PATH");
    const int portable = path && !strcmp(path, "portable"), avx2_only = path && !strcmp(path, "avx2");
    use_avx2 = have_avx2() && !portable;
    use_vnni = use_avx2 && have_vnni() && !avx2_only;
    use_vbmi = use_avx2 && have_vbmi() && !avx2_only;
    if (use_vbmi) mx4_tables_fill();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyModule_AddIntConstant(m, "MAX_ROWS", MAX_ROWS);
    PyModule_AddIntConstant(m, "MAX_ROUTED", MAX_ROUTED);
    PyModule_AddIntConstant(m, "INT4_INTEGER_PATH", use_avx2);
    PyModule_AddStringConstant(m, "INT4_PATH", use_vnni ? "avx512-vnni" : use_avx2 ? "avx2" : "float");
    PyModule_AddStringConstant(m, "MXFP4PAIR_PATH", use_vbmi ? "avx512-vbmi" : use_avx2 ? "avx2" : "float");
#ifdef _OPENMP
    PyModule_AddIntConstant(m, "OPENMP", 1);
#else
    PyModule_AddIntConstant(m, "OPENMP", 0);
#endif
    return m;
}
