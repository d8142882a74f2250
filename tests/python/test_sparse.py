"""Sparse all-reduce through the Python API: argument checks in process, results across ranks
in multi-process jobs (workers/sparse.py)."""

from __future__ import annotations

import numpy as np
import pytest

import hcomm
from conftest import WORKERS, free_port, needs_torch, run_job


@pytest.fixture(scope="module")
def comm():
    return hcomm.Communicator.from_vars(
        {"HCOMM_RANK": 0, "HCOMM_WORLD_SIZE": 1, "HCOMM_MASTER_ADDR": "127.0.0.1", "HCOMM_MASTER_PORT": free_port()}
    )


def test_one_rank_sums_repeats_and_sorts(comm):
    idx = np.array([5, 1, 5], dtype=np.int64)
    vals = np.array([[1, 2], [3, 4], [10, 20]], dtype=np.float32)
    i, v = comm.sparse_all_reduce(idx, vals)
    assert i.tolist() == [1, 5] and v.tolist() == [[3, 4], [11, 22]]
    i, v = comm.sparse_all_reduce_async(idx, vals, op="mean").wait()
    assert v.tolist() == [[3, 4], [11, 22]]  # one rank: the mean is the sum


def test_bad_arguments_name_the_problem(comm):
    idx = np.array([0, 1], dtype=np.int64)
    with pytest.raises(ValueError, match="one row per index"):
        comm.sparse_all_reduce(idx, np.zeros((3, 2), dtype=np.float32))
    with pytest.raises(TypeError, match="expected int64"):
        comm.sparse_all_reduce(idx.astype(np.int32), np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(hcomm.InvalidArgumentError, match="op max"):
        comm.sparse_all_reduce(idx, np.zeros((2, 2), dtype=np.float32), op="max")
    with pytest.raises(hcomm.InvalidArgumentError, match=r"indices\[1\] is -1"):
        comm.sparse_all_reduce(np.array([0, -1], dtype=np.int64), np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(TypeError, match="give"):
        comm.sparse_all_reduce(np.zeros((2, 2), dtype=np.float32))


@needs_torch
def test_sparse_tensor_must_be_row_sparse(comm):
    import torch

    t = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
    with pytest.raises(ValueError, match="2 sparse dimensions"):
        comm.sparse_all_reduce(t)


@needs_torch
@pytest.mark.parametrize("rows", [[3, -1], [5, 2], [4, 4]])
def test_wrong_reduced_rows_fail_before_torch_trusts_them(comm, monkeypatch, rows):
    """The sparse tensor is built as coalesced with torch's invariant checks off: rows that are
    negative, out of order or repeated (a transport bug) must raise, not reach torch's kernels
    (which would write outside the tensor). The reduction's result is replaced here by such rows."""
    import torch

    real = comm._c

    class WrongRows:
        def __init__(self, holder):
            self.holder = holder

        def take(self):
            self.holder.take()
            return bytearray(np.array(rows, dtype=np.int64).tobytes()), bytearray(np.zeros(2 * 3, np.float32).tobytes())

    class Core:
        def __getattr__(self, name):
            return getattr(real, name)

        def sparse_all_reduce(self, *args):
            engine, holder = real.sparse_all_reduce(*args)
            return engine, WrongRows(holder)

    monkeypatch.setattr(comm, "_c", Core())
    t = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.ones(2, 3), (10, 3))
    with pytest.raises(hcomm.HcommError, match="not ascending, unique and >= 0"):
        comm.sparse_all_reduce(t)
    monkeypatch.undo()
    out = comm.sparse_all_reduce(t)  # the real result passes the check
    assert out.coalesce().indices().tolist() == [[1, 2]]


@needs_torch
@pytest.mark.parametrize("n", [2, 3])
def test_sparse_all_reduce_across_ranks(n):
    out = run_job(n, [WORKERS / "sparse.py"], timeout=120)
    assert out.count("ok embedding gradient") == n


@needs_torch
def test_sparse_all_reduce_over_tcp():
    run_job(2, [WORKERS / "sparse.py"], env={"HCOMM_TRANSPORT": "tcp"}, timeout=120)
