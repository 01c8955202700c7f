"""docs/design.md §2, the weight-gradient contract, in one function: :func:`deliver_weight_grad`.

Every module's backward hands each GEMM weight's gradient computation to ``deliver_weight_grad``
and returns whatever it returns to autograd. Nothing else in truefuse touches ``main_grad``.

| configuration                         | returned to autograd | the real gradient goes to                  |
| ------------------------------------- | -------------------- | ------------------------------------------ |
| plain                                 | the gradient         | ``param.grad`` through autograd            |
| delayed                               | None                 | added to ``param.grad`` in backward_dw()   |
| fused, no ``grad_added_to_main_grad`` | None                 | ``param.main_grad`` inside the GEMM        |
| fused, attribute present              | cached zeros; attr=True | ``param.main_grad`` inside the GEMM     |
| delayed + fused, no attribute         | None                 | ``param.main_grad`` in backward_dw()       |
| delayed + fused, attribute present    | cached zeros         | ``param.main_grad`` in backward_dw(), which sets the attribute |

"Inside the GEMM" means accumulated with beta=1 (``overwrite_main_grad`` true: beta=0). Why the
zero tensor: Megatron-core's data-parallel engine hooks each parameter's gradient accumulation; with
None it finds no gradient, with the real one it would add it to ``main_grad`` a second time.

``register_wgrad_hook`` functions run once per weight when its gradient is complete: right after the
GEMM into ``main_grad`` (fused), at the end of ``backward_dw()`` (delayed), or, in the plain
configuration, from the parameter's post-accumulate-grad hook, i.e. once autograd has put it in
``param.grad``.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

#: ``compute(out, accumulate)``: the weight-gradient GEMM. With ``out=None`` it returns a new tensor
#: in the parameter's dtype; otherwise it writes ``out`` (adds into it when ``accumulate``).
WgradCompute = Callable[[torch.Tensor | None, bool], torch.Tensor]

_ZEROS: dict[tuple, torch.Tensor] = {}

#: Default bound on :attr:`WgradState.pending_steps` past which the module warns (once until the
#: next ``backward_dw()``): pipeline schedules keep a few micro-batches pending, never this many.
DEFAULT_MAX_PENDING_WGRAD = 16


def check_max_pending(value) -> int | None:
    """``max_pending_wgrad`` as given (None, or an int >= 0), or a clear error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_pending_wgrad must be None (no warning) or an int >= 0, got {value!r}")
    return value


@dataclass
class WgradState:
    """A module's weight-gradient configuration and its pending work.

    Attributes:
        fuse_wgrad_accumulation: GEMM weights' gradients go to ``param.main_grad`` (fp32).
        delay_wgrad_compute: weight-gradient GEMMs wait for ``backward_dw()``.
        pending: queued weight-gradient work, run and cleared by :func:`run_pending`.
        hooks: ``register_wgrad_hook`` functions by handle id, each called as ``fn(param)``.
        max_pending: warn (a ``UserWarning``, once until the next ``backward_dw()``) when
            :attr:`pending_steps` grows past this; None: never.
        owner: the module's name in that warning.
    """

    fuse_wgrad_accumulation: bool = False
    delay_wgrad_compute: bool = False
    pending: list[Callable[[], None]] = field(default_factory=list)
    hooks: dict[int, Callable[[torch.nn.Parameter], None]] = field(
        default_factory=OrderedDict
    )  # weak-referenceable, for RemovableHandle
    max_pending: int | None = DEFAULT_MAX_PENDING_WGRAD
    owner: str = "module"
    #: queued computations per weight (by id), i.e. backward passes not yet run by backward_dw()
    _queued: dict[int, int] = field(default_factory=dict, repr=False)
    _warned: bool = field(default=False, repr=False)

    @property
    def plain(self) -> bool:
        return not (self.fuse_wgrad_accumulation or self.delay_wgrad_compute)

    @property
    def pending_steps(self) -> int:
        """How many backward passes have queued weight gradients that ``backward_dw()`` has not run:
        the most queued computations of any one weight (a backward queues one per weight it reaches,
        so a module with several weights still counts one per backward)."""
        return max(self._queued.values(), default=0)

    def _enqueue(self, param: torch.Tensor, finish: Callable[[], None]) -> None:
        self.pending.append(finish)
        self._queued[id(param)] = self._queued.get(id(param), 0) + 1
        n = self.pending_steps
        if self.max_pending is not None and n > self.max_pending and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.owner}: {n} backward passes have queued weight gradients (delay_wgrad_compute=True) "
                f"without a backward_dw() call, more than max_pending_wgrad={self.max_pending}. Each holds its "
                "saved tensors until backward_dw() runs them all at once, adding every step's gradient. Call "
                "backward_dw() after each backward (or once per pipeline flush); if this many pending "
                "micro-batches is intended, raise the module's max_pending_wgrad (None disables this warning).",
                UserWarning,
                stacklevel=2,
            )


def check_main_grad(param: torch.Tensor, name: str) -> None:
    """Raise a clear error when ``param.main_grad`` cannot take fused fp32 accumulation."""
    mg = getattr(param, "main_grad", None)
    if mg is None:
        raise RuntimeError(
            f"fuse_wgrad_accumulation=True but {name} has no main_grad: attach an fp32 tensor of shape "
            f"{tuple(param.shape)} as {name}.main_grad (Megatron's DDP does) or construct the module "
            "with fuse_wgrad_accumulation=False"
        )
    if not isinstance(mg, torch.Tensor):
        raise TypeError(f"{name}.main_grad must be a torch.Tensor, got {type(mg).__name__}")
    if mg.shape != param.shape:
        raise ValueError(f"{name}.main_grad has shape {tuple(mg.shape)} but {name} has shape {tuple(param.shape)}")
    if mg.dtype != torch.float32:
        raise TypeError(f"{name}.main_grad has dtype {mg.dtype}; fused accumulation needs torch.float32")
    if mg.device != param.device:
        raise ValueError(f"{name}.main_grad is on {mg.device} but {name} is on {param.device}")
    if not mg.is_contiguous():
        raise ValueError(f"{name}.main_grad must be contiguous")


def _cached_zeros(param: torch.Tensor) -> torch.Tensor:
    """One zero tensor per (shape, dtype, device), never written: autograd copies it into ``.grad``
    (the cache holds a reference, so AccumulateGrad cannot steal it) or adds it in place there."""
    key = (tuple(param.shape), param.dtype, param.device)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    return z


def _gemm_writes_main_grad(param: torch.Tensor) -> bool:
    """Whether the weight-gradient GEMMs can add into ``param.main_grad`` themselves. Not for an fp64
    parameter: no GEMM takes fp64 products into an fp32 out, so its gradient is computed in fp64
    and added with one rounding (:func:`_to_main_grad`)."""
    return param.dtype != torch.float64


def main_grad_target(param: torch.Tensor, name: str) -> tuple[torch.Tensor, bool] | None:
    """Fused and not delayed, for a backward whose weight-gradient GEMMs share a pass with other
    work (the chunked head's: d_input rides with them): where they write and whether they add
    (``overwrite_main_grad`` false); call :func:`main_grad_written` after them. None where the GEMMs
    cannot write it (an fp64 parameter): the caller hands the weight's own pass to
    :func:`deliver_weight_grad` instead."""
    check_main_grad(param, name)
    if not _gemm_writes_main_grad(param):
        return None
    return param.main_grad, not getattr(param, "overwrite_main_grad", False)


def main_grad_written(param: torch.Tensor, state: WgradState) -> torch.Tensor | None:
    """After the GEMMs into :func:`main_grad_target`: the hooks fire, and what autograd gets (as
    :func:`deliver_weight_grad`'s fused row of the table)."""
    _fire(state, param)
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        return _cached_zeros(param)
    return None


def _to_main_grad(param: torch.Tensor, compute: WgradCompute) -> None:
    add = not getattr(param, "overwrite_main_grad", False)
    if not _gemm_writes_main_grad(param):
        # the gradient in the parameter's dtype, then one rounding into the fp32 main_grad (add_
        # computes in the wider dtype and rounds once on the store)
        g = compute(None, False)
        param.main_grad.add_(g) if add else param.main_grad.copy_(g)
        return
    compute(param.main_grad, add)


def _fire(state: WgradState, param: torch.Tensor) -> None:
    for fn in list(state.hooks.values()):
        fn(param)


def deliver_weight_grad(param: torch.Tensor, name: str, compute: WgradCompute, state: WgradState) -> torch.Tensor | None:
    """Run or queue ``param``'s weight-gradient GEMM per docs/design.md §2; return what autograd gets.

    Args:
        param: the GEMM weight (a Parameter, possibly tied into other modules).
        name: its name in error messages (``fc1_weight``, ``weight``...).
        compute: the weight-gradient GEMM (see :data:`WgradCompute`); it must hold every tensor it
            reads, since under delay it runs after the backward returned.
        state: the calling module's configuration and queue.
    """
    fused, delayed = state.fuse_wgrad_accumulation, state.delay_wgrad_compute
    if fused:
        check_main_grad(param, name)
    has_attr = hasattr(param, "grad_added_to_main_grad")
    if delayed:

        def finish() -> None:
            if fused:
                _to_main_grad(param, compute)
                if has_attr:
                    param.grad_added_to_main_grad = True
            else:
                g = compute(None, False)
                # added, never overwriting: autograd would have accumulated it the same way
                if param.grad is None:
                    param.grad = g
                else:
                    param.grad.add_(g)
            _fire(state, param)

        state._enqueue(param, finish)
        return _cached_zeros(param) if (fused and has_attr) else None
    if fused:
        _to_main_grad(param, compute)
        return main_grad_written(param, state)
    return compute(None, False)


def run_pending(state: WgradState) -> None:
    """``backward_dw()``: run the queued weight-gradient GEMMs in backward order, then clear the queue
    (and re-arm the too-many-pending warning)."""
    pending, state.pending = state.pending, []
    state._queued.clear()
    state._warned = False
    for finish in pending:
        finish()


def on_accumulated(state: WgradState, param: torch.Tensor) -> None:
    """The parameter's post-accumulate-grad hook: in the plain configuration the gradient is complete
    once autograd has put it in ``param.grad``, so the module's wgrad hooks fire now."""
    if state.plain:
        _fire(state, param)
