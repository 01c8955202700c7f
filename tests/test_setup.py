"""The README's set-up: scripts/bootstrap.sh's choice of torch build, the README's first snippet and
commands, and the links of the README and docs/.

bootstrap.sh runs here against a stub ``.venv/bin/python`` that records every call, so the test
sees which pip commands the script would run without installing anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

STUB = r"""#!/usr/bin/env bash
echo "PIP_CONFIG_FILE=${PIP_CONFIG_FILE:-} $*" >> "$STUB_LOG"
case "$*" in
  "-c import torch") exit 1 ;;                      # no torch yet
  *"--index-url"*) exit "$STUB_INDEX_RC" ;;         # PyTorch's CPU index reachable or not
  "-c import sys, torch"*) exit 1 ;;                # torch.version.cuda is None: a CPU build
  *) exit 0 ;;
esac
"""


def _run_bootstrap(tmp_path: Path, index_rc: int) -> list[str]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"  # a PATH without nvidia-smi: the machine has no GPU
    bin_dir.mkdir()
    for tool in ("bash", "sha256sum", "cut", "cat", "dirname", "env"):
        shutil.copy(shutil.which(tool), bin_dir / tool)
    env = {"PATH": str(bin_dir), "STUB_LOG": str(log), "STUB_INDEX_RC": str(index_rc), "HOME": str(tmp_path)}
    subprocess.run(["bash", str(tmp_path / "scripts" / "bootstrap.sh")], env=env, check=True, capture_output=True)
    return log.read_text().splitlines()


def _torch_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if re.search(r"-m pip install .*torch", c)]


def test_bootstrap_installs_cpu_torch_from_pytorch_cpu_index(tmp_path):
    installs = _torch_installs(_run_bootstrap(tmp_path, index_rc=0))
    assert len(installs) == 1, installs
    # only the CPU index (the machine's configured mirrors are kept out: they may hold CUDA builds)
    assert f"--index-url {CPU_INDEX}" in installs[0] and installs[0].startswith("PIP_CONFIG_FILE=/dev/null ")


def test_bootstrap_falls_back_when_cpu_index_unreachable(tmp_path):
    installs = _torch_installs(_run_bootstrap(tmp_path, index_rc=1))
    assert len(installs) == 2, installs
    assert CPU_INDEX in installs[0]
    # the fallback names a version: plain "torch" resolves to a CUDA build of several GB here
    assert installs[1].endswith("torch==2.13.0"), installs[1]


@pytest.mark.parametrize("index_rc", [0, 1])
def test_bootstrap_installs_numpy_before_importing_torch(tmp_path, index_rc):
    """torch imported without NumPy warns "Failed to initialize NumPy" (torch's wheels do not require
    it): the check of the installed build must come after NumPy is in."""
    calls = _run_bootstrap(tmp_path, index_rc=index_rc)
    numpy = [i for i, c in enumerate(calls) if re.search(r"-m pip install .*\bnumpy\b", c)]
    imports = [i for i, c in enumerate(calls) if c.split(" ", 1)[1].startswith("-c import sys, torch")]
    assert numpy and imports, calls
    assert numpy[0] < imports[0], calls


def _readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rewrite of the snippet; the GPU runs it as written")
def test_readme_first_snippet_runs(monkeypatch):
    """The README's first snippet, on the CPU at a small size: every name it uses is defined."""
    code = _readme_python_blocks()[0].replace('"cuda"', '"cpu"').replace("8192", "16").replace("4096", "32")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    layer = scope["layer"]
    assert layer.weight.main_grad.abs().sum() > 0  # the snippet's backward reached main_grad
    assert layer.weight.grad is None


def test_readme_first_lines_are_the_two_commands():
    """The first shell block is the main job (the demo) and CI's own command, both from a fresh clone."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()
    assert len(block) == 2
    demo, suite = (line.split("#")[0].strip() for line in block)
    assert demo == "bash scripts/bootstrap.sh && .venv/bin/python -m truefuse demo"
    assert suite == (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert os.access(ROOT / "scripts" / "bootstrap.sh", os.R_OK)


def test_readme_leads_with_what_truefuse_is_and_why_the_cpu_demo_is_not_about_speed():
    """The first screen says what truefuse is and why before any set-up (issue 31), and the README
    says why the CPU demo's speed is not the point (its reference path runs there)."""
    text = (ROOT / "README.md").read_text()
    lead = " ".join(text.split("```bash", 1)[0].split())
    assert "truefuse is a PyTorch library of fused kernels" in lead and "match the unfused computation" in lead
    assert "bootstrap" not in lead and "pip" not in lead
    demo = " ".join(text.split("The demo trains", 1)[1].split("\n\n", 1)[0].split())
    assert "on the CPU it runs its reference path" in demo


def _markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "log").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _relative_links(page: Path) -> list[str]:
    """The page's markdown links inside the repository (code blocks and inline code left out)."""
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", link)]


def test_markdown_links_resolve():
    """Every link of the README and the docs names a file that exists and, after '#', one of its headings."""
    broken = []
    for page in _markdown_pages():
        for link in _relative_links(page):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, broken


def test_readme_is_a_map_of_the_docs():
    """The README reaches every page of docs/ in one link (issue 46: the README as a map; the dated
    log is reached through docs/benchmarks.md)."""
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in _relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def _cited_text() -> dict[str, str]:
    """The tree's pages, code and scripts that may cite a raw result or an experiment; the dated log
    (docs/log/) names files that git history keeps, so it is left out."""
    paths = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "truefuse").rglob("*.py")]
    paths += [*(ROOT / "experiments").iterdir(), *(ROOT / "scripts").iterdir()]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths if p.is_file()}


def _expand_braces(text: str) -> str:
    """`name_run{1,2}.json` written out as `name_run1.json name_run2.json` (how the docs cite runs)."""
    pattern = re.compile(r"([\w./-]*)\{([\w,]+)\}([\w.]*)")
    return pattern.sub(lambda m: " ".join(m[1] + v + m[3] for v in m[2].split(",")), text)


def test_results_cited_and_citations_resolve():
    """docs/results/ holds only what a page, the code or an experiment cites, under a family's folder
    (issue 32), and every docs/results/ path cited resolves."""
    texts = _cited_text()
    kept = [p for p in (ROOT / "docs" / "results").rglob("*") if p.is_file()]
    assert kept and all(p.parent.parent == ROOT / "docs" / "results" for p in kept), "one folder per family"
    everything = "\n".join(_expand_braces(t) for t in texts.values())
    uncited = [str(p.relative_to(ROOT)) for p in kept if p.name not in everything]
    assert not uncited, f"raw results no page cites (git keeps them): {uncited}"
    missing = []
    for name, text in texts.items():
        for cited in re.findall(r"docs/results/[\w./-]+", _expand_braces(text)):
            cited = cited.rstrip(".")
            if not cited.endswith("/") and not (ROOT / cited).exists():
                missing.append(f"{name}: {cited}")
    assert not missing, missing


def test_experiments_indexed():
    """experiments/README.md's table names every script that remains, and no script that is gone."""
    readme = (ROOT / "experiments" / "README.md").read_text()
    table = {m for m in re.findall(r"^\| `([\w.]+\.py)` \|", readme, flags=re.M)}
    scripts = {p.name for p in (ROOT / "experiments").glob("*.py")}
    assert table == scripts, f"not indexed: {sorted(scripts - table)}; indexed but gone: {sorted(table - scripts)}"


def test_cited_experiments_resolve():
    """Every experiment script the pages, code, scripts and tests name (``exp_*.py``, ``profile_*.py``,
    ``experiments/<name>.py``) exists, or is in experiments/README.md's list of removed and folded
    scripts, which says where git keeps it (issue 46: a folded script is cited by its harness's
    subcommand)."""
    index = (ROOT / "experiments" / "README.md").read_text()
    have = {p.name for p in (ROOT / "experiments").glob("*.py")}
    texts = {k: v for k, v in _cited_text().items() if not k.startswith("experiments/")}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "tests").rglob("*.py")}
    pattern = r"experiments/(\w+\.py)|\b((?:exp|profile)_\w+\.py)\b"
    cited = {(name, a or b) for name, text in texts.items() for a, b in re.findall(pattern, text)}
    unknown = sorted(f"{name}: {s}" for name, s in cited if s not in have and f"`{s}`" not in index)
    assert not unknown, unknown


def test_design_references_resolve_inside_the_repository():
    """Every "docs/design.md §N" cited in the tree names a section of docs/design.md, and nothing
    points at a design doc outside the repository (a clone has only this one)."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", design, flags=re.M))
    cited, outside = set(), []
    for path in [
        *ROOT.glob("*.md"),
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "truefuse").rglob("*.py"),
        *(ROOT / "scripts").glob("*"),
    ]:
        text = path.read_text()
        cited |= {m.split(".")[0] for m in re.findall(r"docs/design\.md §(\d+(?:\.\d+)?)", text)}
        if re.search(r"shared/DESIGN|DESIGN §", text):
            outside.append(str(path.relative_to(ROOT)))
    assert not outside, f"references to a design doc outside the repository: {outside}"
    assert cited and cited <= sections, f"cited sections missing from docs/design.md: {sorted(cited - sections)}"
