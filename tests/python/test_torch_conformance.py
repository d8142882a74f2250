"""torch.distributed conformance of the "hcomm" backend (issue #18): each case runs a job of 2
and 3 ranks (tests/python/workers/torch_conformance.py) that does the same on an hcomm group
and a gloo group over the same inputs and compares."""

from __future__ import annotations

import pytest

from conftest import WORKERS, needs_torch, run_job

WORKER = WORKERS / "torch_conformance.py"
RANKS = [2, 3]


@needs_torch
@pytest.mark.parametrize("n", RANKS)
def test_is_completed_after_wait_and_by_polling(n):
    out = run_job(n, [WORKER, "is_completed"], timeout=120)
    assert out.count("ok polling is_completed() ends") == n
    assert out.count("ok p2p is_completed after wait (hcomm and gloo) and by polling") == n


@needs_torch
@pytest.mark.parametrize("n", RANKS)
def test_torch_distributed_debug_detail(n):
    out = run_job(n, [WORKER, "detail"], timeout=150, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert out.count("ok collectives under DETAIL equal gloo's") == n
    assert out.count("ok DETAIL catches mismatched collectives") == n
    assert out.count("ok DDP under DETAIL equals gloo's") == n
    assert "getBackendName is not implemented" not in out


@needs_torch
@pytest.mark.parametrize("n", RANKS)
def test_reduce_ops_and_dtypes(n):
    out = run_job(n, [WORKER, "reduce_ops"], timeout=150)
    for line in ("ok BAND BOR BXOR", "ok bool broadcast", "ok AVG on", "ok PREMUL_SUM", "ok complex64", "ok bad reduce ops"):
        assert out.count(line) == n, line


@needs_torch
@pytest.mark.parametrize("n", RANKS)
def test_monitored_barrier_names_absent_ranks(n):
    out = run_job(n, [WORKER, "monitored_barrier"], timeout=120)
    assert out.count("ok monitored_barrier names the ranks") == n
    assert out.count("ok monitored_barrier with timeout 0 on rank 0 says rank 0 timed out") == n
    assert "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms" in out
    absent = ", ".join(str(r) for r in range(1, n))
    assert f"[Rank 0]: Ranks {absent} failed to pass monitoredBarrier in 2000 ms" in out


@needs_torch
@pytest.mark.parametrize("n", RANKS)
def test_ddp_powersgd_matches_gloo(n):
    out = run_job(n, [WORKER, "powersgd"], timeout=180)
    assert out.count("ok a comm hook whose callback runs") == n
    assert out.count("ok DDP with PowerSGD") == n


@needs_torch
def test_failed_async_operation_fails_its_future():
    out = run_job(2, [WORKER, "future_error"], timeout=90)
    assert "future raised" in out and "not subscriptable" not in out


@needs_torch
@pytest.mark.parametrize("n", RANKS)
def test_coalesced_entry_points_and_fsdp2_match_gloo(n):
    out = run_job(n, [WORKER, "fsdp"], timeout=150)
    assert out.count("ok coalesced all_gather_into_tensor and reduce_scatter_tensor (async) equal gloo's") == n
    assert out.count("ok FSDP2 fully_shard trains 4 steps with gloo's parameters") == n
    assert out.count("ok overlap_fsdp leaves reduce-scatters running until backward ends; parameters bitwise the same, accumulation blocking") == n
    assert "all_gather_single_coalesced" in out  # FSDP2's all-gathers went through it


@needs_torch
@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", RANKS)
def test_entry_points_split_group_and_errors(n):
    # HCOMM_TIMEOUT unset: the groups' timeouts are torch's (the 1 s group must time out in 1 s)
    out = run_job(n, [WORKER, "entry_points"], timeout=150, env={"HCOMM_TIMEOUT": ""})
    assert out.count("ok all_gather_coalesced (uneven, empty, complex) equals gloo's; mismatched outputs refused") == n
    assert out.count("ok sparse all_reduce with 1-3 sparse dimensions equals gloo's") == n
    assert out.count("ok lists of another length or shape are refused by name, as gloo does; the group stays usable") == n
    assert out.count("ok an expanded tensor is all-reduced in place") == n
    assert out.count("ok split_group gives an hcomm subgroup of the parent's communicator") == n
    assert out.count("ok new_group makes hcomm sub-communicators of the default group's (no new rendezvous)") == n
    assert out.count("ok a timed-out collective raises DistBackendError naming the timeout; get_error reports it") == n
    assert out.count("ok dist.set_timeout changes an hcomm group's timeout") == n


@needs_torch
@pytest.mark.parametrize("n", RANKS)
def test_reductions_context_sets_deterministic_and_accumulate(n):
    out = run_job(n, [WORKER, "reductions"], timeout=120, env={"HCOMM_TRANSPORT": "tcp"})
    assert out.count("ok reductions(deterministic=True) gives the rank-order fold bitwise") == n
    assert out.count("ok reductions(accumulate='f32') rounds f16 sums once") == n
