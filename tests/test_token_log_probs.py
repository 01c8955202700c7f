"""token_log_probs (log-probs and entropy from given logits): its registered contract cases (bounded
against the float64 reference, bitwise equal to linear_log_probs on the same logits), rows
independent of the batch, ignored targets, bad input."""

import pytest
import torch

import truefuse
from truefuse.verify.registry import all_cases


def _assert(reports):
    for k, rep in reports.items():
        assert rep.passed, f"{k}: {rep}"


def test_registered_cases(device):
    """Every case on the GPU; on the CPU the fp32 ones (the Triton interpreter) but the bitwise one
    are left to ``verify``: the bf16 ones run the same contracts on the PyTorch math."""
    cases = all_cases(["token_log_probs"], device.type)
    assert len(cases) == 8
    for c in cases:
        if device.type == "cuda" or not c.name.endswith("fp32") or c.name.startswith("same"):
            _assert(c.fn(device))


def test_cases_tell_a_wrong_answer_apart(device, monkeypatch):
    """The bitwise case fails when the op's math is not the head's (here: the reference's)."""
    import truefuse.verify.cases_token_log_probs as cases

    monkeypatch.setattr(cases, "token_log_probs", lambda z, t, **kw: truefuse.token_log_probs_ref(z, t, **kw))
    (c,) = [c for c in all_cases(["token_log_probs"], device.type) if c.name == "same_as_linear_log_probs_bf16"]
    assert not all(r.passed for r in c.fn(device).values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_do_not_depend_on_the_batch(dtype, device):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(6, 100, generator=g) * 3).to(device, dtype).requires_grad_()
    t = torch.randint(0, 100, (6,), generator=g).to(device)
    up = torch.randn(6, generator=g).to(device)
    whole = truefuse.token_log_probs(z, t, temperature=0.9)
    (whole.log_probs * up + whole.entropy).sum().backward()
    for s in (slice(0, 1), slice(2, 6)):
        zs = z.detach()[s].clone().requires_grad_()
        part = truefuse.token_log_probs(zs, t[s], temperature=0.9)
        (part.log_probs * up[s] + part.entropy).sum().backward()
        assert torch.equal(part.log_probs, whole.log_probs[s]) and torch.equal(part.entropy, whole.entropy[s])
        assert torch.equal(zs.grad, z.grad[s])


def test_ignored_targets_and_shapes(device):
    z = torch.randn(2, 3, 40, device=device, requires_grad=True)
    t = torch.tensor([[1, -100, 5], [-100, 0, 39]], device=device)
    out = truefuse.token_log_probs(z, t)
    assert out.log_probs.shape == (2, 3) and out.log_probs.dtype == torch.float32
    assert (out.log_probs[t == -100] == 0).all() and (out.entropy[t == -100] == 0).all()
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert (z.grad[t == -100] == 0).all() and (z.grad[t != -100] != 0).any()


def test_bad_input_names_the_argument(device):
    z = torch.randn(4, 10, device=device)
    t = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="logits"):
        truefuse.token_log_probs(z.long(), t)
    with pytest.raises(TypeError, match="target"):
        truefuse.token_log_probs(z, t.float())
    with pytest.raises(ValueError, match="target has shape"):
        truefuse.token_log_probs(z, t[:3])
    with pytest.raises(ValueError, match="temperature"):
        truefuse.token_log_probs(z, t, temperature=0.0)
    with pytest.raises(ValueError, match="10"):
        truefuse.token_log_probs(z, t + 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_masked_logits_give_torchs_gradients(dtype, device):
    """Top-k-masked (−inf) sampler scores, on the kernel (fp32) and the PyTorch path (fp64): the
    log-probs' gradient alone is torch's ``log_softmax(z / T).gather``'s (finite, 0 at the masked
    logits), and the entropy and its gradient are ``Categorical(logits=z / T).entropy()``'s."""
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(5, 70, generator=g, dtype=dtype) * 2).to(device)
    keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, z.topk(8, dim=-1).indices, True)
    z = z.masked_fill(~keep, float("-inf"))
    t = torch.where(keep, torch.rand(z.shape, generator=g, dtype=dtype).to(device), -1.0).argmax(-1)
    t[3] = (~keep[3]).nonzero()[0, 0]  # a masked target: log-prob −inf, its gradient still finite
    T = 0.7

    def grad(fn):
        zz = z.clone().requires_grad_()
        out = fn(zz)
        (dz,) = torch.autograd.grad(out.sum(), [zz])
        return out.detach(), dz

    lp, d_lp = grad(lambda x: truefuse.token_log_probs(x, t, temperature=T).log_probs)
    lp_ref, d_lp_ref = grad(lambda x: torch.log_softmax(x / T, -1).gather(-1, t[:, None]).squeeze(-1))
    assert lp[3] == -torch.inf
    torch.testing.assert_close(lp, lp_ref.to(lp.dtype))
    assert d_lp.isfinite().all() and (d_lp[~keep & (torch.arange(70, device=device) != t[:, None])] == 0).all()
    torch.testing.assert_close(d_lp, d_lp_ref)

    ent, d_ent = grad(lambda x: truefuse.token_log_probs(x, t, temperature=T).entropy)
    ent_ref, d_ent_ref = grad(lambda x: torch.distributions.Categorical(logits=x / T).entropy())
    assert ent.isfinite().all() and d_ent.isfinite().all() and (d_ent[~keep] == 0).all()
    torch.testing.assert_close(ent, ent_ref.to(ent.dtype))
    torch.testing.assert_close(d_ent, d_ent_ref)
    # finite under any upstream (Categorical's own gradient is NaN past an upstream of 1)
    _, d_ent3 = grad(lambda x: 3 * truefuse.token_log_probs(x, t, temperature=T).entropy)
    torch.testing.assert_close(d_ent3, 3 * d_ent)

    # a row of −inf has no distribution: NaN, as log_softmax gives
    out = truefuse.token_log_probs(torch.full((1, 70), float("-inf"), dtype=dtype, device=device), t[:1])
    assert out.log_probs.isnan().all() and out.entropy.isnan().all()
