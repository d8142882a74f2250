"""The Python API of hcomm: :class:`Communicator`, :class:`Connection`, :class:`SharedMemory`,
and the HCCL-named functions over a default communicator (``InitHcom``, ``AllReduce``, ...).

Tensors are numpy arrays or CPU torch tensors of the dtypes in :data:`DTYPES`, C-contiguous.
hcomm reads and writes their memory directly (no copies); the Python objects are kept alive
for as long as an operation uses them.
"""

from __future__ import annotations

import gc
import operator
import os
import threading
import weakref
from typing import Any, Optional, Sequence

from . import _hcomm
from .errors import ConfigError, HcommError, InvalidArgumentError

#: The dtypes hcomm communicates (numpy / torch names).
DTYPES: tuple[str, ...] = tuple(_hcomm.dtypes())

#: The reduction operators.
OPS: tuple[str, ...] = ("sum", "prod", "min", "max", "mean")

_RANK_VARS = ("HCOMM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


# ----------------------------------------------------------------------------------------------
# tensors


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch") and hasattr(t, "data_ptr")


def _check_tensor(op: str, what: str, t: Any) -> None:
    if _is_torch(t) or hasattr(t, "__array_interface__"):
        return
    raise TypeError(
        f"{op}: {what} must be a numpy.ndarray or a CPU torch.Tensor, got {type(t).__name__}"
    )


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


def _empty(like: Any, shape: Sequence[int]) -> Any:
    """An uninitialised array/tensor of `like`'s kind and dtype."""
    if _is_torch(like):
        import torch

        return torch.empty(tuple(shape), dtype=like.dtype)
    import numpy as np

    return np.empty(tuple(shape), dtype=like.dtype)


_TAG_MAX = (1 << 32) - 1
_INT_MAX = (1 << 63) - 1


def _int(op: str, name: str, value: Any) -> int:
    """`value` (an int, or a numpy integer) as a non-negative int; else a TypeError or
    InvalidArgumentError naming the argument (not the binding's bare conversion error)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{op}: {name} must be an int, not {type(value).__name__} ({value!r})")
    v = operator.index(value)
    if v < 0:
        raise InvalidArgumentError(f"{op}: {name} must not be negative, got {v}")
    # Tags travel as 32-bit numbers, the rest (ranks, sizes, counts) as 64-bit ones.
    limit = _TAG_MAX if name == "tag" else _INT_MAX
    if v > limit:
        raise InvalidArgumentError(f"{op}: {name} must be at most {limit}, got {v}")
    return v


def _ints(op: str, name: str, values: Any) -> list[int]:
    """A sequence of non-negative ints, checked as :func:`_int` checks one."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{op}: {name} must be a sequence of ints, not {type(values).__name__} ({values!r})")
    return [_int(op, f"{name}[{i}]", v) for i, v in enumerate(values)]


def _op(op: str, value: Any) -> str:
    """The reduction `value` names, which must be a string; else a TypeError naming `op`."""
    if not isinstance(value, str):
        raise TypeError(
            f"{op}: op must be a string ('sum', 'prod', 'min', 'max' or 'mean'), not {type(value).__name__} ({value!r})"
        )
    return value


def _dim(op: str, dim: int, ndim: int) -> int:
    if ndim == 0:
        raise InvalidArgumentError(f"{op}: the tensor has no dimensions (give it a shape of at least (1,))")
    if not -ndim <= dim < ndim:
        raise InvalidArgumentError(f"{op}: dim {dim} is out of range for a tensor of {ndim} dimensions")
    return dim % ndim


def _check_out(op: str, out: Any, like: Any, shape: Sequence[int]) -> Any:
    """`out` if it has the expected shape and dtype, else a new array/tensor."""
    if out is None:
        return _empty(like, shape)
    _check_tensor(op, "out", out)
    if _shape(out) != tuple(shape):
        raise InvalidArgumentError(f"{op}: out has shape {_shape(out)}, expected {tuple(shape)}")
    if _is_torch(out) != _is_torch(like):
        kind = lambda t: "a torch.Tensor" if _is_torch(t) else f"a {type(t).__module__}.{type(t).__name__}"
        raise TypeError(f"{op}: out is {kind(out)} but the input is {kind(like)}: pass the same kind")
    if str(out.dtype) != str(like.dtype):
        raise TypeError(f"{op}: out has dtype {out.dtype}, the input {like.dtype}")
    return out


def _concat(parts: Any, dim: int, out: Any) -> Any:
    """Concatenate parts[0], parts[1], ... (a (W, ...) array/tensor) along `dim`."""
    if _is_torch(parts):
        import torch

        if out is None:
            return torch.cat(parts.unbind(0), dim=dim)
        return torch.cat(parts.unbind(0), dim=dim, out=out)
    import numpy as np

    return np.concatenate(list(parts), axis=dim, out=out)


def _elements(t: Any) -> int:
    n = 1
    for d in _shape(t):
        n *= d
    return n


# ----------------------------------------------------------------------------------------------
# handles


class Work:
    """A handle on an asynchronous operation (the ``...Async`` forms): :meth:`wait` returns
    its result, :meth:`is_completed` polls without blocking.

    Operations on one communicator run in the order they were issued, blocking ones included
    (a blocking call issued after an async one waits for it). The tensors an operation uses
    are kept alive until it completes, even if the handle is dropped; do not read or write
    them before :meth:`wait` returns."""

    def __init__(self, engine: Any, result: Any = None, keep: tuple = (), finish: Any = None) -> None:
        self._engine = engine
        self._result = result
        self._keep = keep
        self._finish = finish

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the operation completes and return its result (the output tensor, or
        None). With `timeout` (seconds), raise :class:`HcommTimeoutError` if it is still in
        flight then; it goes on, and `wait` can be called again. Raises the operation's error
        if it failed (on every call)."""
        if self._engine is not None:
            self._engine.wait(timeout)
            self._engine = None
            self._keep = ()
            if self._finish is not None:
                self._result = self._finish()
                self._finish = None
        return self._result

    def is_completed(self) -> bool:
        """True once the operation has finished (successfully or not). Never blocks."""
        return self._engine is None or self._engine.is_completed()

    def result(self) -> Any:
        """Same as :meth:`wait`."""
        return self.wait()

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<hcomm.Work {state}>"


# ----------------------------------------------------------------------------------------------
# compression and byte counters


class CompressionState:
    """One tensor's gradient-compression state: the compressor, whether error feedback is on,
    the residuals and the step count. Keep one per tensor and pass it to every
    :meth:`Communicator.all_reduce_compressed` of that tensor::

        state = hcomm.CompressionState("int8:256")           # error feedback on
        for step in range(steps):
            ...
            hcomm.AllReduceCompressed(grad, state=state, op="mean")

    `compressor` is one of ``none``, ``fp16``, ``bf16``, ``int8[:BLOCK]``, ``int8sr[:BLOCK]``
    (stochastic rounding), ``sign[:BLOCK]``, ``topk:K|P%``, ``randk:K|P%[:SEED]`` (see
    docs/compression.md for what each guarantees). With error feedback, what compression
    drops is kept (:attr:`residual`) and added to the next call's input. `key` is mixed into
    random-k's seed: give tensors sharing a seed different keys (the same on every rank).
    The state binds to the tensor size and communicator at its first use; :meth:`reset`
    rebinds it. Raises :class:`InvalidArgumentError` for an unknown compressor or bad
    parameter (``topk:0``, ``int8:0``, ``randk:150%``)."""

    def __init__(self, compressor: str = "int8", error_feedback: bool = True, key: int = 0) -> None:
        if not isinstance(compressor, str):
            raise TypeError(f"compressor must be a string such as 'int8:256' or 'topk:1%', got {type(compressor).__name__}")
        self._s = _hcomm.CompressionState(compressor, bool(error_feedback), int(key))

    @property
    def compressor(self) -> str:
        """The compressor in canonical form (``"int8:256"``, ``"topk:1%"``, ...)."""
        return self._s.compressor

    @property
    def error_feedback(self) -> bool:
        """Whether error feedback is on."""
        return self._s.error_feedback

    @property
    def steps(self) -> int:
        """Compressed all-reduces run with this state."""
        return self._s.steps

    @property
    def residual(self) -> Any:
        """A copy (numpy float32) of what this rank's compression dropped and will add to the
        next input; empty before the first call, without error feedback, and for ``none``."""
        import numpy as np

        return np.frombuffer(self._s.residual, dtype=np.float32).copy()

    @property
    def owner_residual(self) -> Any:
        """int8 and sign: a copy of what re-encoding the sum of the chunk this rank owns
        dropped (elements :attr:`owner_range`); empty otherwise."""
        import numpy as np

        return np.frombuffer(self._s.owner_residual, dtype=np.float32).copy()

    @property
    def owner_range(self) -> "Optional[tuple[int, int]]":
        """int8 and sign: (start, end) of the elements this rank owns, once used."""
        r = self._s.owner_range
        return None if r is None else (int(r[0]), int(r[1]))

    @property
    def slice(self) -> "Optional[tuple[int, int]]":
        """int8 and sign on several hosts of several ranks: (start, end) of the elements whose
        host sum this rank compresses across hosts (:attr:`residual` is then theirs), once
        used; None otherwise."""
        r = self._s.slice
        return None if r is None else (int(r[0]), int(r[1]))

    @property
    def memory_bytes(self) -> int:
        """Bytes the residuals hold."""
        return self._s.memory_bytes

    def reset(self) -> None:
        """Forget the residuals, the step count and the binding to a tensor."""
        self._s.reset()

    def __repr__(self) -> str:
        return repr(self._s).replace("hcomm._hcomm.", "hcomm.")


def _compression_state(compressor: Optional[str], state: Optional[CompressionState], op: str = "all_reduce_compressed") -> CompressionState:
    """The state a compressed call uses: `state`, or a fresh one for `compressor`."""
    if state is None:
        if compressor is None:
            raise InvalidArgumentError(f"{op}: give a compressor (e.g. 'int8') or a CompressionState")
        return CompressionState(compressor, error_feedback=False)
    if not isinstance(state, CompressionState):
        raise TypeError(f"{op}: state must be a hcomm.CompressionState, got {type(state).__name__}")
    if compressor is not None:
        mine = CompressionState(compressor).compressor  # canonical form (validates it too)
        if mine != state.compressor:
            raise InvalidArgumentError(
                f"{op}: compressor {compressor!r} ({mine}) differs from the state's {state.compressor}; "
                "give one of them"
            )
    return state


class Traffic:
    """Bytes one kind of operation moved on this rank (a row of
    :meth:`Communicator.traffic`)."""

    __slots__ = ("op", "calls", "tcp_sent", "tcp_received", "shm_written", "shm_read")

    def __init__(self, op: str, calls: int, tcp_sent: int, tcp_received: int, shm_written: int, shm_read: int) -> None:
        #: Operation name (``all_reduce``, ``all_reduce_compressed``, ``send``, ...).
        self.op = op
        #: Calls of the operation.
        self.calls = calls
        #: Bytes written to TCP links.
        self.tcp_sent = tcp_sent
        #: Bytes read from TCP links.
        self.tcp_received = tcp_received
        #: Bytes copied into the shared-memory segment.
        self.shm_written = shm_written
        #: Bytes copied (or reduced) out of the shared-memory segment.
        self.shm_read = shm_read

    @property
    def bytes_sent(self) -> int:
        """TCP bytes written plus shared-memory bytes written."""
        return self.tcp_sent + self.shm_written

    @property
    def bytes_received(self) -> int:
        """TCP bytes read plus shared-memory bytes read."""
        return self.tcp_received + self.shm_read

    def as_dict(self) -> dict:
        """The row as a dict (with bytes_sent and bytes_received)."""
        d = {k: getattr(self, k) for k in self.__slots__}
        d.update(bytes_sent=self.bytes_sent, bytes_received=self.bytes_received)
        return d

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Traffic) and all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def __repr__(self) -> str:
        return (
            f"Traffic(op={self.op!r}, calls={self.calls}, tcp_sent={self.tcp_sent}, tcp_received={self.tcp_received}, "
            f"shm_written={self.shm_written}, shm_read={self.shm_read})"
        )


# ----------------------------------------------------------------------------------------------
# connections and shared memory


class Connection:
    """A connection to one peer under one tag (``CreateConnection``). Both ranks create it
    with each other's rank and the same tag. Use as a context manager or close it with
    :meth:`close` (``DestroyConnection``)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    @property
    def peer(self) -> int:
        """The other rank."""
        return self._raw.peer

    @property
    def tag(self) -> int:
        """The tag."""
        return self._raw.tag

    @property
    def closed(self) -> bool:
        """True once closed."""
        return self._raw.closed

    def send(self, tensor: Any) -> None:
        """Send `tensor` to the peer (the peer receives into a tensor of the same byte size)."""
        _check_tensor("send", "tensor", tensor)
        self._raw.send(tensor)

    def recv(self, tensor: Any) -> Any:
        """Receive into `tensor` (in place) and return it."""
        _check_tensor("recv", "tensor", tensor)
        self._raw.recv(tensor)
        return tensor

    def close(self) -> None:
        """Close the connection (local; closing twice is harmless)."""
        self._raw.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<hcomm.Connection peer={self.peer} tag={self.tag}{' closed' if self.closed else ''}>"


class _ArrayView:
    """Exposes a range of shared memory through ``__array_interface__``; numpy arrays made
    from it keep it (and so the SharedMemory) alive."""

    __slots__ = ("__array_interface__", "_shm", "__weakref__")

    def __init__(self, shm: "SharedMemory", interface: dict) -> None:
        self.__array_interface__ = interface
        self._shm = shm


def _numpy_dtype(dtype: Any) -> Any:
    import numpy as np

    if str(dtype) in ("bfloat16", "bf16", "torch.bfloat16"):
        try:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            raise TypeError(
                "numpy has no bfloat16: install ml_dtypes, or use shm.torch(torch.bfloat16)"
            ) from None
    if str(dtype).startswith("torch."):
        dtype = str(dtype)[len("torch.") :]
    return np.dtype(dtype)


class SharedMemory(os.PathLike):
    """Shared memory of one rank (``AllocateSharedMemory`` / ``GetSharedMemory``).

    * :meth:`numpy` and :meth:`torch` view it as an array / tensor of a dtype and shape,
      zero-copy: writes by any rank of the host are seen by all.
    * :attr:`path` (also ``os.fspath(shm)``) is a file that maps the same memory, data at
      offset 0: ``torch.from_file(shm.path, shared=True, size=n)`` or ``numpy.memmap(shm)``.
      It is valid while the owner holds the memory.
    * :meth:`free` (``FreeSharedMemory``) unmaps it, and for the owner frees it. Views must be
      deleted first; peers' mappings stay valid.

    Ranks order their accesses themselves (``Signal``/``Wait`` or ``Barrier``).
    """

    def __init__(self, raw: Any, flags: str = "read_write") -> None:
        if flags not in ("read_write", "read_only"):
            raise InvalidArgumentError(f"flags must be 'read_write' or 'read_only', got {flags!r}")
        self._raw = raw
        self.flags = flags
        self._views: "weakref.WeakSet[_ArrayView]" = weakref.WeakSet()

    @property
    def path(self) -> str:
        """A file mapping the same memory (data at offset 0)."""
        return self._raw.path

    def __fspath__(self) -> str:
        return self._raw.path

    @property
    def size(self) -> int:
        """Usable bytes."""
        return self._raw.size

    def __len__(self) -> int:
        return self._raw.size

    @property
    def owner(self) -> int:
        """The rank that allocated it."""
        return self._raw.owner

    @property
    def data_offset(self) -> int:
        """Offset of the data in the file at :attr:`path` (0)."""
        return self._raw.data_offset

    @property
    def freed(self) -> bool:
        """True once :meth:`free` was called."""
        return self._raw.freed

    def _interface(self, np_dtype: Any, shape: Optional[Sequence[int]], offset: int) -> dict:
        itemsize = np_dtype.itemsize
        if offset < 0 or offset % itemsize:
            raise InvalidArgumentError(f"offset {offset} is not a non-negative multiple of {itemsize} bytes")
        if shape is None:
            shape = ((self.size - offset) // itemsize,) if offset <= self.size else (0,)
        elif isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(n) for n in shape)
        nbytes = itemsize
        for n in shape:
            if n < 0:
                raise InvalidArgumentError(f"negative dimension in shape {shape}")
            nbytes *= n
        if offset + nbytes > self.size:
            raise InvalidArgumentError(
                f"{nbytes} bytes of shape {shape} at offset {offset} do not fit in "
                f"{self.size} bytes of shared memory"
            )
        return {
            "version": 3,
            "shape": shape,
            "typestr": np_dtype.str,
            "descr": np_dtype.descr,
            "data": (self._raw.address + offset, self.flags == "read_only"),
            "strides": None,
        }

    def numpy(self, dtype: Any = "uint8", shape: Optional[Sequence[int]] = None, offset: int = 0) -> Any:
        """The memory as a numpy array of `dtype` (numpy dtype or name) and `shape` (default:
        as many elements as fit), starting `offset` bytes in. Zero-copy; read-only when the
        memory was mapped with flags="read_only"."""
        import numpy as np

        np_dtype = _numpy_dtype(dtype)
        view = _ArrayView(self, self._interface(np_dtype, shape, offset))
        self._views.add(view)
        arr = np.asarray(view)
        if arr.dtype != np_dtype:  # e.g. ml_dtypes' bfloat16 comes back as void
            arr = arr.view(np_dtype)
        return arr

    def torch(self, dtype: Any = None, shape: Optional[Sequence[int]] = None, offset: int = 0) -> Any:
        """The memory as a torch tensor of `dtype` (torch dtype, default float32) and `shape`,
        starting `offset` bytes in. Zero-copy."""
        import numpy as np
        import torch

        if self.flags == "read_only":
            raise InvalidArgumentError("read-only shared memory cannot be a torch tensor (torch has no read-only tensors); use numpy()")
        dtype = torch.float32 if dtype is None else dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.replace("torch.", ""))
        itemsize = torch.empty((), dtype=dtype).element_size()
        carrier = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]
        arr = self.numpy(carrier, shape, offset)
        return torch.from_numpy(arr).view(dtype)

    def free(self) -> None:
        """Unmap the memory (for the owner: free it). Raises BufferError while numpy or torch
        views of it are alive. Freeing twice is harmless."""
        if len(self._views):
            gc.collect()
        if len(self._views):
            raise BufferError(
                f"{len(self._views)} numpy/torch view(s) of this shared memory are still alive; "
                "delete them before freeing it"
            )
        self._raw.free()

    def __enter__(self) -> "SharedMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        return (
            f"<hcomm.SharedMemory owner={self.owner} size={self.size} path={self.path}"
            f"{' freed' if self.freed else ''}>"
        )


# ----------------------------------------------------------------------------------------------
# the communicator


class _Destroyed:
    """Stands in for the engine of a destroyed communicator: every use raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise HcommError(
            f"communicator {self._name!r} was destroyed (destroy() or DestroyHcom()); make a new one"
        )


class Communicator:
    """A group of ranks that run collectives together.

    Make one with :meth:`from_env` (under ``hcomm run``, torchrun, mpirun, srun) or
    :meth:`from_rank_table`, or let :func:`InitHcom` make the default one. Operations on one
    communicator run one at a time, in the order they are issued.
    """

    def __init__(self, engine: Any, name: str = "world") -> None:
        self._c = engine
        self.name = name

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_env(cls, name: str = "world") -> "Communicator":
        """Join the job described by the environment (``HCOMM_*``, torchrun, Open MPI, PMI,
        Slurm variables, or ``HCOMM_RANK_TABLE``)."""
        return cls(_hcomm.Communicator.from_env(), name)

    @classmethod
    def from_rank_table(cls, path: "str | os.PathLike[str]", rank: Optional[int] = None, name: str = "world") -> "Communicator":
        """Join the job described by a rank table (``hcom_config.json``). `rank` defaults to
        the first of ``HCOMM_RANK``, ``RANK``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``,
        ``SLURM_PROCID`` that is set."""
        if rank is None:
            var = next((v for v in _RANK_VARS if os.environ.get(v, "").strip()), None)
            if var is None:
                raise ConfigError(
                    f"rank table {os.fspath(path)}: no rank given and none of {', '.join(_RANK_VARS)} is set"
                )
            try:
                rank = int(os.environ[var].strip())
            except ValueError:
                raise ConfigError(f"{var}={os.environ[var]} is not a non-negative integer") from None
        return cls(_hcomm.Communicator.from_rank_table(os.fspath(path), rank), name)

    @classmethod
    def from_vars(cls, variables: dict, name: str = "world") -> "Communicator":
        """Join a job described by `variables` (``HCOMM_RANK``, ``HCOMM_WORLD_SIZE``,
        ``HCOMM_MASTER_ADDR``, ...), the process environment filling in the rest."""
        return cls(_hcomm.Communicator.from_vars({k: None if v is None else str(v) for k, v in variables.items()}), name)

    @classmethod
    def join_grown(cls, addr: str, name: str = "world") -> "Communicator":
        """Join a communicator that is growing (:meth:`grow` on its ranks) through the
        rendezvous at `addr` (``HOST:PORT``); this process takes the next free rank. The job
        token (``HCOMM_JOB_TOKEN`` / ``HCOMM_TOKEN_FILE``), timeout and transport come from
        the environment; launcher variables are ignored."""
        return cls(_hcomm.Communicator.join_grown(str(addr)), name)

    # -- properties ------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank, ``0..world_size``."""
        return self._c.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._c.world_size

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of its host."""
        return self._c.local_rank

    @property
    def local_world_size(self) -> int:
        """Number of ranks on this host."""
        return self._c.local_world_size

    @property
    def timeout(self) -> float:
        """Deadline of every blocking call, in seconds (settable)."""
        return self._c.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._c.timeout = seconds

    @property
    def deterministic(self) -> bool:
        """Deterministic reductions (settable; ``HCOMM_DETERMINISTIC=1`` sets it at
        creation): all-reduce, reduce-scatter and reduce combine the ranks' contributions in
        rank order (f16/bf16 accumulated in f32), so results are bitwise the same whatever
        the message size, fusion bucket, transport or host layout. Every rank must set the
        same value, in the same place of its program."""
        return self._c.deterministic

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        self._c.deterministic = bool(on)

    @property
    def skip_zeros(self) -> bool:
        """Whether all-reduces between two hosts skip zero blocks (settable; on by default,
        ``HCOMM_SKIP_ZEROS=0`` turns it off at creation): a sum or mean all-reduce of two
        ranks on different hosts, and the cross-host step of the hierarchical all-reduce on
        two hosts, sends only the 1 KiB blocks that are not all zero bits (an embedding's
        gradient: the batch's rows). The result is bitwise the dense one's, so it is on
        wherever it applies. Every rank must set the same value, in the same place of its
        program."""
        return self._c.skip_zeros

    @skip_zeros.setter
    def skip_zeros(self, on: bool) -> None:
        self._c.skip_zeros = bool(on)

    @property
    def gather_cache_budget(self) -> int:
        """Bytes of all-gather outputs this communicator may keep between hosts (settable;
        ``HCOMM_GATHER_CACHE_MB`` sets it at creation; by default 1/64 of the host's memory
        shared among its ranks, at most 256 MiB). An all-gather of at least 1 MiB whose ranks span
        hosts keeps its output, the same on every rank; a rank whose block is bitwise one it
        sent in a kept all-gather sends a reference instead (FSDP2 gathers the same parameters
        in forward and backward). The output is the same either way. ``0`` turns it off and
        drops what is kept. Every rank must set the same value, in the same place of its
        program."""
        return self._c.gather_cache_budget

    @gather_cache_budget.setter
    def gather_cache_budget(self, nbytes: int) -> None:
        if int(nbytes) < 0:
            raise ValueError(f"gather_cache_budget must be >= 0 bytes, got {nbytes}")
        self._c.gather_cache_budget = int(nbytes)

    @property
    def gather_cache_held(self) -> int:
        """Bytes of all-gather outputs kept now (see :attr:`gather_cache_budget`)."""
        return self._c.gather_cache_held

    @property
    def accumulate(self) -> str:
        """How f16 and bf16 reductions accumulate (settable; ``HCOMM_ACCUMULATE`` sets it at
        creation): ``"f32"`` computes each element of an all-reduce, reduce-scatter or
        reduce in f32 and rounds once (the rank-order fold of deterministic mode, for these
        two dtypes only); ``"native"`` (the default) lets the selected algorithm round after
        every addition. Every rank must set the same value, in the same place of its
        program; a :class:`ValueError` names any other value."""
        return self._c.accumulate

    @accumulate.setter
    def accumulate(self, how: str) -> None:
        self._c.accumulate = how

    def trace_to(self, path: str) -> None:
        """Write a Chrome / Perfetto trace (https://ui.perfetto.dev) of this communicator's
        operations, and of the communicators made from it afterwards, to ``path``: a
        directory (one ``hcomm-trace-rank{R}.json`` per rank) or a file name containing
        ``{rank}``. ``HCOMM_TRACE=path`` does this when the communicator is created. One
        slice per operation: algorithm, dtype, count, bytes, bytes on the wire, peers, queue
        time, error. ``hcomm trace merge DIR -o trace.json`` joins the ranks' files."""
        self._c.trace_to(os.fspath(path))

    def stop_trace(self) -> None:
        """Stop tracing this communicator (its file is closed once no communicator uses it)."""
        self._c.stop_trace()

    def flush_trace(self) -> None:
        """Write the trace's buffered events now (they are written every 100 ms anyway)."""
        self._c.flush_trace()

    @property
    def trace_file(self) -> Optional[str]:
        """The file this communicator's trace goes to, or ``None`` when it does not trace."""
        return self._c.trace_file

    def set_trace_label(self, label: Optional[str]) -> None:
        """Attach ``label`` to every operation issued from now on (``args.label`` of its
        trace slice), or none with ``None``: e.g. the DDP bucket or the training step."""
        self._c.set_trace_label(label)

    def abort(self) -> None:
        """Abort: every operation in flight and every later one fails with
        :class:`AbortedError`. Safe from any thread."""
        self._c.abort()

    def revoke(self) -> None:
        """Revoke: every operation in flight on this communicator or started later, on every
        rank, fails promptly with :class:`RevokedError` naming this rank (ranks blocked in a
        wait included). Safe from any thread. Then call :meth:`shrink` on every rank left."""
        self._c.revoke()

    @property
    def revoked(self) -> bool:
        """True once this communicator was revoked (here or, as far as this rank heard, by
        another rank)."""
        return self._c.revoked

    def shrink(self, exclude: Sequence[int] = ()) -> "Communicator":
        """After a failure: the communicator of the ranks that are left, ranks renumbered in
        order, also dropping the ranks in `exclude`. Collective over the survivors: every rank
        that is alive calls it (one that does not within the timeout is dropped). It revokes
        this communicator first, agrees with the others on who is gone without needing any
        rank in particular (rank 0 may be the dead one), and builds the new communicator;
        every survivor gets the same members. Keep this communicator until the new one is
        returned, then drop it (see docs/fault-tolerance.md)."""
        return Communicator(self._c.shrink([int(r) for r in exclude]), f"{self.name}/shrunk")

    def grow(self, count: int, addr: str) -> "Communicator":
        """A communicator of this one's ranks (keeping their ranks) and `count` new processes,
        which call :meth:`Communicator.join_grown` (or :func:`JoinGrown`) with `addr`. Collective
        over this communicator; its rank 0 hosts the rendezvous on `addr` (``HOST:PORT`` of
        its host). This communicator stays usable."""
        return Communicator(self._c.grow(int(count), str(addr)), f"{self.name}/grown")

    def destroy(self) -> None:
        """Leave the group now rather than when the last reference to this object goes: its
        connections close and, on rank 0, the rendezvous store frees the master port, so a
        new communicator can be made on it at once. Groups made from it (``split``,
        ``new_group``) share its connections and store, and operations already issued finish
        first (their ``Work`` keeps them going): until those are gone too, the port stays
        taken. Every later call raises :class:`HcommError`. Destroying twice is harmless.
        :func:`DestroyHcom` destroys the default communicator."""
        if not isinstance(self._c, _Destroyed):
            self._c = _Destroyed(self.name)

    @property
    def destroyed(self) -> bool:
        """True once :meth:`destroy` (or :func:`DestroyHcom`) was called."""
        return isinstance(self._c, _Destroyed)

    def __repr__(self) -> str:
        if self.destroyed:
            return f"<hcomm.Communicator {self.name!r} destroyed>"
        return f"<hcomm.Communicator {self.name!r} rank {self.rank} of {self.world_size}>"

    # -- collectives -----------------------------------------------------------------------

    @staticmethod
    def _finish(engine: Any, result: Any, keep: tuple, finish: Any = None) -> Any:
        """The result of a blocking call, or the Work of an async one (engine not None)."""
        if engine is None:
            return finish() if finish is not None else result
        return Work(engine, result, keep, finish)

    def _all_reduce(self, tensor: Any, op: str, out: Any, a: bool) -> Any:
        _check_tensor("all_reduce", "tensor", tensor)
        op = _op("all_reduce", op)
        if out is not None:
            out = _check_out("all_reduce", out, tensor, _shape(tensor))
            return self._finish(self._c.all_reduce(tensor, out, op, a), out, (tensor, out))
        return self._finish(self._c.all_reduce(None, tensor, op, a), tensor, (tensor,))

    def all_reduce(self, tensor: Any, op: str = "sum", out: Any = None) -> Any:
        """Reduce `tensor` over all ranks with `op` (sum, prod, min, max, mean).

        In place: the result replaces `tensor`'s contents and `tensor` is returned; with `out`
        (same shape and dtype) the result goes there and `tensor` is left unchanged."""
        return self._all_reduce(tensor, op, out, False)

    def all_reduce_async(self, tensor: Any, op: str = "sum", out: Any = None) -> Work:
        """:meth:`all_reduce` in the background; ``wait()`` returns the result."""
        return self._all_reduce(tensor, op, out, True)

    def _all_gather(self, tensor: Any, dim: int, out: Any, a: bool) -> Any:
        op = "all_gather"
        _check_tensor(op, "tensor", tensor)
        shape = list(_shape(tensor))
        d = _dim(op, dim, len(shape))
        w = self.world_size
        res_shape = shape[:d] + [shape[d] * w] + shape[d + 1 :]
        if d == 0:
            out = _check_out(op, out, tensor, res_shape)
            return self._finish(self._c.all_gather(tensor, out, None, a), out, (tensor, out))
        if out is not None:
            _check_out(op, out, tensor, res_shape)
        parts = _empty(tensor, [w] + shape)
        engine = self._c.all_gather(tensor, parts, None, a)
        return self._finish(engine, None, (tensor, parts), lambda: _concat(parts, d, out))

    def all_gather(self, tensor: Any, dim: int = -1, out: Any = None) -> Any:
        """Every rank's `tensor`, concatenated in rank order along `dim`: (1024, 256) becomes
        (1024, 256 * world_size) with the default ``dim=-1``. Returns a new tensor (or `out`);
        `tensor` is unchanged. Along dim 0 the ranks' data land in the result directly; along
        another dim they are gathered, then concatenated (one local copy)."""
        return self._all_gather(tensor, dim, out, False)

    def all_gather_async(self, tensor: Any, dim: int = -1, out: Any = None) -> Work:
        """:meth:`all_gather` in the background; ``wait()`` returns the result."""
        return self._all_gather(tensor, dim, out, True)

    def _reduce_scatter(self, tensor: Any, op: str, out: Any, a: bool) -> Any:
        name = "reduce_scatter"
        _check_tensor(name, "tensor", tensor)
        op = _op(name, op)
        shape = list(_shape(tensor))
        _dim(name, 0, len(shape))
        w = self.world_size
        if shape[0] % w:
            raise InvalidArgumentError(
                f"{name}: dim 0 of the tensor ({shape[0]}) does not divide into {w} equal shares"
            )
        out = _check_out(name, out, tensor, [shape[0] // w] + shape[1:])
        return self._finish(self._c.reduce_scatter(tensor, out, op, None, a), out, (tensor, out))

    def reduce_scatter(self, tensor: Any, op: str = "sum", out: Any = None) -> Any:
        """Reduce `tensor` over all ranks and give each rank its share along dim 0: rank r
        gets rows ``[r * n, (r + 1) * n)`` of the reduction, ``n = tensor.shape[0] //
        world_size`` (which must divide). Returns a new tensor (or `out`); `tensor` is
        unchanged."""
        return self._reduce_scatter(tensor, op, out, False)

    def reduce_scatter_async(self, tensor: Any, op: str = "sum", out: Any = None) -> Work:
        """:meth:`reduce_scatter` in the background; ``wait()`` returns the result."""
        return self._reduce_scatter(tensor, op, out, True)

    def broadcast(self, tensor: Any, root_rank: int = 0) -> Any:
        """Copy `root_rank`'s `tensor` into every rank's `tensor` (in place; same shape
        everywhere). Returns `tensor`."""
        _check_tensor("broadcast", "tensor", tensor)
        self._c.broadcast(tensor, _int("broadcast", "root_rank", root_rank))
        return tensor

    def broadcast_async(self, tensor: Any, root_rank: int = 0) -> Work:
        """:meth:`broadcast` in the background; ``wait()`` returns `tensor`."""
        _check_tensor("broadcast", "tensor", tensor)
        return Work(self._c.broadcast(tensor, _int("broadcast", "root_rank", root_rank), True), tensor, (tensor,))

    def _reduce(self, tensor: Any, op: str, root_rank: int, out: Any, a: bool) -> Any:
        _check_tensor("reduce", "tensor", tensor)
        op, root_rank = _op("reduce", op), _int("reduce", "root_rank", root_rank)
        is_root = self.rank == root_rank
        if out is not None:
            if is_root:
                out = _check_out("reduce", out, tensor, _shape(tensor))
            engine = self._c.reduce(tensor, out if is_root else None, op, root_rank, a)
            return self._finish(engine, out if is_root else None, (tensor, out))
        engine = self._c.reduce(None, tensor, op, root_rank, a)
        return self._finish(engine, tensor if is_root else None, (tensor,))

    def reduce(self, tensor: Any, op: str = "sum", root_rank: int = 0, out: Any = None) -> Any:
        """Reduce `tensor` over all ranks onto `root_rank`. On the root the result replaces
        `tensor` (in place) or goes to `out`, and is returned; other ranks' tensors are
        unchanged and they get None."""
        return self._reduce(tensor, op, root_rank, out, False)

    def reduce_async(self, tensor: Any, op: str = "sum", root_rank: int = 0, out: Any = None) -> Work:
        """:meth:`reduce` in the background; ``wait()`` returns the result (None off the root)."""
        return self._reduce(tensor, op, root_rank, out, True)

    def _gather(self, tensor: Any, root_rank: int, dim: int, out: Any, a: bool) -> Any:
        op = "gather"
        _check_tensor(op, "tensor", tensor)
        root_rank = _int(op, "root_rank", root_rank)
        shape = list(_shape(tensor))
        d = _dim(op, dim, len(shape))
        w = self.world_size
        res_shape = shape[:d] + [shape[d] * w] + shape[d + 1 :]
        if self.rank != root_rank:
            return self._finish(self._c.gather(tensor, None, root_rank, None, a), None, (tensor,))
        if d == 0:
            out = _check_out(op, out, tensor, res_shape)
            return self._finish(self._c.gather(tensor, out, root_rank, None, a), out, (tensor, out))
        if out is not None:
            _check_out(op, out, tensor, res_shape)
        parts = _empty(tensor, [w] + shape)
        engine = self._c.gather(tensor, parts, root_rank, None, a)
        return self._finish(engine, None, (tensor, parts), lambda: _concat(parts, d, out))

    def gather(self, tensor: Any, root_rank: int = 0, dim: int = 0, out: Any = None) -> Any:
        """Every rank's `tensor` (same shape everywhere), concatenated in rank order along
        `dim` on `root_rank`, which gets the result (new, or `out`); other ranks get None."""
        return self._gather(tensor, root_rank, dim, out, False)

    def gather_async(self, tensor: Any, root_rank: int = 0, dim: int = 0, out: Any = None) -> Work:
        """:meth:`gather` in the background; ``wait()`` returns the result (None off the root)."""
        return self._gather(tensor, root_rank, dim, out, True)

    def _scatter(self, tensor: Any, root_rank: int, out: Any, a: bool) -> Any:
        op = "scatter"
        root_rank = _int(op, "root_rank", root_rank)
        is_root = self.rank == root_rank
        if tensor is None:
            if is_root or out is None:
                raise InvalidArgumentError(
                    f"{op}: {'the root needs the tensor to scatter' if is_root else 'give the tensor (for its shape) or out'}"
                )
            _check_tensor(op, "out", out)
            return self._finish(self._c.scatter(None, out, root_rank, None, a), out, (out,))
        _check_tensor(op, "tensor", tensor)
        shape = list(_shape(tensor))
        _dim(op, 0, len(shape))
        w = self.world_size
        if shape[0] % w:
            raise InvalidArgumentError(f"{op}: dim 0 of the tensor ({shape[0]}) does not divide into {w} equal shares")
        out = _check_out(op, out, tensor, [shape[0] // w] + shape[1:])
        engine = self._c.scatter(tensor if is_root else None, out, root_rank, None, a)
        return self._finish(engine, out, (tensor, out))

    def scatter(self, tensor: Any, root_rank: int = 0, out: Any = None) -> Any:
        """Split `root_rank`'s `tensor` along dim 0 into world_size equal shares; rank r gets
        share r (new, or `out`). Other ranks pass a tensor of the same shape (its contents are
        not used), or None with `out`."""
        return self._scatter(tensor, root_rank, out, False)

    def scatter_async(self, tensor: Any, root_rank: int = 0, out: Any = None) -> Work:
        """:meth:`scatter` in the background; ``wait()`` returns this rank's share."""
        return self._scatter(tensor, root_rank, out, True)

    def _all_to_all(self, tensor: Any, out: Any, send_counts: Any, recv_counts: Any, a: bool) -> Any:
        op = "all_to_all"
        _check_tensor(op, "tensor", tensor)
        shape = list(_shape(tensor))
        _dim(op, 0, len(shape))
        w = self.world_size
        row = _elements(tensor) // shape[0] if shape[0] else 1
        if send_counts is None and recv_counts is None:
            if shape[0] % w:
                raise InvalidArgumentError(f"{op}: dim 0 of the tensor ({shape[0]}) does not divide into {w} equal blocks")
            out = _check_out(op, out, tensor, shape)
            return self._finish(self._c.all_to_all(tensor, out, None, None, a), out, (tensor, out))
        if send_counts is None or recv_counts is None:
            raise InvalidArgumentError(f"{op}: give both send_counts and recv_counts, or neither")
        send_counts, recv_counts = _ints(op, "send_counts", send_counts), _ints(op, "recv_counts", recv_counts)
        if sum(send_counts) != shape[0]:
            raise InvalidArgumentError(f"{op}: send_counts add up to {sum(send_counts)} rows, the tensor has {shape[0]}")
        out = _check_out(op, out, tensor, [sum(recv_counts)] + shape[1:])
        engine = self._c.all_to_all(tensor, out, [c * row for c in send_counts], [c * row for c in recv_counts], a)
        return self._finish(engine, out, (tensor, out))

    def all_to_all(
        self,
        tensor: Any,
        out: Any = None,
        send_counts: Optional[Sequence[int]] = None,
        recv_counts: Optional[Sequence[int]] = None,
    ) -> Any:
        """Exchange blocks of rows: block p of `tensor` (along dim 0) goes to rank p, and block
        p of the result comes from rank p. Equal blocks by default (dim 0 must divide by
        world_size); `send_counts` / `recv_counts` give rows per rank instead (what each rank
        sends must match what its peer expects). Returns a new tensor (or `out`)."""
        return self._all_to_all(tensor, out, send_counts, recv_counts, False)

    def all_to_all_async(
        self,
        tensor: Any,
        out: Any = None,
        send_counts: Optional[Sequence[int]] = None,
        recv_counts: Optional[Sequence[int]] = None,
    ) -> Work:
        """:meth:`all_to_all` in the background; ``wait()`` returns the result."""
        return self._all_to_all(tensor, out, send_counts, recv_counts, True)

    def barrier(self) -> None:
        """Block until every rank has called barrier."""
        self._c.barrier()

    def barrier_async(self) -> Work:
        """:meth:`barrier` in the background; ``wait()`` returns None once every rank is in."""
        return Work(self._c.barrier(True))

    # -- compression and byte counters -----------------------------------------------------

    def _all_reduce_compressed(self, tensor: Any, compressor: Optional[str], state: "Optional[CompressionState]", op: str, a: bool) -> Any:
        _check_tensor("all_reduce_compressed", "tensor", tensor)
        op = _op("all_reduce_compressed", op)
        state = _compression_state(compressor, state)
        engine = self._c.all_reduce_compressed(tensor, state._s, op, a)
        return self._finish(engine, tensor, (tensor, state))

    def all_reduce_compressed(
        self,
        tensor: Any,
        compressor: Optional[str] = None,
        state: "Optional[CompressionState]" = None,
        op: str = "sum",
    ) -> Any:
        """All-reduce the float32 `tensor` in place (sum or mean) while a compressed form of
        it travels, and return it.

        Give a :class:`CompressionState` as `state` and keep it for the next steps of the same
        tensor: it holds the residual (what compression dropped, added to the next input:
        error feedback). `compressor` alone (``"fp16"``, ``"bf16"``, ``"int8:256"``,
        ``"sign:1024"``, ``"topk:1%"``, ``"randk:1%"``, ...) compresses this one call with a
        fresh state (no error feedback across calls). Every rank must use the same compressor
        and tensor size; the result is bitwise identical on every rank.

        Raises :class:`InvalidArgumentError` (also a ``ValueError``) for a dtype other than
        float32, an op other than sum/mean, an unknown compressor, or a state used with
        another tensor size; :class:`TypeError` for an unsupported object."""
        return self._all_reduce_compressed(tensor, compressor, state, op, False)

    def all_reduce_compressed_async(
        self,
        tensor: Any,
        compressor: Optional[str] = None,
        state: "Optional[CompressionState]" = None,
        op: str = "sum",
    ) -> Work:
        """:meth:`all_reduce_compressed` in the background; ``wait()`` returns `tensor`. Do
        not touch `tensor` or use `state` elsewhere before it completes (operations on one
        state run in issue order)."""
        return self._all_reduce_compressed(tensor, compressor, state, op, True)

    def _reduce_scatter_compressed(self, tensor: Any, compressor: Optional[str], state: "Optional[CompressionState]", op: str, out: Any,
                                   a: bool) -> Any:
        name = "reduce_scatter_compressed"
        _check_tensor(name, "tensor", tensor)
        op = _op(name, op)
        state = _compression_state(compressor, state, name)
        shape = list(_shape(tensor))
        _dim(name, 0, len(shape))
        w = self.world_size
        if shape[0] % w:
            raise InvalidArgumentError(f"{name}: dim 0 of the tensor ({shape[0]}) does not divide into {w} equal shares")
        out = _check_out(name, out, tensor, [shape[0] // w] + shape[1:])
        engine = self._c.reduce_scatter_compressed(tensor, out, state._s, op, a)
        return self._finish(engine, out, (tensor, out, state))

    def reduce_scatter_compressed(
        self,
        tensor: Any,
        compressor: Optional[str] = None,
        state: "Optional[CompressionState]" = None,
        op: str = "sum",
        out: Any = None,
    ) -> Any:
        """:meth:`reduce_scatter` of the float32 `tensor` (sum or mean) while a compressed form
        of each rank's share travels, FSDP's gradient reduction: rank r gets rows ``[r * n,
        (r + 1) * n)`` of the reduction (``n = tensor.shape[0] // world_size``), in a new
        tensor or `out`; `tensor` is unchanged.

        `compressor` is ``"fp16"``, ``"bf16"``, ``"int8[:BLOCK]"``, ``"int8sr[:BLOCK]"``,
        ``"sign[:BLOCK]"`` or ``"none"`` (top-k and random-k pick elements of the whole vector
        and are refused). Give a :class:`CompressionState` as `state` and keep it for the next
        steps of the same tensor: its residual (one value per element of `tensor`) is added
        to the next input (error feedback). Each rank sends ``(n-1)/n`` of its encoded tensor,
        as a ring reduce-scatter does with the dense one.

        Raises :class:`InvalidArgumentError` for a dtype other than float32, an op other than
        sum/mean, a tensor that does not divide into world_size shares, a top-k/random-k or
        unknown compressor, or a state used with another tensor size."""
        return self._reduce_scatter_compressed(tensor, compressor, state, op, out, False)

    def reduce_scatter_compressed_async(
        self,
        tensor: Any,
        compressor: Optional[str] = None,
        state: "Optional[CompressionState]" = None,
        op: str = "sum",
        out: Any = None,
    ) -> Work:
        """:meth:`reduce_scatter_compressed` in the background; ``wait()`` returns the share.
        Do not touch `tensor` or `out`, or use `state` elsewhere, before it completes."""
        return self._reduce_scatter_compressed(tensor, compressor, state, op, out, True)

    # -- sparse ----------------------------------------------------------------------------

    def _sparse_all_reduce(self, tensor: Any, values: Any, op: str, a: bool) -> Any:
        name = "sparse_all_reduce"
        op = _op(name, op)
        coo = values is None and _is_torch(tensor) and getattr(tensor, "is_sparse", False)
        if coo:
            t = tensor.coalesce() if not tensor.is_coalesced() else tensor
            if t.sparse_dim() != 1:
                raise InvalidArgumentError(
                    f"{name}: a sparse tensor with {t.sparse_dim()} sparse dimensions; only row-sparse "
                    "tensors (sparse_dim 1, e.g. an nn.Embedding(sparse=True) gradient) are supported"
                )
            indices, values = t.indices()[0].contiguous(), t.values().contiguous()
            dense_shape = tuple(t.shape)
        else:
            if values is None:
                raise TypeError(f"{name}: give (indices, values), or one sparse torch tensor")
            indices = tensor
            _check_tensor(name, "indices", indices)
            _check_tensor(name, "values", values)
            if len(_shape(indices)) != 1:
                raise InvalidArgumentError(f"{name}: indices must be 1-D, got shape {_shape(indices)}")
        vshape = _shape(values)
        rows = _shape(indices)[0]
        if not vshape or vshape[0] != rows:
            raise InvalidArgumentError(
                f"{name}: values have shape {vshape}; expected one row per index ({rows} rows first)"
            )
        row_shape = vshape[1:]
        row_len = 1
        for d in row_shape:
            row_len *= d
        engine, holder = self._c.sparse_all_reduce(indices, values, row_len, op, a, dense_shape[0] if coo else None)

        def result() -> Any:
            ib, vb = holder.take()
            if _is_torch(values):
                import torch

                idx = torch.frombuffer(ib, dtype=torch.int64) if len(ib) else torch.empty(0, dtype=torch.int64)
                val = (torch.frombuffer(vb, dtype=values.dtype) if len(vb) else torch.empty(0, dtype=values.dtype))
                val = val.reshape((idx.shape[0],) + row_shape)
                if coo:
                    if idx.numel() and int(idx[-1]) >= dense_shape[0]:
                        raise InvalidArgumentError(
                            f"{name}: the reduced rows reach row {int(idx[-1])}, but this rank's tensor has "
                            f"{dense_shape[0]} rows (the ranks' tensors differ in size)"
                        )
                    # The tensor is built as coalesced with torch's invariant checks off, so
                    # torch will index with these rows unchecked: make sure they are what the
                    # reduction promises (ascending, unique, >= 0), or fail here rather than
                    # let a wrong index write outside the tensor.
                    if idx.numel() and (int(idx[0]) < 0 or not bool((idx[1:] > idx[:-1]).all())):
                        raise HcommError(
                            f"{name}: the reduced row indices are not ascending, unique and >= 0 "
                            f"(first {int(idx[0])}, last {int(idx[-1])}); this is a bug in hcomm, please report it"
                        )
                    return torch.sparse_coo_tensor(idx.unsqueeze(0), val, dense_shape, is_coalesced=True)
                return idx, val
            import numpy as np

            idx = np.frombuffer(ib, dtype=np.int64)
            val = np.frombuffer(vb, dtype=values.dtype).reshape((idx.shape[0],) + row_shape)
            return idx, val

        return self._finish(engine, None, (), result)

    def sparse_all_reduce(self, indices: Any, values: Any = None, op: str = "sum") -> Any:
        """Sum (``op="sum"``) or average (``"mean"``) a row-sparse tensor over all ranks,
        moving only the rows each rank has (an all-gather of (index, row) pairs, as Gloo and
        Horovod do for sparse gradients): much less than a dense all-reduce while the ranks'
        rows are a small part of the table.

        Give `indices` (1-D int64) and `values` (one row per index: shape ``(len(indices),
        ...)``), numpy or torch; returns ``(indices, values)`` of the reduced tensor, indices
        ascending and unique, repeated indices summed, identical bits on every rank. Or give one
        torch sparse COO tensor with one sparse dimension (an ``nn.Embedding(sparse=True)``
        gradient); returns a coalesced sparse tensor of the same shape. Rows a rank lacks count
        as zero (``mean`` divides by the world size). Row shape and dtype must agree across
        ranks; the number of rows may differ."""
        return self._sparse_all_reduce(indices, values, op, False)

    def sparse_all_reduce_async(self, indices: Any, values: Any = None, op: str = "sum") -> Work:
        """:meth:`sparse_all_reduce` in the background (the inputs are copied when it is
        issued); ``wait()`` returns the result."""
        return self._sparse_all_reduce(indices, values, op, True)

    def traffic(self) -> "list[Traffic]":
        """Bytes this rank moved per kind of operation (``all_reduce``,
        ``all_reduce_compressed``, ``broadcast``, ...) since the communicator was made or
        :meth:`reset_traffic` last ran: a list of :class:`Traffic` rows, in the order the
        operations first ran. TCP bytes are those written to / read from sockets (frame
        headers included); shared-memory bytes those copied into / out of the segment. A
        fused bucket counts under ``all_reduce`` (compressed: ``all_reduce_compressed``)."""
        return [Traffic(*row) for row in self._c.traffic()]

    def reset_traffic(self) -> None:
        """Zero the counters of :meth:`traffic`."""
        self._c.reset_traffic()

    # -- fusion ----------------------------------------------------------------------------

    def fusion(
        self,
        op: str = "sum",
        cap_bytes: int = 25 << 20,
        first_bucket_bytes: int = 1 << 20,
        direct_bytes: int = 1 << 20,
        compression: Optional[str] = None,
        error_feedback: bool = True,
        skip_zeros: bool = False,
        encode_on_push: bool = False,
    ) -> "Fusion":
        """A :class:`Fusion` (bucketed all-reduce of many tensors) on this communicator; with
        `compression` (a compressor string such as ``"int8"`` or ``"topk:1%"``) every bucket
        is all-reduced compressed, with `skip_zeros` uncompressed buckets skip their zero
        blocks (lossless; see :class:`Fusion`)."""
        return Fusion(self, op, cap_bytes, first_bucket_bytes, direct_bytes, compression, error_feedback, skip_zeros, encode_on_push)

    def all_reduce_coalesced(self, tensors: Sequence[Any], op: str = "sum", cap_bytes: int = 25 << 20) -> list:
        """All-reduce every tensor of `tensors` (in place, any sizes and dtypes) in fused
        buckets of up to `cap_bytes`: the results are those of one all_reduce per tensor, with
        a few collectives instead of one per tensor. Returns the tensors."""
        tensors = list(tensors)
        f = Fusion(self, _op("all_reduce_coalesced", op), cap_bytes, cap_bytes, max(cap_bytes, 1 << 20))
        for t in tensors:
            f.push(t)
        f.finish()
        return tensors

    # -- point-to-point and synchronisation ------------------------------------------------

    def send(self, tensor: Any, dst_rank: int, tag: int = 0) -> None:
        """Send `tensor` to `dst_rank` under `tag` (messages match by (rank, tag))."""
        _check_tensor("send", "tensor", tensor)
        self._c.send(_int("send", "dst_rank", dst_rank), _int("send", "tag", tag), tensor)

    def recv(self, tensor: Any, src_rank: int, tag: int = 0) -> Any:
        """Receive the message `src_rank` sent with `tag` into `tensor` (in place; sizes must
        match) and return `tensor`."""
        _check_tensor("recv", "tensor", tensor)
        self._c.recv(_int("recv", "src_rank", src_rank), _int("recv", "tag", tag), tensor)
        return tensor

    def send_async(self, tensor: Any, dst_rank: int, tag: int = 0) -> Work:
        """:meth:`send` in the background."""
        _check_tensor("send", "tensor", tensor)
        return Work(self._c.send(_int("send", "dst_rank", dst_rank), _int("send", "tag", tag), tensor, True), None, (tensor,))

    def recv_async(self, tensor: Any, src_rank: int, tag: int = 0) -> Work:
        """:meth:`recv` in the background; ``wait()`` returns `tensor`."""
        _check_tensor("recv", "tensor", tensor)
        return Work(self._c.recv(_int("recv", "src_rank", src_rank), _int("recv", "tag", tag), tensor, True), tensor, (tensor,))

    def recv_any(self, tensor: Any, tag: int = 0) -> int:
        """Receive into `tensor` the first message with `tag` that arrives from any rank
        (MPI's ``MPI_ANY_SOURCE``); returns the sender's rank. Receives posted for that rank
        and tag before it are served first."""
        _check_tensor("recv_any", "tensor", tensor)
        return self._c.recv_any(_int("recv_any", "tag", tag), tensor)

    def recv_any_async(self, tensor: Any, tag: int = 0) -> Work:
        """:meth:`recv_any` in the background; ``wait()`` returns ``(sender rank, tensor)``."""
        _check_tensor("recv_any", "tensor", tensor)
        engine = self._c.recv_any(_int("recv_any", "tag", tag), tensor, True)
        return Work(engine, None, (tensor,), lambda: (engine.source_rank(), tensor))

    def send_recv(self, send: Any, dst_rank: int, recv: Any, src_rank: int, tag: int = 0) -> Any:
        """Send `send` to `dst_rank` and receive into `recv` from `src_rank` at the same time
        (no deadlock when two ranks exchange). Returns `recv`."""
        _check_tensor("send_recv", "send", send)
        _check_tensor("send_recv", "recv", recv)
        o = "send_recv"
        self._c.send_recv(_int(o, "dst_rank", dst_rank), send, _int(o, "src_rank", src_rank), recv, _int(o, "tag", tag))
        return recv

    def create_connection(self, dst_rank: int, tag: int = 0) -> Connection:
        """Open a connection to `dst_rank` under `tag` (both ranks call it)."""
        return Connection(self._c.connect(_int("connect", "dst_rank", dst_rank), _int("connect", "tag", tag)))

    def signal(self, dst_rank: int, tag: int = 0) -> None:
        """Post a signal to `dst_rank` (does not wait). Signals are counted: each
        :meth:`wait` consumes one."""
        self._c.signal(_int("signal", "dst_rank", dst_rank), _int("signal", "tag", tag))

    def wait(self, src_rank: int, tag: int = 0) -> None:
        """Wait for a signal from `src_rank` with `tag`."""
        self._c.wait_signal(_int("wait_signal", "src_rank", src_rank), _int("wait_signal", "tag", tag))

    def wait_async(self, src_rank: int, tag: int = 0) -> Work:
        """:meth:`wait` in the background: the Work completes when the signal has come."""
        return Work(self._c.wait_signal(_int("wait_signal", "src_rank", src_rank), _int("wait_signal", "tag", tag), True))

    # -- shared memory ---------------------------------------------------------------------

    def allocate_shared_memory(self, size: int, flags: str = "read_write") -> SharedMemory:
        """Allocate `size` bytes of shared memory and publish it for the ranks of this host.
        Per rank, not collective."""
        if flags not in ("read_write", "read_only"):
            raise InvalidArgumentError(f"flags must be 'read_write' or 'read_only', got {flags!r}")
        return SharedMemory(self._c.alloc_shared(_int("alloc_shared", "size", size)), flags)

    def get_shared_memory(self, src_rank: int, flags: str = "read_write") -> SharedMemory:
        """Map the shared memory `src_rank` allocated (waiting for it up to the timeout)."""
        if flags not in ("read_write", "read_only"):
            raise InvalidArgumentError(f"flags must be 'read_write' or 'read_only', got {flags!r}")
        return SharedMemory(self._c.get_shared(_int("get_shared", "src_rank", src_rank)), flags)

    # -- groups ----------------------------------------------------------------------------

    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Split into sub-communicators (collective): ranks with the same `color` form one,
        ordered by (key, rank); color=None leaves this rank out (returns None)."""
        c = self._c.split(None if color is None else _int("split", "color", color), _int("split", "key", key))
        return None if c is None else Communicator(c, f"{self.name}/split{color}")

    def new_group(self, ranks: Sequence[int]) -> "Communicator":
        """A communicator of `ranks` (in that order). Only they call it, with the same list."""
        ranks = _ints("new_group", "ranks", ranks)
        return Communicator(self._c.new_group(ranks), f"{self.name}/group{ranks}")



class Fusion:
    """Gradient fusion: many tensors all-reduced in a few large buckets, started while the
    caller is still producing tensors (e.g. during the backward pass).

    Push tensors (numpy arrays or CPU torch tensors, any dtypes) as they become ready; each
    bucket's all-reduce starts as soon as it is full, in the background. :meth:`finish` waits
    for every bucket and leaves the results in the tensors, as if each had been all-reduced
    alone. Every rank must push the same tensors (sizes, dtypes) in the same order. Do not
    touch a pushed tensor before :meth:`finish` returns.

    Buckets hold one dtype and up to `cap_bytes` (the first one closed `first_bucket_bytes`,
    so communication starts early); tensors of at least `direct_bytes` are reduced in place
    without packing.

    With `compression` (a compressor string: ``"fp16"``, ``"bf16"``, ``"int8[:BLOCK]"``,
    ``"sign[:BLOCK]"``, ``"topk:K|P%"``, ``"randk:K|P%"``) every bucket is all-reduced with
    :meth:`Communicator.all_reduce_compressed`, and keeps its own :class:`CompressionState`
    (with error feedback unless `error_feedback=False`) from step to step, keyed by its
    members (positions in the step) and size: push the same tensors in the same order every
    step. `op` must then be sum or mean and the tensors float32.

    With `skip_zeros=True`, uncompressed buckets are all-reduced skipping their zero blocks
    (1 KiB each): when the blocks that are not zero, over all ranks, are fewer than half the
    bucket's (at 2 ranks; (n - 1) / n at n), only those travel (an all-gather), else the
    dense all-reduce runs. Lossless, for any dtype with op sum or mean: made for a dense
    embedding gradient, zero but for the rows of the batch's tokens. It costs a scan of each
    bucket and a small all-gather of counts.

    With `encode_on_push=True`, compressed buckets do the compressor's local part (top-k's
    residual add and selection) in the :meth:`push` that closes the bucket, on the caller's
    thread, instead of on hcomm's progress engine: each rank then pays for its own selection
    on the thread that computes. Worth it when every core computes (the engines' work
    otherwise slows whichever rank the scheduler puts it next to). ::

        fusion = comm.fusion(op="mean")
        with fusion.step() as bucket:          # or: fusion.push(...) ... fusion.finish()
            for g in grads_as_they_become_ready:
                bucket.push(g)
        # every g now holds the mean over the ranks
    """

    def __init__(
        self,
        comm: "Communicator",
        op: str = "sum",
        cap_bytes: int = 25 << 20,
        first_bucket_bytes: int = 1 << 20,
        direct_bytes: int = 1 << 20,
        compression: Optional[str] = None,
        error_feedback: bool = True,
        skip_zeros: bool = False,
        encode_on_push: bool = False,
    ) -> None:
        if compression is not None and not isinstance(compression, str):
            raise TypeError(f"fusion: compression must be a compressor string such as 'int8' or 'topk:1%', got {type(compression).__name__}")
        self._f = comm._c.fusion(op, _int("fusion", "cap_bytes", cap_bytes), _int("fusion", "first_bucket_bytes", first_bucket_bytes), _int("fusion", "direct_bytes", direct_bytes), compression, bool(error_feedback),
                                 bool(skip_zeros), bool(encode_on_push))
        #: Buckets of the last finished step.
        self.last_step_buckets = 0
        self._pushed: list = []  # this step's tensors, for finish(ready=...)

    @property
    def compression(self) -> Optional[str]:
        """The buckets' compressor in canonical form (``"int8:256"``, ``"topk:1%"``), or None
        when buckets are all-reduced exactly (also for ``compression="none"``)."""
        return self._f.compressor

    @property
    def error_feedback(self) -> Optional[bool]:
        """Whether compressed buckets keep residuals (None without compression)."""
        return self._f.error_feedback

    def reset_compression(self) -> None:
        """Forget every bucket's residual (e.g. after changing the model)."""
        self._f.reset_compression()

    def compression_memory(self) -> "tuple[int, int]":
        """(buckets holding a compression state, bytes of their residuals)."""
        return tuple(self._f.compression_memory())

    def push(self, tensor: Any) -> None:
        """Add a ready tensor; launches a bucket if this fills one."""
        _check_tensor("fusion", "tensor", tensor)
        self._f.push(tensor)
        self._pushed.append(tensor)

    def flush(self) -> None:
        """Launch every partly filled bucket now."""
        self._f.flush()

    @property
    def buckets_launched(self) -> int:
        """Buckets launched in the current step."""
        return self._f.buckets_launched

    def finish(self, ready: Any = None) -> int:
        """Wait for every bucket of the step, unpack the results into the tensors, start a new
        step; returns the step's number of buckets.

        With `ready`, call ``ready(tensors)`` as soon as results are in, while later buckets
        may still be in flight: e.g. step the optimizer for those parameters, overlapping it
        with the rest of the communication. Each call covers the bucket just waited for and
        every following bucket that had already arrived (their tensors in launch order, each
        tensor in exactly one call), so buckets that all arrived during backward make one
        call, and the per-call cost (an optimizer step) is paid once. If `ready` raises, it
        is not called again; the remaining buckets are still waited for, then the exception
        propagates."""
        pushed, self._pushed = self._pushed, []
        cb = None if ready is None else (lambda positions: ready([pushed[i] for i in positions]))
        self.last_step_buckets = self._f.finish(cb)
        return self.last_step_buckets

    def step(self) -> "_FusionStep":
        """A context manager for one step: ``with fusion.step() as b: b.push(t)``; leaving it
        calls :meth:`finish` (also on an exception, so no bucket is left in flight)."""
        return _FusionStep(self)

    def __repr__(self) -> str:
        return repr(self._f).replace("hcomm._hcomm.", "hcomm.")


class _FusionStep:
    def __init__(self, fusion: Fusion) -> None:
        self._fusion = fusion

    def __enter__(self) -> Fusion:
        return self._fusion

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self._fusion.finish()
        else:
            try:
                self._fusion.finish()
            except HcommError:
                pass  # the exception already raising says more


# ----------------------------------------------------------------------------------------------
# the default communicator and the HCCL names

_default: Optional[Communicator] = None
_default_lock = threading.Lock()


def _get() -> Communicator:
    c = _default
    if c is None:
        raise HcommError("hcomm is not initialised: call hcomm.InitHcom() first")
    return c


def InitHcom(name: str = "hccl_world_group", config_path: "Optional[str | os.PathLike[str]]" = None, rank: Optional[int] = None) -> Communicator:
    """Join the job and make the default communicator the HCCL-named functions use.

    With `config_path`, the job is the rank table (JSON) at that path and this process's rank
    is `rank` or the first of ``HCOMM_RANK``, ``RANK``, ... that is set; otherwise the
    environment describes it (``hcomm run``, torchrun, mpirun, srun, ``HCOMM_*``). Returns the
    communicator. Raises :class:`HcommError` if already initialised."""
    global _default
    with _default_lock:
        if _default is not None:
            raise HcommError(
                f"InitHcom: already initialised (group {_default.name!r}); call DestroyHcom() first"
            )
        if config_path is not None:
            _default = Communicator.from_rank_table(config_path, rank, name)
        else:
            _default = Communicator.from_env(name)
        return _default


def DestroyHcom() -> None:
    """Leave the job: destroy the default communicator (:meth:`Communicator.destroy`; a
    reference kept to it raises from then on), after which InitHcom can be called again, on
    the same master port. Harmless when there is none."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.destroy()
        _default = None


def Shrink(exclude: Sequence[int] = ()) -> Communicator:
    """Replace the default communicator by its survivors' (:meth:`Communicator.shrink`) after
    a rank was lost; returns it. Every surviving rank calls it."""
    global _default
    with _default_lock:
        old = _get()
        _default = old.shrink(exclude)
        old.destroy()
        return _default


def Grow(count: int, addr: str) -> Communicator:
    """Replace the default communicator by itself plus `count` new processes
    (:meth:`Communicator.grow`); returns it. Every rank of the default communicator calls it."""
    global _default
    with _default_lock:
        old = _get()
        _default = old.grow(count, addr)
        old.destroy()
        return _default


def JoinGrown(addr: str, name: str = "hccl_world_group") -> Communicator:
    """Join a growing job through `addr` and make the result the default communicator (the
    InitHcom of a replacement process)."""
    global _default
    with _default_lock:
        if _default is not None:
            raise HcommError(f"JoinGrown: already initialised (group {_default.name!r}); call DestroyHcom() first")
        _default = Communicator.join_grown(addr, name)
        return _default


def GetCommunicator() -> Communicator:
    """The default communicator (after InitHcom)."""
    return _get()


def GetRank() -> int:
    """This process's rank in the default communicator."""
    return _get().rank


def GetWorldSize() -> int:
    """Number of ranks of the default communicator."""
    return _get().world_size


def GetLocalRank() -> int:
    """This process's index among the ranks of its host."""
    return _get().local_rank


def AllReduce(tensor: Any, op: str = "sum", out: Any = None) -> Any:
    """All-reduce in place (or into `out`); see :meth:`Communicator.all_reduce`."""
    return _get().all_reduce(tensor, op, out)


def AllGather(tensor: Any, dim: int = -1, out: Any = None) -> Any:
    """All-gather along `dim`; see :meth:`Communicator.all_gather`."""
    return _get().all_gather(tensor, dim, out)


def ReduceScatter(tensor: Any, op: str = "sum", out: Any = None) -> Any:
    """Reduce-scatter along dim 0; see :meth:`Communicator.reduce_scatter`."""
    return _get().reduce_scatter(tensor, op, out)


def Broadcast(tensor: Any, root_rank: int = 0) -> Any:
    """Broadcast in place; see :meth:`Communicator.broadcast`."""
    return _get().broadcast(tensor, root_rank)


def Reduce(tensor: Any, op: str = "sum", root_rank: int = 0, out: Any = None) -> Any:
    """Reduce onto `root_rank`; see :meth:`Communicator.reduce`."""
    return _get().reduce(tensor, op, root_rank, out)


def Gather(tensor: Any, root_rank: int = 0, dim: int = 0, out: Any = None) -> Any:
    """Gather onto `root_rank`; see :meth:`Communicator.gather`."""
    return _get().gather(tensor, root_rank, dim, out)


def Scatter(tensor: Any, root_rank: int = 0, out: Any = None) -> Any:
    """Scatter from `root_rank`; see :meth:`Communicator.scatter`."""
    return _get().scatter(tensor, root_rank, out)


def AllToAll(tensor: Any, out: Any = None, send_counts: Optional[Sequence[int]] = None, recv_counts: Optional[Sequence[int]] = None) -> Any:
    """All-to-all along dim 0; see :meth:`Communicator.all_to_all`."""
    return _get().all_to_all(tensor, out, send_counts, recv_counts)


def Barrier() -> None:
    """Block until every rank has called Barrier."""
    _get().barrier()


def AllReduceAsync(tensor: Any, op: str = "sum", out: Any = None) -> Work:
    """:func:`AllReduce` in the background; returns a :class:`Work` (``wait()`` gives the
    result)."""
    return _get().all_reduce_async(tensor, op, out)


def AllGatherAsync(tensor: Any, dim: int = -1, out: Any = None) -> Work:
    """:func:`AllGather` in the background."""
    return _get().all_gather_async(tensor, dim, out)


def ReduceScatterAsync(tensor: Any, op: str = "sum", out: Any = None) -> Work:
    """:func:`ReduceScatter` in the background."""
    return _get().reduce_scatter_async(tensor, op, out)


def BroadcastAsync(tensor: Any, root_rank: int = 0) -> Work:
    """:func:`Broadcast` in the background."""
    return _get().broadcast_async(tensor, root_rank)


def ReduceAsync(tensor: Any, op: str = "sum", root_rank: int = 0, out: Any = None) -> Work:
    """:func:`Reduce` in the background."""
    return _get().reduce_async(tensor, op, root_rank, out)


def GatherAsync(tensor: Any, root_rank: int = 0, dim: int = 0, out: Any = None) -> Work:
    """:func:`Gather` in the background."""
    return _get().gather_async(tensor, root_rank, dim, out)


def ScatterAsync(tensor: Any, root_rank: int = 0, out: Any = None) -> Work:
    """:func:`Scatter` in the background."""
    return _get().scatter_async(tensor, root_rank, out)


def AllToAllAsync(tensor: Any, out: Any = None, send_counts: Optional[Sequence[int]] = None, recv_counts: Optional[Sequence[int]] = None) -> Work:
    """:func:`AllToAll` in the background."""
    return _get().all_to_all_async(tensor, out, send_counts, recv_counts)


def BarrierAsync() -> Work:
    """:func:`Barrier` in the background."""
    return _get().barrier_async()


def AllReduceCoalesced(tensors: Sequence[Any], op: str = "sum", cap_bytes: int = 25 << 20) -> list:
    """All-reduce many tensors in place in fused buckets; see
    :meth:`Communicator.all_reduce_coalesced`."""
    return _get().all_reduce_coalesced(tensors, op, cap_bytes)


def CreateFusion(
    op: str = "sum",
    cap_bytes: int = 25 << 20,
    first_bucket_bytes: int = 1 << 20,
    direct_bytes: int = 1 << 20,
    compression: Optional[str] = None,
    error_feedback: bool = True,
) -> Fusion:
    """A :class:`Fusion` on the default communicator (compressed buckets with
    `compression`)."""
    return _get().fusion(op, cap_bytes, first_bucket_bytes, direct_bytes, compression, error_feedback)


def AllReduceCompressed(tensor: Any, compressor: Optional[str] = None, state: Optional[CompressionState] = None, op: str = "sum") -> Any:
    """All-reduce a float32 tensor in place while a compressed form travels; see
    :meth:`Communicator.all_reduce_compressed`."""
    return _get().all_reduce_compressed(tensor, compressor, state, op)


def AllReduceCompressedAsync(tensor: Any, compressor: Optional[str] = None, state: Optional[CompressionState] = None, op: str = "sum") -> Work:
    """:func:`AllReduceCompressed` in the background; ``wait()`` returns the tensor."""
    return _get().all_reduce_compressed_async(tensor, compressor, state, op)


def SparseAllReduce(indices: Any, values: Any = None, op: str = "sum") -> Any:
    """Sum or average a row-sparse tensor (indices + rows, or a torch sparse COO tensor) over
    the default communicator's ranks, moving only the rows; see
    :meth:`Communicator.sparse_all_reduce`."""
    return _get().sparse_all_reduce(indices, values, op)


def SparseAllReduceAsync(indices: Any, values: Any = None, op: str = "sum") -> Work:
    """:func:`SparseAllReduce` in the background; ``wait()`` returns the result."""
    return _get().sparse_all_reduce_async(indices, values, op)


def GetTraffic() -> "list[Traffic]":
    """Bytes the default communicator moved per kind of operation; see
    :meth:`Communicator.traffic`."""
    return _get().traffic()


def ResetTraffic() -> None:
    """Zero the default communicator's byte counters."""
    _get().reset_traffic()


def CreateConnection(dst_rank: int, tag: int = 0) -> Connection:
    """Open a connection to `dst_rank` under `tag` (both ranks call it)."""
    return _get().create_connection(dst_rank, tag)


def DestroyConnection(conn: Connection) -> None:
    """Close a connection."""
    conn.close()


def SendAsync(tensor: Any, dst_rank: int, tag: int = 0) -> Work:
    """Send `tensor` to `dst_rank` under `tag` in the background."""
    return _get().send_async(tensor, dst_rank, tag)


def RecvAsync(tensor: Any, src_rank: int, tag: int = 0) -> Work:
    """Receive into `tensor` from `src_rank` under `tag` in the background."""
    return _get().recv_async(tensor, src_rank, tag)


def Send(tensor: Any, conn: "Connection | int", tag: int = 0) -> None:
    """Send `tensor` on connection `conn` (or to rank `conn` under `tag`)."""
    if isinstance(conn, Connection):
        conn.send(tensor)
    else:
        _get().send(tensor, conn, tag)


def Recv(tensor: Any, conn: "Connection | int", tag: int = 0) -> Any:
    """Receive into `tensor` (in place) from connection `conn` (or from rank `conn` under
    `tag`); returns `tensor`."""
    if isinstance(conn, Connection):
        return conn.recv(tensor)
    return _get().recv(tensor, conn, tag)


def Signal(dst_rank: int, tag: int = 0) -> None:
    """Post a signal to `dst_rank` (does not wait)."""
    _get().signal(dst_rank, tag)


def Wait(handle: Any = None, *, src_rank: Optional[int] = None, tag: int = 0, timeout: Optional[float] = None) -> Any:
    """``Wait(handle)``: wait for an async operation and return its result.
    ``Wait(src_rank=r, tag=t)``: wait for a signal from rank r with tag t."""
    if isinstance(handle, Work):
        return handle.wait(timeout)
    if handle is not None and hasattr(handle, "wait") and not isinstance(handle, int):
        return handle.wait()
    if src_rank is None:
        if isinstance(handle, int):
            src_rank = handle
        else:
            raise TypeError("Wait: give a handle (Wait(work)) or a signal source (Wait(src_rank=..., tag=...))")
    _get().wait(src_rank, tag)
    return None


def AllocateSharedMemory(size: int, flags: str = "read_write") -> SharedMemory:
    """Allocate `size` bytes of shared memory for the ranks of this host (per rank)."""
    return _get().allocate_shared_memory(size, flags)


def GetSharedMemory(src_rank: int, flags: str = "read_write") -> SharedMemory:
    """Map the shared memory `src_rank` allocated."""
    return _get().get_shared_memory(src_rank, flags)


def FreeSharedMemory(shm: SharedMemory) -> None:
    """Unmap (for the owner: free) shared memory. Its views must be deleted first."""
    shm.free()


# snake_case twins
init_hcom = InitHcom
shrink = Shrink
grow = Grow
join_grown = JoinGrown
destroy_hcom = DestroyHcom
get_communicator = GetCommunicator
get_rank = GetRank
get_world_size = GetWorldSize
get_local_rank = GetLocalRank
all_reduce = AllReduce
all_gather = AllGather
reduce_scatter = ReduceScatter
broadcast = Broadcast
reduce = Reduce
gather = Gather
scatter = Scatter
all_to_all = AllToAll
barrier = Barrier
all_reduce_async = AllReduceAsync
all_gather_async = AllGatherAsync
reduce_scatter_async = ReduceScatterAsync
broadcast_async = BroadcastAsync
reduce_async = ReduceAsync
gather_async = GatherAsync
scatter_async = ScatterAsync
all_to_all_async = AllToAllAsync
barrier_async = BarrierAsync
all_reduce_coalesced = AllReduceCoalesced
create_fusion = CreateFusion
all_reduce_compressed = AllReduceCompressed
all_reduce_compressed_async = AllReduceCompressedAsync
sparse_all_reduce = SparseAllReduce
sparse_all_reduce_async = SparseAllReduceAsync
get_traffic = GetTraffic
reset_traffic = ResetTraffic
traffic = GetTraffic
create_connection = CreateConnection
destroy_connection = DestroyConnection
send = Send
send_async = SendAsync
recv_async = RecvAsync
recv = Recv
signal = Signal
wait = Wait
allocate_shared_memory = AllocateSharedMemory
get_shared_memory = GetSharedMemory
free_shared_memory = FreeSharedMemory
