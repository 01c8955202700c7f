"""One declaration per op (issue 46): what each op answers about itself, in one table.

Before, each op answered five questions by hand in five places (its custom ops under opcheck in
tests/test_compile.py, its compile case there, its DTensor rule in tests/distributed/test_dtensor.py,
its double-backward case in tests/test_double_backward.py, its contract in verify's registry) and
nothing said which op had answered which: ``truefuse.attention``'s two custom ops were under
neither opcheck nor compile. Now the tests iterate :data:`OPS`, and tests/test_op_table.py fails
when an op registered under ``torch.ops.truefuse`` (or a contract in verify's registry) has no
declaration, or a declaration disagrees with the code (a custom op's ``inline``, its eager path).

Here, in ``verify/`` (the top layer), so that the sample builders may call the public functions
and modules of every layer; nothing imports this module but the tests and docs: ``import truefuse``
stays as it was. Names of functions are ``"module:attribute"`` strings, resolved by
:func:`resolve` only when asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

#: ``(custom op name, args, test_utils or None for all of opcheck's tests)``
OpcheckSample = tuple[str, tuple, tuple[str, ...] | None]
#: ``(fn, args, params)``: ``fn(*args)`` compiled against eager, gradients of the ``args`` that
#: require grad and of ``params`` (a module's parameters) compared too
CompileSample = tuple[Callable, tuple, tuple]


@dataclass(frozen=True)
class OpDecl:
    """One op's answers.

    Attributes:
        name: the op as its errors name it (``truefuse.<name> does not ...``): the public function,
            module or ``ops.``/``distributed.`` path.
        stem: the file stem shared by its layers (docs/design.md §5): ``ops/<stem>.py``, ...
        custom_ops: ``truefuse::<name>`` -> ``"module:attribute"`` of the op object; an op may
            share custom ops with another (the norms) and a module may have none of its own (its
            GEMMs are ``gemm``'s).
        ref: ``"module:attribute"`` of the unfused reference (a module's is its ``forward_ref``).
        verify: its contract's op names in ``python -m truefuse verify`` (``--op``); for a
            distributed op, in ``verify --world-size N``'s tables.
        inline: its custom ops trace into their kernels under torch.compile
            (``ops/_launch/custom_op.py::custom_op(inline=)``; docs/design.md §6.7).
        eager: its forward custom ops run without the dispatcher in eager mode
            (``autograd/_eager_op.py``: ``register_backward`` gave them ``.eager``).
        dtensor: ``"refused"`` (one ``TypeError`` naming it, ``ops/_launch/dtensor.py::refuse_dtensor``),
            ``"row-local"`` (each rank's rows, exact: ``on_local_rows``), or ``"no rule"`` (no
            public entry of its own, its callers refuse; or a process-group op, whose inputs are
            each rank's plain tensors by its contract).
        batch_invariant: ``"invariant by construction"`` (a row's bits never depend on the other
            rows: one launch shape for every row count) or ``"switch-dependent"`` (its GEMMs, or
            its statistics, are row-invariant only under ``truefuse.batch_invariant()``).
        double_backward: ``"refused"`` (differentiating its gradient raises one error naming it,
            docs/design.md §6.5), ``"supported"``, or ``"not differentiable"`` (no backward at all:
            ``gemm`` refuses inputs that require grad, ``ops.scale_`` and the grouped GEMM's
            ops have no autograd formula).
        modules: its ``truefuse`` modules, which answer as the op does (``RMSNorm``).
        opaque: custom ops of an ``inline`` op kept whole under torch.compile on purpose: a
            PyTorch path whose math Inductor would compile into other roundings (``rms_norm_hf``'s
            in batch-invariant mode off CUDA).
        opcheck: ``f(device) -> [OpcheckSample]``: every custom op of ``custom_ops`` at least once.
        compile: ``f(device) -> [CompileSample]``, or None with ``why_not_compiled``.
    """

    name: str
    stem: str
    custom_ops: dict[str, str]
    ref: str
    verify: tuple[str, ...]
    inline: bool
    eager: bool
    dtensor: Literal["refused", "row-local", "no rule"]
    batch_invariant: Literal["invariant by construction", "switch-dependent"]
    double_backward: Literal["refused", "supported", "not differentiable"]
    opcheck: Callable[[torch.device], list[OpcheckSample]] | None = None
    compile: Callable[[torch.device], list[CompileSample]] | None = None
    why_not_compiled: str = ""
    modules: tuple[str, ...] = field(default=())
    opaque: tuple[str, ...] = field(default=())


def resolve(path: str):
    """``"truefuse.ops.rope:rope_ref"`` -> the object; ``"m:Cls.attr"`` walks the attributes."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def available(path: str) -> bool:
    """Whether ``path``'s module imports here: the Hugging Face integration's needs transformers
    (the ``hf`` extra), which a plain install lacks."""
    try:
        importlib.import_module(path.partition(":")[0])
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "transformers":
            return False
        raise
    return True


def _r(*shape, device, seed=0, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape))).to(device)
    return t.requires_grad_(grad)


def _module(make: Callable, call: Callable = lambda m, x: m(x), *, width: int = 16) -> Callable:
    """A module's compile sample: built with seed 0 on the device, called on (6, width) rows."""

    def sample(device):
        torch.manual_seed(0)
        m = make().to(device)
        return [(lambda x: call(m, x), (_r(6, width, device=device, grad=True),), tuple(m.parameters()))]

    return sample


# ---------------------------------------------------------------------------------------------
# the sample builders: the shapes of the per-op tests they replaced (tests/test_compile.py,
# tests/test_grouped_gemm.py), so the generated lists cost what the hand-written ones did


def _gemm_opcheck(device):
    a, b, bias = _r(8, 12, device=device), _r(12, 10, device=device), _r(10, device=device)
    b3, pre = _r(2, 12, 10, device=device), torch.empty(8, 10, device=device)
    g, x = _r(6, 9, device=device), _r(9, 4, device=device)
    out, gb, gb2 = torch.empty(2, 6, 4, device=device), torch.empty(6, device=device), torch.empty(2, 6, device=device)
    n = None
    return [
        ("truefuse::gemm", (a, b, torch.float32, bias, n, n, n, n, n, n, False), None),
        ("truefuse::gemm_result", (a, b, torch.float32, bias, n, n, n, n, False, True), None),
        # the grouped forward (rows split, b 3-D), and the GELU epilogue keeping the pre-activation
        ("truefuse::gemm", (a, b3, torch.float32, n, n, n, n, n, n, [3, 5], True), None),
        ("truefuse::gemm", (a, b, torch.float32, bias, "gelu", pre, n, n, n, n, False), None),
        # the backward's forms: the activation's derivative and the bias gradient, then grouped
        (
            "truefuse::gemm_out",
            (g, x, _r(6, 4, device=device), True, n, n, n, "relu", _r(6, 9, device=device), gb, n, False),
            None,
        ),
        ("truefuse::gemm_out", (g, x, out, False, n, n, n, n, n, gb2, [4, 5], True), None),
    ]


def _gemm_compile(device):
    bias = _r(10, device=device, seed=1)
    return [(lambda a, b: truefuse_attr("gemm")(a, b, bias=bias), (_r(8, 12, device=device), _r(12, 10, device=device)), ())]


def truefuse_attr(name: str):
    """``truefuse.<name>``, imported when a sample runs (this module's import stays light)."""
    import truefuse

    return getattr(truefuse, name)


def _grouped_gemm_opcheck(device):
    from truefuse.ops.grouped_gemm.grouped_gemm import split_offsets

    splits, K, N = [5, 0, 1, 19, 3], 24, 20  # an empty group, a one-row group, several tiles
    M, G = sum(splits), len(splits)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32  # what the kernel takes there
    x, w, b, dy = (_r(*s, device=device, seed=i).to(dt) for i, s in enumerate([(M, K), (G, N, K), (G, N), (M, N)]))
    off = split_offsets(splits, G, M, x.device)
    return [
        ("truefuse::grouped_gemm_rows", (x, w, off, b, True, torch.empty(M, N, device=device, dtype=dt)), None),
        ("truefuse::grouped_gemm_wgrad", (dy, x, off, torch.zeros(G, N, K, device=device), True), None),
        ("truefuse::grouped_gemm_bgrad", (dy, off), None),
    ]


def _norm_opcheck(rms: bool):
    def sample(device):
        from truefuse.ops.norm.norm import norm_fwd_op

        x, w = _r(9, 40, device=device, grad=True), _r(40, device=device, grad=True, seed=1)
        b = None if rms else _r(40, device=device, grad=True, seed=2)
        y, mean, rstd = norm_fwd_op(x, w, b, 1e-5, rms, False)
        d = lambda t: None if t is None else t.detach()  # noqa: E731
        return [
            ("truefuse::norm_fwd", (x, w, b, 1e-5, rms, False), None),
            ("truefuse::norm_bwd", (torch.randn_like(y), d(x), d(w), d(b), mean, rstd, rms, False), None),
        ]

    return sample


def _rms_norm_hf_opcheck(device):
    from truefuse.ops.norm.norm import hf_rstd

    x, w = _r(6, 32, device=device, grad=True), _r(32, device=device, grad=True, seed=1)
    rstd = hf_rstd(x.detach(), 1e-6).reshape(-1)
    out = [("truefuse::rms_norm_hf_fwd", (x, w, rstd, style), None) for style in ("llama", "gemma")]
    # its backward's call of norm_bwd: the statistics given, no mean, the weight zero-centered (gemma)
    dy = _r(6, 32, device=device, seed=2)
    out.append(("truefuse::norm_bwd", (dy, x.detach(), w.detach(), None, rstd.new_empty(0), rstd, True, True), None))
    # the PyTorch path kept opaque under torch.compile in batch-invariant mode off CUDA
    out += [("truefuse::rms_norm_hf_pytorch_fwd", (x, w, 1e-6, style), None) for style in ("llama", "gemma")]
    return out + [("truefuse::rms_norm_hf_pytorch_bwd", (dy, x.detach(), w.detach(), 1e-6, "llama"), None)]


def _gated_opcheck(device):
    out = []
    for name, width in (("swiglu", 48), ("gelu", 24)):
        x = _r(7, width, device=device, grad=True)
        out += [
            ("truefuse::gated_activation_fwd", (x, name), None),
            ("truefuse::gated_activation_bwd", (_r(7, 24, device=device, seed=1), x.detach(), name), None),
        ]
    g, u = _r(5, 24, device=device, grad=True), _r(5, 24, device=device, grad=True, seed=1)
    out += [
        ("truefuse::gated_activation2_fwd", (g, u, "swiglu"), None),
        ("truefuse::gated_activation2_bwd", (_r(5, 24, device=device, seed=2), g.detach(), u.detach(), "swiglu"), None),
    ]
    return out


def _gated_compile(device):
    f = truefuse_attr("gated_activation")
    x, u = _r(2, 3, 32, device=device, grad=True), _r(2, 3, 32, device=device, grad=True, seed=1)
    return [(lambda x: f(x, "geglu"), (x,), ()), (lambda g, u: f(g, "swiglu", u), (x, u), ())]


def _rope_opcheck(device):
    x, k = _r(2, 3, 5, 16, device=device, grad=True), _r(2, 1, 5, 16, device=device, grad=True)
    cos, sin = _r(2, 5, 16, device=device, seed=1), _r(2, 5, 16, device=device, seed=2)
    gx, gk, f32 = torch.randn_like(x), torch.randn_like(k), torch.float32
    return [
        ("truefuse::rope_fwd", (x, k, cos, sin), None),
        ("truefuse::rope_bwd", (gx, gk, cos, sin, f32, f32), None),
        ("truefuse::rope_bwd", (None, gk, cos, sin, f32, f32), None),  # q's gradient not asked
    ]


def _rope_compile(device):
    q, k = _r(2, 4, 5, 16, device=device, grad=True), _r(2, 2, 5, 16, device=device, grad=True)
    cos, sin = _r(1, 5, 16, device=device, seed=1), _r(1, 5, 16, device=device, seed=2)
    return [(truefuse_attr("apply_rotary_pos_emb"), (q, k, cos, sin), ())]


def _hf_rotary_opcheck(device):
    """The batch-invariant model's rotary embedding op (integrations/huggingface/rotary_op.py) on a
    registered stock Llama embedding; none without transformers."""
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        from truefuse.integrations.huggingface import modules
        from truefuse.integrations.huggingface.batch_invariant import _rotary_forward
        from truefuse.integrations.huggingface.rotary_op import register
    except ImportError:
        return []
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4)).to(device)
    rotary.__class__ = modules.truefuse_subclass(type(rotary), "batch_invariant_rotary", _rotary_forward)
    _hf_rotary_opcheck.kept = rotary  # registered by a weak reference: alive while opcheck runs
    x, pos = _r(2, 5, 64, device=device), torch.arange(5, device=device)[None].expand(2, 5)
    return [("truefuse::hf_rotary_cos_sin", (register(rotary), x, pos), None)]


def _scale_opcheck(device):
    one = torch.tensor(1.0, device=device)  # the kernel's early exit
    return [
        ("truefuse::scale_", (_r(100, device=device), torch.tensor(0.5, device=device)), None),
        ("truefuse::scale_", (_r(7, 3, device=device), one), None),
    ]


def _scale_compile(device):
    from truefuse.ops.scale import scale_

    # scale_ mutates its argument: compile and eager each get a fresh copy (tests/test_compile.py)
    return [(lambda t, f: scale_(t * 1, f), (_r(100, device=device), torch.tensor(0.5, device=device)), ())]


def _adamw_args(device, lr, lr_tensor=None):
    """``truefuse::adamw_``'s arguments over two odd-sized tensors (a masked tail), fresh states."""
    ps = [_r(5, device=device), _r(3, 7, device=device, seed=1)]
    gs = [_r(5, device=device, seed=2), _r(3, 7, device=device, seed=3)]
    zeros = [torch.zeros_like(p) for p in ps]
    steps = [torch.zeros((), device=device) for _ in ps]
    return (ps, gs, zeros, [z.clone() for z in zeros], [], steps, lr, lr_tensor, 0.9, 0.999, 1e-8, 0.1)


def _adamw_opcheck(device):
    return [
        ("truefuse::adamw_", _adamw_args(device, 1e-2), None),
        ("truefuse::adamw_", _adamw_args(device, 0.0, torch.tensor(3e-3, device=device)), None),  # lr as a tensor
    ]


def _adamw_compile(device):
    from truefuse.ops.adamw import adamw_

    def step(p, g):
        # adamw_ mutates its arguments: compile and eager each step a fresh copy (tests/test_compile.py)
        p = p * 1
        m, v, s = torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device=p.device)
        adamw_([p], [g], [m], [v], [s], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
        return p, m, v

    return [(step, (_r(37, device=device), _r(37, device=device, seed=1)), ())]


def _targets(n: int, v: int, device) -> torch.Tensor:
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1)).to(device)
    t[3 % n] = -100  # an ignored token
    return t


def _token_log_probs_compile(device):
    f = truefuse_attr("token_log_probs")

    def fn(logits, t):
        out = f(logits, t, temperature=0.9)
        return out.log_probs.sum() + 0.5 * out.entropy.sum()

    return [(fn, (_r(6, 11, device=device, grad=True), _targets(6, 11, device)), ())]


def _lce_opcheck(device):
    C, V = 5, 70
    t = torch.tensor([0, 3, -100, 69, 5], device=device)
    ce, zl, ok = torch.empty(C, device=device), torch.empty(C, device=device), torch.empty(C, dtype=torch.bool, device=device)
    s = torch.tensor(0.25, device=device)
    out = []
    for want in (True, False):  # pred: no default
        args = (_r(C, V, device=device), t, None, ce, zl, ok, s, s, None, V, -100, float(V), 0.1, 1e-4, None, want, None)
        out.append(("truefuse::lce_chunk", args, None))
    # the lean loss's two slice kernels: a slice [64, 134) of a 200-class vocabulary
    N, v0, Vs, V = 5, 64, 70, 200
    logits, t = _r(N, Vs, device=device), torch.tensor([0, 70, -100, 133, 199], device=device)
    stats = [torch.empty(N, device=device) for _ in range(2)]
    arg, has_t = torch.empty(N, dtype=torch.int64, device=device), torch.empty(N, dtype=torch.bool, device=device)
    wz, zt = torch.zeros(N, device=device), torch.zeros(N, device=device)
    cw = torch.rand(Vs, generator=torch.Generator().manual_seed(3)).to(device) + 0.5
    lse = _r(N, device=device, seed=4) + 5
    return out + [
        ("truefuse::lce_slice_stats", (logits, None, cw, t, *stats, arg, wz, zt, has_t, v0, 4.0, True), None),
        ("truefuse::lce_slice_grad", (logits, None, cw, t, lse, s, s, v0, V, -100, 250.0, 0.1, 1e-4, 4.0), None),
        # the loss's targets prologue (count, scales, check)
        ("truefuse::lce_targets", (t, torch.empty(4, device=device), V, -100), None),
    ]


def _lce_compile(device):
    f, loss_cls = truefuse_attr("linear_cross_entropy"), truefuse_attr("LinearCrossEntropyLoss")
    x, W, t = _r(10, 16, device=device, grad=True), _r(70, 16, device=device, grad=True, seed=1), _targets(10, 70, device)
    out = []
    for chunk in (None, 4):
        loss = loss_cls(label_smoothing=0.1, chunk_size=chunk)
        out += [
            (lambda x, W, t, c=chunk: f(x, W, t, chunk_size=c, z_loss=1e-4), (x, W, t), ()),
            (lambda x, W, t, loss=loss: loss(x, W, t), (x, W, t), ()),
        ]
    # memory="lean": the vocabulary in slices
    return out + [(lambda x, W, t: f(x, W, t, memory="lean", vocab_slice=64), (x, W, t), ())]


def _log_probs_opcheck(device):
    C, V = 5, 70
    t = torch.tensor([0, 3, -100, 69, 5], device=device)
    lp, ent = torch.empty(C, device=device), torch.empty(C, device=device)
    a, c, bias = _r(C, device=device, seed=1), _r(C, device=device, seed=2), _r(V, device=device, seed=3)
    return [
        ("truefuse::log_probs_chunk", (_r(C, V, device=device), t, lp, ent, a, c, bias, V, -100, 0.7, 5.0, want), None)
        for want in (True, False)
    ]


def _log_probs_compile(device):
    f = truefuse_attr("linear_log_probs")

    def fn(x, W, t):
        out = f(x, W, t, temperature=0.9, chunk_size=4)
        return out.log_probs.sum() + 0.5 * out.entropy.sum()

    x, W = _r(10, 16, device=device, grad=True), _r(70, 16, device=device, grad=True, seed=1)
    return [(fn, (x, W, _targets(10, 70, device)), ())]


def _attention_opcheck(device):
    # the smallest shapes the kernels take: the interpreter costs ~1 s a forward at test_attention's
    q, k, v = (_r(1, 2, 4, 16, device=device, seed=i, grad=True) for i in range(3))
    ks = torch.zeros(1, dtype=torch.int32, device=device)
    args = (None, ks, 0.25, True, 0, 0.0)
    with torch.no_grad():  # the backward op takes plain tensors (a traced backward graph does)
        out, lse = resolve("truefuse.ops.attention.attention:attention_fwd_op")(q, k, v, *args)
    detached = (q.detach(), k.detach(), v.detach(), out, lse)
    # the PyTorch path's ops (what torch.compile traces in its place), fp64: no kernel takes it
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    plain = tuple(t.detach() for t in (q2, k2, v2))  # differentiating the backward op is refused, by name
    return [
        ("truefuse::attention_fwd", (q, k, v, *args), None),
        ("truefuse::attention_bwd", (torch.randn_like(out), *detached, *args), None),
        ("truefuse::attention_pytorch_fwd", (q2, k2, v2, *args), None),
        ("truefuse::attention_pytorch_bwd", (torch.randn_like(plain[0]), *plain, *args), None),
    ]


def _attention_compile(device):
    q, k, v = (_r(1, 2, 4, 16, device=device, seed=i, grad=True) for i in range(3))
    return [(lambda q, k, v: truefuse_attr("attention")(q, k, v, is_causal=True), (q, k, v), ())]


def _grouped_mlp_opcheck(device):
    R, H, F, E = 6, 16, 12, 2
    recompute = (_r(7, 24, device=device, seed=1), _r(7, 48, device=device), "swiglu")
    out = [("truefuse::gated_activation_bwd_recompute", recompute, None)]
    if not available("truefuse.integrations.huggingface.experts_op"):
        return out
    x, w1, w2 = (_r(*s, device=device, seed=i, grad=True) for i, s in enumerate([(R, H), (E, 2 * F, H), (E, H, F)]))
    # not test_aot_dispatch_dynamic: the backward (traced, unlike the opaque forward) runs the
    # experts again from counts.tolist(), a data-dependent size AOT autograd cannot trace; the op
    # exists for torch.export (issue 31)
    args = (x, w1, w2, torch.tensor([2, 4], device=device), "swiglu", "per_group")
    return out + [("truefuse::hf_experts_mlp", args, _NOT_AOT)]


_NOT_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")


def _allreduce_opcheck(device):
    """One rank (world size 1) over host buffers: the interpreter runs the kernel's protocol alone."""
    if device.type != "cpu":
        return []  # the one-rank host-buffer form is the interpreter's; the GPU's: tests/distributed
    from truefuse.distributed.workspace import layout

    half, ll_offset, ll_slot = layout(1, 1 << 16)
    buf, sig = torch.zeros(2 * half, dtype=torch.uint8), torch.zeros(2 * 512, dtype=torch.int32)
    ptrs, sptrs = torch.tensor([buf.data_ptr()]), torch.tensor([sig.data_ptr()])
    epoch, done = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    x, res, w = _r(3, 32, device=device), _r(3, 32, device=device, seed=1), _r(32, device=device)
    args = (x, res, w, ptrs, sptrs, epoch, done, half, ll_offset, ll_slot, 512, 0, 1, 1, 1, 1e-6, 1 << 30, True)
    ptrs.keep_alive = (buf, sig)  # ptrs holds only their addresses: the buffers live as long as it
    return [("truefuse::allreduce_add_rmsnorm", args, ("test_schema", "test_faketensor"))]


def _add_rms_norm_hf_opcheck(device):
    r, h = _r(6, 32, device=device, grad=True), _r(6, 32, device=device, grad=True, seed=1)
    w = _r(32, device=device, grad=True, seed=2)
    # torch's statistics (every mode but batch-invariant on CUDA) and the kernel's (one launch), both styles
    out = [
        ("truefuse::add_rms_norm_hf_fwd", (r, h, w, 1e-6, style, kernel_stats), None)
        for style in ("llama", "gemma")
        for kernel_stats in (False, True)
    ]
    s, rstd = (r + h).detach(), torch.rand(6, device=device) + 0.5
    dn, ds = _r(6, 32, device=device, seed=3), _r(6, 32, device=device, seed=4)
    # its backward with the residual stream's gradient and without (only the normed output used)
    return out + [("truefuse::add_rms_norm_bwd", (dn, d, s, w.detach(), rstd, zc), None) for d, zc in ((ds, False), (None, True))]


def _add_rms_norm_opcheck(device):
    r, x = _r(6, 32, device=device, grad=True), _r(6, 32, device=device, grad=True, seed=1)
    w = _r(32, device=device, grad=True, seed=2)
    # with a weight, zero-centred, and without one; the shared backward without a weight (its own
    # samples with one are add_rms_norm_hf's)
    out = [("truefuse::add_rms_norm_fwd", (r, x, wt, 1e-6, zc), None) for wt, zc in ((w, False), (w, True), (None, False))]
    s, rstd, dn = (r + x).detach(), torch.rand(6, device=device) + 0.5, _r(6, 32, device=device, seed=3)
    return out + [("truefuse::add_rms_norm_bwd", (dn, dn.flip(0), s, None, rstd, False), None)]


_NORM_OPS = {
    "truefuse::norm_fwd": "truefuse.ops.norm.norm:norm_fwd_op",
    "truefuse::norm_bwd": "truefuse.ops.norm.norm:norm_bwd_op",
}
_NO_COMPILE_GROUPED = "no public function: GroupedLinear's and GroupedMLP's samples on backend='triton' trace it"

OPS: tuple[OpDecl, ...] = (
    OpDecl(
        name="sibling_linears",
        stem="siblings",
        custom_ops={},  # torch's own GEMMs (F.linear, mm, addmm_) in an autograd Function
        ref="truefuse.ops.gemm.siblings:sibling_linears_ref",
        verify=("sibling_linears",),
        inline=False,
        eager=False,
        dtensor="refused",
        # under truefuse.batch_invariant() the batch-invariant GEMMs (BatchInvariantSiblingLinears), else
        # cuBLAS's as stock's F.linear; double backward is autograd's in fast mode, refused in batch-invariant
        batch_invariant="switch-dependent",
        double_backward="supported",
        compile=lambda d: [
            (
                lambda x, a, b, c: truefuse_attr("sibling_linears")(x, [a, b], [c, None]),
                tuple(_r(*s, device=d, seed=i, grad=True) for i, s in enumerate([(2, 3, 16), (8, 16), (4, 16), (8,)])),
                (),
            )
        ],
    ),
    OpDecl(
        name="gemm",
        stem="gemm",
        custom_ops={
            "truefuse::gemm": "truefuse.ops.gemm.gemm:gemm_op",
            "truefuse::gemm_result": "truefuse.ops.gemm.gemm:gemm_result_op",
            "truefuse::gemm_out": "truefuse.ops.gemm.gemm:gemm_out_op",
        },
        ref="truefuse.ops.gemm.gemm:gemm_ref",
        verify=("gemm",),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="switch-dependent",
        double_backward="not differentiable",
        opcheck=_gemm_opcheck,
        compile=_gemm_compile,
    ),
    OpDecl(
        name="ops.grouped_gemm",
        stem="grouped_gemm",
        custom_ops={
            f"truefuse::grouped_gemm_{k}": f"truefuse.ops.grouped_gemm.grouped_gemm:grouped_gemm_{k}_op"
            for k in ("rows", "wgrad", "bgrad")
        },
        ref="truefuse.ops.grouped_gemm.grouped_gemm:grouped_gemm_ref",
        verify=("grouped_gemm",),
        inline=False,
        eager=False,
        dtensor="no rule",  # an internal op: its callers (GroupedLinear, GroupedMLP) refuse
        batch_invariant="invariant by construction",
        double_backward="not differentiable",
        opcheck=_grouped_gemm_opcheck,
        why_not_compiled=_NO_COMPILE_GROUPED,
    ),
    OpDecl(
        name="rms_norm",
        stem="norm",
        custom_ops=_NORM_OPS,
        ref="truefuse.ops.norm.norm:rms_norm_ref",
        verify=("rms_norm",),
        inline=True,
        eager=True,
        dtensor="row-local",
        batch_invariant="invariant by construction",
        double_backward="refused",
        modules=("RMSNorm",),
        opcheck=_norm_opcheck(rms=True),
        compile=lambda d: [
            (
                lambda x, w: truefuse_attr("rms_norm")(x, w, 1e-6),
                (_r(3, 5, 32, device=d, grad=True), _r(32, device=d, grad=True)),
                (),
            ),
            *_module(lambda: truefuse_attr("RMSNorm")(16))(d),
        ],
    ),
    OpDecl(
        name="layer_norm",
        stem="norm",
        custom_ops=_NORM_OPS,
        ref="truefuse.ops.norm.norm:layer_norm_ref",
        verify=("layer_norm",),
        inline=True,
        eager=True,
        dtensor="row-local",
        batch_invariant="invariant by construction",
        double_backward="refused",
        opcheck=_norm_opcheck(rms=False),
        compile=lambda d: [
            (
                truefuse_attr("layer_norm"),
                tuple(_r(*s, device=d, seed=i, grad=True) for i, s in enumerate([(3, 5, 32), (32,), (32,)])),
                (),
            )
        ],
    ),
    OpDecl(
        name="rms_norm_hf",
        stem="norm",
        custom_ops={
            "truefuse::rms_norm_hf_fwd": "truefuse.ops.norm.norm:rms_norm_hf_fwd_op",
            "truefuse::norm_bwd": _NORM_OPS["truefuse::norm_bwd"],
            "truefuse::rms_norm_hf_pytorch_fwd": "truefuse.ops.norm.norm:rms_norm_hf_pytorch_op",
            "truefuse::rms_norm_hf_pytorch_bwd": "truefuse.ops.norm.norm:rms_norm_hf_pytorch_bwd_op",
        },
        ref="truefuse.ops.norm.norm:rms_norm_hf_ref",
        verify=("rms_norm_hf",),
        inline=True,
        eager=True,
        dtensor="row-local",
        # its statistics are torch's reduction on CUDA outside batch-invariant mode (stock's bits)
        batch_invariant="switch-dependent",
        double_backward="refused",
        opaque=("truefuse::rms_norm_hf_pytorch_fwd", "truefuse::rms_norm_hf_pytorch_bwd"),
        opcheck=_rms_norm_hf_opcheck,
        compile=lambda d: [
            (
                lambda x, w: truefuse_attr("rms_norm_hf")(x, w, 1e-6),
                (_r(2, 3, 32, device=d, grad=True), _r(32, device=d, grad=True)),
                (),
            )
        ],
    ),
    OpDecl(
        name="add_rms_norm_hf",
        stem="add_norm",
        custom_ops={
            "truefuse::add_rms_norm_hf_fwd": "truefuse.ops.norm.add_norm:add_rms_norm_hf_fwd_op",
            "truefuse::add_rms_norm_bwd": "truefuse.ops.norm.add_norm:add_rms_norm_bwd_op",
        },
        ref="truefuse.ops.norm.add_norm:add_rms_norm_hf_ref",
        verify=("add_rms_norm_hf",),
        inline=True,
        eager=True,
        dtensor="refused",
        # its statistics are torch's reduction on CUDA outside batch-invariant mode (stock's bits), as rms_norm_hf's
        batch_invariant="switch-dependent",
        double_backward="refused",
        opcheck=_add_rms_norm_hf_opcheck,
        compile=lambda d: [
            (
                lambda r, h, w: truefuse_attr("add_rms_norm_hf")(r, h, w, 1e-6),
                tuple(_r(*s, device=d, seed=i, grad=True) for i, s in enumerate([(2, 3, 32), (2, 3, 32), (32,)])),
                (),
            )
        ],
    ),
    OpDecl(
        name="add_rms_norm",
        stem="add_norm",
        custom_ops={
            "truefuse::add_rms_norm_fwd": "truefuse.ops.norm.add_norm:add_rms_norm_fwd_op",
            "truefuse::add_rms_norm_bwd": "truefuse.ops.norm.add_norm:add_rms_norm_bwd_op",
        },
        ref="truefuse.ops.norm.add_norm:add_rms_norm_ref",
        verify=("add_rms_norm",),
        inline=True,
        eager=True,
        dtensor="refused",
        batch_invariant="invariant by construction",
        double_backward="refused",
        opcheck=_add_rms_norm_opcheck,
        compile=lambda d: [
            (
                lambda r, x, w: truefuse_attr("add_rms_norm")(r, x, w, 1e-6),
                tuple(_r(*s, device=d, seed=i, grad=True) for i, s in enumerate([(2, 3, 32), (2, 3, 32), (32,)])),
                (),
            )
        ],
    ),
    OpDecl(
        name="gated_activation",
        stem="gated_activation",
        custom_ops={
            f"truefuse::gated_activation{n}_{d}": f"truefuse.ops.gated_activation.gated_activation:gated{n}_{d}_op"
            for n in ("", "2")
            for d in ("fwd", "bwd")
        },
        ref="truefuse.ops.gated_activation.gated_activation:gated_activation_ref",
        verify=("gated_activation",),
        inline=True,
        eager=True,
        dtensor="row-local",
        batch_invariant="invariant by construction",
        double_backward="refused",
        opcheck=_gated_opcheck,
        compile=_gated_compile,
    ),
    OpDecl(
        name="apply_rotary_pos_emb",
        stem="rope",
        custom_ops={
            "truefuse::rope_fwd": "truefuse.ops.rope:rope_fwd_op",
            "truefuse::rope_bwd": "truefuse.ops.rope:rope_bwd_op",
            # a batch-invariant model's cos and sin, opaque under torch.compile (its eager bits)
            "truefuse::hf_rotary_cos_sin": "truefuse.integrations.huggingface.rotary_op:rotary_cos_sin",
        },
        ref="truefuse.ops.rope:rope_ref",
        verify=("rope",),
        inline=True,
        eager=True,
        dtensor="refused",
        batch_invariant="invariant by construction",
        double_backward="refused",
        opaque=("truefuse::hf_rotary_cos_sin",),
        opcheck=lambda d: _rope_opcheck(d) + _hf_rotary_opcheck(d),
        compile=_rope_compile,
    ),
    OpDecl(
        name="ops.scale_",  # the loss backward's in-place scaling
        stem="scale",
        custom_ops={"truefuse::scale_": "truefuse.ops.scale:scale_op"},
        ref="truefuse.ops.scale:scale_ref",
        verify=("scale",),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="invariant by construction",
        double_backward="not differentiable",
        opcheck=_scale_opcheck,
        compile=_scale_compile,
    ),
    OpDecl(
        name="ops.adamw_",  # truefuse.optim.AdamW's in-place update (docs/optim.md)
        stem="adamw",
        custom_ops={"truefuse::adamw_": "truefuse.ops.adamw:adamw_op"},
        ref="truefuse.ops.adamw:adamw_ref",
        verify=("adamw",),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="invariant by construction",  # elementwise: an element's bits never see the others
        double_backward="not differentiable",
        opcheck=_adamw_opcheck,
        compile=_adamw_compile,
    ),
    OpDecl(
        name="token_log_probs",
        stem="token_log_probs",
        custom_ops={},  # PyTorch row by row: no kernel of its own
        ref="truefuse.ops.lm_head.token_log_probs:token_log_probs_ref",
        verify=("token_log_probs",),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="invariant by construction",
        double_backward="refused",
        compile=_token_log_probs_compile,
    ),
    OpDecl(
        name="linear_cross_entropy",
        stem="linear_cross_entropy",
        custom_ops={
            "truefuse::lce_chunk": "truefuse.ops.lm_head.linear_cross_entropy_chunk:lce_chunk_op",
            "truefuse::lce_targets": "truefuse.ops.lm_head.linear_cross_entropy:lce_targets_op",
            "truefuse::lce_slice_stats": "truefuse.ops.lm_head.linear_cross_entropy_slices:lce_slice_stats_op",
            "truefuse::lce_slice_grad": "truefuse.ops.lm_head.linear_cross_entropy_slices:lce_slice_grad_op",
        },
        ref="truefuse.ops.lm_head.linear_cross_entropy:linear_cross_entropy_ref",
        verify=("linear_cross_entropy", "linear_cross_entropy_lean"),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="switch-dependent",
        double_backward="refused",
        modules=("LinearCrossEntropyLoss",),
        opcheck=_lce_opcheck,
        compile=_lce_compile,
    ),
    OpDecl(
        name="linear_log_probs",
        stem="linear_log_probs",
        custom_ops={"truefuse::log_probs_chunk": "truefuse.ops.lm_head.linear_log_probs:log_probs_chunk_op"},
        ref="truefuse.ops.lm_head.linear_log_probs:linear_log_probs_ref",
        verify=("linear_log_probs",),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="switch-dependent",
        double_backward="refused",
        opcheck=_log_probs_opcheck,
        compile=_log_probs_compile,
    ),
    OpDecl(
        name="attention",
        stem="attention",
        custom_ops={
            "truefuse::attention_fwd": "truefuse.ops.attention.attention:attention_fwd_op",
            "truefuse::attention_bwd": "truefuse.ops.attention.attention:attention_bwd_op",
            "truefuse::attention_pytorch_fwd": "truefuse.ops.attention.attention:attention_pytorch_op",
            "truefuse::attention_pytorch_bwd": "truefuse.ops.attention.attention:attention_pytorch_bwd_op",
        },
        ref="truefuse.ops.attention.attention:attention_ref",
        verify=("attention",),
        inline=False,
        eager=True,
        dtensor="refused",
        batch_invariant="invariant by construction",
        double_backward="refused",  # on the kernels; the PyTorch path (bf16 on the CPU) is autograd's
        opcheck=_attention_opcheck,
        compile=_attention_compile,
    ),
    *(
        OpDecl(
            name=name,
            stem=stem,
            custom_ops={},  # its GEMMs are gemm's custom ops, its norm the norms'
            ref=f"truefuse:{name}.forward_ref",
            verify=(name,),
            inline=False,
            eager=False,
            dtensor="refused",
            batch_invariant="switch-dependent",
            double_backward="refused",
            compile=_module(lambda name=name, a=args: truefuse_attr(name)(*a)),
        )
        for name, stem, args in (
            ("Linear", "linear", (16, 12)),
            ("LayerNormLinear", "layernorm_linear", (16, 12)),
            ("LayerNormMLP", "layernorm_mlp", (16, 24)),
        )
    ),
    OpDecl(
        name="GroupedLinear",
        stem="grouped",
        custom_ops={},  # the grouped GEMM's ops (backend="triton") or gemm's
        ref="truefuse:GroupedLinear.forward_ref",
        verify=("GroupedLinear",),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="switch-dependent",
        double_backward="refused",
        compile=_module(lambda: truefuse_attr("GroupedLinear")(2, 16, 12), lambda m, x: m(x, [2, 4])),
    ),
    OpDecl(
        name="GroupedMLP",
        stem="grouped",
        custom_ops={
            "truefuse::gated_activation_bwd_recompute": "truefuse.ops.gated_activation.gated_recompute:gated_bwd_recompute_op",
            # the patched Hugging Face experts' forward as one op, for torch.export
            "truefuse::hf_experts_mlp": "truefuse.integrations.huggingface.experts_op:experts_mlp",
        },
        ref="truefuse:GroupedMLP.forward_ref",
        verify=("GroupedMLP",),
        inline=False,
        eager=False,
        dtensor="refused",
        batch_invariant="switch-dependent",
        double_backward="refused",
        opcheck=_grouped_mlp_opcheck,
        compile=_module(lambda: truefuse_attr("GroupedMLP")(2, 16, 12), lambda m, x: m(x, [2, 4])),
    ),
    OpDecl(
        name="distributed.allreduce_add_rmsnorm",
        stem="allreduce",
        custom_ops={"truefuse::allreduce_add_rmsnorm": "truefuse.ops.allreduce:allreduce_add_rmsnorm_op"},
        ref="truefuse.distributed.allreduce:allreduce_add_rmsnorm_ref",
        verify=("allreduce_add_rmsnorm",),
        inline=False,
        eager=False,
        dtensor="no rule",
        batch_invariant="invariant by construction",
        double_backward="refused",
        opcheck=_allreduce_opcheck,
        why_not_compiled="needs a process group and its symmetric-memory workspace: tests/distributed",
    ),
)


def by_name() -> dict[str, OpDecl]:
    return {d.name: d for d in OPS}


def declared_custom_ops() -> dict[str, str]:
    """Every declared ``truefuse::`` op -> where it lives (shared ones once)."""
    return {k: v for d in OPS for k, v in d.custom_ops.items()}
