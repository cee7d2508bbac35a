"""The gated delta rule: a token-by-token recurrent form (decode, and the spec) and the chunked WY form (prefill).

Both take inputs already prepared by the layer: q and k L2-normalised, q scaled by Dk^-0.5, q/k heads expanded to
the value heads, everything fp32. They agree to rounding; tests/test_gdn.py holds them to it.

Shapes:
    q, k:  [B, T, H, Dk]      v: [B, T, H, Dv]
    g:     [B, T, H]  log-decay (<= 0): the state is multiplied by exp(g_t) before token t writes
    beta:  [B, T, H]  write strength in (0, 1)
    state: [B, H, Dk, Dv] fp32
    returns o [B, T, H, Dv] fp32 and the final state [B, H, Dk, Dv]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def recurrent_gated_delta_rule(q, k, v, *, g, beta, state=None):
    """Token loop: S <- exp(g)·S;  S <- S + k·(β·(v - Sᵀk))ᵀ;  o = Sᵀq."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    S = q.new_zeros(B, H, Dk, Dv) if state is None else state.to(torch.float32)
    decay = g.exp()  # [B, T, H]
    out = q.new_empty(B, T, H, Dv)
    for t in range(T):
        S = S * decay[:, t, :, None, None]
        k_t = k[:, t]  # [B, H, Dk]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, S)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]  # [B, H, Dv]
        S = S + k_t[..., :, None] * delta[..., None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return out, S


def chunk_gated_delta_rule(q, k, v, *, g, beta, state=None, chunk_size: int = 64):
    """Chunked (WY/UT) form: within a chunk the delta-rule writes are solved as one unit-triangular system, so the
    serial loop runs over chunks, not tokens."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (C - T % C) % C
    # [B, T, H, *] -> [B, H, T+pad, *]; zero padding (β = 0, g = 0) leaves the state untouched
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    q, k, v = (x.reshape(B, H, N, C, -1) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)

    k_beta = k * beta[..., None]
    c = g.cumsum(-1)  # [B, H, N, C] log-decay from the chunk start
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, H, N, C, C], i >= j

    # UT transform: u = T·v_β, w = T·(k_β·exp(c)) with T = (I + strict_lower(A))⁻¹, A = (k_β kᵀ) ⊙ decay.
    # T comes from one triangular solve against I (C columns, not Dv + Dk), then two batched GEMMs.
    kT = k.transpose(-1, -2).contiguous()  # [B, H, N, Dk, C]
    A = (k_beta @ kT) * decay
    if torch.is_grad_enabled() and A.requires_grad:  # training: plain batched products, whose backward is cheap
        inverse = unit_lower_inverse(A)  # [B, H, N, C, C]
    else:
        eye = torch.eye(C, dtype=q.dtype, device=q.device).expand_as(A)
        inverse = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    u = inverse @ (v * beta[..., None])  # [B, H, N, C, Dv]
    w = inverse @ (k_beta * c.exp()[..., None])  # [B, H, N, C, Dk]
    intra = (q @ kT) * decay  # [B, H, N, C, C]
    q_decayed = q * c.exp()[..., None]
    k_decayed_T = (kT * (c[..., -1:] - c).exp()[..., None, :]).contiguous()  # [B, H, N, Dk, C]
    chunk_decay = c[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    # the serial part over chunks, heads flattened: [B·H, ...]
    u, w, q_decayed, intra, k_decayed_T = (x.reshape(B * H, N, *x.shape[-2:]) for x in (u, w, q_decayed, intra,
                                                                                            k_decayed_T))
    chunk_decay = chunk_decay.reshape(B * H, N, 1, 1)
    S = q.new_zeros(B * H, Dk, Dv) if state is None else state.to(torch.float32).reshape(B * H, Dk, Dv)
    out = torch.empty(B * H, N, C, Dv, dtype=q.dtype, device=q.device)
    for n in range(N):
        v_new = torch.baddbmm(u[:, n], w[:, n], S, alpha=-1)  # u - w·S  [B·H, C, Dv]
        out[:, n] = torch.baddbmm(intra[:, n] @ v_new, q_decayed[:, n], S)  # q·S + intra·v_new
        S = torch.baddbmm(S * chunk_decay[:, n], k_decayed_T[:, n], v_new)
    out = out.reshape(B, H, N * C, Dv)[:, :, :T].transpose(1, 2)  # [B, T, H, Dv]
    S = S.reshape(B, H, Dk, Dv)
    return out, S


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + strict_lower(A))⁻¹ for A [..., C, C], C a power of two: blocked forward substitution, the inverses of
    the diagonal blocks doubled from 1×1 up, [[P, 0], [L, Q]]⁻¹ = [[P⁻¹, 0], [-Q⁻¹·L·P⁻¹, Q⁻¹]]."""
    *batch, C, _ = A.shape
    inverse = A.new_ones(*batch, C, 1, 1)  # the C diagonal 1×1 blocks
    b = 1
    while b < C:
        n = C // (2 * b)  # diagonal blocks of size 2b
        blocks = torch.diagonal(A.reshape(*batch, n, 2 * b, n, 2 * b), dim1=-4, dim2=-2).movedim(-1, -3)
        P, Q = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]  # [..., n, b, b]
        lower = -(Q @ blocks[..., b:, :b] @ P)
        inverse = torch.cat([torch.cat([P, torch.zeros_like(P)], -1), torch.cat([lower, Q], -1)], -2)
        b *= 2
    return inverse.reshape(*batch, C, C)
