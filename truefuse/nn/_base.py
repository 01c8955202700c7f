"""What every linear-family module shares: the docs/design.md §2 state, ``backward_dw`` (with the size of
its queue, ``pending_wgrad``) and ``register_wgrad_hook``, input checks, and torch.nn.Linear's
initialisation."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from truefuse.autograd._autocast import autocast_dtype, cast_dtype
from truefuse.autograd._wgrad import (
    DEFAULT_MAX_PENDING_WGRAD,
    WgradState,
    check_main_grad,
    check_max_pending,
    on_accumulated,
    run_pending,
)
from truefuse.nn._data_parallel import reducing_wrapper, refusal
from truefuse.ops._launch.dtensor import refuse_dtensor


def init_linear_(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """torch.nn.Linear's initialisation: kaiming-uniform(a=√5) weight, uniform(±1/√fan_in) bias."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[-1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        torch.nn.init.uniform_(bias, -bound, bound)


class DelayedWgrad(torch.nn.Module):
    """``backward_dw()`` and its queue's size, over the module's ``self._wgrad`` (a WgradState).

    Shared by every module with ``delay_wgrad_compute``; the queue and its warning live in
    ``truefuse/autograd/_wgrad.py``.
    """

    _wgrad: WgradState

    def _refuse_reducing_wrapper(self, weights: list[torch.Tensor]) -> None:
        """Fused or delayed weight gradients (§2) go where FSDP2 / DDP never reduce: refused, in the
        forward, when one of them reduces ``weights`` (nn/_data_parallel.py)."""
        if self._wgrad.plain or not torch.is_grad_enabled():
            return
        weights = [p for p in weights if isinstance(p, torch.Tensor) and p.requires_grad]
        wrapper = reducing_wrapper(self, weights) if weights else None
        if wrapper is not None:
            raise RuntimeError(refusal(self._wgrad.owner, wrapper, self._wgrad.fuse_wgrad_accumulation))

    def backward_dw(self) -> None:
        """Compute the weight gradients the last backward(s) deferred (``delay_wgrad_compute``).

        Adds each into ``param.grad``, or into ``param.main_grad`` under ``fuse_wgrad_accumulation``,
        then calls the ``register_wgrad_hook`` functions once per weight. Nothing pending: no-op.
        Afterwards :attr:`pending_wgrad` is 0.
        """
        with torch.no_grad():
            run_pending(self._wgrad)

    @property
    def pending_wgrad(self) -> int:
        """Backward passes whose weight gradients wait for :meth:`backward_dw` (0 when not delayed).

        Each holds the tensors its weight-gradient GEMMs read; ``backward_dw()`` runs them all
        and adds them up. Past :attr:`max_pending_wgrad` the module warns once.
        """
        return self._wgrad.pending_steps

    @property
    def max_pending_wgrad(self) -> int | None:
        """Warn (``UserWarning``, once until the next :meth:`backward_dw`) when :attr:`pending_wgrad`
        grows past this (default 16; a forgotten ``backward_dw()`` otherwise holds every step's
        tensors silently). Set it to the schedule's largest number of pending micro-batches, or None
        for no warning."""
        return self._wgrad.max_pending

    @max_pending_wgrad.setter
    def max_pending_wgrad(self, value: int | None) -> None:
        self._wgrad.max_pending = check_max_pending(value)

    def _wgrad_params(self) -> list[torch.Tensor]:
        """The weights whose gradient completion :meth:`register_wgrad_hook` reports."""
        raise NotImplementedError

    def register_wgrad_hook(self, fn: Callable[[torch.nn.Parameter], None]) -> RemovableHandle:
        """Call ``fn(param)`` once per GEMM weight when its gradient is complete.

        Complete means: in ``param.grad`` (plain, from the parameter's post-accumulate-grad hook),
        in ``param.main_grad`` (fused, right after the GEMM), or at the end of :meth:`backward_dw`
        (delayed). Returns a handle whose ``remove()`` unregisters ``fn``.
        """
        if not callable(fn):
            raise TypeError(f"register_wgrad_hook takes a callable, got {type(fn).__name__}")
        for p in self._wgrad_params():
            self._watch_wgrad(p)
        handle = RemovableHandle(self._wgrad.hooks)
        self._wgrad.hooks[handle.id] = fn
        return handle

    def _watch_wgrad(self, p: torch.Tensor) -> None:
        """Attach the plain configuration's post-accumulate-grad hook to ``p`` (once per weight)."""
        watched = self.__dict__.setdefault("_acc_handles", {})
        if id(p) not in watched:
            watched[id(p)] = p.register_post_accumulate_grad_hook(lambda p, s=self._wgrad: on_accumulated(s, p))


class WgradModule(DelayedWgrad):
    """Mixin for modules whose GEMM weights follow docs/design.md §2 (see ``truefuse/autograd/_wgrad.py``).

    Subclasses call :meth:`_init_wgrad` and list their GEMM weights in :meth:`gemm_weights`.
    """

    def _init_wgrad(
        self,
        fuse_wgrad_accumulation: bool,
        delay_wgrad_compute: bool,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        self._wgrad = WgradState(
            bool(fuse_wgrad_accumulation),
            bool(delay_wgrad_compute),
            max_pending=check_max_pending(max_pending_wgrad),
            owner=type(self).__name__,
        )

    def gemm_weights(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of every weight whose gradient is a GEMM (the ones §2 governs)."""
        raise NotImplementedError

    def _wgrad_params(self) -> list[torch.Tensor]:
        return [p for _, p in self.gemm_weights()]

    @property
    def fuse_wgrad_accumulation(self) -> bool:
        return self._wgrad.fuse_wgrad_accumulation

    @fuse_wgrad_accumulation.setter
    def fuse_wgrad_accumulation(self, value: bool) -> None:
        self._wgrad.fuse_wgrad_accumulation = bool(value)

    @property
    def delay_wgrad_compute(self) -> bool:
        return self._wgrad.delay_wgrad_compute

    @delay_wgrad_compute.setter
    def delay_wgrad_compute(self, value: bool) -> None:
        self._wgrad.delay_wgrad_compute = bool(value)

    def _check_input(self, x: torch.Tensor, features: int, weight: torch.Tensor) -> None:
        """Clear errors before anything runs: x's type, last dimension and dtype (x and the weight in
        one dtype, or both cast to it by torch.autocast); fused or delayed weight gradients under
        FSDP2 or DDP (refused); main_grad when fused."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        # parallelize_module's ColwiseParallel takes a truefuse.Linear (an nn.Linear) and makes its
        # weight and input DTensors: refused by name here, not inside the GEMM
        refuse_dtensor(type(self).__name__, input=x, **self._parameters)
        if x.dim() == 0 or x.shape[-1] != features:
            raise ValueError(f"input has shape {tuple(x.shape)}: its last dimension must be in_features={features}")
        # under torch.autocast both are cast to its dtype first (fp64 is not), as F.linear's are
        dtype = autocast_dtype(x.device)
        if cast_dtype(x, dtype) != cast_dtype(weight, dtype):
            under = "" if dtype is None else f" (under torch.autocast to {dtype}, fp64 is not cast)"
            raise TypeError(f"input has dtype {x.dtype} but the module's parameters are {weight.dtype}{under}")
        if x.device != weight.device:
            raise ValueError(f"input is on {x.device} but the module's parameters are on {weight.device}")
        self._refuse_reducing_wrapper([p for _, p in self.gemm_weights()])
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled():
            for name, p in self.gemm_weights():
                if p.requires_grad:
                    check_main_grad(p, name)
