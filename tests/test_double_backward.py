"""Double backward (issue 31, item 1; docs/design.md §6.5): every differentiable truefuse op either
differentiates its gradient correctly or refuses with one error naming the op and its reference.

For each op, tiny fp32 shapes (the Triton kernels under the interpreter): a gradient taken with
``create_graph=True`` and then differentiated (a gradient penalty) raises the named error instead
of silently dropping the second-order term; and a ``create_graph=True`` backward whose gradient
is not differentiated again gives the plain backward's gradients, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import truefuse
from truefuse.ops.lm_head.linear_cross_entropy import linear_cross_entropy_ref

N, H, V = 6, 8, 11


def _leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).requires_grad_()


def _target(n=N, v=V):
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    t[1] = -100  # an ignored token
    return t


def _lce(**kw):
    return lambda x, W: truefuse.linear_cross_entropy(x, W, _target(), **kw)


def _log_probs(x, W):
    out = truefuse.linear_log_probs(x, W, _target())
    return out.log_probs.square().sum() + out.entropy.sum()


def _module(make, call=lambda m, x: m(x)):
    torch.manual_seed(0)
    m = make()
    return lambda x, *params: call(m, x).square().sum(), None, list(m.parameters())


def _grouped(make):
    torch.manual_seed(0)
    m = make()
    return lambda x, *params: m(x, [2, 4]).square().sum(), None, list(m.parameters())


def _rope(q, k):
    cos, sin = torch.randn(2, 1, 3, 4, generator=torch.Generator().manual_seed(2)).unbind(0)
    qo, ko = truefuse.apply_rotary_pos_emb(q, k, cos, sin)
    return qo.square().sum() + ko.square().sum()


def _token_log_probs(logits):
    out = truefuse.token_log_probs(logits, _target())
    return out.log_probs.square().sum() + out.entropy.sum()


def _head_logits(x, W):
    from truefuse.autograd._chunked_head import head_logits  # batch-invariant mode's logits

    return head_logits(x, W).square().sum()


def _add_norm(r, h, w):
    normed, summed = truefuse.add_rms_norm_hf(r, h, w)
    return normed.square().sum() + summed.square().sum()


def _add_own_norm(r, x, w):
    normed, summed = truefuse.add_rms_norm(r, x, w)
    return normed.square().sum() + summed.square().sum()


# name: (the op(s) the error may name, f(*inputs) -> scalar, the inputs' shapes (x first) or None,
# a module's parameters (x is then (N, H)) or None)
CASES = {
    "linear_cross_entropy": ("linear_cross_entropy", _lce(), [(N, H), (V, H)], None),
    "linear_cross_entropy_lean": ("linear_cross_entropy", _lce(memory="lean", vocab_slice=4), [(N, H), (V, H)], None),
    "linear_cross_entropy_none": (
        "linear_cross_entropy",
        lambda x, W: _lce(reduction="none")(x, W).square().sum(),
        [(N, H), (V, H)],
        None,
    ),
    "LinearCrossEntropyLoss": (
        "linear_cross_entropy",
        lambda x, W: truefuse.LinearCrossEntropyLoss()(x, W, _target()),
        [(N, H), (V, H)],
        None,
    ),
    "linear_log_probs": ("linear_log_probs", _log_probs, [(N, H), (V, H)], None),
    "Linear": ("Linear", *_module(lambda: truefuse.Linear(H, 5))),
    "LayerNormLinear": ("LayerNormLinear|layer_norm", *_module(lambda: truefuse.LayerNormLinear(H, 5))),
    "LayerNormMLP": ("LayerNormMLP|layer_norm|gated_activation", *_module(lambda: truefuse.LayerNormMLP(H, 6))),
    "GroupedLinear": ("GroupedLinear", *_grouped(lambda: truefuse.GroupedLinear(2, H, 5))),
    "GroupedMLP": ("GroupedMLP|gated_activation", *_grouped(lambda: truefuse.GroupedMLP(2, H, 6))),
    "rms_norm": ("rms_norm", lambda x, w: truefuse.rms_norm(x, w).square().sum(), [(N, H), (H,)], None),
    "layer_norm": ("layer_norm", lambda x, w, b: truefuse.layer_norm(x, w, b).square().sum(), [(N, H), (H,), (H,)], None),
    "rms_norm_hf": ("rms_norm", lambda x, w: truefuse.rms_norm_hf(x, w).square().sum(), [(N, H), (H,)], None),
    "RMSNorm": ("rms_norm", *_module(lambda: truefuse.RMSNorm(H))),
    "add_rms_norm_hf": ("add_rms_norm_hf", _add_norm, [(N, H), (N, H), (H,)], None),
    # the shared backward op's refusal names add_rms_norm_hf where the dispatcher runs it
    "add_rms_norm": ("add_rms_norm", _add_own_norm, [(N, H), (N, H), (H,)], None),
    "gated_activation": ("gated_activation", lambda x: truefuse.gated_activation(x, "swiglu").square().sum(), [(N, H)], None),
    "gated_activation_two": (
        "gated_activation",
        lambda g, u: truefuse.gated_activation(g, "geglu", u).square().sum(),
        [(N, H), (N, H)],
        None,
    ),
    "apply_rotary_pos_emb": ("apply_rotary_pos_emb", _rope, [(1, 2, 3, 4), (1, 1, 3, 4)], None),
    "token_log_probs": ("token_log_probs", _token_log_probs, [(N, V)], None),
    # the kernels under the interpreter (fp32), the smallest shapes they take
    "attention": (
        "attention",
        lambda q, k, v: truefuse.attention(q, k, v, is_causal=True).square().sum(),
        [(1, 2, 4, 16)] * 3,
        None,
    ),
    "head_logits": ("linear_cross_entropy", _head_logits, [(N, H), (V, H)], None),
}


def _inputs(case):
    _, fn, shapes, params = case
    if params is None:  # a function: every input a leaf
        return fn, [_leaf(*s, seed=i) for i, s in enumerate(shapes)]
    x = _leaf(N, H)  # a module: x, then its parameters
    return fn, [x, *params]


#: On a CUDA machine these CPU tensors run the ops' PyTorch references (no interpreter there), which
#: autograd differentiates twice correctly; the kernels' refusal is what this file checks (CI: the
#: interpreter). A CUDA run of the kernels' refusal: tests/test_attention.py's custom op, verify.
_CPU_REFERENCE = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors run the PyTorch reference here")


def _check(names: str, fn, inputs) -> None:
    # a create_graph backward not differentiated again: the plain backward's gradients, bit for bit
    plain = torch.autograd.grad(fn(*inputs), inputs)
    graph = torch.autograd.grad(fn(*inputs), inputs, create_graph=True)
    for p, g in zip(plain, graph, strict=True):
        assert torch.equal(p, g.detach())
    # differentiated again (a gradient penalty): the named refusal, never a dropped second-order term
    penalty = graph[0].square().sum()
    with pytest.raises(
        RuntimeError,
        match=rf"truefuse\.(distributed\.)?({names}) does not support double backward "
        r"\(.*create_graph=True.*\); .*unfused reference (truefuse|torch)\.",
    ):
        torch.autograd.grad(penalty, inputs, allow_unused=True)


@_CPU_REFERENCE
@pytest.mark.parametrize("name", list(CASES))
def test_double_backward_refused_by_name(name):
    fn, inputs = _inputs(CASES[name])
    _check(CASES[name][0], fn, inputs)


def test_reference_gives_the_second_order_term_the_fused_op_refuses():
    """What the message points to: the reference differentiates twice (float64), and the fused
    op's first-order gradient is that of the reference, so the penalty is the same computation."""
    x, W = _leaf(N, H).double(), _leaf(V, H).double()
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    (gx,) = torch.autograd.grad(linear_cross_entropy_ref(x, W, _target()), x, create_graph=True)
    (dW,) = torch.autograd.grad(gx.square().sum(), W)
    assert dW.abs().sum() > 0  # the term the old fused op dropped without a word
    (fx,) = torch.autograd.grad(truefuse.linear_cross_entropy(x, W, _target()), x, create_graph=True)
    torch.testing.assert_close(fx.detach(), gx.detach(), rtol=0, atol=1e-12)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank, destroyed afterwards (other tests expect none)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _distributed_cases():
    from truefuse import distributed as tfd

    ar_norm = tfd.allreduce_add_rmsnorm
    return {
        "allreduce_add_rmsnorm": (
            "allreduce_add_rmsnorm",
            lambda x, r, w: sum(o.square().sum() for o in ar_norm(x, r, w)),
            [(N, H), (N, H), (H,)],
            None,
        ),
        "vocab_parallel_linear_cross_entropy": (
            "linear_cross_entropy",
            lambda x, W: tfd.linear_cross_entropy(x, W, _target()),
            [(N, H), (V, H)],
            None,
        ),
        "ColumnParallelLinear": ("ColumnParallelLinear", *_module(lambda: tfd.ColumnParallelLinear(H, 4))),
        "RowParallelLinear": (
            "RowParallelLinear|scatter_to_tp_region",
            *_module(lambda: tfd.RowParallelLinear(H, 4, input_is_parallel=False)),
        ),
        "TensorParallelMLP": (
            "TensorParallelMLP|ColumnParallelLinear|RowParallelLinear|gated_activation|allreduce_add_rmsnorm",
            *_module(lambda: tfd.TensorParallelMLP(H, 8), lambda m, x: m(x, 0 * x)[0]),
        ),
    }


@pytest.mark.usefixtures("one_rank_group")  # the distributed cases build their layers on a group
def test_every_op_declaring_a_refusal_has_a_case():
    """Each op whose declaration (truefuse/verify/op_table.py) says its double backward is refused
    has a case here under its name or one of its modules' (a distributed op's without the prefix),
    and every case is a declared op or one of its forms."""
    from truefuse.verify.op_table import OPS

    cases = set(CASES) | set(_distributed_cases())
    for d in OPS:
        if d.double_backward == "refused":
            names = {d.name.removeprefix("distributed."), *d.modules}
            assert names & cases, f"{d.name} declares its double backward refused but has no case here"
    declared = {n.removeprefix("distributed.") for d in OPS for n in (d.name, *d.modules)}
    forms = {n for n in cases if not any(n.startswith(name) for name in declared)}
    # the distributed modules and the batch-invariant head's logits: not in the op table (its scope:
    # the ops of verify's registry and of torch.ops.truefuse)
    assert forms == {
        "ColumnParallelLinear",
        "RowParallelLinear",
        "TensorParallelMLP",
        "vocab_parallel_linear_cross_entropy",
        "head_logits",
    }, forms


@pytest.mark.usefixtures("one_rank_group")
@_CPU_REFERENCE
def test_double_backward_refused_distributed_one_rank():
    """The distributed ops on their single-process path (gloo, one rank): the same two checks."""
    for name, case in _distributed_cases().items():
        fn, inputs = _inputs(case)
        try:
            _check(case[0], fn, inputs)
        except BaseException as e:
            raise AssertionError(f"{name}: {e}") from e


def test_attention_cpu_path_differentiates_twice_like_the_reference():
    """``truefuse.attention``'s CPU path is PyTorch (its kernels' custom op refuses by name on the
    GPU, ``ops/attention/attention.py``): there the second-order term is autograd's, equal to the reference's."""
    from truefuse.ops.attention.attention import attention_ref

    def penalty(f):
        q, k, v = (_leaf(1, 2, 5, 8, seed=i).double() for i in range(3))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        (gq,) = torch.autograd.grad(f(q, k, v, is_causal=True).square().sum(), q, create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (k, v))

    for a, b in zip(penalty(truefuse.attention), penalty(attention_ref), strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
