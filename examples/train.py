"""DistributedDataParallel on the "hcomm" torch.distributed backend.

    hcomm run -n 4 python examples/train.py          # or torchrun --nproc-per-node 4 examples/train.py
"""

import torch
import torch.distributed as dist

import hcomm.torch  # noqa: F401  (registers the "hcomm" backend)

torch.set_num_threads(1)
dist.init_process_group("hcomm")  # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, size = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)
true_w = torch.randn(8, 1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1, bias=False))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)  # every rank sees different data
for step in range(100):
    x = torch.randn(32, 8, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
    opt.zero_grad()
    loss.backward()  # gradients are averaged over the ranks by hcomm
    opt.step()

w = model.module.weight.detach().clone()
everyone = [torch.empty_like(w) for _ in range(size)]
dist.all_gather(everyone, w)
assert all(torch.equal(e, w) for e in everyone), "replicas stay identical"
assert loss.item() < 1e-3, f"did not learn: loss {loss.item()}"
if rank == 0:
    print(f"trained on {size} ranks: loss {loss.item():.2e}", flush=True)
dist.destroy_process_group()
print("EXAMPLE OK", flush=True)
