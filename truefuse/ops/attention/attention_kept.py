"""Batch-invariant attention's kept launches at decode: a ``generate`` step's attention, the same
call every layer and token but for the key length, which grows by one a token (issue 47 item 3).

Its path (``autograd/attention.py::attention``: the checks, the mask's expansion, the tiles, two
``fast_launch`` keys of ~35 arguments) cost 93.5 µs of host a decode call on an H100 host against
SDPA's 40.4 (docs/benchmarks.md, "Eager host time per op"). :func:`kept_attention` keeps the
forward's launches (and the split forward's merge) under a key of everything that path read but
the key length: every operand's layout, with k's, v's and the mask's length-dependent strides and
the length itself passed to each call as ints (``prepared.prepare``'s ``varying``), keyed on what
Triton compiled them for (``prepared.specs``), and whether the keys split across programs. The same
kernels, arguments and grids: the same bits (``tests/test_kept_launches.py``).
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.prepared import NOT_NOW, KeptLaunches, ToKeep, launchable, layout, prepare, replayable, specs, stream
from truefuse.ops.attention.attention import fwd_chunk, fwd_outputs, fwd_run

#: ``(go, merge go or None, the partial states' row width)`` by key
_KEPT = KeptLaunches()

#: the forward kernel's parameters that follow the key length, by position: k's and v's batch, head
#: and row strides, the mask's four (expanded), L_k (``attention.fwd_launches``'s argument order)
_FWD_VARYING = (11, 12, 13, 14, 15, 16, 20, 21, 22, 23, 27)
#: the merge's: the number of chunks
_MERGE_VARYING = (9,)


def _mask_strides(mask: torch.Tensor, target: tuple) -> tuple:
    """The strides of ``mask`` unsqueezed in front to 4 dimensions and expanded to ``target``, as the
    path's ``unsqueeze(0)`` and ``expand`` give them, without those calls."""
    sh, st = list(mask.shape), list(mask.stride())
    while len(sh) < 4:
        st.insert(0, sh[0] * st[0] if sh else 1)
        sh.insert(0, 1)
    return tuple(s if a == b else 0 for a, b, s in zip(sh, target, st, strict=True))


def kept_attention(q, k, v, mask, key_start, dropout_p, is_causal, scale, enable_gqa, softcap, window, first_key):
    """``truefuse.attention``'s output for a call with nothing to differentiate through the
    launches kept for its key (a new tensor like the path's); else, where the call may be kept, the
    key to hand :func:`run_and_keep` (a :class:`ToKeep`); else None: not plain CUDA tensors, a
    gradient to record, tracing, a dispatch mode, a call the path would refuse or copy.
    ``first_key(mask, B, Lk, device)``: the path's first valid keys (kept on the mask: ``autograd/attention.py``)."""
    if not replayable(q, k, v, mask, key_start) or dropout_p or q.dim() != 4 or k.dim() != 4:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape:
        return None  # the path copies a strided head dim, or refuses
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    mask_key, ms = None, (0, 0, 0, 0)
    if mask is not None:
        if not 0 < mask.dim() <= 4 or mask.shape[-1] not in (1, Lk) or mask.requires_grad:
            return None
        ms = _mask_strides(mask, (B, H, Lq, Lk))
        mask_key = (mask.dtype, mask.shape[:-1], mask.shape[-1] == 1, mask.get_device(), mask.data_ptr() & 15)
    if key_start is not None and (key_start.dtype is not torch.int32 or not key_start.is_contiguous()):
        return None  # the path launches on an int32 copy of it
    ks_key = None if key_start is None else layout(key_start, key_start.data_ptr())
    kst, vst = k.stride()[:3], v.stride()[:3]
    n_chunks = -(-Lk // fwd_chunk(q))
    spec = specs(*kst, *vst, *ms, Lk, n_chunks)  # n_chunks: the split forward's grid and its merge's loop
    if spec is None:
        return None
    try:
        key = (
            layout(q, q.data_ptr()), k.shape[:2], k.shape[3], k.dtype, k.get_device(), k.data_ptr() & 15,
            v.dtype, v.get_device(), v.data_ptr() & 15, mask_key, ks_key, bool(is_causal), bool(enable_gqa),
            scale, type(scale), softcap, type(softcap), window, type(window), spec,  # types: 8.0 == 8, the path refuses one
        )  # fmt: skip
        kept = _KEPT.get(key)
    except TypeError:  # an unhashable scale, softcap or window: the path names it
        return None
    if kept.__class__ is not tuple:
        return ToKeep(key, kept) if kept > 0 else None
    go, merge, width = kept
    if not launchable(go):
        return None
    out, lse = fwd_outputs(q)
    part = lse if merge is None else torch.empty((n_chunks, B * H, Lq, width), dtype=torch.float32, device=q.device)
    op, lp, pp = out.data_ptr(), lse.data_ptr(), part.data_ptr()
    if (op | lp | pp) & 15:  # as kept (the caching allocator's blocks are 512-byte aligned)
        return None
    ks = first_key(mask, B, Lk, q.device) if key_start is None else key_start
    s, z = stream(go), n_chunks if merge is not None else 1  # the grid's chunks where the keys split
    if mask is None:  # the path's mask argument is q (no slot of its own)
        go(s, q.data_ptr(), k.data_ptr(), v.data_ptr(), ks.data_ptr(), op, lp, pp, *kst, *vst, *ms, Lk, z)
    else:
        go(s, q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), ks.data_ptr(), op, lp, pp, *kst, *vst, *ms, Lk, z)
    if merge is not None:
        merge(s, pp, op, lp, n_chunks)
    return out


def run_and_keep(pending: ToKeep, q, k, v, mask, key_start, scale, is_causal, window, softcap) -> torch.Tensor:
    """The path's forward (``attention.attention_fwd_launch``'s launches on the checked, expanded
    ``mask`` and the first valid keys ``key_start``), keeping its launches under ``pending``. Where
    the keys split, the forward is kept only with its merge (alone it would leave the output unwritten)."""
    out, lse, launches = fwd_run(q, k, v, mask, key_start, scale, is_causal, window, softcap)
    if not launches:
        return out
    (kernel, grid, args, kwargs), *rest = launches
    if kwargs["STATE_IN_MEMORY"]:  # its state tiles are no output a replay allocates: not kept
        _KEPT.keep(pending, None, None, 0)
        return out
    part = args[7]
    slots = (q, k, v, key_start, out, lse, part) if mask is None else (q, k, v, mask, key_start, out, lse, part)
    go = prepare(slots, kernel, grid, *args, varying=_FWD_VARYING, varying_grid=(2,), **kwargs)
    merge, width = None, 0
    if rest and go is not None and go is not NOT_NOW:
        ((mk, mgrid, margs, mkw),) = rest
        merge, width = prepare((part, out, lse), mk, mgrid, *margs, varying=_MERGE_VARYING, **mkw), mkw["BLOCK_D"] + 2
        if merge is None or merge is NOT_NOW:
            go = merge
    _KEPT.keep(pending, go, merge, width)
    return out


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
