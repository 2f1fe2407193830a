/* matvec_amxemu_avx512.c — kn_matmul_amx_emu: matvec_amx.c's walk, packing
 * and MXFP4 decode over a plain-C model of the AMX tile unit, so the tests
 * check the AMX level's layouts on any AVX-512 machine (the model sums in
 * plain fp32, not in the tile unit's own way; only the bound is compared).
 */
#define KN_AMX_EMU 1
#include "matvec_amx.c"
