// The small per-layer ops of a decoder step, fp32 or bf16 on AVX2 CPUs: RMSNorm (alone or after the
// residual add), SiLU-and-multiply, the rotary embedding and the KV-cache write. On AVX-512 CPUs the
// arithmetic ones run layer_ops_avx512.cpp's loops instead (picked at run time, carpool::active_isa()). Their twins are the torch code in kernels/cpu_layer_ops.py and
// kernels/torch_kv_cache_write.py.
//
// Why: each is a handful of torch ops (RMSNorm is seven: cast, pow, mean, add, rsqrt, mul, mul),
// and in a decode step of a 135M model every op costs more in dispatch and allocation than in
// arithmetic: a 30-layer step ran some 900 of them. One pass over the data each, here.
// In bf16 they round where the twins' bf16 ops round, so the two agree to the last bit but for
// fp32 summation order.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "avx2_math.h"
#include "cpu_isa.h"
#include "layer_ops_avx512.h"

namespace {

using carpool::bf16;
using carpool::exp_nonpositive;
using carpool::horizontal_sum;
using carpool::load8;
using carpool::round_like;
using carpool::store8;
using carpool::to_float;

// Rows per parallel task: a row is a few hundred floats, so small batches stay on one thread
// (an OpenMP fork costs more than normalising a few rows).
constexpr int64_t ROWS_PER_TASK = 16;

bool avx512_active() { return carpool::active_isa() >= carpool::Isa::kAvx512Bf16; }

// y = w * T(x / rms(x)): normalised in fp32, rounded to T, then scaled (Llama's order of rounding).
template <typename T>
void rms_norm_row(const T* x, const T* w, T* y, int64_t d, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 v = load8(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = horizontal_sum(acc);
    for (; i < d; ++i) sum += to_float(x[i]) * to_float(x[i]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
    const __m256 inv_v = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= d; i += 8)
        store8(y + i, _mm256_mul_ps(load8(w + i), round_like<T>(_mm256_mul_ps(load8(x + i), inv_v))));
    for (; i < d; ++i) y[i] = static_cast<T>(to_float(w[i]) * round_like<T>(to_float(x[i]) * inv));
}

// T(silu(g)) * u with silu(g) = g * sigmoid(g); sigmoid from exp(-|g|) <= 1, so exp never overflows.
template <typename T>
inline __m256 silu_times(__m256 g, __m256 u) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign_mask));  // exp(-|g|)
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 positive = _mm256_div_ps(one, _mm256_add_ps(one, e));  // sigmoid(g) for g >= 0
    const __m256 negative = _mm256_mul_ps(e, positive);  // sigmoid(g) for g < 0: one division, not two
    const __m256 sigmoid = _mm256_blendv_ps(positive, negative, g);  // picks by g's sign bit
    return _mm256_mul_ps(round_like<T>(_mm256_mul_ps(g, sigmoid)), u);
}

template <typename T>
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* yp = out.data_ptr<T>();
    const float feps = static_cast<float>(eps);
    const bool avx512 = avx512_active();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
        if (avx512 && std::is_same_v<T, float>)
            carpool::rms_norm_rows_avx512_fp32(xp, wp, yp, d, feps, begin, end);
        else if (avx512)
            carpool::rms_norm_rows_avx512_bf16(xp, wp, yp, d, feps, begin, end);
        else
            for (int64_t m = begin; m < end; ++m) rms_norm_row(xp + m * d, wp, yp + m * d, d, feps);
    });
}

// residual <- T(residual + x); out = rms_norm(residual): the decoder layer's residual add and the
// next RMSNorm in one pass (the sum rounded to T before it is normalised, as torch's add rounds it).
template <typename T>
void fused_add_rms_norm_row(const T* x, T* r, const T* w, T* y, int64_t d, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 sum = round_like<T>(_mm256_add_ps(load8(r + i), load8(x + i)));
        store8(r + i, sum);
        acc = _mm256_fmadd_ps(sum, sum, acc);
    }
    float total = horizontal_sum(acc);
    for (; i < d; ++i) {
        const float sum = round_like<T>(to_float(r[i]) + to_float(x[i]));
        r[i] = static_cast<T>(sum);
        total += sum * sum;
    }
    const float inv = 1.f / std::sqrt(total / static_cast<float>(d) + eps);
    const __m256 inv_v = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= d; i += 8)
        store8(y + i, _mm256_mul_ps(load8(w + i), round_like<T>(_mm256_mul_ps(load8(r + i), inv_v))));
    for (; i < d; ++i) y[i] = static_cast<T>(to_float(w[i]) * round_like<T>(to_float(r[i]) * inv));
}

template <typename T>
void fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                        at::Tensor& out) {
    const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
    const T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* yp = out.data_ptr<T>();
    const float feps = static_cast<float>(eps);
    const bool avx512 = avx512_active();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
        if (avx512 && std::is_same_v<T, float>)
            carpool::fused_add_rms_norm_rows_avx512_fp32(xp, rp, wp, yp, d, feps, begin, end);
        else if (avx512)
            carpool::fused_add_rms_norm_rows_avx512_bf16(xp, rp, wp, yp, d, feps, begin, end);
        else
            for (int64_t m = begin; m < end; ++m) fused_add_rms_norm_row(xp + m * d, rp + m * d, wp, yp + m * d, d, feps);
    });
}

template <typename T>
void silu_and_mul(const at::Tensor& gate_up, at::Tensor& out) {
    const int64_t width = out.size(-1), rows = out.numel() / std::max<int64_t>(width, 1);
    const T* in = gate_up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    const bool avx512 = avx512_active();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
        if (avx512) {
            if constexpr (std::is_same_v<T, float>) carpool::silu_and_mul_rows_avx512_fp32(in, o, width, begin, end);
            else carpool::silu_and_mul_rows_avx512_bf16(in, o, width, begin, end);
            return;
        }
        for (int64_t m = begin; m < end; ++m) {
            const T* g = in + m * 2 * width;
            const T* u = g + width;
            T* y = o + m * width;
            int64_t i = 0;
            for (; i + 8 <= width; i += 8) store8(y + i, silu_times<T>(load8(g + i), load8(u + i)));
            for (; i < width; ++i) {
                const float gi = to_float(g[i]);
                y[i] = static_cast<T>(round_like<T>(gi / (1.f + std::exp(-gi))) * to_float(u[i]));
            }
        }
    });
}

// Llama's rotary embedding on one head, in place: x <- x * cos + rotate_half(x) * sin, with
// rotate_half(x) = [-x2, x1] over the two halves of the head. Each product is rounded to T before
// the sum, as torch's three bf16 ops round.
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = load8(x + i), x2 = load8(x + half + i);
        const __m256 first = _mm256_sub_ps(round_like<T>(_mm256_mul_ps(x1, load8(cos + i))),
                                           round_like<T>(_mm256_mul_ps(x2, load8(sin + i))));
        const __m256 second = _mm256_add_ps(round_like<T>(_mm256_mul_ps(x2, load8(cos + half + i))),
                                            round_like<T>(_mm256_mul_ps(x1, load8(sin + half + i))));
        store8(x + i, first);
        store8(x + half + i, second);
    }
    for (; i < half; ++i) {
        const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
        x[i] = static_cast<T>(round_like<T>(x1 * to_float(cos[i])) - round_like<T>(x2 * to_float(sin[i])));
        x[half + i] = static_cast<T>(round_like<T>(x2 * to_float(cos[half + i])) + round_like<T>(x1 * to_float(sin[half + i])));
    }
}

template <typename T>
void rotary_embedding(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
    const int64_t rows = qkv.size(0), row_stride = qkv.stride(0), head_dim = cos.size(1);
    T* base = qkv.data_ptr<T>();
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    const bool avx512 = avx512_active();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
        if (avx512) {
            if constexpr (std::is_same_v<T, float>)
                carpool::rotary_rows_avx512_fp32(base, row_stride, c, s, head_dim, num_heads, begin, end);
            else
                carpool::rotary_rows_avx512_bf16(base, row_stride, c, s, head_dim, num_heads, begin, end);
            return;
        }
        for (int64_t t = begin; t < end; ++t)
            for (int64_t h = 0; h < num_heads; ++h)
                rotate_head(base + t * row_stride + h * head_dim, c + t * head_dim, s + t * head_dim, head_dim);
    });
}

}  // namespace

// out[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * weight. x, out: [M, D] contiguous, weight: [D];
// all fp32 or all bf16.
void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    if (x.scalar_type() == at::kBFloat16)
        rms_norm<bf16>(x, weight, eps, out);
    else
        rms_norm<float>(x, weight, eps, out);
}

// residual <- residual + x (rounded to their dtype), out = rms_norm(residual, weight, eps).
// x, residual, out: [M, D] contiguous, weight: [D]; all fp32 or all bf16.
void fused_add_rms_norm_cpu(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                            at::Tensor& out) {
    if (x.scalar_type() == at::kBFloat16)
        fused_add_rms_norm<bf16>(x, residual, weight, eps, out);
    else
        fused_add_rms_norm<float>(x, residual, weight, eps, out);
}

// gate_up: [M, 2I] (gate then up, as one fused projection writes them); out: [M, I]; fp32 or bf16.
void silu_and_mul_cpu(const at::Tensor& gate_up, at::Tensor& out) {
    if (gate_up.scalar_type() == at::kBFloat16)
        silu_and_mul<bf16>(gate_up, out);
    else
        silu_and_mul<float>(gate_up, out);
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

// qkv: [T, >= num_heads * D] rows (a fused q/k/v projection, unit stride within a row); its first
// num_heads heads (the query's, then the key's) are rotated in place. cos, sin: [T, D] contiguous.
void rotary_embedding_cpu(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
    if (qkv.scalar_type() == at::kBFloat16)
        rotary_embedding<bf16>(qkv, cos, sin, num_heads);
    else
        rotary_embedding<float>(qkv, cos, sin, num_heads);
}
