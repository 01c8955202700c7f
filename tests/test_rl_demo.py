"""``python -m truefuse rl`` at a tiny size (CPU, seconds): batch-invariant mode's sampler and trainer
agree bit for bit on every step, the runs start from the same weights and draw the same samples,
the outputs are written, the task's pieces do what they say, and bad settings are refused."""

from __future__ import annotations

import io
import json
from argparse import Namespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from truefuse.demo import rl  # noqa: E402
from truefuse.demo.rl_report import bi_exact, print_table, summarize, write  # noqa: E402

TINY = dict(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, prompts=4, group=4, steps=3)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def torch_paths():
    """truefuse's ops on their PyTorch paths (the Triton interpreter off, 87 s -> seconds): the
    kernels' own numerics and row invariance are tested op by op; here it is the demo's loop."""
    import dataclasses
    import importlib

    from truefuse.config import get_config

    plain = dataclasses.replace(get_config(), triton_interpret=False)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("_launch.triton", "gemm.gemm_backends.triton", "attention.attention", "rope"):
            mp.setattr(importlib.import_module(f"truefuse.ops.{name}"), "get_config", lambda: plain)
        yield


@pytest.fixture(scope="module")
def tiny(torch_paths):
    cfg = rl.make_config("cpu", **TINY)
    result = rl.run_rl(cfg, ["stock", "truefuse BI"])
    return result, summarize(result)


def test_batch_invariant_sampler_equals_trainer_every_step(tiny):
    result, rows = tiny
    bi = next(r for r in result.runs if r.name == "truefuse BI")
    assert len(bi.gap) == TINY["steps"]
    assert all(t > 0 for t in bi.tokens)  # the gap was taken over some tokens
    assert bi.gap == [0.0] * TINY["steps"]
    assert bi.differing == [0] * TINY["steps"]
    assert bi_exact(rows)


def test_runs_start_from_the_same_weights_and_samples(tiny):
    result, rows = tiny
    stock, bi = result.runs
    assert stock.params_sha256 == bi.params_sha256  # the patch keeps every parameter's bits
    assert stock.samples_sha256[0] == bi.samples_sha256[0]  # same seeds, same first draw
    assert stock.reward[0] == bi.reward[0]
    assert rows[1]["samples_differ_from_step"] != 0


def test_table_json_and_plot_are_written(tiny, tmp_path):
    result, rows = tiny
    from rich.console import Console

    buf = io.StringIO()
    print_table(result, rows, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "truefuse BI" in text and "stock" in text and "0 (bitwise)" in text
    jpath, png = write(result, rows, tmp_path / "out")
    assert png.read_bytes()[:8] == PNG_MAGIC
    data = json.loads(jpath.read_text())
    assert [r["run"] for r in data["runs"]] == ["stock", "truefuse BI"]
    for run, rec in zip(data["runs"], result.runs, strict=True):
        steps = run["steps"]
        for key in ("reward", "gap", "differing", "tokens", "step_s", "generate_s", "train_s"):
            assert len(steps[key]) == TINY["steps"], key
        assert steps["reward"] == rec.reward
        assert all(0.0 <= r <= 1.0 for r in steps["reward"])
    assert data["config"]["group"] == TINY["group"]


def test_gap_sees_a_sampler_trainer_mismatch(monkeypatch):
    """The measurement is live: shift the sampler's log-probs by 1e-3 and the gap says so."""
    real = rl.generate_log_probs

    def shifted(*args, **kwargs):
        out = real(*args, **kwargs)
        return out._replace(log_probs=out.log_probs + 1e-3)

    monkeypatch.setattr(rl, "generate_log_probs", shifted)
    cfg = rl.make_config("cpu", **dict(TINY, steps=1))
    rec = rl.run_rl(cfg, ["stock"]).runs[0]
    assert rec.gap[0] == pytest.approx(1e-3, rel=1e-3)
    assert rec.differing[0] == rec.tokens[0] > 0


def test_prompts_are_left_padded_sums_repeated_per_group():
    cfg = rl.make_config("cpu", prompts=32, group=3, digits=2)
    ids, mask, sums = rl.make_prompts(cfg, 5)
    assert ids.shape[0] == mask.shape[0] == len(sums) == 96
    assert len(set(mask.sum(1).tolist())) > 1  # lengths differ: left padding is exercised
    assert bool((mask[:, -1] == 1).all()) and bool((ids[mask == 0] == rl.PAD).all())
    for row, m, s in zip(ids.tolist(), mask.tolist(), sums, strict=True):
        body = [t for t, keep in zip(row, m, strict=True) if keep]
        assert body[0] == rl.BOS
        a, b = rl.decode(body[1:]).rstrip("=").split("+")
        assert int(a) + int(b) == s
    assert torch.equal(rl.make_prompts(cfg, 5)[0], ids)  # every run gets the same prompts
    assert not torch.equal(rl.make_prompts(cfg, 6)[0], ids)
    assert torch.equal(ids[0], ids[2]) and sums[0] == sums[2]


def test_reward_and_completion_mask():
    cfg = rl.make_config("cpu", digits=2)
    want = rl.answer_text(cfg, 57)
    assert want == "057"
    assert rl.reward(rl.encode("057"), want) == 1.0
    assert rl.reward(rl.encode("051"), want) == pytest.approx(2 / 3)
    assert rl.reward(rl.encode("05") + [rl.EOS], want) == pytest.approx(2 / 3)  # cut by EOS
    assert rl.reward([rl.EOS] + rl.encode("57"), want) == 0.0  # nothing before the EOS
    assert rl.reward([rl.PAD, rl.BOS, rl.PAD], want) == 0.0
    c = torch.tensor([[5, rl.EOS, rl.PAD, rl.PAD], [5, 6, 7, 8], [rl.EOS, rl.PAD, rl.EOS, rl.PAD], [rl.PAD, 4, rl.EOS, 1]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    assert torch.equal(rl.completion_mask(c), expected)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("group", 1),
        ("prompts", 0),
        ("steps", 0),
        ("digits", 0),
        ("digits", 7),
        ("temperature", 0.0),
        ("temperature", float("nan")),
        ("lr", -1.0),
        ("clip_eps", 1.5),
        ("dtype", "fp16"),
        ("heads", 3),
        ("colour", 1),
    ],
)
def test_bad_settings_name_the_setting(setting, value):
    with pytest.raises(ValueError, match=setting):
        rl.make_config("cpu", **{setting: value})


def test_bad_size_and_runs_are_refused():
    with pytest.raises(ValueError, match="size"):
        rl.make_config("huge")
    with pytest.raises(ValueError, match="runs"):
        rl.run_rl(rl.make_config("cpu", **TINY), ["stock", "vllm"])


def test_cli_refuses_a_bad_setting_with_status_2(capsys, tmp_path):
    from truefuse.demo.rl_cli import main

    args = Namespace(device="cpu", dtype=None, steps=1, hidden=None, layers=None, digits=None, prompts=None, group=1)
    args.__dict__.update(lr=None, temperature=None, seed=None, fast=False, out=str(tmp_path), quiet=True)
    assert main(args) == 2
    assert "group" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_graphed_generate_is_refused_off_cuda():
    with pytest.raises(ValueError, match="graphed generate needs device cuda"):
        rl.make_config("cpu", graphed=True)


def test_graphed_generate_draws_the_same_samples(tiny, fake_cuda):
    """``--graphed-generate`` (graph_decode; a CPU stand-in for the graphs here): every run draws the
    completions its eager sampler drew, step by step, and BI's sampler still equals its trainer."""
    import dataclasses

    result, _ = tiny
    graphed = rl.run_rl(dataclasses.replace(rl.make_config("cpu", **TINY), graphed=True), ["stock", "truefuse BI"])
    for eager, run in zip(result.runs, graphed.runs, strict=True):
        assert run.samples_sha256 == eager.samples_sha256, run.name
        assert run.graphs["captures"] >= 1 and run.graphs["replays"] >= TINY["steps"], run.graphs
    assert graphed.runs[1].gap == [0.0] * TINY["steps"]
