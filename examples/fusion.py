"""Gradient fusion: many small gradients all-reduced in a few buckets (hcomm's Fusion, from the
Rust side) instead of one collective each, buckets starting while backward still runs.

    hcomm run -n 4 python examples/fusion.py
"""

import torch

import hcomm

torch.set_num_threads(1)  # ranks share the cores
comm = hcomm.InitHcom("hccl_world_group")
rank, size = hcomm.GetRank(), hcomm.GetWorldSize()

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(40)])  # 80 small tensors
data = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
params = list(model.parameters())

fusion = comm.fusion(op="mean", cap_bytes=256 << 10, first_bucket_bytes=64 << 10)
hooks = [p.register_post_accumulate_grad_hook(lambda p: fusion.push(p.grad)) for p in params]
model(data).square().mean().backward()
buckets = fusion.finish()  # waits for every bucket; results are in the .grad tensors
fused = [p.grad.clone() for p in params]

# Reference: one all-reduce per gradient.
for h in hooks:
    h.remove()
for p in params:
    p.grad = None
model(data).square().mean().backward()
for p in params:
    hcomm.AllReduce(p.grad, op="mean")
for a, p in zip(fused, params):
    assert torch.equal(a, p.grad), "fused and per-tensor all-reduces agree bitwise"

# Or in one call, for tensors that are all ready:
grads = [p.grad for p in params]
hcomm.AllReduceCoalesced(grads, op="sum")

print(f"rank {rank}: {len(params)} gradients all-reduced in {buckets} buckets instead of {len(params)} collectives", flush=True)
print("EXAMPLE OK", flush=True)
