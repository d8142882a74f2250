"""DDP on the "hcomm" backend ends with the same parameters as DDP on "gloo": two copies of
a model built from one seed train side by side for several steps on the same per-rank data,
one wrapped with the default (hcomm) group, one with a gloo group. Small buckets, so DDP
overlaps several asynchronous all-reduces with the backward pass."""

import datetime

import torch
import torch.distributed as dist

import hcomm.torch  # noqa: F401  (registers "hcomm")
from _gloo_exit import leave

torch.set_num_threads(1)  # ranks share the cores

dist.init_process_group("hcomm", timeout=datetime.timedelta(seconds=60))
R, W = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")


def model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


# Different initial weights on every rank: DDP's broadcast from rank 0 must fix them.
m_h, m_g = model(), model()
with torch.no_grad():
    for p in list(m_h.parameters()) + list(m_g.parameters()):
        p.add_(R * 0.01)
ddp_h = torch.nn.parallel.DistributedDataParallel(m_h, bucket_cap_mb=0.002)
ddp_g = torch.nn.parallel.DistributedDataParallel(m_g, process_group=gloo, bucket_cap_mb=0.002)
opt_h = torch.optim.SGD(ddp_h.parameters(), lr=0.05, momentum=0.9)
opt_g = torch.optim.SGD(ddp_g.parameters(), lr=0.05, momentum=0.9)
gen = torch.Generator().manual_seed(99 + R)
for step in range(6):
    xb = torch.randn(8, 16, generator=gen)
    yb = torch.randn(8, 4, generator=gen)
    for ddp, opt in ((ddp_h, opt_h), (ddp_g, opt_g)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xb), yb).backward()
        opt.step()

worst = 0.0
for (name, a), b in zip(m_h.named_parameters(), m_g.parameters()):
    worst = max(worst, (a - b).abs().max().item())
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: hcomm vs gloo: {m}")
# hcomm's result is identical on every rank
flat = torch.cat([p.detach().reshape(-1) for p in m_h.parameters()])
everyone = [torch.empty_like(flat) for _ in range(W)]
dist.all_gather(everyone, flat)
for r in range(W):
    assert torch.equal(everyone[r], flat), f"rank {r}'s parameters differ from rank {R}'s"
moved = (flat - torch.cat([p.detach().reshape(-1) for p in model().parameters()])).abs().max().item()
assert moved > 1e-3, "training did not change the parameters"
print(f"ddp hcomm == gloo after 6 steps (max |diff| {worst:.2e})", flush=True)
dist.destroy_process_group()
print("WORKER OK", flush=True)
leave()  # past torch's gloo teardown race (_gloo_exit.py)
