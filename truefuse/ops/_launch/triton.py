"""Where the elementwise and row Triton kernels (norms, gated activations) run."""

from __future__ import annotations

import torch

from truefuse.config import get_config


def triton_runs(x: torch.Tensor) -> bool:
    """Whether a Triton kernel takes ``x``: on CUDA for fp16/bf16/fp32, or on the CPU under
    ``TRITON_INTERPRET=1`` for fp32 only (the interpreter truncates bf16 casts, docs/design.md §8)."""
    if x.is_cuda:
        return x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return x.device.type == "cpu" and get_config().triton_interpret and x.dtype == torch.float32


#: ``raw_stream(device_index)``: the current CUDA stream's handle as an int (torch's C call where it
#: has one: no ``Stream`` object made)
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda d: torch.cuda.current_stream(d).cuda_stream)


# Cached in plain dicts, not functools.cache: launchers ask in code torch.compile traces, where
# Dynamo warns of every lru_cache wrapper it meets ("silent incorrectness") and traces through it;
# a module dict it reads as a guarded constant (truefuse/config.py's get_config likewise).
_SM_COUNT: dict[int, int] = {}
_CAPABILITY: dict[int, tuple[int, int]] = {}


def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (persistent kernels size their grids from it)."""
    n = _SM_COUNT.get(device_index)
    if n is None:
        n = _SM_COUNT[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return n


def capability(device_index: int) -> tuple[int, int]:
    """A CUDA device's compute capability (cached: the launchers ask at every call)."""
    cap = _CAPABILITY.get(device_index)
    if cap is None:
        cap = _CAPABILITY[device_index] = tuple(torch.cuda.get_device_capability(device_index))
    return cap


def hopper(x: torch.Tensor) -> bool:
    """Whether ``x``'s device has Hopper's launch and copy features (TMA tensor descriptors,
    programmatic dependent launch): CUDA, not ROCm, compute capability 9+."""
    if not x.is_cuda or torch.version.hip is not None:
        return False
    return capability(x.device.index if x.device.index is not None else torch.cuda.current_device())[0] >= 9


#: the tensor types a launcher or a lean path takes as they are: not a subclass (DTensor, a traced
#: fake or functional tensor), which goes through the dispatcher
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor that torch is tracing (fake, functional: torch.compile's AOT
    graph), not one a kernel can launch on. A launcher then hands its kernel to the graph through
    :func:`kernel_for` and leaves out what only an eager launch takes (``launch_pdl``)."""
    return type(t) not in PLAIN_TENSORS


def recorded(t: torch.Tensor) -> bool:
    """Whether ops on ``t`` are recorded (autograd differentiates them, or torch.compile / export
    traces them into a graph that may be replayed with autograd): a PyTorch path must then not
    reuse a dead intermediate's buffer in place (an ``out=`` op refuses autograd; an in-place one may
    overwrite what a backward saved)."""
    return torch.compiler.is_compiling() or (torch.is_grad_enabled() and t.requires_grad)


def kernel_for(kernel, t: torch.Tensor):
    """``kernel`` for a launch on tensors like ``t``: itself in eager mode (no wrapper on the
    launch path), ``torch.library.wrap_triton(kernel)`` where ``t`` is traced, so that a compiled
    graph holds the kernel itself and Inductor launches it from its own code (docs/design.md §6.7).
    The same kernel with the same arguments either way: the same bits.

    Where Dynamo itself traces a launch (a launcher called outside a custom op, such as
    ``rms_norm_hf``'s batch-invariant statistics), ``t`` reads as a plain tensor and the kernel
    goes to Dynamo as it is; Dynamo records only the arguments the call names (it cannot read the
    kernel's parameters to fill the rest, and neither can :class:`_Traced` there), so such a
    launch names every parameter itself (``ops/norm/norm.py::norm_fwd``)."""
    return _Traced(kernel) if traced(t) else kernel


class _Traced:
    """``wrap_triton(kernel)[grid](...)`` with every parameter the call leaves to its default passed
    explicitly: the traced launch checks for the kernel's whole signature (torch 2.11: "Incorrect
    number of arguments passed to kernel")."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = torch.library.wrap_triton(self.kernel)[grid]
        params = self.kernel.params

        def run(*args, **kwargs):
            for p in params[len(args) :]:
                if p.name not in kwargs and p.has_default:
                    kwargs[p.name] = p.default
            return launch(*args, **kwargs)

        return run
