// The cache walk both decode-attention paths share (paged_attention_avx2.cpp and
// paged_attention_avx512.cpp): which sequence and kv head a task is, and where its keys' rows lie
// through the block table. Plain integer and pointer code, the same on every ISA.
//
// Include it inside the translation unit's own anonymous namespace, after <cstdint> and
// paged_attention_args.h: internal linkage gives each ISA's unit its own copy, compiled for its
// target. As plain inline functions in a namespace of their own they would be one symbol with two
// bodies, and the linker could keep the AVX-512 one for the AVX2 path too (paged_attention_args.h).
// Hence no #pragma once and no includes here.

// One (sequence, kv head) task's view of the paged K/V cache.
template <typename T>
struct Task {
    const T* keys;  // the kv head's first element in the key cache (block 0, row 0)
    const T* values;
    const int32_t* table;
    int64_t block_size, block_stride, token_stride, head_dim;
    // Prefetch every kv head's K and V rows, not only this task's (see each path's key_scores).
    bool fetch_all_heads;
};

// Task `task_id` of a launch (kv heads of one sequence numbered together): its query rows and
// context, and its kv head's cache.
template <typename T>
struct SequenceTask {
    int64_t kv, first_row, q_len, ctx;
    Task<T> cache;
};

// next_tasks_share_rows: the caller runs the sequence's other kv heads' tasks next, on this thread,
// so the first kv head's task fetches whole rows for them.
template <typename T>
inline SequenceTask<T> sequence_task(const carpool::PagedAttentionArgs& args, int64_t task_id,
                                     bool next_tasks_share_rows) {
    const int64_t s = task_id / args.num_kv_heads, kv = task_id % args.num_kv_heads;
    const int64_t first_row = args.starts[s];
    return {kv, first_row, args.starts[s + 1] - first_row, args.lens[s],
            Task<T>{static_cast<const T*>(args.key_cache) + kv * args.head_dim,
                    static_cast<const T*>(args.value_cache) + kv * args.head_dim,
                    args.tables + s * args.table_width, args.block_size, args.block_stride,
                    args.token_stride, args.head_dim,
                    next_tasks_share_rows && kv == 0 && args.num_kv_heads > 1}};
}

// rows[i] = key first + i's row (through the block table) for first + i < n, i < Keys; key
// `first`'s row past n, so every pointer is a row the sequence owns. Walks the table: no division
// per key.
template <int64_t Keys, typename T>
inline void group_rows(const Task<T>& task, int64_t first, int64_t n, const T** rows) {
    int64_t c = first / task.block_size, r = first % task.block_size;
    const T* block = task.keys + task.table[c] * task.block_stride;
    for (int64_t i = 0; i < Keys; ++i) {
        rows[i] = first + i < n ? block + r * task.token_stride : rows[0];
        if (++r == task.block_size && first + i + 1 < n) {
            r = 0;
            block = task.keys + task.table[++c] * task.block_stride;
        }
    }
}
