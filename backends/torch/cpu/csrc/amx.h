/* What the AMX kernels share (amx_linear.c, paged_extend_amx.c): the tile configuration's layout. Linux hands the
   tile state to a process only on request: amx_request_permission (tile_state.c), once, before any tile code. */
#ifndef TIERLM_AMX_H
#define TIERLM_AMX_H

#include <immintrin.h>
#include <stdint.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_cfg;

#endif
