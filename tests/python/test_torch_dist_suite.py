"""PyTorch's own distributed test suite on the "hcomm" backend (issue #18), through
scripts/torch-dist-suite.py:

* the whole of ``_DistTestBase`` at 2, 3 and 4 ranks, run on gloo and then with hcomm standing
  in for gloo, compared test by test: every test that passes on gloo must pass on hcomm, apart
  from the script's CANNOT_PASS list (torch's own limits, each with its reason);
* the whole suite with hcomm as itself (``BACKEND=hcomm``) at 2 and 3 ranks: nothing fails;
* the tests the issue found failing, with the ranks spawned as torch's
  ``test_distributed_spawn.py`` does (the whole-suite runs fork them: the same outcomes, test
  by test, in 1-2 minutes instead of about 40).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, needs_torch

SCRIPT = ROOT / "scripts" / "torch-dist-suite.py"


def run_script(*args: str, limit: int) -> "tuple[int, str]":
    cmd = [sys.executable, str(SCRIPT), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    return proc.returncode, proc.stdout + proc.stderr


def pytest_summaries(out: str) -> "list[str]":
    return [line for line in out.splitlines() if re.search(r"\d+ (passed|failed)", line) and " in " in line]


@needs_torch
@pytest.mark.timeout(600)
def test_suite_issue_list_spawned():
    rc, out = run_script("--world-size", "2", "--per-test", "90", "--total", "500", limit=560)
    summary = pytest_summaries(out)
    assert rc == 0, out[-6000:]
    assert summary and "failed" not in summary[-1], summary
    assert int(re.search(r"(\d+) passed", summary[-1]).group(1)) >= 18, summary  # 23 selected, 2 skip


@needs_torch
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_whole_suite_against_gloo(n):
    rc, out = run_script(
        "--world-size", str(n), "--all", "--start", "fork", "--against-gloo",
        "--per-test", "90", "--total", "400", limit=860,
    )  # fmt: skip
    assert rc == 0, out[-8000:]
    runs = {b: (int(p), int(f)) for b, p, f in re.findall(r"^(hcomm|gloo): (\d+) passed, (\d+) failed", out, re.M)}
    assert set(runs) == {"hcomm", "gloo"} and runs["hcomm"][1] == 0, out[-8000:]
    # gloo itself may fail a test now and then on 2 cores (seen once: a subgroup test at 4
    # ranks); that is gloo's, reported, and hcomm must pass every such test
    gloo_only = re.findall(r"^  (\S+): hcomm passed, gloo failed$", out, re.M)
    assert runs["gloo"][1] <= 2 and len(gloo_only) == runs["gloo"][1], out[-8000:]
    # the suite really ran (about 90 pass on gloo here; a broken harness passes nothing)
    gloo_passed, gloo_failed = runs["gloo"]
    assert gloo_passed >= 80 and runs["hcomm"][0] == gloo_passed + gloo_failed - 2, out[-8000:]
    assert "passed on gloo, not on hcomm: 0 (and 2 left out: CANNOT_PASS)" in out, out[-8000:]


@needs_torch
@pytest.mark.timeout(500)
@pytest.mark.parametrize("n", [2, 3])
def test_whole_suite_as_hcomm(n):
    rc, out = run_script(
        "--world-size", str(n), "--all", "--start", "fork", "--native", "--per-test", "90", "--total", "400",
        limit=460,
    )  # fmt: skip
    summary = pytest_summaries(out)
    assert rc == 0, out[-8000:]
    assert summary and "failed" not in summary[-1], summary
    assert int(re.search(r"(\d+) passed", summary[-1]).group(1)) >= 60, summary


def junit(tmp_path, name: str, cases: "dict[str, str]") -> str:
    body = "".join(
        f'<testcase classname="c" name="{t}">'
        + {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='why'/>"}[o]
        + "</testcase>"
        for t, o in cases.items()
    )
    path = tmp_path / name
    path.write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    return str(path)


def test_compare_fails_when_hcomm_misses_a_test_gloo_passes(tmp_path):
    gloo = junit(tmp_path, "g.xml", {"test_a": "passed", "test_b": "passed", "test_get_backend": "passed"})
    ok = junit(tmp_path, "h1.xml", {"test_a": "passed", "test_b": "passed"})  # CANNOT_PASS left out
    rc, out = run_script("--compare", ok, gloo, limit=60)
    assert rc == 0 and "left out on hcomm" in out, out
    for outcome in ("failed", "skipped"):
        bad = junit(tmp_path, f"h-{outcome}.xml", {"test_a": "passed", "test_b": outcome})
        rc, out = run_script("--compare", bad, gloo, limit=60)
        assert rc == 1, out
        assert f"test_b: hcomm {outcome}, gloo passed" in out, out
    missing = junit(tmp_path, "h3.xml", {"test_a": "passed"})  # test_b not run: not excused
    rc, out = run_script("--compare", missing, gloo, limit=60)
    assert rc == 1 and "test_b: hcomm not run, gloo passed" in out, textwrap.shorten(out, 2000)
