"""The demo's training loop: one LlamaForCausalLM, the same initial weights and batches for every run.

``run_demo(cfg, peers)`` trains "stock" (the model as transformers builds it) and then one run per
peer, each peer a function that patches the freshly built model in place (``apply_truefuse``,
Liger's instance patch, or a test's stand-in) and may return a report. Every run starts from a copy
of the one initial ``state_dict``, sees the same batches in the same order under the same seed, and
uses AdamW with the same warm-up + cosine learning-rate schedule; the loss is the model's own
``forward(labels=input_ids)``. On the CPU the runs take turns step by step (``schedule``), so that
other processes' load on a shared machine hits every run alike (the peers ``apart`` run alone after
them); on CUDA they run one after the other, so that each run's peak memory is its own. transformers
is imported here, never at ``import truefuse``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

import torch

#: name -> (param dtype, autocast dtype or None)
DTYPES = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),  # pure bf16: bf16 weights, grads and AdamW states
    "amp-bf16": (torch.float32, torch.bfloat16),  # fp32 weights, bf16 autocast in forward
}


@dataclass(frozen=True)
class DemoConfig:
    """Everything that fixes a demo run (presets in :data:`PRESETS`)."""

    size: str = "cpu"
    device: str = "cpu"
    dtype: str = "fp32"
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 704
    vocab: int = 8192  # the model's vocab_size; the tokenizer is trained to at most this many tokens
    seq: int = 256
    batch: int = 16
    steps: int = 40
    lr: float = 3e-3
    warmup_frac: float = 0.1  # linear warm-up over this fraction of the steps, then cosine to min_lr_frac
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    corpus_bytes: int = 1 << 20
    timing_warmup: int = 3  # first steps left out of the mean step time (allocator, autotuning)
    tol: float = 1e-3  # a run "matches" stock when max |loss - stock loss| along the curve <= tol
    # "interleaved": step i of every run, then step i+1 (a load spike on a shared CPU hits every run
    # alike); "sequential": one run after the other (each run's CUDA peak memory is its own);
    # "auto": interleaved on the CPU, sequential on CUDA
    schedule: str = "auto"
    # FSDP2 (demo/fsdp.py): ranks, each taking its own `batch` sequences of every step; the policy
    # ("mp": fp32 parameters, bf16 compute, fp32 reduce; "bf16": bf16 parameters; "none"), and
    # whether lm_head is its own unit. "auto" follows dtype (FSDP_POLICIES)
    world_size: int = 1
    fsdp_policy: str = "auto"
    head_unit: bool = False
    # every run's decoder layers torch.compile-d after its patch, before any sharding
    # (integrations/huggingface/compile.py: on a GPU, Inductor launches truefuse's kernels itself)
    compile_layers: bool = False
    # every run's step (forward, backward, clip, AdamW) captured in one CUDA graph on the last of the
    # `timing_warmup` untimed steps (the ones before it eager; at least 1) and replayed
    # (integrations/cuda_graph.py, docs/cuda_graphs.md)
    cuda_graphs: bool = False

    @property
    def tokens_per_step(self) -> int:
        """Over all ranks: each of the ``world_size`` ranks trains on its own ``batch`` x ``seq`` tokens."""
        return self.world_size * self.batch * self.seq


PRESETS: dict[str, DemoConfig] = {
    # ~6M parameters, 4096 tokens a step: about 1 s a step on 2 idle CPU cores, ~1.5-2 min for both runs
    "cpu": DemoConfig(),
    # a ~1.3B-parameter Llama: 8192 tokens a step, Llama-3's vocabulary size
    "gpu": DemoConfig(
        size="gpu",
        device="cuda",
        dtype="bf16",
        hidden=2048,
        layers=16,
        heads=16,
        kv_heads=8,
        intermediate=5632,
        vocab=128256,
        seq=2048,
        batch=4,
        steps=50,
        lr=3e-4,
        corpus_bytes=8 << 20,
        tol=5e-2,
    ),
}

SCHEDULES = ("auto", "interleaved", "sequential")

#: --fsdp-policy -> the dtype it implies when --dtype is not given, and the dtypes it accepts
FSDP_POLICIES = {"mp": ("amp-bf16", ("amp-bf16", "fp32")), "bf16": ("bf16", ("bf16",)), "none": (None, tuple(DTYPES))}
#: dtype -> the policy that "auto" resolves to
_AUTO_POLICY = {"amp-bf16": "mp", "bf16": "bf16", "fp32": "none"}

#: default tolerance per dtype when the dtype is changed from the preset's
_TOL = {"fp32": 1e-3, "bf16": 5e-2, "amp-bf16": 5e-2}


def make_config(size: str, **overrides) -> DemoConfig:
    """A preset with ``overrides`` (``None`` values ignored). A new ``hidden`` keeps the preset's head
    size and MLP ratio unless ``heads``/``kv_heads``/``intermediate`` are given; a new ``dtype`` brings
    its default ``tol`` unless ``tol`` is given."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(PRESETS)}")
    base = PRESETS[size]
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - set(asdict(base))
    if unknown:
        raise ValueError(f"unknown demo settings: {', '.join(sorted(unknown))}")
    if "dtype" in given and given["dtype"] not in DTYPES:
        raise ValueError(f"unknown dtype {given['dtype']!r}; known: {', '.join(DTYPES)}")
    if "hidden" in given:
        hidden = given["hidden"]
        head_dim = base.hidden // base.heads
        heads = given.setdefault("heads", max(1, hidden // head_dim))
        if "kv_heads" not in given:
            kv = max(1, heads * base.kv_heads // base.heads)
            while heads % kv:
                kv -= 1
            given["kv_heads"] = kv
        given.setdefault("intermediate", max(8, round(hidden * base.intermediate / base.hidden / 8) * 8))
    if given.get("schedule", "auto") not in SCHEDULES:
        raise ValueError(f"unknown schedule {given['schedule']!r}; known: {', '.join(SCHEDULES)}")
    if given.get("schedule", base.schedule) == "auto":
        given["schedule"] = _auto_schedule(given.get("device", base.device))
    _fsdp_settings(given, base)
    if "dtype" in given and "tol" not in given:
        given["tol"] = _TOL[given["dtype"]]
    cfg = replace(base, **given)
    names = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch", "steps", "corpus_bytes")
    for name in names + ("world_size",):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.cuda_graphs and (cfg.device != "cuda" or cfg.world_size > 1):
        raise ValueError("cuda_graphs needs device cuda and one process (FSDP2 with graphs is not in the demo)")
    if cfg.cuda_graphs and cfg.timing_warmup < 2:
        # the capture is the last untimed step (warm-up eager before it): with fewer the mean would time it
        raise ValueError(f"cuda_graphs needs timing_warmup >= 2 (an eager step, then the capture), got {cfg.timing_warmup}")
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise ValueError(
            f"hidden {cfg.hidden}, heads {cfg.heads}, kv_heads {cfg.kv_heads}: need hidden % heads == heads % kv_heads == 0"
        )
    return cfg


def _fsdp_settings(given: dict, base: DemoConfig) -> None:
    """Resolve ``fsdp_policy`` in ``given``: an explicit policy brings its dtype when none is given
    and refuses a dtype it cannot train ("mp" casts fp32 parameters; "bf16" has bf16 ones); "auto"
    follows the dtype. Without ranks (world_size 1) the policy is "none"."""
    policy = given.get("fsdp_policy", base.fsdp_policy)
    if policy != "auto" and policy not in FSDP_POLICIES:
        raise ValueError(f"unknown fsdp_policy {policy!r}; known: auto, {', '.join(FSDP_POLICIES)}")
    if given.get("world_size", base.world_size) == 1:
        if policy not in ("auto", "none") or given.get("head_unit"):
            raise ValueError("fsdp_policy and head_unit need world_size >= 2 (FSDP2 runs)")
        given["fsdp_policy"] = "none"
        return
    if policy == "auto":
        given["fsdp_policy"] = _AUTO_POLICY[given.get("dtype", base.dtype)]
        return
    implied, accepted = FSDP_POLICIES[policy]
    if "dtype" not in given and implied is not None:
        given["dtype"] = implied
    dtype = given.get("dtype", base.dtype)
    if dtype not in accepted:
        raise ValueError(f"fsdp_policy {policy!r} trains {' or '.join(accepted)} parameters, not dtype {dtype!r}")


def _auto_schedule(device: str) -> str:
    return "sequential" if torch.device(device).type == "cuda" else "interleaved"


def lr_factor(cfg: DemoConfig, step: int) -> float:
    """The schedule's multiplier of ``cfg.lr`` at ``step``: linear warm-up, then cosine to ``min_lr_frac``."""
    warm = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


@dataclass
class RunResult:
    name: str
    losses: list[float]
    step_s: list[float]
    mem_bytes: list[int] | None  # CUDA: peak allocated during each step; None on the CPU
    patch_report: str | None
    n_params: int
    setup_s: float  # build the model, load the initial state, patch, make the optimizer
    host_s: list[float] = field(default_factory=list)  # each step's host time until its last launch returned
    extra: dict = field(default_factory=dict)  # FSDP2: per-rank records, sync counts, profile files


@dataclass
class DemoResult:
    config: DemoConfig
    data: dict
    environment: dict
    model_config: dict
    runs: list[RunResult] = field(default_factory=list)


Patch = Callable[[torch.nn.Module], object]


def llama_config(cfg: DemoConfig, tokenizer_vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=max(cfg.vocab, tokenizer_vocab),  # rows past the tokenizer's size stay, unused
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        use_cache=False,
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build(model_config, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    with torch.device(device), _default_dtype(dtype):
        return LlamaForCausalLM(model_config)


def initial_state(cfg: DemoConfig, model_config) -> dict[str, torch.Tensor]:
    """The one initial state every run loads: built on the CPU under ``cfg.seed`` (the same weights on
    every machine), in the runs' parameter dtype, kept on the CPU."""
    torch.manual_seed(cfg.seed)
    model = _build(model_config, torch.device("cpu"), torch.float32)
    model.to(DTYPES[cfg.dtype][0])
    state = copy.deepcopy(model.state_dict())
    del model
    return state


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One run: build the model, load ``state``, apply ``patch``, then :meth:`step` through the batches.

    The runs' steps can be interleaved (step i of every run, then step i+1): each run keeps its own
    RNG state, so interleaving changes nothing but which run a load spike on a shared CPU hits.
    """

    def __init__(self, name: str, cfg: DemoConfig, model_config, state: dict[str, torch.Tensor], patch: Patch | None = None):
        self.name, self.cfg = name, cfg
        self.device = device = torch.device(cfg.device)
        param_dtype, autocast_dtype = DTYPES[cfg.dtype]
        self.cuda = device.type == "cuda"
        if self.cuda:  # for the peak-memory figure (none on the CPU, where a full collection cost 0.4-1 s a run)
            gc.collect()
            torch.cuda.empty_cache()
        self.t_start = time.perf_counter()
        model = _build(model_config, device, param_dtype)
        model.load_state_dict(state)
        report = patch(model) if patch is not None else None
        if cfg.compile_layers:
            from truefuse.integrations.huggingface.compile import compile_layers

            compile_layers(model)
        model = self.wrap(model)
        model.train()
        # the optimizer is built after the patch: a patch may replace modules and their parameters
        self.params = [p for p in model.parameters() if p.requires_grad]
        # torch's fused AdamW: transformers.Trainer's default optimizer on torch >= 2.8 ("adamw_torch_fused"); the
        # per-tensor foreach one took 21 ms of a 125 ms truefuse step at the GPU preset (one H100, docs/benchmarks.md)
        # captured: the learning rate a tensor the schedule writes between replays (a float would be
        # baked into the graph), the optimizer capturable
        # a patch that reads the host in the step says so (``reads_host``): that run stays eager
        not_graphed = getattr(patch, "reads_host", None) if cfg.cuda_graphs else None
        graphs = cfg.cuda_graphs and not_graphed is None
        lr = torch.tensor(cfg.lr, device=device) if graphs else cfg.lr
        opt_cls, opt_kw = torch.optim.AdamW, {"fused": True, "capturable": graphs}
        if getattr(patch, "optimizer", "torch") == "truefuse":  # the --truefuse-adamw run (cli.py): always capturable
            from truefuse.optim import AdamW as opt_cls

            opt_kw = {}
        self.opt = opt_cls(self.params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, **opt_kw)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(cfg, s))
        self.graphed = None
        if graphs:
            from truefuse.integrations.cuda_graph import graph_step

            # the capture (call ``warmup``: ~2 s for 4 layers on an H100) inside the untimed steps:
            # one timed capture had put stock's mean step at 396 ms against 81 replayed
            # the demo feeds no position_ids (the models' own, never packed): eager's causal skip under capture
            self.graphed = graph_step(self._step_body, warmup=max(1, cfg.timing_warmup - 1), packed_sequences=False)
        self.autocast_dtype = autocast_dtype
        self.model = model
        torch.manual_seed(cfg.seed)
        self.rng = _rng_state(device)
        self.result = RunResult(
            name=name,
            losses=[],
            step_s=[],
            mem_bytes=[] if self.cuda else None,
            patch_report=None if report is None else str(report),
            n_params=sum(p.numel() for p in self.params),
            setup_s=time.perf_counter() - self.t_start,
        )
        if not_graphed:  # said in the table's caption
            self.result.extra["not_graphed"] = not_graphed

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """After the patch, before the optimizer: the FSDP2 trainer shards the model here."""
        return model

    def step(self, ids: torch.Tensor) -> float:
        """One optimizer step on ``ids`` (labels = ids: the model shifts them); returns the loss."""
        device = self.device
        _set_rng_state(device, self.rng)
        ids = ids.to(device)
        _sync(device)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss = self.update(ids)
        # every kernel of the step is queued: host time ~ step time means the GPU waited on the host
        self.result.host_s.append(time.perf_counter() - t0)
        value = loss.item()
        _sync(device)
        self.result.step_s.append(time.perf_counter() - t0)
        self.result.losses.append(value)
        if self.cuda:
            self.result.mem_bytes.append(torch.cuda.max_memory_allocated(device))
        self.rng = _rng_state(device)
        return value

    def update(self, ids: torch.Tensor) -> torch.Tensor:
        """Forward, backward, clip, AdamW and the schedule on ``ids`` (on the device); the loss, unread
        (with ``cuda_graphs``, the captured step's loss tensor, overwritten by the next step)."""
        loss = self._step_body(ids) if self.graphed is None else self.graphed(ids)
        self.sched.step()  # outside the graph: it writes the learning-rate tensor the graph reads
        return loss

    def _step_body(self, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close(self) -> RunResult:
        """Free the model and optimizer; the run's record."""
        del self.model, self.opt, self.sched, self.params, self.graphed
        if self.cuda:
            gc.collect()
        return self.result


def _rng_state(device: torch.device):
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def environment(device: torch.device) -> dict:
    import platform

    import tokenizers
    import transformers

    import truefuse

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "truefuse": truefuse.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
    }
    return env


@contextlib.contextmanager
def progress_bar(total: int, quiet: bool = False):
    """A rich progress bar on stderr (nothing when ``quiet`` or stderr is not a terminal); yields the
    ``on_step(name, step, loss)`` callback :func:`run_demo` calls after each step."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    disable = quiet or not console.is_terminal
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=disable,
    ) as progress:
        task = progress.add_task("demo", total=total)

        def on_step(name: str, step: int, loss: float) -> None:
            progress.update(task, advance=1, description=f"{name}: step {step + 1}, loss {loss:.4f}")

        yield on_step


def prepare_data(cfg: DemoConfig, cache_dir: str | None, log: Callable[[str], None]):
    """The corpus's tokens, the ``(steps, world_size * batch, seq)`` batches (every rank's rows of each
    step) and the data's facts for the results file."""
    from truefuse.demo.data import describe, load_corpus, make_batches, tokenize_corpus

    corpus = load_corpus(cfg.corpus_bytes)
    data = tokenize_corpus(corpus, cfg.vocab, cache_dir)
    batches = make_batches(data.tokens, cfg.steps, cfg.world_size * cfg.batch, cfg.seq, cfg.seed)
    facts = describe(corpus, data)
    facts["epochs"] = round(cfg.steps * cfg.tokens_per_step / max(1, data.tokens.numel() // cfg.seq * cfg.seq), 3)
    log(
        f"data: {facts['files']} stdlib files ({facts['bytes']:,} bytes, {facts['first_file']} .. {facts['last_file']}), "
        f"{facts['tokens']:,} tokens, BPE vocab {data.vocab_size} ({'cached' if data.cached else 'trained'} in {data.cache_dir})"
    )
    return data, batches, facts


def run_demo(
    cfg: DemoConfig,
    peers: dict[str, Patch],
    cache_dir: str | None = None,
    quiet: bool = False,
    log: Callable[[str], None] | None = None,
    apart: Iterable[str] = (),
) -> DemoResult:
    """Train "stock", then each of ``peers`` (name -> patch of the model), from one initial state on
    the same batches. ``log`` gets one-line notes (data, patch reports) as they happen.

    ``apart``: peers that run alone, one after the other, after the interleaved runs: a run much
    slower than the others (the batch-invariant one), interleaved, slowed every run of its round.
    Their step times are their own, the others' are taken without them; the result keeps the
    runs' order.

    A peer whose patch changes process-wide state (Liger's RoPE replaces a transformers module
    function) needs ``schedule="sequential"`` and the last place, or it would leak into the runs before it.
    """
    if "stock" in peers:
        raise ValueError('"stock" is the unpatched reference run; give the peers other names')
    log = log or (lambda _msg: None)
    if cfg.schedule == "auto":
        cfg = replace(cfg, schedule=_auto_schedule(cfg.device))
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    data, batches, facts = prepare_data(cfg, cache_dir, log)
    model_config = llama_config(cfg, data.vocab_size)
    state = initial_state(cfg, model_config)
    result = DemoResult(cfg, facts, environment(device), model_config.to_dict())
    runs = {"stock": None, **peers}
    apart = set(apart)
    unknown = apart - set(peers)
    if unknown:
        raise ValueError(f"apart names no peer: {', '.join(sorted(unknown))}")
    done: dict[str, RunResult] = {}
    with progress_bar(cfg.steps * len(runs), quiet) as on_step:
        if cfg.schedule == "interleaved":
            trainers = [Trainer(name, cfg, model_config, state, patch) for name, patch in runs.items() if name not in apart]
            _log_reports(trainers, log)
            for i in range(cfg.steps):
                for t in trainers:
                    on_step(t.name, i, t.step(batches[i]))
            done.update((t.name, t.close()) for t in trainers)
        for name, patch in runs.items():
            if name in done:
                continue
            trainer = Trainer(name, cfg, model_config, state, patch)
            _log_reports([trainer], log)
            for i in range(cfg.steps):
                on_step(name, i, trainer.step(batches[i]))
            done[name] = trainer.close()
    result.runs.extend(done[name] for name in runs)
    return result


def _log_reports(trainers: list[Trainer], log: Callable[[str], None]) -> None:
    for t in trainers:
        if t.result.patch_report is not None:
            log(f"{t.name}: {t.result.patch_report}")
