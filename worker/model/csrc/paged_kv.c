/* Kernels over the paged KV cache (float32, CPU), called through ctypes (worker/model/cpu_kernels.py).
 *
 * disagg_paged_decode_attention: decode attention, one query token per sequence, its keys and values
 * read in place from the cache's blocks, with no gathered copy of them.
 * disagg_write_kv_rows: the step's new K and V rows stored at their slots (torch's index_copy_
 * managed ~1 row per microsecond; this is a memcpy per row).
 * disagg_prefill_attention, disagg_paged_prefill_attention: causal attention of every prompt chunk of a
 * step in one call (flash attention's tiling and online softmax, see below), where torch's SDPA took a
 * call per sequence and had no way to read a cached prefix in place.
 *
 * Cache layout (see worker/kv_transfer/base.py): (num_blocks, num_layers, 2, block_size, n_kv, head_dim),
 * contiguous. For block b, layer l, K/V row of offset o and kv head h:
 *     cache + b * block_stride + layer_offset + [0 | v_offset] + (o * n_kv + h) * head_dim
 * q and out: (B, n_kv * group, head_dim) contiguous; query heads h * group .. h * group + group - 1
 * share kv head h (grouped-query attention). Work items are sequences, shared out among
 * the OpenMP threads of the process (the runtime torch already loaded, so its thread pool).
 * Softmax is exact (max-subtracted, two passes): each K and V row is read once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_Q 8192  /* heads * head_dim: 32 KiB per buffer on the stack */

/* q heads per sequence and head size this build handles (its per-sequence buffers live on the stack) */
int disagg_paged_decode_attention_limits(int64_t heads, int64_t head_dim) {
    return heads >= 1 && heads <= MAX_HEADS && head_dim >= 1 && head_dim <= MAX_HEAD_DIM
           && heads * head_dim <= MAX_Q;
}

/* Prefetch the row that the same offset of the next block holds: a block's rows of one layer are
 * contiguous (block_size * n_kv * head_dim floats), but consecutive blocks of a sequence need not be,
 * which the hardware prefetcher cannot guess. */
static inline void prefetch_row(const float *row, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i, 0, 1);
}

/* Block j of a sequence's table: its K (offset layer_offset) or V (plus v_offset) rows, and in *next the
 * same rows of block j + 1 (NULL after the last) for prefetch_row. */
static inline const float *seq_block(const float *cache, const int64_t *table, int64_t j, int64_t n_blocks,
                                     int64_t block_stride, int64_t offset, const float **next) {
    *next = j + 1 < n_blocks ? cache + table[j + 1] * block_stride + offset : NULL;
    return cache + table[j] * block_stride + offset;
}

int disagg_paged_decode_attention(
    const float *q, const float *cache, const int64_t *block_tables, int64_t max_blocks,
    const int64_t *seq_lens, int64_t batch, int64_t n_kv, int64_t group, int64_t head_dim,
    int64_t block_size, int64_t block_stride, int64_t layer_offset, int64_t v_offset, float scale,
    float *out)
{
    const int64_t heads = n_kv * group;
    if (!disagg_paged_decode_attention_limits(heads, head_dim)) return 1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * block_size) return 2;
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    int failed = 0;
    const int64_t row = n_kv * head_dim;  /* one offset's K (or V) of every kv head, contiguous */
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len * heads));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 3;
        }
        /* one sequence per item: each position's row of all kv heads is read whole, so a block's
         * K (then V) is one contiguous stretch of memory */
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            if (scores == NULL) continue;
            const int64_t len = seq_lens[b];
            const int64_t *table = block_tables + b * max_blocks;
            const int64_t n_blocks = (len + block_size - 1) / block_size;
            float qs[MAX_Q];
            const float *qb = q + b * heads * head_dim;
            for (int64_t i = 0; i < heads * head_dim; i++) qs[i] = qb[i] * scale;
            /* pass 1: scores[(h * group + g) * len + p] = q_hg . k_hp */
            for (int64_t j = 0; j < n_blocks; j++) {
                const float *next;
                const float *kb = seq_block(cache, table, j, n_blocks, block_stride, layer_offset, &next);
                const int64_t p0 = j * block_size, n = len - p0 < block_size ? len - p0 : block_size;
                for (int64_t o = 0; o < n; o++) {
                    if (next != NULL) prefetch_row(next + o * row, row);
                    for (int64_t h = 0; h < n_kv; h++) {
                        const float *k = kb + o * row + h * head_dim;
                        for (int64_t g = 0; g < group; g++) {
                            const float *qg = qs + (h * group + g) * head_dim;
                            float s = 0.f;
                            for (int64_t d = 0; d < head_dim; d++) s += qg[d] * k[d];
                            scores[(h * group + g) * len + p0 + o] = s;
                        }
                    }
                }
            }
            /* softmax per query head */
            float inv_sum[MAX_HEADS];
            for (int64_t hg = 0; hg < heads; hg++) {
                float *sg = scores + hg * len, m = sg[0], sum = 0.f;
                for (int64_t p = 1; p < len; p++) m = sg[p] > m ? sg[p] : m;
                for (int64_t p = 0; p < len; p++) { sg[p] = expf(sg[p] - m); sum += sg[p]; }
                inv_sum[hg] = 1.f / sum;
            }
            /* pass 2: out_hg = sum_p w_hgp v_hp */
            float acc[MAX_Q];
            memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
            for (int64_t j = 0; j < n_blocks; j++) {
                const float *next;
                const float *vb = seq_block(cache, table, j, n_blocks, block_stride, layer_offset + v_offset, &next);
                const int64_t p0 = j * block_size, n = len - p0 < block_size ? len - p0 : block_size;
                for (int64_t o = 0; o < n; o++) {
                    if (next != NULL) prefetch_row(next + o * row, row);
                    for (int64_t h = 0; h < n_kv; h++) {
                        const float *v = vb + o * row + h * head_dim;
                        for (int64_t g = 0; g < group; g++) {
                            const float w = scores[(h * group + g) * len + p0 + o];
                            float *ag = acc + (h * group + g) * head_dim;
                            for (int64_t d = 0; d < head_dim; d++) ag[d] += w * v[d];
                        }
                    }
                }
            }
            float *ob = out + b * heads * head_dim;
            for (int64_t hg = 0; hg < heads; hg++)
                for (int64_t d = 0; d < head_dim; d++) ob[hg * head_dim + d] = acc[hg * head_dim + d] * inv_sum[hg];
        }
        free(scores);
    }
    return failed;
}

/* cache viewed as rows of row_elems floats (total_rows of them); token t's K goes to row k_rows[t]
 * and its V to v_rows[t], read from k + t * k_stride and v + t * v_stride. Returns 2, writing nothing,
 * if a row is out of range. */
int disagg_write_kv_rows(float *cache, int64_t total_rows, int64_t row_elems, const int64_t *k_rows,
                         const int64_t *v_rows, int64_t tokens, const float *k, int64_t k_stride,
                         const float *v, int64_t v_stride)
{
    for (int64_t t = 0; t < tokens; t++)
        if (k_rows[t] < 0 || k_rows[t] >= total_rows || v_rows[t] < 0 || v_rows[t] >= total_rows) return 2;
    const size_t bytes = sizeof(float) * (size_t)row_elems;
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(cache + k_rows[t] * row_elems, k + t * k_stride, bytes);
        memcpy(cache + v_rows[t] * row_elems, v + t * v_stride, bytes);
    }
    return 0;
}

/* x (rows x dim, contiguous) += delta (if not NULL, same shape), then out = weight * (x * rsqrt(mean(x^2) + eps)):
 * the residual add and RMSNorm of a transformer block in one pass over each row instead of six. */
void disagg_add_rms_norm(float *x, const float *delta, const float *weight, float *out, int64_t rows,
                         int64_t dim, float eps)
{
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim, *o = out + r * dim;
        float sum = 0.f;
        if (delta != NULL) {
            const float *dr = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) { xr[i] += dr[i]; sum += xr[i] * xr[i]; }
        } else {
            for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        }
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* Rotate-half rotary embedding: x (tokens, heads, head_dim), token t at x + t * x_stride, its heads
 * contiguous; cos/sin tables (table_len, head_dim / 2); out (tokens, heads, head_dim) contiguous:
 * [x1 * cos - x2 * sin, x2 * cos + x1 * sin] at each token's position. Returns 2, writing nothing,
 * if a position is outside the tables. */
int disagg_rotary(const float *x, int64_t x_stride, const int64_t *positions, const float *cos_table,
                  const float *sin_table, int64_t table_len, float *out, int64_t tokens, int64_t heads,
                  int64_t head_dim)
{
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= table_len) return 2;
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * x_stride + h * head_dim, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * head_dim, *o2 = o1 + half;
            for (int64_t d = 0; d < half; d++) {
                o1[d] = x1[d] * c[d] - x2[d] * s[d];
                o2[d] = x2[d] * c[d] + x1[d] * s[d];
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- prefill attention
 * Causal attention of prompt chunks, grouped-query, many sequences in one call. Token t's query head h is at
 * q + t * q_stride + h * head_dim; sequence s is the chunk of tokens starts[s] .. starts[s] + lens[s] - 1, at
 * positions ctx_lens[s] .. of its sequence (0 without ctx_lens), and sees keys 0 .. its own position. out
 * (tokens, n_kv * group, head_dim) contiguous, indexed by the same token numbers. Keys and values come from
 *   disagg_prefill_attention: the chunk's own K/V (nothing cached before it): token t's kv head g at
 *     k + t * k_stride + g * head_dim and v + t * v_stride + g * head_dim (views of the fused QKV output);
 *   disagg_paged_prefill_attention: the KV cache's blocks (its cached prefix and the chunk, already written),
 *     sequence s's block table at block_tables + s * max_blocks, laid out as disagg_paged_decode_attention's.
 *
 * Work items are (sequence, kv head, tile of query positions); a tile's rows are its positions times the
 * group's query heads, which share every K and V row they read. Keys go by blocks of PF_BK, softmax online
 * (flash attention's running max and sum), so each key and value row is read once per tile. The two
 * products are register-blocked over four rows: four accumulators of 16 floats per row, each K^T or V
 * vector loaded once for the four. head_dim must be a multiple of 64. */
#define PF_BK 64
#define PF_ROWS 64  /* rows per tile (positions x group) */
#define PF_NEG (-1e30f)  /* a masked score: finite, as -ffast-math assumes */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
/* Four vectors loaded once, each used by four rows' FMAs: without this GCC folds the load into every FMA
 * (sixteen loads where four do), and the loop waits on the load ports instead of the FMA units. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__AVX512F__)  /* a v16 is one zmm register */
#define PF_IN_REGISTERS(a, b, c, d) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))
#else
#define PF_IN_REGISTERS(a, b, c, d) ((void)0)
#endif

int disagg_prefill_attention_limits(int64_t group, int64_t head_dim) {
    return group >= 1 && group <= PF_ROWS && head_dim >= 64 && head_dim <= MAX_HEAD_DIM && head_dim % 64 == 0;
}

/* Where key (kv = 0) or value (kv = 1) rows live: the chunk's own (cache == NULL) or the paged cache. */
struct pf_src {
    const float *k, *v;
    int64_t k_stride, v_stride;
    const float *cache;
    const int64_t *tables;
    int64_t max_blocks, block_size, block_stride, layer_offset, v_offset, n_kv;
};

/* row of position p (of sequence s, whose chunk starts at token `base` at position ctx) of kv head g */
static inline const float *pf_row(const struct pf_src *src, int64_t s, int64_t base, int64_t ctx, int64_t p,
                                  int64_t g, int64_t d, int kv) {
    if (src->cache == NULL)
        return kv ? src->v + (base + p - ctx) * src->v_stride + g * d : src->k + (base + p - ctx) * src->k_stride + g * d;
    const int64_t block = src->tables[s * src->max_blocks + p / src->block_size], o = p % src->block_size;
    return src->cache + block * src->block_stride + src->layer_offset + (kv ? src->v_offset : 0)
           + (o * src->n_kv + g) * d;
}

/* s (rows x PF_BK) = q (rows x d, pre-scaled) . kt (d x PF_BK) */
static void pf_scores(const float *q, const float *kt, int64_t rows, int64_t d, float *s) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        v16 a[4][4] = {{0}};
        const float *q0 = q + r * d;
        for (int64_t i = 0; i < d; i++) {
            v16 k0 = *(const v16u *)(kt + i * PF_BK), k1 = *(const v16u *)(kt + i * PF_BK + 16),
                k2 = *(const v16u *)(kt + i * PF_BK + 32), k3 = *(const v16u *)(kt + i * PF_BK + 48);
            PF_IN_REGISTERS(k0, k1, k2, k3);
            for (int rr = 0; rr < 4; rr++) {
                const float x = q0[rr * d + i];
                a[rr][0] += x * k0; a[rr][1] += x * k1; a[rr][2] += x * k2; a[rr][3] += x * k3;
            }
        }
        for (int rr = 0; rr < 4; rr++)
            for (int c = 0; c < 4; c++) *(v16u *)(s + (r + rr) * PF_BK + c * 16) = a[rr][c];
    }
    for (; r < rows; r++) {
        v16 a[4] = {0};
        for (int64_t i = 0; i < d; i++) {
            const float x = q[r * d + i];
            for (int c = 0; c < 4; c++) a[c] += x * *(const v16u *)(kt + i * PF_BK + c * 16);
        }
        for (int c = 0; c < 4; c++) *(v16u *)(s + r * PF_BK + c * 16) = a[c];
    }
}

/* o (rows x d) += p (rows x PF_BK, the first n columns) . the n value rows at vr[0 .. n - 1] */
static void pf_values(const float *p, const float *const *vr, int64_t n, int64_t rows, int64_t d, float *o) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) {
            v16 a[4][4];
            for (int rr = 0; rr < 4; rr++)
                for (int c = 0; c < 4; c++) a[rr][c] = *(const v16u *)(o + (r + rr) * d + c0 + c * 16);
            for (int64_t j = 0; j < n; j++) {
                const float *vj = vr[j] + c0;
                v16 x0 = *(const v16u *)vj, x1 = *(const v16u *)(vj + 16), x2 = *(const v16u *)(vj + 32),
                    x3 = *(const v16u *)(vj + 48);
                PF_IN_REGISTERS(x0, x1, x2, x3);
                for (int rr = 0; rr < 4; rr++) {
                    const float w = p[(r + rr) * PF_BK + j];
                    a[rr][0] += w * x0; a[rr][1] += w * x1; a[rr][2] += w * x2; a[rr][3] += w * x3;
                }
            }
            for (int rr = 0; rr < 4; rr++)
                for (int c = 0; c < 4; c++) *(v16u *)(o + (r + rr) * d + c0 + c * 16) = a[rr][c];
        }
        for (; r < rows; r++) {
            v16 a[4];
            for (int c = 0; c < 4; c++) a[c] = *(const v16u *)(o + r * d + c0 + c * 16);
            for (int64_t j = 0; j < n; j++) {
                const float w = p[r * PF_BK + j];
                for (int c = 0; c < 4; c++) a[c] += w * *(const v16u *)(vr[j] + c0 + c * 16);
            }
            for (int c = 0; c < 4; c++) *(v16u *)(o + r * d + c0 + c * 16) = a[c];
        }
    }
}

static int pf_run(const float *q, int64_t q_stride, const struct pf_src *src, const int64_t *starts,
                  const int64_t *lens, const int64_t *ctx_lens, int64_t n_seq, int64_t n_kv, int64_t group,
                  int64_t head_dim, float scale, float *out)
{
    if (!disagg_prefill_attention_limits(group, head_dim)) return 1;
    const int64_t d = head_dim, heads = n_kv * group, tile = PF_ROWS / group;  /* positions per tile */
    int64_t n_items = 0;
    for (int64_t s = 0; s < n_seq; s++) {
        const int64_t ctx = ctx_lens != NULL ? ctx_lens[s] : 0;
        if (lens[s] < 0 || starts[s] < 0 || ctx < 0) return 2;
        if (src->cache != NULL && ctx + lens[s] > src->max_blocks * src->block_size) return 2;
        n_items += n_kv * ((lens[s] + tile - 1) / tile);
    }
    int64_t *items = malloc(sizeof(int64_t) * 3 * (size_t)(n_items > 0 ? n_items : 1));
    if (items == NULL) return 3;
    int64_t n = 0;
    for (int64_t s = 0; s < n_seq; s++)  /* the last tiles see the most keys: they go first */
        for (int64_t t0 = ((lens[s] + tile - 1) / tile - 1) * tile; t0 >= 0; t0 -= tile)
            for (int64_t g = 0; g < n_kv; g++) { items[3 * n] = s; items[3 * n + 1] = g; items[3 * n + 2] = t0; n++; }
    int failed = 0;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * (size_t)(2 * PF_ROWS * d + PF_ROWS * PF_BK + d * PF_BK + 2 * PF_ROWS));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 3;
        }
        float *qt = buf, *o = qt + PF_ROWS * d, *sc = o + PF_ROWS * d, *kt = sc + PF_ROWS * PF_BK;
        float *m = kt + d * PF_BK, *l = m + PF_ROWS;
        const float *vr[PF_BK];
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; it++) {
            if (buf == NULL) continue;
            const int64_t s = items[3 * it], g = items[3 * it + 1], t0 = items[3 * it + 2];
            const int64_t base = starts[s], ctx = ctx_lens != NULL ? ctx_lens[s] : 0;
            const int64_t npos = lens[s] - t0 < tile ? lens[s] - t0 : tile, rows = npos * group;
            /* row r = position i * group + head j of the group, its query pre-scaled */
            for (int64_t i = 0; i < npos; i++)
                for (int64_t j = 0; j < group; j++) {
                    const float *from = q + (base + t0 + i) * q_stride + (g * group + j) * d;
                    float *to = qt + (i * group + j) * d;
                    for (int64_t x = 0; x < d; x++) to[x] = from[x] * scale;
                }
            memset(o, 0, sizeof(float) * (size_t)(rows * d));
            for (int64_t r = 0; r < rows; r++) { m[r] = PF_NEG; l[r] = 0.f; }
            const int64_t keys = ctx + t0 + npos;  /* the tile's last position sees keys 0 .. keys - 1 */
            for (int64_t k0 = 0; k0 < keys; k0 += PF_BK) {
                const int64_t nk = keys - k0 < PF_BK ? keys - k0 : PF_BK;
                for (int64_t j = 0; j < PF_BK; j++) {  /* K block, transposed; zeros past the last key */
                    if (j < nk) {
                        const float *kr = pf_row(src, s, base, ctx, k0 + j, g, d, 0);
                        for (int64_t x = 0; x < d; x++) kt[x * PF_BK + j] = kr[x];
                        vr[j] = pf_row(src, s, base, ctx, k0 + j, g, d, 1);
                    } else {
                        for (int64_t x = 0; x < d; x++) kt[x * PF_BK + j] = 0.f;
                    }
                }
                pf_scores(qt, kt, rows, d, sc);
                for (int64_t r = 0; r < rows; r++) {
                    float *sr = sc + r * PF_BK;
                    const int64_t visible = ctx + t0 + r / group - k0 + 1;  /* keys k0 .. its position */
                    const int64_t upto = visible < nk ? visible : nk;
                    float mx = m[r];
                    for (int64_t j = 0; j < upto; j++) mx = sr[j] > mx ? sr[j] : mx;
                    const float alpha = expf(m[r] - mx);
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < PF_BK; j++) {
                        const float e = j < upto ? expf(sr[j] - mx) : 0.f;
                        sr[j] = e;
                        sum += e;
                    }
                    l[r] = l[r] * alpha + sum;
                    m[r] = mx;
                    if (alpha != 1.f)
                        for (int64_t x = 0; x < d; x++) o[r * d + x] *= alpha;
                }
                pf_values(sc, vr, nk, rows, d, o);
            }
            for (int64_t i = 0; i < npos; i++)
                for (int64_t j = 0; j < group; j++) {
                    const int64_t r = i * group + j;
                    const float inv = 1.f / l[r];
                    float *to = out + ((base + t0 + i) * heads + g * group + j) * d;
                    for (int64_t x = 0; x < d; x++) to[x] = o[r * d + x] * inv;
                }
        }
        free(buf);
    }
    free(items);
    return failed;
}

int disagg_prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                             int64_t v_stride, const int64_t *starts, const int64_t *lens, int64_t n_seq,
                             int64_t n_kv, int64_t group, int64_t head_dim, float scale, float *out)
{
    const struct pf_src src = {k, v, k_stride, v_stride, NULL, NULL, 0, 0, 0, 0, 0, n_kv};
    return pf_run(q, q_stride, &src, starts, lens, NULL, n_seq, n_kv, group, head_dim, scale, out);
}

int disagg_paged_prefill_attention(const float *q, int64_t q_stride, const float *cache, const int64_t *block_tables,
                                   int64_t max_blocks, int64_t block_size, int64_t block_stride,
                                   int64_t layer_offset, int64_t v_offset, const int64_t *starts,
                                   const int64_t *lens, const int64_t *ctx_lens, int64_t n_seq, int64_t n_kv,
                                   int64_t group, int64_t head_dim, float scale, float *out)
{
    const struct pf_src src = {NULL, NULL, 0, 0, cache, block_tables, max_blocks, block_size, block_stride,
                               layer_offset, v_offset, n_kv};
    return pf_run(q, q_stride, &src, starts, lens, ctx_lens, n_seq, n_kv, group, head_dim, scale, out);
}
