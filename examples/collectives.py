"""Collectives on CPU tensors, checked against what every rank contributed.

    hcomm run -n 4 python examples/collectives.py        # or: python -m hcomm run -n 4 ...
"""

import torch

import hcomm

torch.set_num_threads(1)  # ranks share the cores
hcomm.InitHcom("hccl_world_group")
rank, size = hcomm.GetRank(), hcomm.GetWorldSize()

# AllReduce: in place; op is sum, prod, min, max or mean.
grad = torch.full((1024,), float(rank + 1))
hcomm.AllReduce(grad, op="sum")
assert torch.all(grad == size * (size + 1) / 2)
hcomm.AllReduce(grad, op="mean")
assert torch.all(grad == size * (size + 1) / 2)

# AllGather: concatenates along dim (-1 by default): (1024, 256) -> (1024, 256 * size).
x = torch.full((1024, 256), float(rank))
y = hcomm.AllGather(x)
assert y.shape == (1024, 256 * size)
for r in range(size):
    assert torch.all(y[:, r * 256 : (r + 1) * 256] == r)
rows = hcomm.AllGather(x[:2], dim=0)  # along dim 0: (2 * size, 256)
assert rows.shape == (2 * size, 256)

# ReduceScatter: each rank gets its share (along dim 0) of the reduction.
z = torch.arange(4.0 * size).reshape(size, 4) + rank
part = hcomm.ReduceScatter(z, op="sum")
assert part.shape == (1, 4)
assert torch.equal(part[0], size * (torch.arange(4.0) + 4 * rank) + sum(range(size)))

# Broadcast: in place from root_rank.
w = torch.full((8,), float(rank))
hcomm.Broadcast(w, root_rank=size - 1)
assert torch.all(w == size - 1)

# Reduce, Gather, Scatter, AllToAll.
r = hcomm.Reduce(torch.full((3,), float(rank)), op="max", root_rank=0)
if rank == 0:
    assert torch.all(r == size - 1)
g = hcomm.Gather(torch.full((2,), rank, dtype=torch.int64), root_rank=0)
if rank == 0:
    assert torch.equal(g, torch.arange(size).repeat_interleave(2))
s = hcomm.Scatter(torch.arange(2.0 * size), root_rank=0)
assert torch.equal(s, torch.tensor([2.0 * rank, 2.0 * rank + 1]))
a = hcomm.AllToAll(torch.full((size, 2), float(rank)))
assert torch.equal(a[:, 0], torch.arange(float(size)))  # row p came from rank p

# bfloat16 works like every other dtype.
b = torch.ones(16, dtype=torch.bfloat16)
hcomm.AllReduce(b)
assert torch.all(b == size)

hcomm.Barrier()
print(f"rank {rank}: every collective checked", flush=True)
print("EXAMPLE OK", flush=True)
