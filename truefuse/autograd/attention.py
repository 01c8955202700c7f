"""``truefuse.attention``: ``scaled_dot_product_attention``'s signature, batch-invariant by
construction (docs/attention.md): a query row gets the same bits alone, in a padded batch and in
decode against a KV cache; a deterministic backward (no atomics)."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from truefuse.autograd._autocast import autocast_dtype, cast
from truefuse.autograd._eager_op import call
from truefuse.ops._launch.capture import host_may_wait
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.prepared import ToKeep
from truefuse.ops._launch.triton import raw_stream as _raw_stream
from truefuse.ops.attention.attention import attention_fwd_op, attention_pytorch_op, use_kernel
from truefuse.ops.attention.attention_blocked import attention_blocked
from truefuse.ops.attention.attention_kept import kept_attention, run_and_keep
from truefuse.ops.attention.attention_mask import first_valid_key

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, window, key_start) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"attention: {name} must be a 4-D (batch, heads, seq, head_dim) tensor, got {got}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"attention: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dtype != query.dtype or t.device != query.device:
            raise ValueError(
                f"attention: {name} is {t.dtype} on {t.device}, query {query.dtype} on {query.device}: they must match"
            )
    B, Hq, Lq, D = query.shape
    if key.shape[0] != B or key.shape[3] != D:
        raise ValueError(
            f"attention: key {tuple(key.shape)} must be (batch={B}, heads, seq, head_dim={D}) like query {tuple(query.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"attention: value {tuple(value.shape)} must have key's shape {tuple(key.shape)}")
    Hk = key.shape[1]
    if Hk != Hq and not (enable_gqa and Hk > 0 and Hq % Hk == 0):
        raise ValueError(
            f"attention: query has {Hq} heads, key/value {Hk}: different head counts need enable_gqa=True and "
            "query's heads a multiple of key's"
        )
    if dropout_p:
        raise ValueError(
            f"attention: dropout_p={dropout_p} is refused: random dropout makes the output depend on the RNG's "
            "stream, so it is neither batch-invariant nor deterministic (docs/attention.md)"
        )
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"attention: scale must be a float or None, got {type(scale).__name__}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
            raise TypeError("attention: attn_mask must be a bool tensor (True = attend) or a float (additive) tensor")
        if attn_mask.device != query.device:
            raise ValueError(f"attention: attn_mask is on {attn_mask.device}, query on {query.device}")
        if attn_mask.requires_grad:
            raise ValueError("attention: attn_mask requires grad: a gradient of the mask is not computed")
        try:
            _broadcast(attn_mask.shape, (B, Hq, Lq, key.shape[2]))
        except RuntimeError:
            raise ValueError(
                f"attention: attn_mask {tuple(attn_mask.shape)} does not broadcast to (batch, heads, L_q, L_k) = "
                f"{(B, Hq, Lq, key.shape[2])}"
            ) from None
        if attn_mask.dim() > 4:
            raise ValueError(f"attention: attn_mask has {attn_mask.dim()} dimensions, at most 4")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"attention: softcap must be a positive number or None, got {softcap!r}")
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise ValueError(f"attention: window must be a positive int or None, got {window!r}")
    if key_start is not None:
        if not isinstance(key_start, torch.Tensor) or key_start.shape != (B,) or key_start.is_floating_point():
            raise ValueError(f"attention: key_start must be an integer tensor of shape (batch,) = ({B},)")
        if key_start.device != query.device:
            raise ValueError(f"attention: key_start is on {key_start.device}, query on {query.device}")


def _broadcast(shape, target) -> None:
    """``torch.broadcast_shapes(shape, target)``'s check (a RuntimeError where they do not
    broadcast): in plain Python for at most 4 dimensions, where torch's took ~50 µs of a decode
    call's host time on the 2-core CI box (experiments/host_time.py bi-stubbed)."""
    if len(shape) > len(target):
        torch.broadcast_shapes(shape, target)
        return
    for s, t in zip(reversed(shape), reversed(target), strict=False):
        if s != t and s != 1 and t != 1:
            raise RuntimeError(f"shapes {tuple(shape)} and {tuple(target)} do not broadcast")


def _first_valid_key(mask, B: int, Lk: int, device) -> torch.Tensor:
    """:func:`first_valid_key`, kept on the mask for the next call with the same mask unwritten (a
    decoder's layers share one mask: four ops, ~25 µs of host a layer in a decode step). Not while
    a CUDA graph is captured: a kept result from before the capture would be replayed for every
    mask the graph's input later holds (a replay runs no Python to check the version)."""
    if mask is None:
        return _no_mask_first_key(B, device)
    if type(mask) is not torch.Tensor or not host_may_wait(mask):
        return first_valid_key(mask, B, Lk, device)
    try:
        key = (mask._version, B, Lk, device, _stream_of(device))
    except RuntimeError:  # an inference tensor keeps no version counter
        return first_valid_key(mask, B, Lk, device)
    kept = mask.__dict__.get("_truefuse_first_key")
    if kept is not None and kept[0] == key:
        return kept[1]
    ks = first_valid_key(mask, B, Lk, device)
    mask._truefuse_first_key = (key, ks)
    return ks


#: the first valid keys of a call without a mask (zeros) by (B, device, stream): read, never written, by every such call
_NO_MASK: dict = {}


def _stream_of(device) -> int | None:
    """The current stream of a CUDA ``device`` (None elsewhere): part of a kept first key's key, so
    that a call on another stream never reads a tensor whose fill (or whose free, once the cache
    drops it) another stream orders."""
    if device.type != "cuda":
        return None
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


def _no_mask_first_key(B: int, device) -> torch.Tensor:
    """(B,) int32 zeros, kept: without it every decode layer's attention ran a fill kernel. Kept and
    served only to plain eager calls: not traced or captured (a tensor made in a capture holds its
    zeros only once replayed), not under a dispatch mode or functorch (a fake tensor kept, or a
    real one served to fake mode), not in inference mode (an inference tensor cannot be saved for a
    later training call's backward); at most 64 batch sizes and streams, one tensor per stream."""
    if (
        torch.compiler.is_compiling()
        or torch.is_inference_mode_enabled()
        or _get_current_dispatch_mode() is not None
        or torch._C._are_functorch_transforms_active()
        or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    ):
        return first_valid_key(None, B, 0, device)
    key = (B, device, _stream_of(device))
    ks = _NO_MASK.get(key)
    if ks is None:
        if len(_NO_MASK) >= 64:
            _NO_MASK.clear()
        ks = _NO_MASK[key] = first_valid_key(None, B, 0, device)
    return ks


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
    window: int | None = None,
    key_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, batch-invariant (docs/attention.md).

    Args:
        query: (B, Hq, Lq, D); key, value: (B, Hk, Lk, D); fp16 / bf16 / fp32 (fp64 on the PyTorch
            path), any strides. Hq ≠ Hk needs ``enable_gqa=True`` and Hq a multiple of Hk.
        attn_mask: bool (True = attend) or additive float, broadcastable to (B, Hq, Lq, Lk); may be
            combined with ``is_causal``.
        dropout_p: must be 0 (dropout is refused: not batch-invariant, not deterministic).
        is_causal: SDPA's top-left diagonal: query i sees keys j ≤ i.
        scale: default 1/√D.
        softcap: Gemma 2's attention logit softcapping, ``softcap · tanh(s / softcap)`` before the mask.
        window: sliding window (Mistral, Gemma 2): query i sees key j iff i + Lk − Lq − j < window
            (the query's position counted from the end of the keys, as in a KV cache).
        key_start: (B,) int, each sequence's first valid key (keys before it are ignored). Default:
            derived from ``attn_mask`` as the first key any query of the sequence attends (False,
            −inf or the dtype's lowest value count as masked). The key blocks start there, so a
            left-padded row gets its unpadded bits. Pass it in decode when the mask also holds a
            sliding window (which moves the first attended key).

    Autocast: as SDPA under ``torch.autocast``: query, key, value and a float mask cast to the
    autocast dtype (fp64 is not), the op run there (a model's q and k leave its fp32 rope in fp32
    while v comes out of a cast GEMM).

    Returns:
        (B, Hq, Lq, D) in the inputs' dtype (the autocast dtype under autocast). A query row that
        sees no key gives zeros. Where the kernels run the output (and each input's gradient) is
        laid out as the query (the input) is, as SDPA's flash kernels lay theirs: a transformers
        query, ``(B, L, H, D)`` memory, gives an output whose ``transpose(1, 2)`` is contiguous.
    """
    dt = autocast_dtype(query.device) if isinstance(query, torch.Tensor) else None
    if dt is not None:
        query, key, value = cast(query, dt), cast(key, dt), cast(value, dt)
        if isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point():
            attn_mask = cast(attn_mask, dt)
        with torch.autocast(query.device.type, enabled=False):
            return attention(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                softcap=softcap,
                window=window,
                key_start=key_start,
            )
    # a decode step: the launches kept for this call but its key length (ops/attention/attention_kept.py)
    kept = kept_attention(
        query, key, value, attn_mask, key_start, dropout_p, is_causal, scale, enable_gqa, softcap, window, _first_valid_key
    )
    if kept is not None and type(kept) is not ToKeep:
        return kept
    refuse_dtensor("attention", query=query, key=key, value=value, attn_mask=attn_mask, key_start=key_start)
    _check(query, key, value, attn_mask, dropout_p, scale, enable_gqa, softcap, window, key_start)
    B, Hq, Lq, D = query.shape
    Lk = key.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    ks = _first_valid_key(attn_mask, B, Lk, query.device) if key_start is None else key_start.to(torch.int32).contiguous()
    mask = None
    if attn_mask is not None:
        while attn_mask.dim() < 4:
            attn_mask = attn_mask.unsqueeze(0)
        mask = attn_mask.expand(B, Hq, Lq, Lk)
    window, softcap = window or 0, float(softcap or 0.0)
    if use_kernel(query):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        if kept is not None and q is query and k is key and v is value:  # nothing to differentiate: no op needed
            return run_and_keep(kept, q, k, v, mask, ks, scale, bool(is_causal), window, softcap)
        # eager mode skips the dispatcher (autograd/_eager_op.py: the op's body and its registered
        # backward; 196 µs of host time a decode call through it on an H100 host, docs/benchmarks.md)
        return call(attention_fwd_op, q, k, v, mask, ks, scale, bool(is_causal), window, softcap)[0]
    if torch.compiler.is_compiling():
        # one opaque op: Inductor's code for the path's math gave other bits than eager's (ops/attention/attention.py)
        return attention_pytorch_op(query, key, value, mask, ks, scale, bool(is_causal), window, softcap)
    return attention_blocked(query, key, value, mask, ks, scale, bool(is_causal), window, softcap)
