"""scripts/convergence.py --quick: data-parallel training on scikit-learn's bundled digits with
every compressor, with and without error feedback, writes its Markdown table; the
uncompressed run learns, and the near-lossless compressors (fp16, bf16, int8) land within a
stated tolerance of it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, needs_torch

try:
    import sklearn  # noqa: F401

    HAVE_SKLEARN = True
except ImportError:
    HAVE_SKLEARN = False

#: Test accuracy of fp16 / bf16 / int8 (with or without error feedback) vs uncompressed after
#: the quick run's 60 steps, in absolute terms (measured: within 0.3 points).
CLOSE_TO_NONE = 0.02


@needs_torch
@pytest.mark.skipif(not HAVE_SKLEARN, reason="scikit-learn is not installed (scripts/test-python.sh installs it)")
def test_convergence_quick(tmp_path):
    out, js = tmp_path / "convergence.md", tmp_path / "runs.jsonl"
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convergence.py"), "--quick", "--out", str(out), "--json", str(js)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=110, cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout
    runs = [json.loads(line) for line in js.read_text().splitlines()]
    assert len(runs) == 13, runs  # none + 6 compressors x (error feedback on, off)
    assert all(r["ranks"] == 2 and r["steps"] == 60 and r["replicas_identical"] for r in runs)
    none = next(r for r in runs if r["compressor"] == "none")
    assert none["test_acc"] > 0.8, none
    for r in runs:
        if r["compressor"] in ("fp16", "bf16", "int8"):
            assert abs(r["test_acc"] - none["test_acc"]) <= CLOSE_TO_NONE, r
            assert abs(r["test_loss"] - none["test_loss"]) <= 0.02, r
        if r["compressor"] != "none":
            assert r["sent_bytes_per_step"] < none["sent_bytes_per_step"], r
    table = out.read_text()
    assert table.count("\n| ") == 14 and "| none | - |" in table and "| topk:1% | off |" in table, table
