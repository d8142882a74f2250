"""Revoke and shrink from Python: rank 1 revokes while the others wait in an all-reduce (they
get RevokedError naming it); everyone shrinks (nobody is gone: same members); then the last
rank is dropped on purpose (it learns that it is out) and the others carry on."""

import time

import numpy as np

import hcomm

comm = hcomm.InitHcom()
me, n = comm.rank, comm.world_size
assert not comm.revoked
if me == 1:
    time.sleep(0.3)
    comm.revoke()
    assert comm.revoked
else:
    t0 = time.perf_counter()
    try:
        comm.all_reduce(np.ones(1000, np.float32))
        raise AssertionError("the all-reduce should have been revoked")
    except hcomm.RevokedError as e:
        assert e.peers == (1,), e.peers
        assert e.fatal
        waited = time.perf_counter() - t0
    assert comm.revoked
    try:
        comm.barrier()
        raise AssertionError("later calls should fail too")
    except hcomm.RevokedError:
        pass
    print(f"rank {me}: RevokedError after {waited * 1e3:.0f} ms", flush=True)

# Nobody is gone: the same ranks, in the same order.
same = hcomm.Shrink()
assert same is hcomm.GetCommunicator() and same.world_size == n and same.rank == me
got = same.all_reduce(np.full(100, me + 1, np.float64))
assert np.all(got == n * (n + 1) / 2), got

# Drop the last rank on purpose: it is told it is out; the others go on.
last = n - 1
if me == last:
    try:
        same.shrink()
        raise AssertionError("the dropped rank should be told")
    except hcomm.HcommError as e:
        assert "dropped" in str(e), e
        print(f"rank {me}: told it was dropped: {e}", flush=True)
else:
    try:
        same.shrink(exclude=[me])
        raise AssertionError("excluding oneself is refused")
    except hcomm.InvalidArgumentError:
        pass
    rest = same.shrink(exclude=[last])
    assert rest.world_size == n - 1 and rest.rank == me
    got = rest.all_reduce(np.full(7, me + 1, np.int64))
    assert np.all(got == (n - 1) * n // 2), got
print("WORKER OK", flush=True)
