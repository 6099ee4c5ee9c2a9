// The Python module of Carpool's CPU kernels: one extension, built once, for all of them.
// torch/csrc/utils/pybind.h, not torch/extension.h: the same Tensor casters, a quarter of the build time.
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"
#include "paged_attention_args.h"

pybind11::dict cpu_features();
std::string active_isa_name();
void set_active_isa(const std::string& name);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("cpu_features", &cpu_features, "the CPU features the kernels probe at run time (CPUID), and whether AVX-512 paths were built");
    m.def("active_isa", &active_isa_name, "the ISA the kernels run with now: 'amx', 'avx512_bf16' or 'avx2'");
    m.def("set_active_isa", &set_active_isa, "run the kernels with 'avx2', 'avx512_bf16' or 'amx' (ValueError where unsupported)");
    m.def("chunk_attention_runs", &carpool::chunk_attention_runs,
          "whether bf16 prefill chunks of this head_dim go to chunk_attention.cpp now (ISA amx or avx512_bf16, head_dim % 32 == 0, <= 256)");
    m.def("amx_pack_weight", &amx_pack_weight, "a bf16 weight [N, K] in AMX tile order [N/16, K/32, 16, 32]");
    m.def("amx_linear", &amx_linear, "y = x @ weight.T (+ bias), bf16, on AMX tiles (weight from amx_pack_weight)");
    m.def("skinny_linear", &skinny_linear, "y = x @ weight.T (+ bias), fp32, few rows, AVX2+FMA");
    m.def("rms_norm_cpu", &rms_norm_cpu, "out = x * rsqrt(mean(x^2) + eps) * weight, fp32 or bf16, per row");
    m.def("fused_add_rms_norm_cpu", &fused_add_rms_norm_cpu,
          "residual += x (rounded to its dtype), out = rms_norm(residual), fp32 or bf16, per row");
    m.def("silu_and_mul_cpu", &silu_and_mul_cpu, "out = silu(gate) * up from [M, 2I] gate_up, fp32 or bf16");
    m.def("rotary_embedding_cpu", &rotary_embedding_cpu, "x = x * cos + rotate_half(x) * sin on the first heads of qkv rows, in place");
    m.def("write_kv_cache_cpu", &write_kv_cache_cpu, "K/V rows into their cache slots (negative: skip)");
    m.def("decoder_layer_cpu", &decoder_layer_cpu,
          "a Llama-family decoder layer of a decode-like step: the per-op kernels and oneDNN GEMMs in one call");
    m.def("paged_attention_cpu", &paged_attention_cpu, "paged causal attention, fp32 or bf16, few query rows per sequence");
}
