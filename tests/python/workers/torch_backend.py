"""torch.distributed with the "hcomm" backend: every operation, checked against references
computed from every rank's deterministic input. Run under a launcher that sets torch's
variables (python -m hcomm run / hcomm run / torchrun); prints WORKER OK at the end."""

import datetime

import numpy as np
import torch
import torch.distributed as dist

import hcomm
import hcomm.torch as ht

dist.init_process_group("hcomm", timeout=datetime.timedelta(seconds=60))
R, W = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "hcomm", dist.get_backend()
comm = ht.communicator_of()
assert isinstance(comm, hcomm.Communicator) and (comm.rank, comm.world_size) == (R, W)


def x(rank, n=12, dtype=torch.float32, salt=0):
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 11 + rank).to(dtype)


def eq(name, got, want):
    assert torch.equal(got, want), f"{name}: got {got}, expected {want}"


def ok(name):
    print(f"ok {name}", flush=True)


every = lambda **k: [x(r, **k) for r in range(W)]  # noqa: E731

# all_reduce: every op, sync and async, contiguous or not, several dtypes
ops = {
    dist.ReduceOp.SUM: lambda s: s.sum(0),
    dist.ReduceOp.PRODUCT: lambda s: s.prod(0),
    dist.ReduceOp.MIN: lambda s: s.min(0).values,
    dist.ReduceOp.MAX: lambda s: s.max(0).values,
    dist.ReduceOp.AVG: lambda s: s.sum(0) / W,
}
for dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16, torch.float16):
    for op, ref in ops.items():
        if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
            continue
        small = op == dist.ReduceOp.PRODUCT
        mk = (lambda r: (x(r, dtype=torch.int64) % 3 + 1).to(dtype)) if small else (lambda r: x(r, dtype=dtype))
        t = mk(R)
        dist.all_reduce(t, op=op)
        want = ref(torch.stack([mk(r).double() for r in range(W)])).to(dtype)
        eq(f"all_reduce {dtype} {op}", t, want)
t = x(R)
work = dist.all_reduce(t, async_op=True)
work.wait()
eq("all_reduce async", t, sum(every()))
t = x(R)
fut = dist.all_reduce(t, async_op=True).get_future()
eq("all_reduce future", fut.wait()[0], sum(every()))
m = torch.stack([x(R), x(R, salt=1)]).t()  # (12, 2), not contiguous
assert not m.is_contiguous()
dist.all_reduce(m)
eq("all_reduce non-contiguous", m, torch.stack([sum(every()), sum(every(salt=1))]).t())
ok("all_reduce: SUM PRODUCT MIN MAX AVG, 6 dtypes, async, future, non-contiguous")

# broadcast, reduce
for root in range(W):
    t = x(R)
    dist.broadcast(t, src=root)
    eq(f"broadcast root={root}", t, x(root))
    t = x(R)
    dist.reduce(t, dst=root, op=dist.ReduceOp.MAX)
    if R == root:
        eq(f"reduce root={root}", t, torch.stack(every()).max(0).values)
    else:
        eq("reduce leaves non-roots", t, x(R))
h = dist.broadcast(x(R), src=0, async_op=True)
h.wait()
ok("broadcast and reduce: every root")

# all_gather (list), all_gather_into_tensor (out of place and in place)
outs = [torch.empty(12) for _ in range(W)]
dist.all_gather(outs, x(R))
for r in range(W):
    eq(f"all_gather [{r}]", outs[r], x(r))
big = torch.empty(12 * W)
dist.all_gather_into_tensor(big, x(R))
eq("all_gather_into_tensor", big, torch.cat(every()))
big2 = torch.empty(W, 12, dtype=torch.int64)
big2[R] = x(R, dtype=torch.int64)
dist.all_gather_into_tensor(big2, big2[R])
eq("all_gather_into_tensor in place", big2, torch.stack(every(dtype=torch.int64)))
big3 = torch.empty(12 * W, dtype=torch.bfloat16)
dist.all_gather_into_tensor(big3, x(R, dtype=torch.bfloat16), async_op=True).wait()
eq("all_gather_into_tensor async bf16", big3, torch.cat(every(dtype=torch.bfloat16)))
ok("all_gather, all_gather_into_tensor (out of place, in place, async)")

# reduce_scatter (list), reduce_scatter_tensor
out = torch.empty(3)
dist.reduce_scatter(out, [x(R, n=3, salt=q) for q in range(W)])
eq("reduce_scatter", out, sum(x(r, n=3, salt=R) for r in range(W)))
out = torch.empty(4)
dist.reduce_scatter_tensor(out, x(R, n=4 * W))
eq("reduce_scatter_tensor", out, sum(every(n=4 * W))[R * 4 : (R + 1) * 4])
out = torch.empty(4, dtype=torch.int32)
dist.reduce_scatter_tensor(out, x(R, n=4 * W, dtype=torch.int32), op=dist.ReduceOp.MIN, async_op=True).wait()
eq("reduce_scatter_tensor async min", out, torch.stack(every(n=4 * W, dtype=torch.int32)).min(0).values[R * 4 : (R + 1) * 4])
ok("reduce_scatter, reduce_scatter_tensor")

# all_to_all (lists), all_to_all_single (equal and uneven splits)
outs = [torch.empty(2) for _ in range(W)]
dist.all_to_all(outs, [x(R, n=2, salt=q) for q in range(W)])
for p in range(W):
    eq(f"all_to_all from {p}", outs[p], x(p, n=2, salt=R))
out = torch.empty(3 * W)
dist.all_to_all_single(out, x(R, n=3 * W))
eq("all_to_all_single", out, torch.cat([x(p, n=3 * W)[R * 3 : (R + 1) * 3] for p in range(W)]))
rows = lambda p, q: p + q + 1  # noqa: E731
inp = torch.arange(sum(rows(R, q) for q in range(W)) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * R
out = torch.empty(sum(rows(p, R) for p in range(W)), 2, dtype=torch.float64)
dist.all_to_all_single(out, inp, output_split_sizes=[rows(p, R) for p in range(W)], input_split_sizes=[rows(R, q) for q in range(W)])
want = []
for p in range(W):
    src = torch.arange(sum(rows(p, q) for q in range(W)) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * p
    start = sum(rows(p, q) for q in range(R))
    want.append(src[start : start + rows(p, R)])
eq("all_to_all_single uneven", out, torch.cat(want))
ok("all_to_all, all_to_all_single (equal, uneven)")

# gather, scatter
for root in range(W):
    g = [torch.empty(5) for _ in range(W)] if R == root else None
    dist.gather(x(R, n=5), gather_list=g, dst=root)
    if R == root:
        for p in range(W):
            eq(f"gather root={root} [{p}]", g[p], x(p, n=5))
    out = torch.empty(5)
    dist.scatter(out, scatter_list=[x(root, n=5, salt=q) for q in range(W)] if R == root else None, src=root)
    eq(f"scatter root={root}", out, x(root, n=5, salt=R))
ok("gather and scatter: every root")

# point-to-point
if W > 1:
    nxt, prv = (R + 1) % W, (R - 1) % W
    got = torch.empty(20)
    if R % 2 == 0:
        dist.send(x(R, n=20), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(x(R, n=20), dst=nxt)
    eq("send/recv", got, x(prv, n=20))
    got = torch.empty(20)
    reqs = [dist.isend(x(R, n=20, salt=1), dst=nxt, tag=4), dist.irecv(got, src=prv, tag=4)]
    for q in reqs:
        q.wait()
    eq("isend/irecv", got, x(prv, n=20, salt=1))
    ok("send/recv, isend/irecv")

# barrier, subgroups (a second hcomm communicator bootstrapped through the store)
dist.barrier()
if W > 1:
    sub = dist.new_group(ranks=[0, 1], backend="hcomm")
    if R < 2:
        t = x(R)
        dist.all_reduce(t, group=sub)
        eq("subgroup all_reduce", t, x(0) + x(1))
    dist.barrier()
    ok("barrier, new_group")

# wrong device / unsupported op: clear errors
try:
    dist.all_reduce(torch.ones(2, dtype=torch.float32), op=dist.ReduceOp.BAND)
    raise AssertionError("BAND on float32 must be refused")
except (ValueError, RuntimeError) as e:
    assert "BAND" in str(e) and "float32" in str(e), e
ok("errors")

# A subgroup whose communicator is destroyed refuses calls (the backend must not keep using it).
if W > 1:
    sub2 = dist.new_group(ranks=list(range(W)), backend="hcomm")
    hcomm.torch.communicator_of(sub2).destroy()
    try:
        dist.all_reduce(torch.ones(2), group=sub2)
        raise AssertionError("a destroyed communicator must refuse")
    except (hcomm.HcommError, RuntimeError) as e:
        assert "destroyed" in str(e), e
    ok("destroyed communicator refused")

dist.destroy_process_group()
print("WORKER OK", flush=True)
