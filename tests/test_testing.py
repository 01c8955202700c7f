import math

import torch

from truefuse.testing import bitwise_report, bounded_report, rel_error


def test_bitwise_report_sees_one_ulp():
    a = torch.randn(1000, dtype=torch.bfloat16)
    b = a.clone()
    assert bitwise_report(a, b).equal
    b.view(torch.int16)[7] += 1  # one ulp on one element
    rep = bitwise_report(a, b)
    assert not rep.equal and rep.frac_nonzero == 1 / 1000 and rep.max_diff > 0


def test_bitwise_report_nan_on_one_side_is_infinite():
    a = torch.ones(4)
    b = a.clone()
    b[1] = float("nan")
    rep = bitwise_report(a, b)
    assert not rep.equal and math.isinf(rep.max_diff)


def test_bitwise_report_distinguishes_signed_zero():
    assert not bitwise_report(torch.tensor([0.0]), torch.tensor([-0.0])).equal


def test_bounded_uses_the_baseline_error():
    ref = torch.randn(4096, dtype=torch.float64)
    baseline = ref.to(torch.bfloat16)  # the same-dtype path: one bf16 rounding
    good = ref.float()  # far more accurate
    bad = (ref * (1 + 1e-2)).to(torch.bfloat16)  # ~1% error: several times a bf16 rounding
    assert bounded_report(good, ref, baseline).passed
    rep = bounded_report(bad, ref, baseline)
    assert not rep.passed and rep.ratio > 1.25


def test_nan_never_passes():
    ref = torch.randn(64, dtype=torch.float64)
    out = ref.float()
    out[3] = float("nan")
    assert rel_error(out, ref) == math.inf
    assert not bounded_report(out, ref, ref.to(torch.bfloat16)).passed
