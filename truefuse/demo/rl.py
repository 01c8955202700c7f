"""``python -m truefuse rl``: a few GRPO steps of a small Llama (random init) learning digit addition
from scratch, stock vs truefuse in batch-invariant mode, from the same weights and seeds
(docs/rl.md).

Each step samples ``group`` completions of each of ``prompts`` prompts ``"a+b="`` with
``model.generate`` (the sampler: KV cache, left-padded prompts); the sampler's log-probs are
``generate_log_probs`` (``token_log_probs`` of the logits it sampled from, in the model's logits
dtype). The trainer recomputes them with ``model_log_probs`` (one forward over prompt + completion,
differentiable), and the update is GRPO's clipped importance-ratio loss with group-normalised
advantages, one AdamW step. Before the update, the trainer's and the sampler's log-probs of the
same tokens should be equal: their gap is what the run records next to the reward. In
batch-invariant mode it is 0 bit for bit; stock's sampler and trainer disagree in the last bits,
the mismatch RL papers measure. transformers is imported only when a run starts.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from truefuse.integrations.huggingface.log_probs import generate_log_probs

#: the character vocabulary: specials, then the characters prompts and answers are made of
PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+="
VOCAB = 3 + len(CHARS)
_ID = {c: 3 + i for i, c in enumerate(CHARS)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: run name -> apply_truefuse's keyword arguments (None: stock, nothing patched)
RUNS: dict[str, dict | None] = {"stock": None, "truefuse BI": {"batch_invariant": True}, "truefuse": {}}


@dataclass(frozen=True)
class RLConfig:
    """Everything that fixes a run (presets in :data:`PRESETS`)."""

    size: str = "cpu"
    device: str = "cpu"
    dtype: str = "fp32"
    hidden: int = 128
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 352
    digits: int = 2  # operands in [0, 10**digits)
    prompts: int = 8  # prompts a step
    group: int = 8  # completions a prompt (GRPO's G)
    steps: int = 60
    lr: float = 5e-3
    temperature: float = 1.0
    clip_eps: float = 0.2  # the ratio's clip range [1 - eps, 1 + eps]
    seed: int = 0
    fast: bool = False  # also a run of plain apply_truefuse (fast mode)
    graphed: bool = False  # every run samples with its decode steps as CUDA graphs (graph_decode)
    timing_warmup: int = 2  # first steps left out of the mean step time

    @property
    def new_tokens(self) -> int:
        """The answer's length: ``digits`` + 1 (the carry); no EOS is needed after it."""
        return self.digits + 1

    @property
    def runs(self) -> list[str]:
        return ["stock", "truefuse BI"] + ["truefuse"] * self.fast


PRESETS = {
    # ~0.4M parameters, 64 completions a step. Hidden 128 and 64 rows a decode step: this CPU's fp32
    # GEMMs then round a sampler's row otherwise than the trainer's (stock's gap is not 0; at hidden
    # 64 and 128 rows they were the same bits, and only the GPU would show the gap)
    "cpu": RLConfig(),
    # bf16, ~100M parameters, 1024 completions a step. lr 5e-5: at 3e-4 the policy collapsed to one
    # answer a prompt by step 2 (H100, docs/benchmarks.md "RL in the client users run")
    "gpu": RLConfig(
        size="gpu",
        device="cuda",
        dtype="bf16",
        hidden=1024,
        layers=8,
        heads=16,
        kv_heads=8,
        intermediate=2816,
        digits=3,
        prompts=64,
        group=16,
        steps=40,
        lr=5e-5,
    ),
}


def make_config(size: str, **overrides) -> RLConfig:
    """A preset with ``overrides`` (``None`` values ignored). Raises ValueError naming the bad setting."""
    if size not in PRESETS:
        raise ValueError(f"size must be one of {', '.join(PRESETS)}, got {size!r}")
    base = PRESETS[size]
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - set(asdict(base))
    if unknown:
        raise ValueError(f"unknown rl settings: {', '.join(sorted(unknown))}")
    if "hidden" in given:  # keep the preset's head size and MLP ratio
        given.setdefault("heads", max(1, given["hidden"] // (base.hidden // base.heads)))
        given.setdefault("kv_heads", max(1, given["heads"] // 2))
        given.setdefault("intermediate", max(8, round(given["hidden"] * base.intermediate / base.hidden / 8) * 8))
    cfg = replace(base, **given)
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {cfg.device!r}")
    if cfg.graphed and cfg.device != "cuda":
        raise ValueError("graphed generate needs device cuda (CUDA graphs record GPU kernels)")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "prompts", "steps"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.group < 2:
        raise ValueError(f"group must be at least 2 (advantages are normalised within a group), got {cfg.group}")
    if not 1 <= cfg.digits <= 6:
        raise ValueError(f"digits must be in [1, 6], got {cfg.digits}")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {cfg.temperature}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"lr must be finite and > 0, got {cfg.lr}")
    if not 0 < cfg.clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {cfg.clip_eps}")
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise ValueError(
            f"hidden {cfg.hidden}, heads {cfg.heads}, kv_heads {cfg.kv_heads}: need hidden % heads == heads % kv_heads == 0"
        )
    return cfg


# --- the task ------------------------------------------------------------------------------------


def encode(text: str) -> list[int]:
    return [_ID[c] for c in text]


def decode(ids: list[int]) -> str:
    """Characters of ``ids``; a special token reads as "?" (never a digit)."""
    return "".join(CHARS[i - 3] if 3 <= i < VOCAB else "?" for i in ids)


def make_prompts(cfg: RLConfig, step: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Step ``step``'s prompts, each repeated ``group`` times: (ids, attention_mask) left-padded
    ``BOS a + b =`` (operands of 1 to ``digits`` digits: the lengths differ) and the sums. The same
    for every run (a generator seeded by seed and step)."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    ab = torch.randint(0, 10**cfg.digits, (cfg.prompts, 2), generator=g).tolist()
    seqs = [[BOS] + encode(f"{a}+{b}=") for a, b in ab]
    width = max(len(s) for s in seqs)
    ids = torch.full((cfg.prompts, width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = torch.tensor(s), 1
    rep = lambda t: t.repeat_interleave(cfg.group, 0)  # noqa: E731
    return rep(ids), rep(mask), [a + b for a, b in ab for _ in range(cfg.group)]


def completion_mask(completions: torch.Tensor) -> torch.Tensor:
    """1 for each sampled token up to and including the first EOS, 0 after (``generate``'s padding
    of a finished sequence; a sampled PAD token before the EOS counts)."""
    eos = (completions == EOS).long()
    after = eos.cumsum(1) - eos  # EOS tokens strictly before each position
    return (after == 0).long()


def answer_text(cfg: RLConfig, total: int) -> str:
    """The sum as the model should write it: ``digits + 1`` characters, zero-padded ("07" for 3+4
    at one digit), so that every answer has the same length and each place a fixed meaning."""
    return f"{total:0{cfg.new_tokens}d}"


def reward(completion: list[int], want: str) -> float:
    """Partial credit: the share of ``want``'s characters the completion (up to its first EOS) has
    at their place, so each right digit counts (the carry digit is learnt first) and 1 means exactly
    right. A completion cut by an early EOS loses the places it did not write."""
    if EOS in completion:
        completion = completion[: completion.index(EOS)]
    # strict=False: a short completion scores the places it wrote
    return sum(a == b for a, b in zip(decode(completion), want, strict=False)) / len(want)


# --- the runs ------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """One run's per-step numbers."""

    name: str
    patch_report: str | None = None
    params_sha256: str = ""  # of the initial parameters, after the patch (every run's the same)
    reward: list[float] = field(default_factory=list)  # mean over the step's completions
    exact: list[float] = field(default_factory=list)  # share of completions exactly right
    gap: list[float] = field(default_factory=list)  # max |trainer - sampler| log-prob over completion tokens
    differing: list[int] = field(default_factory=list)  # completion tokens whose two log-probs differ
    tokens: list[int] = field(default_factory=list)  # completion tokens (up to EOS) sampled
    samples_sha256: list[str] = field(default_factory=list)  # of each step's completions
    step_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)  # trainer log-probs, loss, backward, AdamW
    graphs: dict | None = None  # with --graphed-generate: graph_decode's captures and replays


@dataclass
class RLResult:
    config: RLConfig
    environment: dict
    model_config: dict
    runs: list[RunRecord] = field(default_factory=list)


def llama_config(cfg: RLConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=4 * cfg.digits + 8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


def initial_state(cfg: RLConfig, model_config) -> dict[str, torch.Tensor]:
    """The one initial state every run loads: built on the CPU under ``cfg.seed``, in the runs' dtype."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(model_config).to(DTYPES[cfg.dtype])
    return copy.deepcopy(model.state_dict())


def _sha256(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GRPORun:
    """One run: build the model, load ``state``, patch it (``RUNS[name]``), then :meth:`step`."""

    def __init__(self, name: str, cfg: RLConfig, model_config, state: dict[str, torch.Tensor]):
        from transformers import GenerationConfig, LlamaForCausalLM

        self.name, self.cfg = name, cfg
        self.device = torch.device(cfg.device)
        with torch.device(self.device):
            model = LlamaForCausalLM(model_config).to(DTYPES[cfg.dtype])
        model.load_state_dict(state)
        self.record = RunRecord(name)
        patch = RUNS[name]
        if patch is not None:
            from truefuse.integrations.huggingface import apply_truefuse

            self.record.patch_report = str(apply_truefuse(model, **patch))
        self.record.params_sha256 = _sha256(model.state_dict().values())
        self.model = model
        self.graphs = None
        if cfg.graphed:  # the decode steps replayed as CUDA graphs of the same eager forward: the same bits
            from truefuse.integrations.huggingface import graph_decode

            self.graphs = graph_decode(model)
        self.params = [p for p in model.parameters() if p.requires_grad]  # after the patch, which may swap modules
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        # plain multinomial sampling at the temperature: no top-k / top-p cut, no early-stop tweaks
        self.gen_config = GenerationConfig(
            do_sample=True,
            temperature=cfg.temperature,
            top_k=None,
            top_p=None,
            max_new_tokens=cfg.new_tokens,
            pad_token_id=PAD,
            eos_token_id=EOS,
            bos_token_id=BOS,
            output_logits=True,
            return_dict_in_generate=True,
            **({"cache_implementation": "static", "disable_compile": True} if cfg.graphed else {}),
        )

    @torch.no_grad()
    def sample(self, ids: torch.Tensor, mask: torch.Tensor, step: int):
        """(completions (B, n), sampler log-probs (B, n)): ``generate`` at the temperature, then
        ``generate_log_probs`` of the sampled tokens from the logits they were drawn from (0 after a
        sequence's EOS: each row's log-prob is its own, so zeroing them leaves the others' bits)."""
        torch.manual_seed(self.cfg.seed * 100_003 + step)  # every run draws the same random numbers
        self.model.eval()  # the patched forward's generate path (no training-only branches)
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.gen_config)
        completions = out.sequences[:, ids.shape[1] :]
        lp = generate_log_probs(self.model, out, ids.shape[1], temperature=self.cfg.temperature).log_probs
        return completions, torch.where(completion_mask(completions).bool(), lp, 0.0)

    def train_step(self, seqs, full_mask, prompt_len, old, cmask, advantages) -> torch.Tensor:
        """The trainer's log-probs of the completion tokens (before the update) and one AdamW step on
        GRPO's clipped loss, averaged over the completion tokens."""
        from truefuse.integrations.huggingface import model_log_probs

        cfg = self.cfg
        self.model.train()
        new = model_log_probs(self.model, seqs, full_mask, temperature=cfg.temperature).log_probs[:, prompt_len - 1 :]
        ratio = torch.exp(new - old)
        adv = advantages[:, None]
        per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
        m = cmask.to(per_token.dtype)
        loss = (per_token * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return new.detach()

    def step(self, step: int) -> None:
        cfg, rec, dev = self.cfg, self.record, self.device
        ids, mask, answers = make_prompts(cfg, step)
        ids, mask = ids.to(dev), mask.to(dev)
        _sync(dev)
        t0 = time.perf_counter()
        completions, old = self.sample(ids, mask, step)
        _sync(dev)
        t1 = time.perf_counter()
        cmask = completion_mask(completions)
        rows = completions.tolist()
        rewards = torch.tensor([reward(c, answer_text(cfg, a)) for c, a in zip(rows, answers, strict=True)], dtype=torch.float32)
        grouped = rewards.view(cfg.prompts, cfg.group)
        # group-normalised advantages; a group whose completions all score alike teaches nothing (0)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1).to(dev)
        seqs = torch.cat([ids, completions], 1)
        full_mask = torch.cat([mask, cmask], 1)
        new = self.train_step(seqs, full_mask, ids.shape[1], old, cmask, adv)
        _sync(dev)
        t2 = time.perf_counter()
        valid = cmask.bool()
        diff = (new.double() - old.double()).abs()[valid]
        rec.reward.append(float(rewards.mean()))
        rec.exact.append(float((rewards == 1).float().mean()))
        rec.gap.append(float(diff.max()) if diff.numel() else 0.0)
        rec.differing.append(int((diff != 0).sum()))
        rec.tokens.append(int(valid.sum()))
        rec.samples_sha256.append(_sha256([completions]))
        rec.generate_s.append(t1 - t0)
        rec.train_s.append(t2 - t1)
        rec.step_s.append(t2 - t0)

    def close(self) -> RunRecord:
        if self.graphs is not None:
            self.record.graphs = {"captures": self.graphs.captures, "replays": self.graphs.replays}
            self.graphs.remove()
        del self.model, self.opt, self.params, self.graphs
        return self.record


def environment(device: torch.device) -> dict:
    import platform

    import transformers

    import truefuse

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "truefuse": truefuse.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
    }


def run_rl(
    cfg: RLConfig,
    runs: list[str] | None = None,
    on_step: Callable[[str, int, RunRecord], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> RLResult:
    """Every run of ``runs`` (default ``cfg.runs``; names of :data:`RUNS`) from one initial state,
    one after the other (each run's steps timed alone, not interleaved with another's)."""
    runs = cfg.runs if runs is None else runs
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        raise ValueError(f"runs must be names among {', '.join(RUNS)}, got {runs!r}")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    model_config = llama_config(cfg)
    state = initial_state(cfg, model_config)
    result = RLResult(cfg, environment(device), model_config.to_dict())
    for name in runs:
        run = GRPORun(name, cfg, model_config, state)
        if log and run.record.patch_report:
            log(f"{name}: {run.record.patch_report}")
        for i in range(cfg.steps):
            run.step(i)
            if on_step:
                on_step(name, i, run.record)
        result.runs.append(run.close())
    return result


@contextlib.contextmanager
def progress_bar(total: int, quiet: bool = False):
    """A rich progress bar on stderr (none when ``quiet`` or stderr is no terminal); yields the
    ``on_step`` callback of :func:`run_rl`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    ) as progress:
        task = progress.add_task("rl", total=total)

        def on_step(name: str, step: int, rec: RunRecord) -> None:
            desc = f"{name}: step {step + 1}, reward {rec.reward[-1]:.3f}, gap {rec.gap[-1]:.1e}"
            progress.update(task, advance=1, description=desc)

        yield on_step
