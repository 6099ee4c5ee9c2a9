// Run-time CPU feature probe and the ISA switch the kernels dispatch on.
//
// __builtin_cpu_supports reads CPUID at run time (libgcc also checks that the OS saves the
// AVX-512 register state, via XGETBV), so one build runs on AVX2-only and AVX-512 machines alike.
#include "cpu_isa.h"

#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "avx512_build.h"

namespace carpool {
namespace {

// The AVX-512 kernels use F/BW/VL/DQ ops and VDPBF16PS (AVX512_BF16): every CPU with the last
// (Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later) has all of them.
bool cpu_has_avx512_bf16() {
#if CARPOOL_BUILD_AVX512
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return false;  // the compiler could not build the AVX-512 translation units
#endif
}

Isa best_isa() {
    if (!cpu_has_avx512_bf16()) return Isa::kAvx2;
    return amx_tiles_usable() ? Isa::kAmx : Isa::kAvx512Bf16;
}

std::atomic<int>& isa_slot() {
    static std::atomic<int> slot{static_cast<int>(best_isa())};
    return slot;
}

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::kAmx: return "amx";
        case Isa::kAvx512Bf16: return "avx512_bf16";
        default: return "avx2";
    }
}

}  // namespace

bool isa_supported(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(best_isa()); }

Isa active_isa() { return static_cast<Isa>(isa_slot().load(std::memory_order_relaxed)); }

}  // namespace carpool

// Python: the CPU's features as the kernels see them.
pybind11::dict cpu_features() {
    pybind11::dict features;
#if CARPOOL_BUILD_AVX512
    __builtin_cpu_init();
    features["avx2"] = static_cast<bool>(__builtin_cpu_supports("avx2"));
    features["fma"] = static_cast<bool>(__builtin_cpu_supports("fma"));
    features["avx512f"] = static_cast<bool>(__builtin_cpu_supports("avx512f"));
    features["avx512bw"] = static_cast<bool>(__builtin_cpu_supports("avx512bw"));
    features["avx512vl"] = static_cast<bool>(__builtin_cpu_supports("avx512vl"));
    features["avx512dq"] = static_cast<bool>(__builtin_cpu_supports("avx512dq"));
    features["avx512bf16"] = static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
#endif
    features["amx"] = carpool::amx_tiles_usable();  // AMX-TILE + AMX-BF16, granted by the OS, and built
    features["built_avx512"] = static_cast<bool>(CARPOOL_BUILD_AVX512);
    return features;
}

std::string active_isa_name() { return carpool::isa_name(carpool::active_isa()); }

// Python: switch the kernels to `name` ("avx2", "avx512_bf16" or "amx"); refuses one this CPU lacks.
void set_active_isa(const std::string& name) {
    carpool::Isa isa;
    if (name == "avx2") isa = carpool::Isa::kAvx2;
    else if (name == "avx512_bf16") isa = carpool::Isa::kAvx512Bf16;
    else if (name == "amx") isa = carpool::Isa::kAmx;
    else throw std::invalid_argument("unknown ISA '" + name + "': expected 'avx2', 'avx512_bf16' or 'amx'");
    if (!carpool::isa_supported(isa))
        throw std::invalid_argument("this CPU (or the compiler that built the kernels) has no " + name);
    carpool::isa_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
}
