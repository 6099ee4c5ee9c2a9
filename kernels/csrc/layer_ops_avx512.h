// The AVX-512 layer-op row loops (layer_ops_avx512.cpp), called by layer_ops_cpu.cpp only where
// carpool::active_isa() is kAvx512Bf16. Raw pointers: `T` is float (_fp32) or bf16 bits (_bf16).
// Each processes rows [begin, end) of a contiguous [rows, d] input.
#pragma once
#include <cstdint>

namespace carpool {

#define CARPOOL_DECLARE_LAYER_OPS_AVX512(suffix)                                                                  \
    void rms_norm_rows_avx512_##suffix(const void* x, const void* w, void* y, int64_t d, float eps, int64_t begin, \
                                       int64_t end);                                                              \
    void fused_add_rms_norm_rows_avx512_##suffix(const void* x, void* residual, const void* w, void* y, int64_t d,  \
                                                 float eps, int64_t begin, int64_t end);                          \
    void silu_and_mul_rows_avx512_##suffix(const void* gate_up, void* out, int64_t width, int64_t begin,           \
                                           int64_t end);                                                          \
    void rotary_rows_avx512_##suffix(void* qkv, int64_t row_stride, const void* cos, const void* sin,             \
                                     int64_t head_dim, int64_t num_heads, int64_t begin, int64_t end);

CARPOOL_DECLARE_LAYER_OPS_AVX512(fp32)
CARPOOL_DECLARE_LAYER_OPS_AVX512(bf16)

#undef CARPOOL_DECLARE_LAYER_OPS_AVX512

}  // namespace carpool
