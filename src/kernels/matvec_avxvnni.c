/* matvec_avxvnni.c — the AVX2 level's tiles for CPUs with AVX-VNNI (Intel
 * since Alder Lake and Sapphire Rapids, AMD since Zen 5).
 *
 * Owns: kn_matmul_avxvnni (and its _prep / _px forms): matvec_avx2.c built
 * again with -mavxvnni, where the 4-bit tiles form each lane's integer sum
 * by vpdpbusd (one instruction per 32 codes and digit plane) instead of
 * vpmaddubsw + vpmaddwd + vpaddw. The integer is the same, so every output
 * is bit-equal to kn_matmul_avx2's (test kn_avxvnni_same_bits_as_avx2);
 * matvec.c sends the AVX2 level here when kn_avxvnni_usable() says so.
 * Every other tile is the AVX2 file's, unchanged.
 */
#define KN_AVXVNNI 1
#include "matvec_avx2.c"
