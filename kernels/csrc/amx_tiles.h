// The operand of LDTILECFG, for the AMX translation units (amx_linear.cpp, chunk_attention.cpp):
// include it only inside their AMX target region. Plain data, no functions (see
// paged_attention_args.h: a header function built under two target ISAs is one symbol).
#pragma once
#include <cstdint>

namespace carpool_amx {

// Palette 1: per tile, bytes per row and rows (tiles 0-7 used; the rest must stay zero).
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

}  // namespace carpool_amx
