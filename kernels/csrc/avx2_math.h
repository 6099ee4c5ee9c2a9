// Small AVX2 helpers shared by the CPU kernels (each .cpp includes this; all inline).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace carpool {

inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0, 8 at a time (Cephes' expf: a degree-5 polynomial on [-ln2/2, ln2/2] times
// 2^n; relative error about 2e-7). Scalar std::exp cost more than the whole attention arithmetic.
inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below this expf underflows anyway
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// -- fp32 and bf16 storage, fp32 arithmetic ---------------------------------------------------
// The kernels are templates over the element type T (float or c10::BFloat16): values are widened
// to fp32 on load and narrowed on store, so a bf16 model computes as torch does (fp32 inside an
// op, one rounding at its output) while its K/V cache and activations take half the bytes.

using bf16 = c10::BFloat16;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bf16 is the top half of an fp32: widening is a 16-bit shift.
inline __m256 load8(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// fp32 bits rounded to bf16 (round to nearest even, as c10::BFloat16 and torch do; NaN stays a
// quiet NaN), still in the top 16 bits of each 32-bit lane.
inline __m256i round_to_bf16_bits(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(rounded, quiet_nan, _mm256_castps_si256(is_nan));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(bf16* p, __m256 v) {
    const __m256i high = _mm256_srli_epi32(round_to_bf16_bits(v), 16);  // each lane < 2^16: packus keeps it
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// v as it would read back after a store to T: the rounding torch applies between two bf16 ops.
template <typename T>
inline __m256 round_like(__m256 v);
template <>
inline __m256 round_like<float>(__m256 v) { return v; }
template <>
inline __m256 round_like<bf16>(__m256 v) {
    return _mm256_castsi256_ps(_mm256_and_si256(round_to_bf16_bits(v), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Scalar twins, for the tails.
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }
template <typename T>
inline float round_like(float x) { return static_cast<float>(static_cast<T>(x)); }

}  // namespace carpool
