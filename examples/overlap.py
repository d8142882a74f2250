"""Overlap: start the all-reduce of each layer's gradient as soon as backward produces it
(AllReduceAsync), keep computing, and wait for all of them at the end. The result equals a
blocking all-reduce after backward.

    hcomm run -n 4 python examples/overlap.py
"""

import torch

import hcomm

torch.set_num_threads(1)  # ranks share the cores
hcomm.InitHcom("hccl_world_group")
rank, size = hcomm.GetRank(), hcomm.GetWorldSize()

torch.manual_seed(0)  # same model on every rank
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
data = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))

handles = []


def launch(p: torch.Tensor) -> None:
    # Called by autograd when p.grad is complete; communication starts while the backward
    # pass goes on with earlier layers.
    handles.append(hcomm.AllReduceAsync(p.grad, op="mean"))


hooks = [p.register_post_accumulate_grad_hook(launch) for p in model.parameters()]
model(data).square().mean().backward()
for h in handles:
    h.wait()  # or hcomm.Wait(h)
overlapped = [p.grad.clone() for p in model.parameters()]

# The same step without overlap, for comparison.
for h in hooks:
    h.remove()
for p in model.parameters():
    p.grad = None
model(data).square().mean().backward()
for p in model.parameters():
    hcomm.AllReduce(p.grad, op="mean")
for a, p in zip(overlapped, model.parameters()):
    assert torch.equal(a, p.grad)

print(f"rank {rank}: {len(overlapped)} gradients all-reduced during backward", flush=True)
print("EXAMPLE OK", flush=True)
