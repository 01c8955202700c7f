"""The command line: verify's table and exit codes, info's plans, bench's files."""

import json

import pytest
import torch

from truefuse.__main__ import main
from truefuse.testing import BoundedReport
from truefuse.verify import registry


def test_verify_cpu_all_pass(capsys):
    assert main(["verify", "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "wgrad_bgrad_dgelu_split_bf16/grad_bias" in out and "FAIL" not in out
    n_cases = len(registry.all_cases(["gemm"], "cpu"))
    passed = int(out.strip().splitlines()[-1].split()[0])
    assert passed >= n_cases  # one row per reported tensor, at least one per case


@pytest.fixture
def failing_case():
    @registry.register("selftest", "always_fails", "bounded")
    def _fail(device):
        return {"": BoundedReport(1.0, 0.1, 10.0, 1.0, 1.0, False)}

    @registry.register("selftest", "raises", "bitwise")
    def _raise(device):
        raise RuntimeError("boom")

    yield
    registry._CASES[:] = [c for c in registry._CASES if c.op != "selftest"]


def test_verify_fails_on_a_failing_case(failing_case, capsys):
    assert main(["verify", "--device", "cpu", "--op", "selftest", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "always_fails" in out and "RuntimeError: boom" in out and "0 passed, 2 failed" in out


def test_verify_unknown_op(capsys):
    assert main(["verify", "--device", "cpu", "--op", "nope"]) == 2
    assert "--op 'nope' is not registered" in capsys.readouterr().err


def test_info_shows_tables_and_plans(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GEMM backend 'torch' on cpu" in out
    # CPU torch has no addmm(out_dtype=fp32): the plan must say it upcasts
    line = next(ln for ln in out.splitlines() if "wgrad, bf16 -> fp32 main_grad (beta=1)" in ln)
    assert "split out_dtype" in line


def test_bench_writes_json_and_png(tmp_path, capsys):
    assert main(["bench", "gemm", "--quick", "--out", str(tmp_path), "--providers", "bf16_gemm", "fp32_accumulate"]) == 0
    data = json.loads((tmp_path / "gemm_wgrad.json").read_text())
    provs = [r["provider"] for r in data["rows"]]
    assert provs == ["bf16_gemm", "fp32_accumulate"]
    assert data["rows"][0]["ratio"] == 1.0 and data["rows"][1]["ms"] > 0
    assert data["meta"]["torch"] == torch.__version__
    assert (tmp_path / "gemm_wgrad.png").stat().st_size > 1000


def test_bench_unknown_provider(tmp_path, capsys):
    assert main(["bench", "gemm", "--quick", "--out", str(tmp_path), "--providers", "cublas9000"]) == 2
    assert "unknown ['cublas9000']" in capsys.readouterr().err
