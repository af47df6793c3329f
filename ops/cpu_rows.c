/* Small-shape CPU kernel of the AttnRes ops (ops/cpu_native.py builds and calls it).
 *
 * The same computation as ops/cpu.py (docs/design.md section 3), one row at a time, in
 * one call: at decode sizes the torch path's dozen ATen calls cost more than the
 * arithmetic. Per row: the delta add (fp32, one rounding, written back into prefix), the
 * block write, the sources (fp32 ones read where they lie, 16-bit ones upcast once into an
 * fp32 stage), RMS-normed query logits, the softmax over depth, the weighted sum, the
 * optional output RMSNorm. Accumulation is
 * fp32; each output is rounded to the dtype once. Reductions keep eight partial sums.
 *
 * Tensors: the last dimension contiguous; row strides in elements. dtype: 0 fp32,
 * 1 bf16, 2 fp16. Returns 0, or -1 when scratch memory cannot be allocated.
 *
 * Python calls the one exported function, kimi_attn_res_rows_call, with the arguments
 * packed into one struct (kimi_rows_call; ops/cpu_native.py packs it with struct.Struct):
 * ctypes converts each argument of a call separately, so one buffer costs a fraction of
 * what 21 arguments do (docs/design.md section 9).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Every helper is inlined into the row loop, so each copy of the loop (attn_res_rows, per
 * dtype and target) compiles them with its dtype a constant and for its own target. */
#define INLINE static inline __attribute__((always_inline))

/* Four fp32 lanes: one SSE register (GCC's vector extension; x86-64's baseline). */
typedef float v4 __attribute__((vector_size(16)));

INLINE v4 load4(const float *p) {
    v4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE float hsum(v4 a, v4 b) {
    v4 v = a + b;
    return (v[0] + v[1]) + (v[2] + v[3]);
}

INLINE float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

INLINE void to_f32(int dtype, const void *restrict src, float *restrict dst, int64_t H) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)H * sizeof(float));
    } else if (dtype == 1) {
        const uint16_t *s = src;
        for (int64_t h = 0; h < H; h++) dst[h] = bf16_to_f32(s[h]);
    } else {
        const _Float16 *s = src;
        for (int64_t h = 0; h < H; h++) dst[h] = (float)s[h];
    }
}

INLINE void from_f32(int dtype, const float *restrict src, void *restrict dst, int64_t H) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)H * sizeof(float));
    } else if (dtype == 1) {
        uint16_t *d = dst;
        for (int64_t h = 0; h < H; h++) d[h] = f32_to_bf16(src[h]);
    } else {
        _Float16 *d = dst;
        for (int64_t h = 0; h < H; h++) d[h] = (_Float16)src[h];
    }
}

/* dot(a, b) and dot(a, a), eight partial sums each (two registers), then the tail. */
INLINE void dot2(const float *restrict a, const float *restrict b, int64_t H, float *ab,
                 float *aa) {
    v4 s0 = {0}, s1 = {0}, q0 = {0}, q1 = {0};
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
        v4 x0 = load4(a + h), x1 = load4(a + h + 4);
        s0 += x0 * load4(b + h);
        s1 += x1 * load4(b + h + 4);
        q0 += x0 * x0;
        q1 += x1 * x1;
    }
    float ts = hsum(s0, s1), tq = hsum(q0, q1);
    for (; h < H; h++) {
        ts += a[h] * b[h];
        tq += a[h] * a[h];
    }
    *ab = ts;
    *aa = tq;
}

/* One call's arguments: integers and addresses as int64 (0 for an absent tensor), then the
 * two epsilons. ops/cpu_native.py's _CALL packs this layout. */
typedef struct {
    int64_t dtype, T, H, num_blocks, block_write_idx;
    int64_t prefix, prefix_rs, delta, delta_rs, blocks, blocks_rs, blocks_ss;
    int64_t norm_weight, qk_weight, onw;
    double eps, oeps;
    int64_t out, out_rs, mixed, mixed_rs;
} kimi_rows_call;

_Static_assert(sizeof(void *) == sizeof(int64_t), "addresses are packed as int64");

#define PTR(a) ((void *)(intptr_t)(a))

/* On x86-64 with glibc, an AVX2 copy of the row loop beside the baseline one, picked at
 * load time (an ifunc) where the CPU has AVX2: the loops GCC widens take twice the lanes
 * (docs/design.md section 9 has the figures). The same bits either way
 * (tests/test_cpu_native.py): AVX2 alone brings no FMA (GCC contracts a*b+c only for a
 * target that has one), the reductions are written with v4, and the loops GCC widens are
 * elementwise. -DKIMI_ROWS_BASELINE builds the baseline alone. */
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(KIMI_ROWS_BASELINE) && \
    defined(__has_attribute)
#if __has_attribute(target_clones) /* GCC 6+, clang 14+ */
#define ROWS_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef ROWS_CLONES
#define ROWS_CLONES
#endif

INLINE int rows(const int dtype, const kimi_rows_call *c) {
    const int64_t T = c->T, H = c->H, num_blocks = c->num_blocks;
    const int64_t block_write_idx = c->block_write_idx, prefix_rs = c->prefix_rs;
    const int64_t delta_rs = c->delta_rs, blocks_rs = c->blocks_rs, blocks_ss = c->blocks_ss;
    const int64_t out_rs = c->out_rs, mixed_rs = c->mixed_rs;
    void *prefix = PTR(c->prefix), *blocks = PTR(c->blocks), *out = PTR(c->out);
    void *mixed = PTR(c->mixed);
    const void *delta = PTR(c->delta), *norm_weight = PTR(c->norm_weight);
    const void *qk_weight = PTR(c->qk_weight), *onw = PTR(c->onw);
    const int64_t n = num_blocks + 1, es = dtype == 0 ? 4 : 2;
    const int64_t staged = dtype == 0 ? 0 : n; /* fp32 sources need no stage */
    const float feps = (float)c->eps, foeps = (float)c->oeps, fH = (float)H;
    /* scratch: src [n] pointers; w, onw, m, tmp [H] each; stage [staged, H]; logits [n] */
    const float **src =
        malloc(sizeof(float *) * (size_t)n + sizeof(float) * (size_t)(H * (staged + 4) + n));
    if (!src) return -1;
    float *w = (float *)(src + n);
    float *on = w + H, *m = on + H, *tmp = m + H, *stage = tmp + H, *lg = stage + staged * H;
    to_f32(dtype, norm_weight, tmp, H);
    to_f32(dtype, qk_weight, w, H);
    for (int64_t h = 0; h < H; h++) w[h] *= tmp[h]; /* the folded query, rounded to fp32 */
    if (onw) to_f32(dtype, onw, on, H);

    for (int64_t t = 0; t < T; t++) {
        char *x = (char *)prefix + t * prefix_rs * es;
        /* fp32 sources are read where they lie; 16-bit ones are upcast into the stage once.
         * The prefix is the last source. */
        float *xs;
        if (dtype == 0) {
            float *xf = (float *)x;
            if (delta) { /* the rounded sum, written back, is what is mixed */
                const float *d = (const float *)((const char *)delta + t * delta_rs * es);
                for (int64_t h = 0; h < H; h++) xf[h] += d[h];
            }
            xs = xf;
        } else {
            xs = stage + num_blocks * H;
            to_f32(dtype, x, xs, H);
            if (delta) { /* fp32 add, one rounding, written back; the rounded sum is mixed */
                to_f32(dtype, (const char *)delta + t * delta_rs * es, tmp, H);
                for (int64_t h = 0; h < H; h++) tmp[h] += xs[h];
                from_f32(dtype, tmp, x, H);
                to_f32(dtype, x, xs, H);
            }
        }
        src[num_blocks] = xs;
        char *brow = (char *)blocks + t * blocks_rs * es;
        if (block_write_idx >= 0)
            memcpy(brow + block_write_idx * blocks_ss * es, x, (size_t)(H * es));
        const float *mix = xs; /* a single source gets softmax weight 1 */
        if (num_blocks > 0) {
            if (dtype == 0) {
                for (int64_t j = 0; j < num_blocks; j++)
                    src[j] = (const float *)(brow + j * blocks_ss * es);
            } else {
                for (int64_t j = 0; j < num_blocks; j++) {
                    to_f32(dtype, brow + j * blocks_ss * es, stage + j * H, H);
                    src[j] = stage + j * H;
                }
            }
            float top = -INFINITY, total = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                float dot, sq;
                dot2(src[j], w, H, &dot, &sq);
                lg[j] = dot * (1.0f / sqrtf(sq / fH + feps));
                top = lg[j] > top ? lg[j] : top;
            }
            for (int64_t j = 0; j < n; j++) {
                lg[j] = expf(lg[j] - top);
                total += lg[j];
            }
            memset(m, 0, (size_t)H * sizeof(float));
            for (int64_t j = 0; j < n; j++) {
                const float p = lg[j] / total, *restrict v = src[j];
                for (int64_t h = 0; h < H; h++) m[h] += p * v[h];
            }
            mix = m;
        }
        if (mixed) from_f32(dtype, mix, (char *)mixed + t * mixed_rs * es, H);
        char *o = (char *)out + t * out_rs * es;
        if (!onw) {
            from_f32(dtype, mix, o, H);
            continue;
        }
        float unused, sq;
        dot2(mix, mix, H, &unused, &sq);
        const float r = 1.0f / sqrtf(sq / fH + foeps);
        for (int64_t h = 0; h < H; h++) tmp[h] = (mix[h] * r) * on[h];
        from_f32(dtype, tmp, o, H);
    }
    free(src);
    return 0;
}

/* One copy of the row loop per dtype (the dtype a constant in each), in each target's copy. */
ROWS_CLONES
static int attn_res_rows(const kimi_rows_call *c) {
    switch (c->dtype) {
    case 0: return rows(0, c);
    case 1: return rows(1, c);
    default: return rows(2, c);
    }
}

int kimi_attn_res_rows_call(const void *packed) {
    kimi_rows_call c;
    memcpy(&c, packed, sizeof c); /* the caller's buffer (a bytes object) may be unaligned */
    return attn_res_rows(&c);
}
