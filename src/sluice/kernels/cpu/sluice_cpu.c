/* CPU kernels for MLX-affine quantized weights (bits 2, 4, 8; any group size that is a multiple of 16).
 *
 * Layout: w[n] is a row of uint32 words, element j of a word at bits [j*bits, (j+1)*bits), LSB-first;
 * value = scale[n][g] * q + bias[n][g]. Scales/biases are fp32 (0), fp16 (1) or bf16 (2).
 *
 * qgemv:   y[M, N] = x[M, K] @ W^T, dequantization fused (decode: reads only the packed bytes).
 *          Per row: sum_g scale_g * dot(x_g, q_g) + bias_g * sum(x_g), so the bias term costs one FMA per group.
 * dequant: W[rows] -> fp32 (prefill: one dequantization, then a BLAS GEMM; embedding lookups).
 * Built by sluice/kernels/qmatmul/cpu.py with `gcc -O3 -march=native -fopenmp`.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000 | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f; memcpy(&f, &bits, 4); return f;
}

static inline float load_scalar(const void *p, int dtype, int64_t i) {
    if (dtype == 0) return ((const float *)p)[i];
    if (dtype == 1) return half_to_float(((const uint16_t *)p)[i]);
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16; float f; memcpy(&f, &bits, 4); return f;
}

/* Unpack one group of `gs` codes (starting at word pointer w) into floats. */
static inline void unpack_group(const uint32_t *w, int bits, int gs, float *out) {
#ifdef __AVX2__
    if (bits == 4) {
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(15);
        for (int i = 0; i < gs / 8; i++) {
            __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)w[i]), shifts);
            _mm256_storeu_ps(out + 8 * i, _mm256_cvtepi32_ps(_mm256_and_si256(v, mask)));
        }
        return;
    }
    if (bits == 8) {  /* LSB-first bytes of little-endian words are simply the bytes in order */
        const uint8_t *b = (const uint8_t *)w;
        for (int i = 0; i < gs / 8; i++) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * i)));
            _mm256_storeu_ps(out + 8 * i, _mm256_cvtepi32_ps(v));
        }
        return;
    }
    if (bits == 2) {
        const __m256i lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), hi = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
        const __m256i mask = _mm256_set1_epi32(3);
        for (int i = 0; i < gs / 16; i++) {
            __m256i word = _mm256_set1_epi32((int)w[i]);
            _mm256_storeu_ps(out + 16 * i, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, lo), mask)));
            _mm256_storeu_ps(out + 16 * i + 8, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, hi), mask)));
        }
        return;
    }
#endif
    const int per = 32 / bits; const uint32_t mask = (1u << bits) - 1u;
    for (int j = 0; j < gs; j++) out[j] = (float)((w[j / per] >> ((j % per) * bits)) & mask);
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

static inline float dot(const float *a, const float *b, int n) {
#ifdef __AVX2__
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    float r = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
#else
    float r = 0.f; for (int i = 0; i < n; i++) r += a[i] * b[i]; return r;
#endif
}


#ifdef __AVX2__
/* Codes i*8 .. i*8+7 of a group as floats; `bits` is a literal at every call site, so the switch folds away. */
static inline __m256 codes8(const uint32_t *wg, int i, int bits) {
    if (bits == 4) {
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)wg[i]), shifts);
        return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    }
    if (bits == 8) {
        __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)wg + 8 * i));
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    }
    const __m256i lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), hi = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)wg[i >> 1]), (i & 1) ? hi : lo);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(3)));
}

/* One output row for one activation row: unpack and FMA in registers, one horizontal sum per row.
 * sum_g scale_g * dot(x_g, q_g) accumulates in a vector; the bias term is one scalar FMA per group. */
#define ROW_DOT(BITS)                                                                                           \
static float row_dot_##BITS(const float *x, const uint32_t *wr, const void *scales, const void *biases,         \
                            int sdtype, int64_t n, int64_t G, int gs, const float *xsum) {                      \
    __m256 racc = _mm256_setzero_ps();                                                                          \
    float bacc = 0.f;                                                                                           \
    const int wpg = gs * BITS / 32;                                                                             \
    for (int64_t g = 0; g < G; g++) {                                                                           \
        const uint32_t *wg = wr + g * wpg;                                                                      \
        const float *xg = x + g * gs;                                                                           \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                              \
        for (int i = 0; i < gs / 8; i += 2) {                                                                   \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * i), codes8(wg, i, BITS), a0);                         \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8 * i + 8), codes8(wg, i + 1, BITS), a1);                 \
        }                                                                                                       \
        racc = _mm256_fmadd_ps(_mm256_set1_ps(load_scalar(scales, sdtype, n * G + g)), _mm256_add_ps(a0, a1), racc); \
        bacc += load_scalar(biases, sdtype, n * G + g) * xsum[g];                                               \
    }                                                                                                           \
    return hsum(racc) + bacc;                                                                                   \
}
ROW_DOT(2)
ROW_DOT(4)
ROW_DOT(8)
#endif

/* Portable fallback: unpack a group into a buffer, then a plain dot product. */
static float row_dot_any(const float *x, const uint32_t *wr, const void *scales, const void *biases, int sdtype,
                         int64_t n, int64_t G, int gs, const float *xsum, int bits) {
    float buf[256], acc = 0.f;
    for (int64_t g = 0; g < G; g++) {
        unpack_group(wr + g * ((int64_t)gs * bits / 32), bits, gs, buf);
        acc += load_scalar(scales, sdtype, n * G + g) * dot(x + g * gs, buf, gs)
             + load_scalar(biases, sdtype, n * G + g) * xsum[g];
    }
    return acc;
}

static inline float row_dot(const float *x, const uint32_t *wr, const void *scales, const void *biases, int sdtype,
                            int64_t n, int64_t G, int gs, const float *xsum, int bits) {
#ifdef __AVX2__
    if (bits == 4) return row_dot_4(x, wr, scales, biases, sdtype, n, G, gs, xsum);
    if (bits == 8) return row_dot_8(x, wr, scales, biases, sdtype, n, G, gs, xsum);
    if (bits == 2) return row_dot_2(x, wr, scales, biases, sdtype, n, G, gs, xsum);
#endif
    return row_dot_any(x, wr, scales, biases, sdtype, n, G, gs, xsum, bits);
}

/* y[M, N] = x[M, K] @ W[N, K]^T. xsum[M, K/gs] receives the per-group sums of x (the bias term). */
void qgemv(const float *x, int64_t M, int64_t K, const uint32_t *w, const void *scales, const void *biases,
           int sdtype, int64_t N, int bits, int gs, float *y, float *xsum) {
    const int64_t G = K / gs, words_per_row = K * bits / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f; for (int j = 0; j < gs; j++) s += x[m * K + g * gs + j]; xsum[m * G + g] = s;
        }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = row_dot(x + m * K, w + n * words_per_row, scales, biases, sdtype, n, G, gs,
                                   xsum + m * G, bits);
}

/* out[r, K] = dequantized W[rows[r]] (rows == NULL: all N rows in order). */
void dequant(const uint32_t *w, const void *scales, const void *biases, int sdtype, int64_t K, int bits, int gs,
             const int64_t *rows, int64_t nrows, float *out) {
    const int64_t G = K / gs, words_per_row = K * bits / 32, wpg = (int64_t)gs * bits / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t n = rows ? rows[r] : r;
        float *o = out + r * K;
        for (int64_t g = 0; g < G; g++) {
            unpack_group(w + n * words_per_row + g * wpg, bits, gs, o + g * gs);
            float s = load_scalar(scales, sdtype, n * G + g), b = load_scalar(biases, sdtype, n * G + g);
            for (int j = 0; j < gs; j++) o[g * gs + j] = o[g * gs + j] * s + b;
        }
    }
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w  (fp32 RMSNorm, as the torch reference computes it). */
void rms_norm(const float *x, const float *w, float eps, int64_t rows, int64_t D, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) out[r * D + i] = w[i] * (xr[i] * inv);
    }
}

/* One decode step (T = 1, one sequence) of causal GQA attention over an fp32 cache, in place.
 *   qkv [Hq + 2 Hkv, D]: this token's q heads, then k heads, then v heads.
 *   cos, sin [rot]: RoPE for this position, rotate-half convention over the first `rot` dims (rest pass through).
 *   kc, vc [Hkv, cap, D]: the layer's cache; rope(k) and v are written at `pos`, then all q heads attend to
 *   positions 0..pos. Query head h reads kv head h / (Hq / Hkv).
 *   out [Hq, D].
 * The same math, op for op, as kernels/rope + kernels/attention references (softmax with the max subtracted). */
static void rope_row(const float *x, const float *cos, const float *sin, int64_t D, int64_t rot, float *y) {
    const int64_t h = rot / 2;
    for (int64_t i = 0; i < h; i++) {
        y[i] = x[i] * cos[i] + (-x[i + h]) * sin[i];
        y[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
    }
    for (int64_t i = rot; i < D; i++) y[i] = x[i];
}

void attn_decode(const float *qkv, const float *cos, const float *sin, float *kc, float *vc, int64_t Hq,
                 int64_t Hkv, int64_t D, int64_t rot, int64_t cap, int64_t pos, float scale, float *out) {
    const int64_t rep = Hq / Hkv, S = pos + 1;
    for (int64_t j = 0; j < Hkv; j++) {
        rope_row(qkv + (Hq + j) * D, cos, sin, D, rot, kc + (j * cap + pos) * D);
        memcpy(vc + (j * cap + pos) * D, qkv + (Hq + Hkv + j) * D, D * sizeof(float));
    }
    #pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < Hq; h++) {
        const int64_t j = h / rep;
        const float *K = kc + j * cap * D, *V = vc + j * cap * D;
        float q[512], *o = out + h * D;
        float *p = (float *)malloc(S * sizeof(float));
        rope_row(qkv + h * D, cos, sin, D, rot, q);
        float m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < S; t++) { p[t] = dot(q, K + t * D, (int)D) * scale; if (p[t] > m) m = p[t]; }
        for (int64_t t = 0; t < S; t++) { p[t] = expf(p[t] - m); sum += p[t]; }
        for (int64_t i = 0; i < D; i++) o[i] = 0.f;
        for (int64_t t = 0; t < S; t++) {
            const float w = p[t] / sum, *v = V + t * D;
            for (int64_t i = 0; i < D; i++) o[i] += w * v[i];
        }
        free(p);
    }
}

/* Where slot s of KV head j starts in a code array: keys row by row ([cap, D/2]: byte i of slot s at s D/2 + i),
 * values four slots interleaved ([cap/4, D/2, 4]: byte i of slot s at (s / 4) 2D + 4 i + s % 4;
 * reference.interleave). Bytes i and i + 1 lie `tq_step(interleaved)` apart. */
static inline int64_t tq_code_offset(int64_t j, int64_t s, int64_t cap, int64_t Dh, int interleaved) {
    return interleaved ? j * cap * Dh + (s / 4) * 4 * Dh + s % 4 : (j * cap + s) * Dh;
}

static inline int64_t tq_step(int interleaved) { return interleaved ? 4 : 1; }

/* Position x's key or value row of KV head j in the rotated domain: exact from the ring (pos - x < R) or decoded
 * from its codes (byte i: coordinate i low nibble, i + D/2 high) times its scale. */
static const float *tq_row(const uint8_t *codes, const float *scales, const float *ring_rows, const float *levels,
                           int64_t j, int64_t x, int64_t pos, int64_t D, int64_t cap, int64_t R, int32_t ring,
                           int interleaved, float *buf) {
    if (pos - x < R) return ring_rows + (j * R + x % R) * D;
    const int64_t slot = ring ? x % cap : x, Dh = D / 2, step = tq_step(interleaved);
    const uint8_t *c = codes + tq_code_offset(j, slot, cap, Dh, interleaved);
    const float sc = scales[j * cap + slot];
    for (int64_t i = 0; i < Dh; i++) {
        buf[i] = levels[c[i * step] & 15] * sc;
        buf[i + Dh] = levels[c[i * step] >> 4] * sc;
    }
    return buf;
}

/* TurboQuant KV-cache decode attention for one sequence, in the rotated domain (kernels/turboquant/reference.py):
 * q [Hq, D] (rotated), key codes [Hkv, cap, D/2], value codes [Hkv, cap/4, D/2, 4], scales [Hkv, cap], the exact
 * rings [Hkv, R, D] (position x at slot x % R), levels[16]; positions first..pos at slot x (or x % cap when
 * `ring`). Each KV head's rows are decoded once for its Hq / Hkv query heads. out [Hq, D] (rotated). */
static void tq_attn_decode(const float *q, const uint8_t *kc, const float *ks, const uint8_t *vc, const float *vs,
                           const float *kr, const float *vr, const float *levels, int64_t Hq, int64_t Hkv, int64_t D,
                           int64_t cap, int64_t R, int64_t first, int64_t pos, int32_t ring, float scale,
                           float *out) {
    const int64_t rep = Hq / Hkv, S = pos + 1 - first;
    #pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < Hkv; j++) {
        float buf[512];
        float *p = (float *)malloc(rep * S * sizeof(float));
        for (int64_t t = 0; t < S; t++) {
            const float *k = tq_row(kc, ks, kr, levels, j, first + t, pos, D, cap, R, ring, 0, buf);
            for (int64_t g = 0; g < rep; g++) p[g * S + t] = dot(q + (j * rep + g) * D, k, (int)D) * scale;
        }
        for (int64_t g = 0; g < rep; g++) {
            float m = -INFINITY, sum = 0.f, *pg = p + g * S;
            for (int64_t t = 0; t < S; t++) if (pg[t] > m) m = pg[t];
            for (int64_t t = 0; t < S; t++) { pg[t] = expf(pg[t] - m); sum += pg[t]; }
            for (int64_t t = 0; t < S; t++) pg[t] /= sum;
            for (int64_t i = 0; i < D; i++) out[(j * rep + g) * D + i] = 0.f;
        }
        for (int64_t t = 0; t < S; t++) {
            const float *v = tq_row(vc, vs, vr, levels, j, first + t, pos, D, cap, R, ring, 1, buf);
            for (int64_t g = 0; g < rep; g++) {
                const float w = p[g * S + t];
                float *o = out + (j * rep + g) * D;
                for (int64_t i = 0; i < D; i++) o[i] += w * v[i];
            }
        }
        free(p);
    }
}

/* x <- x H (Sylvester Hadamard, natural order) in place: log2(D) butterfly passes. */
static void fwht(float *x, int64_t D) {
    for (int64_t h = 1; h < D; h *= 2)
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

/* The TurboQuant codec's rotation (reference.rotate): y = (x * s) H / sqrt(D); inverse: x = (y H) * s / sqrt(D). */
static void tq_rotate(const float *x, const float *signs, int64_t D, int inverse, float *y) {
    const float inv = 1.f / sqrtf((float)D);
    for (int64_t i = 0; i < D; i++) y[i] = inverse ? x[i] : x[i] * signs[i];
    fwht(y, D);
    for (int64_t i = 0; i < D; i++) y[i] *= inverse ? inv * signs[i] : inv;
}

/* reference.quantize of one vector into its cache slot (its bytes `step` apart), and its rotation into the exact
 * ring slot. */
static void tq_append(const float *x, const float *signs, const float *levels, const float *bounds, int64_t D,
                      uint8_t *codes, int64_t step, float *scale, float *ring_row) {
    float y[512];
    uint8_t c[512];
    tq_rotate(x, signs, D, 0, y);
    memcpy(ring_row, y, D * sizeof(float));
    float nrm = 0.f, lsq = 0.f;
    for (int64_t i = 0; i < D; i++) nrm += y[i] * y[i];
    nrm = sqrtf(nrm);
    const float unit = sqrtf((float)D) / fmaxf(nrm, 1e-30f);
    for (int64_t i = 0; i < D; i++) {
        const float yn = y[i] * unit;
        int code = 0;
        while (code < 15 && yn > bounds[code]) code++;  /* the boundaries are sorted: bucketize */
        c[i] = (uint8_t)code;
        lsq += levels[code] * levels[code];
    }
    for (int64_t i = 0; i < D / 2; i++) codes[i * step] = (uint8_t)(c[i] | (c[i + D / 2] << 4));
    *scale = nrm / fmaxf(sqrtf(lsq), 1e-30f);
}

/* A whole TurboQuant decode step of one sequence and layer: append the new k, v [Hkv, D] at slot `pos` (or
 * pos % cap when `ring`) and ring slot pos % R, attend q [Hq, D] over positions first..pos, out [Hq, D] (all
 * unrotated, fp32). */
static void tq_decode_step(const float *q, const float *kn, const float *vn, const float *signs,
                           const float *levels, const float *bounds, uint8_t *kc, float *ks, uint8_t *vc, float *vs,
                           float *kr, float *vr, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t R,
                           int64_t first, int64_t pos, int32_t ring, float scale, float *out) {
    const int64_t slot = ring ? pos % cap : pos, rslot = pos % R;
    for (int64_t j = 0; j < Hkv; j++) {
        tq_append(kn + j * D, signs, levels, bounds, D, kc + tq_code_offset(j, slot, cap, D / 2, 0), tq_step(0),
                  ks + j * cap + slot, kr + (j * R + rslot) * D);
        tq_append(vn + j * D, signs, levels, bounds, D, vc + tq_code_offset(j, slot, cap, D / 2, 1), tq_step(1),
                  vs + j * cap + slot, vr + (j * R + rslot) * D);
    }
    float *qr = (float *)malloc(2 * Hq * D * sizeof(float)), *orot = qr + Hq * D;
    for (int64_t h = 0; h < Hq; h++) tq_rotate(q + h * D, signs, D, 0, qr + h * D);
    tq_attn_decode(qr, kc, ks, vc, vs, kr, vr, levels, Hq, Hkv, D, cap, R, first, pos, ring, scale, orot);
    for (int64_t h = 0; h < Hq; h++) tq_rotate(orot + h * D, signs, D, 1, out + h * D);
    free(qr);
}

/* tq_decode_step for B sequences at the same position: q [B, Hq, D], k, v [B, Hkv, D], the caches [B, Hkv, ...],
 * out [B, Hq, D], all contiguous. */
void tq_decode_steps(const float *q, const float *kn, const float *vn, const float *signs, const float *levels,
                     const float *bounds, uint8_t *kc, float *ks, uint8_t *vc, float *vs, float *kr, float *vr,
                     int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t R, int64_t first,
                     int64_t pos, int32_t ring, float scale, float *out) {
    for (int64_t b = 0; b < B; b++)
        tq_decode_step(q + b * Hq * D, kn + b * Hkv * D, vn + b * Hkv * D, signs, levels, bounds,
                       kc + b * Hkv * cap * (D / 2), ks + b * Hkv * cap, vc + b * Hkv * cap * (D / 2),
                       vs + b * Hkv * cap, kr + b * Hkv * R * D, vr + b * Hkv * R * D, Hq, Hkv, D, cap, R, first,
                       pos, ring, scale, out + b * Hq * D);
}
