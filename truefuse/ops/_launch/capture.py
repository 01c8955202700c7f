"""Whether the host may wait on a tensor's values now: not while a graph is traced
(``torch.compile``, ``torch.export``) nor while a CUDA graph is captured. A capture records kernels,
not host work: a read of device data (``.item()``, ``.tolist()``, an event's ``synchronize``) during
capture invalidates it ("operation failed due to a previous error during capture"), and a value read
at capture time would be baked into every replay. Checks that need a value then stay on the device
(``torch._assert_async``); what cannot stay there is refused by :func:`refuse_under_capture`."""

from __future__ import annotations

import torch


def capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on ``t``'s device's current stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def host_may_wait(t: torch.Tensor) -> bool:
    """The host may read ``t``'s values (one sync on CUDA) without breaking a trace or a capture."""
    return not (torch.compiler.is_compiling() or capturing(t))


def refuse_under_capture(t: torch.Tensor, what: str) -> None:
    """Raise before the host reads ``t`` during a CUDA-graph capture: ``what`` names the input and
    the way that needs it on the host (the capture would fail, or replay sizes read once)."""
    if capturing(t):
        raise RuntimeError(
            f"{what} needs its values on the host, which a CUDA-graph capture cannot give "
            "(they would be read once and replayed for every step); see docs/cuda_graphs.md"
        )
