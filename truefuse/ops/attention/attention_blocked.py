"""The row-invariant PyTorch path of attention (docs/attention.md): what runs where no kernel does
(the CPU without the interpreter, bf16/fp16 on the CPU, fp64).

It keeps the kernels' guarantee by a construction of the same kind. Every product is a batched
matmul of one fixed shape: a tile of :data:`BLOCK_M` query rows against a block of
:func:`block_n` keys. The BLAS picks its kernel from the shape, and within a fixed-shape call a
row's bits depend neither on its place nor on the other rows, nor on how many products the batch
holds (``ops/gemm/gemm_exec.py::BI_ROWS``; tests/test_attention.py). The key blocks start at each
sequence's first valid key. A row's softmax shifts by its maximum over the keys it sees (exact in
any order), sums each block's probabilities over the fixed block, and adds the blocks' sums and
products with V in key order; a block the row does not see adds zeros, so the causal prefill skips
its tiles' trailing blocks. Sums in fp32 (fp64 for fp64). Autograd differentiates it as written.

It replaced elementwise products summed over the head dim (one (rows, keys, D) tensor a block, in
forward and backward): a BI training step of the demo's CPU model ran at 0.08x stock's, now
0.53x (2 threads; docs/batch_invariance.md).
"""

from __future__ import annotations

import torch

from truefuse.ops.attention.attention_mask import score_mask

#: query rows per product: a speed setting, never chosen from the number of rows (that would
#: change the BLAS kernel, and so the bits, with the batch)
BLOCK_M = 64


def block_n(head_dim: int) -> int:
    """Keys per block, from the head dim only: 64, or 16 for head dims up to 16 (CI's tiny
    models, whose short sequences then span several blocks)."""
    return 16 if head_dim <= 16 else 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention_blocked(q, k, v, attn_mask, key_start, scale: float, is_causal: bool, window: int, softcap: float) -> torch.Tensor:
    """Attention of (B, Hq, Lq, D) ``q`` over (B, Hk, Lk, D) ``k``/``v`` (Hq a multiple of Hk),
    ``attn_mask`` None or (B, Hq, Lq, Lk) (expanded), ``key_start`` (B,) int; returns q's dtype."""
    # autocast would run the products in bf16/fp16 (on the CPU through another BLAS, whose
    # fixed-shape invariance is not checked): the path's sums stay fp32
    with torch.autocast(q.device.type, enabled=False):
        return _attention_blocked(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap)


def _attention_blocked(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap):
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    G = Hq // Hk
    acc_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    BLOCK_N = block_n(D)
    # the query rows of a key-value head, (query head, position), in tiles of BLOCK_M (zero rows
    # pad the last)
    R = G * Lq
    n_tiles = _cdiv(R, BLOCK_M)
    Rp = n_tiles * BLOCK_M
    qt = q.to(acc_dt).reshape(B, Hk, R, D)
    if Rp > R:
        qt = torch.cat([qt, qt.new_zeros(B, Hk, Rp - R, D)], 2)
    qt = qt.reshape(B, Hk, n_tiles, BLOCK_M, D).unbind(2)  # tiles of (B, Hk, BLOCK_M, D)
    # each sequence's keys shifted so that its first valid key is column 0: the blocks below then
    # start at every sequence's first valid key at once (the kernels offset their loads instead)
    n_blocks = max(1, _cdiv(Lk, BLOCK_N))
    cols = key_start.to(torch.long)[:, None] + torch.arange(n_blocks * BLOCK_N, device=dev)  # (B, Lk_pad)
    in_k = cols < Lk
    idx = cols.clamp(max=Lk - 1)
    gidx = idx[:, None, :, None].expand(B, Hk, -1, D)
    kb = torch.gather(k.to(acc_dt), 2, gidx)
    vb = torch.where(in_k[:, None, :, None], torch.gather(v.to(acc_dt), 2, gidx), 0)
    # (blocks, B, Hk, BLOCK_N, D): a tile's first blocks are one contiguous slice
    kb, vb = (t.reshape(B, Hk, n_blocks, BLOCK_N, D).permute(2, 0, 1, 3, 4).contiguous() for t in (kb, vb))

    pos = torch.arange(Rp, device=dev) % Lq  # each row's query position (padding rows: any)
    if attn_mask is not None:
        attn_mask = torch.gather(attn_mask, 3, idx[:, None, None, :].expand(B, Hq, Lq, -1)).reshape(B, Hk, R, -1)
        if Rp > R:
            attn_mask = torch.cat([attn_mask, attn_mask.new_zeros(B, Hk, Rp - R, attn_mask.shape[-1])], 2)
    outs = []
    for t in range(n_tiles):
        # a causal tile stops at the block of its last position: a block after it is masked for
        # every sequence (key ≥ column)
        nb = min(n_blocks, _tile_last(t, R, Lq) // BLOCK_N + 1) if is_causal else n_blocks
        rows = slice(t * BLOCK_M, (t + 1) * BLOCK_M)
        s = torch.matmul(qt[t].expand(nb, -1, -1, -1, -1), kb[:nb].transpose(-1, -2)) * scale  # (nb, B, Hk, BLOCK_M, BLOCK_N)
        valid = score_mask(pos[rows], cols[:, : nb * BLOCK_N], in_k[:, : nb * BLOCK_N], Lq, Lk, is_causal, window)
        mask = None if attn_mask is None else _blocks(attn_mask[:, :, rows, : nb * BLOCK_N], nb, BLOCK_N)
        s = score_transform(s, mask, softcap).masked_fill(~_blocks(valid[:, None], nb, BLOCK_N), float("-inf"))
        # the row's maximum over every key it sees (exact in any order); the shift cancels in
        # acc / l: detached, its gradient (zero in exact arithmetic) is not formed
        m = s.detach().amax(dim=(0, 4))
        m = torch.where(m == float("-inf"), 0.0, m)  # (B, Hk, BLOCK_M)
        p = torch.exp(s - m[..., None])
        ls, pv = p.sum(-1).unbind(0), torch.matmul(p, vb[:nb]).unbind(0)
        # the blocks in key order
        denom, acc = ls[0], pv[0]
        for j in range(1, nb):
            denom = denom + ls[j]
            acc = acc + pv[j]
        has = denom > 0
        outs.append(torch.where(has[..., None], acc / torch.where(has, denom, 1.0)[..., None], 0.0))
    out = torch.stack(outs, 2).reshape(B, Hk, Rp, D)[:, :, :R]
    return out.reshape(B, Hq, Lq, D).to(q.dtype)


def _tile_last(t: int, R: int, Lq: int) -> int:
    """The last query position among tile ``t``'s rows (rows r = head · Lq + position)."""
    first, end = t * BLOCK_M, min((t + 1) * BLOCK_M, R)
    if end - first >= Lq or first // Lq != (end - 1) // Lq:
        return Lq - 1  # the tile wraps to another head: it holds some head's last position
    return (end - 1) % Lq


def _blocks(x: torch.Tensor, nb: int, n: int) -> torch.Tensor:
    """(B, H', BLOCK_M, nb · n) → (nb, B, H', BLOCK_M, n)."""
    B, H, M = x.shape[:3]
    return x.reshape(B, H, M, nb, n).permute(3, 0, 1, 2, 4)


def score_transform(s: torch.Tensor, mask: torch.Tensor | None, softcap: float) -> torch.Tensor:
    """Softcap, then the user's mask (bool: False → −inf; float: added), as the kernels order them."""
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is None:
        return s
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, float("-inf"))
    return s + mask.to(s.dtype)
