"""A short job for the launch tests: `numpy` (InitHcom from the launcher's variables),
`torch` (dist.init_process_group("hcomm") from torch's variables), `rank_table PATH`
(InitHcom(config_path=PATH))."""

import sys

import numpy as np

import hcomm

mode = sys.argv[1]
if mode == "torch":
    import torch
    import torch.distributed as dist

    import hcomm.torch  # noqa: F401

    dist.init_process_group("hcomm")
    t = torch.full((5,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert torch.equal(t, torch.full((5,), n * (n + 1) / 2)), t
    dist.barrier()
    print("init_process_group ok", flush=True)
    dist.destroy_process_group()
else:
    if mode == "rank_table":
        comm = hcomm.InitHcom("table", config_path=sys.argv[2])
    else:
        comm = hcomm.InitHcom()
    a = np.full(5, comm.rank + 1, np.int64)
    hcomm.AllReduce(a)
    n = comm.world_size
    assert (a == n * (n + 1) // 2).all(), a
    if mode == "rank_table":
        print("rank table ok", flush=True)
print("WORKER OK", flush=True)
