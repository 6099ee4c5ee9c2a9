// A Llama-family decoder layer of one step as one call: the kernels of the other files and the
// GEMMs (AMX tiles, oneDNN's packed weights or the skinny kernel), in the order and on the tensors
// kernels' dispatchers use when worker/model/decoder_loop.py calls them op by op (so the result is
// the same, bit for bit), without a Python call per op. A small model's decode step makes eleven
// kernel calls per layer; from Python each costs 3-20 us of interpreter, checks and argument
// parsing, which at a few sequences is a fifth of the step.
//
// The caller (StepOps.decoder_layer) has checked once per step what the dispatchers check per
// call: contiguous fp32 or bf16 activations, the caches, the metadata, and that every sequence's
// query rows fit the attention kernel (max_query_rows).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>

#include "cpu_kernels.h"

namespace {

// The row counts of the step, as kernels/cpu_packed_linear.py and kernels/dispatch.py decide them.
struct RowPlan {
    int64_t packed_rows;  // rows handed to oneDNN (padded_rows; AMX tiles take the rows as they are)
    int64_t max_skinny_rows;  // fp32: the skinny kernel up to this many rows
    int64_t max_amx_rows;  // AMX tiles up to this many rows, oneDNN on the plain weight above
    int64_t max_packed_fp32_rows;  // fp32: oneDNN's packed copy past the skinny rows, up to this many
};

at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                            std::optional<std::string>(std::string(""))};
    op.callBoxed(&stack);
    return stack[0].toTensor();
}

// oneDNN on its packed copy, the rows padded to plan.packed_rows (kernels.cpu_packed_linear.padded_rows).
at::Tensor padded_packed_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              const RowPlan& plan) {
    const int64_t rows = x.size(0);
    if (plan.packed_rows == rows) return packed_gemm(x, packed, bias);
    at::Tensor padded = at::zeros({plan.packed_rows, x.size(1)}, x.options());
    padded.narrow(0, 0, rows).copy_(x);
    return packed_gemm(padded, packed, bias).narrow(0, 0, rows);
}

at::Tensor linear(const at::Tensor& x, const LinearArgs& args, const RowPlan& plan) {
    const auto& [weight, bias, packed] = args;
    const int64_t rows = x.size(0);
    const bool fp32 = x.scalar_type() == at::kFloat;
    if (packed.has_value() && !fp32) {
        if (packed->dim() == 4)  // AMX tiles: no padding; a long prefill chunk goes to oneDNN (see cpu_amx_linear.py)
            return rows <= plan.max_amx_rows ? amx_linear(x, *packed, bias) : at::linear(x, weight, bias);
        return padded_packed_gemm(x, *packed, bias, plan);
    }
    if (fp32 && weight.scalar_type() == at::kFloat && rows > 0 && rows <= plan.max_skinny_rows &&
        weight.is_contiguous() && (!bias.has_value() || bias->is_contiguous()))
        return skinny_linear(x, weight, bias);
    // fp32 past the skinny kernel's rows and short of a prefill chunk's: the weight's oneDNN copy
    // (kernels.dispatch.MAX_PACKED_FP32_ROWS), where MKL would pack the weight again on this call.
    if (packed.has_value() && rows > plan.max_skinny_rows && rows <= plan.max_packed_fp32_rows)
        return padded_packed_gemm(x, *packed, bias, plan);
    return at::linear(x, weight, bias);
}

}  // namespace

// hidden: [T, hidden] contiguous, the layer's input; returns the layer's output [T, hidden].
// key_cache, value_cache: this layer's; cos, sin: [T, head_dim] contiguous.
at::Tensor decoder_layer_cpu(const at::Tensor& hidden, const at::Tensor& input_norm, double input_eps,
                             const LinearArgs& qkv_proj, const LinearArgs& o_proj, const at::Tensor& post_norm,
                             double post_eps, const LinearArgs& gate_up_proj, const LinearArgs& down_proj,
                             int64_t num_heads, int64_t num_kv_heads, double scale, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t max_query_rows,
                             int64_t packed_rows, int64_t max_skinny_rows, int64_t max_amx_rows,
                             int64_t max_packed_fp32_rows) {
    const RowPlan plan{packed_rows, max_skinny_rows, max_amx_rows, max_packed_fp32_rows};
    const int64_t tokens = hidden.size(0), head_dim = cos.size(1);
    const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;

    at::Tensor normed = at::empty_like(hidden);
    rms_norm_cpu(hidden, input_norm, input_eps, normed);
    at::Tensor qkv = linear(normed, qkv_proj, plan);  // [T, (H + 2 KV) * D]
    rotary_embedding_cpu(qkv, cos, sin, num_heads + num_kv_heads);
    const at::Tensor query = qkv.narrow(1, 0, q_width).view({tokens, num_heads, head_dim});
    const at::Tensor key = qkv.narrow(1, q_width, kv_width).view({tokens, num_kv_heads, head_dim});
    const at::Tensor value = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, num_kv_heads, head_dim});
    write_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping);
    at::Tensor attended = at::zeros(query.sizes(), query.options());  // rows outside every sequence stay zero
    paged_attention_cpu(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        max_query_rows, attended);

    // The output projection's fresh tensor carries the residual stream (as _FusedDecoderLayer).
    at::Tensor residual = linear(attended.view({tokens, q_width}), o_proj, plan);
    at::Tensor post_normed = at::empty_like(hidden);
    fused_add_rms_norm_cpu(hidden, residual, post_norm, post_eps, post_normed);
    at::Tensor gate_up = linear(post_normed, gate_up_proj, plan);
    at::Tensor activated = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul_cpu(gate_up, activated);
    return linear(activated, down_proj, plan).add_(residual);
}
