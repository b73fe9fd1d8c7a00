// One decode step's attention for every row, on AVX2 CPUs (magrpo/speedups/decode_attention.py says
// why and when): the rotary embedding of the row's new query and key, the new key and value
// written into the row's own cache, then softmax attention over the prompt's keys (one copy
// per prompt, shared by its G rows) and the row's own generated ones, as one softmax.
//
// Float32; head_dim a multiple of 8, each key and value row contiguous. Threads: one task
// per (prompt, key/value head) on torch's OpenMP threads (see blocked_matmul.cpp).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd_math.h"

namespace {

constexpr long kKeysPerBlock = 32;  // prompt keys (or values) per block: 8 KB at 64 features

// scores[j] = q . key_j * scale (+ bias[j]) for the n keys at keys + j * stride.
void dot_scores(const float *q, const float *keys, long stride, long n, long dim, float scale,
                const float *bias, float *scores) {
  const __m256 scaled = _mm256_set1_ps(scale);
  long j = 0;
  for (; j + 8 <= n; j += 8) {  // 8 keys at a time: 8 independent FMA chains
    const float *k = keys + j * stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (long c = 0; c < dim; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
      a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + c), a0);
      a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + stride + c), a1);
      a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 2 * stride + c), a2);
      a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 3 * stride + c), a3);
      a4 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 4 * stride + c), a4);
      a5 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 5 * stride + c), a5);
      a6 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 6 * stride + c), a6);
      a7 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 7 * stride + c), a7);
    }
    // the 8 sums side by side: [a0 .. a3 | a0 .. a3] halves, then [a0 .. a7]
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                             _mm256_permute2f128_ps(u0, u1, 0x31));
    s = _mm256_mul_ps(s, scaled);
    if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + j));
    _mm256_storeu_ps(scores + j, s);
  }
  for (; j < n; j++) {
    const float *k = keys + j * stride;
    __m256 a = _mm256_setzero_ps();
    for (long c = 0; c < dim; c += 8)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), a);
    scores[j] = sum_lanes(a) * scale + (bias ? bias[j] : 0.0f);
  }
}

// out[0 : 8V] += sum_j weights[j] * values_j[0 : 8V], the sums in registers (named, not an
// array: GCC stores an array of accumulators back to memory at every key).
template <int V>
void weighted_sum_block(const float *weights, const float *values, long stride, long n,
                        float *out) {
  __m256 a0, a1, a2, a3, a4, a5, a6, a7;
#define LOAD(v) \
  if (V > v) a##v = _mm256_loadu_ps(out + 8 * v);
  LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5) LOAD(6) LOAD(7)
#undef LOAD
  for (long j = 0; j < n; j++) {
    const __m256 w = _mm256_broadcast_ss(weights + j);
    const float *value = values + j * stride;
#define MAC(v) \
  if (V > v) a##v = _mm256_fmadd_ps(w, _mm256_loadu_ps(value + 8 * v), a##v);
    MAC(0) MAC(1) MAC(2) MAC(3) MAC(4) MAC(5) MAC(6) MAC(7)
#undef MAC
  }
#define STORE(v) \
  if (V > v) _mm256_storeu_ps(out + 8 * v, a##v);
  STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
#undef STORE
}

// out[0 : dim] += sum_j weights[j] * values_j, 64 features (8 registers) at a time.
void weighted_sum(const float *weights, const float *values, long stride, long n, long dim,
                  float *out) {
  for (long c = 0; c < dim; c += 64) {
    switch ((std::min(dim - c, 64L)) / 8) {
      case 1: weighted_sum_block<1>(weights, values + c, stride, n, out + c); break;
      case 2: weighted_sum_block<2>(weights, values + c, stride, n, out + c); break;
      case 3: weighted_sum_block<3>(weights, values + c, stride, n, out + c); break;
      case 4: weighted_sum_block<4>(weights, values + c, stride, n, out + c); break;
      case 5: weighted_sum_block<5>(weights, values + c, stride, n, out + c); break;
      case 6: weighted_sum_block<6>(weights, values + c, stride, n, out + c); break;
      case 7: weighted_sum_block<7>(weights, values + c, stride, n, out + c); break;
      default: weighted_sum_block<8>(weights, values + c, stride, n, out + c); break;
    }
  }
}

// Llama's rotary embedding (transformers' rotate_half): out = x * cos + rotate_half(x) * sin,
// rotate_half(x) = [-x[dim/2:], x[:dim/2]].
void rotate(const float *x, const float *cos, const float *sin, long dim, float *out) {
  const long half = dim / 2;
  for (long i = 0; i < half; i++) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
  for (long i = half; i < dim; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// max, then exp(s - max) in place; returns the sum of the exps.
float softmax_numerators(float *scores, long n) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  long j = 0;
  for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float largest = *std::max_element(lanes, lanes + 8);
  for (; j < n; j++) largest = std::max(largest, scores[j]);
  const __m256 shift = _mm256_set1_ps(largest);
  __m256 sums = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
    _mm256_storeu_ps(scores + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  float sum = sum_lanes(sums);
  if (j < n) {  // the tail through a full register: padded with -inf, which gives 0
    alignas(32) float tail[8];
    std::fill(tail, tail + 8, -INFINITY);
    std::copy(scores + j, scores + n, tail);
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(tail), shift));
    _mm256_store_ps(tail, e);
    std::copy(tail, tail + (n - j), scores + j);
    sum += sum_lanes(e);
  }
  return sum;
}

}  // namespace

extern "C" {

// Where one layer's caches are: element strides of [prompt or row, key/value head, token]
// (the feature stride is 1).
struct AttentionCaches {
  const float *k_prompt, *v_prompt;  // [P, KV, W, D]
  long k_prompt_strides[3], v_prompt_strides[3];
  const float *prompt_bias;  // [P, W]: 0 where attended, -inf where not
  long prompt_tokens;        // W
  float *k_own, *v_own;      // [rows, KV, T, D]: each row's generated tokens
  long own_strides[3];
  long rows, group, heads, kv_heads, dim;  // rows = P * group, prompt of row r: r / group
  float scale;
};

// out[r, h * D : (h + 1) * D] = attention of row r's query head h, where projected [rows,
// (H + 2 KV) * D] holds the rows' q, k, v before the rotary embedding (cos, sin: [rows, D])
// and slot is this step's token in the own caches (attended: tokens 0 .. slot).
//
// One task per prompt and key/value head: its queries (the heads that share the key/value
// head, in each of the prompt's rows: 12 for SmolLM2 at G = 4) take each block of prompt
// keys and values in turn while it is in L1, so the prompt's cache is read once per task
// instead of once per query (it does not fit L1: 69 KB per head at 270 tokens).
void decode_attention(const AttentionCaches *c, const float *projected, long ldp,
                      const float *cos, const float *sin, long ldc, long slot, float *out,
                      long ldo) {
  const long dim = c->dim, per_kv = c->heads / c->kv_heads, own = slot + 1;
  const long prompt_tokens = c->prompt_tokens, keys = prompt_tokens + own;
  const long queries = c->group * per_kv, prompts = c->rows / c->group;
  const long *ks = c->k_prompt_strides, *vs = c->v_prompt_strides, *os = c->own_strides;
#pragma omp parallel
  {
    std::vector<float> scratch(queries * (keys + 2 * dim + 1));
    float *scores = scratch.data(), *query = scores + queries * keys, *sums = query + queries * dim;
    float *totals = sums + queries * dim;
#pragma omp for schedule(static)
    for (long task = 0; task < prompts * c->kv_heads; task++) {
      const long p = task / c->kv_heads, g = task % c->kv_heads;
      // the rows' new key and value into their caches; their queries rotated, query
      // q = (row in the prompt) * per_kv + (head in the group)
      for (long m = 0; m < c->group; m++) {
        const long r = p * c->group + m;
        const float *row = projected + r * ldp, *row_cos = cos + r * ldc, *row_sin = sin + r * ldc;
        const long at = r * os[0] + g * os[1] + slot * os[2];
        rotate(row + (c->heads + g) * dim, row_cos, row_sin, dim, c->k_own + at);
        std::memcpy(c->v_own + at, row + (c->heads + c->kv_heads + g) * dim, sizeof(float) * dim);
        for (long i = 0; i < per_kv; i++)
          rotate(row + (g * per_kv + i) * dim, row_cos, row_sin, dim, query + (m * per_kv + i) * dim);
      }
      const float *k_prompt = c->k_prompt + p * ks[0] + g * ks[1];
      const float *v_prompt = c->v_prompt + p * vs[0] + g * vs[1];
      const float *bias = c->prompt_bias + p * prompt_tokens;
      for (long j = 0; j < prompt_tokens; j += kKeysPerBlock) {
        const long n = std::min(kKeysPerBlock, prompt_tokens - j);
        for (long q = 0; q < queries; q++)
          dot_scores(query + q * dim, k_prompt + j * ks[2], ks[2], n, dim, c->scale, bias + j,
                     scores + q * keys + j);
      }
      for (long q = 0; q < queries; q++) {
        const float *k_own = c->k_own + (p * c->group + q / per_kv) * os[0] + g * os[1];
        dot_scores(query + q * dim, k_own, os[2], own, dim, c->scale, nullptr,
                   scores + q * keys + prompt_tokens);
      }
      for (long q = 0; q < queries; q++) totals[q] = softmax_numerators(scores + q * keys, keys);
      std::fill(sums, sums + queries * dim, 0.0f);
      for (long j = 0; j < prompt_tokens; j += kKeysPerBlock) {
        const long n = std::min(kKeysPerBlock, prompt_tokens - j);
        for (long q = 0; q < queries; q++)
          weighted_sum(scores + q * keys + j, v_prompt + j * vs[2], vs[2], n, dim, sums + q * dim);
      }
      for (long q = 0; q < queries; q++) {
        const long r = p * c->group + q / per_kv, h = g * per_kv + q % per_kv;
        weighted_sum(scores + q * keys + prompt_tokens, c->v_own + r * os[0] + g * os[1], os[2],
                     own, dim, sums + q * dim);
        const float inverse = 1.0f / totals[q];
        float *o = out + r * ldo + h * dim;
        for (long i = 0; i < dim; i++) o[i] = sums[q * dim + i] * inverse;
      }
    }
  }
}

}  // extern "C"
