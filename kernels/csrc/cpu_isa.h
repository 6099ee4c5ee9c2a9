// Which instruction set the CPU kernels run with, picked at run time (never from the build
// machine): every kernel has an AVX2 + FMA path (the extension's baseline flags) and, where it
// pays, an AVX-512 path compiled in its own translation unit under `#pragma GCC target`. AMX (the
// tile unit of Sapphire Rapids and later Xeons) adds the bf16 linear of amx_linear.cpp on top of
// the AVX-512 paths, which every AMX CPU also has.
#pragma once

namespace carpool {

enum class Isa : int { kAvx2 = 0, kAvx512Bf16 = 1, kAmx = 2 };  // each includes the ones before

// The one the kernels dispatch on now: the best this CPU supports unless lowered by set_isa.
Isa active_isa();
// True where this CPU (and the compiler that built the extension) can run `isa`.
bool isa_supported(Isa isa);
// True where this CPU has AMX-TILE and AMX-BF16 and the OS let this process use them (asked once).
bool amx_tiles_usable();

}  // namespace carpool
