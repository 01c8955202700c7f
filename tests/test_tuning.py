"""The tuning knobs (``truefuse.config.Tuning``) and their scoped override ``truefuse.config.tuning``:
an override changes what the ops do, is undone after the block (also after an exception), and a
bad name or value raises before anything changes."""

import dataclasses

import pytest
import torch

import truefuse
from truefuse.config import Tuning, get_tuning, knob_docs, tuning
from truefuse.ops.lm_head.chunked_head_gemms import vocab_split
from truefuse.ops.norm.norm import use_kernel
from truefuse.verify.cases_linear_cross_entropy import make_inputs

KNOBS = (
    "chunk_bytes",
    "slice_bytes",
    "align",
    "min_macs",
    "two_stage_bytes",
    "two_stage_bytes_other",
    "push_max_bytes",
    "ll_max_bytes",
    "programs_per_sm",
    "maxp",
    "hf_norm_stock_numel",
    "max_kernel_n",
)


def _chunks(monkeypatch, N, V, H, **kw) -> list[int]:
    """Rows of each chunk the public ``truefuse.linear_cross_entropy`` runs (default chunk_size) on
    an fp32 (N, H) input and a (V, H) weight: the forward's per-chunk ``vocab_split`` calls, spied."""
    import truefuse.ops.lm_head.chunked_head as head_mod

    rows = []
    monkeypatch.setattr(head_mod, "vocab_split", lambda xc, v, *bi: rows.append(xc.shape[0]) or vocab_split(xc, v, *bi))
    x, W, t, _ = make_inputs(torch.float32, torch.device("cpu"), N=N, H=H, V=V, ignore="none")
    with torch.no_grad():  # no weight gradient: the budget is chunk_bytes alone
        truefuse.linear_cross_entropy(x, W, t, **kw)
    return rows


def test_knobs_and_defaults():
    t = get_tuning()
    assert tuple(f.name for f in dataclasses.fields(Tuning)) == KNOBS
    assert t == Tuning()
    assert (t.chunk_bytes, t.align, t.min_macs) == (512 << 20, 64, 1 << 32)
    assert (t.push_max_bytes, t.ll_max_bytes, t.programs_per_sm, t.maxp, t.max_kernel_n, t.hf_norm_stock_numel) == (
        256 << 10,
        128 << 10,
        2,
        512,
        16384,
        1 << 18,
    )
    assert [t.two_stage_threshold(w) for w in (2, 4, 8, 3)] == [1 << 30, 1 << 20, 512 << 10, 512 << 10]
    assert all(len(d) > 20 and "\n" not in d for d in knob_docs().values())
    assert list(knob_docs()) == list(KNOBS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.chunk_bytes = 1


def test_override_changes_the_default_chunk_and_is_restored(monkeypatch):
    """64 tokens x V = 256 fp32 = 64 KiB of logits: one chunk by default; with a 16 KiB budget,
    chunks of 16 tokens (the largest power of two whose logits fit)."""
    assert _chunks(monkeypatch, 64, 256, 8) == [64]
    with tuning(chunk_bytes=16 << 10) as inside:
        assert inside is get_tuning() and inside.chunk_bytes == 16 << 10
        assert inside.align == 64  # the knobs not named keep their values
        assert _chunks(monkeypatch, 64, 256, 8) == [16, 16, 16, 16]
        with tuning(chunk_bytes=32 << 10):  # nested: the inner one wins, then the outer comes back
            assert _chunks(monkeypatch, 64, 256, 8) == [32, 32]
        assert get_tuning().chunk_bytes == 16 << 10
    assert get_tuning() == Tuning()
    assert _chunks(monkeypatch, 64, 256, 8) == [64]
    assert _chunks(monkeypatch, 64, 256, 8, chunk_size=8) == [8] * 8  # an explicit chunk_size ignores it


def test_override_reaches_other_readers():
    x = torch.randn(2, 4096)
    assert use_kernel(x) == use_kernel(torch.randn(2, 64))  # within max_kernel_n: as any small row
    with tuning(max_kernel_n=1024):
        assert not use_kernel(x)
    from truefuse.ops.allreduce import default_two_stage_bytes

    with tuning(two_stage_bytes={4: 1 << 10, 16: 2 << 10}, two_stage_bytes_other=3 << 10):
        assert [default_two_stage_bytes(w) for w in (2, 4, 16, 3)] == [1 << 30, 1 << 10, 2 << 10, 3 << 10]
    assert [default_two_stage_bytes(w) for w in (4, 16)] == [1 << 20, 512 << 10]


def test_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"):
        with tuning(align=8, min_macs=1):
            assert (get_tuning().align, get_tuning().min_macs) == (8, 1)
            raise RuntimeError("inside")
    assert get_tuning() == Tuning()


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"chunk_byte": 1}, r"unknown tuning knob 'chunk_byte'; known knobs: chunk_bytes, slice_bytes, align, .*max_kernel_n"),
        ({"align": 8, "MAXP": 1, "x": 2}, r"unknown tuning knobs 'MAXP', 'x'"),
        ({"chunk_bytes": 0}, r"chunk_bytes=0: it must be a positive int"),
        ({"align": 8, "maxp": -1}, r"maxp=-1"),
        ({"min_macs": 1.5}, r"min_macs=1.5"),
        ({"programs_per_sm": True}, r"programs_per_sm=True"),
        ({"ll_max_bytes": "128K"}, r"ll_max_bytes='128K'"),
        ({"two_stage_bytes": {4: 0}}, r"two_stage_bytes=\{4: 0\}"),
        ({"two_stage_bytes": 5}, r"two_stage_bytes=5"),
    ],
)
def test_bad_names_and_values_raise_before_anything_changes(overrides, match):
    entered = False
    with pytest.raises(ValueError, match=match):
        with tuning(**overrides):
            entered = True
    assert not entered
    assert get_tuning() == Tuning()
    with pytest.raises(ValueError, match=match):
        tuning(**overrides)  # at the call, before any `with`


def test_info_prints_the_knobs(capsys):
    from truefuse.info import print_info, tuning_rows

    rows = {r[0]: r[1:3] for r in tuning_rows()}
    assert list(rows) == list(KNOBS)
    assert rows["chunk_bytes"] == ("536870912 (512MiB)", "")  # "": the default
    assert rows["two_stage_bytes"] == ("2: 1GiB, 4: 1MiB, 8: 512KiB", "")
    with tuning(chunk_bytes=3 << 20):
        assert {r[0]: r[1:3] for r in tuning_rows()}["chunk_bytes"] == ("3145728 (3MiB)", "536870912 (512MiB)")
        print_info()
    out = capsys.readouterr().out
    for name in KNOBS:
        assert f"│ {name} " in out, name
    assert "│ 3145728 (3MiB) " in out
