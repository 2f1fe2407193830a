/* dtype.c — safetensors dtype names and scalar element conversions.
 *
 * The conversions here are the exact references every SIMD decoder is tested
 * against: f16 and fp8-e4m3 decode by bit manipulation (no libm), e2m1 by
 * table, e8m0 by exponent construction.
 */
#include "dtype.h"
#include <math.h>
#include <string.h>

static const struct { const char *name; st_dtype t; int size; } dtypes[] = {
    {"F64", DT_F64, 8},         {"F32", DT_F32, 4},   {"F16", DT_F16, 2},
    {"BF16", DT_BF16, 2},       {"F8_E4M3", DT_F8_E4M3, 1},
    {"F8_E5M2", DT_F8_E5M2, 1}, {"I64", DT_I64, 8},   {"I32", DT_I32, 4},
    {"I16", DT_I16, 2},         {"I8", DT_I8, 1},     {"U8", DT_U8, 1},
    {"BOOL", DT_BOOL, 1},
};

st_dtype dtype_from_name(const char *s) {
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (strcmp(s, dtypes[i].name) == 0) return dtypes[i].t;
    return DT_UNKNOWN;
}

const char *dtype_name(st_dtype t) {
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (dtypes[i].t == t) return dtypes[i].name;
    return "UNKNOWN";
}

int dtype_size(st_dtype t) {
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (dtypes[i].t == t) return dtypes[i].size;
    return 0;
}

static float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (man << 13));
    return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities, 0x7f/0xff NaN. */
float fp8_e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b >> 7) << 31;
    uint32_t exp = (b >> 3) & 0xf, man = b & 7;
    if (exp == 15 && man == 7) return bits_to_f32(sign | 0x7fc00000u);
    if (exp == 0) { /* subnormal: man * 2^-9 */
        float v = (float)man * 0.001953125f;
        return sign ? -v : v;
    }
    return bits_to_f32(sign | ((exp + 120) << 23) | (man << 20));
}

const float df_e2m1_table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float e8m0_to_f32(uint8_t s) {
    if (s == 255) return NAN;
    if (s == 0) return bits_to_f32(0x00400000u); /* 2^-127, subnormal */
    return bits_to_f32((uint32_t)s << 23);
}
