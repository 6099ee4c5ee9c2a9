// The layer ops' AVX-512 paths (RMSNorm, residual-add + RMSNorm, SiLU-and-multiply, rotary): the
// AVX2 loops of layer_ops_cpu.cpp at 16 lanes, with masked tails instead of scalar ones. They
// round where the AVX2 paths (and the torch twins) round, with the same exp and division, so
// results differ from those only by fp32 summation order inside an RMSNorm's sum of squares.
#include <immintrin.h>

#include <cstdint>

#include "avx512_build.h"
#include "layer_ops_avx512.h"

#if CARPOOL_BUILD_AVX512

CARPOOL_AVX512_BEGIN
#include "avx512_math.h"

namespace carpool512 {
namespace {

// sum(v^2) over the row, 16 lanes (zeros past d).
template <typename T>
inline float sum_of_squares(const T* x, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        const __m512 v = load16(x + i, first_lanes16(d - i));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// y = w * T(x * inv): normalised in fp32, rounded to T, then scaled (Llama's order of rounding).
template <typename T>
inline void scale_row(const T* x, const T* w, T* y, int64_t d, float inv) {
    const __m512 inv_v = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = first_lanes16(d - i);
        store16(y + i, _mm512_mul_ps(load16(w + i, m), round_like<T>(_mm512_mul_ps(load16(x + i, m), inv_v))), m);
    }
}

inline float inverse_rms(float sum, int64_t d, float eps) {
    return 1.f / __builtin_sqrtf(sum / static_cast<float>(d) + eps);
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t d, float eps, int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
        const T* row = x + m * d;
        scale_row(row, w, y + m * d, d, inverse_rms(sum_of_squares(row, d), d, eps));
    }
}

// residual <- T(residual + x), then y = rms_norm(residual): the decoder layer's residual add and
// the next norm in one pass over the row (the sum is rounded before it is normalised, as torch's
// separate add rounds it).
template <typename T>
void fused_add_rms_norm_rows(const T* x, T* residual, const T* w, T* y, int64_t d, float eps, int64_t begin,
                             int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
        T* r = residual + m * d;
        const T* xm = x + m * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 k = first_lanes16(d - i);
            const __m512 sum = round_like<T>(_mm512_add_ps(load16(r + i, k), load16(xm + i, k)));
            store16(r + i, sum, k);
            acc = _mm512_fmadd_ps(sum, sum, acc);
        }
        scale_row(r, w, y + m * d, d, inverse_rms(_mm512_reduce_add_ps(acc), d, eps));
    }
}

// T(silu(g)) * u with silu(g) = g * sigmoid(g); sigmoid from exp(-|g|) <= 1 (no overflow).
template <typename T>
inline __m512 silu_times(__m512 g, __m512 u) {
    const __m512 e = exp_nonpositive(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));  // exp(-|g|)
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 positive = _mm512_div_ps(one, _mm512_add_ps(one, e));  // sigmoid(g) for g >= 0
    const __m512 negative = _mm512_mul_ps(e, positive);  // sigmoid(g) for g < 0
    const __mmask16 is_negative = _mm512_movepi32_mask(_mm512_castps_si512(g));  // g's sign bit, as blendv reads it
    const __m512 sigmoid = _mm512_mask_mov_ps(positive, is_negative, negative);
    return _mm512_mul_ps(round_like<T>(_mm512_mul_ps(g, sigmoid)), u);
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t width, int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
        const T* g = gate_up + m * 2 * width;
        const T* u = g + width;
        T* y = out + m * width;
        for (int64_t i = 0; i < width; i += 16) {
            const __mmask16 k = first_lanes16(width - i);
            store16(y + i, silu_times<T>(load16(g + i, k), load16(u + i, k)), k);
        }
    }
}

// x <- x * cos + rotate_half(x) * sin on one head, each product rounded to T before the sum.
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 k = first_lanes16(half - i);
        const __m512 x1 = load16(x + i, k), x2 = load16(x + half + i, k);
        const __m512 first = _mm512_sub_ps(round_like<T>(_mm512_mul_ps(x1, load16(cos + i, k))),
                                           round_like<T>(_mm512_mul_ps(x2, load16(sin + i, k))));
        const __m512 second = _mm512_add_ps(round_like<T>(_mm512_mul_ps(x2, load16(cos + half + i, k))),
                                            round_like<T>(_mm512_mul_ps(x1, load16(sin + half + i, k))));
        store16(x + i, first, k);
        store16(x + half + i, second, k);
    }
}

template <typename T>
void rotary_rows(T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t head_dim, int64_t num_heads,
                 int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < num_heads; ++h)
            rotate_head(qkv + t * row_stride + h * head_dim, cos + t * head_dim, sin + t * head_dim, head_dim);
}

}  // namespace
}  // namespace carpool512

#define CARPOOL_DEFINE_LAYER_OPS_AVX512(suffix, T)                                                                 \
    void rms_norm_rows_avx512_##suffix(const void* x, const void* w, void* y, int64_t d, float eps, int64_t begin, \
                                       int64_t end) {                                                              \
        carpool512::rms_norm_rows(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), d, eps,  \
                                  begin, end);                                                                     \
    }                                                                                                              \
    void fused_add_rms_norm_rows_avx512_##suffix(const void* x, void* residual, const void* w, void* y, int64_t d,  \
                                                 float eps, int64_t begin, int64_t end) {                          \
        carpool512::fused_add_rms_norm_rows(static_cast<const T*>(x), static_cast<T*>(residual),                   \
                                            static_cast<const T*>(w), static_cast<T*>(y), d, eps, begin, end);     \
    }                                                                                                              \
    void silu_and_mul_rows_avx512_##suffix(const void* gate_up, void* out, int64_t width, int64_t begin,           \
                                           int64_t end) {                                                          \
        carpool512::silu_and_mul_rows(static_cast<const T*>(gate_up), static_cast<T*>(out), width, begin, end);   \
    }                                                                                                              \
    void rotary_rows_avx512_##suffix(void* qkv, int64_t row_stride, const void* cos, const void* sin,             \
                                     int64_t head_dim, int64_t num_heads, int64_t begin, int64_t end) {           \
        carpool512::rotary_rows(static_cast<T*>(qkv), row_stride, static_cast<const T*>(cos),                      \
                                static_cast<const T*>(sin), head_dim, num_heads, begin, end);                      \
    }

#else  // no AVX-512 build: never called (active_isa() is always kAvx2)

#define CARPOOL_DEFINE_LAYER_OPS_AVX512(suffix, T)                                                                 \
    void rms_norm_rows_avx512_##suffix(const void*, const void*, void*, int64_t, float, int64_t, int64_t) {}       \
    void fused_add_rms_norm_rows_avx512_##suffix(const void*, void*, const void*, void*, int64_t, float, int64_t,  \
                                                 int64_t) {}                                                       \
    void silu_and_mul_rows_avx512_##suffix(const void*, void*, int64_t, int64_t, int64_t) {}                       \
    void rotary_rows_avx512_##suffix(void*, int64_t, const void*, const void*, int64_t, int64_t, int64_t, int64_t) {}

#endif

namespace carpool {
CARPOOL_DEFINE_LAYER_OPS_AVX512(fp32, float)
CARPOOL_DEFINE_LAYER_OPS_AVX512(bf16, uint16_t)  // bf16 bits
}  // namespace carpool

#if CARPOOL_BUILD_AVX512
CARPOOL_AVX512_END
#endif
