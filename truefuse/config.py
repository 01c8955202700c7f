"""The one reader of environment variables (:class:`Config`), and the frozen tuning knobs
(:class:`Tuning`, overridden for a scope with :func:`tuning`).

Everything else in truefuse asks :func:`get_config` instead of reading ``os.environ`` itself, and
:func:`get_tuning` instead of keeping its own module constant, so that a run's behaviour can be
explained from two objects (``python -m truefuse info`` prints both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

#: The GEMM backends ``TRUEFUSE_GEMM_BACKENDS`` may name, in default preference order. Each is one
#: file of ``truefuse/ops/gemm/gemm_backends/``, whose registry checks at import that it lists exactly
#: these (config sits below ops: it names them, it does not import them).
KNOWN_GEMM_BACKENDS: tuple[str, ...] = ("torch", "triton")


def known_gemm_backends() -> tuple[str, ...]:
    """:data:`KNOWN_GEMM_BACKENDS`."""
    return KNOWN_GEMM_BACKENDS


class ConfigError(ValueError):
    """An environment variable truefuse reads has a value it cannot use (the message names both)."""


def _gemm_backends(raw: str | None) -> tuple[str, ...]:
    """``TRUEFUSE_GEMM_BACKENDS`` parsed (None: unset, the registry's order), or :class:`ConfigError`:
    empty, unknown or repeated names."""
    known = known_gemm_backends()
    if raw is None:
        return known
    names = tuple(s.strip() for s in raw.split(",") if s.strip())
    hint = (
        f"known backends: {', '.join(known)}; give a comma-separated preference order "
        f"such as TRUEFUSE_GEMM_BACKENDS={','.join(known)}, or unset it for that default"
    )
    if not names:
        raise ConfigError(f"TRUEFUSE_GEMM_BACKENDS={raw!r} names no GEMM backend; {hint}")
    unknown = [n for n in names if n not in known]
    if unknown:
        what = "backend" if len(unknown) == 1 else "backends"
        raise ConfigError(f"TRUEFUSE_GEMM_BACKENDS={raw!r}: unknown GEMM {what} {', '.join(map(repr, unknown))}; {hint}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"TRUEFUSE_GEMM_BACKENDS={raw!r} names {', '.join(map(repr, repeated))} more than once; {hint}")
    return names


def _flag(name: str, default: bool = False) -> bool:
    """An on/off environment variable: ``default`` where unset or empty, else on unless 0/false/no/off
    (a default-off flag: on only for 1/true/yes/on)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in {"0", "false", "no", "off"} if default else value in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Config:
    """Process-wide settings.

    Attributes:
        triton_interpret: ``TRITON_INTERPRET=1``: Triton kernels run in Triton's CPU interpreter.
            Then the Triton backend is offered on the CPU too (for fp32 kernel-logic tests; the
            interpreter's bf16 casts truncate, so bf16 numerics are only checked on a GPU).
        gemm_backends: ``TRUEFUSE_GEMM_BACKENDS``, a comma-separated preference order of GEMM
            backends (default: every registered backend in the registry's order, today
            ``torch,triton``). A backend left out is never planned. An empty list, a name not in
            :func:`known_gemm_backends` or a repeated name raises :class:`ConfigError` (a
            ``ValueError``) from :func:`get_config`.
    """

    triton_interpret: bool
    gemm_backends: tuple[str, ...]

    @classmethod
    def from_env(cls) -> Config:
        return cls(
            triton_interpret=_flag("TRITON_INTERPRET"),
            gemm_backends=_gemm_backends(os.environ.get("TRUEFUSE_GEMM_BACKENDS")),
        )


#: :func:`get_config`'s answer once read. A plain global, not ``functools.cache``: launchers call
#: it in code ``torch.compile`` traces, where Dynamo warns of any ``lru_cache`` wrapper it meets
#: ("silent incorrectness") and traces the wrapped function (the environment read) instead; a global
#: it reads as a guarded constant.
_config: Config | None = None


def get_config() -> Config:
    """The configuration read once from the environment of this process
    (``get_config.cache_clear()`` forgets it: the next call reads the environment again).

    Raises:
        ConfigError: (a ``ValueError``) for a value it cannot use, e.g. ``TRUEFUSE_GEMM_BACKENDS=cublas``;
            nothing is cached then, so every later call raises the same error.
    """
    global _config
    if _config is None:
        _config = Config.from_env()
    return _config


def _clear_config() -> None:
    global _config
    _config = None


get_config.cache_clear = _clear_config


def _knob(default, doc: str):
    """A :class:`Tuning` field: its default and the one line that says what it bounds and where it
    was measured (``python -m truefuse info`` prints it; :func:`knob_docs`)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Tuning:
    """The tuning knobs: thresholds and sizes the ops pick their paths by (measurements in
    docs/benchmarks.md). Frozen: change them for a scope with :func:`tuning`, read the current ones
    with :func:`get_tuning`. Every reader reads its knob when it runs (a CUDA graph keeps what was
    read at capture); a ``truefuse.distributed.Workspace`` sizes its symmetric memory from
    ``ll_max_bytes`` and ``maxp`` and takes its default ``two_stage_bytes`` when it is made.
    Every value is a positive int (``two_stage_bytes``: world size → bytes, both positive)."""

    chunk_bytes: int = _knob(
        512 << 20,
        "linear_cross_entropy's logits budget per chunk when chunk_size is None (input-dtype bytes); "
        "H200, 8192 x 128256 x 4096: chunks of 512/1024/2048/4096 tokens took 58.6/50.2/47.3/45.4 ms, "
        "the last with 1 GiB more peak; 512 MiB picks 2048 (with an fp32 weight-gradient accumulator "
        "its V*H*4 bytes when more; docs/benchmarks.md, linear cross-entropy)",
    )
    slice_bytes: int = _knob(
        256 << 20,
        "linear_cross_entropy(memory='lean')'s logits budget per vocabulary slice when vocab_slice is "
        "None (input-dtype bytes, all tokens): 16384 classes of 8192 bf16 tokens, 8 slices of 128256; "
        "with the fp32 (tokens, H) d_input buffer the lean peak stays under 0.6 GB at 8192 x 128256 x 4096",
    )
    align: int = _knob(
        64,
        "linear_cross_entropy's split GEMMs: the vocabulary of the aligned part and the logits rows' "
        "padding are multiples of it (cuBLAS on the H200 runs V % 8 != 0 5-6x slower: 31.0 against "
        "4.85 ms at 8192 x 50257 x 4096; experiments/exp_odd_vocab_gemms.py, docs/benchmarks.md)",
    )
    min_macs: int = _knob(
        1 << 32,
        "tokens x V x H of a linear_cross_entropy chunk below which nothing is padded or split "
        "(2^32: ~12 us of GEMM on the H200 at cuBLAS speed, ~60 us unaligned; docs/benchmarks.md)",
    )
    two_stage_bytes: tuple[tuple[int, int], ...] = _knob(
        ((2, 1 << 30), (4, 1 << 20), (8, 512 << 10)),
        "allreduce: message bytes from which a Workspace of that world size takes the 2-stage kernel "
        "(its default two_stage_bytes); measured on 2 and 4 H200 (2: the 1-stage kernel wins at every "
        "size, 4: 1 MiB), 8 is a guess, not measured (docs/benchmarks.md, allreduce)",
    )
    two_stage_bytes_other: int = _knob(
        512 << 10,
        "allreduce: the 2-stage threshold of a world size two_stage_bytes does not list (a guess, like 8)",
    )
    push_max_bytes: int = _knob(
        256 << 10,
        "allreduce: messages up to this size push rows into the readers' buffers, larger ones are "
        "pulled (4 H200, 1-stage at 64 rows x 4096 bf16: pull 16.1 us, push 17.5; docs/benchmarks.md)",
    )
    ll_max_bytes: int = _knob(
        128 << 10,
        "allreduce: messages up to this size take the LL kernel (data and flag in each 8-byte word, no "
        "barrier; the words double the bytes, so it loses beyond: 4 H200, 16 rows 9.5 us against 11.2, "
        "64 rows 20.3 against 16.1; docs/benchmarks.md); a Workspace sizes its LL slots from it when made",
    )
    programs_per_sm: int = _knob(
        2,
        "allreduce: most programs per SM (1 where a program needs 16 warps); two keep more rows in "
        "flight, and registers are capped at 128 a thread to make two resident (65536 / (128 x 256))",
    )
    maxp: int = _knob(
        512,
        "allreduce: most programs per launch; a Workspace's signal pad holds 2 regions of maxp x "
        "world_size flags, sized when it is made (a call with a larger maxp than its workspace's raises)",
    )
    hf_norm_stock_numel: int = _knob(
        1 << 18,
        "rms_norm_hf with nothing to differentiate runs the stock expression itself (its own bits, so "
        "the same) up to this many elements outside batch-invariant mode: a decode step's norm costs "
        "68 us of host as stock's six ops, 173 us as statistics + kernel (H100 host, 4 x 2048 bf16; "
        "experiments/host_time.py launch, docs/benchmarks.md)",
    )
    max_kernel_n: int = _knob(
        16384,
        "largest hidden size the norm kernels take (a row lives in registers; wider rows use the "
        "reference) and the largest allreduce / allreduce_add_rmsnorm accepts",
    )

    def two_stage_threshold(self, world_size: int) -> int:
        """The 2-stage threshold (bytes) of a group of ``world_size`` ranks."""
        return dict(self.two_stage_bytes).get(world_size, self.two_stage_bytes_other)


def knob_docs() -> dict[str, str]:
    """Each :class:`Tuning` knob's one-line description, by name, in field order."""
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(Tuning)}


_tuning = Tuning()  # the current knobs; replaced (never mutated) by tuning()


def get_tuning() -> Tuning:
    """The tuning knobs in effect now: the defaults, or the innermost :func:`tuning` override."""
    return _tuning


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _checked(name: str, value: object, current: Tuning) -> object:
    """``value`` as knob ``name`` holds it, or ValueError naming the knob and the value."""
    if name == "two_stage_bytes":
        pairs = value.items() if isinstance(value, Mapping) else value
        try:
            pairs = [tuple(p) for p in pairs]
        except TypeError:
            pairs = None
        if pairs is None or not all(len(p) == 2 and _positive_int(p[0]) and _positive_int(p[1]) for p in pairs):
            raise ValueError(
                f"tuning knob two_stage_bytes={value!r}: give a mapping of world size to bytes, "
                "both positive ints, e.g. {4: 1 << 20}"
            )
        merged = dict(current.two_stage_bytes) | dict(pairs)
        return tuple(sorted(merged.items()))
    if not _positive_int(value):
        raise ValueError(f"tuning knob {name}={value!r}: it must be a positive int")
    return value


def tuning(**overrides) -> contextlib.AbstractContextManager[Tuning]:
    """Override tuning knobs for a ``with`` block; the previous knobs come back on exit, also on an
    exception. Yields the :class:`Tuning` in effect inside.

    ``with truefuse.config.tuning(chunk_bytes=64 << 20): ...`` — every knob not named keeps its
    current value (blocks nest). ``two_stage_bytes`` takes a mapping of world size to bytes,
    merged into the current table.

    Names and values are checked when ``tuning(...)`` is called, before anything changes: an
    unknown name raises ValueError naming it and the known knobs; a value that is not a positive
    int (bools are not) raises ValueError naming the knob.

    Not thread-safe beyond a plain module global, as :func:`get_config`'s cache is no more: the
    override is process-wide (seen by every thread, including autograd's backward threads, not
    per thread or per task), and overlapping blocks in several threads restore each other's values
    in exit order. Use it from one thread, around the calls it should affect.
    """
    known = tuple(f.name for f in dataclasses.fields(Tuning))
    unknown = [n for n in overrides if n not in known]
    if unknown:
        what = "knob" if len(unknown) == 1 else "knobs"
        raise ValueError(f"unknown tuning {what} {', '.join(map(repr, unknown))}; known knobs: {', '.join(known)}")
    for name, value in overrides.items():  # every value checked here, before the block starts
        _checked(name, value, _tuning)
    return _override(overrides)


@contextlib.contextmanager
def _override(overrides: dict[str, object]) -> Iterator[Tuning]:
    global _tuning
    previous = _tuning
    _tuning = dataclasses.replace(previous, **{n: _checked(n, v, previous) for n, v in overrides.items()})
    try:
        yield _tuning
    finally:
        _tuning = previous


# The batch-invariant switch (docs/design.md §1, "Batch invariance"; issue 34). Process-wide like
# the tuning knobs, not a ContextVar: autograd runs CUDA backwards on its own threads, which a
# ContextVar would not reach. A call reads it once (``autograd/_modes.py``: ``Modes.now()``), passes
# the answer to the ops and keeps it on the autograd ctx, so a backward run after the ``with`` block
# still takes the forward's path.
_batch_invariant: bool = _flag("TRUEFUSE_BATCH_INVARIANT")


def is_batch_invariant() -> bool:
    """Whether batch-invariant mode is on: every truefuse op then gives each row (token) a result
    bitwise independent of the other rows in the call. Default off, or ``TRUEFUSE_BATCH_INVARIANT=1``;
    :func:`batch_invariant` turns it on or off for a block."""
    return _batch_invariant


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[bool]:
    """``with truefuse.batch_invariant(): ...`` runs the block in batch-invariant mode (or, with
    ``enabled=False``, out of it); the previous mode comes back on exit, also on an exception.
    Blocks nest. Process-wide, like :func:`tuning`: use it from one thread.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _batch_invariant
    previous, _batch_invariant = _batch_invariant, _checked_switch("batch_invariant", enabled)
    try:
        yield enabled
    finally:
        _batch_invariant = previous


def _checked_switch(name: str, enabled) -> bool:
    """``enabled`` for the switch ``name``'s block: a bool, else one TypeError naming it."""
    if not isinstance(enabled, bool):
        raise TypeError(f"{name}(enabled={enabled!r}): enabled must be a bool")
    return enabled


# Eager Triton launches through the compiled kernel's own launcher (ops/_launch/fast_launch.py,
# docs/design.md §6.7; issue 47 item 3). Process-wide like the batch-invariant switch, read at every
# launch: a ``with eager_fast_launch(False)`` block's launches all take Triton's own path. On by
# default; ``TRUEFUSE_FAST_LAUNCH=0`` starts the process with it off.
_eager_fast_launch: bool = _flag("TRUEFUSE_FAST_LAUNCH", default=True)


def is_eager_fast_launch() -> bool:
    """Whether eager Triton launches may go through the compiled kernel's own launcher (the same
    kernel and arguments, less host time; ``ops/_launch/fast_launch.py``), and a repeated call may
    replay its kept launch (``ops/_launch/prepared.py``). Default on, or off with
    ``TRUEFUSE_FAST_LAUNCH=0``; :func:`eager_fast_launch` turns it on or off for a block."""
    return _eager_fast_launch


@contextlib.contextmanager
def eager_fast_launch(enabled: bool = True) -> Iterator[bool]:
    """``with truefuse.config.eager_fast_launch(False): ...`` launches every Triton kernel in the
    block through ``kernel[grid](...)``, Triton's own path (to compare host time, or to rule the
    fast path out); the previous setting comes back on exit, also on an exception. Blocks nest.
    Process-wide, like :func:`batch_invariant`: use it from one thread.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    global _eager_fast_launch
    previous, _eager_fast_launch = _eager_fast_launch, _checked_switch("eager_fast_launch", enabled)
    try:
        yield enabled
    finally:
        _eager_fast_launch = previous
