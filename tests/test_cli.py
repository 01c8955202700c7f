"""The command line: verify's table and exit codes, info's plans, bench's files."""

import json
import os

import pytest
import torch

from truefuse.__main__ import main
from truefuse.testing import BoundedReport
from truefuse.verify import registry

#: ops whose test file runs every registered case itself (test_registered_cases), or the same case
#: functions over the same variants (tests/test_linear_modules.py: bounded, delayed, main_grad via
#: the registered bitwise cases): not run twice
_OWN_TESTS = {
    "linear_cross_entropy",
    "linear_cross_entropy_lean",
    "linear_log_probs",
    "gated_activation",
    "grouped_gemm",
    "rms_norm",
    "layer_norm",
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "attention",
}


_VERIFY_OPS = sorted({c.op for c in registry.all_cases(device="cpu")} - _OWN_TESTS)


def test_verify_covers_the_other_ops():
    assert "gemm" in _VERIFY_OPS and "GroupedLinear" in _VERIFY_OPS and len(_VERIFY_OPS) >= 5


# one op per test: the ops' cases spread over the suite's workers (one test of every op: 29 s on one CI core)
@pytest.mark.parametrize("op", _VERIFY_OPS)
def test_verify_cpu_all_pass(op, capsys):
    """``verify`` on the CPU passes for every op whose own tests do not run its cases already."""
    assert main(["verify", "--device", "cpu", "--quiet", "--op", op]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    if op == "gemm":
        assert "wgrad_bgrad_dgelu_split_bf16/grad_bias" in out
    passed = int(out.strip().splitlines()[-1].split()[0])
    assert passed >= len(registry.all_cases([op], "cpu"))  # one row per reported tensor, at least one per case


@pytest.fixture
def failing_case():
    @registry.register("selftest", "always_fails", "bounded")
    def _fail(device):
        return {"": BoundedReport(1.0, 0.1, 10.0, 1.0, 1.0, False)}

    @registry.register("selftest", "raises", "bitwise")
    def _raise(device):
        raise RuntimeError("boom")

    yield
    registry.unregister("selftest")


def test_verify_fails_on_a_failing_case(failing_case, capsys):
    assert main(["verify", "--device", "cpu", "--op", "selftest", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "always_fails" in out and "RuntimeError: boom" in out and "0 passed, 2 failed" in out


def test_every_cases_module_is_registered():
    """Each ``truefuse/verify/cases_<op>.py`` is in ``CASE_MODULES`` (a module left out would never
    run under ``verify``), and each listed module exists (docs/adding_an_op.md)."""
    from pathlib import Path

    files = {f"truefuse.verify.{p.stem}" for p in Path(registry.__file__).parent.glob("cases_*.py")}
    assert files == set(registry.CASE_MODULES)


def test_every_bench_module_is_registered():
    """Each ``truefuse/bench/bench_<name>.py`` is a benchmark ``python -m truefuse bench`` knows."""
    from pathlib import Path

    from truefuse import bench

    files = {f"truefuse.bench.{p.stem}" for p in Path(bench.__file__).parent.glob("bench_*.py")}
    assert files == set(bench.BENCHES.values()) | set(bench.DISTRIBUTED_BENCHES.values())


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


def test_bench_alias_runs_its_benchmark(tmp_path, capsys):
    """``bench rms_norm`` (docs, scripts/gpu_check.sh) is the norm benchmark (``bench_norm.py``)."""
    from truefuse import bench

    assert set(bench.ALIASES.values()) <= set(bench.BENCHES) and not set(bench.ALIASES) & set(bench.BENCHES)
    assert main(["bench", "rms_norm", "--quick", "--out", str(tmp_path), "--providers", "cublas9000"]) == 2
    err = capsys.readouterr().err
    assert "unknown ['cublas9000']" in err and "unknown benchmark" not in err


# verify's output in a pipe, a log and a narrow terminal --------------------------------------

_LONG = "a_case_name_as_long_as_the_real_grouped_ones_" + "x" * 40  # the table needs > 150 columns
_BOOM = "RuntimeError: " + " ".join(f"word{i}" for i in range(60))  # a message longer than any line


@pytest.fixture
def wide_cases():
    """A passing, a failing and a raising case with long names, under op ``selftest_wide``."""

    @registry.register("selftest_wide", f"{_LONG}_passes", "bounded")
    def _pass(device):
        return {"": BoundedReport(0.0, 0.0, 1.0, 0.0, 0.0, True)}

    @registry.register("selftest_wide", f"{_LONG}_fails", "bounded")
    def _fail(device):
        return {"": BoundedReport(1.0, 0.1, 10.0, 1.0, 1.0, False)}

    @registry.register("selftest_wide", f"{_LONG}_raises", "bitwise")
    def _raise(device):
        raise RuntimeError(_BOOM.removeprefix("RuntimeError: "))

    yield {f"{_LONG}_passes": "PASS", f"{_LONG}_fails": "FAIL", f"{_LONG}_raises": "FAIL"}
    registry.unregister("selftest_wide")


def _assert_every_row_shows_its_result(out: str, expected: dict[str, str]) -> None:
    lines = out.rstrip("\n").splitlines()
    for name, result in expected.items():
        row = [ln for ln in lines if name in ln]  # the row first; the rich table lists messages after
        assert row and result in row[0], (name, row)
    assert _BOOM in out  # the whole message, never wrapped or cut
    assert lines[-1] == "1 passed, 2 failed"


def test_verify_piped_shows_every_result_and_the_whole_message(wide_cases, capsys):
    """Not a terminal (capsys): plain rows, each with its PASS/FAIL, the message whole, the summary last."""
    assert main(["verify", "--device", "cpu", "--op", "selftest_wide", "--quiet"]) == 1
    _assert_every_row_shows_its_result(capsys.readouterr().out, wide_cases)


def _run_cases(op: str) -> list:
    from truefuse.verify import verify

    return verify(torch.device("cpu"), [op], quiet=True)


def test_verify_narrow_terminal_keeps_the_result_column(wide_cases, monkeypatch):
    """A terminal of 80 columns: the result column and the message are never squeezed away."""
    import io

    import rich.console

    from truefuse.verify import print_table

    buf = io.StringIO()
    real = rich.console.Console
    monkeypatch.setattr(rich.console, "Console", lambda *a, **k: real(width=80, force_terminal=True, file=buf, **k))
    print_table(_run_cases("selftest_wide"), torch.device("cpu"))
    _assert_every_row_shows_its_result(buf.getvalue(), wide_cases)


def test_verify_wide_terminal_rich_table_shows_results_and_messages(wide_cases):
    """A terminal wide enough: the rich table, PASS/FAIL per row, each failure's message whole after it."""
    import io

    from rich.console import Console

    from truefuse.verify import print_table

    buf = io.StringIO()
    print_table(_run_cases("selftest_wide"), torch.device("cpu"), Console(width=400, force_terminal=True, file=buf))
    out = buf.getvalue()
    assert "┃" in out  # the rich table, not the plain rows
    _assert_every_row_shows_its_result(out, wide_cases)


def test_verify_piped_through_cat_shows_pass_on_every_row():
    """``python -m truefuse verify | cat``: real stdout, a pipe. Long case names (GroupedMLP's, 80
    columns, made the table wider than the 150 it was given) squeezed the result column to nothing.
    One case with a long name joins ``scale``'s (a fast op), so the run takes seconds."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from truefuse.__main__ import main\n"
        "from truefuse.testing import BoundedReport\n"
        "from truefuse.verify import registry\n"
        f"registry.register('selftest_pipe', {_LONG!r}, 'bounded')(lambda d: {{'': BoundedReport(0, 0, 1, 0, 0, True)}})\n"
        "sys.exit(main(['verify', '--device', 'cpu', '--op', 'scale', '--op', 'selftest_pipe', '--quiet']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    p = subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parents[1], timeout=120
    )
    assert p.returncode == 0, p.stdout
    lines = p.stdout.rstrip("\n").splitlines()
    rows = [ln for ln in lines if "scale" in ln or "selftest_pipe" in ln]
    assert lines[-1] == "7 passed, 0 failed" and len(rows) == 7 and all("PASS" in ln for ln in rows), p.stdout


# --op, --world-size ---------------------------------------------------------------------------


@pytest.fixture
def two_ops():
    for op in ("selftest_a", "selftest_b"):
        registry.register(op, "passes", "bounded")(lambda device: {"": BoundedReport(0.0, 0.0, 1.0, 0.0, 0.0, True)})
    yield
    registry.unregister("selftest_a", "selftest_b")


@pytest.mark.parametrize("ops", [["--op", "selftest_a", "selftest_b"], ["--op", "selftest_a", "--op", "selftest_b"]])
def test_verify_op_takes_several_names(two_ops, ops, capsys):
    assert main(["verify", "--device", "cpu", "--quiet", *ops]) == 0
    out = capsys.readouterr().out
    assert "selftest_a" in out and "selftest_b" in out and out.splitlines()[-1] == "2 passed, 0 failed"


@pytest.mark.parametrize("n", ["0", "-1"])
def test_verify_world_size_below_one_is_an_argparse_error(n, capsys):
    with pytest.raises(SystemExit) as e:
        main(["verify", "--device", "cpu", "--op", "scale", "--quiet", "--world-size", n])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--world-size" in err and "at least 1" in err


@pytest.fixture
def fake_run_local(monkeypatch):
    """run_local replaced by a one-row table per rank (the real one spawns processes)."""
    import truefuse.distributed.launch as launch

    calls = []
    row = {
        "rows": 1,
        "hidden": 8,
        "dtype": "float32",
        "bytes": 32,
        "path": "reference",
        "max_diff": 0.0,
        "frac_nonzero": 0.0,
        "checks": {},
        "passed": True,
    }

    def fake(world_size, fn, *args, **kwargs):
        calls.append(world_size)
        return [[dict(row)] for _ in range(world_size)]

    monkeypatch.setattr(launch, "run_local", fake)
    return calls


def test_verify_world_size_op_outside_the_distributed_table_is_an_error(fake_run_local, capsys):
    assert main(["verify", "--device", "cpu", "--world-size", "2", "--op", "gemm"]) == 2
    err = capsys.readouterr().err
    assert "--op 'gemm'" in err and "allreduce_add_rmsnorm" in err
    assert fake_run_local == []  # refused before any process starts


@pytest.mark.parametrize("op", [[], ["--op", "allreduce_add_rmsnorm"], ["--op", "allreduce", "allreduce_add_rmsnorm"]])
@pytest.mark.parametrize("world_size", [1, 2])
def test_verify_world_size_runs_the_distributed_table(fake_run_local, op, world_size, capsys):
    assert main(["verify", "--device", "cpu", "--world-size", str(world_size), *op]) == 0
    out = capsys.readouterr().out
    assert fake_run_local == [world_size]
    assert out.splitlines()[-1] == f"{world_size} passed, 0 failed (all ranks)"


# one version; bad configuration -----------------------------------------------------------------


def test_installed_version_is_truefuse_version():
    """pyproject.toml takes its version from truefuse.__version__ (one place)."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    import truefuse

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    try:
        installed = importlib.metadata.version("truefuse")
    except importlib.metadata.PackageNotFoundError:  # the GPU machine runs the checkout from PYTHONPATH
        pytest.skip("truefuse is not installed here (PYTHONPATH checkout)")
    assert installed == truefuse.__version__


def test_info_bad_configuration_is_one_line_and_exit_2(monkeypatch, capsys):
    import truefuse.info

    def bogus():
        raise ValueError("TRUEFUSE_GEMM_BACKENDS: unknown backend 'nope'")

    monkeypatch.setattr(truefuse.info, "print_info", bogus)
    assert main(["info"]) == 2
    assert capsys.readouterr().err == "info: TRUEFUSE_GEMM_BACKENDS: unknown backend 'nope'\n"
