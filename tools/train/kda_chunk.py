#!/usr/bin/env python3
"""Chunkwise KDA recurrence for training, written once for numpy and PyTorch.

The fla stand-in in tools/fixtures/gen_kimi.py (the reference the model is
checked against) runs the KDA delta rule one token at a time. Training needs
the same function over [B, T] fast; this is the same mathematics in chunks of
C tokens (the WY / UT form): the per-token loop becomes C-wide matrix
products and one triangular solve per chunk. It is used only while training;
the exported model is evaluated with the stand-in itself.

Owns: kda_chunked(xp, ops, q, k, v, g, beta, chunk) and the numpy self-test.
Refuses: an initial state (training starts every window from zero).

The recurrence (per head; q already scaled by K^-1/2, q and k l2-normalised,
g = log decay per key channel, g <= 0, beta in (0, 1)):
    S_t = diag(exp g_t) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t
In a chunk starting from state S, with G_r = sum_{i<=r} g_i (inclusive,
per channel) and u_r = beta_r (v_r - k_r^T diag(exp g_r) S_{r-1}):
    S_r = diag(exp G_r) S + sum_{j<=r} diag(exp(G_r - G_j)) k_j u_j^T
    (I + A) U = diag(beta) (V - (K * exp G) S),  A_rj = beta_r sum_d k_r[d] k_j[d] exp(G_r[d] - G_j[d]), j < r
    o_r = (q_r * exp G_r)^T S + sum_{j<=r} (sum_d q_r[d] k_j[d] exp(G_r[d] - G_j[d])) u_j
    S_next = diag(exp G_last) S + sum_j diag(exp(G_last - G_j)) k_j u_j^T
Every exponent is a difference G_r - G_j with j <= r (or G_r itself), so it
is <= 0: nothing overflows whatever the chunk length (entries above the
diagonal are clipped to 0 before exp and masked after).

`xp` is the array module (numpy or torch); `ops` supplies the few calls
whose spelling differs (permute, tril, eye, zeros, stack, unbind, solve, pad).

    /usr/bin/python3 tools/train/kda_chunk.py      # numpy self-test
"""


def kda_chunked(xp, ops, q, k, v, g, beta, chunk):
    """q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H].
    Returns (o [B, T, H, V], final state S [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk
    pad = (-T) % C
    if pad:       # zero k, v, g, beta after the end: the state and earlier outputs are unchanged
        q, k, v, g, beta = (ops.pad_time(x, pad) for x in (q, k, v, g, beta))
    N = (T + pad) // C

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape((B, N, C, H) + tuple(x.shape[3:]))
        return ops.permute(x, (0, 3, 1, 2) + tuple(range(4, len(x.shape))))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    incl = ops.tril(C, 0, q)                                             # [C, C]: j <= r
    strict = ops.tril(C, -1, q)                                          # j < r
    G = incl @ g            # [B, H, N, C, K], cumulative over the chunk (a matmul: CUDA's cumsum is not deterministic)
    diff = G[:, :, :, :, None, :] - G[:, :, :, None, :, :]               # [B, H, N, r, j, K]
    Dec = xp.exp(diff.clip(max=0)) * incl[:, :, None]
    Akk = (k[:, :, :, :, None, :] * k[:, :, :, None, :, :] * Dec).sum(-1) * beta[..., None] * strict
    Aqk = (q[:, :, :, :, None, :] * k[:, :, :, None, :, :] * Dec).sum(-1)          # [B, H, N, C, C]
    M = Akk + ops.eye(C, q)
    eG = xp.exp(G)
    Uh = ops.solve_lower_unit(M, beta[..., None] * v)                    # [B, H, N, C, V]
    Wm = ops.solve_lower_unit(M, beta[..., None] * (k * eG))             # [B, H, N, C, K]
    qG = q * eG
    last = eG[:, :, :, -1, :]                                            # [B, H, N, K]
    kend = (k * xp.exp(G[:, :, :, -1:, :] - G)).swapaxes(-1, -2)         # [B, H, N, K, C]
    # split along the chunk axis once (autograd then stacks the gradients once,
    # instead of a full-size zero gradient for every per-chunk slice)
    Uh, Wm, qG, Aqk, last, kend = (ops.unbind(x, 2) for x in (Uh, Wm, qG, Aqk, last, kend))
    S = ops.zeros((B, H, K, V), q)
    outs = []
    for n in range(N):
        U = Uh[n] - Wm[n] @ S                                            # [B, H, C, V]
        outs.append(qG[n] @ S + Aqk[n] @ U)
        S = last[n][..., None] * S + kend[n] @ U
    o = ops.permute(ops.stack(outs, 2), (0, 2, 3, 1, 4)).reshape((B, N * C, H, V))
    return o[:, :T], S


class NumpyOps:
    def __init__(self, np):
        self.np = np

    def permute(self, x, dims):
        return x.transpose(dims)

    def tril(self, C, diag, like):
        return self.np.tril(self.np.ones((C, C), dtype=like.dtype), diag)

    def eye(self, C, like):
        return self.np.eye(C, dtype=like.dtype)

    def zeros(self, shape, like):
        return self.np.zeros(shape, dtype=like.dtype)

    def stack(self, xs, dim):
        return self.np.stack(xs, dim)

    def unbind(self, x, dim):
        return [self.np.take(x, i, axis=dim) for i in range(x.shape[dim])]

    def solve_lower_unit(self, M, R):
        return self.np.linalg.solve(M, R)

    def pad_time(self, x, n):
        return self.np.concatenate([x, self.np.zeros((x.shape[0], n) + x.shape[2:], dtype=x.dtype)], 1)


class TorchOps:
    def __init__(self, torch):
        self.torch = torch

    def permute(self, x, dims):
        return x.permute(*dims)

    def tril(self, C, diag, like):
        return self.torch.tril(self.torch.ones(C, C, dtype=like.dtype, device=like.device), diag)

    def eye(self, C, like):
        return self.torch.eye(C, dtype=like.dtype, device=like.device)

    def zeros(self, shape, like):
        return like.new_zeros(shape)

    def stack(self, xs, dim):
        return self.torch.stack(xs, dim)

    def unbind(self, x, dim):
        return self.torch.unbind(x, dim)

    def solve_lower_unit(self, M, R):
        return self.torch.linalg.solve_triangular(M, R, upper=False, unitriangular=True)

    def pad_time(self, x, n):
        return self.torch.cat([x, x.new_zeros((x.shape[0], n) + tuple(x.shape[2:]))], 1)


def naive_np(np, q, k, v, g, beta):
    """The stand-in's per-token loop (gen_kimi.install_fla_standin, kda) in numpy."""
    B, T, H, K = q.shape
    S = np.zeros((B, H, K, v.shape[-1]), dtype=q.dtype)
    o = np.zeros_like(v)
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None]
        u = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + np.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], u)
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def inputs_np(np, rng, B, T, H, K, V, dtype, g_lo=-5.0):
    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q = l2(rng.standard_normal((B, T, H, K))) * K ** -0.5
    k = l2(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V)) * 2.0
    g = g_lo * 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H, K)) * 3.0))   # (g_lo, 0), many near 0
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    return [x.astype(dtype) for x in (q, k, v, g, beta)]


def selftest():
    import numpy as np
    ops = NumpyOps(np)
    rng = np.random.default_rng(0)
    worst = {}
    for (B, T, H, K, V, C, lo) in [(2, 37, 3, 5, 4, 8, -5.0), (1, 64, 2, 8, 6, 16, -5.0), (2, 16, 1, 4, 4, 16, -5.0),
                                   (1, 50, 2, 6, 3, 32, -5.0), (1, 33, 2, 6, 3, 8, -0.01), (1, 5, 1, 3, 2, 16, -5.0)]:
        q, k, v, g, beta = inputs_np(np, rng, B, T, H, K, V, np.float64, lo)
        o_ref, S_ref = naive_np(np, q, k, v, g, beta)
        o, S = kda_chunked(np, ops, q, k, v, g, beta, C)
        e64 = max(float(np.abs(o - o_ref).max()), float(np.abs(S - S_ref).max()))
        q32, k32, v32, g32, b32 = (x.astype(np.float32) for x in (q, k, v, g, beta))
        o32, S32 = kda_chunked(np, ops, q32, k32, v32, g32, b32, C)
        e32 = float(np.abs(o32 - o_ref).max() / np.abs(o_ref).max())
        worst[(B, T, H, K, V, C, lo)] = (e64, e32)
        assert o.shape == o_ref.shape and S.shape == S_ref.shape
        assert e64 < 1e-10, (B, T, C, e64)
        assert e32 < 1e-5, (B, T, C, e32)
    for key, (e64, e32) in worst.items():
        print("B,T,H,K,V,C,g_lo=%s: float64 max |d| %.2e, float32 rel %.2e" % (key, e64, e32))
    print("kda_chunked == per-token recurrence (numpy): ok")


if __name__ == "__main__":
    selftest()
