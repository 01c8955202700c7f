"""Does the dK/dV pass race on shared memory (issue 33)? One small bf16 backward per loop variant,
meant to run under ``compute-sanitizer --tool racecheck``.

Run: ``PYTHONPATH=. compute-sanitizer --tool racecheck python experiments/exp_attention_race.py M N WARPS STAGES FLAT LOAD_T``
"""

import dataclasses
import sys

import torch

import truefuse.ops.attention as ops_attention
from truefuse.autograd.attention import attention
from truefuse.ops.attention_config import attention_config

m, n, warps, stages, flat, load_t = (int(a) for a in sys.argv[1:7])
cfg = dataclasses.replace(attention_config(128, torch.bfloat16, False), dkdv_m=m, dkdv_n=n, dkdv_warps=warps, dkdv_stages=stages)
ops_attention.attention_config = lambda *a: cfg
ops_attention.VARIANT.update(dkdv_flat=bool(flat), dkdv_load_t=bool(load_t))
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, h, 256, 128, generator=g).cuda().bfloat16().requires_grad_() for h in (4, 2, 2))
attention(q, k, v, is_causal=True, enable_gqa=True).backward(torch.randn(1, 4, 256, 128).cuda().bfloat16())
torch.cuda.synchronize()
print("race check run done", (m, n, warps, stages, flat, load_t))
