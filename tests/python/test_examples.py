"""Every example in examples/ runs and checks its own results (each rank prints EXAMPLE OK)."""

import subprocess
import sys

import pytest

from conftest import EXAMPLES, ROOT, needs_torch, run_job

CASES = [
    ("collectives.py", 4),
    ("point_to_point.py", 3),
    ("synchronisation.py", 2),
    ("shared_memory.py", 2),
    ("overlap.py", 2),
    ("fusion.py", 3),
    ("compression.py", 3),
    ("train.py", 2),
]


#: Examples with arguments, tested in their own files.
ELSEWHERE = {
    "train_ddp.py": "test_train_ddp.py",
    "fault_tolerant_training.py": "test_fault_tolerance.py",
    "torch_workloads.py": "here (test_torch_workloads_equal_gloo)",
}


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([name for name, _ in CASES] + list(ELSEWHERE))


@needs_torch
@pytest.mark.parametrize("script, n", CASES)
def test_example_runs(script, n):
    run_job(n, [EXAMPLES / script], timeout=180)


@needs_torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_torch_workloads_equal_gloo(n):
    # FSDP2 (a small transformer), DTensor and torch.distributed.checkpoint on hcomm, each
    # compared with gloo on the same seeds (the example asserts it), and the 8 B timing loop
    out = run_job(n, [EXAMPLES / "torch_workloads.py", "--quick"], timeout=240)
    for line in (
        "ok FSDP2 transformer: hcomm's parameters equal gloo's after 4 steps",
        "ok DTensor distribute_tensor / redistribute",
        "ok torch.distributed.checkpoint: the FSDP2 model saved and loaded on hcomm",
        "ok 8 B all_reduce timed on hcomm and gloo",
    ):
        assert line in out, line


@pytest.mark.parametrize("script", ["examples/train_ddp.py", "scripts/training-report.py", "scripts/convergence.py"])
def test_scripts_with_options_print_their_help(script):
    # Their defaults name compressors such as "topk:1%"; a bare % in a help string made
    # argparse fail with "unsupported format character" instead of printing the help.
    out = subprocess.run([sys.executable, ROOT / script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "topk:1%" in out.stdout, out.stdout
