"""truefuse.optim.AdamW and its update ``ops.adamw_`` (docs/optim.md): bitwise torch's single-tensor
capturable AdamW (``foreach=False, capturable=True``), one launch per group.

On the CPU the kernel runs in Triton's interpreter in fp32 (and fp16 with fp32 masters, whose one
cast numpy rounds correctly). torch refuses ``capturable`` on the CPU, so its check is lifted here
(its code runs unchanged), and torch's CPU ``sqrt`` is MKL's, not correctly rounded: the
comparison with torch's own code makes it IEEE (``ops/adamw.py::sqrt_rn``). bf16 / fp16 against
torch run on CUDA only (the interpreter truncates bf16 casts)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.optim.adam as torch_adam
from conftest import requires_cuda

import truefuse.ops.adamw as adamw_ops
from truefuse.ops.adamw import adamw_, adamw_ref, sqrt_rn
from truefuse.optim import AdamW
from truefuse.testing import assert_bitwise
from truefuse.verify.registry import all_cases

SIZES = ((1,), (7,), (33, 5), (1000,), (4097,), ())  # one element, odd sizes, several 128-element CPU chunks, 0-dim


@pytest.fixture
def torch_capturable_here(monkeypatch, device):
    """torch's capturable AdamW as it runs on CUDA: on the CPU its device check lifted and its
    ``sqrt`` correctly rounded (torch's CPU ``sqrt`` is MKL's; the kernel's is IEEE, as CUDA's)."""
    if device.type == "cpu":
        monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", lambda supports_xla=True: ["cuda", "cpu"])
        monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: sqrt_rn(self))


def _params(device, dtype=torch.float32, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in sizes]


def _grads(params, step, dtype=None):
    g = torch.Generator().manual_seed(100 + step)
    return [(0.1 * torch.randn(p.shape, generator=g)).to(p.device, dtype or p.dtype) for p in params]


def _train(opt, params, steps=3, *, main_grad=False, skip=()):
    """``steps`` steps, the gradients ``_grads`` (as ``.grad`` or ``main_grad``); ``skip``: indices
    of parameters with no gradient at all."""
    for step in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(params, step, torch.float32 if main_grad else None), strict=True)):
            if i in skip:
                p.grad = None
            elif main_grad:
                p.main_grad = g
            else:
                p.grad = g
        opt.step()


def _assert_same(a, b, what="param"):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_bitwise(x.detach(), y.detach(), f"{what} {i}")


@pytest.mark.parametrize("case", [c.name for c in all_cases(["adamw"])])
def test_contract(case, device):
    (c,) = [c for c in all_cases(["adamw"]) if c.name == case]
    if device.type not in c.devices:
        pytest.skip(f"{case} runs on {c.devices}")
    for label, report in c.fn(device).items():
        assert report.passed, (case, label, report)


@pytest.mark.parametrize("lr_tensor", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_equals_torch_adamw_capturable(device, torch_capturable_here, lr_tensor, weight_decay):
    lr = torch.tensor(3e-3, device=device) if lr_tensor else 1e-2
    ours, ref = _params(device), _params(device)
    _train(AdamW(ours, lr=lr, weight_decay=weight_decay), ours)
    opt = torch.optim.AdamW(ref, lr=lr, weight_decay=weight_decay, foreach=False, capturable=True)
    _train(opt, ref)
    _assert_same(ours, ref)


def test_states_equal_torch_and_ref_is_torch_on_cpu(monkeypatch):
    """The moments and step counts too; and ``adamw_ref`` with the CPU's own ``sqrt`` is torch's
    capturable AdamW bit for bit on the CPU (the reference is torch's composition)."""
    monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", lambda supports_xla=True: ["cuda", "cpu"])
    ref = _params("cpu")
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False, capturable=True)
    _train(opt, ref)
    mine = _params("cpu")
    states = [[torch.zeros_like(p) for p in mine] for _ in range(2)] + [[torch.zeros(()) for _ in mine]]
    with torch.no_grad():
        for step in range(3):
            adamw_ref(mine, _grads(mine, step), *states, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                      sqrt=torch.sqrt)  # fmt: skip
    _assert_same(mine, ref)
    for k, got in zip(("exp_avg", "exp_avg_sq", "step"), states, strict=True):
        _assert_same(got, [opt.state[p][k] for p in ref], k)


def test_kernel_runs_not_the_reference(device, monkeypatch):
    """The contract cases compare against ``adamw_ref``: here the op may not fall back to it (fp32,
    and fp16 parameters with fp32 masters, which the interpreter runs too)."""

    def boom(*a, **k):
        raise AssertionError("adamw_ref ran instead of the kernel")

    monkeypatch.setattr(adamw_ops, "adamw_ref", boom)
    for dtype, master in ((torch.float32, False), (torch.float16, True)):
        ps = _params(device, dtype)
        _train(AdamW(ps, master_weights=master), ps, steps=1)


def test_one_tensor_is_the_same_alone_and_in_a_group(device):
    """Batch invariance (docs/design.md §1): a tensor's update never depends on the others."""
    group = _params(device)
    alone = [group[3].detach().clone().requires_grad_()]
    opts = AdamW(group), AdamW(alone)
    for step in range(3):
        grads = _grads(group, step)
        for p, g in zip(group, grads, strict=True):
            p.grad = g
        alone[0].grad = grads[3].clone()
        for opt in opts:
            opt.step()
    assert_bitwise(group[3].detach(), alone[0].detach(), "a tensor in a group vs alone")


def test_lr_of_one_element_is_a_scalar(device):
    """A one-element lr of shape (1,) steps as the 0-dim one (torch squeezes it: ``_to_scalar``)."""
    a, b = _params(device), _params(device)
    _train(AdamW(a, lr=torch.tensor([3e-3], device=device), weight_decay=0.1), a, steps=2)
    _train(AdamW(b, lr=torch.tensor(3e-3, device=device), weight_decay=0.1), b, steps=2)
    _assert_same(a, b)


def test_main_grad_is_the_gradient(device, torch_capturable_here):
    """An fp32 ``main_grad`` is the gradient, also over a ``.grad`` that is there."""
    ours, ref = _params(device), _params(device)
    for p in ours:
        p.grad = torch.full_like(p, 7.0)  # ignored: main_grad wins
    _train(AdamW(ours, weight_decay=0.1), ours, main_grad=True)
    _train(torch.optim.AdamW(ref, weight_decay=0.1, foreach=False, capturable=True), ref)
    _assert_same(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("main_grad", [False, True])
def test_master_weights(device, torch_capturable_here, dtype, main_grad):
    """Masters: torch's AdamW on an fp32 copy, the parameter its rounding; the master stays fp32.
    (bf16 on the CPU runs ``adamw_ref``: the interpreter truncates bf16 casts.)"""
    ours = _params(device, dtype)
    opt = AdamW(ours, weight_decay=0.1, master_weights=True)
    _train(opt, ours, main_grad=main_grad)
    masters = [p.detach().float().requires_grad_() for p in _params(device, dtype)]
    ropt = torch.optim.AdamW(masters, weight_decay=0.1, foreach=False, capturable=True)
    for step in range(3):
        for m, g in zip(masters, _grads(masters, step, torch.float32 if main_grad else dtype), strict=True):
            m.grad = g.float()
        ropt.step()
    _assert_same([opt.state[p]["master"] for p in ours], masters, "master")
    _assert_same(ours, [m.detach().to(dtype) for m in masters])
    assert all(opt.state[p][k].dtype == torch.float32 for p in ours for k in ("master", "exp_avg", "exp_avg_sq"))


def test_parameter_without_gradient_is_skipped(device, torch_capturable_here):
    ours, ref = _params(device), _params(device)
    opt = AdamW(ours)
    _train(opt, ours, skip={1, 4})
    _train(torch.optim.AdamW(ref, foreach=False, capturable=True), ref, skip={1, 4})
    _assert_same(ours, ref)
    assert ours[1] not in opt.state and torch.equal(ours[1], _params(device)[1])
    _train(opt, ours, steps=2)  # later steps with every gradient: the skipped ones start at step 1
    assert opt.state[ours[1]]["step"].item() == 2 and opt.state[ours[0]]["step"].item() == 5


@pytest.mark.parametrize("master", [False, True])
def test_state_dict_round_trip(device, master):
    dtype = torch.float16 if master else torch.float32
    a, b = _params(device, dtype), _params(device, dtype)
    kw = dict(lr=torch.tensor(3e-3, device=device), weight_decay=0.1, master_weights=master)
    opt_a, opt_b = AdamW(a, **kw), AdamW(b, **kw)
    _train(opt_a, a, steps=2)
    _train(opt_b, b, steps=2)
    saved = copy.deepcopy(opt_b.state_dict())
    fresh = AdamW(b, **kw)
    fresh.load_state_dict(saved)
    if master:
        assert all(fresh.state[p]["master"].dtype == torch.float32 for p in b)
    for opt, ps in ((opt_a, a), (fresh, b)):
        for step in range(2, 4):
            for p, g in zip(ps, _grads(ps, step), strict=True):
                p.grad = g
            opt.step()
    _assert_same(b, a)
    _assert_same([fresh.state[p]["exp_avg_sq"] for p in b], [opt_a.state[p]["exp_avg_sq"] for p in a], "exp_avg_sq")


def test_zero_grad(device):
    ps = _params(device)
    opt = AdamW(ps)
    _train(opt, ps, steps=1, main_grad=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    where = [p.main_grad.data_ptr() for p in ps]
    opt.zero_grad()
    assert all(p.grad is None for p in ps)
    assert all(not p.main_grad.any() for p in ps) and [p.main_grad.data_ptr() for p in ps] == where


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amsgrad": True}, "amsgrad=True"),
        ({"maximize": True}, "maximize=True"),
        ({"differentiable": True}, "differentiable=True"),
        ({"capturable": False}, "capturable=False"),
        ({"betas": (torch.tensor(0.9), torch.tensor(0.99))}, "betas must be two floats"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]=1.0"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, "lr as a tensor"),
        ({"eps": -1.0}, "eps=-1.0"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
    ],
)
def test_constructor_refuses_by_name(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AdamW(_params("cpu"), **kwargs)


def _bad_grad(case, p):
    if case == "sparse":
        return torch.zeros_like(p).to_sparse()
    if case == "dtype":
        return torch.zeros_like(p, dtype=torch.float64)
    return torch.zeros(p.numel() + 1)


@pytest.mark.parametrize(("case", "match"), [("sparse", r"grads\[2\] is sparse"), ("dtype", r"grads\[2\] is torch.float64"),
                                             ("shape", r"grads\[2\] is torch.float32 \(1001,\)")])  # fmt: skip
def test_step_refuses_bad_gradients_before_any_launch(device, case, match):
    ps = _params(device, sizes=((5,), (6,), (1000,)))
    before = [p.detach().clone() for p in ps]
    for p, g in zip(ps, _grads(ps, 0), strict=True):
        p.grad = g
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        adamw_(ps, [p.grad for p in ps[:2]] + [_bad_grad(case, ps[2])], *_states(ps), lr=1e-3, betas=(0.9, 0.999),
               eps=1e-8, weight_decay=0.0)  # fmt: skip
    _assert_same(ps, before)  # nothing ran: the first two are untouched


def _states(ps):
    return [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], [torch.zeros((), device=p.device) for p in ps]


def test_step_refuses_complex_params_and_bad_main_grad(device):
    z = torch.zeros(3, dtype=torch.complex64, device=device, requires_grad=True)
    z.grad = torch.zeros_like(z)
    with pytest.raises(TypeError, match=r"params\[0\] is torch.complex64"):
        AdamW([z]).step()
    p = _params(device, sizes=((4,),))[0]
    p.main_grad = torch.zeros(4, dtype=torch.float16, device=device)
    with pytest.raises(TypeError, match="main_grad must be an fp32 tensor"):
        AdamW([p]).step()
    p.main_grad = torch.zeros(5, device=device)
    with pytest.raises(ValueError, match=r"main_grad \(5,\)"):
        AdamW([p]).step()
    with pytest.raises(ValueError, match="exp_avgs has 0 tensors for 1 params"):
        adamw_([p], [p], [], [p], [p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


# ---------------------------------------------------------------------------------------------
# CUDA: bf16 / fp16 against torch's own AdamW, and a captured step


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lr_tensor", [False, True])
def test_low_precision_equals_torch_on_cuda(dtype, lr_tensor):
    lr = torch.tensor(3e-3, device="cuda") if lr_tensor else 1e-2
    sizes = (*SIZES, (2048, 2048 + 3), (3 * 16384 + 5,))  # several 16384-element CUDA chunks, a tail
    ours, ref = _params("cuda", dtype, sizes), _params("cuda", dtype, sizes)
    opt = AdamW(ours, lr=lr, weight_decay=0.1)
    _train(opt, ours, steps=4)
    topt = torch.optim.AdamW(ref, lr=lr, weight_decay=0.1, foreach=False, capturable=True)
    _train(topt, ref, steps=4)
    _assert_same(ours, ref)
    for k in ("exp_avg", "exp_avg_sq"):
        _assert_same([opt.state[p][k] for p in ours], [topt.state[p][k] for p in ref], k)


@requires_cuda
def test_captured_step_replays_the_eager_bits():
    """``zero_grad`` + backward + ``step`` captured in one CUDA graph (the gradients reallocated in
    the graph's pool: the launch's address table is rebuilt during the capture) equal eager steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 33)).cuda().bfloat16()
    twin = copy.deepcopy(model)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    lr = torch.tensor(1e-3, device="cuda")
    opt, topt = AdamW(model.parameters(), lr=lr), AdamW(twin.parameters(), lr=lr)

    def step(m, o):
        o.zero_grad(set_to_none=True)
        m(x).float().square().mean().backward()
        o.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(model, opt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(model, opt)
    for _ in range(3):
        graph.replay()
    for _ in range(2 + 3):  # the capture records without running: 2 eager steps and 3 replays
        step(twin, topt)
    torch.cuda.synchronize()
    _assert_same(list(model.parameters()), list(twin.parameters()))
    assert opt.state[next(iter(model.parameters()))]["step"].item() == 5
