// Small AVX-512 helpers for the AVX-512 translation units. Include it only after
// CARPOOL_AVX512_BEGIN (avx512_build.h) (it needs the target ISA), and only there: everything here has internal
// linkage (an anonymous namespace), so no AVX-512 body can stand in for a same-named AVX2 one.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace carpool512 {
namespace {

using bf16_bits = uint16_t;  // a c10::BFloat16's storage (its methods are not ours to recompile)

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Lanes [0, n) set, n clamped to [0, 16].
inline __mmask16 first_lanes16(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}
inline __mmask32 first_lanes32(int64_t n) {
    return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : n <= 0 ? 0 : static_cast<__mmask32>((1u << n) - 1);
}

// exp(x) for x <= 0, 16 at a time: the AVX2 path's Cephes polynomial, lane for lane the same
// operations, so both paths give the same bits.
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(exponent));
}

// -- fp32 and bf16 storage, fp32 arithmetic (as avx2_math.h) -----------------------------------

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
// bf16 is the top half of an fp32: widening is a 16-bit shift.
inline __m512 load16(const bf16_bits* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// fp32 bits rounded to bf16 (nearest even; NaN stays a quiet NaN), in the top 16 bits of each
// lane. Not VCVTNEPS2BF16: it flushes denormals to zero, torch's rounding does not.
inline __m512i round_to_bf16_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __m512i quiet_nan = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, is_nan, quiet_nan);
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16_bits* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_bits(v), 16)));
}

// v as it would read back after a store to T: the rounding torch applies between two bf16 ops.
template <typename T>
inline __m512 round_like(__m512 v);
template <>
inline __m512 round_like<float>(__m512 v) { return v; }
template <>
inline __m512 round_like<bf16_bits>(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(round_to_bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

}  // namespace
}  // namespace carpool512
