"""A whole training step in one CUDA graph: warm up, record, replay (docs/cuda_graphs.md).

The recipe TorchTitan runs by default (``torchtitan/distributed/cudagraph.py``): a few eager steps on
a side stream (Triton compiles and caches its kernels, cuBLAS makes its workspace, the optimizer its
state), then one capture of the step, then a replay per step with the new batch copied into the
captured inputs. A replay runs the kernels the capture recorded, at the addresses it recorded: so
the step may not read device data on the host, size an allocation from data, or choose a kernel
from values (truefuse's ops do none of these under capture: ``ops/_launch/capture.py``); gradients live in
the graph's pool, at stable addresses; the optimizer is built with ``capturable=True``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch


class GraphedStep:
    """``step(*inputs)`` run eagerly ``warmup`` times, captured on the next call, replayed after.

    Every call is a real step: the warm-up calls run ``step`` on a side stream; the capturing call
    records it and replays the recording once (a capture runs nothing). Later calls copy their
    tensor inputs into the captured ones and replay. Tensor inputs must keep their shape, dtype and
    device; other inputs must equal the captured call's. The outputs are the captured step's tensors,
    overwritten by the next call: ``.clone()`` what you keep.

    Args:
        step: the training step; it returns a tensor, a tuple of tensors or None. Inside it: forward,
            backward, clipping, ``optimizer.step()`` and ``zero_grad`` as eager; no host reads.
        warmup: eager steps before the capture (≥ 1: the first call compiles kernels and builds
            optimizer state, which a capture cannot do). TorchTitan warms up for 1-3 steps.
        pool: a memory pool to share with other graphs (``torch.cuda.graph_pool_handle()``).
        packed_sequences: False where the step's transformers models never get position_ids that
            pack several sequences (see :func:`graph_step`): the capture then keeps the causal
            skip that eager attention takes; a warm-up that saw packing refuses the capture.

    A step that reads the host makes the capture fail: the ``RuntimeError`` names the step's own
    error. No eager check can find such reads beforehand: libraries branch on whether a capture
    runs (transformers' masks read a value on the host in eager mode and not while capturing; so
    does truefuse's label check), so a step that syncs eagerly may capture cleanly (a sync-debug
    check of the last warm-up step refused stock and patched Llama steps that capture, H100).
    """

    def __init__(self, step: Callable[..., Any], *, warmup: int = 3, pool=None, packed_sequences: bool = True):
        if not callable(step):
            raise TypeError(f"step must be callable, got {type(step).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1 (the first steps compile and build state), got {warmup!r}")
        self.step, self.warmup, self.pool = step, warmup, pool
        self.packed_sequences = bool(packed_sequences)
        self._packing: list[bool] = []  # the warm-up's packed-sequence answers (packed_sequences=False)
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs: tuple = ()
        self._outputs: Any = None
        self._side = None

    def __call__(self, *inputs):
        _check_cuda(inputs)
        self.calls += 1
        if self.calls <= self.warmup:
            return self._eager(inputs)
        if self.graph is None:
            self._capture(inputs)
        else:
            self._load(inputs)
        self.graph.replay()
        return self._outputs

    def _eager(self, inputs):
        """On a side stream, as torch's capture recipe asks (the warm-up's allocations and lazy
        initialisation then sit outside the default stream's history)."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side), _packing_recorded(self.packed_sequences, self._packing):
            out = self.step(*inputs)
        torch.cuda.current_stream().wait_stream(self._side)
        return out

    def _capture(self, inputs) -> None:
        if not self.packed_sequences and any(self._packing):
            raise ValueError(
                "graph_step(packed_sequences=False): a warm-up step's position_ids packed several sequences "
                "(transformers found packing); capture it with packed_sequences=True (the default)"
            )
        self._inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        graph = torch.cuda.CUDAGraph()
        first: list[BaseException] = []
        try:
            with _as_eager(self.packed_sequences), torch.cuda.graph(graph, pool=self.pool):
                try:
                    self._outputs = self.step(*self._inputs)
                except BaseException as e:  # keep the step's own error: the capture's end raises another
                    first.append(e)
                    raise
        except BaseException as e:
            cause = first[0] if first else e
            raise RuntimeError(
                f"capturing the step in a CUDA graph failed: {type(cause).__name__}: {cause} "
                "(a host read, a CPU-to-GPU copy from pageable memory or a data-sized allocation in the step; "
                "docs/cuda_graphs.md lists what a captured step may not do; after a failed capture, torch 2.11 "
                "leaves this process's CUDA random generator unusable: restart it)"
            ) from cause
        self.graph = graph

    def _load(self, inputs) -> None:
        if len(inputs) != len(self._inputs):
            raise ValueError(f"the step was captured with {len(self._inputs)} inputs, got {len(inputs)}")
        for i, (new, old) in enumerate(zip(inputs, self._inputs, strict=True)):
            if isinstance(old, torch.Tensor):
                if not isinstance(new, torch.Tensor) or (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
                    got = (tuple(new.shape), new.dtype, new.device) if isinstance(new, torch.Tensor) else type(new).__name__
                    raise ValueError(
                        f"input {i}: captured as {(tuple(old.shape), old.dtype, old.device)}, got {got} "
                        "(a graph replays fixed shapes: capture one GraphedStep per shape)"
                    )
                old.copy_(new)
            elif new != old:
                raise ValueError(f"input {i}: captured as {old!r}, got {new!r} (a replay cannot change a Python value)")


def _as_eager(packed_sequences: bool = True):
    """What the capture runs under so that libraries decide as in the eager step: transformers'
    SDPA mask (some versions build the full causal mask while a stream captures, which cost attention
    2.6-5.8x in a graphed demo step on an H100: ``huggingface/attention_mask.py``), and with
    ``packed_sequences=False`` its packed-sequence check (which every version answers "packed" while
    capturing, building the full mask too)."""
    if "transformers.masking_utils" not in sys.modules:
        return contextlib.nullcontext()
    from truefuse.integrations.huggingface.attention_mask import eager_mask_decisions, unpacked_positions

    stack = contextlib.ExitStack()
    stack.enter_context(eager_mask_decisions())
    if not packed_sequences:
        stack.enter_context(unpacked_positions())
    return stack


def _packing_recorded(packed_sequences: bool, record: list):
    """A warm-up step's context: with ``packed_sequences=False``, transformers' packed-sequence answers
    recorded (a packed one refuses the capture)."""
    if packed_sequences or "transformers.masking_utils" not in sys.modules:
        return contextlib.nullcontext()
    from truefuse.integrations.huggingface.attention_mask import packing_seen

    return packing_seen(record)


def _check_cuda(inputs) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("GraphedStep needs CUDA: CUDA graphs record GPU kernels")
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and not x.is_cuda:
            raise ValueError(f"input {i} is on {x.device}: the inputs a captured step reads must be CUDA tensors")


def graph_step(step: Callable[..., Any], *, warmup: int = 3, pool=None, packed_sequences: bool = True) -> GraphedStep:
    """``step`` as a :class:`GraphedStep`: eager for ``warmup`` calls, then captured and replayed.

    ``packed_sequences=False``: the step's transformers models never get position_ids that pack
    several sequences in a row (the models' own positions, no packing collator). Their packed-sequence
    check is then answered as eagerly while capturing, so a plainly causal batch keeps attention's
    causal skip (transformers otherwise builds the full mask under capture: attention 2-6x longer,
    docs/cuda_graphs.md); a warm-up step that did see packed positions refuses the capture."""
    return GraphedStep(step, warmup=warmup, pool=pool, packed_sequences=packed_sequences)
