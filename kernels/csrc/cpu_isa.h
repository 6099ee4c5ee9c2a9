// Which instruction set the CPU kernels run with, picked at run time (never from the build
// machine): every kernel has an AVX2 + FMA path (the extension's baseline flags) and, where it
// pays, an AVX-512 path compiled in its own translation unit under `#pragma GCC target`.
#pragma once

namespace carpool {

enum class Isa : int { kAvx2 = 0, kAvx512Bf16 = 1 };

// The one the kernels dispatch on now: the best this CPU supports unless lowered by set_isa.
Isa active_isa();
// True where this CPU (and the compiler that built the extension) can run `isa`.
bool isa_supported(Isa isa);

}  // namespace carpool
