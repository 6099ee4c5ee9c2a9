// amx_linear: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in bf16 on AMX tiles, for every row count a
// step brings, on a weight packed once into tile order (amx_pack_weight).
//
// Why: oneDNN's packed bf16 GEMM (kernels/cpu_packed_linear.py) streams a decode step's weights at
// ~15 GB/s on a 2-core Sapphire Rapids VM at 1-32 rows, where a plain read of the same bytes runs
// at ~25 GB/s, and costs 1.3x its 1-row time at 64 rows. This kernel reads each weight tile from
// memory once per call and multiplies it by every row tile of x from the caches: 1.42-1.44x oneDNN
// at 1-32 rows, 1.28x at 64, 1.20x at 128, 1.10x at 256, all 30 layers of SmolLM2 called from
// Python (`python scripts/bench_cpu_linear.py --bf16 --packed --rows 1,8,32,64,128,256 --threads 2`);
// from C++, where a decoder layer is one call, 1 row reads the weights at ~26 GB/s.
//
// Layout: a weight [N, K] becomes [N/16][K/32][16][32] bf16, one 1 KiB B tile per 16 columns and
// 32 features, in the pairs TDPBF16PS takes (tile row r holds w[n][k0 + 2r], w[n][k0 + 2r + 1] for
// the 16 columns n). Threads split the columns in panels of 32 (two B tiles); per panel, up to 32
// rows of x at a time (two A tiles) against both B tiles into four fp32 accumulator tiles, K in
// order. Each output is one dot product accumulated in fp32 and rounded to bf16 once (bias added
// in fp32 first), and a row's result never depends on the other rows of the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "avx512_build.h"
#include "cpu_isa.h"
#include "cpu_kernels.h"

namespace {

constexpr int64_t kTileCols = 16;  // columns of one B tile
constexpr int64_t kTileDepth = 32;  // features of one tile: 64 bytes of bf16 per tile row
constexpr int64_t kTileElements = 16 * 32;
constexpr int64_t kPanel = 32;  // columns per panel: two B tiles
constexpr int64_t kRowBlock = 32;  // rows per pass: two A tiles

}  // namespace

// GCC 12+ (the AMX intrinsics and __builtin_cpu_supports("amx-tile")); elsewhere no AMX path.
#if CARPOOL_BUILD_AVX512 && !defined(__clang__) && __GNUC__ >= 12
#define CARPOOL_BUILD_AMX 1

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "amx_tiles.h"

namespace {

// Tiles 0-3: accumulators (rows of x block 0: 0, 1; block 1: 2, 3); 4, 5: A (x rows); 6, 7: B.
void configure_tiles(int rows0, int rows1) {
    carpool_amx::TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = static_cast<uint8_t>(rows0);
    config.rows[2] = config.rows[3] = config.rows[5] = static_cast<uint8_t>(std::max(rows1, 1));
    config.rows[6] = config.rows[7] = 16;
    _tile_loadconfig(&config);
}

// One panel (two B tiles) against one or two A tiles of rows, over kb tile depths; fp32 out.
template <bool kTwoRowTiles>
inline void panel_product(const uint16_t* x, int64_t x_stride, const uint16_t* b0, const uint16_t* b1,
                          int64_t kb, float* acc) {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwoRowTiles) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < kb; ++k) {
        _tile_loadd(4, x + k * kTileDepth, x_stride * 2);
        _tile_loadd(6, b0 + k * kTileElements, 64);
        _tile_loadd(7, b1 + k * kTileElements, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (kTwoRowTiles) {
            _tile_loadd(5, x + 16 * x_stride + k * kTileDepth, x_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, kPanel * 4);
    _tile_stored(1, acc + 16, kPanel * 4);
    if (kTwoRowTiles) {
        _tile_stored(2, acc + 16 * kPanel, kPanel * 4);
        _tile_stored(3, acc + 16 * kPanel + 16, kPanel * 4);
    }
}

// rows x 32 fp32 accumulators (+ the panel's 32 bias values) -> bf16, round to nearest even.
inline void round_rows(const float* acc, int rows, const float* bias, uint16_t* y, int64_t y_stride) {
    const __m512 bias_lo = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 bias_hi = bias != nullptr ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(acc + r * kPanel), bias_lo);
        const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(acc + r * kPanel + 16), bias_hi);
        _mm512_storeu_si512(y + r * y_stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

void amx_gemm(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t M, int64_t K,
              int64_t N) {
    const int64_t kb = K / kTileDepth;
    at::parallel_for(0, N / kPanel, 1, [&](int64_t begin, int64_t end) {
        alignas(64) float acc[kRowBlock * kPanel];
        int configured0 = -1, configured1 = -1;
        // Panel outer, rows inner: a panel's tiles come from DRAM once and from L1/L2 for the other
        // row blocks; x (a few hundred KB at a decode step's row counts) stays in L2.
        for (int64_t p = begin; p < end; ++p) {
            const uint16_t* b0 = w + 2 * p * kb * kTileElements;
            const uint16_t* b1 = b0 + kb * kTileElements;
            for (int64_t m = 0; m < M; m += kRowBlock) {
                const int rows0 = static_cast<int>(std::min<int64_t>(16, M - m));
                const int rows1 = static_cast<int>(std::clamp<int64_t>(M - m - 16, 0, 16));
                if (rows0 != configured0 || rows1 != configured1) {  // only the last block differs
                    configure_tiles(rows0, rows1);
                    configured0 = rows0;
                    configured1 = rows1;
                }
                if (rows1 > 0) panel_product<true>(x + m * K, K, b0, b1, kb, acc);
                else panel_product<false>(x + m * K, K, b0, b1, kb, acc);
                round_rows(acc, rows0 + rows1, bias != nullptr ? bias + p * kPanel : nullptr, y + m * N + p * kPanel, N);
            }
        }
        _tile_release();
    });
}

}  // namespace

#pragma GCC pop_options
#else
#define CARPOOL_BUILD_AMX 0
#endif

namespace carpool {

bool amx_tiles_usable() {
#if CARPOOL_BUILD_AMX
    // Linux hands out AMX's tile state per process, on request (arch_prctl, kernel 5.16+); a tile
    // instruction before it faults. Asked once; a refusal (old kernel, a VM without it) means no AMX.
    static const bool usable = [] {
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
    }();
    return usable;
#else
    return false;
#endif
}

}  // namespace carpool

// Shapes, dtypes and contiguity are checked by kernels/cpu_amx_linear.py before these calls.
at::Tensor amx_pack_weight(const at::Tensor& weight) {
    const int64_t N = weight.size(0), K = weight.size(1), kb = K / kTileDepth;
    at::Tensor packed = at::empty({N / kTileCols, kb, 16, kTileDepth}, weight.options());
    const uint16_t* src = static_cast<const uint16_t*>(weight.data_ptr());
    uint16_t* dst = static_cast<uint16_t*>(packed.data_ptr());
    at::parallel_for(0, N / kTileCols, 1, [&](int64_t begin, int64_t end) {
        for (int64_t nb = begin; nb < end; ++nb)
            for (int64_t k = 0; k < kb; ++k) {
                uint16_t* tile = dst + (nb * kb + k) * kTileElements;
                for (int64_t r = 0; r < 16; ++r)
                    for (int64_t j = 0; j < kTileCols; ++j) {
                        const uint16_t* pair = src + (nb * kTileCols + j) * K + k * kTileDepth + 2 * r;
                        tile[r * kTileDepth + 2 * j] = pair[0];
                        tile[r * kTileDepth + 2 * j + 1] = pair[1];
                    }
            }
    });
    return packed;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
    const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kTileCols;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
#if CARPOOL_BUILD_AMX
    TORCH_CHECK(carpool::amx_tiles_usable(), "amx_linear: this CPU or OS offers no AMX tiles");
    at::Tensor bias_fp32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    amx_gemm(static_cast<const uint16_t*>(x.data_ptr()), static_cast<const uint16_t*>(packed.data_ptr()),
             bias.has_value() ? bias_fp32.data_ptr<float>() : nullptr, static_cast<uint16_t*>(y.data_ptr()), M, K, N);
    return y;
#else
    TORCH_CHECK(false, "amx_linear: the compiler that built the kernels could not build AMX code");
#endif
}
