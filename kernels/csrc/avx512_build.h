// CARPOOL_BUILD_AVX512: 1 where the compiler can build the AVX-512 (+ AVX512_BF16) translation
// units with `#pragma GCC target` (GCC 10+, Clang 9+ know avx512bf16); 0 leaves only AVX2 paths.
#pragma once

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 9) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define CARPOOL_BUILD_AVX512 1
#else
#define CARPOOL_BUILD_AVX512 0
#endif

// Compile what follows for AVX-512 F/BW/VL/DQ + BF16, whatever the command line says.
#if defined(__clang__)
#define CARPOOL_AVX512_BEGIN                                                                                     \
    _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16\"))), apply_to = function)")
#define CARPOOL_AVX512_END _Pragma("clang attribute pop")
#else
#define CARPOOL_AVX512_BEGIN \
    _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16\")")
#define CARPOOL_AVX512_END _Pragma("GCC pop_options")
#endif
