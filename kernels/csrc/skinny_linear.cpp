// skinny_linear: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in fp32 for a few rows M (AVX2 + FMA).
//
// Why: a decode step multiplies a handful of rows by every weight matrix. MKL's sgemm runs such
// shapes at 30-45 % of the speed a weight stream allows on AVX2 CPUs (M = 8 costs twice M = 1),
// so steps late in a batch, with few sequences left, pay for rows they do not have.
//
// Algorithm: threads split the N weight rows. A micro-tile holds MR x rows against NR weight rows
// in MR * NR vector accumulators; the NR weight rows (contiguous in memory) are streamed once
// from DRAM and reused from L1 by every row tile of x, which stays in L1/L2. Each output is one
// dot product reduced at the end, so a row's result never depends on the other rows of the batch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_math.h"

namespace {

using carpool::horizontal_sum;

constexpr int MR = 3;  // x rows per micro-tile
constexpr int NR = 4;  // weight rows per micro-tile: 12 accumulators + 4 weights + 1 x of 16 ymm

// R rows of x against C weight rows over the first k_vec (a multiple of 8) features. The K tail
// is added by the caller: a scalar loop in here stops GCC keeping the accumulators in registers
// (measured: twice as slow at 16 rows).
template <int R, int C>
inline void micro_tile(const float* x, const float* w, float* y, int64_t K, int64_t k_vec, int64_t N) {
    __m256 acc[R][C];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_vec; k += 8) {
        __m256 wv[C];
        for (int j = 0; j < C; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int i = 0; i < R; ++i) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) y[i * N + j] = horizontal_sum(acc[i][j]);
}

template <int C>
inline void column_block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
    const int64_t k_vec = K - K % 8;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) micro_tile<MR, C>(x + m * K, w, y + m * N, K, k_vec, N);
    for (; m < M; ++m) micro_tile<1, C>(x + m * K, w, y + m * N, K, k_vec, N);
    if (k_vec == K) return;
    for (m = 0; m < M; ++m)
        for (int j = 0; j < C; ++j) {
            float tail = 0.f;
            for (int64_t k = k_vec; k < K; ++k) tail += x[m * K + k] * w[j * K + k];
            y[m * N + j] += tail;
        }
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    // Shapes, dtypes and contiguity are checked by the Python wrapper before this call.
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    auto y = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t num_blocks = N / NR;
    // grain: 16 blocks of 4 rows x K floats is >= 36 KiB of weights, enough to amortize a task.
    at::parallel_for(0, num_blocks, 16, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            column_block<NR>(xp, wp + b * NR * K, yp + b * NR, M, K, N);
        }
    });
    for (int64_t n = num_blocks * NR; n < N; ++n) column_block<1>(xp, wp + n * K, yp + n, M, K, N);
    if (bias.has_value()) y.add_(*bias);
    return y;
}
