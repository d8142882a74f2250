"""Gradient compression and byte counters through the Python API: argument checking and the
one-rank invariants in process; multi-process jobs (workers/compression.py,
workers/ddp_compression.py) for results across ranks, error feedback, counters, fusion and
the DDP communication hook."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hcomm
from conftest import HAVE_TORCH, WORKERS, free_port, needs_torch, run_job

if HAVE_TORCH:
    import torch


@pytest.fixture(scope="module")
def comm():
    return hcomm.Communicator.from_vars(
        {"HCOMM_RANK": 0, "HCOMM_WORLD_SIZE": 1, "HCOMM_MASTER_ADDR": "127.0.0.1", "HCOMM_MASTER_PORT": free_port()}
    )


# ---------------------------------------------------------------- the state object


@pytest.mark.parametrize(
    "given, canonical",
    [
        ("none", "none"),
        ("fp16", "fp16"),
        ("bf16", "bf16"),
        ("int8", "int8:256"),
        ("int8sr:64", "int8sr:64"),
        ("sign", "sign:1024"),
        ("topk:1%", "topk:1%"),
        ("topk:100", "topk:100"),
        ("randk:1%", "randk:1%:0"),
    ],
)
def test_compressors_parse_to_their_canonical_form(given, canonical):
    st = hcomm.CompressionState(given)
    assert st.compressor == canonical
    assert st.error_feedback and st.steps == 0 and st.residual.size == 0 and st.owner_range is None
    assert st.slice is None
    assert canonical in repr(st)


@pytest.mark.parametrize("bad", ["int9", "topk:0", "topk:150%", "int8:0", "fp16:3", "sign:x", ""])
def test_bad_compressors_are_invalid_argument_errors(bad):
    with pytest.raises(hcomm.InvalidArgumentError) as e:
        hcomm.CompressionState(bad)
    assert isinstance(e.value, ValueError)
    assert "invalid argument" in str(e.value)


def test_compressor_must_be_a_string():
    with pytest.raises(TypeError):
        hcomm.CompressionState(8)


# ---------------------------------------------------------------- one rank: exact invariants


@pytest.mark.parametrize("comp", ["fp16", "bf16", "int8:64", "sign:128", "topk:3%", "randk:10%"])
def test_one_rank_result_plus_residual_is_the_input(comm, comp):
    """On one rank the result is what compression kept; with error feedback the residual is
    exactly what it dropped (int8/sign: plus the owner's re-encoding residual)."""
    x = (np.random.default_rng(1).standard_normal(1000) * np.logspace(-3, 0, 1000)).astype(np.float32)
    st = hcomm.CompressionState(comp)
    y = comm.all_reduce_compressed(x.copy(), state=st)
    left = st.residual.astype(np.float64)
    if st.owner_range is not None:
        lo, hi = st.owner_range
        left[lo:hi] += st.owner_residual
    np.testing.assert_allclose(y + left, x, rtol=0, atol=1e-6)
    assert not np.array_equal(y, x), "a lossy compressor changed something"
    assert st.steps == 1 and st.memory_bytes >= 4 * x.size
    st.reset()
    assert st.steps == 0 and st.residual.size == 0


def test_none_is_exact_and_keeps_no_residual(comm):
    x = np.arange(100, dtype=np.float32)
    st = hcomm.CompressionState("none")
    assert np.array_equal(comm.all_reduce_compressed(x.copy(), state=st, op="mean"), x)
    assert st.residual.size == 0


def test_without_error_feedback_nothing_is_kept(comm):
    st = hcomm.CompressionState("topk:10%", error_feedback=False)
    comm.all_reduce_compressed(np.ones(100, np.float32), state=st)
    assert not st.error_feedback and st.residual.size == 0 and st.memory_bytes == 0


# ---------------------------------------------------------------- argument errors


def test_argument_errors(comm):
    x = np.ones(64, np.float32)
    with pytest.raises(hcomm.InvalidArgumentError, match="float64"):
        comm.all_reduce_compressed(np.ones(64), compressor="int8")
    with pytest.raises(hcomm.InvalidArgumentError, match="sums or averages"):
        comm.all_reduce_compressed(x, compressor="fp16", op="max")
    with pytest.raises(ValueError, match="give a compressor"):
        comm.all_reduce_compressed(x)
    with pytest.raises(ValueError, match="differs from the state"):
        comm.all_reduce_compressed(x, compressor="fp16", state=hcomm.CompressionState("int8"))
    comm.all_reduce_compressed(x, compressor="int8:256", state=hcomm.CompressionState("int8"))  # same, canonically
    with pytest.raises(TypeError):
        comm.all_reduce_compressed(x, state="int8")
    with pytest.raises(TypeError):
        comm.all_reduce_compressed([1.0, 2.0], compressor="int8")
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.all_reduce_compressed(np.ones((8, 8), np.float32)[:, ::2], compressor="int8")
    st = hcomm.CompressionState("int8")
    comm.all_reduce_compressed(np.ones(64, np.float32), state=st)
    with pytest.raises(hcomm.InvalidArgumentError, match="64-element tensor"):
        comm.all_reduce_compressed(np.ones(65, np.float32), state=st)


def test_reduce_scatter_compressed_argument_errors(comm):
    x = np.ones(64, np.float32)
    with pytest.raises(hcomm.InvalidArgumentError, match="float64"):
        comm.reduce_scatter_compressed(np.ones(64), "int8")
    with pytest.raises(hcomm.InvalidArgumentError, match="sums or averages"):
        comm.reduce_scatter_compressed(x, "fp16", op="max")
    with pytest.raises(hcomm.InvalidArgumentError, match="picks elements of the whole vector"):
        comm.reduce_scatter_compressed(x, "topk:1%")
    with pytest.raises(ValueError, match="reduce_scatter_compressed: give a compressor"):
        comm.reduce_scatter_compressed(x)
    with pytest.raises(hcomm.InvalidArgumentError, match="out has shape"):
        comm.reduce_scatter_compressed(x, "int8", out=np.zeros(3, np.float32))
    with pytest.raises(hcomm.InvalidArgumentError, match="overlap"):
        comm.reduce_scatter_compressed(x, "int8", out=x)
    st = hcomm.CompressionState("int8:16")
    y = comm.reduce_scatter_compressed(np.linspace(-1, 1, 64, dtype=np.float32), state=st)
    # one rank: the share is the input as int8 kept it, the residual what it dropped
    assert np.allclose(y + st.residual, np.linspace(-1, 1, 64, dtype=np.float32), atol=1e-6)
    with pytest.raises(hcomm.InvalidArgumentError, match="64-element tensor"):
        comm.reduce_scatter_compressed(np.ones(32, np.float32), state=st)


def test_fusion_argument_errors(comm):
    with pytest.raises(hcomm.InvalidArgumentError, match="summed or averaged"):
        comm.fusion(op="max", compression="int8")
    with pytest.raises(hcomm.InvalidArgumentError):
        comm.fusion(compression="topk:0")
    with pytest.raises(TypeError):
        comm.fusion(compression=hcomm.CompressionState("int8"))
    f = comm.fusion(op="mean", compression="int8")
    assert f.compression == "int8:256" and f.error_feedback is True and "int8:256" in repr(f)
    with pytest.raises(hcomm.InvalidArgumentError, match="float32"):
        f.push(np.ones(8, np.float16))
    f.push(np.ones(8, np.float32))  # the refused tensor was not taken
    assert f.finish() == 1
    plain = comm.fusion(compression="none")
    assert plain.compression is None and plain.error_feedback is None
    plain.push(np.ones(8, np.float16))  # no compression: any dtype
    plain.finish()


# ---------------------------------------------------------------- async and counters


def test_async_form_returns_the_tensor(comm):
    x = np.full(300, 2.0, np.float32)
    st = hcomm.CompressionState("fp16")
    w = comm.all_reduce_compressed_async(x, state=st, op="mean")
    assert w.wait() is x and np.array_equal(x, np.full(300, 2.0, np.float32)) and st.steps == 1


@needs_torch
def test_torch_tensors(comm):
    t = torch.linspace(-1, 1, 500)
    st = hcomm.CompressionState("int8:32")
    out = comm.all_reduce_compressed(t, state=st)
    assert out is t and st.steps == 1
    with pytest.raises(hcomm.InvalidArgumentError, match="bfloat16"):
        comm.all_reduce_compressed(torch.ones(8, dtype=torch.bfloat16), compressor="int8")


def test_traffic_rows_and_reset(comm):
    comm.reset_traffic()
    assert all(t.calls == 0 for t in comm.traffic())
    comm.all_reduce_compressed(np.ones(16, np.float32), compressor="int8")
    comm.all_reduce_compressed(np.ones(16, np.float32), compressor="int8")
    comm.all_reduce(np.ones(16, np.float32))
    rows = {t.op: t for t in comm.traffic()}
    assert rows["all_reduce_compressed"].calls == 2 and rows["all_reduce"].calls == 1
    r = rows["all_reduce"]
    assert r.bytes_sent == r.tcp_sent + r.shm_written == 0  # one rank moves nothing
    assert set(r.as_dict()) >= {"op", "calls", "tcp_sent", "tcp_received", "shm_written", "shm_read", "bytes_sent", "bytes_received"}
    assert "Traffic(op='all_reduce'" in repr(r)
    comm.reset_traffic()
    assert all(t.calls == 0 for t in comm.traffic())


def test_module_level_names(monkeypatch):
    for k, v in {"HCOMM_RANK": "0", "HCOMM_WORLD_SIZE": "1", "HCOMM_MASTER_ADDR": "127.0.0.1", "HCOMM_MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HCOMM_RANK_TABLE", raising=False)
    hcomm.DestroyHcom()
    hcomm.InitHcom("test")
    try:
        for hccl, snake in [
            ("AllReduceCompressed", "all_reduce_compressed"),
            ("AllReduceCompressedAsync", "all_reduce_compressed_async"),
            ("GetTraffic", "get_traffic"),
            ("ResetTraffic", "reset_traffic"),
        ]:
            assert getattr(hcomm, hccl) is getattr(hcomm, snake) and getattr(hcomm, hccl).__doc__
        assert hcomm.traffic is hcomm.GetTraffic
        x = np.ones(10, np.float32)
        assert hcomm.AllReduceCompressed(x, "bf16") is x
        assert hcomm.AllReduceCompressedAsync(x, "bf16").wait() is x
        assert [t.op for t in hcomm.GetTraffic()] == ["all_reduce_compressed"]
        hcomm.ResetTraffic()
        f = hcomm.CreateFusion(op="mean", compression="fp16")
        assert f.compression == "fp16"
    finally:
        hcomm.DestroyHcom()


# ---------------------------------------------------------------- across ranks


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_compression_across_ranks(n):
    out = run_job(n, [WORKERS / "compression.py", "numpy"], timeout=120)
    assert "ok error feedback" in out and "ok fusion with compression" in out


def test_compression_across_ranks_over_tcp():
    """TCP: the counters show the wire formats' ratios."""
    out = run_job(3, [WORKERS / "compression.py", "numpy"], env={"HCOMM_TRANSPORT": "tcp"}, timeout=120)
    assert "ok traffic counters (tcp)" in out


def test_compression_on_two_hosts_of_two_ranks():
    """int8 and sign hierarchical (each rank's residual covers its slice of the host sum);
    results identical everywhere, error feedback conserves the inputs."""
    out = run_job(4, [WORKERS / "compression.py", "numpy"], env={"COMPRESSION_TEST_HOSTS": "2"}, timeout=180)
    assert "ok error feedback" in out and "ok fusion with compression" in out


@needs_torch
def test_compression_on_torch_tensors():
    run_job(2, [WORKERS / "compression.py", "torch"], timeout=120)


@needs_torch
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_compression_hook(n):
    out = run_job(n, [WORKERS / "ddp_compression.py"], timeout=180)
    assert "ok ddp hooks" in out


def test_fusion_finish_reports_each_bucket_as_it_arrives(comm):
    f = comm.fusion(op="sum", cap_bytes=64, first_bucket_bytes=16, direct_bytes=1 << 20)
    ts = [np.full(n, i + 1, dtype=np.float32) for i, n in enumerate([4, 4, 10, 3, 8])]
    for t in ts:
        f.push(t)
    seen = []
    n = f.finish(ready=seen.append)
    # at most one call per bucket; every tensor reported once, in push order (the same objects)
    assert n >= 2 and 1 <= len(seen) <= n
    flat = [t for bucket in seen for t in bucket]
    assert len(flat) == len(ts) and all(a is b for a, b in zip(flat, ts))
    # buckets that arrived before finish: one call for all of them (the bucket that finish
    # itself launches may come in a second call)
    for t in ts:
        f.push(t)
    launched = f.buckets_launched
    assert 2 <= launched < n  # [t0], [t1, t2] launched by the pushes; the rest by finish
    time.sleep(1.0)  # one rank: each bucket's job takes microseconds
    seen = []
    assert f.finish(ready=seen.append) == n
    assert len(seen) <= 2 and len(seen[0]) >= 3
    flat = [t for bucket in seen for t in bucket]
    assert len(flat) == len(ts) and all(a is b for a, b in zip(flat, ts))
    # an exception from the callback: no further calls, every bucket still waited for, raised
    for t in ts:
        f.push(t)
    calls = []

    def boom(tensors):
        calls.append(len(tensors))
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        f.finish(ready=boom)
    assert len(calls) == 1
    f.push(ts[0])
    assert f.finish() == 1  # the fusion goes on with a fresh step


@needs_torch
def test_ddp_trace_labels_buckets_and_closes_the_file(tmp_path):
    out = run_job(2, [WORKERS / "ddp_trace.py"], timeout=120, env={"HCOMM_TRACE": str(tmp_path / "trace")})
    assert "ok ddp trace" in out
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == ["hcomm-trace-rank0.json", "hcomm-trace-rank1.json"]
