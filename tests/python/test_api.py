"""In-process tests on a one-rank communicator: argument checking (types, dtypes, shapes,
contiguity), exception types, zero-copy semantics, async handles, shared memory views, the
exported names and the .pyi stubs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hcomm
from conftest import HAVE_TORCH, free_port, needs_torch

if HAVE_TORCH:
    import torch


@pytest.fixture(scope="module")
def comm():
    return hcomm.Communicator.from_vars(
        {"HCOMM_RANK": 0, "HCOMM_WORLD_SIZE": 1, "HCOMM_MASTER_ADDR": "127.0.0.1", "HCOMM_MASTER_PORT": free_port()}
    )


@pytest.fixture()
def default(monkeypatch):
    """hcomm.InitHcom() from a one-rank environment, destroyed afterwards."""
    for k, v in {"HCOMM_RANK": "0", "HCOMM_WORLD_SIZE": "1", "HCOMM_MASTER_ADDR": "127.0.0.1", "HCOMM_MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HCOMM_RANK_TABLE", raising=False)
    hcomm.DestroyHcom()
    c = hcomm.InitHcom("test")
    yield c
    hcomm.DestroyHcom()


# ---------------------------------------------------------------- errors and their types


def test_exception_hierarchy():
    for cls in (
        hcomm.InvalidArgumentError,
        hcomm.HcommTimeoutError,
        hcomm.PeerError,
        hcomm.AbortedError,
        hcomm.MismatchError,
        hcomm.PoisonedError,
        hcomm.ConfigError,
        hcomm.AuthenticationError,
        hcomm.LaunchError,
    ):
        assert issubclass(cls, hcomm.HcommError)
    assert issubclass(hcomm.InvalidArgumentError, ValueError)
    assert issubclass(hcomm.HcommTimeoutError, TimeoutError)
    assert issubclass(hcomm.AuthenticationError, PermissionError)


def test_calls_before_init_raise():
    hcomm.DestroyHcom()
    with pytest.raises(hcomm.HcommError, match="InitHcom"):
        hcomm.GetRank()
    with pytest.raises(hcomm.HcommError):
        hcomm.AllReduce(np.ones(2))


def test_init_twice_raises_and_destroy_allows_again(default):
    assert (hcomm.GetRank(), hcomm.GetWorldSize(), hcomm.GetLocalRank()) == (0, 1, 0)
    assert hcomm.get_rank() == 0 and hcomm.GetCommunicator() is default
    with pytest.raises(hcomm.HcommError, match="already"):
        hcomm.InitHcom("again")


def test_bad_configuration_is_a_config_error(monkeypatch, tmp_path):
    for v in ("HCOMM_RANK", "HCOMM_WORLD_SIZE", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "HCOMM_RANK_TABLE"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(hcomm.ConfigError, match="rank"):
        hcomm.Communicator.from_env()
    bad = tmp_path / "hcom_config.json"
    bad.write_text('{"version": "2.0"}')
    with pytest.raises(hcomm.ConfigError, match="version"):
        hcomm.Communicator.from_rank_table(bad, rank=0)
    with pytest.raises(hcomm.ConfigError, match="no rank"):
        hcomm.Communicator.from_rank_table(bad)


def test_library_argument_errors_are_invalid_argument_errors(comm):
    with pytest.raises(hcomm.InvalidArgumentError, match="root") as e:
        comm.broadcast(np.ones(3), root_rank=1)
    assert isinstance(e.value, ValueError)
    assert e.value.op == "broadcast" and e.value.fatal is False
    with pytest.raises(hcomm.InvalidArgumentError):
        comm.send(np.ones(3), dst_rank=4)
    # Arguments refused before the library sees them are InvalidArgumentErrors too (so an
    # `except hcomm.HcommError` catches every refusal), and still ValueErrors.
    for call, match in [
        (lambda: comm.all_reduce(np.ones(3), op="bogus"), "bogus"),
        (lambda: comm.all_reduce(np.zeros((4, 4))[:, ::2]), "contiguous"),
        (lambda: comm.all_to_all(np.ones(4), send_counts=[3], recv_counts=[4]), "send_counts"),
        (lambda: comm.all_gather(np.ones(3), dim=5), "dim"),
    ]:
        with pytest.raises(hcomm.InvalidArgumentError, match=match):
            call()
    # not fatal: the communicator still works
    a = np.ones(3)
    comm.all_reduce(a)


def test_integer_and_op_arguments_are_checked_by_name(comm):
    """Ranks, tags, counts, sizes, colors and keys: a negative value is an InvalidArgumentError
    naming the argument, a value of the wrong type a TypeError naming it (not the binding's
    bare OverflowError or conversion error); numpy integers are ints."""
    for call, match in [
        (lambda: comm.broadcast(np.ones(3), root_rank=-1), "broadcast: root_rank must not be negative, got -1"),
        (lambda: comm.reduce(np.ones(3), root_rank=-2), "reduce: root_rank must not be negative"),
        (lambda: comm.gather(np.ones(3), root_rank=-1), "gather: root_rank"),
        (lambda: comm.scatter(np.ones(3), root_rank=-1), "scatter: root_rank"),
        (lambda: comm.all_to_all(np.ones(4), send_counts=[5, -1], recv_counts=[4, 0]), r"send_counts\[1\] must not be negative"),
        (lambda: comm.send(np.ones(3), dst_rank=-1), "send: dst_rank"),
        (lambda: comm.recv(np.ones(3), src_rank=0, tag=-3), "recv: tag must not be negative"),
        (lambda: comm.signal(-1), "signal: dst_rank"),
        (lambda: comm.split(color=-5), "split: color must not be negative"),
        (lambda: comm.new_group([0, -1]), r"new_group: ranks\[1\]"),
        (lambda: comm.allocate_shared_memory(-1), "alloc_shared: size must not be negative"),
        # more than the host can hold: refused, not reserved (that would wake the OOM killer)
        (lambda: comm.allocate_shared_memory(1 << 62), "more than this host has available"),
        # too large for the binding's integers: named too, not a bare OverflowError
        (lambda: comm.broadcast(np.ones(3), root_rank=2**64), "broadcast: root_rank must be at most"),
        (lambda: comm.send(np.ones(3), dst_rank=0, tag=2**32), "send: tag must be at most 4294967295"),
        (lambda: comm.fusion(cap_bytes=-1), "fusion: cap_bytes must not be negative"),
    ]:
        with pytest.raises(hcomm.InvalidArgumentError, match=match):
            call()
    for call, match in [
        (lambda: comm.all_reduce(np.ones(3), op=3), "all_reduce: op must be a string"),
        (lambda: comm.reduce_scatter(np.ones(3), op=None), "reduce_scatter: op must be a string"),
        (lambda: comm.broadcast(np.ones(3), root_rank="0"), "broadcast: root_rank must be an int, not str"),
        (lambda: comm.broadcast(np.ones(3), root_rank=1.0), "root_rank must be an int, not float"),
        (lambda: comm.broadcast(np.ones(3), root_rank=None), "root_rank must be an int, not NoneType"),
        (lambda: comm.send(np.ones(3), dst_rank=0, tag=True), "send: tag must be an int, not bool"),
        (lambda: comm.all_to_all(np.ones(4), send_counts=4, recv_counts=[4]), "send_counts must be a sequence of ints"),
        (lambda: comm.allocate_shared_memory(1.5), "size must be an int, not float"),
    ]:
        with pytest.raises(TypeError, match=match):
            call()
    # a timeout past what the clock can count: an error, not a panic inside the binding
    old = comm.timeout
    for bad in (1e30, float("inf"), -1.0):
        with pytest.raises(hcomm.InvalidArgumentError, match="timeout"):
            comm.timeout = bad
    assert comm.timeout == old
    a = np.ones(3)
    assert comm.broadcast(a, root_rank=np.int64(0)) is a
    comm.all_reduce(a)  # not fatal: the communicator still works


def test_python_launcher_refuses_out_of_range_numbers():
    """`python -m hcomm run` names the option and the range, with no traceback."""
    for args, want in [
        (["-n", "-1"], "argument -n/--nprocs: -1 is less than 1"),
        (["--nnodes", "0"], "argument --nnodes: 0 is less than 1"),
        (["--port", "70000"], "argument --port: 70000 is not in 1..65535"),
        (["--port", "-5"], "argument --port: -5 is not in 1..65535"),
        (["--grace-ms", "-1"], "argument --grace-ms: -1 is less than 0"),
        (["--master", "h:70000"], "--master must be HOST:PORT (port 1..65535)"),
    ]:
        p = subprocess.run([sys.executable, "-m", "hcomm", "run", *args, "true"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


FORK_CHILD_EXITS = """
import os, sys
import numpy as np
import hcomm
c = hcomm.InitHcom()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child's interpreter shuts down, dropping its copy of the communicator
_, status = os.waitpid(pid, 0)
assert status == 0, status
g = c.new_group([0])  # needs rank 0's store, which the child must have left serving
a = np.ones(3)
g.all_reduce(a)
print("FORK OK", flush=True)
"""


def test_a_forked_child_exiting_leaves_rank_0s_store_serving(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, HCOMM_RANK="0", HCOMM_WORLD_SIZE="1", HCOMM_MASTER_ADDR="127.0.0.1", HCOMM_MASTER_PORT=str(free_port()), HCOMM_TIMEOUT="20")
    env.pop("HCOMM_RANK_TABLE", None)
    r = subprocess.run([sys.executable, "-c", FORK_CHILD_EXITS], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "FORK OK" in r.stdout, r.stdout + r.stderr
    assert "PanicException" not in r.stderr, r.stderr


def test_a_destroyed_communicator_refuses_calls_and_destroy_hcom_destroys(default):
    assert not default.destroyed
    hcomm.DestroyHcom()
    assert default.destroyed and "destroyed" in repr(default)
    with pytest.raises(hcomm.HcommError, match="destroyed"):
        default.all_reduce(np.ones(3))
    default.destroy()  # twice is harmless
    hcomm.DestroyHcom()  # and with no default


@pytest.mark.parametrize(
    "bad, what",
    [
        ([1.0, 2.0], "list"),
        ((1, 2), "tuple"),
        (3.0, "float"),
        (np.ones(3, dtype=bool), "bool"),
        (np.ones(3, dtype=np.complex64), "complex64"),
        (np.ones(3, dtype=np.uint16), "uint16"),
        (np.array(["a"]), "str"),
    ],
)
def test_unsupported_objects_and_dtypes_are_type_errors(comm, bad, what):
    with pytest.raises(TypeError, match=what):
        comm.all_reduce(bad)


def test_dtype_mismatch_between_input_and_out(comm):
    with pytest.raises(TypeError, match="dtype"):
        comm.all_reduce(np.ones(3, np.float32), out=np.ones(3, np.float64))
    with pytest.raises(TypeError, match="dtype"):
        comm._c.all_reduce(np.ones(3, np.float32), np.ones(3, np.float64), "sum")


def test_non_contiguous_arrays_are_value_errors(comm):
    a = np.zeros((4, 4), np.float32)
    for bad in (a[:, ::2], a.T, a[::2]):
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_reduce(bad)
        with pytest.raises(ValueError, match="contiguous"):
            comm.broadcast(bad)
        with pytest.raises(ValueError, match="contiguous"):
            comm.all_gather(bad, dim=0)
    # contiguous slices are fine, and are operated on in place
    comm.all_reduce(a[1:3])


def test_read_only_output_and_bad_byte_order_are_value_errors(comm):
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(ro)
    comm.all_reduce(ro, out=np.empty(3))  # a read-only input is fine
    with pytest.raises(ValueError, match="byte order"):
        comm.all_reduce(np.ones(3, dtype=">f4"))


def test_shape_errors_are_value_errors(comm):
    with pytest.raises(ValueError, match="dim 2"):
        comm.all_gather(np.ones((2, 2)), dim=2)
    with pytest.raises(ValueError, match="no dimensions"):
        comm.all_gather(np.array(1.0))
    with pytest.raises(ValueError, match="shape"):
        comm.all_reduce(np.ones(3), out=np.ones(4))
    with pytest.raises(ValueError, match="shape"):
        comm.all_gather(np.ones((2, 3)), dim=0, out=np.ones((3, 3)))
    with pytest.raises(ValueError, match="send_counts"):
        comm.all_to_all(np.ones((4, 2)), send_counts=[3], recv_counts=[4])
    with pytest.raises(ValueError, match="neither"):
        comm.all_to_all(np.ones((4, 2)), send_counts=[4])
    with pytest.raises(ValueError, match="root needs"):
        comm.scatter(None, root_rank=0, out=np.ones(2))
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.all_reduce(np.ones(2), op="median")


def test_overlapping_input_and_output(comm):
    a = np.arange(10.0)
    with pytest.raises(ValueError, match="overlap"):
        comm.all_reduce(a[0:6], out=a[4:10])
    same = comm.all_reduce(a, out=a)  # the same memory: in place
    assert same is a


def test_results_land_in_place_without_copies(comm):
    base = np.arange(10, dtype=np.int64)
    view = base[2:6]
    assert comm.all_reduce(view, op="sum") is view
    comm.broadcast(view, root_rank=0)
    assert np.shares_memory(view, base)
    out = np.zeros(8, np.int64)
    comm.all_gather(base[:8], dim=0, out=out)
    np.testing.assert_array_equal(out, base[:8])
    empty = np.zeros((0, 3), np.float32)
    comm.all_reduce(empty)
    assert comm.all_gather(empty, dim=0).shape == (0, 3)


@needs_torch
def test_torch_tensors_in_place_and_errors(comm):
    t = torch.arange(6, dtype=torch.float32)
    ptr = t.data_ptr()
    assert comm.all_reduce(t, op="max") is t and t.data_ptr() == ptr
    b = torch.ones(4, dtype=torch.bfloat16)
    comm.all_reduce(b)
    assert comm.all_gather(torch.ones(2, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(TypeError, match="bool"):
        comm.all_reduce(torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="complex"):
        comm.all_reduce(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="strided"):
        comm.all_reduce(torch.ones(3).to_sparse())
    with pytest.raises(ValueError, match="device 'meta'"):
        comm.all_reduce(torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match="dtype"):
        comm.all_reduce(torch.ones(3), out=torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="out is a numpy.ndarray but the input is a torch.Tensor"):
        comm.all_gather(torch.ones(3), out=np.ones(3, dtype=np.float32))
    # A lazily negated view keeps its values un-negated in memory: refused, not reduced wrong.
    with pytest.raises(ValueError, match="negated view"):
        comm.all_reduce(torch.full((3,), 2.0)._neg_view(), op="max")


@needs_torch
def test_a_tensor_whose_storage_was_resized_is_refused_not_overrun(comm):
    # FSDP frees unsharded parameters this way: the shape stays, the memory goes. hcomm wrote
    # the shape's bytes into the 16-byte (or null) storage and the process died (2026-12-08).
    for nbytes in (16, 0):
        t = torch.zeros(1 << 10)
        t.untyped_storage().resize_(nbytes)
        with pytest.raises(ValueError, match=f"storage holds {nbytes} bytes"):
            comm.broadcast(t, 0)
    # A view at an offset is measured from its offset.
    base = torch.zeros(8)
    view = base[4:]
    base.untyped_storage().resize_(24)
    with pytest.raises(ValueError, match="16 bytes from byte 16"):
        comm.all_reduce(view)
    assert comm.all_reduce(torch.zeros(8)[4:]).shape == (4,)


def test_an_array_interface_must_declare_its_dtypes_element_size(comm):
    class Mislabelled:
        """float32 memory under a float64 name: twice the bytes would be read and written."""

        def __init__(self, a):
            self._a = a
            self.dtype = np.dtype(np.float64)
            self.__array_interface__ = dict(a.__array_interface__)

    with pytest.raises(TypeError, match="declares <f4"):
        comm.all_reduce(Mislabelled(np.ones(4, dtype=np.float32)))


def test_ml_dtypes_bfloat16(comm):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.ones(4, dtype=ml_dtypes.bfloat16)
    comm.all_reduce(a, op="sum")
    assert a.dtype == ml_dtypes.bfloat16


# ---------------------------------------------------------------- async handles


def test_async_handles(comm):
    a = np.ones(5)
    w = comm.all_reduce_async(a)
    assert isinstance(w, hcomm.Work)
    assert w.wait() is a and w.is_completed()
    assert w.wait() is a  # waiting again returns the same result
    assert hcomm.Wait is hcomm.wait
    g = comm.all_gather_async(np.ones((2, 3)), dim=1)
    assert g.wait(timeout=30).shape == (2, 3)
    assert comm.barrier_async().wait() is None
    with pytest.raises(ValueError, match="timeout"):
        comm.all_reduce_async(np.ones(2)).wait(timeout=-1)


def test_async_errors_come_back_from_wait(comm):
    # errors found before the operation is queued (types, shapes, contiguity) are raised at once ...
    with pytest.raises(TypeError):
        comm.all_reduce_async([1, 2])
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce_async(np.ones((2, 2)).T)
    # ... the library's own checks run with the operation: wait() raises them, every time
    w = comm.broadcast_async(np.ones(2), root_rank=3)
    with pytest.raises(hcomm.InvalidArgumentError, match="root"):
        w.wait()
    with pytest.raises(hcomm.InvalidArgumentError):
        w.wait()
    w = comm._c.reduce(np.ones(2), None, "sum", 0, True)  # the root without an output
    with pytest.raises(hcomm.InvalidArgumentError, match="recv buffer"):
        w.wait()
    assert w.is_completed()
    assert isinstance(w.exception(), hcomm.InvalidArgumentError)
    comm.all_reduce(np.ones(2))  # not fatal


# ---------------------------------------------------------------- shared memory


def test_shared_memory_views_files_and_free(comm):
    shm = comm.allocate_shared_memory(4096)
    assert (shm.size, shm.owner, shm.data_offset, len(shm)) == (4096, 0, 0, 4096)
    assert os.fspath(shm) == shm.path
    a = shm.numpy(np.float32)
    assert a.shape == (1024,) and a.dtype == np.float32
    a[:] = np.arange(1024)
    b = shm.numpy(np.int64, shape=(2, 4), offset=64)
    assert b.shape == (2, 4)
    m = np.memmap(os.fspath(shm), dtype=np.float32, mode="r", shape=(1024,))
    np.testing.assert_array_equal(m, np.arange(1024, dtype=np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        shm.numpy(np.float64, shape=(1000,))
    # Checked before allocating: this aborted the interpreter (2026-12-08).
    with pytest.raises(ValueError, match="go beyond its 4096 bytes"):
        shm._raw.read(1 << 62)
    assert len(shm._raw.read(8, 4088)) == 8 and len(shm._raw.read(16)) == 16
    with pytest.raises(ValueError, match="multiple"):
        shm.numpy(np.float32, offset=3)
    with pytest.raises(BufferError, match="view"):
        shm.free()
    del a, b
    shm.free()
    assert shm.freed
    shm.free()  # twice is harmless
    with pytest.raises(ValueError, match="freed"):
        shm.numpy()
    with pytest.raises(ValueError, match="flags"):
        comm.allocate_shared_memory(16, flags="write_only")


@needs_torch
def test_shared_memory_as_torch_and_from_file(comm):
    with comm.allocate_shared_memory(1024) as shm:
        t = shm.torch(torch.float32, shape=(16, 16))
        t.fill_(3.0)
        f = torch.from_file(shm.path, shared=True, size=256)
        assert torch.equal(f, torch.full((256,), 3.0))
        f[0] = 7.0
        assert t[0, 0].item() == 7.0
        bf = shm.torch(torch.bfloat16, shape=(4,), offset=512)
        bf.fill_(1.5)
        assert bf.dtype == torch.bfloat16 and bf[0].item() == 1.5
        del t, bf
    assert shm.freed


# ---------------------------------------------------------------- names and stubs

STUB_DIR = Path(hcomm.__file__).parent


def _stub_names(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def test_documented_names_exist_with_snake_case_twins():
    for hccl, snake in [
        ("InitHcom", "init_hcom"),
        ("GetRank", "get_rank"),
        ("GetWorldSize", "get_world_size"),
        ("GetLocalRank", "get_local_rank"),
        ("AllReduce", "all_reduce"),
        ("AllGather", "all_gather"),
        ("ReduceScatter", "reduce_scatter"),
        ("Broadcast", "broadcast"),
        ("Reduce", "reduce"),
        ("Gather", "gather"),
        ("Scatter", "scatter"),
        ("AllToAll", "all_to_all"),
        ("CreateConnection", "create_connection"),
        ("DestroyConnection", "destroy_connection"),
        ("Send", "send"),
        ("Recv", "recv"),
        ("Barrier", "barrier"),
        ("Signal", "signal"),
        ("Wait", "wait"),
        ("AllReduceAsync", "all_reduce_async"),
        ("AllocateSharedMemory", "allocate_shared_memory"),
        ("GetSharedMemory", "get_shared_memory"),
        ("FreeSharedMemory", "free_shared_memory"),
    ]:
        assert getattr(hcomm, hccl) is getattr(hcomm, snake), hccl
        assert hccl in hcomm.__all__ and snake in hcomm.__all__
        assert getattr(hcomm, hccl).__doc__
    for name in hcomm.__all__:
        assert hasattr(hcomm, name), name


def test_stubs_ship_and_match_the_runtime():
    init_stub = STUB_DIR / "__init__.pyi"
    ext_stub = STUB_DIR / "_hcomm.pyi"
    assert init_stub.exists() and ext_stub.exists() and (STUB_DIR / "py.typed").exists()
    assert set(hcomm.__all__) <= _stub_names(init_stub) | {"errors"}
    ext_public = {n for n in dir(hcomm._hcomm) if not n.startswith("_")}
    assert ext_public <= _stub_names(ext_stub), ext_public - _stub_names(ext_stub)
    for cls in ("Communicator", "Connection", "SharedMemory", "Work", "Fusion", "CompressionState"):
        stub_cls = next(n for n in ast.parse(ext_stub.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
        stub_members = {n.name for n in stub_cls.body if isinstance(n, ast.FunctionDef)}
        runtime = {n for n in dir(getattr(hcomm._hcomm, cls)) if not n.startswith("_")}
        assert runtime <= stub_members, f"{cls}: {runtime - stub_members} missing from _hcomm.pyi"
