"""A short job for the launch tests: `numpy` (InitHcom from the launcher's variables),
`torch` (dist.init_process_group("hcomm") from torch's variables), `rank_table PATH`
(InitHcom(config_path=PATH)), `reinit` (InitHcom / AllReduce / DestroyHcom four times on the
launcher's master port, rank 1 dawdling before each DestroyHcom, and the communicator kept in
a variable, which DestroyHcom must not let hold the port)."""

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
elif mode == "reinit":
    import time

    for round in range(4):
        comm = hcomm.InitHcom()
        a = np.full(5, comm.rank + round, np.int64)
        hcomm.AllReduce(a)
        n = comm.world_size
        assert (a == n * (n - 1) // 2 + n * round).all(), (round, a)
        if comm.rank == 1:
            time.sleep(0.3)
        hcomm.DestroyHcom()
        assert comm.destroyed
        try:
            comm.rank
            raise AssertionError("a destroyed communicator must refuse calls")
        except hcomm.HcommError as e:
            assert "destroyed" in str(e), e
    print("reinit ok", flush=True)
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
