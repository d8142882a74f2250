"""Non-blocking point-to-point on the "hcomm" backend (issue #18): isend / irecv in every
posting order at 2–4 ranks with 8 B, 64 KiB and 4 MiB messages, batch_isend_irecv against
gloo, and torch.distributed.pipelining (GPipe, 1F1B) with the same gradients as on gloo
(tests/python/workers/torch_p2p.py). Every job is bounded twice: the group timeout inside
(20 s per wait) and the job's own limit here."""

from __future__ import annotations

import pytest

from conftest import WORKERS, needs_torch, run_job

WORKER = WORKERS / "torch_p2p.py"


@needs_torch
@pytest.mark.parametrize("n", [2, 3, 4])
def test_isend_irecv_complete_in_every_posting_order(n):
    out = run_job(n, [WORKER, "orders"], timeout=180)
    for nbytes in (8, 64 << 10, 4 << 20):
        assert out.count(f"ok isend/irecv all pairs, every order, {nbytes} B") == n
    assert out.count("ok several messages per peer match in posting order") == n
    assert out.count("ok posted p2p is_completed by polling") == n
    assert out.count("ok blocking recv after a posted large send") == n


@needs_torch
@pytest.mark.parametrize("n", [2, 3])
def test_batch_isend_irecv_as_on_gloo(n):
    out = run_job(n, [WORKER, "batch"], timeout=180)
    assert out.count("ok batch_isend_irecv ring and all pairs on hcomm") == n
    assert out.count("ok batch_isend_irecv ring and all pairs on gloo") == n


@needs_torch
@pytest.mark.parametrize("n", [2, 4])
def test_pipelining_schedules_equal_gloo(n):
    out = run_job(n, [WORKER, "pipeline"], timeout=240)
    assert out.count("ok pipelining ScheduleGPipe") == n
    assert out.count("ok pipelining Schedule1F1B") == n


@needs_torch
@pytest.mark.parametrize("n", [2, 3])
def test_recv_from_any_source_as_on_gloo(n):
    out = run_job(n, [WORKER, "any_source"], timeout=120)
    assert out.count("ok recv from any source on hcomm") == n
    assert out.count("ok recv from any source on gloo") == n
