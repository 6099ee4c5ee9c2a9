// paged_attention_cpu's AVX2 path (8 lanes, fp32 arithmetic on an fp32 or bf16 cache), one task at a
// time: a (sequence, kv head) pair's query rows, or a part of a long chunk's; paged_attention_cpu.cpp
// deals out the tasks and picks this path on CPUs without AVX-512 (or where CARPOOL_CPU_ISA pins it).
// The torch twin (kernels/torch_paged_attention.py) is its specification.
//
// Why it reads the cache where it lies: a decode step's attention reads each context's K and V once,
// so it is bound by those reads. This path used to copy a task's K and V rows into contiguous fp32
// scratch first and read them back: on a 2-vCPU Zen 3 EPYC, 128 decodes over 50..1,100 positions
// (113 MB of fp32 K/V a layer) took 18.5 ms a layer at one thread, 6 GB/s where one core streams
// 19; perf put two thirds of the time on the copy's stores and the prefetch loops. In place, at two
// threads: 9.8-10.1 ms a layer -> 8.4-8.8, and 64 decodes over 50..600 positions 2.6-2.8 -> 2.1-2.3
// (scripts/bench_kernels.py, fp32); in bf16 within 3 % of the copy (each query head widens the rows
// again). What is left is mostly the wait on DRAM: with the K/V in L3 the same kernel spends 24 ns a
// key and kv head, from DRAM 76 (one thread); fetching 8 to 64 keys ahead, or the pool on huge
// pages, changed it by less than the noise.
//
// Per query row and chunk of up to kMaxHeads query heads sharing the kv head: scores of keys 0..p,
// eight keys at a time (their partial sums reduced together), the other keys one at a time; a
// softmax in fp32 with the max subtracted; then the probability-weighted V rows accumulated in
// registers, a slab of output dims at a time for all the chunk's heads (each V row read once per
// slab, widened once for all of them).
//
// Rounding: every score, softmax and output element gets the same operations in the same order as
// the copying kernel did (sum_each over eight keys, horizontal_sum for the rest, V rows in key
// order), so the results are bit for bit what they were.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "avx2_math.h"
#include "paged_attention_args.h"

namespace {

#include "paged_attention_rows.h"  // Task, sequence_task, group_rows: inside this unit's namespace

using carpool::bf16;
using carpool::exp_nonpositive;
using carpool::horizontal_sum;
using carpool::load8;
using carpool::store8;

constexpr int64_t kKeys = 8;  // keys per score group: one per lane
// How far ahead of the keys being scored their rows are fetched: 64 keys, four blocks of 16 (on a
// 2-vCPU Zen 3 EPYC, 128 decodes over 50..1,100 positions at two threads: 8.36-8.41 ms a layer,
// against 8.45-8.46 at 16 keys; at one thread 8 to 64 keys all within 16.0-17.7 ms).
constexpr int64_t kFetchAhead = 64;
constexpr int64_t kMaxHeads = 3;  // query heads per pass over K and V
constexpr int kMaxSums = 12;  // V sums held in registers per slab (of AVX2's 16), over all its heads

// [sum(a0), sum(a1), ..., sum(a7)]: eight dot products finished in eight instructions, not forty.
inline __m256 sum_each(const __m256* a) {
    // hadd pairs neighbours within each 128-bit half; after two rounds each half holds four sums.
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// The K rows of a group of keys (and their V rows, which the V pass reads once this pass ends),
// fetched kFetchAhead keys before they are scored: blocks lie scattered, in DRAM for a real pool. A
// kv head's part of a row lies between the other heads' (768 B a fp32 row for SmolLM2's 3 heads of
// 64): the first kv head's task of a decode step fetches whole rows, into L2, so that the
// sequence's next tasks, the same thread's, read theirs there.
template <typename T>
inline void fetch_rows(const Task<T>& task, const T* const* rows) {
    const int64_t fetch_bytes = (task.fetch_all_heads ? task.token_stride : task.head_dim) * static_cast<int64_t>(sizeof(T));
    for (int64_t i = 0; i < kKeys; ++i) {
        const char* key = reinterpret_cast<const char*>(rows[i]);
        const char* value = reinterpret_cast<const char*>(task.values + (rows[i] - task.keys));
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

// scores[h * stride + t] = scale * q_h.k_t for t < n, for num_heads heads (queries: fp32, head_dim
// apart); peaks[h] = each head's max score.
template <typename T>
void key_scores(const Task<T>& task, const float* queries, int64_t num_heads, int64_t n, float scale, float* scores,
                int64_t stride, float* peaks) {
    const int64_t head_dim = task.head_dim;
    const __m256 scale_v = _mm256_set1_ps(scale);
    __m256 peak_v[kMaxHeads];
    for (int64_t h = 0; h < num_heads; ++h) peak_v[h] = _mm256_set1_ps(-INFINITY);
    const T* rows[kKeys];
    const T* ahead_rows[kKeys];
    for (int64_t first = 0; first < kFetchAhead && first < n; first += kKeys) {
        group_rows<kKeys>(task, first, n, ahead_rows);
        fetch_rows(task, ahead_rows);
    }
    int64_t first = 0;
    for (; first < n; first += kKeys) {
        group_rows<kKeys>(task, first, n, rows);
        if (first + kFetchAhead < n) {
            group_rows<kKeys>(task, first + kFetchAhead, n, ahead_rows);
            fetch_rows(task, ahead_rows);
        }
        if (first + kKeys > n) break;  // the last keys, fewer than eight: one at a time, below
        for (int64_t h = 0; h < num_heads; ++h) {
            const float* q = queries + h * head_dim;
            __m256 a[kKeys];
            for (int j = 0; j < kKeys; ++j) a[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < head_dim; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
                for (int j = 0; j < kKeys; ++j) a[j] = _mm256_fmadd_ps(qv, load8(rows[j] + i), a[j]);
            }
            const __m256 v = _mm256_mul_ps(sum_each(a), scale_v);
            _mm256_storeu_ps(scores + h * stride + first, v);
            peak_v[h] = _mm256_max_ps(peak_v[h], v);
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, peak_v[h]);
        peaks[h] = -INFINITY;
        for (float lane : lanes) peaks[h] = std::max(peaks[h], lane);
    }
    for (int64_t t = first, i = 0; t < n; ++t, ++i) {
        for (int64_t h = 0; h < num_heads; ++h) {
            const float* q = queries + h * head_dim;
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(rows[i] + d), a);
            const float score = horizontal_sum(a) * scale;
            scores[h * stride + t] = score;
            peaks[h] = std::max(peaks[h], score);
        }
    }
}

// In place: scores <- softmax(scores), in fp32 with the maximum (peak) subtracted.
inline void softmax(float* scores, int64_t n, float peak) {
    const __m256 peak_v = _mm256_set1_ps(peak);
    __m256 total_v = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), peak_v));
        _mm256_storeu_ps(scores + t, e);
        total_v = _mm256_add_ps(total_v, e);
    }
    float total = horizontal_sum(total_v);
    for (; t < n; ++t) total += (scores[t] = std::exp(scores[t] - peak));
    const __m256 inv_v = _mm256_set1_ps(1.f / total);
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(scores + t, _mm256_mul_ps(_mm256_loadu_ps(scores + t), inv_v));
    for (; t < n; ++t) scores[t] *= 1.f / total;
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

// out_h[d0, d0 + 8 * NV) = sum_t probs[h * stride + t] * V_t[d0, ...] for NH heads, the sums in
// registers across all n keys (unrolled by pragma: left to GCC, the sums stayed in memory).
template <typename T, int NH, int NV>
void weighted_values(const Task<T>& task, const float* probs, int64_t stride, int64_t n, int64_t d0, T* const* outs) {
    __m256 acc[NH][NV];
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t first = 0, c = 0; first < n; first += task.block_size, ++c) {
        if (first + task.block_size < n) fetch_value_block(task, task.table[c + 1]);
        const T* row = task.values + task.table[c] * task.block_stride + d0;
        const int64_t rows = std::min(task.block_size, n - first);
        for (int64_t r = 0; r < rows; ++r, row += task.token_stride) {
            __m256 v[NV];
#pragma GCC unroll 8
            for (int i = 0; i < NV; ++i) v[i] = load8(row + 8 * i);
#pragma GCC unroll 4
            for (int h = 0; h < NH; ++h) {
                const __m256 p = _mm256_set1_ps(probs[h * stride + first + r]);
#pragma GCC unroll 8
                for (int i = 0; i < NV; ++i) acc[h][i] = _mm256_fmadd_ps(p, v[i], acc[h][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
        for (int i = 0; i < NV; ++i) store8(outs[h] + d0 + 8 * i, acc[h][i]);
}

// Up to kMaxSums / NH vectors of output dims from d0 (fewer where the head ends sooner); returns how
// many dims it did.
template <typename T, int NH>
int64_t weighted_values_slab(const Task<T>& task, const float* probs, int64_t stride, int64_t n, int64_t d0,
                             T* const* outs) {
    const int64_t vectors = std::min<int64_t>(std::min(8, kMaxSums / NH), (task.head_dim - d0) / 8);
    switch (vectors) {
        case 1: weighted_values<T, NH, 1>(task, probs, stride, n, d0, outs); break;
        case 2: weighted_values<T, NH, 2>(task, probs, stride, n, d0, outs); break;
        case 3: weighted_values<T, NH, 3>(task, probs, stride, n, d0, outs); break;
        case 4: weighted_values<T, NH, 4>(task, probs, stride, n, d0, outs); break;
        case 5: weighted_values<T, NH, 5>(task, probs, stride, n, d0, outs); break;
        case 6: weighted_values<T, NH, 6>(task, probs, stride, n, d0, outs); break;
        case 7: weighted_values<T, NH, 7>(task, probs, stride, n, d0, outs); break;
        default: weighted_values<T, NH, 8>(task, probs, stride, n, d0, outs); break;
    }
    return 8 * vectors;
}

template <typename T>
void weighted_values_all(const Task<T>& task, const float* probs, int64_t stride, int64_t num_heads, int64_t n,
                         T* const* outs) {
    for (int64_t d0 = 0; d0 < task.head_dim;) {
        switch (num_heads) {
            case 1: d0 += weighted_values_slab<T, 1>(task, probs, stride, n, d0, outs); break;
            case 2: d0 += weighted_values_slab<T, 2>(task, probs, stride, n, d0, outs); break;
            default: d0 += weighted_values_slab<T, 3>(task, probs, stride, n, d0, outs); break;
        }
    }
}

template <typename T>
void attend(const carpool::PagedAttentionArgs& args, int64_t task_id, int64_t first_j, int64_t end_j,
            bool next_tasks_share_rows, float* scratch) {
    const SequenceTask<T> st = sequence_task<T>(args, task_id, next_tasks_share_rows);
    const int64_t kv = st.kv, first_row = st.first_row, q_len = st.q_len, ctx = st.ctx;
    if (q_len == 0 || q_len > args.max_query_rows) return;
    const int64_t group = args.num_heads / args.num_kv_heads, head_dim = args.head_dim;
    const Task<T>& task = st.cache;
    const int64_t stride = ctx;  // one head's scores
    float* queries = scratch + kMaxHeads * stride;  // the chunk's query heads in fp32, head_dim apart
    const T* q = static_cast<const T*>(args.query);
    T* o = static_cast<T*>(args.out);
    T* outs[kMaxHeads];
    float peaks[kMaxHeads];
    for (int64_t j = first_j; j < std::min(end_j, q_len); ++j) {
        const int64_t row = first_row + j, num_keys = ctx - q_len + j + 1;  // causal: keys 0..position
        for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
            const int64_t heads = std::min(kMaxHeads, group - g0);
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t head = kv * group + g0 + h;
                const T* q_head = q + row * args.q_token_stride + head * args.q_head_stride;
                for (int64_t i = 0; i < head_dim; i += 8) _mm256_storeu_ps(queries + h * head_dim + i, load8(q_head + i));
                outs[h] = o + (row * args.num_heads + head) * head_dim;
            }
            key_scores(task, queries, heads, num_keys, args.scale, scratch, stride, peaks);
            for (int64_t h = 0; h < heads; ++h) softmax(scratch + h * stride, num_keys, peaks[h]);
            weighted_values_all(task, scratch, stride, heads, num_keys, outs);
        }
    }
}

}  // namespace

namespace carpool {

int64_t avx2_attention_scratch_floats(int64_t max_ctx, int64_t head_dim) { return kMaxHeads * (max_ctx + head_dim); }

void paged_attention_task_avx2_bf16(const PagedAttentionArgs& args, int64_t task, int64_t first_row, int64_t end_row,
                                    bool next_tasks_share_rows, float* scratch) {
    attend<bf16>(args, task, first_row, end_row, next_tasks_share_rows, scratch);
}

void paged_attention_task_avx2_fp32(const PagedAttentionArgs& args, int64_t task, int64_t first_row, int64_t end_row,
                                    bool next_tasks_share_rows, float* scratch) {
    attend<float>(args, task, first_row, end_row, next_tasks_share_rows, scratch);
}

}  // namespace carpool
