"""Failures surface as the documented exception types. Run with 2 ranks:

    python -m hcomm run -n 2 python failures.py CASE

CASE is timeout, peer, abort, mismatch, invalid or auth. Rank 0 checks the exception (rank 1 plays
the misbehaving peer); prints WORKER OK when the expected exception was seen.
"""

import os
import sys
import threading
import time

import numpy as np

import hcomm

CASE = sys.argv[1]
if CASE == "peer":
    # Over TCP a dead peer's connections close at once. (Over shared memory hcomm detects a dead
    # peer by its pid, which a launcher that has not reaped the exited rank still holds as a
    # zombie, so the survivor would only time out.)
    os.environ["HCOMM_TRANSPORT"] = "tcp"
if CASE == "auth":
    # Rank 1 joins with another job token than the one hcomm run handed every rank.
    os.environ["HCOMM_TIMEOUT"] = "3"
    rank = int(os.environ["RANK"])
    if rank == 1:
        os.environ["HCOMM_JOB_TOKEN"] = "not-the-job-token-" + "x" * 20
    try:
        hcomm.InitHcom()
        raise AssertionError("joining with a wrong token (or with a peer that has one) must fail")
    except hcomm.HcommError as e:
        print(f"caught {type(e).__name__}: {e}", flush=True)
        if rank == 1:
            assert isinstance(e, hcomm.AuthenticationError) and isinstance(e, PermissionError), type(e)
    print("WORKER OK", flush=True)
    sys.exit(0)
comm = hcomm.InitHcom()
R = comm.rank
assert comm.world_size == 2


def expect(exc_type, f):
    try:
        f()
    except exc_type as e:
        assert isinstance(e, hcomm.HcommError), type(e)
        print(f"caught {type(e).__name__}: {e} (op={e.op}, peers={e.peers}, fatal={e.fatal})", flush=True)
        return e
    raise AssertionError(f"{CASE}: expected {exc_type.__name__}")


if CASE == "timeout":
    comm.timeout = 0.5
    if R == 0:
        e = expect(hcomm.HcommTimeoutError, lambda: hcomm.Wait(src_rank=1, tag=7))
        assert isinstance(e, TimeoutError) and e.peers == (1,) and e.fatal and e.op == "wait_signal"
        # the communicator is unusable after a fatal error
        expect(hcomm.PoisonedError, lambda: hcomm.AllReduce(np.ones(2)))
        # an async wait with a timeout is not fatal: the operation goes on
    time.sleep(1.0)
elif CASE == "peer":
    comm.timeout = 20
    hcomm.Barrier()  # every link is up
    if R == 1:
        os._exit(0)  # dies without taking part
    e = expect(hcomm.PeerError, lambda: hcomm.AllReduce(np.ones(1 << 16, np.float32)))
    assert e.peers == (1,), e.peers
elif CASE == "abort":
    comm.timeout = 30
    if R == 0:
        threading.Timer(0.3, comm.abort).start()
        t0 = time.monotonic()
        expect(hcomm.AbortedError, lambda: hcomm.Wait(src_rank=1, tag=3))  # never signalled
        assert time.monotonic() - t0 < 10, "abort must end the wait at once"
        expect((hcomm.AbortedError, hcomm.PoisonedError), lambda: hcomm.Barrier())
        w = hcomm.AllReduceAsync(np.ones(4))
        expect((hcomm.AbortedError, hcomm.PoisonedError), lambda: w.wait())
    else:
        time.sleep(1.5)
elif CASE == "mismatch":
    comm.timeout = 10
    hcomm.Barrier()
    if R == 0:
        f = lambda: hcomm.AllReduce(np.ones(8, np.float32))  # noqa: E731
    else:
        f = lambda: hcomm.Broadcast(np.ones(8, np.float32), root_rank=0)  # noqa: E731
    e = expect(hcomm.HcommError, f)
    assert isinstance(e, (hcomm.MismatchError, hcomm.PeerError)), type(e)
    if R == 0:
        assert isinstance(e, hcomm.MismatchError), f"rank 0 must name the mismatch, got {type(e).__name__}"
elif CASE == "invalid":
    e = expect(hcomm.InvalidArgumentError, lambda: hcomm.Broadcast(np.ones(3), root_rank=5))
    assert isinstance(e, ValueError) and not e.fatal and e.op == "broadcast"
    expect(hcomm.InvalidArgumentError, lambda: hcomm.Send(np.ones(3), 9, tag=1))
    # not fatal: the communicator still works
    a = np.full(3, R + 1.0)
    hcomm.AllReduce(a)
    assert (a == 3).all(), a
    # a point-to-point size mismatch fails the receive and is not fatal either
    if R == 0:
        hcomm.Send(np.ones(4, np.float32), 1, tag=2)
    else:
        e = expect(hcomm.MismatchError, lambda: hcomm.Recv(np.ones(8, np.float32), 0, tag=2))
        assert not e.fatal
    hcomm.Barrier()
else:
    raise SystemExit(f"unknown case {CASE}")
print("WORKER OK", flush=True)
