"""Every Triton kernel the ops launch on the CPU also compiles for a GPU (sm_90), with the arguments
it was launched with: the interpreter runs a kernel's Python and never its compiler, which refuses
more (a constexpr branch returning another type than its sibling passed the interpreter and failed
the sm_90 compile of the loss kernels, 2026-12-07).

The ops run here under the interpreter in fp32 (one representative call each, forward and
backward); each distinct launch (kernel, argument types, constexprs, num_warps) is then compiled in a
process of its own (the suite's ``TRITON_INTERPRET=1`` makes kernels interpreted functions), with
``INTERPRETED`` flags set as a GPU launch sets them. fp32 pointers as launched: the dtype-specific
code paths are the GPU suite's."""

import importlib
import json

import pytest
import torch

import truefuse

pytest.importorskip("triton")

from _sm90 import compile_sm90  # noqa: E402

from truefuse.config import get_config  # noqa: E402

if not get_config().triton_interpret:  # a GPU machine: its suite compiles and runs every kernel itself
    pytest.skip("the CPU interpreter is off: nothing launches on the CPU to record", allow_module_level=True)


def _calls():
    g = torch.Generator().manual_seed(0)

    def r(*s, grad=True):
        return torch.randn(*s, generator=g).requires_grad_(grad)

    def back(out):
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs if o.requires_grad])

    x, w, b = r(6, 64), r(64), r(64)
    q, k = r(2, 4, 8, 16), r(2, 2, 8, 16)
    cos, sin = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    W, t = r(40, 64), torch.randint(0, 40, (6,), generator=g)
    return {
        "rms_norm": lambda: back(truefuse.rms_norm(x, w)),
        "layer_norm": lambda: back(truefuse.layer_norm(x, w, b)),
        "rms_norm_hf": lambda: [back(truefuse.rms_norm_hf(x, w, style=s)) for s in ("llama", "gemma")],
        "add_rms_norm_hf": lambda: back(truefuse.add_rms_norm_hf(r(6, 64), x, w)),
        "add_rms_norm": lambda: back(truefuse.add_rms_norm(r(6, 64), x, w)),
        "gated_activation": lambda: [
            back(truefuse.gated_activation(r(6, 64), "swiglu")),
            back(truefuse.gated_activation(x, "geglu", r(6, 64))),
        ],
        "rope": lambda: back(truefuse.apply_rotary_pos_emb(q, k, cos, sin)),
        "attention": lambda: [
            back(truefuse.attention(q, k, k.detach().clone().requires_grad_(), is_causal=True, enable_gqa=True)),
            back(truefuse.attention(q, k, k, mask, enable_gqa=True, softcap=20.0, window=4)),
        ],
        "linear_cross_entropy": lambda: [
            back(truefuse.linear_cross_entropy(x, W, t, label_smoothing=0.1, z_loss=1e-4, softcap=3.0)),
            back(truefuse.linear_cross_entropy(x, W, t, reduction="none")),
        ],
        "linear_log_probs": lambda: back(tuple(truefuse.linear_log_probs(x, W, t, softcap=3.0))),
        "token_log_probs": lambda: back(tuple(truefuse.token_log_probs(r(6, 40), t))),
        "gemm": lambda: _on_triton(lambda: truefuse.gemm(x.detach(), W.detach().t(), bias=b.detach()[:40], activation="gelu")),
        "gemm batch-invariant": lambda: _on_triton(lambda: truefuse.gemm(x.detach(), W.detach().t(), batch_invariant=True)),
        "GroupedMLP": lambda: back(truefuse.GroupedMLP(2, 64, 32)(x, [2, 4])),
        "adamw": lambda: [_adamw_step(r(300), torch.float32, False), _adamw_step(r(300), torch.float16, True)],
    }


def _adamw_step(p, dtype, master):
    """One ``truefuse.optim.AdamW`` step (fp16 parameters only with fp32 masters: what the interpreter runs)."""
    from truefuse.optim import AdamW

    p = p.detach().to(dtype).requires_grad_()
    p.grad = torch.ones_like(p)
    AdamW([p], master_weights=master).step()


def _on_triton(call):
    """``call`` with the Triton GEMM backend first (on the CPU the planner prefers torch's)."""
    with truefuse.override_capabilities(backends=["triton", "torch"]):
        return call()


_TORCH_TO_TRITON = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def _spec(fn, args, kwargs) -> dict | None:
    """A recorded launch as what ``triton.compile`` takes: the signature and the constexprs, or None
    for an argument this test cannot type (a host TMA descriptor)."""
    import inspect

    import triton.language as tl

    parameters = inspect.signature(fn.fn).parameters
    params = list(parameters)
    constexprs = {n for n, p in parameters.items() if "constexpr" in str(p.annotation)}
    defaults = {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}
    values = dict(zip(params, args, strict=False))
    options = {}
    for key, v in kwargs.items():
        if key in params:
            values[key] = v
        elif key in ("num_warps", "num_stages"):
            options[key] = v
    sig, const = {}, {}
    for name in params:
        v = values.get(name, defaults.get(name))
        if name == "INTERPRETED":
            v = False
        if name in constexprs or v is None:
            sig[name], const[name] = "constexpr", (v if not isinstance(v, tl.dtype) else str(v))
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TORCH_TO_TRITON[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            return None
    return {"module": fn.fn.__module__, "name": fn.fn.__name__, "sig": sig, "const": const, "options": options}


@pytest.fixture(scope="module")
def launches() -> dict:
    """``{op: [distinct launch specs]}`` recorded from the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict = {}
    real = InterpretedFunction.run
    current = [""]

    def recording(self, *args, grid, warmup, **kwargs):
        spec = _spec(self, args, kwargs)
        if spec is not None:
            seen.setdefault(current[0], {})[json.dumps(spec, sort_keys=True, default=str)] = spec
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        for op, call in _calls().items():
            current[0] = op
            call()
    finally:
        InterpretedFunction.run = real
    return {op: list(specs.values()) for op, specs in seen.items()}


def test_every_op_launched_a_kernel(launches):
    """The calls above reach the kernels (else the compile test below checks nothing): each op
    launched at least one."""
    missing = sorted(set(_calls()) - set(launches))
    assert not missing, f"no Triton launch recorded for {missing} (the interpreter off, or a path changed)"


def test_every_launch_compiles_for_sm90(launches):
    specs = [s for op in sorted(launches) for s in launches[op]]
    errors = [o["error"] for o in compile_sm90(specs) if "error" in o]
    assert not errors, f"{len(errors)} of {len(specs)} launches do not compile for sm_90:\n" + "\n".join(errors[:5])


def test_the_recorded_kernels_are_importable(launches):
    for op, specs in launches.items():
        for s in specs:
            assert hasattr(importlib.import_module(s["module"]), s["name"]), (op, s["module"], s["name"])
