"""Deterministic mode from Python: `env` (HCOMM_DETERMINISTIC=1 set by the test) or `property`
(comm.deterministic = True). Every rank all-reduces random non-integer float32 vectors of two
sizes (both canonical schedules) and checks the result bitwise against the rank-order fold
computed with numpy: ((x0 + x1) + x2) + ..."""

import sys

import numpy as np

import hcomm

mode = sys.argv[1]
comm = hcomm.Communicator.from_env()
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
