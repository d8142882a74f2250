"""Every call of the hcomm Python API on one kind of tensor (numpy or torch), checked against
numpy references computed from every rank's (deterministic) input. Run by each rank:

    python -m hcomm run -n N python collectives.py numpy|torch

Prints one "ok NAME" line per check and "WORKER OK" at the end; any mismatch raises.
"""

import sys

import numpy as np

import hcomm

KIND = sys.argv[1]
assert KIND in ("numpy", "torch"), KIND
if KIND == "torch":
    import torch

comm = hcomm.InitHcom("tests")
R, W = hcomm.GetRank(), hcomm.GetWorldSize()
assert (comm.rank, comm.world_size) == (R, W)
assert 0 <= hcomm.GetLocalRank() < W

DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint32", "uint64"]
try:  # numpy has bfloat16 only through ml_dtypes
    import ml_dtypes  # noqa: F401

    HAVE_NP_BF16 = True
except ImportError:
    HAVE_NP_BF16 = False
if KIND == "torch" or HAVE_NP_BF16:
    DTYPES.append("bfloat16")

FLOATS = {"float32", "float64", "float16", "bfloat16"}
SHAPE = (12, 3)  # dim 0 divides by 1, 2, 3, 4


def np_dtype(name):
    if name == "bfloat16":
        return np.float32 if KIND == "torch" else np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def T(arr, dtype):
    """A tensor of this run's kind holding `arr` (a numpy array of small integers)."""
    if KIND == "numpy":
        return np.ascontiguousarray(arr.astype(np_dtype(dtype)))
    if dtype == "bfloat16":
        return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr.astype(np.dtype(dtype))))


def N(t):
    """A tensor as a float64 / int64 numpy array."""
    if t is None:
        return None
    if KIND == "torch":
        t = t.float() if t.dtype == torch.bfloat16 else t
        a = t.numpy()
    else:
        a = t
    if a.dtype.kind == "f" or str(a.dtype) == "bfloat16":
        return a.astype(np.float64)
    return a.astype(np.int64)


def inp(rank, dtype, shape=SHAPE, salt=0, small=False):
    """Rank `rank`'s input: small non-negative integers, exact in every dtype."""
    n = int(np.prod(shape))
    i = np.arange(n).reshape(shape)
    if small:  # for prod: values 1..3, products of up to 4 ranks stay <= 81
        return (i + rank + salt) % 3 + 1
    return (i * 7 + rank * 3 + salt) % 11 + rank


def wrap(x, dtype):
    """Integer reference values with the dtype's wrap-around (hcomm's integer sum/prod wrap)."""
    if dtype in FLOATS:
        return x.astype(np.float64)
    return x.astype(np.int64).astype(np.dtype(dtype)).astype(np.int64)


def reference(op, dtype, arrays):
    a = np.stack([x.astype(np.int64) for x in arrays])
    if op == "sum":
        return wrap(a.sum(0), dtype)
    if op == "prod":
        return wrap(a.prod(0), dtype)
    if op == "min":
        return wrap(a.min(0), dtype)
    if op == "max":
        return wrap(a.max(0), dtype)
    if op == "mean":
        s = wrap(a.sum(0), dtype)
        return s / W if dtype in FLOATS else s // W  # inputs are non-negative: truncation = floor
    raise ValueError(op)


def check(name, got, want, dtype):
    got = N(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    if dtype in ("float16", "bfloat16"):
        np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=name)
    elif dtype in FLOATS:
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
    else:
        np.testing.assert_array_equal(got, want, err_msg=name)


def ok(name):
    print(f"ok {name}", flush=True)


def same_object(a, b):
    return a is b


# ---------------------------------------------------------------- all-reduce

for dtype in DTYPES:
    for op in hcomm.OPS:
        small = op == "prod"
        t = T(inp(R, dtype, small=small), dtype)
        res = hcomm.AllReduce(t, op=op)
        assert same_object(res, t), "AllReduce is in place and returns its tensor"
        check(f"all_reduce {dtype} {op}", t, reference(op, dtype, [inp(r, dtype, small=small) for r in range(W)]), dtype)
    src = T(inp(R, dtype), dtype)
    keep = N(src).copy()
    out = T(np.zeros(SHAPE), dtype)
    res = hcomm.all_reduce(src, op="max", out=out)
    assert same_object(res, out)
    check(f"all_reduce out= {dtype}", out, reference("max", dtype, [inp(r, dtype) for r in range(W)]), dtype)
    check(f"all_reduce out= leaves the input {dtype}", src, keep, dtype)
ok("all_reduce: every dtype x op, in place and out=")

# ---------------------------------------------------------------- all-gather

for dtype in DTYPES:
    t = T(inp(R, dtype), dtype)
    every = [inp(r, dtype) for r in range(W)]
    for dim in (0, 1, -1):
        res = hcomm.AllGather(t, dim=dim)
        check(f"all_gather {dtype} dim={dim}", res, np.concatenate(every, axis=dim), dtype)
    check(f"all_gather leaves the input {dtype}", t, inp(R, dtype), dtype)
    out = T(np.zeros((SHAPE[0] * W, SHAPE[1])), dtype)
    assert same_object(hcomm.all_gather(t, dim=0, out=out), out)
    check(f"all_gather out= {dtype}", out, np.concatenate(every, axis=0), dtype)
doc = T(np.full((1024, 256), R), "float32")
assert tuple(hcomm.AllGather(doc).shape) == (1024, 256 * W), "the documented example"
ok("all_gather: every dtype, dims 0/1/-1, out=, (1024, 256) -> (1024, 256 x world_size)")

# ---------------------------------------------------------------- reduce-scatter

n = SHAPE[0] // W
for dtype in DTYPES:
    for op in ("sum", "max", "mean"):
        t = T(inp(R, dtype), dtype)
        res = hcomm.ReduceScatter(t, op=op)
        want = reference(op, dtype, [inp(r, dtype) for r in range(W)])[R * n : (R + 1) * n]
        check(f"reduce_scatter {dtype} {op}", res, want, dtype)
ok("reduce_scatter: every dtype, sum/max/mean, share along dim 0")

# ---------------------------------------------------------------- broadcast, reduce

for dtype in DTYPES:
    for root in range(W):
        t = T(inp(R, dtype), dtype)
        assert same_object(hcomm.Broadcast(t, root_rank=root), t)
        check(f"broadcast {dtype} root={root}", t, inp(root, dtype), dtype)
        t = T(inp(R, dtype), dtype)
        res = hcomm.Reduce(t, op="sum", root_rank=root)
        want = reference("sum", dtype, [inp(r, dtype) for r in range(W)])
        if R == root:
            assert same_object(res, t)
            check(f"reduce {dtype} root={root}", t, want, dtype)
        else:
            assert res is None
            check(f"reduce leaves non-roots {dtype}", t, inp(R, dtype), dtype)
        out = T(np.zeros(SHAPE), dtype)
        res = hcomm.reduce(T(inp(R, dtype), dtype), op="min", root_rank=root, out=out)
        if R == root:
            check(f"reduce out= {dtype}", res, reference("min", dtype, [inp(r, dtype) for r in range(W)]), dtype)
ok("broadcast and reduce: every dtype and root, in place and out=")

# ---------------------------------------------------------------- gather, scatter

for dtype in DTYPES:
    every = [inp(r, dtype) for r in range(W)]
    for root in range(W):
        for dim in (0, 1):
            res = hcomm.Gather(T(inp(R, dtype), dtype), root_rank=root, dim=dim)
            if R == root:
                check(f"gather {dtype} root={root} dim={dim}", res, np.concatenate(every, axis=dim), dtype)
            else:
                assert res is None
        full = T(inp(root, dtype, salt=5), dtype)  # only the root's content matters
        res = hcomm.Scatter(full, root_rank=root)
        check(f"scatter {dtype} root={root}", res, inp(root, dtype, salt=5)[R * n : (R + 1) * n], dtype)
        if R != root:
            out = T(np.zeros((n, SHAPE[1])), dtype)
            assert same_object(hcomm.scatter(None, root_rank=root, out=out), out)
        else:
            hcomm.scatter(full, root_rank=root)
ok("gather and scatter: every dtype and root, dims 0/1")

# ---------------------------------------------------------------- all-to-all

for dtype in DTYPES:
    t = T(inp(R, dtype), dtype)
    res = hcomm.AllToAll(t)
    want = np.concatenate([inp(p, dtype)[R * n : (R + 1) * n] for p in range(W)])
    check(f"all_to_all {dtype}", res, want, dtype)
# uneven: rank p sends (p + q + 1) rows to rank q
rows = lambda p, q: p + q + 1  # noqa: E731
send_counts = [rows(R, q) for q in range(W)]
recv_counts = [rows(p, R) for p in range(W)]


def a2a_input(p):
    return np.arange(sum(rows(p, q) for q in range(W)) * 2).reshape(-1, 2) + 100 * p


res = hcomm.AllToAll(T(a2a_input(R), "int32"), send_counts=send_counts, recv_counts=recv_counts)
parts = []
for p in range(W):
    start = sum(rows(p, q) for q in range(R))
    parts.append(a2a_input(p)[start : start + rows(p, R)])
check("all_to_all uneven counts", res, np.concatenate(parts), "int32")
ok("all_to_all: every dtype, equal blocks and uneven counts")

hcomm.Barrier()
ok("barrier")

# ---------------------------------------------------------------- async forms

works = []
a = T(inp(R, "float32"), "float32")
works.append(("all_reduce", hcomm.AllReduceAsync(a, op="sum"), reference("sum", "float32", [inp(r, "float32") for r in range(W)])))
works.append(("all_gather", hcomm.AllGatherAsync(T(inp(R, "int64"), "int64"), dim=1), np.concatenate([inp(r, "int64") for r in range(W)], axis=1)))
works.append(("reduce_scatter", hcomm.ReduceScatterAsync(T(inp(R, "int32"), "int32")), reference("sum", "int32", [inp(r, "int32") for r in range(W)])[R * n : (R + 1) * n]))
works.append(("broadcast", hcomm.BroadcastAsync(T(inp(R, "float64"), "float64"), root_rank=W - 1), inp(W - 1, "float64")))
works.append(("all_to_all", hcomm.AllToAllAsync(T(inp(R, "int16"), "int16")), np.concatenate([inp(p, "int16")[R * n : (R + 1) * n] for p in range(W)])))
red = hcomm.ReduceAsync(T(inp(R, "int64"), "int64"), op="max", root_rank=0)
gat = hcomm.GatherAsync(T(inp(R, "uint8"), "uint8"), root_rank=0, dim=1)
sca = hcomm.ScatterAsync(T(inp(0, "float32", salt=1), "float32"), root_rank=0)
bar = hcomm.BarrierAsync()
for name, w, want in works:
    dtype = {"all_reduce": "float32", "all_gather": "int64", "reduce_scatter": "int32", "broadcast": "float64", "all_to_all": "int16"}[name]
    check(f"{name} async", hcomm.Wait(w), want, dtype)
    assert w.is_completed()
assert works[0][1].wait() is a, "an in-place async result is the tensor itself"
r = red.wait()
if R == 0:
    check("reduce async", r, reference("max", "int64", [inp(p, "int64") for p in range(W)]), "int64")
else:
    assert r is None
g = gat.wait()
if R == 0:
    check("gather async", g, np.concatenate([inp(p, "uint8") for p in range(W)], axis=1), "uint8")
check("scatter async", sca.wait(), inp(0, "float32", salt=1)[R * n : (R + 1) * n], "float32")
assert bar.wait() is None and bar.is_completed()
# Issue order: a blocking call after async ones sees their results.
x = T(np.ones(1000), "float32")
h1 = hcomm.AllReduceAsync(x)
h2 = hcomm.AllReduceAsync(x)  # same tensor twice: runs after h1
y = T(np.ones(4), "int32")
hcomm.AllReduce(y)  # waits for h1 and h2 (issue order)
assert h1.is_completed() and h2.is_completed(), "blocking calls wait for earlier async ones"
check("async issue order", x, np.full(1000, float(W * W)), "float32")
# A dropped handle: the operation still runs, its tensors stay alive until it ends.
hcomm.AllReduceAsync(T(np.ones(1 << 16), "float32"))
z = T(np.full(3, R), "int64")
hcomm.AllReduce(z)
check("after a dropped async handle", z, np.full(3, sum(range(W))), "int64")
ok("async forms: all collectives, Wait(handle), is_completed, issue order, dropped handles")

# ---------------------------------------------------------------- fusion

sizes = [(5, "float32"), (300, "float32"), (7, "int64"), (4000, "float32"), (1, "float64"), (50, "int32")]
if "bfloat16" in DTYPES:
    sizes.append((33, "bfloat16"))
fusion = comm.fusion(op="sum", cap_bytes=2048, first_bucket_bytes=256, direct_bytes=8000)
for step in range(2):
    tensors = [T(inp(R, d, shape=(k,), salt=step), d) for k, d in sizes]
    with fusion.step() as b:
        for t in tensors:
            b.push(t)
    assert fusion.last_step_buckets >= 3, fusion.last_step_buckets
    for (k, d), t in zip(sizes, tensors):
        check(f"fusion step {step} {d}[{k}]", t, reference("sum", d, [inp(r, d, shape=(k,), salt=step) for r in range(W)]), d)
tensors = [T(inp(R, d, shape=(k,)), d) for k, d in sizes]
res = hcomm.AllReduceCoalesced(tensors, op="max", cap_bytes=1024)
assert all(a is b for a, b in zip(res, tensors))
for (k, d), t in zip(sizes, tensors):
    check(f"all_reduce_coalesced {d}[{k}]", t, reference("max", d, [inp(r, d, shape=(k,)) for r in range(W)]), d)
ok("fusion: Fusion steps and AllReduceCoalesced equal per-tensor all-reduces")

# ---------------------------------------------------------------- point-to-point

if W > 1:
    nxt, prv = (R + 1) % W, (R - 1) % W
    for dtype in DTYPES:
        out = T(np.zeros(SHAPE), dtype)
        # point-to-point by rank and tag, both directions of a ring
        if R % 2 == 0:
            hcomm.Send(T(inp(R, dtype), dtype), nxt, tag=11)
            hcomm.Recv(out, prv, tag=11)
        else:
            hcomm.Recv(out, prv, tag=11)
            hcomm.Send(T(inp(R, dtype), dtype), nxt, tag=11)
        check(f"send/recv {dtype}", out, inp(prv, dtype), dtype)
    # connections (HCCL style): a ring of connections with tag 5
    to_next = hcomm.CreateConnection(nxt, tag=5)
    from_prev = to_next if W == 2 else hcomm.CreateConnection(prv, tag=5)
    buf = T(np.zeros(64), "float32")
    if R % 2 == 0:
        hcomm.Send(T(np.full(64, R), "float32"), to_next)
        hcomm.Recv(buf, from_prev)
    else:
        hcomm.Recv(buf, from_prev)
        hcomm.Send(T(np.full(64, R), "float32"), to_next)
    check("connection send/recv", buf, np.full(64, prv), "float32")
    hcomm.DestroyConnection(to_next)
    if from_prev is not to_next:
        hcomm.DestroyConnection(from_prev)
    try:
        to_next.send(buf)
        raise AssertionError("a closed connection must refuse to send")
    except hcomm.InvalidArgumentError:
        pass
    # signals
    if R == 0:
        for p in range(1, W):
            hcomm.Signal(p, tag=21)
        for p in range(1, W):
            hcomm.Wait(src_rank=p, tag=22)
    else:
        hcomm.Wait(src_rank=0, tag=21)
        hcomm.Signal(0, tag=22)
    # async send/recv (eager-sized: operations run in issue order, so an async send that
    # waits for its receiver would hold up this rank's own receive)
    big = T(np.arange(10000) % 100 + R, "int32")
    got = T(np.zeros(10000), "int32")
    hs = hcomm.SendAsync(big, nxt, tag=30)
    hr = hcomm.RecvAsync(got, prv, tag=30)
    hs.wait()
    assert hr.wait() is got
    check("async send/recv", got, np.arange(10000) % 100 + prv, "int32")
    # a wait with a timeout that passes is not fatal: the operation goes on
    if R == 0:
        w = comm.wait_async(1, tag=40)
        try:
            w.wait(timeout=0.05)
            raise AssertionError("the signal comes 0.3 s later")
        except hcomm.HcommTimeoutError as e:
            assert not e.fatal and not w.is_completed()
        hcomm.Wait(w)
        assert w.is_completed()
    elif R == 1:
        import time

        time.sleep(0.3)
        hcomm.Signal(0, tag=40)
    ok("point-to-point: send/recv by rank and tag, connections, signals, async, wait timeouts")

hcomm.Barrier()
hcomm.DestroyHcom()
try:
    hcomm.GetRank()
    raise AssertionError("calls after DestroyHcom must fail")
except hcomm.HcommError:
    pass
print("WORKER OK", flush=True)
