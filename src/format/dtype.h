/* dtype.h — safetensors element types and the weight-matrix types built on them. */
#ifndef DF_FORMAT_DTYPE_H
#define DF_FORMAT_DTYPE_H
#include <stdint.h>

typedef enum {
    DT_UNKNOWN = 0,
    DT_F64, DT_F32, DT_F16, DT_BF16, DT_F8_E4M3, DT_F8_E5M2,
    DT_I64, DT_I32, DT_I16, DT_I8, DT_U8, DT_BOOL
} st_dtype;

st_dtype dtype_from_name(const char *s); /* "BF16" -> DT_BF16; DT_UNKNOWN otherwise */
const char *dtype_name(st_dtype t);
int dtype_size(st_dtype t);              /* bytes per element; 0 for DT_UNKNOWN */

/* Scalar conversions (the reference the SIMD kernels are tested against). */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}
float f16_to_f32(uint16_t h);
float fp8_e4m3_to_f32(uint8_t b);
/* e2m1 code (0..15) to value: 0 .5 1 1.5 2 3 4 6 and the negatives (bit 3). */
extern const float df_e2m1_table[16];
/* e8m0 scale byte s -> 2^(s-127); s = 0 gives 2^-127, s = 255 gives NaN. */
float e8m0_to_f32(uint8_t s);
#endif
