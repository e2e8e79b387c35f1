/* The decoder layer's small operations, each fused into one pass, in C for the CPU (chapter 07).
 *
 * Between its matrix multiplies a decoder layer runs a handful of element-wise
 * operations: RMSNorm (twice), RoPE on the query and key heads, and SwiGLU's
 * silu(gate) * up. In PyTorch each is several calls (RMSNorm
 * alone is pow, mean, add, rsqrt, two multiplies), and in a decode step of a few
 * tokens each call costs more in overhead than in arithmetic. vLLM's CPU backend
 * runs them as fused C++ operations (rms_norm, rotary_embedding, silu_and_mul);
 * these are the same three, one pass over the data each. The readable
 * definitions are mini_vllm/model.py's rms_norm, apply_rotary_pos_emb and
 * silu_and_mul: tests/test_kernels_fused_ops_cpu.py holds these functions to them.
 *
 * And one that is not element-wise: a projection of one to three rows (a decode step
 * of one to three sequences) as plain dot products, one weight row at a time. Such a
 * multiply only streams the weight from memory; on CPUs where MKL's matrix-vector path
 * does not run at the memory's speed (measured on AMD EPYC: benchmarks/README.md),
 * this loop does.
 *
 * Everything is float32, rows contiguous unless a stride is given.
 */

#include <math.h>
#include <stdint.h>

/* One row: out = x / sqrt(mean(x^2) + eps) * weight. */
static inline void rms_norm_row(float *out, const float *x, const float *weight, int64_t dim, float eps) {
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < dim; i++) sum_sq += x[i] * x[i];
    const float inv_rms = 1.0f / sqrtf(sum_sq / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * inv_rms);
}

/* out[r] = rms_norm(x[r]) for each of `rows` rows of `dim`. */
void rms_norm_f32(float *out, const float *x, const float *weight, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) rms_norm_row(out + r * dim, x + r * dim, weight, dim, eps);
}

/* SwiGLU's gate: out[r][i] = silu(gate_up[r][i]) * gate_up[r][inter + i],
 * silu(g) = g / (1 + exp(-g)); gate_up rows are [gate | up], 2 * inter wide.
 * Below g = -88, exp(-g) overflows float32 (exp(88) ~ 1.7e38): PyTorch's formula then
 * divides by infinity and gives 0, but -ffast-math assumes no infinity, so 0 is written
 * out (the exact value there is below 2e-36). */
void silu_and_mul_f32(float *out, const float *gate_up, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float g = gate[i];
            const float silu = g < -88.0f ? 0.0f : g / (1.0f + expf(-g));
            o[i] = silu * up[i];
        }
    }
}

/* RoPE in place, the half-split layout: for each of the `heads` heads of token t (head h
 * at x + t * row_stride + h * head_dim), pair (i, i + D/2) turns by its angle:
 *   x1' = x1 * cos - x2 * sin,  x2' = x2 * cos + x1 * sin,
 * with cos/sin [num_tokens, head_dim] as RotaryEmbedding makes them (the angle of pair i
 * repeated at i + D/2). row_stride lets x be the query and key heads inside the fused
 * qkv projection's output, rotated where they lie. */
void rotary_f32(float *x, const float *cos, const float *sin, int64_t num_tokens, int64_t heads, int64_t head_dim,
                int64_t row_stride) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* y[r] = weight @ x[r] (+ bias) for `rows` rows: weight [out, in] row-major as nn.Linear
 * keeps it, x [rows, in], y [rows, out]. Each weight row is read once and used for every
 * x row while it is in cache; the x rows (a few KB) stay in L1. */
void linear_f32(float *y, const float *x, const float *weight, const float *bias, int64_t rows, int64_t in,
                int64_t out) {
    for (int64_t o = 0; o < out; o++) {
        const float *w = weight + o * in;
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * in;
            float acc = 0.0f;
            for (int64_t i = 0; i < in; i++) acc += w[i] * xr[i];
            y[r * out + o] = bias ? acc + bias[o] : acc;
        }
    }
}
