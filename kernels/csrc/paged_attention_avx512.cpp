// paged_attention_cpu's AVX-512 path (16 lanes; VDPBF16PS for q.k on a bf16 cache), one task at a
// time: a (sequence, kv head) pair's query rows, or a part of a long chunk's; paged_attention_cpu.cpp
// deals out the tasks and picks this path at run time. The torch twin (kernels/torch_paged_attention.py) is its specification.
//
// Why it differs from the AVX2 path (paged_attention_avx2.cpp, which walks the cache the same way):
// a decode step's attention reads each context's K and V once, so it is bound by those reads and
// by the instructions spent per key. Both read the cache where it lies; this path also takes q.k
// on bf16 pairs with VDPBF16PS (two instructions per 64-dim key, no widening), and reduces sixteen
// keys' partial sums together (46 instructions per 16 keys, not 16 horizontal sums).
//
// Per query row and chunk of up to four query heads sharing the kv head: scores of keys 0..p,
// sixteen keys at a time (keys past p padded with key 0, then masked to -inf), a softmax in fp32
// with the max subtracted, then the probability-weighted V rows accumulated in registers (a bf16
// row widened by a shift and a mask into its even and odd elements, no widening shuffle).
//
// Memory: a token's cache row holds every kv head's K (and V) side by side; the first kv head's
// task of a decode step fetches whole rows into L2 for the sequence's other tasks (key_scores).
//
// Rounding: bf16 products are exact in fp32, and VDPBF16PS adds lane i's odd product, then its
// even one, into the fp32 sum (Intel SDM, VDPBF16PS). The fp32 path adds the same products in the
// same order (odd elements, then even), so a bf16 batch gives its fp32-widened result rounded
// once, as on the AVX2 path.
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "avx512_build.h"
#include "paged_attention_args.h"

#if CARPOOL_BUILD_AVX512

CARPOOL_AVX512_BEGIN
#include "avx512_math.h"

namespace carpool512 {
namespace {

#include "paged_attention_rows.h"  // Task, sequence_task, group_rows: inside this unit's namespace

constexpr int64_t kKeys = 16;  // keys per score group: one per lane
constexpr int64_t kMaxHeads = 4;  // query heads per pass: 4 heads x 4 vectors of V sums in registers
constexpr int64_t kMaxChunks = 8;  // 32-element chunks of a head: head_dim <= 256
constexpr int64_t kSlab = 64;  // output dims per V pass (4 vectors)

// A query head prepared for the q.k loop, zero past head_dim.
struct QueryBf16 {
    __m512i pairs[kMaxChunks];  // 32 bf16 per chunk, as VDPBF16PS pairs them
};
struct QueryFp32 {
    __m512 odd[kMaxChunks], even[kMaxChunks];  // elements 32c + 2i + 1 and 32c + 2i in lane i
};

inline void prepare(const bf16_bits* q, int64_t head_dim, QueryBf16& out) {
    for (int64_t c = 0; c * 32 < head_dim; ++c)
        out.pairs[c] = _mm512_maskz_loadu_epi16(first_lanes32(head_dim - 32 * c), q + 32 * c);
}

// Even and odd elements of 32 floats at p (zeros past n).
inline void split_even_odd(const float* p, int64_t n, __m512& even, __m512& odd) {
    const __m512i even_index = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd_index = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512 lo = _mm512_maskz_loadu_ps(first_lanes16(n), p);
    const __m512 hi = _mm512_maskz_loadu_ps(first_lanes16(n - 16), p + 16);
    even = _mm512_permutex2var_ps(lo, even_index, hi);
    odd = _mm512_permutex2var_ps(lo, odd_index, hi);
}

inline void prepare(const float* q, int64_t head_dim, QueryFp32& out) {
    for (int64_t c = 0; c * 32 < head_dim; ++c) split_even_odd(q + 32 * c, head_dim - 32 * c, out.even[c], out.odd[c]);
}

// One key's partial dot products (16 lanes; their sum is q.k) over NC chunks of 32 elements, the
// last one holding `tail` of them. NC is a compile-time count so the 16 keys' loops unroll flat.
template <int NC>
inline __m512 partial_dot(const QueryBf16& q, const bf16_bits* k, int64_t tail) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) {
        const __m512i kc = c + 1 < NC ? _mm512_loadu_si512(k + 32 * c) : _mm512_maskz_loadu_epi16(first_lanes32(tail), k + 32 * c);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)q.pairs[c], (__m512bh)kc);
    }
    return acc;
}

template <int NC>
inline __m512 partial_dot(const QueryFp32& q, const float* k, int64_t tail) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) {
        __m512 even, odd;
        split_even_odd(k + 32 * c, c + 1 < NC ? 32 : tail, even, odd);
        acc = _mm512_fmadd_ps(q.odd[c], odd, acc);  // VDPBF16PS's order: the odd product first
        acc = _mm512_fmadd_ps(q.even[c], even, acc);
    }
    return acc;
}

// [sum(a[0]), ..., sum(a[15])]: a transposing tree of adds (each level halves the vectors and
// doubles the keys per vector), then one permute into key order.
inline __m512 sum_each(const __m512* a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)  // 128-bit lanes: a_i's (q0+q2, q1+q3), then a_{i+8}'s
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)  // 128-bit lanes: keys i, i + 8, i + 4, i + 12
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i) {  // per 128-bit lane: two floats of c_i's key, two of c_{i+2}'s
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(c[i]), _mm512_castps_pd(c[i + 2]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(c[i]), _mm512_castps_pd(c[i + 2]));
        d[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // e's lanes hold keys 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15.
    const __m512i order = _mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0);
    return _mm512_permutexvar_ps(order, e);
}

// scores[h * stride + t] = scale * q_h.k_t for t < n (then -inf up to the next multiple of 16);
// returns nothing but fills peaks[h] with each head's max score.
template <int NC, typename T, typename Q>
void key_scores(const Task<T>& task, const Q* queries, int64_t num_heads, int64_t n, float scale, float* scores,
                int64_t stride, float* peaks) {
    const int64_t tail = task.head_dim - 32 * (NC - 1);
    __m512 peak[kMaxHeads];
    for (int64_t h = 0; h < num_heads; ++h) peak[h] = _mm512_set1_ps(-__builtin_inff());
    const __m512 scale_v = _mm512_set1_ps(scale);
    const T* rows[kKeys];
    const T* next_rows[kKeys];
    // What of the next group's cache rows to fetch, and to which level. A kv head's 128 B of a row
    // lie between the other heads' (384 B a row for SmolLM2's 3): fetched head by head, each
    // task's rows came from DRAM at a few lines in flight, some 6 GB/s on a Zen 4 core. The first
    // kv head's task of a decode step fetches whole rows into L2 (its `keys` start at a row's first
    // element: kv head 0), so that the sequence's next tasks, the same thread's, read theirs there.
    const int64_t fetch_bytes = (task.fetch_all_heads ? task.token_stride : task.head_dim) * static_cast<int64_t>(sizeof(T));
    group_rows<kKeys>(task, 0, n, next_rows);
    for (int64_t first = 0; first < n; first += kKeys) {
        for (int64_t i = 0; i < kKeys; ++i) rows[i] = next_rows[i];
        if (first + kKeys < n) {
            // The next group's K rows, fetched while this one is scored (blocks lie scattered, in
            // DRAM or L3 for a real pool), and its V rows, which the V pass reads once this pass ends
            // (a context's V rows for one kv head fit in L2: 128 B a row).
            group_rows<kKeys>(task, first + kKeys, n, next_rows);
            for (int64_t i = 0; i < kKeys; ++i) {
                const char* key = reinterpret_cast<const char*>(next_rows[i]);
                const char* value = reinterpret_cast<const char*>(task.values + (next_rows[i] - task.keys));
                for (int64_t b = 0; b < fetch_bytes; b += 64) {
                    if (task.fetch_all_heads) {
                        _mm_prefetch(key + b, _MM_HINT_T1);
                        _mm_prefetch(value + b, _MM_HINT_T2);
                    } else {
                        _mm_prefetch(key + b, _MM_HINT_T0);
                        _mm_prefetch(value + b, _MM_HINT_T1);
                    }
                }
            }
        }
        const __mmask16 valid = first_lanes16(n - first);
        for (int64_t h = 0; h < num_heads; ++h) {
            __m512 acc[kKeys];
#pragma GCC unroll 16
            for (int i = 0; i < kKeys; ++i) acc[i] = partial_dot<NC>(queries[h], rows[i], tail);
            const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), valid, _mm512_mul_ps(sum_each(acc), scale_v));
            _mm512_storeu_ps(scores + h * stride + first, s);
            peak[h] = _mm512_max_ps(peak[h], s);
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) peaks[h] = _mm512_reduce_max_ps(peak[h]);
}

template <typename T, typename Q>
void key_scores_any(const Task<T>& task, const Q* queries, int64_t num_heads, int64_t n, float scale, float* scores,
                    int64_t stride, float* peaks) {
    switch ((task.head_dim + 31) / 32) {
        case 1: return key_scores<1>(task, queries, num_heads, n, scale, scores, stride, peaks);
        case 2: return key_scores<2>(task, queries, num_heads, n, scale, scores, stride, peaks);
        case 3: return key_scores<3>(task, queries, num_heads, n, scale, scores, stride, peaks);
        case 4: return key_scores<4>(task, queries, num_heads, n, scale, scores, stride, peaks);
        case 5: return key_scores<5>(task, queries, num_heads, n, scale, scores, stride, peaks);
        case 6: return key_scores<6>(task, queries, num_heads, n, scale, scores, stride, peaks);
        case 7: return key_scores<7>(task, queries, num_heads, n, scale, scores, stride, peaks);
        default: return key_scores<8>(task, queries, num_heads, n, scale, scores, stride, peaks);
    }
}

// In place: scores[0, n) <- softmax, in fp32 with the max subtracted (zeros up to the next 16).
inline void softmax(float* scores, int64_t n, float peak) {
    const __m512 peak_v = _mm512_set1_ps(peak);
    __m512 total_v = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += kKeys) {
        const __m512 e = _mm512_maskz_mov_ps(first_lanes16(n - t),
                                             exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + t), peak_v)));
        _mm512_storeu_ps(scores + t, e);
        total_v = _mm512_add_ps(total_v, e);
    }
    const __m512 inv_v = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total_v));
    for (int64_t t = 0; t < n; t += kKeys) _mm512_storeu_ps(scores + t, _mm512_mul_ps(_mm512_loadu_ps(scores + t), inv_v));
}

// Into L1: this kv head's V rows of a block the V pass reads next.
template <typename T>
inline void fetch_value_block(const Task<T>& task, int32_t block) {
    const int64_t row_bytes = task.head_dim * static_cast<int64_t>(sizeof(T));
    const char* rows = reinterpret_cast<const char*>(task.values + block * task.block_stride);
    for (int64_t r = 0; r < task.block_size; ++r)
        for (int64_t b = 0; b < row_bytes; b += 64)
            _mm_prefetch(rows + r * task.token_stride * static_cast<int64_t>(sizeof(T)) + b, _MM_HINT_T0);
}

// out_h[d0, d0 + 16 * NV) = sum_t probs[h * stride + t] * V_t[d0, ...] for NH heads, the sums in
// registers across all n keys; V rows are read (and widened) once for all NH heads. The loops over
// heads and vectors are unrolled by pragma: left to GCC, it kept the sums in memory and stored all
// of them at every key: twelve 64-byte stores a key for 3 heads of 64.
template <typename T, int NH, int NV>
void weighted_values(const Task<T>& task, const float* probs, int64_t stride, int64_t n, int64_t d0, T* const* outs) {
    __m512 acc[NH][NV];
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
    __mmask16 masks[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) masks[v] = first_lanes16(task.head_dim - d0 - 16 * v);
    for (int64_t first = 0, c = 0; first < n; first += task.block_size, ++c) {
        if (first + task.block_size < n) fetch_value_block(task, task.table[c + 1]);
        const T* row = task.values + task.table[c] * task.block_stride + d0;
        const int64_t rows = min64(task.block_size, n - first);
        for (int64_t r = 0; r < rows; ++r, row += task.token_stride) {
            __m512 v[NV];
#pragma GCC unroll 4
            for (int i = 0; i < NV; ++i) v[i] = load16(row + 16 * i, masks[i]);
#pragma GCC unroll 4
            for (int h = 0; h < NH; ++h) {
                const __m512 p = _mm512_set1_ps(probs[h * stride + first + r]);
#pragma GCC unroll 4
                for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_fmadd_ps(p, v[i], acc[h][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
        for (int i = 0; i < NV; ++i) store16(outs[h] + d0 + 16 * i, acc[h][i], masks[i]);
}

template <typename T, int NH>
void weighted_values_slab(const Task<T>& task, const float* probs, int64_t stride, int64_t n, int64_t d0, T* const* outs) {
    switch ((min64(kSlab, task.head_dim - d0) + 15) / 16) {
        case 1: return weighted_values<T, NH, 1>(task, probs, stride, n, d0, outs);
        case 2: return weighted_values<T, NH, 2>(task, probs, stride, n, d0, outs);
        case 3: return weighted_values<T, NH, 3>(task, probs, stride, n, d0, outs);
        default: return weighted_values<T, NH, 4>(task, probs, stride, n, d0, outs);
    }
}

// weighted_values for a bf16 cache and whole 32-element chunks (NP of them from d0): a 64-byte load
// of a V row is its 32 elements' fp32 values in two vectors, the even elements (shifted up 16 bits)
// and the odd ones (masked), with no widening shuffle; each output element gets the same products
// in the same order as in weighted_values, from the lane that holds it, and the two vectors are
// interleaved back into element order once, at the end.
template <int NH, int NP>
void weighted_values_pairs(const Task<bf16_bits>& task, const float* probs, int64_t stride, int64_t n, int64_t d0,
                           bf16_bits* const* outs) {
    __m512 even[NH][NP], odd[NH][NP];
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NP; ++c) even[h][c] = odd[h][c] = _mm512_setzero_ps();
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t first = 0, b = 0; first < n; first += task.block_size, ++b) {
        if (first + task.block_size < n) fetch_value_block(task, task.table[b + 1]);
        const bf16_bits* row = task.values + task.table[b] * task.block_stride + d0;
        const int64_t rows = min64(task.block_size, n - first);
        for (int64_t r = 0; r < rows; ++r, row += task.token_stride) {
            __m512 v_even[NP], v_odd[NP];
#pragma GCC unroll 4
            for (int c = 0; c < NP; ++c) {
                const __m512i pairs = _mm512_loadu_si512(row + 32 * c);
                v_even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                v_odd[c] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
            }
#pragma GCC unroll 4
            for (int h = 0; h < NH; ++h) {
                const __m512 p = _mm512_set1_ps(probs[h * stride + first + r]);
#pragma GCC unroll 4
                for (int c = 0; c < NP; ++c) {
                    even[h][c] = _mm512_fmadd_ps(p, v_even[c], even[h][c]);
                    odd[h][c] = _mm512_fmadd_ps(p, v_odd[c], odd[h][c]);
                }
            }
        }
    }
    // Lane j of the first half: even[j / 2] or odd[j / 2] (index bit 4 picks the second source).
    const __m512i first_half = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NP; ++c) {
            bf16_bits* out = outs[h] + d0 + 32 * c;
            store16(out, _mm512_permutex2var_ps(even[h][c], first_half, odd[h][c]), 0xffff);
            store16(out + 16, _mm512_permutex2var_ps(even[h][c], second_half, odd[h][c]), 0xffff);
        }
}

template <int NH>
void weighted_values_slab_bf16(const Task<bf16_bits>& task, const float* probs, int64_t stride, int64_t n,
                               int64_t d0, bf16_bits* const* outs) {
    if (task.head_dim % 32 != 0) return weighted_values_slab<bf16_bits, NH>(task, probs, stride, n, d0, outs);
    if (task.head_dim - d0 >= 64) return weighted_values_pairs<NH, 2>(task, probs, stride, n, d0, outs);
    return weighted_values_pairs<NH, 1>(task, probs, stride, n, d0, outs);
}

template <typename T>
void weighted_values_all(const Task<T>& task, const float* probs, int64_t stride, int64_t num_heads, int64_t n,
                         T* const* outs) {
    for (int64_t d0 = 0; d0 < task.head_dim; d0 += kSlab) {
        if constexpr (std::is_same_v<T, bf16_bits>) {
            switch (num_heads) {
                case 1: weighted_values_slab_bf16<1>(task, probs, stride, n, d0, outs); break;
                case 2: weighted_values_slab_bf16<2>(task, probs, stride, n, d0, outs); break;
                case 3: weighted_values_slab_bf16<3>(task, probs, stride, n, d0, outs); break;
                default: weighted_values_slab_bf16<4>(task, probs, stride, n, d0, outs); break;
            }
            continue;
        }
        switch (num_heads) {
            case 1: weighted_values_slab<T, 1>(task, probs, stride, n, d0, outs); break;
            case 2: weighted_values_slab<T, 2>(task, probs, stride, n, d0, outs); break;
            case 3: weighted_values_slab<T, 3>(task, probs, stride, n, d0, outs); break;
            default: weighted_values_slab<T, 4>(task, probs, stride, n, d0, outs); break;
        }
    }
}

template <typename T, typename Q>
void attend(const carpool::PagedAttentionArgs& args, int64_t task_id, int64_t first_j, int64_t end_j,
            bool next_tasks_share_rows, float* scratch) {
    const SequenceTask<T> st = sequence_task<T>(args, task_id, next_tasks_share_rows);
    const int64_t kv = st.kv, first_row = st.first_row, q_len = st.q_len, ctx = st.ctx;
    if (q_len == 0 || q_len > args.max_query_rows) return;
    const int64_t group = args.num_heads / args.num_kv_heads, head_dim = args.head_dim;
    const Task<T>& task = st.cache;
    const int64_t stride = (ctx + kKeys - 1) / kKeys * kKeys;  // one head's scores, padded to whole groups
    const T* q = static_cast<const T*>(args.query);
    T* o = static_cast<T*>(args.out);
    Q queries[kMaxHeads];
    float peaks[kMaxHeads];
    T* outs[kMaxHeads];
    for (int64_t j = first_j; j < min64(end_j, q_len); ++j) {
        const int64_t row = first_row + j, num_keys = ctx - q_len + j + 1;  // causal: keys 0..position
        for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
            const int64_t heads = min64(kMaxHeads, group - g0);
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t head = kv * group + g0 + h;
                prepare(q + row * args.q_token_stride + head * args.q_head_stride, head_dim, queries[h]);
                outs[h] = o + (row * args.num_heads + head) * head_dim;
            }
            key_scores_any(task, queries, heads, num_keys, args.scale, scratch, stride, peaks);
            for (int64_t h = 0; h < heads; ++h) softmax(scratch + h * stride, num_keys, peaks[h]);
            weighted_values_all(task, scratch, stride, heads, num_keys, outs);
        }
    }
}

}  // namespace
}  // namespace carpool512

namespace carpool {

int64_t avx512_attention_scratch_floats(int64_t max_ctx) {
    return carpool512::kMaxHeads * ((max_ctx + carpool512::kKeys - 1) / carpool512::kKeys * carpool512::kKeys);
}

int64_t avx512_attention_max_head_dim() { return 32 * carpool512::kMaxChunks; }

void paged_attention_task_avx512_bf16(const PagedAttentionArgs& args, int64_t task, int64_t first_row,
                                      int64_t end_row, bool next_tasks_share_rows, float* scratch) {
    carpool512::attend<carpool512::bf16_bits, carpool512::QueryBf16>(args, task, first_row, end_row,
                                                                     next_tasks_share_rows, scratch);
}

void paged_attention_task_avx512_fp32(const PagedAttentionArgs& args, int64_t task, int64_t first_row,
                                      int64_t end_row, bool next_tasks_share_rows, float* scratch) {
    carpool512::attend<float, carpool512::QueryFp32>(args, task, first_row, end_row, next_tasks_share_rows, scratch);
}

}  // namespace carpool

CARPOOL_AVX512_END

#else  // no AVX-512 build: never called (active_isa() is always kAvx2)

namespace carpool {
int64_t avx512_attention_scratch_floats(int64_t) { return 0; }
int64_t avx512_attention_max_head_dim() { return 0; }
void paged_attention_task_avx512_bf16(const PagedAttentionArgs&, int64_t, int64_t, int64_t, bool, float*) {}
void paged_attention_task_avx512_fp32(const PagedAttentionArgs&, int64_t, int64_t, int64_t, bool, float*) {}
}  // namespace carpool

#endif
