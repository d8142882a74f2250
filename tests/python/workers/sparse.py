"""Sparse all-reduce through the Python API, checked on every rank against a dense numpy
reference built from every rank's deterministic rows:

    python -m hcomm run -n N python sparse.py

* (indices, values) with numpy and with torch, sum and mean, rows of shape (3,) and (2, 2),
  repeated indices, a rank with no rows; identical bits on every rank;
* a torch sparse COO gradient from nn.Embedding(sparse=True) gives the dense all-reduce of
  the same gradients (and the async form the same as the blocking one);
* a row shape, or a sparse tensor's number of rows, that differs across ranks is a
  MismatchError on every rank.

Prints "ok NAME" per check and "WORKER OK" at the end; any mismatch raises.
"""

import numpy as np
import torch

import hcomm

comm = hcomm.InitHcom("sparse-tests")
R, W = hcomm.GetRank(), hcomm.GetWorldSize()
TABLE = 40


def rows_of(rank, row_shape):
    """Rank `rank`'s rows: repeats included; rank 1 has none when there are 3+ ranks."""
    if W > 2 and rank == 1:
        idx = np.zeros(0, dtype=np.int64)
    else:
        idx = np.array([(k * (rank + 2) + rank) % TABLE for k in range(6 + 3 * rank)], dtype=np.int64)
    vals = (np.arange(len(idx) * int(np.prod(row_shape))) % 9 - 4 + rank).astype(np.float32)
    return idx, vals.reshape((len(idx),) + row_shape)


def dense_reference(row_shape, mean):
    t = np.zeros((TABLE,) + row_shape, dtype=np.float64)
    for r in range(W):
        idx, vals = rows_of(r, row_shape)
        np.add.at(t, idx, vals)
    return t / W if mean else t


def same_everywhere(*arrays):
    mine = np.concatenate([np.ascontiguousarray(a).view(np.uint8).ravel() for a in arrays])
    every = comm.all_gather(np.array([len(mine)], dtype=np.int64), dim=0)
    assert (every == len(mine)).all(), every
    all_bytes = comm.all_gather(mine, dim=0).reshape(W, -1)
    assert (all_bytes == all_bytes[0]).all(), "ranks got different bits"


for kind in ("numpy", "torch"):
    for row_shape in ((3,), (2, 2)):
        for op in ("sum", "mean"):
            idx, vals = rows_of(R, row_shape)
            if kind == "torch":
                idx, vals = torch.from_numpy(idx), torch.from_numpy(vals)
            got_i, got_v = comm.sparse_all_reduce(idx, vals, op=op)
            if kind == "torch":
                assert isinstance(got_i, torch.Tensor) and got_v.dtype == torch.float32
                got_i, got_v = got_i.numpy(), got_v.numpy()
            assert got_v.shape == (len(got_i),) + row_shape, got_v.shape
            assert (np.diff(got_i) > 0).all(), "indices ascending and unique"
            dense = np.zeros((TABLE,) + row_shape)
            dense[got_i] = got_v
            want = dense_reference(row_shape, op == "mean")
            assert np.allclose(dense, want, atol=1e-6), (kind, row_shape, op)
            touched = sorted({int(i) for r in range(W) for i in rows_of(r, row_shape)[0]})
            assert got_i.tolist() == touched
            same_everywhere(got_i, got_v)
            print(f"ok {kind} rows {row_shape} {op}", flush=True)

# an embedding gradient: sparse all-reduce == dense all-reduce of the same gradients
torch.manual_seed(0)
emb = torch.nn.Embedding(TABLE, 4, sparse=True)
dense_emb = torch.nn.Embedding(TABLE, 4)
dense_emb.weight.data.copy_(emb.weight.data)
tokens = torch.tensor([[(3 * k + 5 * R) % TABLE for k in range(7)]])
emb(tokens).pow(2).sum().backward()
dense_emb(tokens).pow(2).sum().backward()
g = emb.weight.grad
assert g.is_sparse
reduced = comm.sparse_all_reduce(g, op="mean")
assert reduced.is_sparse and reduced.is_coalesced() and tuple(reduced.shape) == (TABLE, 4)
want = comm.all_reduce(dense_emb.weight.grad.clone(), op="mean")
assert torch.allclose(reduced.to_dense(), want, atol=1e-6)
again = comm.sparse_all_reduce_async(g, op="mean").wait()
assert torch.equal(again.to_dense(), reduced.to_dense())
print("ok embedding gradient", flush=True)

# disagreement: a rank with rows of another shape
bad = np.zeros((1, 3 if R == 0 else 2), dtype=np.float32)
try:
    comm.sparse_all_reduce(np.array([0], dtype=np.int64), bad)
except hcomm.MismatchError as e:
    assert "rows of" in str(e), e
else:
    raise AssertionError("a row shape that differs across ranks must fail")
print("ok mismatch", flush=True)

# tables of different sizes: every rank fails, saying both sizes (before 2026-12-07 only the
# rank whose table was too small for the reduced rows did, and with rows inside every table
# the ranks ended with results of different shapes)
rows = TABLE + 10 if R == 0 else TABLE
for row in (rows - 1, 0):
    t = torch.sparse_coo_tensor(torch.tensor([[row]]), torch.ones(1, 2), (rows, 2))
    try:
        comm.sparse_all_reduce(t)
    except hcomm.MismatchError as e:
        assert "every rank must reduce a tensor of the same size" in str(e) and f"rank 0's tensor has {TABLE + 10} rows, rank 1's {TABLE}" in str(e), e
    else:
        raise AssertionError("tables of different sizes must fail on every rank")
print("ok table sizes", flush=True)
print("WORKER OK", flush=True)
