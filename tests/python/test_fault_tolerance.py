"""Surviving a lost rank from Python: revoke / RevokedError / shrink (workers/fault_tolerance.py)
and the fault-tolerant training example with a rank SIGKILLed at each point of a step."""

import re
import sys

import pytest

from conftest import EXAMPLES, WORKERS, needs_torch, run_job


@pytest.mark.parametrize("n", [2, 3, 4])
def test_revoke_and_shrink(n):
    out = run_job(n, [WORKERS / "fault_tolerance.py"], timeout=120, env={"HCOMM_TIMEOUT": "20"})
    assert out.count("RevokedError after") == n - 1, out
    assert "told it was dropped" in out, out


@needs_torch
@pytest.mark.parametrize(
    "n, victim, at",
    [
        (4, 2, "allreduce"),
        (4, 1, "backward"),
        (4, 3, "optimizer"),
        (4, 0, "commit"),
        (3, 0, "allreduce"),
        (2, 1, "backward"),
    ],
)
def test_training_survives_a_killed_rank(n, victim, at):
    launcher = [sys.executable, "-m", "hcomm", "run", "--keep-going", "-n", str(n)]
    argv = [EXAMPLES / "fault_tolerant_training.py", "--kill-rank", victim, "--kill-at", at]
    out = run_job(n, argv, timeout=180, launcher=launcher, expect_ok=False, env={"HCOMM_TIMEOUT": "30"})
    assert f"rank {victim}: killed" in out, out
    assert out.count("EXAMPLE OK") == n - 1, out
    # Every survivor recovered once and finished on n - 1 ranks, equal to the uninterrupted run.
    finals = re.findall(r"rank (\d+): 24 steps on (\d+) of (\d+) ranks; (\d+) recovery", out)
    assert len(finals) == n - 1, out
    assert all(int(k) == n - 1 and int(m) == n and int(r) == 1 for _, k, m, r in finals), finals
    assert sorted(int(r) for r, *_ in finals) == [r for r in range(n) if r != victim]


@needs_torch
def test_a_replacement_takes_the_lost_ranks_place():
    n = 4
    launcher = [sys.executable, "-m", "hcomm", "run", "--keep-going", "-n", str(n)]
    argv = [EXAMPLES / "fault_tolerant_training.py", "--kill-rank", 2, "--kill-at", "allreduce", "--replace"]
    out = run_job(n, argv, timeout=180, launcher=launcher, expect_ok=False, env={"HCOMM_TIMEOUT": "60"})
    assert "rank 2: killed" in out and "rank 4: joined as rank 3 of 4" in out, out
    # The three survivors and the replacement finish together on 4 ranks, as the uninterrupted run.
    assert out.count("EXAMPLE OK") == n, out
    finals = re.findall(r"rank (\d+): 24 steps on 4 of 4 ranks", out)
    assert sorted(int(r) for r in finals) == [0, 1, 3, 4], out


@needs_torch
@pytest.mark.parametrize("n", [3, 4])
def test_torch_shrink_group_drops_a_killed_rank(n):
    launcher = [sys.executable, "-m", "hcomm", "run", "--keep-going", "-n", str(n)]
    out = run_job(n, [WORKERS / "torch_shrink.py"], timeout=120, launcher=launcher, expect_ok=False, env={"HCOMM_TIMEOUT": "30"})
    assert out.count("WORKER OK") == n - 1, out
    assert out.count(f"shrunk to {n - 1} ranks") == n - 1, out
