"""Deterministic mode from Python: `env` (HCOMM_DETERMINISTIC=1 set by the test) or `property`
(comm.deterministic = True). Every rank all-reduces random non-integer float32 vectors of two
sizes (both canonical schedules) and checks the result bitwise against the rank-order fold
computed with numpy: ((x0 + x1) + x2) + ...

`accumulate-env` (HCOMM_ACCUMULATE=f32 set by the test) or `accumulate-property`
(comm.accumulate = "f32"): f16 sums are computed in f32 and rounded once, whatever the
algorithm; "native" rounds at every step (rank 0 gives 2048, where the f16 step is 2, and the
others 1: rounded once the sum is 2048 + 2n - 2 rounded to even, step by step it stays 2048
on the ring's chunks that start at rank 0).

`skip-zeros` (2 ranks, each claiming a host of its own; `skip-zeros-off` with
HCOMM_SKIP_ZEROS=0 set by the test): the all-reduce of a mostly-zero vector gives the dense
all-reduce's bits with comm.skip_zeros on, and moves less than a quarter of its bytes.

`gather-cache` (2 ranks, each claiming a host of its own): an all-gather repeated from the same
blocks gives the same output and moves almost nothing; comm.gather_cache_budget is on by
default, settable, refuses a negative size, and 0 drops what is kept (the next repeat moves
every byte again)."""

import os
import sys

import numpy as np

import hcomm

mode = sys.argv[1]
if mode.startswith("skip-zeros") or mode == "gather-cache":
    # each rank claims a host of its own: the collective crosses "hosts" over TCP
    os.environ["HCOMM_HOST_ID"] = f"host{os.environ['RANK']}"
comm = hcomm.Communicator.from_env()
if mode.startswith("skip-zeros"):
    # skip-zeros: on by default, the bits of the dense all-reduce, fewer bytes;
    # skip-zeros-off: HCOMM_SKIP_ZEROS=0 set by the test
    r = comm.rank
    assert comm.skip_zeros == (mode == "skip-zeros"), comm.skip_zeros
    x = np.zeros(1 << 18, dtype=np.float32)  # 1 MiB: 1024 blocks of 1 KiB
    rng = np.random.default_rng(r)
    for row in rng.choice(1024, 40, replace=False):  # 40 non-zero blocks per rank
        x[row * 256:(row + 1) * 256] = rng.uniform(-1, 1, 256)
    x[5 * 256 + 3] = -0.0 if r == 0 else 0.0  # a -0.0 facing a +0.0: the dense sum gives +0.0

    def reduced(on):
        comm.skip_zeros = on
        before = sum(t.tcp_sent for t in comm.traffic())
        buf = x.copy()
        comm.all_reduce(buf)
        return buf, sum(t.tcp_sent for t in comm.traffic()) - before

    dense, dense_bytes = reduced(False)
    skipped, skip_bytes = reduced(True)
    assert skipped.tobytes() == dense.tobytes(), f"rank {r}: skipping zero blocks changed the bits"
    assert dense_bytes >= x.nbytes, dense_bytes
    assert skip_bytes * 4 < dense_bytes, f"rank {r}: {skip_bytes} bytes against the dense {dense_bytes}"
    print(f"skip-zeros ok: {skip_bytes} bytes against {dense_bytes}", flush=True)
    print("WORKER OK", flush=True)
    sys.exit(0)
if mode == "gather-cache":
    r = comm.rank
    assert comm.gather_cache_budget > 0 and comm.gather_cache_held == 0, comm.gather_cache_budget
    x = np.random.default_rng(r).standard_normal((1024, 256)).astype(np.float32)  # 1 MiB per rank

    def gathered():
        before = sum(t.tcp_sent for t in comm.traffic())
        out = comm.all_gather(x, dim=0)
        return out, sum(t.tcp_sent for t in comm.traffic()) - before

    want = np.concatenate([np.random.default_rng(q).standard_normal((1024, 256)).astype(np.float32) for q in range(2)])
    first, first_bytes = gathered()
    again, again_bytes = gathered()
    assert first.tobytes() == want.tobytes() and again.tobytes() == want.tobytes(), f"rank {r}: wrong all-gather"
    assert first_bytes >= x.nbytes and again_bytes * 100 < first_bytes, (first_bytes, again_bytes)
    assert comm.gather_cache_held == 2 * x.nbytes, comm.gather_cache_held
    try:
        comm.gather_cache_budget = -1
        raise AssertionError("a negative budget was taken")
    except ValueError as e:
        assert "gather_cache_budget" in str(e), e
    comm.gather_cache_budget = 0
    assert comm.gather_cache_held == 0
    off, off_bytes = gathered()
    assert off.tobytes() == want.tobytes() and off_bytes >= x.nbytes, off_bytes
    print(f"gather-cache ok: {again_bytes} bytes for the repeat against {first_bytes}", flush=True)
    print("WORKER OK", flush=True)
    sys.exit(0)
if mode.startswith("accumulate"):
    n, r = comm.world_size, comm.rank
    if mode == "accumulate-property":
        assert comm.accumulate == "native", comm.accumulate
        comm.accumulate = "f32"
    assert comm.accumulate == "f32" and not comm.deterministic
    try:
        comm.accumulate = "f64"
        raise AssertionError("accumulate = 'f64' was taken")
    except ValueError as e:
        assert "f64" in str(e) and "f32" in str(e), e
    want = np.float16(np.float32(2048.0) + np.float32(n - 1))
    # 1 and 7 elements: recursive doubling over TCP; 100,000 (200 KB): the ring
    for count in (1, 7, 100_000):
        buf = np.full(count, 2048.0 if r == 0 else 1.0, dtype=np.float16)
        comm.all_reduce(buf)
        assert (buf == want).all(), f"rank {r}: {count}: {buf[:4]} (want {want})"
    comm.accumulate = "native"
    buf = np.full(7, 2048.0 if r == 0 else 1.0, dtype=np.float16)
    comm.all_reduce(buf)
    if n > 2 and mode == "accumulate-property":
        # shared memory folds from rank 0, rounding each step (with 2 ranks 2048 + 1 rounds
        # to 2048 either way)
        assert (buf != want).any(), f"rank {r}: the native fold rounded like f32: {buf}"
    print("accumulate ok", flush=True)
    print("WORKER OK", flush=True)
    sys.exit(0)
if mode == "property":
    assert not comm.deterministic
    comm.deterministic = True
assert comm.deterministic
n, r = comm.world_size, comm.rank
for count in (1000, 300_001):
    inputs = [np.random.default_rng(10 * count + k).uniform(-500, 500, count).astype(np.float32) for k in range(n)]
    want = inputs[0].copy()
    for x in inputs[1:]:
        want = (want + x).astype(np.float32)
    buf = inputs[r].copy()
    comm.all_reduce(buf)
    assert buf.tobytes() == want.tobytes(), f"rank {r}: {count} elements differ from the rank-order fold"
print("deterministic ok", flush=True)
print("WORKER OK", flush=True)
