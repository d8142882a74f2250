"""Point-to-point: connections (CreateConnection / Send / Recv / DestroyConnection) around a
ring, and send/recv by rank and tag. Needs at least 2 ranks.

    hcomm run -n 4 python examples/point_to_point.py
"""

import torch

import hcomm

torch.set_num_threads(1)  # ranks share the cores
hcomm.InitHcom("hccl_world_group")
rank, size = hcomm.GetRank(), hcomm.GetWorldSize()
assert size >= 2, "run with at least 2 ranks"
nxt, prv = (rank + 1) % size, (rank - 1) % size

# A connection per neighbour: both ends create it with each other's rank and the same tag.
to_next = hcomm.CreateConnection(dst_rank=nxt, tag=100)
from_prev = to_next if size == 2 else hcomm.CreateConnection(dst_rank=prv, tag=100)

token = torch.full((4, 4), float(rank))
received = torch.empty(4, 4)
if rank % 2 == 0:  # even ranks send first, odd ranks receive first
    hcomm.Send(token, to_next)
    hcomm.Recv(received, from_prev)
else:
    hcomm.Recv(received, from_prev)
    hcomm.Send(token, to_next)
assert torch.all(received == prv), received
hcomm.DestroyConnection(to_next)
if from_prev is not to_next:
    hcomm.DestroyConnection(from_prev)

# Without a connection object: by rank and tag (messages match by (rank, tag)).
if rank == 0:
    for dst in range(1, size):
        hcomm.Send(torch.arange(10, dtype=torch.int32) * dst, dst, tag=7)
else:
    buf = torch.empty(10, dtype=torch.int32)
    hcomm.Recv(buf, 0, tag=7)
    assert torch.equal(buf, torch.arange(10, dtype=torch.int32) * rank)

hcomm.Barrier()
print(f"rank {rank}: got {received[0, 0].item():.0f} from rank {prv}", flush=True)
print("EXAMPLE OK", flush=True)
