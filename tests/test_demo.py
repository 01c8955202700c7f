"""``python -m truefuse demo`` at a tiny size, in-process, with stand-in patches for apply_truefuse:
the identity (must give stock's curve bit for bit) and a deliberate perturbation (must be reported)."""

from __future__ import annotations

import functools
import io
import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from truefuse.demo import data as demo_data  # noqa: E402
from truefuse.demo.report import print_table, speed_note, summarize, to_json, write  # noqa: E402
from truefuse.demo.train import make_config, run_demo  # noqa: E402

TINY = dict(hidden=32, layers=2, heads=4, kv_heads=2, vocab=300, seq=32, batch=2, steps=6, corpus_bytes=64 << 10)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def identity(model):
    return "identity stand-in (no change)"


def perturb(model):
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)  # final norm x2: every logit changes from step 0
    return "perturbing stand-in"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo_cache")


@pytest.fixture(scope="module")
def demo(cache_dir, tmp_path_factory):
    cfg = make_config("cpu", device="cpu", **TINY)
    result = run_demo(cfg, {"identity": identity, "perturbed": perturb}, cache_dir=str(cache_dir), quiet=True)
    rows = summarize(result)
    out = tmp_path_factory.mktemp("demo_out")
    paths = write(result, rows, out)
    return result, rows, paths


def test_corpus_is_the_stdlib_in_a_fixed_order():
    corpus = demo_data.load_corpus(64 << 10)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert Path(corpus.root) == root
    assert corpus.n_bytes == 64 << 10  # the budget, exactly (the last file cut)
    assert all(f.endswith(".py") and (root / f).is_file() for f in corpus.files)
    assert corpus.files == sorted(corpus.files)
    text = "".join(corpus.texts)
    assert "def " in text and "import " in text and "return" in text
    # whole files up to the last one: the first file's text is that file's source
    assert corpus.texts[0] == (root / corpus.files[0]).read_text(encoding="utf-8")
    assert demo_data.load_corpus(64 << 10).sha256 == corpus.sha256


def test_tokenizer_round_trips_and_is_cached(cache_dir):
    corpus = demo_data.load_corpus(64 << 10)
    tok = demo_data.tokenize_corpus(corpus, 300, cache_dir)
    assert tok.vocab_size == 300
    sample = corpus.texts[-1][:2000] + "\n    # ünïcödé → ok\n"
    ids = tok.tokenizer.encode(sample).ids
    assert len(ids) < len(sample.encode())  # merges learned: fewer tokens than bytes
    assert tok.tokenizer.decode(ids) == sample
    assert int((tok.tokens == tok.eos_id).sum()) == len(corpus.files)  # one separator per file
    again = demo_data.tokenize_corpus(corpus, 300, cache_dir)
    assert again.cached and again.key == tok.key
    assert torch.equal(again.tokens, tok.tokens)
    other = demo_data.tokenize_corpus(corpus, 320, cache_dir)
    assert other.key != tok.key and other.vocab_size == 320


def test_batches_fixed_by_the_seed():
    tokens = torch.arange(10_000)
    a = demo_data.make_batches(tokens, 5, 3, 16, seed=0)
    assert a.shape == (5, 3, 16)
    assert torch.equal(a, demo_data.make_batches(tokens, 5, 3, 16, seed=0))
    assert not torch.equal(a, demo_data.make_batches(tokens, 5, 3, 16, seed=1))
    assert torch.equal(a[..., 1:] - a[..., :-1], torch.ones(5, 3, 15, dtype=a.dtype))  # contiguous windows
    assert len({int(w[0]) for w in a.view(-1, 16)}) == 15  # no window twice while the stream lasts


def test_runs_share_init_and_batches(demo):
    result, rows, _ = demo
    stock, ident, pert = result.runs
    assert [r.name for r in result.runs] == ["stock", "identity", "perturbed"]
    assert len(stock.losses) == TINY["steps"]
    assert all(math.isfinite(v) for v in stock.losses)
    assert abs(stock.losses[0] - math.log(result.model_config["vocab_size"])) < 0.5  # random init: ~ln(V)
    assert ident.losses[0] == stock.losses[0]  # same weights, same first batch: the same loss, exactly
    assert ident.losses == stock.losses  # and the identity patch gives the whole curve bit for bit
    assert ident.patch_report == "identity stand-in (no change)"
    by = {r["run"]: r for r in rows}
    assert by["identity"]["max_abs_diff_vs_stock"] == 0.0 and by["identity"]["verdict"] == "identical"


def test_perturbed_run_reported_as_differing(demo):
    result, rows, _ = demo
    by = {r["run"]: r for r in rows}
    assert by["perturbed"]["step0_diff_vs_stock"] > 0
    assert by["perturbed"]["max_abs_diff_vs_stock"] > result.config.tol
    assert by["perturbed"]["verdict"] == "DIFFERS"


def test_sequential_schedule_gives_the_same_curves(demo, cache_dir):
    # CUDA runs one run after the other, the CPU interleaves them: the curves must not care
    interleaved, _, _ = demo
    assert interleaved.config.schedule == "interleaved"
    cfg = make_config("cpu", device="cpu", schedule="sequential", **TINY)
    result = run_demo(cfg, {"identity": identity}, cache_dir=str(cache_dir), quiet=True)
    assert result.config.schedule == "sequential"
    assert result.runs[0].losses == interleaved.runs[0].losses
    assert result.runs[1].losses == interleaved.runs[1].losses


def test_table_json_and_png(demo):
    result, rows, (jpath, ppath) = demo
    from rich.console import Console

    console = Console(record=True, width=200, file=io.StringIO())
    print_table(result, rows, console)
    table = console.export_text()
    for header in ("final loss", "max |Δloss| vs stock", "step ms", "tokens/s", "peak GiB", "speedup", "n/a", "DIFFERS"):
        assert header in table, header
    for r in rows:
        for key in ("final_loss", "max_abs_diff_vs_stock", "mean_step_s", "tokens_per_s", "speedup_vs_stock"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["run"], key)
        assert r["peak_mem_bytes"] is None  # the CPU: n/a, not a made-up number
    assert rows[0]["speedup_vs_stock"] == 1.0
    assert rows[1]["tokens_per_s"] == pytest.approx(TINY["batch"] * TINY["seq"] / rows[1]["mean_step_s"])
    saved = json.loads(jpath.read_text())
    assert saved == json.loads(json.dumps(to_json(result, rows)))
    assert saved["data"]["source"].startswith("Python standard library") and saved["data"]["tokenizer_vocab"] == 300
    assert [r["run"] for r in saved["runs"]] == ["stock", "identity", "perturbed"]
    assert saved["runs"][2]["verdict"] == "DIFFERS" and len(saved["runs"][0]["losses"]) == TINY["steps"]
    assert "n/a" in saved["memory_note"]
    raw = ppath.read_bytes()
    assert raw[:8] == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(ppath)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    assert img[..., :3].std() > 0.05  # something drawn, not a blank canvas


def test_cpu_caption_says_why_speed_is_not_the_point(demo, monkeypatch):
    """On the CPU truefuse runs its reference path (unfused PyTorch), so the table must say that its
    speed there is not what the demo shows (issue 31: 0.85-0.90x stock with no word why)."""
    from rich.console import Console

    from truefuse.demo import report

    result, rows, _ = demo
    for interpret, words in ((False, "reference path"), (True, "interpreter")):
        monkeypatch.setattr(report, "get_config", lambda i=interpret: SimpleNamespace(triton_interpret=i))
        console = Console(record=True, width=400, file=io.StringIO())
        print_table(result, rows, console)
        caption = " ".join(console.export_text().split())  # rich wraps the caption
        assert "not the point on the CPU" in caption and words in caption and "GPU run" in caption
    assert speed_note(SimpleNamespace(config=SimpleNamespace(device="cuda"))) == ""


def test_cli_end_to_end(monkeypatch, tmp_path, cache_dir, capsys):
    from truefuse.__main__ import main
    from truefuse.demo import cli

    monkeypatch.setattr(cli, "truefuse_patch", lambda: identity)
    argv = ["demo", "--device", "cpu", "--hidden", "32", "--layers", "1", "--vocab", "300", "--seq", "16", "--batch", "1"]
    argv += ["--steps", "2", "--corpus-bytes", str(64 << 10), "--cache-dir", str(cache_dir), "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "truefuse" in out and "identical" in out and "results.json" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["layers"] == 1 and saved["config"]["steps"] == 2
    assert (tmp_path / "demo.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_calls_apply_truefuse():
    hf = pytest.importorskip("truefuse.integrations.huggingface")
    from truefuse.demo import cli

    assert cli.truefuse_patch() is hf.apply_truefuse


def test_cli_without_transformers_says_how_to_install(monkeypatch, capsys):
    from truefuse.__main__ import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert main(["demo", "--device", "cpu"]) == 2
    assert "pip install truefuse[hf]" in capsys.readouterr().err


def test_liger_peer_missing_is_a_clear_exit(monkeypatch, capsys):
    from truefuse.__main__ import main
    from truefuse.demo import cli

    monkeypatch.setattr(cli, "truefuse_patch", lambda: identity)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    assert main(["demo", "--device", "cpu", "--peer", "liger"]) == 2
    assert "liger-kernel" in capsys.readouterr().err


def test_import_truefuse_does_not_import_transformers():
    # parity_cli: every CLI command's parser imports it (its arguments), `verify` and `info` included
    code = "import sys, truefuse, truefuse.demo, truefuse.demo.cli, truefuse.demo.parity_cli; "
    code += "print('transformers' in sys.modules, 'tokenizers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["False", "False"]


def test_peers_apart_run_alone_after_the_interleaved_runs(demo, cache_dir, monkeypatch):
    """``apart`` (the CLI's batch-invariant run): its steps all come after the interleaved runs',
    the result keeps the runs' order, the curves are the interleaved demo's."""
    from truefuse.demo import train

    interleaved, _, _ = demo
    order = []
    real = train.Trainer.step
    monkeypatch.setattr(train.Trainer, "step", lambda self, ids: order.append(self.name) or real(self, ids))
    cfg = make_config("cpu", device="cpu", **TINY)
    peers = {"perturbed": perturb, "identity": identity}
    result = run_demo(cfg, peers, cache_dir=str(cache_dir), quiet=True, apart=("perturbed",))
    steps = TINY["steps"]
    assert order == ["stock", "identity"] * steps + ["perturbed"] * steps
    assert [r.name for r in result.runs] == ["stock", "perturbed", "identity"]
    by = {r.name: r.losses for r in result.runs}
    assert all(by[r.name] == r.losses for r in interleaved.runs)
    with pytest.raises(ValueError, match="apart names no peer: nobody"):
        run_demo(cfg, peers, cache_dir=str(cache_dir), quiet=True, apart=("nobody",))


def test_cli_runs_the_batch_invariant_peer_apart(monkeypatch):
    from truefuse.demo import cli

    seen = {}
    monkeypatch.setattr(cli, "truefuse_patch", lambda: identity)
    monkeypatch.setattr(cli, "truefuse_bi_patch", lambda: identity)

    def fake_run_demo(cfg, peers, apart=(), **kw):
        seen.update(peers=list(peers), apart=tuple(apart))
        raise SystemExit(0)

    monkeypatch.setattr("truefuse.demo.train.run_demo", fake_run_demo)
    from truefuse.__main__ import main

    with pytest.raises(SystemExit):
        main(["demo", "--device", "cpu", "--batch-invariant", "--steps", "1", "--quiet"])
    assert seen == {"peers": ["truefuse", "stock again", "truefuse BI"], "apart": ("truefuse BI",)}


def test_cuda_graphs_refused_off_cuda_and_with_ranks(capsys):
    """``--cuda-graphs`` captures the step on a GPU in one process: on the CPU or under FSDP2 it is a
    clear error before anything is built."""
    with pytest.raises(ValueError, match="cuda_graphs needs device cuda and one process"):
        make_config("cpu", device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs needs device cuda and one process"):
        make_config("gpu", device="cuda", world_size=2, cuda_graphs=True)
    assert make_config("gpu", device="cuda", cuda_graphs=True).cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs needs timing_warmup >= 2"):
        make_config("gpu", device="cuda", cuda_graphs=True, timing_warmup=1)  # the capture would be timed
    from truefuse.__main__ import main

    assert main(["demo", "--device", "cpu", "--cuda-graphs", "--steps", "1"]) == 2
    assert "cuda_graphs needs device cuda" in capsys.readouterr().err


def test_truefuse_adamw_run_steps_with_truefuse_optimizer(cache_dir, monkeypatch):
    """``--truefuse-adamw`` adds a run that steps with ``truefuse.optim.AdamW``: its curve is stock's
    within the demo's tolerance (fp32 on the CPU, the optimizer's kernel under the interpreter)."""
    from truefuse.demo import cli
    from truefuse.demo import train as demo_train
    from truefuse.optim import AdamW

    used = []
    real = AdamW.step
    monkeypatch.setattr(AdamW, "step", lambda self, *a, **k: used.append(1) or real(self, *a, **k))
    cfg = make_config("cpu", device="cpu", **{**TINY, "steps": 3})
    adamw_identity = functools.partial(identity)
    adamw_identity.optimizer = cli._apply_truefuse_adamw.optimizer  # the --truefuse-adamw run's optimizer, no patch
    result = demo_train.run_demo(cfg, {"identity adamw": adamw_identity}, cache_dir=str(cache_dir), quiet=True)
    stock, ours = result.runs
    assert len(used) == 3  # every step went through truefuse's optimizer
    assert max(abs(a - b) for a, b in zip(stock.losses, ours.losses, strict=True)) <= cfg.tol


def test_cuda_graphs_with_liger_adds_its_graphable_run(monkeypatch):
    """``--cuda-graphs --peer liger``: Liger's own step stays eager (its loss reads the host), so a
    second Liger run without its fused loss, which a graph can capture, runs beside it, last."""
    from truefuse.demo import cli, needs

    seen = {}
    monkeypatch.setattr(needs, "device", lambda want: ("cuda", None))
    monkeypatch.setattr(cli, "truefuse_patch", lambda: identity)
    monkeypatch.setattr(cli, "liger_patch", lambda: cli._apply_liger)

    def fake_run_demo(cfg, peers, apart=(), **kw):
        seen.update(peers={k: getattr(v, "reads_host", None) for k, v in peers.items()}, graphs=cfg.cuda_graphs)
        raise SystemExit(0)

    monkeypatch.setattr("truefuse.demo.train.run_demo", fake_run_demo)
    from truefuse.__main__ import main

    with pytest.raises(SystemExit):
        main(["demo", "--cuda-graphs", "--peer", "liger", "--steps", "1", "--quiet"])
    assert seen["graphs"] and list(seen["peers"]) == ["truefuse", "liger", "liger, no fused loss"]
    assert seen["peers"]["liger"] is not None and seen["peers"]["liger, no fused loss"] is None


def test_cuda_graphs_capture_is_an_untimed_step(monkeypatch, cache_dir):
    """``--cuda-graphs``: the step that captures (slow: seconds for the GPU preset) is one of the
    ``timing_warmup`` steps the mean step time leaves out; each timed step is a replay. A stand-in
    for ``graph_step`` (the CPU cannot capture) records the step index of the capture."""
    from dataclasses import replace

    import truefuse.integrations.cuda_graph as cg

    captures: list[int] = []
    steps = [0]

    class _Stand:
        def __init__(self, step, *, warmup, pool=None, packed_sequences=True):
            assert packed_sequences is False  # the demo feeds no position_ids: eager's causal skip under capture
            self.step, self.warmup, self.calls = step, warmup, 0

        def __call__(self, *inputs):
            self.calls += 1
            if self.calls == self.warmup + 1:  # graph_step's capture call
                captures.append(steps[0])
            steps[0] += 1
            return self.step(*inputs)

    monkeypatch.setattr(cg, "graph_step", _Stand)
    cfg = replace(make_config("cpu", device="cpu", **TINY), cuda_graphs=True)  # past make_config's CUDA check
    result = run_demo(cfg, {}, cache_dir=str(cache_dir), quiet=True)
    assert captures and captures[0] < cfg.timing_warmup, f"captured at step {captures}, timed from {cfg.timing_warmup}"
    assert len(result.runs[0].step_s) == cfg.steps


def test_cli_adds_the_fusions_run(monkeypatch):
    from truefuse.demo import cli

    seen = {}
    monkeypatch.setattr(cli, "truefuse_patch", lambda: identity)

    def fake_run_demo(cfg, peers, apart=(), **kw):
        seen.update(peers=peers)
        raise SystemExit(0)

    monkeypatch.setattr("truefuse.demo.train.run_demo", fake_run_demo)
    from truefuse.__main__ import main

    with pytest.raises(SystemExit):
        main(["demo", "--device", "cpu", "--fusions", "--steps", "1", "--quiet"])
    assert list(seen["peers"]) == ["truefuse", "truefuse fused"]
    assert seen["peers"]["truefuse fused"].optimizer == "truefuse"
    with pytest.raises(SystemExit):  # with --batch-invariant: the fusions in that mode too
        main(["demo", "--device", "cpu", "--fusions", "--batch-invariant", "--steps", "1", "--quiet"])
    assert list(seen["peers"]) == ["truefuse", "truefuse fused", "stock again", "truefuse BI", "truefuse BI fused"]
    assert seen["peers"]["truefuse BI fused"].optimizer == "truefuse"


@pytest.mark.slow  # ~20 s on CI's 2 cores: the fusions' own tests are tests/hf/test_sibling_grads.py, test_residual_norm.py
def test_fusions_run_keeps_stocks_curve(cache_dir):
    """``--fusions``: truefuse with the residual add + norm and sibling-projection fusions and
    truefuse's AdamW, its curve stock's within the demo's tolerance (fp32 on the CPU)."""
    from truefuse.demo import cli
    from truefuse.demo import train as demo_train
    from truefuse.integrations.huggingface import sibling_grads

    cfg = make_config("cpu", device="cpu", **{**TINY, "steps": 3})
    seen = []

    def fused(model):
        report = cli._apply_truefuse_fusions(model)
        seen.append(sum(1 for m in model.modules() if type(m) is sibling_grads.member_class()))
        return report

    fused.optimizer = cli._apply_truefuse_fusions.optimizer
    result = demo_train.run_demo(cfg, {"truefuse fused": fused}, cache_dir=str(cache_dir), quiet=True)
    stock, ours = result.runs
    assert seen and seen[0] == 5 * cfg.layers  # q/k/v and gate/up of every layer
    assert max(abs(a - b) for a, b in zip(stock.losses, ours.losses, strict=True)) <= cfg.tol
