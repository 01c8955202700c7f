"""Linear, LayerNormLinear, LayerNormMLP: bounded against their references, delayed == immediate
bit for bit over every option, and clear errors for bad input."""

import itertools

import pytest
import torch

import truefuse
from truefuse.ops.linear import MLP_ACTIVATIONS, NORMALIZATIONS
from truefuse.testing import assert_bitwise
from truefuse.verify.cases_linear import (
    MODULES,
    attach_main_grads,
    delayed_vs_immediate_case,
    fwd_bwd_case,
    main_grad_case,
    run_module,
)

DTYPES = [torch.float32, torch.bfloat16]  # fp32 runs the Triton kernels under the CPU interpreter


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(MODULES))
def test_bounded_against_reference(name, dtype, device):
    for case in (fwd_bwd_case(name, dtype), main_grad_case(name, dtype)):
        for k, rep in case(device).items():
            assert rep.passed, f"{name} {k}: {rep}"


def _variants():
    """Every module over every normalization, zero_centered_gamma, bias and activation."""
    for bias in (True, False):
        yield f"Linear-bias{bias}", lambda dt, dev, kw, b=bias: truefuse.Linear(40, 24, bias=b, device=dev, dtype=dt, **kw)
    for norm, zc, bias in itertools.product(NORMALIZATIONS, (False, True), (True, False)):
        yield (
            f"LayerNormLinear-{norm}-zc{zc}-bias{bias}",
            lambda dt, dev, kw, n=norm, z=zc, b=bias: truefuse.LayerNormLinear(
                40, 24, bias=b, device=dev, dtype=dt, normalization=n, zero_centered_gamma=z, **kw
            ),
        )
    for i, act in enumerate(MLP_ACTIVATIONS):  # cycle norm / zc / bias across activations
        norm, zc, bias = NORMALIZATIONS[i % 2], bool(i // 2 % 2), bool(i // 4 % 2) or act == "swiglu"
        yield (
            f"LayerNormMLP-{act}-{norm}-zc{zc}-bias{bias}",
            lambda dt, dev, kw, a=act, n=norm, z=zc, b=bias: truefuse.LayerNormMLP(
                40, 36, bias=b, device=dev, dtype=dt, normalization=n, activation=a, zero_centered_gamma=z, **kw
            ),
        )


VARIANTS = dict(_variants())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_delayed_equals_immediate_bitwise(variant, dtype, device):
    factory = VARIANTS[variant]
    for fused in (True, False):
        results = []
        for delay in (False, True):
            torch.manual_seed(0)
            m = factory(dtype, device, {"fuse_wgrad_accumulation": fused, "delay_wgrad_compute": delay})
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if n.startswith("layer_norm"):
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)).to(p) * 0.3)
            if fused:
                attach_main_grads(m)
            g = torch.Generator().manual_seed(1)
            # 3 x 3 tokens: the norm backward's CPU grid still runs two-row tiles, two a program and
            # a half tile (the interpreter runs a program per row: 5 x 9 took 3-5 s a variant)
            x = torch.randn(3, 3, m.gemm_weights()[0][1].shape[1], generator=g).to(device, dtype)
            out = m(x)
            dy = torch.randn(out.shape, generator=g).to(device, dtype)
            res = run_module(m, x, dy)
            if delay:
                assert all(p.grad is None for _, p in m.gemm_weights())
            m.backward_dw()
            res.update({f"d{n}": p.grad for n, p in m.gemm_weights() if p.grad is not None})
            res.update({f"{n}.main_grad": p.main_grad for n, p in m.gemm_weights() if fused})
            results.append(res)
        assert results[0].keys() == results[1].keys()
        for k in results[0]:
            assert_bitwise(results[1][k], results[0][k], f"{variant} fused={fused} {k}")


def test_registered_bitwise_cases_pass(device):
    for name in MODULES:
        for fused in (True, False):
            for k, rep in delayed_vs_immediate_case(name, torch.bfloat16, fused)(device).items():
                assert rep.passed, f"{name} {k}"


# ---- bad input -------------------------------------------------------------------------------


def _mods(device, **kw):
    return [
        truefuse.Linear(16, 8, device=device, **kw),
        truefuse.LayerNormLinear(16, 8, device=device, **kw),
        truefuse.LayerNormMLP(16, 12, device=device, activation="swiglu", **kw),
    ]


def test_wrong_last_dimension(device):
    for m in _mods(device):
        with pytest.raises(ValueError, match="last dimension must be .*=16"):
            m(torch.randn(3, 15, device=device))


def test_dtype_mismatch(device):
    for m in _mods(device):
        with pytest.raises(TypeError, match="input has dtype torch.bfloat16 but the module's parameters are torch.float32"):
            m(torch.randn(3, 16, device=device, dtype=torch.bfloat16))


def test_fusion_without_main_grad(device):
    for m in _mods(device, fuse_wgrad_accumulation=True):
        with pytest.raises(RuntimeError, match=r"fuse_wgrad_accumulation=True but \w*weight has no main_grad"):
            m(torch.randn(3, 16, device=device))
        with torch.no_grad():  # inference needs no main_grad
            m(torch.randn(3, 16, device=device))


@pytest.mark.parametrize(
    "bad,exc,msg",
    [
        (lambda p: torch.zeros(p.shape[0] + 1, p.shape[1], device=p.device), ValueError, "main_grad has shape"),
        (lambda p: torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device), TypeError, "needs torch.float32"),
        (lambda p: torch.zeros(p.shape[1], p.shape[0], device=p.device).t(), ValueError, "must be contiguous"),
    ],
)
def test_bad_main_grad(bad, exc, msg, device):
    for m in _mods(device, fuse_wgrad_accumulation=True):
        for _, p in m.gemm_weights():
            p.main_grad = bad(p)
        with pytest.raises(exc, match=msg):
            m(torch.randn(3, 16, device=device))


def test_bad_options():
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        truefuse.LayerNormLinear(8, 8, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation='tanh'"):
        truefuse.LayerNormMLP(8, 8, activation="tanh")
    with pytest.raises(TypeError, match="register_wgrad_hook takes a callable"):
        truefuse.Linear(4, 4).register_wgrad_hook(3)


def test_gated_mlp_shapes_and_drop_in():
    m = truefuse.LayerNormMLP(16, 12, activation="swiglu", normalization="RMSNorm")
    assert m.fc1_weight.shape == (24, 16) and m.fc2_weight.shape == (16, 12) and m.layer_norm_bias is None
    lin = truefuse.Linear(16, 8)
    assert isinstance(lin, torch.nn.Linear)
    x = torch.randn(2, 3, 16)
    assert_bitwise(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), "Linear fp32 on the torch backend")
