/* act_simd.h — the x86 levels' gated activations, written once (see act.c).
 *
 * Owns: nothing by itself; act_avx2.c and act_avx512.c define the vector
 * type, its operations and libmvec's expf / tanhf for it, then include this
 * file, which defines ACT_SILU and ACT_SITU (kn_act_*_mul's level forms).
 *   AV, AL        vector of AL floats
 *   A_SET1 A_ADD A_MUL A_DIV A_NEG A_LOADU A_STOREU
 *   A_LOADN(p, n) A_STOREN(p, n, v)   the first n < AL lanes (the rest zero)
 *   A_EXP A_TANH  libmvec's expf and tanhf, lane by lane
 * Each lane computes the scalar level's formula in the scalar level's order
 * (x / (1 + exp(-x)) * u; b * tanh(g / b) * sigmoid(g) * (lb * tanh(u / lb)
 * or u)), only exp and tanh differ (libmvec: a few ulp, not correctly
 * rounded). The last lanes of an array are loaded zero-padded and stored
 * masked, so an element's value never depends on where the array ends.
 */

AI AV silu_v(AV x, AV u) { return A_MUL(A_DIV(x, A_ADD(A_SET1(1.0f), A_EXP(A_NEG(x)))), u); }

AI AV situ_v(AV g, AV u, AV b, AV lb, const int up_tanh) {
    const AV sig = A_DIV(A_SET1(1.0f), A_ADD(A_SET1(1.0f), A_EXP(A_NEG(g))));
    const AV a = A_MUL(A_MUL(b, A_TANH(A_DIV(g, b))), sig);
    return A_MUL(a, up_tanh ? A_MUL(lb, A_TANH(A_DIV(u, lb))) : u);
}

void ACT_SILU(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + AL <= n; i += AL) A_STOREU(g + i, silu_v(A_LOADU(g + i), A_LOADU(u + i)));
    if (i < n) A_STOREN(g + i, n - i, silu_v(A_LOADN(g + i, n - i), A_LOADN(u + i, n - i)));
}

AI void situ_all(float *g, const float *u, int64_t n, float beta, float linear_beta, const int up_tanh) {
    const AV b = A_SET1(beta), lb = A_SET1(linear_beta);
    int64_t i = 0;
    for (; i + AL <= n; i += AL) A_STOREU(g + i, situ_v(A_LOADU(g + i), A_LOADU(u + i), b, lb, up_tanh));
    if (i < n)
        A_STOREN(g + i, n - i, situ_v(A_LOADN(g + i, n - i), A_LOADN(u + i, n - i), b, lb, up_tanh));
}

void ACT_SITU(float *g, const float *u, int64_t n, float beta, float linear_beta) {
    if (linear_beta > 0) situ_all(g, u, n, beta, linear_beta, 1);
    else situ_all(g, u, n, beta, linear_beta, 0);
}
