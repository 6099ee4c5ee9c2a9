// paged_attention_cpu: causal attention of a few query rows per sequence over its paged K/V cache,
// fp32 or bf16 (computed in fp32), on AVX2 CPUs (paged_attention_avx2.cpp) and on AVX-512 CPUs
// (paged_attention_avx512.cpp; the path picked at run time, carpool::active_isa()). This file checks
// the launch and deals out the tasks. The pure-torch twin (kernels/torch_paged_attention.py) is its
// specification.
//
// Why: in a decode step each sequence has one query row and a short context. The twin gathers
// every context into a padded tensor and calls SDPA; at these sizes the gather and SDPA's own
// set-up cost more than the arithmetic (a third of a mid-size decode step). These kernels read
// K/V where they lie, through the block table. Sequences with more query rows than max_query_rows
// are skipped (left untouched in `out`): the caller hands them to the twin.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "avx2_math.h"  // carpool::bf16
#include "cpu_isa.h"
#include "paged_attention_args.h"

namespace {

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

// Query rows of a long chunk per task (a decode step has one per sequence).
constexpr int64_t kRowsPerPart = 32;
// A bf16 sequence with this many rows in the step or more goes to chunk_attention.cpp (AMX tiles,
// or without AMX VDPBF16PS blocks in tile order). Against the row-by-row scan, one sequence, 9 heads
// over 3: AMX on a 2-core Xeon, 16 rows after 128, 512, 1,000, 2,000 positions 1.3x, 1.8x, 1.5x,
// 1.6x (8 rows: 0.7-1.0x); from position 0, 16 rows 0.5x (16 against 31 us a layer: a prompt that
// short is rare), 32 rows 1.15x, 64 1.5x, 128 2.4x. AVX512-BF16 on a 2-vCPU Zen 5 EPYC, 16 rows
// after 128, 512, 2,000 positions 1.2x, 1.7x, 2.1x (from 0: 0.85x), 32 rows 1.1-2.7x, 128 rows
// 1.65-2.9x; 8 rows 0.8-1.5x.
constexpr int64_t kChunkMinRows = 16;

// The tasks of a launch, each run by paged_attention_avx512.cpp (avx512) or paged_attention_avx2.cpp.
template <typename T>
void paged_attention_tasks(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, int64_t max_query_rows, bool avx512, at::Tensor& out) {
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
        if (avx512 && carpool::chunk_attention_runs(args.head_dim)) {  // chunks of kChunkMinRows rows or more
            carpool::chunk_attention(args, num_seqs, kChunkMinRows, max_query_rows);
            max_query_rows = std::min(max_query_rows, kChunkMinRows - 1);
            args.max_query_rows = max_query_rows;
        }
    }
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < num_seqs; ++s) max_ctx = std::max<int64_t>(max_ctx, args.lens[s]);
    const size_t scratch_floats = static_cast<size_t>(avx512 ? carpool::avx512_attention_scratch_floats(max_ctx)
                                                             : carpool::avx2_attention_scratch_floats(max_ctx, args.head_dim));
    const auto run = [&](int64_t task, int64_t first_row, int64_t end_row, bool next_tasks_share_rows, float* scratch) {
        if constexpr (std::is_same_v<T, float>) {
            if (avx512)
                carpool::paged_attention_task_avx512_fp32(args, task, first_row, end_row, next_tasks_share_rows, scratch);
            else
                carpool::paged_attention_task_avx2_fp32(args, task, first_row, end_row, next_tasks_share_rows, scratch);
        } else if (avx512) {
            carpool::paged_attention_task_avx512_bf16(args, task, first_row, end_row, next_tasks_share_rows, scratch);
        } else {
            carpool::paged_attention_task_avx2_bf16(args, task, first_row, end_row, next_tasks_share_rows, scratch);
        }
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
    if (query.scalar_type() == at::kBFloat16)
        paged_attention_tasks<carpool::bf16>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                             max_query_rows, avx512, out);
    else
        paged_attention_tasks<float>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                     max_query_rows, avx512, out);
}
