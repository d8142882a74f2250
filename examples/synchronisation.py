"""Synchronisation: Barrier, and Signal / Wait between two ranks (a producer hands data over
through shared memory and signals; the consumer waits for the signal, then reads).

    hcomm run -n 2 python examples/synchronisation.py
"""

import time

import torch

import hcomm

torch.set_num_threads(1)  # ranks share the cores
hcomm.InitHcom("hccl_world_group")
rank, size = hcomm.GetRank(), hcomm.GetWorldSize()

# Barrier: nobody leaves before everyone has arrived.
start = time.monotonic()
if rank == 0:
    time.sleep(0.2)
hcomm.Barrier()
assert time.monotonic() - start >= 0.19 or rank == 0

if size >= 2:
    if rank == 0:
        shm = hcomm.AllocateSharedMemory(1024 * 4)
        data = shm.torch(torch.float32)
        data.copy_(torch.arange(1024.0))
        hcomm.Signal(dst_rank=1, tag=1)  # "the data is ready"
        hcomm.Wait(src_rank=1, tag=2)  # "I have read it"
        del data
        hcomm.FreeSharedMemory(shm)
    elif rank == 1:
        hcomm.Wait(src_rank=0, tag=1)
        shm = hcomm.GetSharedMemory(src_rank=0)
        assert torch.equal(shm.torch(torch.float32), torch.arange(1024.0))
        hcomm.Signal(dst_rank=0, tag=2)

hcomm.Barrier()
print(f"rank {rank}: synchronised", flush=True)
print("EXAMPLE OK", flush=True)
