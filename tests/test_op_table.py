"""The op declarations (truefuse/verify/op_table.py, issue 46) against the code: every custom op
under ``torch.ops.truefuse`` and every contract in verify's registry belongs to a declaration,
every declared name exists, and what a declaration says of its custom ops (inline, the eager
path) is what they do. The generated lists: tests/test_compile.py (opcheck, compile),
tests/test_double_backward.py, tests/distributed/test_dtensor.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch

import truefuse
from truefuse.verify.op_table import OPS, OpDecl, available, by_name, declared_custom_ops, resolve
from truefuse.verify.registry import all_cases

PKG = Path(truefuse.__file__).parent


def _registered() -> set[str]:
    """``truefuse::`` ops in the dispatcher once truefuse, its distributed room and every declared
    module are imported (the Hugging Face and allreduce ops register only when their room loads)."""
    import truefuse.distributed  # noqa: F401

    for where in declared_custom_ops().values():
        if available(where):
            resolve(where)
    return {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("truefuse::")}


def _in_source() -> set[str]:
    """``truefuse::`` names given to a custom-op decorator anywhere in the package: the ops of a
    module nothing imports yet are found too."""
    pat = re.compile(r"""(?:custom_op|triton_op)\(\s*["'](truefuse::\w+)["']""")
    return {m for p in PKG.rglob("*.py") for m in pat.findall(p.read_text())}


def test_every_custom_op_is_declared_and_every_declared_one_exists():
    declared = set(declared_custom_ops())
    registered, source = _registered(), _in_source()
    here = {n for n, where in declared_custom_ops().items() if available(where)}  # transformers may be absent
    assert source & here <= registered, f"in the source, not registered after import: {sorted(source & here - registered)}"
    missing = (registered | source) - declared
    assert not missing, f"custom ops with no declaration in truefuse/verify/op_table.py: {sorted(missing)}"
    assert here <= registered, f"declared but not registered: {sorted(here - registered)}"
    for name in here:
        where = declared_custom_ops()[name]
        op = resolve(where)
        assert f"truefuse::{op._name}" == name, f"{name} is declared at {where}, which is truefuse::{op._name}"


def test_every_contract_is_declared_and_every_declared_one_is_registered():
    """Each op's verify names against verify's registry (and, for a distributed op, the tables
    ``verify --world-size`` runs): a new cases module without a declaration fails here."""
    from truefuse.verify.distributed_table import OPS as TABLE_OPS

    cases = {c.op for c in all_cases()}
    declared = {v for d in OPS for v in d.verify}
    assert cases - declared == set(), f"contracts with no declaration: {sorted(cases - declared)}"
    assert declared - cases - set(TABLE_OPS) == set(), f"declared contracts verify does not know: {sorted(declared - cases)}"


def test_names_are_unique_and_answers_in_their_enums():
    assert len(by_name()) == len(OPS)
    hints = get_type_hints(OpDecl)
    for d in OPS:
        for attr in ("dtensor", "batch_invariant", "double_backward"):
            allowed = get_args(hints[attr])
            assert getattr(d, attr) in allowed, (d.name, attr, getattr(d, attr))
        assert (d.compile is None) == bool(d.why_not_compiled), f"{d.name}: a compile sample or why not, one of them"
        assert d.opcheck is not None or not d.custom_ops, f"{d.name}: custom ops but no opcheck sample"


@pytest.mark.parametrize("name", [d.name for d in OPS])
def test_references_and_public_names_resolve(name):
    d = by_name()[name]
    assert callable(resolve(d.ref)), d.ref
    if not d.name.startswith(("ops.", "distributed.")):
        assert hasattr(truefuse, d.name), f"truefuse.{d.name}"
    assert all(hasattr(truefuse, m) for m in d.modules), d.modules
    assert any(p.stem.startswith(d.stem) for p in (PKG / "ops").rglob("*.py")) or d.stem in ("linear", "layernorm_linear",
        "layernorm_mlp", "grouped"), f"no ops/ module of stem {d.stem}"  # fmt: skip


@pytest.mark.parametrize("name", [d.name for d in OPS if d.custom_ops])
def test_inline_and_eager_are_what_the_custom_ops_do(name):
    """``inline``: every custom op was made with ``custom_op(inline=...)`` truthy (a callable
    deciding per call counts), but those declared ``opaque``; ``eager``: a forward op carries
    ``register_backward``'s ``.eager``."""
    d = by_name()[name]
    assert set(d.opaque) <= set(d.custom_ops), f"{name} declares opaque ops it does not have"
    ops = [resolve(w) for w in d.custom_ops.values() if available(w)]
    inline = {n: bool(getattr(resolve(w), "inline", False)) for n, w in d.custom_ops.items() if available(w)}
    wanted = {n: d.inline and n not in d.opaque for n in inline}
    assert inline == wanted, f"{name} declares inline={d.inline} (opaque: {d.opaque}), its ops: {inline}"
    assert any(hasattr(op, "eager") for op in ops) == d.eager, f"{name} declares eager={d.eager}"


def test_not_differentiable_ops_have_no_autograd_formula():
    for d in OPS:
        if d.double_backward == "not differentiable":
            for name, where in d.custom_ops.items():
                assert not available(where) or resolve(where)._backward_fn is None, (
                    f"{d.name} declares no backward but {name} has one"
                )
