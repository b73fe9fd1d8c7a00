// Products of a few rows with float32 weights stored in column blocks, for decode steps
// on AVX2 CPUs (magrpo/speedups/blocked_matmul.py says why and when).
//
// A weight [n, k] (torch's nn.Linear layout, n a multiple of 16) is "blocked" when each
// of its 16-row blocks is stored transposed, [k][16]: the same memory, permuted. A product
// then streams each block once, front to back, with the 16 outputs of every input row in
// two AVX registers, and prefetches the block ahead of the loads.
//
// Threads: OpenMP, linked against the runtime torch already loaded, so that
// torch.set_num_threads (per calling thread) applies here too.

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "simd_math.h"

namespace {

constexpr long kBlock = 16;         // weight rows per block: two AVX registers of outputs
constexpr long kRowsPerPass = 4;    // input rows per pass: 8 accumulators (FMA latency x throughput)
constexpr long kPrefetchAhead = 256;  // floats: 16 cache lines; best of 128/256/512/1024

// Rows [0, R) of x times one block: out[r][0:16] = x[r] . block (+ bias) (+ residual[r]).
template <int R>
inline void block_pass(const float *x, long ldx, const float *block, long k, float *out,
                       long ldo, const float *bias, const float *residual, long ldr) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  for (long i = 0; i < k; i++, block += kBlock) {
    _mm_prefetch(reinterpret_cast<const char *>(block + kPrefetchAhead), _MM_HINT_T0);
    __m256 w0 = _mm256_loadu_ps(block), w1 = _mm256_loadu_ps(block + 8), b;
    // named accumulators (not an array) keep them in registers
#define MAC(r)                                         \
  if (R > r) {                                         \
    b = _mm256_broadcast_ss(x##r + i);                 \
    c##r##0 = _mm256_fmadd_ps(b, w0, c##r##0);         \
    c##r##1 = _mm256_fmadd_ps(b, w1, c##r##1);         \
  }
    MAC(0) MAC(1) MAC(2) MAC(3)
#undef MAC
  }
#define STORE(r)                                                              \
  if (R > r) {                                                                \
    if (bias) {                                                               \
      c##r##0 = _mm256_add_ps(c##r##0, _mm256_loadu_ps(bias));                \
      c##r##1 = _mm256_add_ps(c##r##1, _mm256_loadu_ps(bias + 8));            \
    }                                                                         \
    if (residual) {                                                           \
      c##r##0 = _mm256_add_ps(c##r##0, _mm256_loadu_ps(residual + r * ldr));  \
      c##r##1 = _mm256_add_ps(c##r##1, _mm256_loadu_ps(residual + r * ldr + 8)); \
    }                                                                         \
    _mm256_storeu_ps(out + r * ldo, c##r##0);                                 \
    _mm256_storeu_ps(out + r * ldo + 8, c##r##1);                             \
  }
  STORE(0) STORE(1) STORE(2) STORE(3)
#undef STORE
}

}  // namespace

extern "C" {

// out[:, c] = x @ W.T (+ bias) (+ residual) for W the row-wise concatenation of the blocked
// weights[0..count) (widths[j] rows each, k columns): each 16 outputs are one block.
void blocked_matmul(const float *x, long ldx, long rows, long k, const float *const *weights,
                      const long *widths, long count, float *out, long ldo, const float *bias,
                      const float *residual, long ldr) {
  long blocks = 0;
  for (long j = 0; j < count; j++) blocks += widths[j] / kBlock;
#pragma omp parallel for schedule(static)
  for (long b = 0; b < blocks; b++) {
    long j = 0, first = 0;  // the weight that holds block b, and its first block
    while (b - first >= widths[j] / kBlock) first += widths[j++] / kBlock;
    const float *block = weights[j] + (b - first) * kBlock * k;
    const float *block_bias = bias ? bias + b * kBlock : nullptr;
    for (long r = 0; r < rows; r += kRowsPerPass) {
      const float *xr = x + r * ldx;
      float *o = out + r * ldo + b * kBlock;
      const float *res = residual ? residual + r * ldr + b * kBlock : nullptr;
      switch (rows - r < kRowsPerPass ? rows - r : kRowsPerPass) {
        case 1: block_pass<1>(xr, ldx, block, k, o, ldo, block_bias, res, ldr); break;
        case 2: block_pass<2>(xr, ldx, block, k, o, ldo, block_bias, res, ldr); break;
        case 3: block_pass<3>(xr, ldx, block, k, o, ldo, block_bias, res, ldr); break;
        default: block_pass<4>(xr, ldx, block, k, o, ldo, block_bias, res, ldr); break;
      }
    }
  }
}

// out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for each of the rows (Llama's RMSNorm
// in float32, as transformers computes it): the decode step's norms in one call instead of
// six torch operators.
void rms_norm_rows(const float *x, long ldx, long rows, long k, const float *weight,
                   float eps, float *out, long ldo) {
  for (long r = 0; r < rows; r++) {
    const float *xr = x + r * ldx;
    float *o = out + r * ldo;
    __m256 sums = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= k; i += 8) {
      __m256 v = _mm256_loadu_ps(xr + i);
      sums = _mm256_fmadd_ps(v, v, sums);
    }
    float sum = sum_lanes(sums);
    for (; i < k; i++) sum += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(k) + eps);
    for (i = 0; i < k; i++) o[i] = weight[i] * (xr[i] * scale);
  }
}

// out[r] = silu(gate) * up for each row x[r] = [gate | up] (half features each), as the
// fused gate/up product gives them: SwiGLU's activation in one call instead of four torch
// operators. sigmoid(g) comes from exp(-|g|), which cannot overflow.
void silu_mul_rows(const float *x, long ldx, long rows, long half, float *out, long ldo) {
  const __m256 one = _mm256_set1_ps(1.0f), sign_bit = _mm256_set1_ps(-0.0f);
  for (long r = 0; r < rows; r++) {
    const float *gate = x + r * ldx, *up = gate + half;
    float *o = out + r * ldo;
    long i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign_bit));  // exp(-|g|)
      // sigmoid(g) = 1 / (1 + e) where g >= 0, e / (1 + e) where g < 0 (blend by sign)
      const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
    }
    for (; i < half; i++) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

// Blocks weight [n, k] in place (to_blocked) or back to [n, k] rows: an exact permutation.
// Returns 0, or -1 when out of memory (the weight is then unchanged).
int transpose_blocks(float *weight, long n, long k, int to_blocked) {
  const long blocks = n / kBlock, size = kBlock * k;
  const int threads = omp_get_max_threads();
  float *copies = static_cast<float *>(std::malloc(sizeof(float) * size * threads));
  if (copies == nullptr) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long b = 0; b < blocks; b++) {
    float *block = weight + b * size, *copy = copies + omp_get_thread_num() * size;
    std::memcpy(copy, block, sizeof(float) * size);
    for (long row = 0; row < kBlock; row++)
      for (long i = 0; i < k; i++) {
        if (to_blocked) block[i * kBlock + row] = copy[row * k + i];
        else block[row * k + i] = copy[i * kBlock + row];
      }
  }
  std::free(copies);
  return 0;
}

int max_threads(void) { return omp_get_max_threads(); }

}  // extern "C"
