"""Deterministic mode from Python: `env` (HCOMM_DETERMINISTIC=1 set by the test) or `property`
(comm.deterministic = True). Every rank all-reduces random non-integer float32 vectors of two
sizes (both canonical schedules) and checks the result bitwise against the rank-order fold
computed with numpy: ((x0 + x1) + x2) + ...

`accumulate-env` (HCOMM_ACCUMULATE=f32 set by the test) or `accumulate-property`
(comm.accumulate = "f32"): f16 sums are computed in f32 and rounded once, whatever the
algorithm; "native" rounds at every step (rank 0 gives 2048, where the f16 step is 2, and the
others 1: rounded once the sum is 2048 + 2n - 2 rounded to even, step by step it stays 2048
on the ring's chunks that start at rank 0)."""

import sys

import numpy as np

import hcomm

mode = sys.argv[1]
comm = hcomm.Communicator.from_env()
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
