"""The loss's four public signatures stay equal to each other: ``truefuse.linear_cross_entropy``
(functional), ``LinearCrossEntropyLoss`` (``__init__`` + ``forward``), the autograd level
(``LinearCrossEntropyOptions``, the options its Functions run on, and ``linear_cross_entropy_with``)
and ``truefuse.distributed.linear_cross_entropy`` (vocab-parallel).

"Equal": the same names with the same defaults, and the options in the same order in each. Each
entry is compared with the others, never with a list written here, so an argument added to all
four passes and one added to fewer fails. What differs by design is named below with its reason.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import truefuse
import truefuse.distributed
from truefuse.autograd.linear_cross_entropy import linear_cross_entropy_with
from truefuse.nn.linear_cross_entropy import LinearCrossEntropyLoss
from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOptions

#: The module holds its weight-gradient state (docs/design.md §2) and builds it from these; the
#: functions take the state itself instead.
MODULE_ONLY = {"delay_wgrad_compute", "max_pending_wgrad"}
FUNCTION_ONLY = {"wgrad_state"}
#: torch.nn.functional.linear_cross_entropy's ``options`` object (its batch chunk is our
#: ``chunk_size``): the functional takes torch's signature (issue 31); the module keeps its own.
TORCH_ONLY = {"options"}
#: The vocab-parallel loss: where its shard lies, and its group; it always slices the vocabulary
#: (lean's passes), so the token chunks' options do not apply to it.
DISTRIBUTED_ONLY = {"group", "vocab_start"}
NOT_DISTRIBUTED = {"chunk_size", "fp32_weight_grad"}
#: each rank sees its vocabulary shard: a token's argmax would need a cross-rank reduction it does not make
NOT_DISTRIBUTED |= {"return_predicted_tokens"}
#: The shard of the LM head under its own name.
RENAMED = {"linear_weight_shard": "linear_weight"}


def _params(fn, skip_self: bool = False) -> dict[str, inspect.Parameter]:
    ps = list(inspect.signature(fn).parameters.values())
    return {RENAMED.get(p.name, p.name): p for p in ps[1 if skip_self else 0 :]}


def _entries() -> dict[str, dict[str, inspect.Parameter]]:
    """Every entry's parameters by name (the module's ``__init__`` and ``forward`` together)."""
    module = _params(LinearCrossEntropyLoss.__init__, skip_self=True) | _params(LinearCrossEntropyLoss.forward, skip_self=True)
    return {
        "functional": {n: p for n, p in _params(truefuse.linear_cross_entropy).items() if n not in TORCH_ONLY},
        "module": module,
        "distributed": _params(truefuse.distributed.linear_cross_entropy),
    }


def _options() -> list[dataclasses.Field]:
    return list(dataclasses.fields(LinearCrossEntropyOptions))


def test_functional_and_module_take_the_same_arguments():
    e = _entries()
    assert set(e["functional"]) - FUNCTION_ONLY == set(e["module"]) - MODULE_ONLY


def test_distributed_takes_the_functional_arguments_that_apply_to_it():
    e = _entries()
    assert set(e["distributed"]) - DISTRIBUTED_ONLY == set(e["functional"]) - NOT_DISTRIBUTED


def test_the_options_are_the_functional_keywords_in_their_order():
    """The autograd level: ``LinearCrossEntropyOptions``' fields are the functional's keywords but
    the tensors and the weight-gradient ones, which ``linear_cross_entropy_with`` takes beside them."""
    with_ = set(_params(linear_cross_entropy_with)) - {"opts"}
    fields = [f.name for f in _options()]
    functional = [n for n in _entries()["functional"] if n not in with_]
    assert fields == functional
    assert with_ <= set(_entries()["functional"])


@pytest.mark.parametrize("entry", ["functional", "module", "distributed"])
def test_defaults_equal_the_options_and_each_other(entry):
    e = _entries()
    fields = {f.name: f.default for f in _options()}
    for name, p in e[entry].items():
        if name in fields:
            assert p.default == fields[name], f"{entry}: {name}={p.default!r}, the options' default is {fields[name]!r}"
        for other, ps in e.items():
            if name in ps and ps[name].default is not inspect.Parameter.empty:
                assert p.default == ps[name].default, f"{entry} and {other} differ on {name}'s default"


@pytest.mark.parametrize("entry", ["functional", "module", "distributed"])
def test_the_options_come_in_one_order(entry):
    """The options an entry takes appear in the dataclass's order; the tensors lead, in one order."""
    fields = [f.name for f in _options()]
    names = list(_entries()[entry])
    assert [n for n in names if n in fields] == [f for f in fields if f in names]
    tensors = ["input", "linear_weight", "target"]
    assert names[:3] == tensors if entry != "module" else [n for n in names if n in tensors] == tensors
