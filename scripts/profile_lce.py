"""Where the time of linear_cross_entropy goes at one issue shape (default 8192 x 128256 x 4096),
against torch.compile of the plain path: the CUDA kernels of one forward + backward, by total time.

    python scripts/profile_lce.py [N V H]
"""

import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import truefuse

N, V, H = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 128256, 4096)
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(N, H, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
W = (torch.randn(V, H, generator=g, device="cuda", dtype=torch.bfloat16) * H**-0.5).requires_grad_()
t = torch.randint(0, V, (N,), generator=g, device="cuda")
plain = torch.compile(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c))

for name, fn in (("truefuse", lambda: truefuse.linear_cross_entropy(x, W, t)), ("compile_plain", lambda: plain(x, W, t))):
    for _ in range(3):
        x.grad = W.grad = None
        fn().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        x.grad = W.grad = None
        fn().backward()
        torch.cuda.synchronize()
    print(f"== {name}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
