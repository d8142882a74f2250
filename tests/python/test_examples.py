"""Every example in examples/ runs and checks its own results (each rank prints EXAMPLE OK)."""

import pytest

from conftest import EXAMPLES, needs_torch, run_job

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
ELSEWHERE = {"train_ddp.py": "test_train_ddp.py"}


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([name for name, _ in CASES] + list(ELSEWHERE))


@needs_torch
@pytest.mark.parametrize("script, n", CASES)
def test_example_runs(script, n):
    run_job(n, [EXAMPLES / script], timeout=180)
