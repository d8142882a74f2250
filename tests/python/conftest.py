"""Shared helpers of the Python tests: multi-process launches with a deadline, and torch
detection that cannot silently skip in CI (HCOMM_REQUIRE_TORCH=1 turns a missing torch into
failures)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
EXAMPLES = ROOT / "examples"

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

REQUIRE_TORCH = os.environ.get("HCOMM_REQUIRE_TORCH") == "1"

#: Mark tests that need torch: skipped without it, unless HCOMM_REQUIRE_TORCH=1 (CI), where a
#: missing torch fails them instead.
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH and not REQUIRE_TORCH, reason="torch is not installed (CI sets HCOMM_REQUIRE_TORCH=1)"
)


def free_port() -> int:
    """A port free on loopback now, outside the ephemeral range and new to this process (rank 0
    binds it a moment later; see hcomm::bootstrap::free_master_port)."""
    from hcomm import _hcomm

    return _hcomm.free_master_port("127.0.0.1")


def run_job(
    n: int,
    argv: Sequence[str],
    *,
    timeout: float = 120,
    launcher: Optional[Sequence[str]] = None,
    env: Optional[dict] = None,
    expect_ok: bool = True,
) -> str:
    """Run `argv` (a Python script and its arguments) on `n` ranks under a launcher (default
    ``python -m hcomm run -n N``) and return the output. Fails the test on a non-zero exit, a
    missing "WORKER OK"/"EXAMPLE OK" from any rank, or when the job outlives `timeout` (the
    launcher is then told to stop every rank)."""
    if launcher is None:
        launcher = [sys.executable, "-m", "hcomm", "run", "-n", str(n)]
    cmd = list(launcher) + [sys.executable] + [str(a) for a in argv]
    full_env = dict(os.environ)
    full_env.setdefault("HCOMM_TIMEOUT", "60")
    full_env["PYTHONUNBUFFERED"] = "1"
    # A rank that dies of a signal (SIGSEGV, or SIGABRT from glibc's heap checks) prints every
    # thread's Python stack, so a crash names its call, not only the last line printed.
    full_env.setdefault("PYTHONFAULTHANDLER", "1")
    if env:
        full_env.update(env)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=ROOT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its ranks
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s; output:\n{out}")
    if expect_ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}; output:\n{out}"
        done = out.count("WORKER OK") + out.count("EXAMPLE OK")
        assert done == n, f"{done} of {n} ranks reported OK; output:\n{out}"
    return out
