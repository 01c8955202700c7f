"""``truefuse info``: versions, devices, the configuration and tuning knobs, the GEMM capability
tables and the plans of the main cases."""

from __future__ import annotations

import dataclasses

import torch

from truefuse.config import Tuning, get_config, get_tuning, knob_docs
from truefuse.ops.gemm.gemm import gemm_plan_for
from truefuse.ops.gemm.gemm_backends import backend_names
from truefuse.ops.gemm.gemm_plan import FEATURES, backend_available, capability_table


def _versions() -> dict[str, str]:
    v = {"torch": torch.__version__, "cuda (torch build)": str(torch.version.cuda)}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:  # triton is optional off Linux
        v["triton"] = "not installed"
    import truefuse

    v["truefuse"] = truefuse.__version__
    return v


def _devices() -> list[str]:
    devs = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devs.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)")
    return devs


def main_cases(device: str) -> dict[str, object]:
    """The plans truefuse picks for the main cases on ``device`` (tiny meta-free tensors)."""
    dev = torch.device(device)
    bf = dict(dtype=torch.bfloat16, device=dev)
    x, w, dy = torch.empty(16, 8, **bf), torch.empty(4, 8, **bf), torch.empty(16, 4, **bf)
    mg = torch.empty(4, 8, dtype=torch.float32, device=dev)
    bias = torch.empty(4, **bf)
    cases = {
        "forward, bf16, bias + gelu": lambda: gemm_plan_for(x, w.t(), bias=bias, activation="gelu"),
        "wgrad, bf16 -> fp32 main_grad (beta=1)": lambda: gemm_plan_for(dy.t(), x, out=mg, accumulate=True),
        "wgrad, bf16 -> fp32 main_grad + bias-grad": lambda: gemm_plan_for(dy.t(), x, out=mg, accumulate=True, grad_bias=True),
        "wgrad after dgelu + bias-grad": lambda: gemm_plan_for(
            dy.t(), x, out=mg, accumulate=True, grad_bias=True, grad_activation="gelu", pre_activation=dy.t()
        ),
        "grouped forward, bf16, 2 groups": lambda: gemm_plan_for(x, torch.empty(2, 8, 4, **bf), m_splits=[10, 6]),
    }
    plans: dict[str, object] = {}
    for case, fn in cases.items():
        try:
            plans[case] = fn()
        except RuntimeError as e:  # no enabled backend runs it here (e.g. TRUEFUSE_GEMM_BACKENDS=triton on a CPU)
            plans[case] = f"no plan: {e}"
    return plans


def _size(n: int) -> str | None:
    """``n`` bytes as a whole number of GiB / MiB / KiB, or None."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return None


def _human(name: str, value: object) -> str:
    """A knob's value as printed: byte sizes also in KiB / MiB / GiB, other powers of two as 2^k;
    ``two_stage_bytes`` as ``world size: size`` pairs."""
    if isinstance(value, tuple):
        return ", ".join(f"{w}: {_size(b) or b}" for w, b in value)
    if "_bytes" in name and _size(value):
        return f"{value} ({_size(value)})"
    if value > 1024 and value & (value - 1) == 0:
        return f"{value} (2^{value.bit_length() - 1})"
    return str(value)


def tuning_rows() -> list[tuple[str, str, str, str]]:
    """``(knob, current value, default or "" when the same, what it bounds)`` for every tuning
    knob (a value differs from its default inside a ``truefuse.config.tuning`` block)."""
    now, default, docs = get_tuning(), Tuning(), knob_docs()
    rows = []
    for f in dataclasses.fields(Tuning):
        value, base = getattr(now, f.name), getattr(default, f.name)
        rows.append((f.name, _human(f.name, value), "" if value == base else _human(f.name, base), docs[f.name]))
    return rows


def print_info() -> None:
    """Print versions, devices, the configuration, the tuning knobs, the capability tables and the main plans.

    Raises:
        ValueError: (``truefuse.config.ConfigError``) before printing anything, when the environment
            holds a value truefuse cannot use, e.g. ``TRUEFUSE_GEMM_BACKENDS=cublas9000``; the message
            names the variable, the value and what is accepted (the CLI prints it and exits 2).
    """
    cfg = get_config()  # first: a bad environment is one clear error, not a half-printed report
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 150)
    for k, v in _versions().items():
        console.print(f"{k}: {v}")
    console.print("devices: " + "; ".join(_devices()))
    console.print(f"config: {cfg}")
    t = Table(title="tuning knobs (truefuse.config.Tuning; override for a scope with truefuse.config.tuning)")
    t.add_column("knob", no_wrap=True)
    t.add_column("value", max_width=24)
    t.add_column("default (if overridden)", max_width=24)
    t.add_column("bounds")
    for row in tuning_rows():
        t.add_row(*(escape(c) for c in row))
    console.print(t)
    device_types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for backend in backend_names():
        for dev in device_types:
            rows = [r for r in capability_table(backend) if r[3] == dev]
            avail = backend_available(backend, dev)
            t = Table(title=f"GEMM backend {backend!r} on {dev}" + ("" if avail else " (not available here)"))
            t.add_column("in -> out")
            for f in FEATURES:
                t.add_column(f)
            pairs = sorted({(r[1], r[2]) for r in rows}, key=str)
            for i, o in pairs:
                t.add_row(
                    f"{str(i).removeprefix('torch.')} -> {str(o).removeprefix('torch.')}",
                    *["fused" if (f, i, o, dev) in rows else "split" for f in FEATURES],
                )
            console.print(t)

    for dev in device_types:
        t = Table(title=f"plans on {dev}")
        t.add_column("case")
        t.add_column("plan")
        for case, p in main_cases(dev).items():
            t.add_row(case, escape(str(p)))
        console.print(t)
