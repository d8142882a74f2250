"""DDP on "hcomm" with HCOMM_DETERMINISTIC=1 (set by the test): the same model trained with
several bucket caps, one after the other, in one job, must end with bitwise the same
parameters; rank 0 prints their SHA-256 per cap, and the test compares jobs of different
host layouts (DET_HOSTS=2: the ranks claim 2 hosts, so reductions run over TCP instead of
the shared segment)."""

import datetime
import hashlib
import os

HOSTS = int(os.environ.get("DET_HOSTS", "1"))
if HOSTS > 1:
    _r, _w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["HCOMM_HOST_ID"] = f"host{_r * HOSTS // _w}"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hcomm.torch  # noqa: E402,F401  (registers "hcomm")

torch.set_num_threads(1)  # ranks share the cores
dist.init_process_group("hcomm", timeout=datetime.timedelta(seconds=90))
R = dist.get_rank()


def train(cap_mb: float) -> str:
    torch.manual_seed(1234)
    # About 0.9 M parameters (3.5 MB of gradients): several buckets at the small caps.
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 640), torch.nn.Tanh(), torch.nn.Linear(640, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(7 + R)
    for _ in range(3):
        x, y = torch.randn(16, 256, generator=gen), torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


for cap in (0.25, 1.0, 25.0, 100.0):
    digest = train(cap)
    if R == 0:
        print(f"cap {cap} MiB: {digest}", flush=True)
dist.barrier()
dist.destroy_process_group()
print("WORKER OK", flush=True)
