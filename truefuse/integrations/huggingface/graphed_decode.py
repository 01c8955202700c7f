"""``generate``'s decode steps replayed as CUDA graphs, in fast and batch-invariant mode
(docs/cuda_graphs.md, "Graphed generate").

A decode step is a few hundred small kernels: with ``generate``'s Python launching each, the host
sets the speed (issue 47: truefuse's eager ``generate`` at 0.57-0.86× stock's tokens/s on an H100).
transformers' own answer, a static cache with ``torch.compile(mode="reduce-overhead")``, failed on
a patched model inside Inductor's static-cache kernel (H100, torch 2.11, transformers 5.17). This
captures the eager forward itself: the first decode step of a shape runs eagerly, the next is
captured with :class:`truefuse.integrations.cuda_graph.GraphedStep` and replayed after, with the
step's tensors copied into the captured ones. The same kernels with the same arguments: a replay's
logits are the eager step's bits (truefuse's kernels choose from shapes and dtypes, never values).

What a graph may bake in is keyed: the step's tensors' shapes and dtypes, every other argument's
value, the static cache's layout, the mode record (``Modes.now()``) and autocast's dtype. A static
cache is written in place at the addresses the graph recorded: a new cache of the same layout
(transformers 5.25 builds one a ``generate``) is adopted, its prefilled contents copied into the
graph's tensors (:meth:`_Graph.adopt`), instead of capturing again. Anything else (a prefill, a
dynamic cache, autograd on, a CPU tensor, a cache whose layers change other host state) runs the
forward eagerly, and so does a sliding-window layer's step once its window is full. While a window is not
full, the one host value its step changes, the layer's Python count of its tokens, is advanced after
each replay as the eager step advances it.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict

import torch
from torch.utils import _pytree as pytree

from truefuse.autograd._modes import Modes
from truefuse.integrations import cuda_graph
from truefuse.integrations.huggingface.batch_invariant import unwrap
from truefuse.integrations.huggingface.head import is_fsdp_unit

__all__ = ["GraphedDecode", "graph_decode"]

#: the cache's keyword across transformers versions (5.25 renamed ``past_key_values`` to ``cache``)
_CACHE_KEYS = ("past_key_values", "cache", "cache_params")


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


class GraphedDecode:
    """The handle :func:`graph_decode` returns: its graphs, their counts, and :meth:`remove`.

    Attributes:
        captures: graphs captured so far (one per key: shapes, argument values, cache layout, modes).
        replays: decode steps served by a replay (the capturing step included: a capture runs nothing,
            so it replays once).
        eager: forward calls run eagerly (prefills, warm-up steps, anything not a graphable decode step).
    """

    def __init__(self, model: torch.nn.Module, *, warmup: int, max_graphs: int):
        self.model, self.warmup, self.max_graphs = model, warmup, max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.pool = None
        self.captures = self.replays = self.eager = 0
        self._rebuild = None
        self._removed = False  # after remove(): the plain forward (a wrapper around this one may remain)
        self._layout: _CacheLayout | None = None  # the last cache's tensors and layout, kept across steps
        # key -> the host counters its step advances (sliding windows), None where it changes other
        # host state (that key stays eager); read off its warm-up step
        self._counters: dict[tuple, tuple | None] = {}
        self._forward = model.forward  # the bound forward the wrapper replaces (patched or stock)
        # generate reads the forward's parameters to choose what to pass (``logits_to_keep``: without
        # it the prefill computes every position's logits)
        self.__signature__ = inspect.signature(self._forward)
        gc = getattr(model, "generation_config", None)
        self._config = None if gc is None else (gc.cache_implementation, gc.disable_compile)

    def __call__(self, *args, **kwargs):
        key_and_inputs = None if args or self._removed else self._graphable(kwargs)
        if key_and_inputs is None:
            self.eager += 1
            return self._forward(*args, **kwargs)
        key, tensors, rebuild, cache, held = key_and_inputs
        if key in self._counters and self._counters[key] is None:
            self.eager += 1
            return self._forward(**kwargs)
        graph = self.graphs.get(key)
        if graph is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            step = cuda_graph.graph_step(self._step, warmup=self.warmup, pool=self.pool)
            graph = self.graphs[key] = _Graph(step, [t for _, _, t in held], weakref.ref(cache))
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)  # the least recently used
        else:
            self.graphs.move_to_end(key)
            if graph.cache() is not cache:
                graph.adopt(cache, held)
        step = graph.step
        before, self._rebuild = step.calls, rebuild
        state = _host_state(cache) if before < self.warmup else None
        try:
            out = step(*tensors)
        finally:
            self._rebuild = None
        if state is not None:
            # other host state a replay would neither advance nor read anew: this key stays eager
            self._counters[key] = _counters(state, _host_state(cache))
            if self._counters[key] is None:
                del self.graphs[key]
        if before > self.warmup:  # a replay ran no Python: advance the counters its step advances
            for i, name in self._counters.get(key) or ():
                layer = cache.layers[i]
                setattr(layer, name, getattr(layer, name) + 1)
        if step.calls > self.warmup:
            self.replays += 1
            self.captures += before == self.warmup
        else:
            self.eager += 1
        # the step's outputs live in the graph's memory, which the next replay overwrites; the cache
        # they name is the capture's: this call's is the one the caller continues with
        return pytree.tree_map_only(torch.Tensor, torch.clone, _with_cache(out, cache))

    def _step(self, *tensors):
        # this call's arguments around the step's tensors (eager warm-up and capture; a replay runs
        # no Python): the graph keeps no reference to the call's cache, only to its tensors
        return self._forward(**self._rebuild(tensors))

    def _graphable(self, kwargs: dict):
        """``(key, tensors, rebuild, cache, held)`` for a decode step a graph may replay (``held``: the
        cache's tensors, ``_cache_tensors``), else None."""
        if torch.is_grad_enabled():
            return None
        names = [k for k in _CACHE_KEYS if k in kwargs]
        if len(names) != 1:
            return None
        cache = kwargs[names[0]]
        if not getattr(cache, "is_compileable", False):  # a dynamic cache grows: new shapes every step
            return None
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[1] != 1:
            return None  # a prefill (or a chunk of one): its shapes change from call to call
        known = self._layout
        if known is None or not known.still(cache):
            known = self._layout = _CacheLayout.of(cache, self._forgetter())
        if known is None or _window_full(cache):
            return None
        held, layout = known.held, known.layout
        rest = {k: v for k, v in kwargs.items() if k != names[0]}
        leaves, spec = pytree.tree_flatten(rest)
        tensors, others = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if not _on_cuda(leaf):
                    return None
                tensors.append(leaf)
                others.append((tuple(leaf.shape), leaf.dtype, leaf.stride()))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return None
                others.append(("value", type(leaf), leaf))
        # autocast's casts are recorded like any kernel (accelerate runs TRL's generate under bf16 autocast)
        dev = ids.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        key = (names[0], spec, tuple(others), layout, Modes.now(), cast)
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def rebuild(ts):
            filled = list(leaves)
            for i, t in zip(slots, ts, strict=True):
                filled[i] = t
            return {**pytree.tree_unflatten(filled, spec), names[0]: cache}

        return key, tensors, rebuild, cache, held

    def _forgetter(self):
        """A callback for a cache's weak reference that drops the kept layout of that cache (it
        holds the handle weakly: no cycle keeps either alive)."""
        me = weakref.ref(self)

        def forget(ref) -> None:
            handle = me()
            if handle is not None and handle._layout is not None and handle._layout.cache is ref:
                handle._layout = None

        return forget

    def remove(self) -> None:
        """Put the model's forward and generation config back and free the graphs. Where something
        wrapped the forward since (accelerate's autocast does), this stays inside that wrapper as the
        plain forward."""
        self._removed = True
        self._layout = None
        if self.model.__dict__.get("forward") is self:
            del self.model.forward
        gc = getattr(self.model, "generation_config", None)
        if gc is not None and self._config is not None:
            gc.cache_implementation, gc.disable_compile = self._config
        self.graphs.clear()


class _Graph:
    """One captured decode step and the cache tensors it was captured on."""

    def __init__(self, step, tensors: list, cache):
        self.step, self.tensors, self.cache = step, tensors, cache

    def adopt(self, cache, held: list) -> None:
        """Serve a new cache of the same layout (``generate`` builds one a call, transformers 5.25):
        its contents (the prefill's keys and values) copied into the tensors the graph writes, which
        its layers then hold. One copy of the cache a ``generate``, instead of a capture; the cache a
        graphed ``generate`` returned is thus the graph's, rewritten by the next one."""
        for (layer, name, t), mine in zip(held, self.tensors, strict=True):
            if t is not mine:
                mine.copy_(t)
                setattr(layer, name, mine)
        self.cache = weakref.ref(cache)


#: a sliding-window layer's Python count of the tokens it holds (transformers 5.17-5.25
#: ``StaticSlidingWindowLayer``): it chooses the update's branch, in-place writes until the window is
#: full, a roll after (which uploads a host-made index: not capturable)
_COUNTER = "cumulative_length_int"


def _window_full(cache) -> bool:
    """Whether a sliding-window layer of ``cache`` is full: its next update rolls (eager)."""
    return any(getattr(layer, _COUNTER, -1) >= getattr(layer, "max_cache_len", 0) for layer in cache.layers)


def _counters(before: tuple, after: tuple) -> tuple | None:
    """``((layer, name), ...)``: the sliding-window counters a decode step advanced by its one token,
    where those are all it changed on the host; None where it changed anything else."""
    counted = []
    for (i, name, a), (j, name2, b) in zip(before, after, strict=True):
        if (i, name) != (j, name2):
            return None
        if a != b:
            if name != _COUNTER or b != a + 1:
                return None
            counted.append((i, name))
    return tuple(counted)


def _host_state(cache) -> tuple:
    """Every host-side value a cache's layers hold (ints, floats, bools): what a replay leaves as the
    capture found it."""
    return tuple(
        (i, name, v)
        for i, layer in enumerate(cache.layers)
        for name, v in sorted(vars(layer).items())
        if isinstance(v, (int, float, bool))
    )


def _with_cache(out, cache):
    """``out`` (a model output) with every cache it holds replaced by ``cache``."""
    return pytree.tree_map(lambda leaf: cache if _is_cache(leaf) else leaf, out)


def _is_cache(leaf) -> bool:
    return not isinstance(leaf, torch.Tensor) and hasattr(leaf, "layers") and hasattr(leaf, "is_compileable")


class _CacheLayout:
    """A cache's tensors (``_cache_tensors``) and their layout in a graph's key, kept across decode
    steps: reading them anew cost ~46 of the ~66 µs a 16-layer step spent choosing its graph (the
    CPU box, ``vars`` of every layer sorted). Kept while the cache is the same object with the same
    layer objects, each tensor is still bound where it was found and no layer gained or lost an
    attribute: a static cache binds its tensors at its first update (the prefill, never graphed) and
    writes them in place after; ``_Graph.adopt`` rebinds them, which a later step sees. Holds the
    layers and tensors until the cache is freed (``forget``: the owner drops this record then), so a
    cache ``generate`` let go of is not kept resident beside the next one."""

    __slots__ = ("cache", "layers", "held", "layout", "counts")

    def __init__(self, cache, held: list, forget):
        self.cache, self.layers, self.held = weakref.ref(cache, forget), tuple(cache.layers), held
        self.layout = tuple((name, tuple(t.shape), t.dtype, t.device) for _, name, t in held)
        self.counts = [len(vars(layer)) for layer in self.layers]

    @staticmethod
    def of(cache, forget) -> _CacheLayout | None:
        """The record of ``cache`` (None where it has no layers); ``forget(ref)`` runs once it is freed."""
        held = _cache_tensors(cache)
        return None if held is None else _CacheLayout(cache, held, forget)

    def still(self, cache) -> bool:
        layers = cache.layers
        if self.cache() is not cache or len(layers) != len(self.layers):
            return False
        if any(a is not b for a, b in zip(layers, self.layers, strict=True)):
            return False
        if [len(vars(layer)) for layer in layers] != self.counts:
            return False
        return all(getattr(layer, name) is t for layer, name, t in self.held)


def _cache_tensors(cache) -> list | None:
    """``[(layer, name, tensor)]``: every tensor a static cache's layers hold (keys, values, position
    counters), what a captured step writes to and reads from. None where the cache has no layers
    (an unknown cache class: not graphed)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    return [(layer, name, t) for layer in layers for name, t in sorted(vars(layer).items()) if isinstance(t, torch.Tensor)]


def graph_decode(model: torch.nn.Module, *, warmup: int = 1, max_graphs: int = 8) -> GraphedDecode:
    """Replay ``model.generate``'s decode steps as CUDA graphs (fast or batch-invariant mode, patched
    or not): a static cache, the forward's first step of each shape eager, the next captured, the
    rest replayed. The logits are the eager forward's bits.

    Sets ``model.generation_config.cache_implementation = "static"`` (a graph needs the cache at fixed
    addresses) and ``disable_compile = True`` (transformers would otherwise compile the forward with
    ``mode="reduce-overhead"`` around this). :meth:`GraphedDecode.remove` puts both back.

    Args:
        model: a transformers causal LM on CUDA (or a PEFT model wrapping one).
        warmup: eager decode steps of a shape before its capture (≥ 1: the first launch compiles).
        max_graphs: graphs kept (the oldest freed first): one per batch size, cache and mode in use.

    Returns:
        :class:`GraphedDecode`, the handle (``captures``, ``replays``, ``eager``, ``remove()``).

    Raises:
        ValueError naming the argument: a model not on CUDA, spread over several devices or sharded
        by FSDP2, one already graphed, bad ``warmup`` or ``max_graphs``.
    """
    inner = unwrap(model)
    if not isinstance(inner, torch.nn.Module) or not callable(getattr(inner, "generate", None)):
        raise TypeError(f"model must be a transformers model with generate(), got {type(model).__name__}")
    sharded = next((name for name, m in inner.named_modules() if is_fsdp_unit(m)), None)
    if sharded is not None:
        unit = "its root module" if not sharded else repr(sharded)
        raise ValueError(
            f"model is sharded by FSDP2 ({unit} is a unit): its parameters are gathered to new addresses each "
            "forward, which a CUDA graph cannot follow; generate with the unsharded model"
        )
    devices = {p.device for p in inner.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"model has parameters on {len(devices)} devices ({', '.join(sorted(map(str, devices)))}): a CUDA graph "
            "records one device's stream; graph a model that sits on one GPU"
        )
    param = next(inner.parameters(), None)
    if param is None or not _on_cuda(param):
        where = "no parameters" if param is None else f"parameters on {param.device}"
        raise ValueError(f"model has {where}: CUDA graphs record GPU kernels (move it to CUDA first)")
    if isinstance(inner.__dict__.get("forward"), GraphedDecode):
        raise ValueError("model's decode steps are already graphed: call .remove() on its GraphedDecode first")
    for name, v, low in (("warmup", warmup, 1), ("max_graphs", max_graphs, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    handle = GraphedDecode(inner, warmup=warmup, max_graphs=max_graphs)
    inner.forward = handle
    gc = getattr(inner, "generation_config", None)
    if gc is not None:
        gc.cache_implementation, gc.disable_compile = "static", True
    return handle
