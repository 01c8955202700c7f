"""The vocab-parallel loss's table (``truefuse.distributed.linear_cross_entropy``), run inside every
rank of a process group: ``python -m truefuse verify --world-size N`` (op
``vocab_parallel_linear_cross_entropy``) and tests/distributed/test_vocab_parallel.py.

Every case is drawn from one set of unsharded values (the same on every rank); rank r holds rows
[r·V/N, (r+1)·V/N) of the LM head (and of the bias). Rows, per tensor:

* ``fwd_bwd``: loss, z-loss, token accuracy, d_input, this rank's d_weight and d_bias rows,
  **bounded** (docs/design.md §1) against the float64 reference (``linear_cross_entropy_ref``) on
  the whole weight, with the single-process ``truefuse.linear_cross_entropy`` on the whole weight in
  the same dtype as the baseline (cut to this rank's rows). ``all_ranks``: the loss, z-loss, accuracy
  and d_input have the same bits on every rank.
* ``delayed_vs_immediate_{grad,main_grad}``: a delayed weight gradient (§2) gives the immediate
  one's bits, into ``.grad`` and into ``main_grad``.
* ``main_grad_2_microbatches``: fused fp32 accumulation over 2 micro-batches into a random
  ``main_grad``, bounded against float64 with "the shard's gradient in the weight's dtype, then an
  fp32 add" as the baseline.
"""

from __future__ import annotations

import torch

from truefuse.testing import bitwise_report, bounded_report, same_on_all_ranks

OP = "vocab_parallel_linear_cross_entropy"
#: The options' cases: the issue's list (ignore_index, label smoothing, z-loss, softcap, class
#: weights, bias, the three reductions, accuracy), and every target ignored.
OPTIONS = {
    "mean": {},
    "sum_zloss": {"reduction": "sum", "z_loss": 1e-3},
    "none_everything": {"reduction": "none", "label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "weight": True},
    "everything_bias": {"label_smoothing": 0.1, "softcap": 4.0, "weight": True, "bias": True},
    "all_ignored": {"ignore": "all"},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
#: classes per rank, hidden size, sub-slice width (several sub-slices per shard)
_V_RANK, _H, _SLICE = 40, 16, 16
_REPLICATED = ("loss", "z_loss", "acc", "dx")


def inputs(dtype, N: int, V: int, H: int = _H, ignore: str = "some", seed: int = 0, device="cpu"):
    """(x, W, b, t, class weights, upstream) for one case, from float64 draws: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) * H**-0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[::4] = -100
    if ignore == "all":
        t.fill_(-100)
    cw = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    up = torch.randn(N, generator=g, dtype=torch.float64)
    return tuple(v.to(device, dtype if v.is_floating_point() and v is not cw else v.dtype) for v in (x, W, b, t, cw, up))


def run_loss(fn, x, W, t, b, up, reduction: str, **kw) -> dict:
    """Forward + backward of ``fn`` (a loss with ``linear_cross_entropy``'s signature) on fresh leaves;
    the outputs and gradients by name (``db`` None without a bias)."""
    xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
    bl = None if b is None else b.clone().requires_grad_()
    out = fn(xl, Wl, t, linear_bias=bl, reduction=reduction, return_z_loss=True, return_token_accuracy=True, **kw)
    out.loss.backward(up.to(out.loss.dtype) if reduction == "none" else None)
    return {
        "loss": out.loss.detach(),
        "z_loss": out.z_loss,
        "acc": out.token_accuracy,
        "dx": xl.grad,
        "dW": Wl.grad,
        "db": None if bl is None else bl.grad,
    }


def _row(case, dtype_name, check, tensor, contract, passed, **info) -> dict:
    return {
        "op": OP,
        "case": case,
        "dtype": dtype_name,
        "path": "reference",
        "check": check,
        "tensor": tensor,
        "contract": contract,
        "passed": bool(passed),
        **info,
    }


def _fwd_bwd_rows(name: str, dtype_name: str, rank: int, world: int, N: int, device) -> list[dict]:
    import truefuse
    from truefuse.distributed import linear_cross_entropy as vocab_parallel
    from truefuse.ops.lm_head.linear_cross_entropy import linear_cross_entropy_ref

    spec = dict(OPTIONS[name])
    V, rows_r = _V_RANK * world, slice(rank * _V_RANK, (rank + 1) * _V_RANK)
    x, W, b, t, cw, up = inputs(DTYPES[dtype_name], N, V, ignore=spec.pop("ignore", "some"), device=device)
    kw = {k: v for k, v in spec.items() if k not in ("weight", "bias")}
    if spec.get("weight"):
        kw["weight"] = cw
    bias = b if spec.get("bias") else None
    reduction = kw.pop("reduction", "mean")
    got = run_loss(
        vocab_parallel, x, W[rows_r], t, None if bias is None else bias[rows_r], up, reduction, vocab_slice=_SLICE, **kw
    )
    base = run_loss(truefuse.linear_cross_entropy, x, W, t, bias, up, reduction, **kw)
    x64, W64 = x.cpu().double(), W.cpu().double()
    kw64 = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    ref = run_loss(
        linear_cross_entropy_ref, x64, W64, t.cpu(), None if bias is None else bias.cpu().double(), up.cpu(), reduction, **kw64
    )
    for k in ("dW", "db"):
        if base[k] is not None:
            base[k], ref[k] = base[k][rows_r], ref[k][rows_r]
    out = []
    for k in sorted(k for k, v in got.items() if v is not None):
        rep = bounded_report(got[k], ref[k], base[k])
        all_ranks = same_on_all_ranks(got[k]) if k in _REPLICATED else None
        out.append(
            _row(
                name,
                dtype_name,
                "fwd_bwd",
                k,
                "bounded",
                rep.passed and all_ranks is not False,
                error=rep.error,
                baseline_error=rep.baseline_error,
                ratio=rep.ratio,
                all_ranks=all_ranks,
            )
        )
    return out


def _wgrad_rows(dtype_name: str, rank: int, world: int, N: int, device) -> list[dict]:
    from truefuse.autograd._wgrad import WgradState, run_pending
    from truefuse.distributed import linear_cross_entropy as vocab_parallel
    from truefuse.ops.lm_head.linear_cross_entropy import linear_cross_entropy_ref

    dtype = DTYPES[dtype_name]
    V, rows_r = _V_RANK * world, slice(rank * _V_RANK, (rank + 1) * _V_RANK)
    x, W, _, t, _, up = inputs(dtype, N, V, device=device)
    Wr = W[rows_r]
    start = torch.randn(Wr.shape, generator=torch.Generator().manual_seed(3)).to(device)

    def step(fused: bool, delay: bool, main_grad=None):
        state = WgradState(fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
        Wl = Wr.clone().requires_grad_()
        if fused:
            Wl.main_grad = main_grad if main_grad is not None else start.clone()
        xl = x.clone().requires_grad_()
        kw = {"reduction": "none", "z_loss": 1e-3, "vocab_slice": _SLICE}
        loss = vocab_parallel(xl, Wl, t, wgrad_state=state, **kw)
        loss.backward(up.to(loss.dtype))
        if delay:
            with torch.no_grad():  # as a module's backward_dw() runs it
                run_pending(state)
        return xl.grad, (Wl.main_grad if fused else Wl.grad), Wl.grad

    out = []
    for fused in (False, True):
        imm, dly = step(fused, False), step(fused, True)
        differ = [n for n, a, b in zip(("dx", "dW"), imm[:2], dly[:2], strict=True) if not bitwise_report(a, b).equal]
        out.append(
            _row(
                "none_zloss",
                dtype_name,
                f"delayed_vs_immediate_{'main_grad' if fused else 'grad'}",
                "dx, dW",
                "bitwise",
                not differ,
                detail=("differ: " + ", ".join(differ)) if differ else "",
            )
        )
    # two micro-batches into one main_grad; nothing returned to autograd
    mg = start.clone()
    grads = [step(True, False, main_grad=mg)[2] for _ in range(2)]
    plain = step(False, False)[1]
    ref = run_loss(linear_cross_entropy_ref, x.cpu().double(), W.cpu().double(), t.cpu(), None, up.cpu(), "none", z_loss=1e-3)
    want = start.cpu().double() + 2 * ref["dW"][rows_r]
    rep = bounded_report(mg, want, start + plain.float() + plain.float())
    ok = rep.passed and all(g is None for g in grads)
    out.append(
        _row(
            "none_zloss",
            dtype_name,
            "main_grad_2_microbatches",
            "main_grad",
            "bounded",
            ok,
            error=rep.error,
            baseline_error=rep.baseline_error,
            ratio=rep.ratio,
        )
    )
    return out


def vocab_table(rank: int, world: int, device: str = "cpu", dtypes=None, options=None, wgrad: bool = True) -> list[dict]:
    """Every row for this rank (call inside a process group of ``world`` ranks). Defaults: on the CPU
    fp64 (the PyTorch path) with every option and fp32 (the slice kernels, under the interpreter:
    one option, slow); on CUDA bf16 and fp32 with every option."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dtypes is None:
        dtypes = ("bf16", "fp32") if dev.type == "cuda" else ("fp64", "fp32")
    rows = []
    for d in dtypes:
        names = options or (OPTIONS if dev.type == "cuda" or d == "fp64" else ("none_everything",))
        N = 24 if dev.type == "cuda" or d == "fp64" else 8
        for name in names:
            rows += _fwd_bwd_rows(name, d, rank, world, N, dev)
        if wgrad and d != "fp64":  # main_grad is fp32: the §2 rows in the dtypes it serves
            rows += _wgrad_rows(d, rank, world, N, dev)
    return rows
