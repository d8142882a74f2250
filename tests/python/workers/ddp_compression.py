"""DDP with hcomm's compression hook (hcomm.torch.compression_hook), against DDP without a
hook. Copies of one model train side by side on the same per-rank data:

* hook "none" ends where plain DDP ends (up to the rounding of dividing before or after the sum);
* hook "fp16" ends close to it; hook "topk:10%" with error feedback still learns;
* every replica is identical on every rank (the compressed results are bitwise identical);
* the hook also serves DDP on a gloo group when given the hcomm communicator (comm=), and
  says what to do when it has no hcomm communicator.

Prints "WORKER OK" at the end; any mismatch raises.
"""

import datetime

import torch
import torch.distributed as dist

import hcomm
import hcomm.torch as ht
from _gloo_exit import leave

torch.set_num_threads(1)
dist.init_process_group("hcomm", timeout=datetime.timedelta(seconds=60))
R, W = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")


def model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


runs = {}
for name, comp, group in [
    ("plain", None, None),
    ("none", "none", None),
    ("fp16", "fp16", None),
    ("topk", "topk:10%", None),
    ("int8-on-gloo", "int8", gloo),
]:
    m = model()
    ddp = torch.nn.parallel.DistributedDataParallel(m, process_group=group, bucket_cap_mb=0.01)
    state = None
    if comp is not None:
        comm = ht.communicator_of() if group is not None else None
        state = ht.CompressionHookState(comp, error_feedback=True, comm=comm, process_group=group)
        ddp.register_comm_hook(state, ht.compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(77 + R)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(5))
    losses = []
    for step in range(12):
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), torch.tanh(x @ target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    f = flat(m)
    every = [torch.empty_like(f) for _ in range(W)]
    dist.all_gather(every, f, group=gloo)
    assert all(torch.equal(e, f) for e in every), f"{name}: replicas differ between ranks"
    if state is not None:
        assert state.states, f"{name}: the hook never ran"
        assert state.communicator() is ht.communicator_of(), f"{name}: the hook used another communicator"
    runs[name] = (f, losses)

plain, plain_losses = runs["plain"]
torch.testing.assert_close(runs["none"][0], plain, rtol=1e-5, atol=1e-6, msg="hook 'none' == plain DDP")
torch.testing.assert_close(runs["fp16"][0], plain, rtol=0, atol=2e-3, msg="hook 'fp16' close to plain DDP")
torch.testing.assert_close(runs["int8-on-gloo"][0], plain, rtol=0, atol=2e-2, msg="int8 on gloo DDP close to plain DDP")
topk_losses = runs["topk"][1]
assert topk_losses[-1] < topk_losses[0], f"topk with error feedback does not learn: {topk_losses}"
if R == 0:
    print(
        "ok ddp hooks: max |diff| vs plain: none %.1e fp16 %.1e int8 %.1e; topk loss %.3f -> %.3f"
        % tuple(
            [(runs[k][0] - plain).abs().max().item() for k in ("none", "fp16", "int8-on-gloo")]
            + [topk_losses[0], topk_losses[-1]]
        ),
        flush=True,
    )

# Without a communicator: DDP on gloo, no comm=, no InitHcom -> a clear error.
lonely = ht.CompressionHookState("int8", process_group=gloo)
try:
    lonely.communicator()
except ValueError as e:
    assert "comm=" in str(e), e
else:
    raise AssertionError("a hook without an hcomm communicator must fail")
try:
    ht.CompressionHookState("int9")
except hcomm.InvalidArgumentError as e:
    assert "int9" in str(e)
else:
    raise AssertionError("an unknown compressor must fail when the hook state is made")
dist.destroy_process_group()
print("WORKER OK", flush=True)
leave()  # past torch's gloo teardown race (_gloo_exit.py)
