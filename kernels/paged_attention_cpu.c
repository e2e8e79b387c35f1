/* Decode attention over the paged KV cache, in C for the CPU (chapter 07, "On a CPU").
 *
 * The same function as kernels.reference.paged_attention and the Triton kernel
 * in paged_attention.py: each sequence brings one query token, which attends
 * over the sequence's context, read from the cache in place through its block
 * table. Where the torch backend copies a sequence's blocks out of the cache
 * (index_select) before PyTorch's attention can run on them, this loop reads
 * each key and value row where it lies, once, for every query head of its
 * grouped-query group -- what vLLM's CPU backend does in C++.
 *
 * Per (sequence, KV head), two passes over the context:
 *   1. scores[g][j] = scale * (q_g . k_j) for the group's query heads g;
 *   2. softmax over j for each g, then out_g = sum_j p[g][j] * v_j.
 * Everything is float32 (the caller converts), the layout the engine uses:
 *   query, out   [num_seqs, num_q_heads, head_dim]            contiguous
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]  contiguous
 *   block_tables [num_seqs, table_width] int32, seq_lens [num_seqs] int32.
 * With a sliding window W > 0, only the last W positions are read.
 *
 * Returns 0, or a negative code (nothing trusted is read past it) when a
 * sequence length or a block id would read outside the tables or the cache:
 * the Python wrapper turns it into a ValueError that names the problem.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    OK = 0,
    BAD_SEQ_LEN = -1,  /* a seq_len < 1, or more positions than its block-table row holds */
    BAD_BLOCK_ID = -2, /* a block id outside [0, num_blocks) */
    NO_MEMORY = -3,
};

/* One sequence: its num_q_heads = num_kv_heads * group query heads (at q) attend over the n
 * positions from `start`; results to o. Token by token, every head of a cached row is used
 * while the row is in the cache, so the cache is read front to back. Inlined into each call
 * below with head_dim a constant where it is a common size, so that the compiler unrolls and
 * vectorises the rows completely. */
static inline __attribute__((always_inline)) void attend_sequence(
    float *o, const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t start,
    int64_t n, int64_t num_kv_heads, int64_t group, const int64_t head_dim, int64_t block_size, float scale,
    float *scores, float *inv_sum) {
    const int64_t num_q_heads = num_kv_heads * group, row_stride = num_kv_heads * head_dim;
    /* 1. Scores: scores[qh][j] = scale * (q_qh . k_j), query head qh reading KV head qh / group. */
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = start + j;
        const float *k_row = k_cache + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row_stride;
        for (int64_t qh = 0; qh < num_q_heads; qh++) {
            const float *k = k_row + (qh / group) * head_dim, *qv = q + qh * head_dim;
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dot += qv[d] * k[d];
            scores[qh * n + j] = dot * scale;
        }
    }
    /* 2. Softmax per query head (minus its max, so no exp overflows), then the weighted values. */
    for (int64_t qh = 0; qh < num_q_heads; qh++) {
        float *row = scores + qh * n;
        float max = row[0];
        for (int64_t j = 1; j < n; j++) max = row[j] > max ? row[j] : max;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            row[j] = expf(row[j] - max);
            sum += row[j];
        }
        inv_sum[qh] = 1.0f / sum;
    }
    memset(o, 0, sizeof(float) * (size_t)(num_q_heads * head_dim));
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = start + j;
        const float *v_row = v_cache + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row_stride;
        for (int64_t qh = 0; qh < num_q_heads; qh++) {
            const float p = scores[qh * n + j], *v = v_row + (qh / group) * head_dim;
            float *oh = o + qh * head_dim;
            for (int64_t d = 0; d < head_dim; d++) oh[d] += p * v[d];
        }
    }
    for (int64_t qh = 0; qh < num_q_heads; qh++)
        for (int64_t d = 0; d < head_dim; d++) o[qh * head_dim + d] *= inv_sum[qh];
}

int paged_attention_f32(float *out, const float *query, const float *k_cache, const float *v_cache,
                        const int32_t *block_tables, const int32_t *seq_lens, int64_t num_seqs,
                        int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                        int64_t block_size, int64_t table_width, int64_t sliding_window, float scale,
                        int64_t *bad_seq) {
    const int64_t group = num_q_heads / num_kv_heads; /* query heads per KV head */

    /* Check every sequence first, so that a bad one leaves `out` untouched. */
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t seq_len = seq_lens[s];
        *bad_seq = s;
        if (seq_len < 1 || (seq_len + block_size - 1) / block_size > table_width) return BAD_SEQ_LEN;
        const int64_t start = (sliding_window > 0 && seq_len > sliding_window) ? seq_len - sliding_window : 0;
        for (int64_t b = start / block_size; b <= (seq_len - 1) / block_size; b++) {
            const int32_t block = block_tables[s * table_width + b];
            if (block < 0 || block >= num_blocks) return BAD_BLOCK_ID;
        }
        if (seq_len - start > longest) longest = seq_len - start;
    }
    if (longest == 0) return OK; /* no sequences: nothing to do */
    /* Working memory on the heap (any number of heads): the scores, then 1 / sum per query head. */
    float *scores = malloc(sizeof(float) * (size_t)(num_q_heads * (longest + 1)));
    if (scores == NULL) return NO_MEMORY;
    float *inv_sum = scores + num_q_heads * longest;

    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t seq_len = seq_lens[s];
        const int64_t start = (sliding_window > 0 && seq_len > sliding_window) ? seq_len - sliding_window : 0;
        const int32_t *table = block_tables + s * table_width;
        float *o = out + s * num_q_heads * head_dim;
        const float *q = query + s * num_q_heads * head_dim;
#define ATTEND(dim) \
    attend_sequence(o, q, k_cache, v_cache, table, start, seq_len - start, num_kv_heads, group, dim, block_size, scale, scores, inv_sum)
        if (head_dim == 64)
            ATTEND(64);
        else if (head_dim == 128)
            ATTEND(128);
        else
            ATTEND(head_dim);
#undef ATTEND
    }
    free(scores);
    return OK;
}
