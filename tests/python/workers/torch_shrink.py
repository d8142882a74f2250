"""torch.distributed.shrink_group on the "hcomm" backend: the last rank is SIGKILLed; the
survivors see the failure, shrink the default group without it, and go on."""

import os
import signal

import torch
import torch.distributed as dist

import hcomm
import hcomm.torch  # noqa: F401

torch.set_num_threads(1)
dist.init_process_group("hcomm")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.ones(1000)
dist.all_reduce(t)
assert torch.all(t == size)
victim = size - 1
if rank == victim:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    while True:
        dist.all_reduce(t)
except hcomm.HcommError as e:
    print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
assert backend.supports_shrinking
group = dist.shrink_group([victim])
assert dist.get_world_size() == size - 1 and dist.get_rank() == rank, (dist.get_world_size(), dist.get_rank())
assert group.size() == size - 1
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert torch.all(t == sum(range(1, size))), t[0]
out = [torch.zeros(3) for _ in range(size - 1)]
dist.all_gather(out, torch.full((3,), float(rank)))
assert [int(o[0]) for o in out] == list(range(size - 1))
dist.barrier()
print(f"rank {rank}: shrunk to {dist.get_world_size()} ranks", flush=True)
dist.destroy_process_group()
print("WORKER OK", flush=True)
