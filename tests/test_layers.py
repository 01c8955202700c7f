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
    """``truefuse.ops.norm`` -> ``ops``; ``truefuse`` (the package itself) -> ``__init__``."""
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
    """No module in autograd/, nn/ or distributed/ imports truefuse.kernels: ops/ is the one
    launcher, so its host functions are the one compile boundary."""
    bad = []
    for path in _files():
        me = _room(_module_name(path))
        if me not in ("autograd", "nn", "distributed", "integrations"):
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{ln} imports {m}" for ln, m in _imports(path) if _room(m) == "kernels"]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_lazy_upward_import():
    """The checker itself: an import inside a function counts, and a relative one is resolved."""
    src = "def f():\n    from truefuse.nn.linear import Linear\n    from ..nn import linear\n"
    found = [m for _, m in _imports(PKG / "ops" / "probe.py", src)]
    assert found == ["truefuse.nn.linear", "truefuse.nn"]
