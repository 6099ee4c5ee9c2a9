// The tensor-level entry points of Carpool's CPU kernels, one declaration each: bindings.cpp
// exposes them to Python, decoder_layer_cpu.cpp calls them for a whole layer. Declarations only
// (no inline code): the files that define them are compiled for different target ISAs.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
void paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale, int64_t max_query_rows,
                         at::Tensor& out);
void rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
void fused_add_rms_norm_cpu(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                            at::Tensor& out);
void silu_and_mul_cpu(const at::Tensor& gate_up, at::Tensor& out);
void rotary_embedding_cpu(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads);
void write_kv_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slot_mapping);
// A weight [N, K] bf16 (N, K multiples of 32) in AMX tile order, and x [M, K] bf16 times it.
at::Tensor amx_pack_weight(const at::Tensor& weight);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// (weight, bias, the weight packed once: oneDNN's reordered copy, or 4-D AMX tiles from
// amx_pack_weight): a projection, as kernels.linear takes it.
using LinearArgs = std::tuple<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>>;
at::Tensor decoder_layer_cpu(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps,
                             const LinearArgs& qkv_proj, const LinearArgs& o_proj, const at::Tensor& post_norm,
                             double post_eps, const LinearArgs& gate_up_proj, const LinearArgs& down_proj,
                             int64_t num_heads, int64_t num_kv_heads, double scale, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t max_query_rows,
                             int64_t packed_rows, int64_t max_skinny_rows, int64_t max_amx_rows,
                             int64_t max_packed_fp32_rows);
