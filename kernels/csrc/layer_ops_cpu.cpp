// The small per-layer ops of a decoder step, fp32 on AVX2 CPUs: RMSNorm, SiLU-and-multiply and
// the KV-cache write. Their twins are the torch code in kernels/cpu_layer_ops.py and
// kernels/torch_kv_cache_write.py.
//
// Why: each is a handful of torch ops (RMSNorm is seven: cast, pow, mean, add, rsqrt, mul, mul),
// and in a decode step of a 135M model every op costs more in dispatch and allocation than in
// arithmetic: a 30-layer step ran some 900 of them. One pass over the data each, here.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "avx2_math.h"

namespace {

using carpool::exp_nonpositive;
using carpool::horizontal_sum;

// Rows per parallel task: a row is a few hundred floats, so small batches stay on one thread
// (an OpenMP fork costs more than normalising a few rows).
constexpr int64_t ROWS_PER_TASK = 16;

void rms_norm_row(const float* x, const float* w, float* y, int64_t d, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = horizontal_sum(acc);
    for (; i < d; ++i) sum += x[i] * x[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
    const __m256 inv_v = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), inv_v)));
    for (; i < d; ++i) y[i] = w[i] * (x[i] * inv);
}

// silu(g) * u with silu(g) = g * sigmoid(g); sigmoid from exp(-|g|) <= 1, so exp never overflows.
inline __m256 silu_times(__m256 g, __m256 u) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign_mask));  // exp(-|g|)
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 denominator = _mm256_add_ps(one, e);
    const __m256 positive = _mm256_div_ps(one, denominator);  // sigmoid(g) for g >= 0
    const __m256 negative = _mm256_div_ps(e, denominator);  // sigmoid(g) for g < 0
    const __m256 sigmoid = _mm256_blendv_ps(positive, negative, g);  // picks by g's sign bit
    return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

}  // namespace

// out[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * weight. x, out: [M, D] contiguous.
void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = out.data_ptr<float>();
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) rms_norm_row(xp + m * d, wp, yp + m * d, d, feps);
    });
}

// gate_up: [M, 2I] (gate then up, as one fused projection writes them); out: [M, I].
void silu_and_mul_cpu(const at::Tensor& gate_up, at::Tensor& out) {
    const int64_t width = out.size(-1), rows = out.numel() / std::max<int64_t>(width, 1);
    const float* in = gate_up.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) {
            const float* g = in + m * 2 * width;
            const float* u = g + width;
            float* y = o + m * width;
            int64_t i = 0;
            for (; i + 8 <= width; i += 8)
                _mm256_storeu_ps(y + i, silu_times(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
            for (; i < width; ++i) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        }
    });
}

// Token t's K and V ([num_kv_heads, head_dim] each, any strides over tokens and heads, head_dim
// contiguous) into cache slot slot_mapping[t]; negative slots are skipped. Any dtype: rows are
// copied as bytes.
void write_kv_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slot_mapping) {
    const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_bytes = key.size(2) * key.element_size();
    const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < num_tokens; ++t)
        if (slots[t] >= num_slots)
            throw std::invalid_argument("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                                        " is past the cache's " + std::to_string(num_slots) + " slots");
    const int64_t elem = key.element_size(), slot_bytes = num_heads * head_bytes;
    const char* k = static_cast<const char*>(key.data_ptr());
    const char* v = static_cast<const char*>(value.data_ptr());
    char* kc = static_cast<char*>(key_cache.data_ptr());
    char* vc = static_cast<char*>(value_cache.data_ptr());
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < num_heads; ++h) {
            std::memcpy(kc + slots[t] * slot_bytes + h * head_bytes, k + (t * key.stride(0) + h * key.stride(1)) * elem, head_bytes);
            std::memcpy(vc + slots[t] * slot_bytes + h * head_bytes, v + (t * value.stride(0) + h * value.stride(1)) * elem, head_bytes);
        }
    }
}
