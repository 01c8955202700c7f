"""The row-invariant PyTorch path of attention (docs/attention.md): what runs where no kernel does
(the CPU without the interpreter, bf16/fp16 on the CPU, fp64).

It keeps the kernels' guarantee by the same construction: each query row reduces over the keys in
blocks of a fixed size starting at its sequence's first valid key, with the same online-softmax
merge in key order, and a block in which the row sees nothing leaves its state bit for bit
unchanged (``kernels/attention.py``'s module doc). The arithmetic is elementwise products summed
over a fixed-size last dimension, in fp32 (fp64 for fp64), so no row's bits depend on how many
other rows there are (a matmul's blocking may). Autograd differentiates it as written.
"""

from __future__ import annotations

import torch

from truefuse.ops.attention_mask import score_mask

#: keys per block of the PyTorch path (any fixed size keeps the guarantee; 16, the interpreter's
#: block, makes CI's short sequences span several blocks)
BLOCK_N = 16


def attention_blocked(q, k, v, attn_mask, key_start, scale: float, is_causal: bool, window: int, softcap: float) -> torch.Tensor:
    """Attention of (B, Hq, Lq, D) ``q`` over (B, Hk, Lk, D) ``k``/``v`` (Hq a multiple of Hk),
    ``attn_mask`` None or (B, Hq, Lq, Lk) (expanded), ``key_start`` (B,) int; returns q's dtype."""
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    G = Hq // Hk
    acc_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(acc_dt).reshape(B, Hk, G, Lq, 1, D)
    # each sequence's keys shifted so that its first valid key is column 0: the blocks below then
    # start at every sequence's first valid key at once (the kernels offset their loads instead)
    n_blocks = max(1, -(-Lk // BLOCK_N))
    cols = key_start.to(torch.long)[:, None] + torch.arange(n_blocks * BLOCK_N, device=q.device)  # (B, Lk_pad)
    in_k = cols < Lk
    idx = cols.clamp(max=Lk - 1)
    gidx = idx[:, None, :, None].expand(B, Hk, -1, D)
    ks = torch.gather(k.to(acc_dt), 2, gidx).reshape(B, Hk, 1, 1, n_blocks, BLOCK_N, D)
    vs = torch.gather(v.to(acc_dt), 2, gidx).reshape(B, Hk, 1, 1, n_blocks, BLOCK_N, D)
    vs = torch.where(in_k.reshape(B, 1, 1, 1, n_blocks, BLOCK_N, 1), vs, 0)
    mask_s = None
    if attn_mask is not None:
        mask_s = torch.gather(attn_mask, 3, idx[:, None, None, :].expand(B, Hq, Lq, -1)).reshape(B, Hk, G, Lq, n_blocks, BLOCK_N)
    rows = torch.arange(Lq, device=q.device)

    m = torch.full((B, Hk, G, Lq), float("-inf"), dtype=acc_dt, device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(B, Hk, G, Lq, D, dtype=acc_dt, device=q.device)
    for j in range(n_blocks):
        s = (qf * ks[:, :, :, :, j]).sum(-1) * scale  # (B, Hk, G, Lq, BLOCK_N)
        blk_cols = cols[:, j * BLOCK_N : (j + 1) * BLOCK_N]
        valid = score_mask(rows, blk_cols, in_k[:, j * BLOCK_N : (j + 1) * BLOCK_N], Lq, Lk, is_causal, window)
        s = score_transform(s, None if mask_s is None else mask_s[..., j, :], softcap)
        s = s.masked_fill(~valid[:, None, None], float("-inf"))
        # the shift cancels in acc / l: detached, its gradient (zero in exact arithmetic) is not formed
        m_new = torch.maximum(m, s.detach().amax(-1))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe[..., None])
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[..., None] * vs[:, :, :, :, j]).sum(-2)
        m = m_new
    has = denom > 0
    out = torch.where(has[..., None], acc / torch.where(has, denom, 1.0)[..., None], 0.0)
    return out.reshape(B, Hq, Lq, D).to(q.dtype)


def score_transform(s: torch.Tensor, mask: torch.Tensor | None, softcap: float) -> torch.Tensor:
    """Softcap, then the user's mask (bool: False → −inf; float: added), as the kernels order them."""
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is None:
        return s
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, float("-inf"))
    return s + mask.to(s.dtype)
