"""Shared memory (the documented example): rank 0 allocates and fills it, rank 1 maps it with
GetSharedMemory(src_rank=0) and reads it zero-copy, as a tensor view and through
torch.from_file(shm.path, shared=True). Allocation is per rank, not collective.

    hcomm run -n 2 python examples/shared_memory.py
"""

import torch

import hcomm

torch.set_num_threads(1)  # ranks share the cores
hcomm.InitHcom("hccl_world_group")
rank = hcomm.GetRank()
assert hcomm.GetWorldSize() >= 2, "run with at least 2 ranks"
n = 1 << 20  # float32 elements (4 MiB)

if rank == 0:
    shm = hcomm.AllocateSharedMemory(n * 4, flags="read_write")
    weights = shm.torch(torch.float32, shape=(1024, 1024))  # a view, no copy
    weights.copy_(torch.arange(n, dtype=torch.float32).reshape(1024, 1024))
    hcomm.Signal(1, tag=1)
    hcomm.Wait(src_rank=1, tag=2)
    assert weights[0, 0].item() == -1.0  # rank 1 wrote into the same memory
    del weights  # views must go before the memory is freed
    hcomm.FreeSharedMemory(shm)
elif rank == 1:
    hcomm.Wait(src_rank=0, tag=1)
    shm = hcomm.GetSharedMemory(src_rank=0)
    view = shm.torch(torch.float32, shape=(1024, 1024))
    assert torch.equal(view.reshape(-1), torch.arange(n, dtype=torch.float32))
    mapped = torch.from_file(shm.path, shared=True, size=n)  # the same memory, by path
    assert torch.equal(mapped, view.reshape(-1))
    mapped[0] = -1.0
    assert view[0, 0].item() == -1.0
    print(f"rank 1 read {n * 4 >> 20} MiB of rank 0's memory from {shm.path}", flush=True)
    del view, mapped
    hcomm.Signal(0, tag=2)

hcomm.Barrier()
print("EXAMPLE OK", flush=True)
