"""GroupedLinear / GroupedMLP: equal to one Linear per group bit for bit, what the MLP keeps for
the backward, and clear errors for bad m_splits. (Bounded and weight-gradient contract tests run
over the grouped modules in test_linear_modules.py and test_wgrad_contract.py.)"""

import random

import pytest
import torch

import truefuse
from truefuse.verify.cases_grouped import grouped_vs_linear


def _random_splits(seed: int, groups: int = 6) -> list[int]:
    rng = random.Random(seed)
    splits = [rng.randint(2, 40) for _ in range(groups)]
    empty, one = rng.sample(range(groups), 2)
    splits[empty], splits[one] = 0, 1  # always an empty group and a group of one row
    return splits


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("packed", [False, True])
# two draws of sizes (each has an empty and a one-row group): a third repeated the same paths (suite time)
@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_linear_equals_linear_per_group(packed, fused, bias, seed, device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    splits = _random_splits(seed)
    for k, rep in grouped_vs_linear(dtype, device, packed=packed, splits=splits, fused=fused, bias=bias, seed=seed).items():
        assert rep.passed, f"{k}: max_diff={rep.max_diff} frac={rep.frac_nonzero} splits={splits}"


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_mlp_keeps_only_input_and_fc1_output(activation, device):
    """Nothing cheaper to recompute is kept: the saved activations are x and fc1's output."""
    m = truefuse.GroupedMLP(3, 32, 24, device=device, activation=activation, single_grouped_weight=True)
    x = torch.randn(20, 32, device=device, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x, [5, 0, 15])
    params = {id(p) for p in m.parameters()}
    acts = [t for t in saved if id(t) not in params]
    fc1_out = 48 if activation == "swiglu" else 24
    assert sorted(tuple(t.shape) for t in acts) == sorted([(20, 32), (20, fc1_out)])
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize(
    "splits,exc,msg",
    [
        ([5, 5], ValueError, "m_splits has 2 groups but there are 3"),
        ([5, 5, 1], ValueError, "m_splits sums to 11 but the number of rows of x is 10"),
        ([12, -2, 0], ValueError, "negative group size"),
        ([5.0, 5, 0], TypeError, "m_splits must be a list of ints"),
        (torch.tensor([5.0, 5.0, 0.0]), TypeError, "m_splits must be a 1-D integer tensor"),
    ],
)
def test_bad_m_splits(splits, exc, msg, device):
    for m in (truefuse.GroupedLinear(3, 8, 4, device=device), truefuse.GroupedMLP(3, 8, 4, device=device)):
        with pytest.raises(exc, match=msg):
            m(torch.randn(10, 8, device=device), splits)


def test_m_splits_tensor_and_bad_input(device):
    m = truefuse.GroupedLinear(3, 8, 4, device=device)
    x = torch.randn(10, 8, device=device)
    torch.testing.assert_close(m(x, torch.tensor([4, 0, 6])), m(x, [4, 0, 6]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="last dimension must be in_features=8"):
        m(torch.randn(10, 7, device=device), [4, 0, 6])
    with pytest.raises(ValueError, match="must be 2-D"):
        m(torch.randn(2, 5, 8, device=device), [4, 0, 6])
    with pytest.raises(ValueError, match="num_gemms must be at least 1"):
        truefuse.GroupedLinear(0, 8, 4)
    with pytest.raises(ValueError, match="activation='tanh'"):
        truefuse.GroupedMLP(2, 8, 4, activation="tanh")


def test_m_splits_numpy_ints_accepted(device):
    """``list(np_array)`` gives NumPy ints: accepted like Python ints (they used to be refused with
    "got list"), by both modules and their references."""
    np = pytest.importorskip("numpy")
    x = torch.randn(10, 8, device=device)
    for m in (truefuse.GroupedLinear(3, 8, 4, device=device), truefuse.GroupedMLP(3, 8, 4, device=device)):
        want = m(x, [4, 0, 6])
        for splits in (list(np.array([4, 0, 6])), [np.int32(4), np.int64(0), 6], np.array([4, 0, 6])):
            torch.testing.assert_close(m(x, splits), want, rtol=0, atol=0)
            torch.testing.assert_close(m.forward_ref(x, splits), m.forward_ref(x, [4, 0, 6]), rtol=0, atol=0)


@pytest.mark.parametrize(
    "make,exc,msg",
    [
        (lambda np: [np.float64(4.0), 0, 6], TypeError, r"m_splits must be a list of ints.*m_splits\[0\] is"),
        (lambda np: np.array([4.0, 0.0, 6.0]), TypeError, "m_splits must be a list of ints.*float64"),
        (lambda np: [np.int64(12), np.int64(-2), 0], ValueError, "m_splits has a negative group size"),
    ],
)
def test_m_splits_numpy_floats_and_negatives_refused(make, exc, msg, device):
    np = pytest.importorskip("numpy")
    for m in (truefuse.GroupedLinear(3, 8, 4, device=device), truefuse.GroupedMLP(3, 8, 4, device=device)):
        with pytest.raises(exc, match=msg):
            m(torch.randn(10, 8, device=device), make(np))
