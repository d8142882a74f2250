"""torch.distributed conformance of the "hcomm" backend (issue #18): what a PyTorch user runs
on gloo runs on hcomm, with the same results. Every case runs the same operations on the
default (hcomm) group and on a gloo group over the same inputs, and compares. Run under a
launcher that sets torch's variables:

    python -m hcomm run -n N python torch_conformance.py CASE

CASE is one of is_completed, detail, reduce_ops, monitored_barrier, powersgd, future_error,
fsdp, entry_points, reductions. Prints "ok <check>" lines and WORKER OK at the end.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

import hcomm
import hcomm.torch as ht
from _gloo_exit import leave

torch.set_num_threads(1)  # ranks share the cores

CASE = sys.argv[1]
dist.init_process_group("hcomm", timeout=datetime.timedelta(seconds=60))
R, W = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")


def ok(name):
    print(f"ok {name}", flush=True)


def x(rank, n=12, dtype=torch.float32, salt=0):
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 11 + rank).to(dtype)


def eq(name, got, want):
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert torch.equal(got, want), f"{name}: got {got}, expected {want}"


def both(f):
    """f(group) on hcomm (default group) and gloo; their results (clones)."""
    return f(None), f(gloo)


def poll(name, work, limit=30.0):
    """Poll `work.is_completed()` (never wait()) until it is True, within `limit` seconds."""
    deadline = time.monotonic() + limit
    while not work.is_completed():
        assert time.monotonic() < deadline, f"{name}: is_completed() still False after {limit} s"
        time.sleep(0.001)
    assert work.is_success(), f"{name}: is_success() False after completion"
    assert work.exception() is None, f"{name}: exception() {work.exception()}"


# ----------------------------------------------------------------------------------------------
if CASE == "is_completed":
    # 1. wait() then is_completed(), on hcomm and on gloo, for async collectives and p2p
    for group in (None, gloo):
        tag = "gloo" if group is gloo else "hcomm"
        t = x(R)
        w = dist.all_reduce(t, async_op=True, group=group)
        w.wait()
        assert w.is_completed(), f"{tag}: all_reduce is_completed() False after wait()"
        eq(f"{tag} all_reduce", t, sum(x(r) for r in range(W)))
    ok("is_completed after wait (all_reduce, hcomm and gloo)")

    # 2. polling loops (no wait) end, and the results are there when they do
    t = x(R)
    poll("all_reduce", dist.all_reduce(t, async_op=True))
    eq("polled all_reduce", t, sum(x(r) for r in range(W)))
    m = torch.stack([x(R), x(R, salt=1)]).t()  # not contiguous: copied out on completion
    poll("all_reduce non-contiguous", dist.all_reduce(m, async_op=True))
    eq("polled non-contiguous all_reduce", m, torch.stack([sum(x(r) for r in range(W)), sum(x(r, salt=1) for r in range(W))]).t())
    t = x(R)
    poll("broadcast", dist.broadcast(t, src=W - 1, async_op=True))
    eq("polled broadcast", t, x(W - 1))
    big = torch.empty(12 * W)
    poll("all_gather_into_tensor", dist.all_gather_into_tensor(big, x(R), async_op=True))
    eq("polled all_gather_into_tensor", big, torch.cat([x(r) for r in range(W)]))
    out = torch.empty(4)
    poll("reduce_scatter_tensor", dist.reduce_scatter_tensor(out, x(R, n=4 * W), async_op=True))
    eq("polled reduce_scatter_tensor", out, sum(x(r, n=4 * W) for r in range(W))[R * 4 : (R + 1) * 4])
    out = torch.empty(3 * W)
    poll("all_to_all_single", dist.all_to_all_single(out, x(R, n=3 * W), async_op=True))
    eq("polled all_to_all_single", out, torch.cat([x(p, n=3 * W)[R * 3 : (R + 1) * 3] for p in range(W)]))
    poll("barrier", dist.barrier(async_op=True))
    poll("all_gather (list)", dist.all_gather([torch.empty(12) for _ in range(W)], x(R), async_op=True))
    # several in flight, polled together
    ts = [x(R, salt=k) for k in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    deadline = time.monotonic() + 30
    while not all(w.is_completed() for w in works):
        assert time.monotonic() < deadline, "5 all_reduces in flight: not all completed"
        time.sleep(0.001)
    for k, t in enumerate(ts):
        eq(f"polled all_reduce {k}", t, sum(x(r, salt=k) for r in range(W)))
    # the future of a polled work, and the work of a waited future
    t = x(R)
    w = dist.all_reduce(t, async_op=True)
    poll("all_reduce then future", w)
    eq("future after polling", w.get_future().wait()[0], sum(x(r) for r in range(W)))
    w = dist.all_reduce(t := x(R), async_op=True)
    w.get_future().wait()
    poll("all_reduce after its future", w, limit=5)
    ok("polling is_completed() ends (all_reduce, non-contiguous, broadcast, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, barrier, all_gather, 5 in flight, futures)")

    # 3. p2p: isend/irecv (and batch_isend_irecv), on hcomm and gloo
    nxt, prv = (R + 1) % W, (R - 1) % W
    for group in (None, gloo):
        tag = "gloo" if group is gloo else "hcomm"
        got = torch.empty(20)
        reqs = [dist.isend(x(R, n=20), dst=nxt, tag=3, group=group), dist.irecv(got, src=prv, tag=3, group=group)]
        for q in reqs:
            q.wait()
            assert q.is_completed(), f"{tag}: p2p is_completed() False after wait()"
        eq(f"{tag} isend/irecv", got, x(prv, n=20))
    # polled (gloo's send and receive complete only in wait(), so this is hcomm's alone)
    got = torch.empty(20)
    reqs = [dist.isend(x(R, n=20, salt=1), dst=nxt, tag=4), dist.irecv(got, src=prv, tag=4)]
    for i, q in enumerate(reqs):
        poll(f"p2p {i}", q)
    eq("polled isend/irecv", got, x(prv, n=20, salt=1))
    ok("p2p is_completed after wait (hcomm and gloo) and by polling")

    # 4. other backends' handles are answered as before (gloo's own, in flight then done)
    t = torch.ones(1 << 16)
    w = dist.all_reduce(t, async_op=True, group=gloo)
    w.wait()
    assert w.is_completed() and w.is_success()
    ok("gloo handles unchanged")

# ----------------------------------------------------------------------------------------------
elif CASE == "detail":
    assert os.environ.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL"
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    wrapped = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert type(wrapped).__name__ == "_ProcessGroupWrapper", type(wrapped)
    comm = ht.communicator_of()
    assert (comm.rank, comm.world_size) == (R, W)

    def run(group):
        res = {}
        t = x(R)
        dist.all_reduce(t, group=group)
        res["all_reduce"] = t
        t = x(R, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        res["all_reduce async max"] = t
        t = x(R)
        dist.broadcast(t, src=W - 1, group=group)
        res["broadcast"] = t
        outs = [torch.empty(12) for _ in range(W)]
        dist.all_gather(outs, x(R), group=group)
        res["all_gather"] = torch.cat(outs)
        big = torch.empty(12 * W)
        dist.all_gather_into_tensor(big, x(R), group=group)
        res["all_gather_into_tensor"] = big
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, x(R, n=4 * W), group=group)
        res["reduce_scatter_tensor"] = out
        out = torch.empty(3 * W)
        dist.all_to_all_single(out, x(R, n=3 * W), group=group)
        res["all_to_all_single"] = out
        t = x(R)
        dist.reduce(t, dst=0, group=group)
        res["reduce"] = t if R == 0 else torch.zeros(0)
        dist.barrier(group=group)
        nxt, prv = (R + 1) % W, (R - 1) % W
        got = torch.empty(8)
        reqs = [dist.isend(x(R, n=8), dst=nxt, group=group), dist.irecv(got, src=prv, group=group)]
        for q in reqs:
            q.wait()
        res["isend/irecv"] = got
        return res

    h, g = both(run)
    for k in h:
        eq(f"DETAIL {k} hcomm vs gloo", h[k], g[k])
    ok("collectives under DETAIL equal gloo's (all_reduce sync/async, broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, reduce, barrier, isend/irecv)")

    # DETAIL's point: a collective called differently on the ranks is caught before it runs
    for group in (None, gloo):
        try:
            dist.all_reduce(torch.ones(4 + R), group=group)
            raise AssertionError("DETAIL must catch tensors of different shapes")
        except RuntimeError as e:
            assert "mismatch" in str(e).lower() or "Mismatch" in str(e), e
    t = x(R)
    dist.all_reduce(t)
    eq("all_reduce after a caught mismatch", t, sum(x(r) for r in range(W)))
    ok("DETAIL catches mismatched collectives on hcomm as on gloo")

    # DDP under DETAIL, two steps, the same parameters as averaging the gradients over gloo
    # by hand (DDP on a gloo subgroup crashes under DETAIL in torch itself, hcomm or not)
    def model():
        torch.manual_seed(7)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    params = []
    for use_ddp in (True, False):
        m = model()
        net = torch.nn.parallel.DistributedDataParallel(m) if use_ddp else m
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(5 + R)
        for _ in range(2):
            opt.zero_grad()
            net(torch.randn(4, 8, generator=gen)).square().mean().backward()
            if not use_ddp:
                for p in m.parameters():
                    p.grad.div_(W)  # as DDP does, before summing
                    dist.all_reduce(p.grad, group=gloo)
            opt.step()
        params.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=1e-6)
    ok("DDP under DETAIL equals gloo's")

# ----------------------------------------------------------------------------------------------
elif CASE == "reduce_ops":
    Op = dist.ReduceOp

    def ints(rank, dtype, salt=0, n=24):
        v = (torch.arange(n, dtype=torch.int64) * 37 + rank * 11 + salt * 5) % 251
        if dtype == torch.bool:
            return (v % 3 != 0) if rank % 2 else (v % 2 == 0)
        return v.to(dtype)

    def fold(op, rows):
        acc = rows[0].clone()
        f = {Op.BAND: torch.bitwise_and, Op.BOR: torch.bitwise_or, Op.BXOR: torch.bitwise_xor}[op]
        for r in rows[1:]:
            acc = f(acc, r)
        return acc

    checked = 0
    # bitwise ops on integer and bool tensors; bool with SUM/PRODUCT/MIN/MAX too
    cases = [(dt, op) for dt in (torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool) for op in (Op.BAND, Op.BOR, Op.BXOR)]
    cases += [(torch.bool, op) for op in (Op.SUM, Op.PRODUCT, Op.MIN, Op.MAX)]
    for dt, op in cases:
        name = f"{op} {dt}"
        if op in (Op.BAND, Op.BOR, Op.BXOR):
            want = fold(op, [ints(r, dt) for r in range(W)])
        else:  # bools: SUM and MAX are OR, PRODUCT and MIN are AND
            stack = torch.stack([ints(r, dt) for r in range(W)])
            want = stack.any(0) if op in (Op.SUM, Op.MAX) else stack.all(0)

        def run(group):
            res = {}
            t = ints(R, dt)
            dist.all_reduce(t, op=op, group=group)
            res["all_reduce"] = t
            t = ints(R, dt)
            dist.all_reduce(t, op=op, group=group, async_op=True).wait()
            res["all_reduce async"] = t
            t = ints(R, dt)
            dist.reduce(t, dst=W - 1, op=op, group=group)
            res["reduce"] = t if R == W - 1 else ints(R, dt)
            out = torch.empty(24 // W if 24 % W == 0 else 8, dtype=dt)
            n = out.numel()
            dist.reduce_scatter_tensor(out, ints(R, dt, n=n * W), op=op, group=group)
            res["reduce_scatter_tensor"] = out
            out = torch.empty(5, dtype=dt)
            dist.reduce_scatter(out, [ints(R, dt, salt=q, n=5) for q in range(W)], op=op, group=group)
            res["reduce_scatter"] = out
            return res

        h = run(None)
        eq(f"all_reduce {name}", h["all_reduce"], want)
        eq(f"all_reduce async {name}", h["all_reduce async"], want)
        eq(f"reduce {name}", h["reduce"], want if R == W - 1 else ints(R, dt))
        try:
            g = run(gloo)
        except (RuntimeError, ValueError) as e:  # a combination gloo refuses: the reference
            print(f"gloo refuses {name}: {str(e).splitlines()[0]}", flush=True)
            g = None
        if g is not None:
            for k in h:
                eq(f"{k} {name} hcomm vs gloo", h[k], g[k])
            checked += 1
        else:
            n = h["reduce_scatter_tensor"].numel()
            full = [ints(r, dt, n=n * W) for r in range(W)]
            if op in (Op.BAND, Op.BOR, Op.BXOR):
                ref = fold(op, full)
                ref5 = fold(op, [ints(r, dt, salt=R, n=5) for r in range(W)])
            else:
                st = torch.stack(full)
                ref = st.any(0) if op in (Op.SUM, Op.MAX) else st.all(0)
                st5 = torch.stack([ints(r, dt, salt=R, n=5) for r in range(W)])
                ref5 = st5.any(0) if op in (Op.SUM, Op.MAX) else st5.all(0)
            eq(f"reduce_scatter_tensor {name}", h["reduce_scatter_tensor"], ref[R * n : (R + 1) * n])
            eq(f"reduce_scatter {name}", h["reduce_scatter"], ref5)
    ok(f"BAND BOR BXOR on int32 int64 uint8 int8 bool, bool SUM PRODUCT MIN MAX: all_reduce (sync, async), reduce, reduce_scatter_tensor, reduce_scatter ({checked} of {len(cases)} compared with gloo, the rest with the reference)")

    # bool in the other collectives (as uint8 on the wire)
    def bool_run(group):
        res = {}
        t = ints(R, torch.bool)
        dist.broadcast(t, src=W - 1, group=group)
        res["broadcast"] = t
        outs = [torch.empty(24, dtype=torch.bool) for _ in range(W)]
        dist.all_gather(outs, ints(R, torch.bool), group=group)
        res["all_gather"] = torch.cat(outs)
        big = torch.empty(24 * W, dtype=torch.bool)
        dist.all_gather_into_tensor(big, ints(R, torch.bool), group=group)
        res["all_gather_into_tensor"] = big
        out = torch.empty(4 * W, dtype=torch.bool)
        dist.all_to_all_single(out, ints(R, torch.bool, n=4 * W), group=group)
        res["all_to_all_single"] = out
        return res

    h, g = both(bool_run)
    for k in h:
        eq(f"bool {k} hcomm vs gloo", h[k], g[k])
    ok("bool broadcast, all_gather, all_gather_into_tensor, all_to_all_single equal gloo's")

    # AVG: floats (hcomm's mean) and integers (the sum divided as integers are); gloo refuses
    # AVG, so its SUM divided by the ranks is the reference
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32):
        t = x(R, dtype=dt)
        dist.all_reduce(t, op=Op.AVG)
        s = x(R, dtype=dt)
        dist.all_reduce(s, op=Op.SUM, group=gloo)
        want = (s.double() / W).to(dt) if dt.is_floating_point else torch.div(s, W, rounding_mode="trunc")
        if dt == torch.bfloat16:
            torch.testing.assert_close(t, want, rtol=3e-2, atol=0)  # bf16: each addition rounds
        else:
            torch.testing.assert_close(t, want, rtol=1e-6, atol=0)
        out = torch.empty(4, dtype=dt)
        dist.reduce_scatter_tensor(out, x(R, n=4 * W, dtype=dt), op=Op.AVG)
        total = sum(x(r, n=4 * W, dtype=torch.int64) for r in range(W))[R * 4 : (R + 1) * 4]
        ref = (total.double() / W).to(dt) if dt.is_floating_point else torch.div(total, W, rounding_mode="trunc").to(dt)
        torch.testing.assert_close(out, ref, rtol=3e-2 if dt == torch.bfloat16 else 1e-6, atol=0)
    ok("AVG on float32 float64 bfloat16 int64 int32 (all_reduce vs gloo's SUM / ranks, reduce_scatter_tensor)")

    # PREMUL_SUM: scalar factor and per-rank tensor factor, as torch builds them
    premul = dist._make_nccl_premul_sum
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        # bf16 keeps 8 bits: every addition may round by half an ulp (0.4% of the value)
        tol = dict(rtol=3e-2, atol=1e-1) if dt == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        for label, make, fac in (
            ("scalar 0.25", lambda r: premul(0.25), lambda r: 0.25),
            ("tensor 1/(rank+1)", lambda r: premul(torch.tensor([1.0 / (r + 1)], dtype=torch.float64)), lambda r: 1.0 / (r + 1)),
        ):
            want = sum(x(r, dtype=torch.float64) * fac(r) for r in range(W))
            t = x(R, dtype=dt)
            dist.all_reduce(t, op=make(R))
            torch.testing.assert_close(t.double(), want.to(dt).double(), **tol, msg=lambda m: f"PREMUL_SUM {label} {dt} all_reduce: {m}")
            t = x(R, dtype=dt)
            dist.all_reduce(t, op=make(R), async_op=True).wait()
            torch.testing.assert_close(t.double(), want.to(dt).double(), **tol)
            out = torch.empty(4, dtype=dt)
            inp = x(R, n=4 * W, dtype=dt)
            keep = inp.clone()
            dist.reduce_scatter_tensor(out, inp, op=make(R))
            eq("PREMUL_SUM leaves the input", inp, keep)
            full = sum(x(r, n=4 * W, dtype=torch.float64) * fac(r) for r in range(W))
            torch.testing.assert_close(out.double(), full[R * 4 : (R + 1) * 4].to(dt).double(), **tol)
            t = x(R, dtype=dt)
            dist.reduce(t, dst=0, op=make(R))
            if R == 0:
                torch.testing.assert_close(t.double(), want.to(dt).double(), **tol)
            else:
                eq("PREMUL_SUM reduce leaves non-roots", t, x(R, dtype=dt))
            # equal to gloo's SUM of the inputs premultiplied as hcomm does (in the dtype)
            g = x(R, dtype=dt).mul_(torch.tensor(fac(R), dtype=torch.float64))
            dist.all_reduce(g, group=gloo)
            t = x(R, dtype=dt)
            dist.all_reduce(t, op=make(R))
            if dt != torch.bfloat16 and W == 2:  # two addends: the same bits in any order
                eq(f"PREMUL_SUM {label} {dt} vs gloo SUM of premultiplied", t, g)
            else:  # more: the order of the additions may differ by an ulp
                torch.testing.assert_close(t, g, **tol)
    ok("PREMUL_SUM scalar and tensor factors on float32 float64 bfloat16 (all_reduce sync/async, reduce_scatter_tensor, reduce; vs gloo's SUM of the premultiplied inputs)")

    # complex: through its real view, as gloo does
    for dt in (torch.complex64, torch.complex128):
        def cx(rank, n=10, salt=0):
            return torch.complex(x(rank, n=n, dtype=torch.float64, salt=salt), -x(rank, n=n, dtype=torch.float64, salt=salt + 1)).to(dt)

        def crun(group):
            res = {}
            t = cx(R)
            dist.all_reduce(t, group=group)
            res["all_reduce"] = t
            t = cx(R)
            dist.broadcast(t, src=W - 1, group=group)
            res["broadcast"] = t
            outs = [torch.empty(10, dtype=dt) for _ in range(W)]
            dist.all_gather(outs, cx(R), group=group)
            res["all_gather"] = torch.cat(outs)
            big = torch.empty(10 * W, dtype=dt)
            dist.all_gather_into_tensor(big, cx(R), group=group)
            res["all_gather_into_tensor"] = big
            out = torch.empty(2 * W, dtype=dt)
            dist.all_to_all_single(out, cx(R, n=2 * W), group=group)
            res["all_to_all_single"] = out
            got = torch.empty(10, dtype=dt)
            nxt, prv = (R + 1) % W, (R - 1) % W
            reqs = [dist.isend(cx(R, salt=3), dst=nxt, group=group), dist.irecv(got, src=prv, group=group)]
            for q in reqs:
                q.wait()
            res["isend/irecv"] = got
            return res

        h, g = both(crun)
        for k in h:
            eq(f"{dt} {k} hcomm vs gloo", h[k], g[k])
        t = cx(R)
        dist.all_reduce(t, op=Op.AVG)
        torch.testing.assert_close(t, h["all_reduce"] / W)
        out = torch.empty(3, dtype=dt)
        dist.reduce_scatter_tensor(out, cx(R, n=3 * W))
        eq(f"{dt} reduce_scatter_tensor", out, sum(cx(r, n=3 * W) for r in range(W))[R * 3 : (R + 1) * 3])
    ok("complex64 complex128: all_reduce (SUM, AVG), broadcast, all_gather, all_gather_into_tensor, all_to_all_single, isend/irecv equal gloo's; reduce_scatter_tensor")

    # bad input: a typed error naming the op and the dtype, on every rank, nothing sent
    bad = [
        (lambda: dist.all_reduce(torch.ones(4), op=Op.BAND), ("BAND", "float32")),
        (lambda: dist.all_reduce(torch.ones(4, dtype=torch.float64), op=Op.BXOR, async_op=True), ("BXOR", "float64")),
        (lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * W), op=Op.BOR), ("BOR", "float32")),
        (lambda: dist.reduce(torch.ones(4, dtype=torch.bfloat16), dst=0, op=Op.BAND), ("BAND", "bfloat16")),
        (lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=premul(0.5)), ("PREMUL_SUM", "int32")),
        (lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool), op=Op.AVG), ("AVG", "bool")),
    ]
    for f, words in bad:
        try:
            f()
            raise AssertionError(f"{words} must be refused")
        except ValueError as e:
            assert isinstance(e, hcomm.InvalidArgumentError), type(e)
            for w in words:
                assert w in str(e), (w, str(e))
            print(f"refused: {e}", flush=True)
    t = x(R)
    dist.all_reduce(t)
    eq("all_reduce after refusals", t, sum(x(r) for r in range(W)))
    ok("bad reduce ops raise InvalidArgumentError naming op and dtype; the group stays usable")

# ----------------------------------------------------------------------------------------------
elif CASE == "monitored_barrier":
    short = datetime.timedelta(seconds=2)
    for group in (None, gloo):
        dist.monitored_barrier(group=group, timeout=short)
        dist.monitored_barrier(group=group, timeout=short, wait_all_ranks=True)
    ok("monitored_barrier passes when every rank comes (hcomm and gloo)")

    def expect_failure(wait_all, absent, expected):
        start = time.monotonic()
        try:
            dist.monitored_barrier(timeout=short, wait_all_ranks=wait_all)
            raise AssertionError("monitored_barrier must fail when a rank does not come")
        except ht.MonitoredBarrierError as e:
            took = time.monotonic() - start
            print(f"rank {R} caught {type(e).__name__}: {e} after {took:.1f} s", flush=True)
            assert isinstance(e, hcomm.HcommTimeoutError) and isinstance(e, TimeoutError)
            assert isinstance(e, dist.DistBackendError) and isinstance(e, RuntimeError)  # as gloo's
            assert 1.5 <= took <= 15, took
            if R == 0:
                assert str(e) == expected, (str(e), expected)
                assert e.peers == tuple(absent), e.peers
            else:
                assert e.peers == (0,), e.peers
                assert f"Rank {R} successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0" in str(e), str(e)

    # fail fast: rank 1 does not come; rank 0 names it
    if R == 1:
        time.sleep(3)
    else:
        expect_failure(False, [1], "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms")
    dist.barrier()  # hcomm itself was not disturbed
    # wait_all_ranks: no rank but 0 comes; rank 0 names them all
    if R == 0:
        absent = list(range(1, W))
        expect_failure(True, absent, f"[Rank 0]: Ranks {', '.join(map(str, absent))} failed to pass monitoredBarrier in 2000 ms")
    else:
        time.sleep(3)
    t = x(R)
    dist.all_reduce(t)
    eq("all_reduce after failed monitored barriers", t, sum(x(r) for r in range(W)))
    ok("monitored_barrier names the ranks that did not come (fail fast and wait_all_ranks), like gloo")

    # rank 0's time is up before it waits for anyone (timeout 0): gloo's "timed out" wording
    if R == 0:
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(0))
            raise AssertionError("monitored_barrier with timeout 0 must fail when the others do not come")
        except ht.MonitoredBarrierError as e:
            assert "Rank 0 timed out in monitoredBarrier after 0 ms" in str(e), str(e)
            assert "No ranks successfully processed" in str(e), str(e)
    dist.barrier()
    ok("monitored_barrier with timeout 0 on rank 0 says rank 0 timed out")

    # gloo, same scenario (fail fast), for its message: the same form as ours
    if R == 1:
        time.sleep(3)
    else:
        try:
            dist.monitored_barrier(group=gloo, timeout=short)
            raise AssertionError("gloo's monitored_barrier must fail")
        except RuntimeError as e:
            first = str(e).splitlines()[0]
            print(f"gloo: {first}", flush=True)
            if R == 0:
                assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in first, first
    ok("gloo's message has the same form")

# ----------------------------------------------------------------------------------------------
elif CASE == "powersgd":
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    # a hook whose future callback runs another collective and waits for it (PowerSGD's
    # pattern), on the waiter thread that completes the first future
    extra = torch.zeros(3)

    def nested_hook(group, bucket):  # the state is the group (None: the default, hcomm)
        fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()

        def then(f):
            buf = f.value()[0]
            e = torch.full((3,), float(R + 1))
            got = dist.all_reduce(e, group=group, async_op=True).get_future().wait()[0]
            extra.copy_(got)
            return buf.div_(W)

        return fut.then(then)

    def model():
        torch.manual_seed(1234)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def train(group, hook, state, steps, lr=0.05):
        m = model()
        # One bucket (DDP's default cap): a callback's collectives then cannot interleave, in a
        # different order on different ranks, with the next bucket's (on any backend).
        ddp = torch.nn.parallel.DistributedDataParallel(m, process_group=group)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        gen = torch.Generator().manual_seed(99 + R)
        for _ in range(steps):
            xb, yb = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(xb), yb).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    t0 = time.monotonic()
    ph = train(None, nested_hook, None, 3)
    pg = train(gloo, nested_hook, gloo, 3)
    assert time.monotonic() - t0 < 60
    torch.testing.assert_close(ph, pg, rtol=1e-5, atol=1e-6)
    eq("nested all_reduce result", extra, torch.full((3,), float(sum(range(1, W + 1)))))
    ok("a comm hook whose callback runs and waits for another collective: no deadlock, = gloo")

    # PowerSGD: vanilla all-reduce for 2 iterations, then low-rank compression with error
    # feedback and warm start; same seed on hcomm and gloo
    # (batched_powerSGD_hook fails in torch 2.15 itself, on gloo too: its _orthogonalize
    # asserts a batch of matrices and is handed one.)
    def psgd(group, rank):
        return powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=2, min_compression_rate=0.5, random_seed=0)

    for rank in (1, 3):  # Gram-Schmidt, QR
        name = f"powerSGD_hook rank {rank}"
        hook = powerSGD.powerSGD_hook
        t0 = time.monotonic()
        ph = train(None, hook, psgd(None, rank), 6)
        pg = train(gloo, hook, psgd(gloo, rank), 6)
        took = time.monotonic() - t0
        diff = (ph - pg).abs().max().item()
        # Two ranks add two numbers, which is exact and commutative: hcomm and gloo sum the
        # same bits, and everything else (QR, matmuls) is the same local code, so at 2 ranks
        # the parameters are identical. At 3 ranks the sums may be associated differently
        # (1 ulp per all-reduce), which PowerSGD's orthogonalisation and 6 momentum steps
        # carry along: rtol 1e-4 / atol 1e-5 is far above that and far below the update size.
        if W == 2:
            eq(f"{name} hcomm vs gloo", ph, pg)
        else:
            torch.testing.assert_close(ph, pg, rtol=1e-4, atol=1e-5)
        moved = (ph - torch.cat([p.detach().reshape(-1) for p in model().parameters()])).abs().max().item()
        assert moved > 1e-3, "training did not move the parameters"
        print(f"{name}: hcomm vs gloo max |diff| {diff:.2e} after 6 steps ({took:.1f} s)", flush=True)
    ok("DDP with PowerSGD (powerSGD_hook, approximation ranks 1 and 3) equals gloo + PowerSGD")

# ----------------------------------------------------------------------------------------------
elif CASE == "future_error":
    # A failed asynchronous operation fails its future (wait() and value() raise), also after
    # the future went through torch's C++ code: it never hands the exception over as a value.
    sub = dist.new_group(ranks=list(range(W)), backend="hcomm")
    ht.communicator_of(sub).timeout = 2
    if R == 0:
        fut = dist.all_reduce(torch.ones(4), group=sub, async_op=True).get_future()
        try:
            v = fut.wait()
            raise AssertionError(f"the future of a failed all_reduce gave a value: {v!r}")
        except RuntimeError as e:
            assert "HcommTimeoutError" in str(e) or "timed out" in str(e).lower() or "deadline" in str(e).lower(), e
            print(f"future raised: {str(e).splitlines()[0][:200]}", flush=True)
        try:
            chained = dist.all_reduce(torch.ones(4), group=sub, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
            chained.wait()
            raise AssertionError("a callback on a failed future must fail")
        except (RuntimeError, hcomm.HcommError) as e:  # the group is poisoned by then
            assert "subscriptable" not in str(e), e
    time.sleep(5)  # rank 0's deadline passes first
    dist.barrier()  # the default group is unharmed
    ok("a failed async operation fails its future")

# ----------------------------------------------------------------------------------------------
elif CASE == "fsdp":
    from torch.distributed.distributed_c10d import _coalescing_manager
    from torch.distributed.fsdp import fully_shard

    # the coalesced entry points: one Work for several asynchronous operations
    def coalesced(group):
        outs = [torch.empty(k * W) for k in (3, 5, 7)]
        with _coalescing_manager(group=group, async_ops=True) as cm:
            for k, o in zip((3, 5, 7), outs):
                dist.all_gather_into_tensor(o, x(R, n=k, salt=k), group=group)
        cm.wait()
        reds = [torch.empty(k) for k in (2, 4)]
        with _coalescing_manager(group=group, async_ops=True) as cm:
            for k, o in zip((2, 4), reds):
                dist.reduce_scatter_tensor(o, x(R, n=k * W, salt=k), group=group)
        cm.wait()
        return outs + reds

    h, g = both(coalesced)
    for a, b in zip(h, g):
        eq("coalesced hcomm vs gloo", a, b)
    ok("coalesced all_gather_into_tensor and reduce_scatter_tensor (async) equal gloo's")

    called = set()
    for name in ("all_gather_single", "reduce_scatter_single", "allreduce", "all_gather_single_coalesced", "reduce_scatter_single_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "allgather", "broadcast"):
        def spy(f, name=name):
            def call(self, *a, **k):
                called.add(name)
                return f(self, *a, **k)
            return call
        setattr(ht.HcommBackend, name, spy(getattr(ht.HcommBackend, name)))

    def model():
        torch.manual_seed(42)
        return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))

    def train_model(m, group, overlap, accumulate, compress=None):
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        if overlap:
            ht.overlap_fsdp(m)
        if compress:
            ht.compress_fsdp(m, compress)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(3 + R)
        for _ in range(4):
            opt.zero_grad()
            for _ in range(accumulate):  # micro-batches: gradients add up in .grad
                torch.nn.functional.mse_loss(m(torch.randn(6, 12, generator=gen)), torch.randn(6, 3, generator=gen)).backward()
            opt.step()
        params = [p.full_tensor().detach().clone() for p in m.parameters()]
        return (params, ht.overlap_fsdp_counts(m)) if overlap else params

    def train(group, overlap=False, accumulate=1, compress=None):
        return train_model(model(), group, overlap, accumulate, compress)

    ph = train(None)
    print(f"FSDP2 called hcomm's {sorted(called)}", flush=True)
    pg = train(gloo)
    for a, b in zip(ph, pg):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ok("FSDP2 fully_shard trains 4 steps with gloo's parameters")

    # hcomm.torch.overlap_fsdp: asynchronous all-gathers, and reduce-scatters left running
    # until backward ends; the same parameters bitwise, on both backends. With two
    # micro-batches per step the second backward accumulates into .grad, which FSDP2 reads
    # at once: those reduce-scatters must run blocking.
    for group in (None, gloo):
        plain = train(group)
        ov, counts = train(group, overlap=True)
        for a, b in zip(plain, ov):
            assert torch.equal(a, b), ("overlap_fsdp changed the parameters", group)
        if W > 1:  # 4 steps x 3 layers (the root holds no parameters; one rank: nothing to reduce)
            assert counts["overlapped"] == 4 * 3 and counts["blocking"] == 0, counts
        plain = train(group, accumulate=2)
        ov, counts = train(group, overlap=True, accumulate=2)
        for a, b in zip(plain, ov):
            assert torch.equal(a, b), ("overlap_fsdp changed the accumulated parameters", group)
        if W > 1:
            assert counts["overlapped"] == 4 * 3 and counts["blocking"] == 4 * 3, counts
            assert "accumulate" in counts["reason"], counts
    # compress_fsdp's compressed reduce-scatters (hcomm only), overlapped the same way: the
    # same parameters bitwise as compressed and blocking
    plain = train(None, compress="int8")
    ov, counts = train(None, overlap=True, compress="int8")
    for a, b in zip(plain, ov):
        assert torch.equal(a, b), "overlap_fsdp changed compress_fsdp's parameters"
    if W > 1:
        assert counts["overlapped"] == 4 * 3 and counts["blocking"] == 0, counts
    ok("overlap_fsdp leaves reduce-scatters running until backward ends; parameters bitwise the same, accumulation blocking")

# ----------------------------------------------------------------------------------------------
elif CASE == "entry_points":
    # all_gather_coalesced: output_lists[rank][tensor], tensors of different shapes (some empty,
    # some complex), one call
    def gathered(group, dtype):
        shapes = [(2, 2), (0,), (3, 3, 3), (1,), (0,)]
        ins = [(torch.arange(torch.Size(s).numel()) + 10 * R + i).reshape(s).to(dtype) for i, s in enumerate(shapes)]
        if dtype.is_complex:
            ins = [t * (1 - 2j) for t in ins]
        outs = [[torch.full(s, -1, dtype=dtype) for s in shapes] for _ in range(W)]
        dist.all_gather_coalesced(outs, ins, group=group)
        return outs

    for dtype in (torch.float32, torch.int64, torch.complex64):
        h, g = both(lambda group: gathered(group, dtype))
        for r in range(W):
            for a, b in zip(h[r], g[r]):
                eq(f"all_gather_coalesced {dtype} from rank {r}", a, b)
    try:
        dist.all_gather_coalesced([[torch.empty(4)] for _ in range(W)], [torch.empty(3)])
        raise AssertionError("all_gather_coalesced with mismatched outputs must fail")
    except ValueError as e:
        assert "allgather_coalesced" in str(e) and "[4]" in str(e) and "[3]" in str(e), str(e)
    ok("all_gather_coalesced (uneven, empty, complex) equals gloo's; mismatched outputs refused")

    # Lists of another length, shape or dtype than the tensor they go with are refused, as
    # gloo does (a tensor of another shape with as many elements used to be filled in the
    # wrong layout, and a scatter_list of the wrong length or sizes scattered its
    # concatenation). Every check is local, before anything is sent: the group stays usable.
    def refused(call, *words):
        try:
            call()
        except ValueError as e:
            assert all(w in str(e) for w in words), (words, str(e))
            return
        raise AssertionError(f"not refused: {words}")

    refused(lambda: dist.all_gather([torch.zeros(2, 3) for _ in range(W)], torch.zeros(3, 2)),
            "allgather", f"tensor_list[{R}] has shape (2, 3), expected (3, 2)")
    refused(lambda: dist.all_gather([torch.zeros(3) for _ in range(W + 1)], torch.zeros(3)),
            f"tensor_list has {W + 1} tensors, expected one per rank ({W})")
    if R == 0:  # checked on the root only: the others do not call
        refused(lambda: dist.gather(torch.zeros(3, 2), [torch.zeros(2, 3) for _ in range(W)], dst=0),
                "gather", "gather_list[0] has shape (2, 3), expected (3, 2)")
        uneven = [torch.arange(2.0), torch.arange(10.0, 14.0)] + [torch.zeros(3)] * (W - 2)
        refused(lambda: dist.scatter(torch.zeros(3), uneven, src=0),
                "scatter", "scatter_list[0] has shape (2,), expected (3,)")
        refused(lambda: dist.scatter(torch.zeros(3), [torch.zeros(3 * W)], src=0),
                f"scatter_list has 1 tensors, expected one per rank ({W})")
    refused(lambda: dist.reduce_scatter_tensor(torch.zeros(1), torch.zeros(2 * W + 1)),
            "reduce_scatter_tensor: the output has 1 elements", "world_size")
    refused(lambda: dist.all_gather_into_tensor(torch.zeros(W + 1), torch.zeros(1)),
            "all_gather_into_tensor: the output has", "world_size")
    other = (R + 1) % W
    if W > 1:
        big = torch.zeros(2 * W)
        refused(lambda: dist.all_gather_into_tensor(big, big[2 * other : 2 * other + 2]),
                f"the smaller tensor is block {other} of the larger tensor, but this is rank {R}")
        refused(lambda: dist.reduce_scatter_tensor(big[2 * other : 2 * other + 2], big),
                f"the smaller tensor is block {other} of the larger tensor, but this is rank {R}")
    out = torch.zeros(3)
    dist.scatter(out, [torch.full((3,), float(r)) for r in range(W)] if R == 0 else None, src=0)
    assert torch.equal(out, torch.full((3,), float(R))), out
    ok("lists of another length or shape are refused by name, as gloo does; the group stays usable")

    # An expand()ed tensor (stride 0) is reduced in place: every position the sum (its copy
    # back used to raise torch's "more than one element ... single memory location"). Not
    # compared with gloo, which writes all 12 elements into the 3-element storage: that
    # corrupted this process's heap.
    t = torch.full((1, 3), float(R + 1)).expand(4, 3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4, 3), float(W * (W + 1) // 2))), t
    # An all-gather into an expanded output would keep one rank's block only: refused.
    if W > 1:
        refused(lambda: dist.all_gather_into_tensor(torch.zeros(1).expand(W), torch.full((1,), float(R))),
                "differs along its expanded dimensions")
    ok("an expanded tensor is all-reduced in place")

    # sparse all-reduce with several sparse dimensions and dense ones, against gloo
    def sparse(group, sparse_dims, dense):
        n = R + 1
        idx = torch.stack([torch.arange(n)] + [torch.full((n,), (R + d) % 2) for d in range(sparse_dims - 1)])
        vals = torch.ones([n] + [2] * dense) * (R + 1)
        t = torch.sparse_coo_tensor(idx, vals, [W + 1] + [2] * (sparse_dims - 1) + [2] * dense)
        dist.all_reduce(t, group=group)
        return t.coalesce().to_dense()

    for sd, dense in ((1, 0), (2, 0), (3, 0), (2, 1), (1, 2)):
        h, g = both(lambda group: sparse(group, sd, dense))
        eq(f"sparse all_reduce {sd} sparse dims, {dense} dense", h, g)
    ok("sparse all_reduce with 1-3 sparse dimensions equals gloo's")

    # split_group: the subgroup comes from the parent's communicator (its store, no new port)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert backend.supports_splitting
    halves = [list(range(0, W, 2)), list(range(1, W, 2))]
    sub = dist.split_group(split_ranks=halves)
    mine = halves[R % 2]
    assert dist.get_world_size(sub) == len(mine) and dist.get_rank(sub) == mine.index(R)
    t = x(R)
    dist.all_reduce(t, group=sub)
    eq("all_reduce on split_group", t, sum(x(r) for r in mine))
    sub_backend = sub._get_backend(torch.device("cpu"))
    assert isinstance(sub_backend, ht.HcommBackend), type(sub_backend)
    assert sub_backend.comm.world_size == len(mine)
    dist.monitored_barrier(group=sub, timeout=datetime.timedelta(seconds=10))
    ok("split_group gives an hcomm subgroup of the parent's communicator")

    # new_group (and DeviceMesh's groups): a sub-communicator of the default group's, made
    # through hcomm's rendezvous store; nothing published in the group's torch store
    pair = [W - 1, 0]  # torch sorts the ranks: the group is [0, W-1]
    grp = dist.new_group(ranks=pair)
    if R in pair:
        gb = grp._get_backend(torch.device("cpu"))
        assert isinstance(gb, ht.HcommBackend), type(gb)
        assert "/group[0," in gb.comm.name, gb.comm.name
        assert not gb._store.check([ht._backend._STORE_KEY]), "new_group bootstrapped a rendezvous of its own"
        assert dist.get_rank(grp) == sorted(pair).index(R)
        t = x(R, salt=5)
        dist.all_reduce(t, group=grp)
        eq("all_reduce on new_group", t, sum(x(r, salt=5) for r in set(pair)))
        gathered = [torch.empty(12) for _ in set(pair)]
        dist.all_gather(gathered, x(R), group=grp)
        for got, r in zip(gathered, sorted(set(pair))):
            eq(f"all_gather on new_group from rank {r}", got, x(r))
    else:
        assert grp == dist.GroupMember.NON_GROUP_MEMBER
    world = dist.new_group()  # every rank: a second communicator of the whole world
    t = x(R, salt=9)
    dist.all_reduce(t, group=world)
    eq("all_reduce on a second world group", t, sum(x(r, salt=9) for r in range(W)))
    ok("new_group makes hcomm sub-communicators of the default group's (no new rendezvous)")

    # a timed-out collective: a DistBackendError (as gloo's) that names the timeout; get_error
    short = dist.new_group(timeout=datetime.timedelta(seconds=1))
    short_backend = short._get_backend(torch.device("cpu"))
    assert short_backend.get_error() == ErrorType.SUCCESS
    if R == 0:
        start = time.monotonic()
        try:
            dist.barrier(group=short)
            raise AssertionError("a barrier only rank 0 enters must time out")
        except dist.DistBackendError as e:
            took = time.monotonic() - start
            assert isinstance(e, hcomm.HcommTimeoutError), type(e).__mro__
            assert " timeout " in str(e) and "rank(s) [1" in str(e), str(e)
            assert 0.9 <= took <= 15, took
        assert short_backend.get_error() == ErrorType.TIMEOUT, short_backend.get_error()
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM, group=gloo, async_op=False)
        dist.broadcast(torch.ones(2), src=W, group=None)
        raise AssertionError("a broadcast from a rank out of range must fail")
    except ValueError as e:
        print(f"rank {R}: bad root refused: {e}", flush=True)
    assert backend.get_error() == ErrorType.SUCCESS  # a refused argument is no failure
    dist.barrier(group=gloo)
    ok("a timed-out collective raises DistBackendError naming the timeout; get_error reports it")

    # dist.set_timeout reaches the hcomm group (torch's C++ setTimeout alone only warns): a
    # group made with 300 s times out after 1.5 s once set, and the default group's changes
    long = dist.new_group(timeout=datetime.timedelta(seconds=300))
    dist.set_timeout(datetime.timedelta(seconds=1.5), group=long)
    assert hcomm.torch.communicator_of(long).timeout == 1.5, hcomm.torch.communicator_of(long).timeout
    if R == 0:
        try:
            dist.barrier(group=long)
            raise AssertionError("a barrier only rank 0 enters must time out")
        except dist.DistBackendError as e:
            assert "timed out after 1.5s" in str(e), str(e)
    before = hcomm.torch.communicator_of().timeout
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=77))  # the older name
    assert hcomm.torch.communicator_of().timeout == 77, hcomm.torch.communicator_of().timeout
    dist.set_timeout(datetime.timedelta(seconds=before))
    try:
        dist.set_timeout(datetime.timedelta(seconds=0), group=long)
        raise AssertionError("a zero timeout must be refused")
    except ValueError as e:
        assert "must be positive" in str(e), str(e)
    dist.barrier(group=gloo)
    ok("dist.set_timeout changes an hcomm group's timeout")

# ----------------------------------------------------------------------------------------------
elif CASE == "reductions":
    # hcomm.torch.reductions: deterministic mode and f32 accumulation for the collectives
    # issued inside the block (run over TCP by the test, where the default all-reduce of a
    # large message is a ring, not the rank-order fold)
    comm = ht.communicator_of()
    assert not comm.deterministic and comm.accumulate == "native"

    def inputs(count):
        g = torch.Generator().manual_seed(count)
        return [(torch.rand(count, generator=g) - 0.5) * 1000 for _ in range(W)]

    def fold(xs):
        acc = xs[0].clone()
        for t in xs[1:]:
            acc = acc + t
        return acc

    for count in (1000, 300_001):
        xs = inputs(count)
        with ht.reductions(deterministic=True) as c:
            assert c is comm and comm.deterministic
            t = xs[R].clone()
            dist.all_reduce(t)
            late = xs[R].clone()
            work = dist.all_reduce(late, async_op=True)
        assert not comm.deterministic  # restored; the work issued inside keeps the mode
        work.wait()
        want = fold(xs)
        assert torch.equal(t, want), f"{count}: differs from the rank-order fold"
        assert torch.equal(late, want), f"{count}: the async all_reduce issued in the block differs"
    if W >= 3:
        t = inputs(300_001)[R].clone()
        dist.all_reduce(t)
        assert not torch.equal(t, fold(inputs(300_001))), "the default ring happened to fold in rank order"
    ok("reductions(deterministic=True) gives the rank-order fold bitwise, in issue order")

    want = torch.tensor(2048.0 + (W - 1), dtype=torch.float32).to(torch.float16)
    for count in (1, 7, 100_000):
        with ht.reductions(accumulate="f32"):
            h = torch.full((count,), 2048.0 if R == 0 else 1.0, dtype=torch.float16)
            dist.all_reduce(h)
        assert (h == want).all(), f"f16, {count}: {h[:4]} (want {want})"
    assert comm.accumulate == "native"
    try:
        with ht.reductions(accumulate="f64", deterministic=True):
            raise AssertionError("reductions(accumulate='f64') was taken")
    except ValueError as e:
        assert "f64" in str(e), e
    assert not comm.deterministic and comm.accumulate == "native"
    ok("reductions(accumulate='f32') rounds f16 sums once; a bad value changes nothing")

else:
    raise SystemExit(f"unknown case {CASE}")

dist.destroy_process_group()
print("WORKER OK", flush=True)
leave()  # past torch's gloo teardown race (_gloo_exit.py)
