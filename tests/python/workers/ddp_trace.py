"""DDP on "hcomm" with HCOMM_TRACE set: the trace has a slice per operation, and with
hcomm.torch.bucket_trace_hook every bucket's all-reduce is labelled with its index, with
parameters bitwise those of DDP without a hook. Prints "WORKER OK"; any mismatch raises."""

import datetime
import json
import os

import torch
import torch.distributed as dist

import hcomm.torch as ht

torch.set_num_threads(1)
dist.init_process_group("hcomm", timeout=datetime.timedelta(seconds=60))
R, W = dist.get_rank(), dist.get_world_size()
comm = ht.communicator_of()
path = comm.trace_file
assert path is not None and path.endswith(f"hcomm-trace-rank{R}.json"), path
assert path.startswith(os.environ["HCOMM_TRACE"]), path


def train(hook):
    torch.manual_seed(1234)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(77 + R)
    for _ in range(3):
        x = torch.randn(32, 16, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


plain = train(None)
traced = train(ht.bucket_trace_hook)
assert torch.equal(plain, traced), "bucket_trace_hook changed the result"
dist.barrier()
comm.flush_trace()
with open(path) as f:
    events = json.loads(f.read().rstrip().rstrip(",") + "\n]")
slices = [e for e in events if e.get("ph") == "X"]
assert all(e["pid"] == R for e in slices)
labelled = [e for e in slices if str(e["args"].get("label", "")).startswith("ddp bucket ")]
assert labelled, "no labelled bucket all-reduce"
assert all(e["name"] == "all_reduce" for e in labelled), labelled
buckets = sorted({int(e["args"]["label"].split()[-1]) for e in labelled})
assert buckets == list(range(len(buckets))) and len(buckets) >= 2, buckets
# Every gradient all-reduced once per step (3 steps), whatever the bucketing (DDP rebuilds
# its buckets after the first step), and nothing else labelled.
grad_bytes = 4 * plain.numel()
assert sum(e["args"]["bytes"] for e in labelled) == 3 * grad_bytes, (labelled, grad_bytes)
# The unlabelled run's bucket all-reduces are traced too, with the same sizes.
sizes = sorted(e["args"]["bytes"] for e in labelled)
plain_sizes = sorted(e["args"]["bytes"] for e in slices if e["name"] == "all_reduce" and "label" not in e["args"] and e["args"]["bytes"] in set(sizes))
assert len(plain_sizes) >= len(sizes), (plain_sizes, sizes)
if R == 0:
    print(f"ok ddp trace: {len(slices)} slices, {len(buckets)} buckets labelled", flush=True)
# One more operation, then the group goes: the file holds it (written on the 100 ms beat or
# when the backend shut down; the closing `]` comes when the communicator goes, and readers
# accept a file without it).
dist.all_reduce(torch.ones(7))
dist.destroy_process_group()
with open(path) as f:
    text = f.read()
after = json.loads(text.rstrip().rstrip("]").rstrip().rstrip(",") + "\n]")
assert any(e.get("ph") == "X" and e["args"].get("count") == 7 for e in after), "the last operation is not in the trace"
print("WORKER OK", flush=True)
