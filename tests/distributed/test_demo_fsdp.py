"""``python -m truefuse demo --world-size 2`` on gloo (truefuse/demo/fsdp.py): stock and apply_truefuse
under FSDP2 at a tiny size, one spawn of 2 ranks for every check (a spawn costs each rank torch's and
transformers' imports).

* truefuse's curve follows stock's within the demo's tolerance, with the fused loss (no fallback);
* the ranks train on disjoint rows and report one global loss: the same value on every rank, the mean
  of their own losses, and the whole curve that one process gets on the whole batch;
* --profile writes each run's top table and trace.

The ranks run truefuse's reference path (TRITON_INTERPRET=0), as the CPU demo does: the
interpreter took ~60 s a step here, and the kernels have their own tests.
"""

from __future__ import annotations

import contextlib
import json
import math
import traceback
import warnings
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from truefuse.demo.profile import SYNC_MESSAGE, call_site, sync_warnings, top_syncs  # noqa: E402
from truefuse.demo.train import make_config  # noqa: E402

TINY = dict(hidden=32, layers=2, heads=4, kv_heads=2, vocab=300, seq=32, batch=2, steps=3, corpus_bytes=64 << 10)
WORLD = 2


def _argv(out, cache_dir, profile) -> list[str]:
    argv = ["demo", "--device", "cpu", "--world-size", str(WORLD), "--quiet", "--out", str(out), "--cache-dir", str(cache_dir)]
    argv += ["--profile", str(profile), "--sync-debug"]
    for k, v in TINY.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


#: the tests of the 2-rank spawn (~27 s of the 2 CI cores, the suite's longest): marked slow, run by
#: ``pytest -m ""`` and scripts/gpu_check.sh. CI keeps what they would catch first: FSDP2 + apply_truefuse
#: against stock (tests/distributed/test_fsdp.py) and the demo's per-rank pieces (this file's unit tests)
_SPAWN = pytest.mark.slow


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    from truefuse.__main__ import main

    root = tmp_path_factory.mktemp("demo_fsdp")
    out, cache_dir, profile = root / "out", root / "cache", root / "profile"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # the spawned ranks read it at import
        rc = main(_argv(out, cache_dir, profile))
    return rc, json.loads((out / "results.json").read_text()), out, cache_dir, profile


@_SPAWN
def test_truefuse_follows_stock_with_the_fused_loss(fsdp_run):
    rc, saved, out, _, _ = fsdp_run
    assert rc == 0
    assert saved["config"]["world_size"] == WORLD and saved["config"]["fsdp_policy"] == "none"
    stock, tf = saved["runs"]
    assert [stock["run"], tf["run"]] == ["stock", "truefuse"]
    assert tf["verdict"] in ("identical", "within tol") and tf["max_abs_diff_vs_stock"] <= saved["config"]["tol"]
    assert "linear_cross_entropy" in tf["patch_report"]
    assert tf["extra"]["warnings"] == []  # lm_head in the root unit: no fallback to stock logits
    assert stock["tokens_per_s"] == pytest.approx(WORLD * TINY["batch"] * TINY["seq"] / stock["mean_step_s"])
    assert (out / "demo.png").read_bytes()[:4] == b"\x89PNG"


@_SPAWN
def test_ranks_report_one_global_loss(fsdp_run, tmp_path):
    _, saved, _, cache_dir, _ = fsdp_run
    for run in saved["runs"]:
        ranks = run["extra"]["ranks"]
        assert len(ranks) == WORLD
        assert all(r["losses"] == run["losses"] for r in ranks)  # every rank: the same bits
        for i, loss in enumerate(run["losses"]):
            local = [r["local_losses"][i] for r in ranks]
            assert loss == pytest.approx(sum(local) / WORLD, rel=1e-12)
        assert ranks[0]["local_losses"][0] != ranks[1]["local_losses"][0]  # disjoint rows
    # the global curve is one process's on the whole (WORLD x batch) batch: the rows are split, not repeated
    single = _one_process_curve(str(cache_dir))
    for run in saved["runs"]:
        assert run["losses"] == pytest.approx(single, rel=1e-5), run["run"]


def _one_process_curve(cache_dir: str) -> list[float]:
    from truefuse.demo.data import load_corpus, make_batches, tokenize_corpus
    from truefuse.demo.train import Trainer, initial_state, llama_config

    cfg = make_config("cpu", device="cpu", **TINY)  # one process, WORLD x batch rows a step (made here, not by the demo)
    data = tokenize_corpus(load_corpus(cfg.corpus_bytes), cfg.vocab, cache_dir)
    batches = make_batches(data.tokens, cfg.steps, WORLD * cfg.batch, cfg.seq, cfg.seed)
    model_config = llama_config(cfg, data.vocab_size)
    trainer = Trainer("stock", cfg, model_config, initial_state(cfg, model_config))
    return [trainer.step(batches[i]) for i in range(cfg.steps)]


@_SPAWN
def test_profile_files_and_syncs(fsdp_run, capsys):
    _, saved, _, _, profile = fsdp_run
    for run in saved["runs"]:
        files = run["extra"]["profile"]
        assert "Self CPU" in (profile / f"{run['run']}_top.txt").read_text()
        assert files["trace"].endswith(f"{run['run']}_trace.json.gz")
        assert run["extra"]["syncs"] is None  # counted on CUDA only
        assert len(run["losses"]) == len(run["step_s"]) == len(run["host_s"]) == TINY["steps"]  # extra steps left out
        assert all(0 < h <= s for h, s in zip(run["host_s"], run["step_s"], strict=True))


def _syncing_op(n: int) -> None:
    for _ in range(n):
        warnings.warn(f"{SYNC_MESSAGE} (stand-in)", UserWarning, stacklevel=1)


def test_sync_warnings_counted_by_site():
    with warnings.catch_warnings(record=True) as others, sync_warnings() as sites:
        _syncing_op(3)
        warnings.warn("something else", stacklevel=1)
    assert sum(sites.values()) == 3 and len(sites) == 1  # every one counted, not once per place
    (site,) = sites
    assert "test_demo_fsdp.py" in site and "(_syncing_op)" in site
    assert [str(w.message) for w in others] == ["something else"]  # other warnings pass through
    assert top_syncs({"a": 1, "b": 5, "c": 1}, 2) == [("b", 5), ("a", 1)]


def test_call_site_names_the_library_line_above():
    frames = [
        traceback.FrameSummary("/x/truefuse/demo/train.py", 10, "update"),
        traceback.FrameSummary("/v/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py", 20, "forward"),
        traceback.FrameSummary("/v/lib/python3.12/site-packages/torch/nn/functional.py", 30, "linear"),
        traceback.FrameSummary("/usr/lib/python3.12/warnings.py", 40, "warn"),
    ]
    assert call_site(frames) == "torch/nn/functional.py:30 (linear) <- transformers/models/llama/modeling_llama.py:20 (forward)"
    assert call_site(frames[:2]) == "transformers/models/llama/modeling_llama.py:20 (forward)"


@pytest.mark.parametrize(
    "given, dtype, policy",
    [
        ({}, "fp32", "none"),
        ({"dtype": "amp-bf16"}, "amp-bf16", "mp"),
        ({"dtype": "bf16"}, "bf16", "bf16"),
        ({"fsdp_policy": "mp"}, "amp-bf16", "mp"),
        ({"fsdp_policy": "bf16"}, "bf16", "bf16"),
        ({"fsdp_policy": "mp", "dtype": "fp32"}, "fp32", "mp"),
    ],
)
def test_policy_follows_dtype(given, dtype, policy):
    cfg = make_config("cpu", world_size=2, **given)
    assert (cfg.dtype, cfg.fsdp_policy) == (dtype, policy)
    assert cfg.tokens_per_step == 2 * cfg.batch * cfg.seq
    assert make_config("cpu").fsdp_policy == "none" and make_config("cpu").tokens_per_step == cfg.batch * cfg.seq


@pytest.mark.parametrize(
    "given, words",
    [
        ({"world_size": 2, "fsdp_policy": "bf16", "dtype": "amp-bf16"}, "not dtype 'amp-bf16'"),
        ({"world_size": 2, "fsdp_policy": "fp8"}, "unknown fsdp_policy"),
        ({"fsdp_policy": "mp"}, "need world_size >= 2"),
        ({"head_unit": True}, "need world_size >= 2"),
        ({"world_size": 0}, "world_size must be at least 1"),
    ],
)
def test_bad_settings_are_named(given, words):
    with pytest.raises(ValueError, match=words):
        make_config("cpu", **given)


def test_cli_refuses_profiling_without_ranks(capsys):
    from truefuse.__main__ import main

    assert main(["demo", "--device", "cpu", "--sync-debug"]) == 2
    assert "--world-size" in capsys.readouterr().err


@_SPAWN
def test_losses_are_finite(fsdp_run):
    assert all(math.isfinite(v) for run in fsdp_run[1]["runs"] for v in run["losses"])


def test_merge_takes_the_slowest_rank_and_drops_a_failed_peer():
    from truefuse.demo.fsdp import merge

    def rec(name, step_s, mem, local):
        return dict(
            name=name,
            losses=[1.0, 0.5],
            step_s=step_s,
            mem_bytes=mem,
            patch_report=None,
            n_params=7,
            setup_s=0.1,
            host_s=[0.01, 0.01],
            extra={"local_losses": local, "warnings": []},
        )

    rank0 = [rec("stock", [1.0, 3.0], [5, 1], [1.1, 0.6]), {"name": "liger", "failed": "Traceback: boom"}]
    rank1 = [rec("stock", [2.0, 1.0], [2, 9], [0.9, 0.4]), {"name": "liger", "failed": "Traceback: boom"}]
    runs, failed = merge([rank0, rank1])
    assert [r.name for r in runs] == ["stock"] and failed == {"liger": "Traceback: boom"}
    assert runs[0].step_s == [2.0, 3.0] and runs[0].mem_bytes == [5, 9]
    assert [r["local_losses"] for r in runs[0].extra["ranks"]] == [[1.1, 0.6], [0.9, 0.4]]


class _FakeTrainer:
    """A trainer whose training work syncs twice and whose step syncs once more around it."""

    cuda = True

    def __init__(self):
        self.result = SimpleNamespace(losses=[], step_s=[], host_s=[], mem_bytes=None)

    def update(self, ids):
        _syncing_op(2)
        return ids

    def step(self, ids):
        self.update(ids)
        _syncing_op(1)  # the demo's own (reading the loss)
        self.result.losses.append(1.0)
        return 1.0


def test_sync_debug_counts_the_training_work_only(monkeypatch):
    from truefuse.demo import profile

    @contextlib.contextmanager
    def on_cpu(enabled=True):
        with sync_warnings() as sites:
            yield sites

    monkeypatch.setattr(profile, "count_syncs", on_cpu)
    trainer = _FakeTrainer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the step's own sync, not counted
        sites = profile.after_run(trainer, torch.zeros(1, 2, 3), {"sync_debug": True}, rank=0)["syncs"]
    assert sum(sites.values()) == 2
    assert trainer.result.losses == []  # the extra step leaves the run's record alone
    assert "update" in type(trainer).__dict__ and "update" not in vars(trainer)  # the method is back
