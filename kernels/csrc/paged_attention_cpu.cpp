// paged_attention_cpu: causal attention of a few query rows per sequence over its paged K/V cache,
// fp32 or bf16 (computed in fp32) on AVX2 CPUs, and on AVX-512 CPUs through
// paged_attention_avx512.cpp (picked at run time, carpool::active_isa()). The pure-torch twin (kernels/torch_paged_attention.py)
// is its specification.
//
// Why: in a decode step each sequence has one query row and a short context. The twin gathers
// every context into a padded tensor and calls SDPA; at these sizes the gather and SDPA's own
// set-up cost more than the arithmetic (a third of a mid-size decode step). This kernel reads
// K/V where they lie, through the block table.
//
// Algorithm, per (sequence, kv head) task: the context's K and V rows are read once through the
// block table into contiguous fp32 scratch (widened from bf16 there, once, not once per query
// head); it stays in L1/L2 while every query row j (absolute position p) of every query head
// sharing the kv head takes its scores against keys 0..p (eight keys at a time, reduced together),
// a softmax in fp32 with the max subtracted, and the weighted sum of V rows accumulated in
// registers. Sequences with more query rows than max_query_rows are skipped (left untouched in
// `out`): the caller hands them to the twin.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "avx2_math.h"
#include "cpu_isa.h"
#include "paged_attention_args.h"

namespace {

using carpool::exp_nonpositive;
using carpool::horizontal_sum;
using carpool::load8;
using carpool::store8;

// [sum(a0), sum(a1), ..., sum(a7)]: eight dot products finished in eight instructions, not forty.
inline __m256 sum_each(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    // hadd pairs neighbours within each 128-bit half; after two rounds each half holds four sums.
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[t] = scale * <q, keys[t]> for t < n; keys: [n, head_dim] fp32 contiguous. Returns the max.
inline float key_scores(const float* q, const float* keys, int64_t n, int64_t head_dim, float scale, float* scores) {
    const __m256 scale_v = _mm256_set1_ps(scale);
    __m256 peak_v = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const float* k = keys + t * head_dim;
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 8) {
            const __m256 qv = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * head_dim + i), a[j]);
        }
        const __m256 v = _mm256_mul_ps(sum_each(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), scale_v);
        _mm256_storeu_ps(scores + t, v);
        peak_v = _mm256_max_ps(peak_v, v);
    }
    float peak = -INFINITY;
    {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, peak_v);
        for (float lane : lanes) peak = std::max(peak, lane);
    }
    for (; t < n; ++t) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(keys + t * head_dim + i), a);
        scores[t] = horizontal_sum(a) * scale;
        peak = std::max(peak, scores[t]);
    }
    return peak;
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

// out = sum_t probs[t] * values[t]; values: [n, head_dim] fp32 contiguous. Up to 64 output floats
// are held in registers across all keys.
template <typename T>
inline void weighted_values(const float* probs, const float* values, int64_t n, int64_t head_dim, T* out) {
    for (int64_t d = 0; d < head_dim; d += 64) {
        const int num_vecs = static_cast<int>(std::min<int64_t>(64, head_dim - d) / 8);
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        if (num_vecs == 8) {  // the common head_dim 64 / 128: a fixed trip count GCC unrolls
            for (int64_t t = 0; t < n; ++t) {
                const __m256 p = _mm256_set1_ps(probs[t]);
                const float* v = values + t * head_dim + d;
                for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
            }
        } else {
            for (int64_t t = 0; t < n; ++t) {
                const __m256 p = _mm256_set1_ps(probs[t]);
                const float* v = values + t * head_dim + d;
                for (int i = 0; i < num_vecs; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
            }
        }
        for (int i = 0; i < num_vecs; ++i) store8(out + d + 8 * i, acc[i]);
    }
}

// dst[t, :] = row t of the context (through the block table), widened to fp32, block by block.
// The next block is prefetched while this one is copied: blocks lie scattered (in DRAM for all
// but the smallest pools), and without it each row waited for its own miss. The first kv head's
// task prefetches the whole block, every head's rows in one sequential run, so that the tasks of
// the sequence's other kv heads, next on the same thread, find their rows in L2.
template <typename T>
inline void gather_rows(const T* cache, const int32_t* table, int64_t n, int64_t block_size, int64_t block_stride,
                        int64_t token_stride, int64_t head_offset, int64_t head_dim, float* dst) {
    const int64_t block_bytes = block_stride * static_cast<int64_t>(sizeof(T));
    const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
    const int64_t token_bytes = token_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t first = 0, c = 0; first < n; first += block_size, ++c) {
        if (first + block_size < n) {
            const char* next = reinterpret_cast<const char*>(cache + table[c + 1] * block_stride);
            if (head_offset == 0) {
                for (int64_t b = 0; b < block_bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            } else {
                next += head_offset * static_cast<int64_t>(sizeof(T));
                for (int64_t r = 0; r < block_size; ++r)
                    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(next + r * token_bytes + b, _MM_HINT_T0);
            }
        }
        const T* row = cache + table[c] * block_stride + head_offset;
        const int64_t rows = std::min(block_size, n - first);
        float* out = dst + first * head_dim;
        for (int64_t r = 0; r < rows; ++r, row += token_stride, out += head_dim)
            for (int64_t i = 0; i < head_dim; i += 8) _mm256_storeu_ps(out + i, load8(row + i));
    }
}

// Values the kernel would follow blindly; std::invalid_argument reaches Python as ValueError.
void check_lengths_and_tables(const int32_t* starts, const int32_t* lens, const int32_t* tables, int64_t num_seqs,
                              int64_t table_width, int64_t block_size, int64_t num_blocks, int64_t num_tokens) {
    if (starts[num_seqs] > num_tokens)
        throw std::invalid_argument("query_start_loc ends at " + std::to_string(starts[num_seqs]) +
                                    " but query has only " + std::to_string(num_tokens) + " rows");
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = starts[s + 1] - starts[s], ctx = lens[s];
        if (q_len < 0 || ctx < q_len || ctx > table_width * block_size)
            throw std::invalid_argument("sequence " + std::to_string(s) + ": need 0 <= query_len (" + std::to_string(q_len) +
                                        ") <= seq_len (" + std::to_string(ctx) + ") <= max_num_blocks_per_seq * block_size (" +
                                        std::to_string(table_width * block_size) + ")");
        for (int64_t c = 0; c < (ctx + block_size - 1) / block_size; ++c) {
            const int64_t block = tables[s * table_width + c];
            if (block < 0 || block >= num_blocks)
                throw std::invalid_argument("block_tables[" + std::to_string(s) + ", " + std::to_string(c) + "] = " +
                                            std::to_string(block) + " is not a block id in [0, " + std::to_string(num_blocks) + ")");
        }
    }
}

// block_tables: [num_seqs, width] int32; seq_lens: [num_seqs] int32; query_start_loc: [num_seqs + 1] int32.
template <typename T>
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t max_query_rows, at::Tensor& out) {
    // Shapes, dtypes and strides are checked by the Python wrapper; lengths and block ids here.
    const int64_t num_seqs = seq_lens.size(0), num_heads = query.size(1), head_dim = query.size(2);
    const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
    const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
    const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
    const int64_t q_token_stride = query.stride(0), q_head_stride = query.stride(1);
    const T* q = query.data_ptr<T>();
    const T* kc = key_cache.data_ptr<T>();
    const T* vc = value_cache.data_ptr<T>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int32_t* starts = query_start_loc.data_ptr<int32_t>();
    T* o = out.data_ptr<T>();
    const float fscale = static_cast<float>(scale);
    check_lengths_and_tables(starts, lens, tables, num_seqs, table_width, block_size, key_cache.size(0), query.size(0));

    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;  // one query head's scores over the context
        std::vector<float> q_row(static_cast<size_t>(head_dim));  // the query head, in fp32
        std::vector<float> keys, values;  // the task's context K/V rows, fp32, contiguous
        for (int64_t task = begin; task < end; ++task) {
            const int64_t s = task / num_kv_heads, kv = task % num_kv_heads;
            const int64_t first_row = starts[s], q_len = starts[s + 1] - starts[s], ctx = lens[s];
            if (q_len == 0 || q_len > max_query_rows) continue;
            const int32_t* table = tables + s * table_width;
            scores.resize(static_cast<size_t>(ctx));
            keys.resize(static_cast<size_t>(ctx * head_dim));
            values.resize(static_cast<size_t>(ctx * head_dim));
            gather_rows(kc, table, ctx, block_size, block_stride, token_stride, kv * head_dim, head_dim, keys.data());
            gather_rows(vc, table, ctx, block_size, block_stride, token_stride, kv * head_dim, head_dim, values.data());
            for (int64_t j = 0; j < q_len; ++j) {
                const int64_t row = first_row + j, num_keys = ctx - q_len + j + 1;  // causal: keys 0..position
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t head = kv * group + g;
                    const T* q_head = q + row * q_token_stride + head * q_head_stride;
                    for (int64_t i = 0; i < head_dim; i += 8) _mm256_storeu_ps(q_row.data() + i, load8(q_head + i));
                    const float peak = key_scores(q_row.data(), keys.data(), num_keys, head_dim, fscale, scores.data());
                    softmax(scores.data(), num_keys, peak);
                    weighted_values(scores.data(), values.data(), num_keys, head_dim, o + (row * num_heads + head) * head_dim);
                }
            }
        }
    });
}

// Query rows of a long chunk per task of the AVX-512 path (a decode step has one per sequence).
constexpr int64_t kRowsPerPart = 32;
// A bf16 sequence with this many rows in the step or more goes to chunk_attention.cpp (AMX tiles,
// or without AMX VDPBF16PS blocks in tile order). Against the row-by-row scan, one sequence, 9 heads
// over 3: AMX on a 2-core Xeon, 16 rows after 128, 512, 1,000, 2,000 positions 1.3x, 1.8x, 1.5x,
// 1.6x (8 rows: 0.7-1.0x); from position 0, 16 rows 0.5x (16 against 31 us a layer: a prompt that
// short is rare), 32 rows 1.15x, 64 1.5x, 128 2.4x. AVX512-BF16 on a 2-vCPU Zen 5 EPYC, 16 rows
// after 128, 512, 2,000 positions 1.2x, 1.7x, 2.1x (from 0: 0.85x), 32 rows 1.1-2.7x, 128 rows
// 1.65-2.9x; 8 rows 0.8-1.5x.
constexpr int64_t kChunkMinRows = 16;

// The AVX-512 path: the same tasks, each run by paged_attention_avx512.cpp.
template <typename T>
void paged_attention_avx512(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                            double scale, int64_t max_query_rows, at::Tensor& out) {
    carpool::PagedAttentionArgs args{};
    args.query = query.data_ptr<T>();
    args.key_cache = key_cache.data_ptr<T>();
    args.value_cache = value_cache.data_ptr<T>();
    args.tables = block_tables.data_ptr<int32_t>();
    args.lens = seq_lens.data_ptr<int32_t>();
    args.starts = query_start_loc.data_ptr<int32_t>();
    args.out = out.data_ptr<T>();
    args.num_heads = query.size(1);
    args.head_dim = query.size(2);
    args.block_size = key_cache.size(1);
    args.num_kv_heads = key_cache.size(2);
    args.table_width = block_tables.size(1);
    args.token_stride = args.num_kv_heads * args.head_dim;
    args.block_stride = args.block_size * args.token_stride;
    args.q_token_stride = query.stride(0);
    args.q_head_stride = query.stride(1);
    args.max_query_rows = max_query_rows;
    args.scale = static_cast<float>(scale);
    const int64_t num_seqs = seq_lens.size(0);
    check_lengths_and_tables(args.starts, args.lens, args.tables, num_seqs, args.table_width, args.block_size,
                             key_cache.size(0), query.size(0));
    if constexpr (std::is_same_v<T, carpool::bf16>) {
        if (carpool::chunk_attention_runs(args.head_dim)) {  // chunks of kChunkMinRows rows or more
            carpool::chunk_attention(args, num_seqs, kChunkMinRows, max_query_rows);
            max_query_rows = std::min(max_query_rows, kChunkMinRows - 1);
            args.max_query_rows = max_query_rows;
        }
    }
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < num_seqs; ++s) max_ctx = std::max<int64_t>(max_ctx, args.lens[s]);
    const size_t scratch_floats = static_cast<size_t>(carpool::avx512_attention_scratch_floats(max_ctx));
    const auto run = [&](int64_t task, int64_t first_row, int64_t end_row, bool next_tasks_share_rows, float* scratch) {
        if constexpr (std::is_same_v<T, float>)
            carpool::paged_attention_task_avx512_fp32(args, task, first_row, end_row, next_tasks_share_rows, scratch);
        else
            carpool::paged_attention_task_avx512_bf16(args, task, first_row, end_row, next_tasks_share_rows, scratch);
    };
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = args.starts[s + 1] - args.starts[s];
        if (q_len <= max_query_rows) longest = std::max(longest, q_len);
    }
    if (longest <= kRowsPerPart) {  // decodes and short chunks: a task per (sequence, kv head)
        at::parallel_for(0, num_seqs * args.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scratch(scratch_floats);  // the task's scores, per query head
            // A sequence's kv heads are consecutive tasks, mostly on one thread.
            for (int64_t task = begin; task < end; ++task) run(task, 0, kRowsPerPart, true, scratch.data());
        });
        return;
    }
    // A long chunk as (sequence, kv head) tasks alone kept a thread idle: one 1,024-row prompt with
    // 3 kv heads on 2 threads ran 2 tasks on one thread and 1 on the other. Its rows go out in parts
    // of kRowsPerPart, the costliest first (a part's keys grow with its rows' positions), each
    // thread taking the next part when it is done with one.
    struct Part {
        int64_t cost, task, first_row;
    };
    std::vector<Part> parts;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t q_len = args.starts[s + 1] - args.starts[s], before = args.lens[s] - q_len;
        if (q_len == 0 || q_len > max_query_rows) continue;
        for (int64_t first = 0; first < q_len; first += kRowsPerPart) {
            const int64_t rows = std::min(kRowsPerPart, q_len - first);
            for (int64_t kv = 0; kv < args.num_kv_heads; ++kv)
                parts.push_back({rows * (before + first + rows), s * args.num_kv_heads + kv, first});
        }
    }
    std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.cost > b.cost; });
    std::atomic<size_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        std::vector<float> scratch(scratch_floats);
        for (size_t i = next++; i < parts.size(); i = next++)
            run(parts[i].task, parts[i].first_row, parts[i].first_row + kRowsPerPart, false, scratch.data());
    });
}

// The AVX-512 path where this CPU has it (and it is not switched off) and the head fits its registers.
bool use_avx512(int64_t head_dim) {
    return carpool::active_isa() >= carpool::Isa::kAvx512Bf16 && head_dim <= carpool::avx512_attention_max_head_dim();
}

}  // namespace

// query: [num_tokens, num_heads, head_dim], head_dim contiguous; out: the same shape and dtype, contiguous;
// caches: [num_blocks, block_size, num_kv_heads, head_dim]; all fp32 or all bf16.
void paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale, int64_t max_query_rows,
                         at::Tensor& out) {
    const bool avx512 = use_avx512(query.size(2));
    if (query.scalar_type() == at::kBFloat16 && avx512)
        paged_attention_avx512<carpool::bf16>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                              scale, max_query_rows, out);
    else if (avx512)
        paged_attention_avx512<float>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                      max_query_rows, out);
    else if (query.scalar_type() == at::kBFloat16)
        paged_attention<carpool::bf16>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                       max_query_rows, out);
    else
        paged_attention<float>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                               max_query_rows, out);
}
