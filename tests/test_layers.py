"""The package's layering (docs/design.md §5), read from the source: every import, lazy ones in
functions included, runs from a higher layer to a lower one or within a layer."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "truefuse"

#: Layer of each top-level room; a module may import its own layer and lower ones.
LAYERS = {
    "config": 0,
    "testing": 0,
    "kernels": 1,
    "ops": 2,
    "autograd": 3,
    "nn": 4,
    "optim": 4,  # truefuse.optim.AdamW: a user-facing object over ops/, as the modules are
    "distributed": 5,
    "integrations": 6,
    # the command line and its tools sit on top of everything
    "verify": 7,
    "bench": 7,
    "demo": 7,
    "info": 7,
    "__main__": 7,
    "__init__": 7,
}


def _room(module: str) -> str:
    """``truefuse.ops.norm.norm`` -> ``ops``; ``truefuse`` (the package itself) -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1] if len(parts) > 2 else parts  # truefuse/ops/__init__ -> truefuse.ops
    return ".".join(parts)


def _imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every truefuse import in the file (or in ``source`` as if it
    were that file)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    pkg = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "truefuse"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "truefuse":
                if mod == "truefuse":  # from truefuse import ops -> each name is a room
                    found += [(node.lineno, f"truefuse.{a.name}") for a in node.names]
                else:
                    found.append((node.lineno, mod))
    return found


def _files():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_room_has_a_layer():
    rooms = {_room(_module_name(p)) for p in _files()}
    assert rooms <= set(LAYERS), f"rooms without a layer: {sorted(rooms - set(LAYERS))}"


def test_imports_run_from_higher_layers_to_lower():
    bad = []
    for path in _files():
        me = _room(_module_name(path))
        for line, mod in _imports(path):
            other = _room(mod)
            if other in LAYERS and LAYERS[other] > LAYERS[me]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({me}) imports {mod} ({other})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_only_ops_launches_kernels():
    """No module in autograd/, nn/, optim or distributed/ imports truefuse.kernels: ops/ is the one
    launcher, so its host functions are the one compile boundary."""
    bad = []
    for path in _files():
        me = _room(_module_name(path))
        if me not in ("autograd", "nn", "optim", "distributed", "integrations"):
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{ln} imports {m}" for ln, m in _imports(path) if _room(m) == "kernels"]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_lazy_upward_import():
    """The checker itself: an import inside a function counts, and a relative one is resolved."""
    src = "def f():\n    from truefuse.nn.linear import Linear\n    from ..nn import linear\n"
    found = [m for _, m in _imports(PKG / "ops" / "probe.py", src)]
    assert found == ["truefuse.nn.linear", "truefuse.nn"]


# -- the batch-invariant switch (docs/design.md §1; issue 46): read once a call, passed down ------

#: Where ``is_batch_invariant`` may be named outside config.py (which owns the switch), by (file,
#: enclosing function): its re-export, the one per-call read (``Modes.now``), ``truefuse.gemm``'s
#: public ``None`` (= the switch), and the Hugging Face model's mode, which enters the switch itself.
SWITCH_READERS = {
    ("truefuse/__init__.py", "<module>"),
    ("truefuse/autograd/_modes.py", "<module>"),
    ("truefuse/autograd/_modes.py", "Modes.now"),
    ("truefuse/ops/gemm/gemm.py", "<module>"),
    ("truefuse/ops/gemm/gemm.py", "_resolve_batch_invariant"),
    ("truefuse/integrations/huggingface/batch_invariant.py", "<module>"),
    ("truefuse/integrations/huggingface/batch_invariant.py", "ModelMode.active"),
}
_SWITCH_ATTRS = {"is_batch_invariant", "_batch_invariant"}  # the function, config's variable


def _switch_reads(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, enclosing function's qualified name or ``<module>``) of every mention of the switch:
    a name, an attribute (``config.is_batch_invariant``) or an import of it, aliased or not."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
            if isinstance(child, ast.Name) and child.id == "is_batch_invariant":
                found.append((child.lineno, scope))
            elif isinstance(child, ast.Attribute) and child.attr in _SWITCH_ATTRS:
                found.append((child.lineno, scope))
            elif isinstance(child, ast.ImportFrom) and any(a.name in _SWITCH_ATTRS for a in child.names):
                found.append((child.lineno, scope))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_ops_and_kernels_never_read_the_switch():
    """ops/ and kernels/ take the batch-invariant mode as an argument (the caller's ``Modes``),
    except ``truefuse.gemm``'s public ``batch_invariant=None``, resolved once at its entries."""
    bad = []
    for path in _files():
        rel = str(path.relative_to(PKG.parent))
        if _room(_module_name(path)) not in ("ops", "kernels"):
            continue
        bad += [f"{rel}:{ln} in {fn}" for ln, fn in _switch_reads(path) if (rel, fn) not in SWITCH_READERS]
    assert not bad, "ops/kernels reading the batch-invariant switch (take the mode as an argument):\n" + "\n".join(bad)


def test_the_switch_is_read_only_where_listed():
    """Everywhere else a call reads ``Modes.now()`` once at its entry and passes the mode down (an
    autograd Function keeps it on ``ctx.modes`` for its backward): no second read that could
    disagree with the first, none in a backward."""
    seen, bad = set(), []
    for path in _files():
        rel = str(path.relative_to(PKG.parent))
        if rel == "truefuse/config.py":
            continue
        for ln, fn in _switch_reads(path):
            seen.add((rel, fn))
            if (rel, fn) not in SWITCH_READERS:
                bad.append(f"{rel}:{ln} in {fn}")
    assert not bad, "the switch read outside SWITCH_READERS (read Modes.now() once a call):\n" + "\n".join(bad)
    assert seen == SWITCH_READERS, f"listed but gone (update SWITCH_READERS): {sorted(SWITCH_READERS - seen)}"


def test_the_switch_checker_sees_aliases_attributes_and_scopes():
    src = (
        "from truefuse.config import is_batch_invariant as on\n"
        "import truefuse.config as c\n"
        "class K:\n"
        "    def f(self):\n"
        "        return c.is_batch_invariant() or c._batch_invariant\n"
    )
    assert _switch_reads(PKG / "ops" / "probe.py", src) == [(1, "<module>"), (5, "K.f"), (5, "K.f")]


#: The GEMM entry points whose ``batch_invariant=None`` means "read the switch".
_GEMM_ENTRIES = {"gemm", "gemm_groups", "plain_gemm"}


def _gemm_calls_without_mode(path: Path, source: str | None = None) -> list[int]:
    """Lines calling a GEMM entry point (imported from ``truefuse.ops.gemm.gemm`` under any name, defined
    in that module, or a ``.gemm`` method such as ``GroupSpec.gemm``) without ``batch_invariant=``."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    names = set(_GEMM_ENTRIES) if _module_name(path) == "truefuse.ops.gemm.gemm" else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "truefuse.ops.gemm.gemm":
            names |= {a.asname or a.name for a in node.names if a.name in _GEMM_ENTRIES}
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id in names) or (isinstance(f, ast.Attribute) and f.attr == "gemm"):
            if not any(k.arg in ("batch_invariant", None) for k in node.keywords):  # None: **kwargs
                bad.append(node.lineno)
    return bad


def test_internal_gemm_calls_pass_the_mode():
    """Inside the library every GEMM call says its mode: a missing ``batch_invariant`` would read the
    switch again, inside ops/ or in a backward (after the ``with`` block), not the call's."""
    bad = []
    for path in _files():
        if _room(_module_name(path)) not in ("ops", "autograd", "nn", "distributed", "integrations"):
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{ln}" for ln in _gemm_calls_without_mode(path)]
    assert not bad, "GEMM calls without batch_invariant=:\n" + "\n".join(bad)


def test_the_gemm_call_checker_sees_aliases_and_methods():
    src = (
        "from truefuse.ops.gemm.gemm import gemm as g\n"
        "g(a, b)\n"
        "g(a, b, batch_invariant=bi)\n"
        "spec.gemm(a, b, m_splits=s)\n"
        "spec.gemm(a, b, **kw)\n"
    )
    assert _gemm_calls_without_mode(PKG / "autograd" / "probe.py", src) == [2, 4]
