// chunk_attention: causal attention of a step's prefill chunks (bf16, 16 query rows or more a
// sequence) on AMX tiles, or without AMX on VDPBF16PS register blocks that read the same tile
// layouts; scores, softmax and sums in fp32, K and V read from the paged cache.
// paged_attention_cpu.cpp hands it those sequences where the ISA is AMX or AVX512-BF16
// (carpool::chunk_attention_runs) and runs the rest (decodes, short chunks) through its row-by-row scan.
//
// Why: on a Xeon with AMX, torch's CPU flash attention (which chunks of more than 128 rows went
// to) spent about half of a 1,400-token prefill; a perf profile of its call showed the softmax at
// two thirds of it (separate scale, max, exp and convert passes over each 256 x 512 score block)
// and the AMX GEMMs at a third; its 512-key blocks also computed up to 511 masked keys a row on
// the diagonal. And the scan, which took chunks of up to 128 rows, ran a chunk of 128 rows after
// 1,000 positions 4.3x slower than the tiles do. Here one pass over a row of scores exponentiates,
// sums and rounds it (exp2 of an FMA, VSCALEFPS), blocks of 32 query rows stop at their own last
// key, and a kv head's K and V are put in tile order once for all the query heads that share them.
//
// Why the AVX512-BF16 blocks: the scan takes one query row at a time, so every 16 keys cost it
// 16 loads, 32 VDPBF16PS and a 46-instruction transposing sum per head; in tile order a row's
// broadcast feature pair meets 16 keys in one VDPBF16PS with nothing to sum, and a block of 8
// rows shares each loaded vector. On a 2-vCPU AMD EPYC (family 26, Zen 5), one layer (9 heads over 3): a
// 1,400-token prompt 3.5 against 10.2 ms, 512 rows after 1,024 positions 2.4 against 7.1 ms
// (scripts/bench_kernels.py; README, long prompts); 16 rows after 2,000 positions 0.20 against
// 0.41 ms (a scratch script over kernels.paged_attention).
//
// Algorithm, per call: each sequence's K, per kv head, becomes B tiles of 16 keys x 32 features
// (K^T in the pairs TDPBF16PS takes), its V B tiles of 32 keys x 16 features, zero past the
// context. Then tasks of (sequence, query head, 32 query rows), the costliest first, each thread
// taking the next when done: the rows' scores against 256 keys at a time (two A tiles of rows,
// 2 x 2 fp32 accumulator tiles), an online softmax over them (running max and sum per row, the
// output so far rescaled when the max grows), the probabilities rounded to bf16 (as flash
// attention does) and multiplied by V on tiles into the fp32 output. Row i of a chunk of q rows
// (position ctx - q + i) sees keys 0..ctx - q + i: the mask is causal aligned to the bottom right.
// Without AMX the same steps, the two products on VDPBF16PS blocks over the task's rows rounded
// up to 8 (not all 32: a 16-row chunk costs half).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "avx512_build.h"
#include "cpu_isa.h"
#include "paged_attention_args.h"

#if CARPOOL_BUILD_AVX512 && !defined(__clang__) && __GNUC__ >= 12
#define CARPOOL_BUILD_CHUNK_ATTENTION 1

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "avx512_math.h"
#include "amx_tiles.h"

namespace {

using carpool512::bf16_bits;

constexpr int64_t kRows = 32;  // query rows of a task: two A tiles of 16
constexpr int64_t kKeys = 256;  // keys per softmax pass: 32 x 256 fp32 scores, 32 KiB
constexpr int64_t kTileElements = 16 * 32;  // bf16 of one tile: 16 rows of 64 bytes
constexpr int64_t kMaxHeadDim = 256;  // the per-thread buffers' sizes grow with it

// Every tile here is 16 rows of 64 bytes: 0-3 fp32 accumulators (rows 0-15 and 16-31, two column
// tiles each), 4-5 A (the two row halves), 6-7 B.
void configure_tiles() {
    carpool_amx::TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

// 2^x for x <= 0, 16 lanes: x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor series
// to f^6 (relative error below 4e-8, well under the bf16 rounding the probabilities get next),
// times 2^n by VSCALEFPS (which also gives 0 far below the fp32 range).
inline __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381609954e-4f);  // ln2^6 / 720
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443423e-3f));  // ln2^5 / 120
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284771619e-3f));  // ln2^4 / 24
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821579953e-2f));  // ln2^3 / 6
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071233e-1f));  // ln2^2 / 2
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994530942e-1f));  // ln2
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

struct ChunkArgs {
    const bf16_bits* query;  // row `start` of the chunk, head 0
    int64_t q_token_stride, q_head_stride;
    bf16_bits* out;  // the same layout as the query rows: [rows, heads, head_dim], contiguous
    int64_t out_token_stride;
    bf16_bits* key_tiles;  // [kv heads][key tiles of 16][head_dim / 32][16][16][2]
    bf16_bits* value_tiles;  // [kv heads][key pairs of 32][head_dim / 16][16][16][2]
    int64_t key_tiles_per_head, value_tiles_per_head;  // in tiles
    int64_t rows, before, num_heads, group, head_dim;
    float log2_scale;  // the softmax scale times log2(e): scores go to exp2
};

// Thread-private buffers of one task.
struct TaskScratch {
    std::vector<bf16_bits> q;  // [kRows][head_dim], rows past the chunk zero
    std::vector<float> scores;  // [kRows][kKeys]
    std::vector<bf16_bits> probs;  // [kRows][kKeys]
    std::vector<float> acc;  // [kRows][head_dim]
    float max[kRows], sum[kRows];
    explicit TaskScratch(int64_t head_dim)
        : q(kRows * head_dim), scores(kRows * kKeys), probs(kRows * kKeys), acc(kRows * head_dim) {}
};

// scores[0:32, 0:width] = q @ K[first_key : first_key + width]^T, width a multiple of 32.
inline void score_block(const ChunkArgs& a, const TaskScratch& s, const bf16_bits* keys, int64_t first_key,
                        int64_t width, float* scores) {
    const int64_t depth = a.head_dim / 32;
    for (int64_t j = 0; j < width; j += 32) {
        const bf16_bits* b0 = keys + ((first_key + j) / 16) * depth * kTileElements;
        const bf16_bits* b1 = b0 + depth * kTileElements;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d = 0; d < depth; ++d) {
            _tile_loadd(4, s.q.data() + d * 32, a.head_dim * 2);
            _tile_loadd(5, s.q.data() + 16 * a.head_dim + d * 32, a.head_dim * 2);
            _tile_loadd(6, b0 + d * kTileElements, 64);
            _tile_loadd(7, b1 + d * kTileElements, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, scores + j, kKeys * 4);
        _tile_stored(1, scores + j + 16, kKeys * 4);
        _tile_stored(2, scores + 16 * kKeys + j, kKeys * 4);
        _tile_stored(3, scores + 16 * kKeys + j + 16, kKeys * 4);
    }
}

// acc[0:32, :] += probs[0:32, 0:width] @ V[first_key : first_key + width], width a multiple of 32.
inline void value_block(const ChunkArgs& a, TaskScratch& s, const bf16_bits* values, int64_t first_key,
                        int64_t width) {
    const int64_t feature_tiles = a.head_dim / 16;
    float* acc = s.acc.data();
    for (int64_t e = 0; e < feature_tiles; e += 2) {
        _tile_loadd(0, acc + e * 16, a.head_dim * 4);
        _tile_loadd(1, acc + e * 16 + 16, a.head_dim * 4);
        _tile_loadd(2, acc + 16 * a.head_dim + e * 16, a.head_dim * 4);
        _tile_loadd(3, acc + 16 * a.head_dim + e * 16 + 16, a.head_dim * 4);
        for (int64_t j = 0; j < width; j += 32) {
            const bf16_bits* b0 = values + (((first_key + j) / 32) * feature_tiles + e) * kTileElements;
            _tile_loadd(4, s.probs.data() + j, kKeys * 2);
            _tile_loadd(5, s.probs.data() + 16 * kKeys + j, kKeys * 2);
            _tile_loadd(6, b0, 64);
            _tile_loadd(7, b0 + kTileElements, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, acc + e * 16, a.head_dim * 4);
        _tile_stored(1, acc + e * 16 + 16, a.head_dim * 4);
        _tile_stored(2, acc + 16 * a.head_dim + e * 16, a.head_dim * 4);
        _tile_stored(3, acc + 16 * a.head_dim + e * 16 + 16, a.head_dim * 4);
    }
}

// Without AMX (AVX512-BF16), the same two blocks on VDPBF16PS from the same tile layouts: a K
// tile's row (64 bytes) is one feature pair of 16 keys and a V tile's row one key pair of 16
// features, each a vector, so a query row's broadcast pair times it adds to 16 keys' scores (or
// 16 features' sums) at once, with no horizontal sums. Register blocks of rows x vectors reuse
// each loaded vector across rows and each broadcast across vectors.
constexpr int kScoreRows = 8;  // 8 rows x 2 key vectors: 16 accumulators
constexpr int kValueRows = 4;  // 4 rows x up to 4 feature vectors: 16 accumulators

inline __m512bh pair_at(const bf16_bits* p) {
    return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

inline void score_block_avx512(const ChunkArgs& a, const TaskScratch& s, const bf16_bits* keys, int64_t first_key,
                               int64_t width, int64_t rows, float* scores) {
    const int64_t depth = a.head_dim / 32;
    for (int64_t j = 0; j < width; j += 32) {
        const bf16_bits* b0 = keys + ((first_key + j) / 16) * depth * kTileElements;
        const bf16_bits* b1 = b0 + depth * kTileElements;
        for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
            __m512 acc[kScoreRows][2];
            for (int r = 0; r < kScoreRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            const bf16_bits* q = s.q.data() + r0 * a.head_dim;
            for (int64_t d = 0; d < depth; ++d) {
                for (int64_t p = 0; p < 16; ++p) {  // features 32d + 2p, 32d + 2p + 1
                    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(b0 + d * kTileElements + p * 32);
                    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(b1 + d * kTileElements + p * 32);
#pragma GCC unroll 8
                    for (int r = 0; r < kScoreRows; ++r) {
                        const __m512bh qr = pair_at(q + r * a.head_dim + 32 * d + 2 * p);
                        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, k0);
                        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, k1);
                    }
                }
            }
            for (int r = 0; r < kScoreRows; ++r) {
                _mm512_storeu_ps(scores + (r0 + r) * kKeys + j, acc[r][0]);
                _mm512_storeu_ps(scores + (r0 + r) * kKeys + j + 16, acc[r][1]);
            }
        }
    }
}

template <int NV>
inline void value_block_avx512_slab(const ChunkArgs& a, TaskScratch& s, const bf16_bits* values, int64_t first_key,
                                    int64_t width, int64_t rows, int64_t e0) {
    const int64_t feature_tiles = a.head_dim / 16;
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
        __m512 acc[kValueRows][NV];
        for (int r = 0; r < kValueRows; ++r)
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(s.acc.data() + (r0 + r) * a.head_dim + (e0 + v) * 16);
        for (int64_t j = 0; j < width; j += 32) {
            const bf16_bits* tiles = values + (((first_key + j) / 32) * feature_tiles + e0) * kTileElements;
            const bf16_bits* probs = s.probs.data() + r0 * kKeys + j;
            for (int64_t p = 0; p < 16; ++p) {  // keys j + 2p, j + 2p + 1
                __m512bh v[NV];
                for (int i = 0; i < NV; ++i) v[i] = (__m512bh)_mm512_loadu_si512(tiles + i * kTileElements + p * 32);
#pragma GCC unroll 4
                for (int r = 0; r < kValueRows; ++r) {
                    const __m512bh pr = pair_at(probs + r * kKeys + 2 * p);
                    for (int i = 0; i < NV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], pr, v[i]);
                }
            }
        }
        for (int r = 0; r < kValueRows; ++r)
            for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s.acc.data() + (r0 + r) * a.head_dim + (e0 + v) * 16, acc[r][v]);
    }
}

inline void value_block_avx512(const ChunkArgs& a, TaskScratch& s, const bf16_bits* values, int64_t first_key,
                               int64_t width, int64_t rows) {
    const int64_t feature_tiles = a.head_dim / 16;  // even: head_dim is a multiple of 32
    int64_t e0 = 0;
    for (; e0 + 4 <= feature_tiles; e0 += 4) value_block_avx512_slab<4>(a, s, values, first_key, width, rows, e0);
    if (e0 < feature_tiles) value_block_avx512_slab<2>(a, s, values, first_key, width, rows, e0);
}

// One row of a score block: `visible` of its keys unmasked (the rest, to `width`, get probability
// 0). Updates the row's running max and sum, writes its bf16 probabilities and rescales its output.
inline void softmax_row(const ChunkArgs& a, TaskScratch& s, int64_t row, int64_t visible, int64_t width) {
    const float* scores = s.scores.data() + row * kKeys;
    bf16_bits* probs = s.probs.data() + row * kKeys;
    if (visible <= 0) {
        std::memset(probs, 0, width * sizeof(bf16_bits));
        return;
    }
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k = 0; k < visible; k += 16)
        top = _mm512_mask_max_ps(top, carpool512::first_lanes16(visible - k), top, _mm512_loadu_ps(scores + k));
    // log2_scale > 0: the max of the scaled scores is the scaled max.
    const float block_max = _mm512_reduce_max_ps(top) * a.log2_scale;
    const float new_max = std::max(s.max[row], block_max);
    const float rescale = std::exp2(s.max[row] - new_max);  // 0 on the first block (max -inf)
    const __m512 scale = _mm512_set1_ps(a.log2_scale), shift = _mm512_set1_ps(new_max);
    __m512 total = _mm512_setzero_ps();
    for (int64_t k = 0; k < width; k += 32) {
        const __m512 lo = _mm512_maskz_mov_ps(
            carpool512::first_lanes16(visible - k),
            exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(scores + k), scale, shift)));
        const __m512 hi = _mm512_maskz_mov_ps(
            carpool512::first_lanes16(visible - k - 16),
            exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(scores + k + 16), scale, shift)));
        total = _mm512_add_ps(total, _mm512_add_ps(lo, hi));
        // VCVTNE2PS2BF16 flushes denormal probabilities to 0: weights below 1e-38 of the row's largest.
        _mm512_storeu_si512(probs + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    s.sum[row] = s.sum[row] * rescale + _mm512_reduce_add_ps(total);
    s.max[row] = new_max;
    if (rescale != 1.0f) {
        float* acc = s.acc.data() + row * a.head_dim;
        const __m512 factor = _mm512_set1_ps(rescale);
        for (int64_t d = 0; d < a.head_dim; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), factor));
    }
}

// Query head `head`, chunk rows first_row.. first_row + 32 (clamped to the chunk), on AMX tiles
// (kAmx) or VDPBF16PS.
template <bool kAmx>
void attend_rows(const ChunkArgs& a, TaskScratch& s, int64_t head, int64_t first_row) {
    const int64_t rows = std::min(kRows, a.rows - first_row), kv_head = head / a.group;
    for (int64_t r = 0; r < kRows; ++r) {
        bf16_bits* dst = s.q.data() + r * a.head_dim;
        if (r < rows)
            std::memcpy(dst, a.query + (first_row + r) * a.q_token_stride + head * a.q_head_stride,
                        a.head_dim * sizeof(bf16_bits));
        else
            std::memset(dst, 0, a.head_dim * sizeof(bf16_bits));
        s.max[r] = -std::numeric_limits<float>::infinity();
        s.sum[r] = 0.0f;
    }
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    const bf16_bits* keys = a.key_tiles + kv_head * a.key_tiles_per_head * kTileElements;
    const bf16_bits* values = a.value_tiles + kv_head * a.value_tiles_per_head * kTileElements;
    const int64_t first_pos = a.before + first_row, end_key = first_pos + rows;  // row r sees keys <= first_pos + r
    // AMX tiles take 32 rows; VDPBF16PS blocks stop at the block of 8 that holds the chunk's last row.
    const int64_t computed = kAmx ? kRows : (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
    for (int64_t first_key = 0; first_key < end_key; first_key += kKeys) {
        const int64_t keys_here = std::min(kKeys, end_key - first_key), width = (keys_here + 31) / 32 * 32;
        if constexpr (kAmx)
            score_block(a, s, keys, first_key, width, s.scores.data());
        else
            score_block_avx512(a, s, keys, first_key, width, computed, s.scores.data());
        for (int64_t r = 0; r < computed; ++r) {
            const int64_t last = first_pos + std::min(r, rows - 1);  // padding rows copy the last real one
            softmax_row(a, s, r, std::min(keys_here, last + 1 - first_key), width);
        }
        if constexpr (kAmx)
            value_block(a, s, values, first_key, width);
        else
            value_block_avx512(a, s, values, first_key, width, computed);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 inverse = _mm512_set1_ps(1.0f / s.sum[r]);
        const float* acc = s.acc.data() + r * a.head_dim;
        bf16_bits* dst = a.out + (first_row + r) * a.out_token_stride + head * a.head_dim;
        for (int64_t d = 0; d < a.head_dim; d += 16)
            carpool512::store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), inverse), 0xffff);
    }
}

// The sequence's K and V in tile order, 32 positions from `first` (zero past its context): two
// K tile groups (16 keys each, all features) and one V tile group (32 keys, all features) per kv head.
void pack_keys_and_values(const carpool::PagedAttentionArgs& args, int64_t seq, int64_t kv_head, int64_t first,
                          bf16_bits* key_tiles, bf16_bits* value_tiles) {
    const auto* k_base = static_cast<const bf16_bits*>(args.key_cache);
    const auto* v_base = static_cast<const bf16_bits*>(args.value_cache);
    const int32_t* table = args.tables + seq * args.table_width;
    const int64_t ctx = args.lens[seq], head_dim = args.head_dim, depth = head_dim / 32;
    const auto row_at = [&](const bf16_bits* base, int64_t pos) {
        return base + table[pos / args.block_size] * args.block_stride + (pos % args.block_size) * args.token_stride +
               kv_head * head_dim;
    };
    auto* k_dst = reinterpret_cast<uint32_t*>(key_tiles);
    for (int64_t i = 0; i < 32; ++i) {
        // K tile (group i / 16, depth d): row r, column i % 16 holds features 32d + 2r and 32d + 2r + 1.
        uint32_t* k_col = k_dst + (i / 16) * depth * 256 + (i % 16);
        const auto* src = first + i < ctx ? reinterpret_cast<const uint32_t*>(row_at(k_base, first + i)) : nullptr;
        for (int64_t w = 0; w < head_dim / 2; ++w) k_col[(w / 16) * 256 + (w % 16) * 16] = src != nullptr ? src[w] : 0;
    }
    // V tile (feature tile e): row r, column n holds V[first + 2r][16e + n] and V[first + 2r + 1][16e + n].
    auto* v_dst = reinterpret_cast<uint32_t*>(value_tiles);
    const __m512i zero = _mm512_setzero_si512();
    const auto widened = [&](int64_t pos, int64_t e) {
        return pos < ctx ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_at(v_base, pos) + 16 * e)))
                         : zero;
    };
    for (int64_t r = 0; r < 16; ++r)
        for (int64_t e = 0; e < head_dim / 16; ++e)
            _mm512_storeu_si512(v_dst + e * 256 + r * 16,
                                _mm512_or_si512(widened(first + 2 * r, e), _mm512_slli_epi32(widened(first + 2 * r + 1, e), 16)));
}

void attend_chunks(const carpool::PagedAttentionArgs& args, int64_t num_seqs, int64_t min_rows, int64_t max_rows,
                   bool amx) {
    const int64_t head_dim = args.head_dim, num_kv_heads = args.num_kv_heads;
    const int64_t key_group_tiles = head_dim / 32, value_group_tiles = head_dim / 16;  // per 16 and 32 keys
    // Per sequence taken: its rows and where its tiles start; the K and V tiles of all of them in one buffer.
    std::vector<ChunkArgs> chunks;
    std::vector<int64_t> chunk_seq, tile_offset;
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t rows = args.starts[s + 1] - args.starts[s];
        if (rows < min_rows || rows > max_rows) continue;
        const int64_t key_pairs = (args.lens[s] + 31) / 32;  // groups of 32 keys, the last zero-padded
        ChunkArgs a{};
        a.query = static_cast<const bf16_bits*>(args.query) + args.starts[s] * args.q_token_stride;
        a.q_token_stride = args.q_token_stride;
        a.q_head_stride = args.q_head_stride;
        a.out = static_cast<bf16_bits*>(args.out) + args.starts[s] * args.num_heads * head_dim;
        a.out_token_stride = args.num_heads * head_dim;
        a.key_tiles_per_head = key_pairs * 2 * key_group_tiles;
        a.value_tiles_per_head = key_pairs * value_group_tiles;
        a.rows = rows;
        a.before = args.lens[s] - rows;
        a.num_heads = args.num_heads;
        a.group = args.num_heads / num_kv_heads;
        a.head_dim = head_dim;
        a.log2_scale = args.scale * 1.4426950408889634f;
        chunks.push_back(a);
        chunk_seq.push_back(s);
        tile_offset.push_back(tiles);
        tiles += num_kv_heads * (a.key_tiles_per_head + a.value_tiles_per_head);
    }
    if (chunks.empty()) return;
    std::vector<bf16_bits> tile_buffer(static_cast<size_t>(tiles * kTileElements));
    struct Pack {
        int64_t chunk, kv_head, first;
    };
    std::vector<Pack> packs;
    for (size_t c = 0; c < chunks.size(); ++c) {
        bf16_bits* base = tile_buffer.data() + tile_offset[c] * kTileElements;
        chunks[c].key_tiles = base;
        chunks[c].value_tiles = base + num_kv_heads * chunks[c].key_tiles_per_head * kTileElements;
        for (int64_t kv = 0; kv < num_kv_heads; ++kv)
            for (int64_t first = 0; first < args.lens[chunk_seq[c]]; first += 32) packs.push_back({static_cast<int64_t>(c), kv, first});
    }
    at::parallel_for(0, static_cast<int64_t>(packs.size()), 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const Pack& p = packs[i];
            const ChunkArgs& a = chunks[p.chunk];
            pack_keys_and_values(args, chunk_seq[p.chunk], p.kv_head, p.first,
                                 a.key_tiles + (p.kv_head * a.key_tiles_per_head + (p.first / 16) * key_group_tiles) * kTileElements,
                                 a.value_tiles + (p.kv_head * a.value_tiles_per_head + (p.first / 32) * value_group_tiles) * kTileElements);
        }
    });
    // Tasks of (query head, 32 rows), the costliest (the most keys) first, each thread taking the
    // next when done, so that the causal triangle's uneven tasks even out over the threads.
    struct Task {
        int64_t cost, chunk, head, first_row;
    };
    std::vector<Task> tasks;
    for (size_t c = 0; c < chunks.size(); ++c)
        for (int64_t first = 0; first < chunks[c].rows; first += kRows) {
            const int64_t rows = std::min(kRows, chunks[c].rows - first);
            for (int64_t h = 0; h < args.num_heads; ++h)
                tasks.push_back({rows * (chunks[c].before + first + rows), static_cast<int64_t>(c), h, first});
        }
    std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
    std::atomic<size_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        TaskScratch scratch(head_dim);
        if (amx) {
            configure_tiles();
            for (size_t i = next++; i < tasks.size(); i = next++)
                attend_rows<true>(chunks[tasks[i].chunk], scratch, tasks[i].head, tasks[i].first_row);
            _tile_release();
        } else {
            for (size_t i = next++; i < tasks.size(); i = next++)
                attend_rows<false>(chunks[tasks[i].chunk], scratch, tasks[i].head, tasks[i].first_row);
        }
    });
}

}  // namespace

#pragma GCC pop_options
#else
#define CARPOOL_BUILD_CHUNK_ATTENTION 0
#endif

namespace carpool {

bool chunk_attention_runs(int64_t head_dim) {
#if CARPOOL_BUILD_CHUNK_ATTENTION
    return active_isa() >= Isa::kAvx512Bf16 && head_dim % 32 == 0 && head_dim <= kMaxHeadDim;
#else
    return head_dim < 0;  // never: not built
#endif
}

void chunk_attention(const PagedAttentionArgs& args, int64_t num_seqs, int64_t min_rows, int64_t max_rows) {
#if CARPOOL_BUILD_CHUNK_ATTENTION
    attend_chunks(args, num_seqs, min_rows, max_rows, active_isa() == Isa::kAmx);
#else
    (void)args, (void)num_seqs, (void)min_rows, (void)max_rows;
#endif
}

}  // namespace carpool
