// The paged-attention launch, as plain data: what the ISA-specific translation units share.
// POD only (no inline functions): a header function compiled under two target ISAs would be
// one symbol with two bodies, and the linker may keep the AVX-512 one for every caller.
// (Code both paths share, the cache walk, is in paged_attention_rows.h, which each unit includes
// inside its own anonymous namespace.)
#pragma once
#include <cstdint>

namespace carpool {

struct PagedAttentionArgs {
    const void* query;  // [num_tokens, num_heads, head_dim], head_dim contiguous
    const void* key_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    const void* value_cache;
    const int32_t* tables;  // [num_seqs, table_width]
    const int32_t* lens;  // [num_seqs]: context lengths including this step's rows
    const int32_t* starts;  // [num_seqs + 1]: query row offsets
    void* out;  // [num_tokens, num_heads, head_dim], contiguous
    int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
    int64_t token_stride, block_stride;  // in elements, of the caches
    int64_t q_token_stride, q_head_stride;  // in elements, of the query
    int64_t max_query_rows;  // sequences with more rows are skipped (the caller's twin takes them)
    float scale;
};

// AVX-512 (+ AVX512_BF16) paged attention, one (sequence, kv head) task, its query rows
// first_row..end_row (of the sequence's rows in this step; end_row clamped to them): defined in
// paged_attention_avx512.cpp, callable only where carpool::active_isa() is kAvx512Bf16.
// scratch: at least avx512_attention_scratch_floats(max context) floats, private to the caller.
int64_t avx512_attention_scratch_floats(int64_t max_ctx);
int64_t avx512_attention_max_head_dim();
// next_tasks_share_rows: the caller runs the sequence's other kv heads' tasks next, on this thread,
// so the first kv head's task fetches whole cache rows for them.
void paged_attention_task_avx512_bf16(const PagedAttentionArgs& args, int64_t task, int64_t first_row,
                                      int64_t end_row, bool next_tasks_share_rows, float* scratch);
void paged_attention_task_avx512_fp32(const PagedAttentionArgs& args, int64_t task, int64_t first_row,
                                      int64_t end_row, bool next_tasks_share_rows, float* scratch);

// The AVX2 path (paged_attention_avx2.cpp), the same tasks on any AVX2 + FMA CPU. scratch: at least
// avx2_attention_scratch_floats(max context, head_dim) floats, private to the caller.
int64_t avx2_attention_scratch_floats(int64_t max_ctx, int64_t head_dim);
void paged_attention_task_avx2_bf16(const PagedAttentionArgs& args, int64_t task, int64_t first_row, int64_t end_row,
                                    bool next_tasks_share_rows, float* scratch);
void paged_attention_task_avx2_fp32(const PagedAttentionArgs& args, int64_t task, int64_t first_row, int64_t end_row,
                                    bool next_tasks_share_rows, float* scratch);

// AMX tiles, or VDPBF16PS blocks in tile order (chunk_attention.cpp), for the prefill chunks of
// bf16 steps. chunk_attention_runs: true where they can take a head of this size now (ISA kAmx or
// kAvx512Bf16, head_dim a multiple of 32 up to 256).
// chunk_attention: the sequences with min_rows..max_rows query rows, into out; the others untouched.
bool chunk_attention_runs(int64_t head_dim);
void chunk_attention(const PagedAttentionArgs& args, int64_t num_seqs, int64_t min_rows, int64_t max_rows);

}  // namespace carpool
