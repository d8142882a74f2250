"""The ``"hcomm"`` backend of ``torch.distributed``.

Importing this module registers it::

    import torch.distributed as dist
    import hcomm.torch  # noqa: F401  (registers "hcomm")

    dist.init_process_group("hcomm")   # under hcomm run or torchrun (env://), or any init_method
    model = torch.nn.parallel.DistributedDataParallel(model)

It implements allreduce, broadcast, reduce, allgather (and ``all_gather_into_tensor``),
reduce_scatter (and ``reduce_scatter_tensor``), alltoall (and ``all_to_all_single``), gather,
scatter, barrier, send and recv on CPU tensors, with the reduce ops SUM, PRODUCT, MIN, MAX and
AVG. Each process group bootstraps an hcomm communicator through the store torch hands it:
rank 0 of the group starts hcomm's rendezvous on a free port of its own and publishes the
address there, so the backend never competes with torch's store for ``MASTER_PORT``. The job token
(``HCOMM_JOB_TOKEN`` / ``HCOMM_TOKEN_FILE``, set by ``hcomm run``) authenticates hcomm's
connections; without one (torchrun) rank 0 makes one and hands it over through the store.
``HCOMM_TIMEOUT`` (if set) or the group's timeout becomes hcomm's deadline.

With ``async_op=True`` (and for DDP's gradient buckets) allreduce, broadcast,
all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single run on hcomm's progress
engine and return at once; their Work completes (and its future is set, by one waiter thread
per process group) when hcomm is done, in issue order. The other operations run when issued
and return a completed Work. Non-contiguous tensors go through a contiguous copy.

:func:`compression_hook` with a :class:`CompressionHookState` is a DDP communication hook that
all-reduces DDP's gradient buckets with hcomm's compressed all-reduce (fp16, bf16, int8, sign,
top-k, random-k, with error feedback)::

    ddp.register_comm_hook(hcomm.torch.CompressionHookState("int8"), hcomm.torch.compression_hook)
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import secrets
import socket
import threading
import weakref
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.distributed import ReduceOp

from . import _hcomm
from ._core import Communicator, CompressionState, Work
from .errors import InvalidArgumentError

__all__ = ["HcommBackend", "BACKEND_NAME", "communicator_of", "CompressionHookState", "compression_hook"]

#: The name to pass to ``init_process_group`` / ``new_group``.
BACKEND_NAME = "hcomm"

_OPS = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "mean",
}

_STORE_KEY = "hcomm/rendezvous"


def _op(opts: Any) -> str:
    red = opts.reduceOp
    kind = getattr(red, "op", red)
    try:
        return _OPS[kind]
    except KeyError:
        raise InvalidArgumentError(
            f"hcomm backend: reduce op {kind} is not supported (SUM, PRODUCT, MIN, MAX, AVG are)"
        ) from None


def _check_cpu(op: str, tensors: List[torch.Tensor]) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise InvalidArgumentError(f"hcomm backend: {op} got a tensor on {t.device}; hcomm communicates CPU tensors")


class _Work(dist._Work):
    """A completed operation: ``wait()`` returns at once; ``get_future()`` holds the output
    tensors (what DDP's reducer reads)."""

    def __init__(self, outputs: List[torch.Tensor]) -> None:
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> List[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._outputs)
        return fut


class _AsyncWork(dist._Work):
    """An operation running on hcomm's progress engine. ``wait()`` blocks (without the GIL)
    until hcomm is done; ``get_future()`` is set by the group's waiter thread."""

    def __init__(self, waiter: "_Waiter", engine: Any, outputs: List[torch.Tensor], keep: tuple, post: Optional[Callable[[], None]]) -> None:
        super().__init__()
        self._waiter = waiter
        self._engine = engine
        self._outputs = outputs
        self._keep = keep
        self._post = post
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None

    def _complete(self) -> None:
        with self._lock:
            if self._engine is None:
                if self._error is not None:
                    raise self._error
                return
            try:
                self._engine.wait()
                if self._post is not None:
                    self._post()
            except BaseException as e:
                self._error = e
                raise
            finally:
                self._engine = None
                self._keep = ()
                self._post = None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        self._complete()
        return True

    def is_completed(self) -> bool:
        e = self._engine
        return e is None or (e.is_completed() and self._post is None)

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> List[torch.Tensor]:
        self._complete()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._waiter.put(self.result, fut)
        return fut


_WAITERS: "weakref.WeakSet[_Waiter]" = weakref.WeakSet()


def _stop_waiters() -> None:
    """Stop every waiter thread before the interpreter shuts down: a daemon thread frozen in
    the middle of completing a torch future (C++ code) aborts the process at exit ("terminate
    called without an active exception")."""
    for w in list(_WAITERS):
        w.stop()


atexit.register(_stop_waiters)


class _Waiter:
    """A thread that completes torch futures in issue order (hcomm runs the operations in
    that order): one per process group (its async Works) and one per compression hook state
    (DDP's bucket futures). Every one is stopped at exit (`_stop_waiters`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        _WAITERS.add(self)

    def stop(self) -> None:
        """Finish the queued futures, then end the thread (waits for it)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
            thread.join(timeout=60)

    def put(self, finish: Callable[[], Any], fut: torch.futures.Future) -> None:
        """Set `fut` to what `finish()` returns (or its exception), after the futures put
        before it."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._q.put((finish, fut))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            finish, fut = item
            try:
                result = finish()
            except BaseException as e:  # noqa: BLE001 - handed to the future's owner
                fut.set_exception(e)
            else:
                fut.set_result(result)


def _in_place(t: torch.Tensor, f: Any) -> None:
    """Run `f` on `t`'s memory, through a contiguous copy if `t` is not contiguous."""
    if t.is_contiguous():
        f(t)
    else:
        tmp = t.contiguous()
        f(tmp)
        with torch.no_grad():
            t.copy_(tmp)


def _is_own_block(block: torch.Tensor, whole: torch.Tensor, rank: int) -> bool:
    """True when `block` is exactly block `rank` of the contiguous tensor `whole`."""
    n = block.numel() * block.element_size()
    return (
        whole.is_contiguous()
        and block.is_contiguous()
        and n > 0
        and block.dtype == whole.dtype
        and block.data_ptr() == whole.data_ptr() + rank * n
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1)


def _advertised_address() -> str:
    """This host's address as seen from the master (the interface that routes to it)."""
    master = os.environ.get("MASTER_ADDR") or os.environ.get("HCOMM_MASTER_ADDR") or "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)  # no packet is sent: this only picks the route
                ip = s.getsockname()[0]
                return ip
        except OSError:
            continue
    return "127.0.0.1"


def _bootstrap(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Communicator:
    # Without a job token from the launcher (torchrun sets none), rank 0 makes one and hands it
    # over with the address: hcomm's connections are then authenticated as far as torch's
    # store can be trusted with the secret.
    own_token = bool(os.environ.get("HCOMM_JOB_TOKEN") or os.environ.get("HCOMM_TOKEN_FILE"))
    if rank == 0:
        addr = _advertised_address()
        token = "-" if own_token else secrets.token_hex(32)
        store.set(_STORE_KEY, f"{addr} {_hcomm.free_master_port(addr)} {token}")
    value = store.get(_STORE_KEY)  # waits for rank 0 (up to the store's timeout)
    addr, port, token = value.decode().rsplit(" ", 2)
    variables = {
        "HCOMM_RANK": str(rank),
        "HCOMM_WORLD_SIZE": str(size),
        "HCOMM_MASTER_ADDR": addr,
        "HCOMM_MASTER_PORT": port,
        # The group's ranks are not the launcher's: hcomm works the local layout out itself.
        "HCOMM_LOCAL_RANK": None,
        "HCOMM_LOCAL_WORLD_SIZE": None,
    }
    if token != "-" and not own_token:
        variables["HCOMM_JOB_TOKEN"] = token
    if not os.environ.get("HCOMM_TIMEOUT"):
        variables["HCOMM_TIMEOUT"] = f"{max(timeout.total_seconds(), 0.001):.3f}"
    return Communicator.from_vars(variables, name=f"torch/{rank}")


class HcommBackend(_C10dBackend):
    """A ``torch.distributed`` backend over an hcomm :class:`~hcomm.Communicator`."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, comm: Optional[Communicator] = None) -> None:
        super().__init__(rank, size)
        self._options = _C10dBackend.Options(BACKEND_NAME, timeout=timeout)
        self.comm = comm if comm is not None else _bootstrap(store, rank, size, timeout)
        self._waiter = _Waiter("hcomm-torch-waiter")

    @property
    def _c(self) -> Any:
        # Looked up on every call, so that a destroyed communicator is refused here too.
        return self.comm._c

    def _run(self, opts: Any, out: torch.Tensor, keep: tuple, call: Callable[[torch.Tensor, bool], Any]) -> dist._Work:
        """Run `call(buffer, async_op)` writing `out` (through a contiguous copy if `out` is
        not contiguous); asynchronously when the caller asked for it."""
        buf = out if out.is_contiguous() else out.contiguous()

        def post() -> None:
            with torch.no_grad():
                out.copy_(buf)

        if not getattr(opts, "asyncOp", False):
            call(buf, False)
            if buf is not out:
                post()
            return _Work([out])
        engine = call(buf, True)
        return _AsyncWork(self._waiter, engine, [out], keep + (buf,), post if buf is not out else None)

    @property
    def options(self) -> Any:
        return self._options

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_coalescing(self) -> bool:
        return False

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # -- collectives -----------------------------------------------------------------------

    def allreduce(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("allreduce", tensors)
        op = _op(opts)
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        if len(tensors) == 1:
            return self._run(opts, tensors[0], (), lambda b, a: self._c.all_reduce(None, b, op, a))
        for t in tensors:
            _in_place(t, lambda b: self._c.all_reduce(None, b, op))
        return _Work(tensors)

    def _sparse_allreduce(self, tensors: List[torch.Tensor], op: str) -> _Work:
        """Sparse tensors (an ``nn.Embedding(sparse=True)`` gradient under DDP): hcomm's sparse
        all-reduce, which moves only the rows (like gloo's). Each input is replaced by the
        coalesced result, which is also the work's result (what DDP's reducer reads)."""
        if op not in ("sum", "mean"):
            raise InvalidArgumentError(f"hcomm backend: sparse allreduce sums or averages, not {op}")
        if not all(t.is_sparse for t in tensors):
            raise InvalidArgumentError("hcomm backend: allreduce got sparse and dense tensors together")
        out = []
        for t in tensors:
            res = self.comm.sparse_all_reduce(t, op=op)
            with torch.no_grad():
                t.copy_(res)
            out.append(res)
        return _Work(out)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("broadcast", tensors)
        if len(tensors) == 1:
            return self._run(opts, tensors[0], (), lambda b, a: self._c.broadcast(b, opts.rootRank, a))
        for t in tensors:
            _in_place(t, lambda b: self._c.broadcast(b, opts.rootRank))
        return _Work(tensors)

    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("reduce", tensors)
        op = _op(opts)
        for t in tensors:
            _in_place(t, lambda b: self._c.reduce(None, b, op, opts.rootRank))
        return _Work(tensors)

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("allgather", inputs)
        for outs, inp in zip(output_lists, inputs):
            _check_cpu("allgather", outs)
            counts = [o.numel() for o in outs]
            flat = torch.empty(sum(counts), dtype=inp.dtype)
            self._c.all_gather(_flat(inp), flat, counts)
            with torch.no_grad():
                for o, part in zip(outs, flat.split(counts)):
                    o.copy_(part.view_as(o))
        return _Work([o for outs in output_lists for o in outs])

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> _Work:
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> _Work:
        _check_cpu("all_gather_into_tensor", [output, inp])
        src = _flat(inp)
        if _is_own_block(src, output, self.rank()):  # in place (FSDP's usage)
            return self._run(opts, output, (), lambda b, a: self._c.all_gather(None, b, None, a))
        return self._run(opts, output, (src,), lambda b, a: self._c.all_gather(src, b, None, a))

    def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> _Work:
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _Work(outputs)

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any) -> _Work:
        _check_cpu("reduce_scatter", outputs)
        op = _op(opts)
        for out, ins in zip(outputs, input_lists):
            _check_cpu("reduce_scatter", ins)
            flat = torch.cat([_flat(t) for t in ins])
            counts = [t.numel() for t in ins]
            _in_place(out, lambda b: self._c.reduce_scatter(flat, b, op, counts))
        return _Work(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> _Work:
        _check_cpu("reduce_scatter_tensor", [output, inp])
        op = _op(opts)
        src = _flat(inp)
        if _is_own_block(output, inp, self.rank()) and inp.is_contiguous():  # in place
            work = self._run(opts, inp, (), lambda b, a: self._c.reduce_scatter(None, b, op, None, a))
            work._outputs = [output]
            return work
        return self._run(opts, output, (src,), lambda b, a: self._c.reduce_scatter(src, b, op, None, a))

    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> _Work:
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _Work(outputs)

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("alltoall", outputs + inputs)
        send = torch.cat([_flat(t) for t in inputs]) if inputs else torch.empty(0)
        rcounts = [t.numel() for t in outputs]
        recv = torch.empty(sum(rcounts), dtype=send.dtype)
        self._c.all_to_all(send, recv, [t.numel() for t in inputs], rcounts)
        with torch.no_grad():
            for o, part in zip(outputs, recv.split(rcounts)):
                o.copy_(part.view_as(o))
        return _Work(outputs)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: List[int], input_split_sizes: List[int], opts: Any) -> _Work:
        _check_cpu("all_to_all_single", [output, inp])
        n = self.size()
        src = _flat(inp)
        if not output_split_sizes and not input_split_sizes:
            return self._run(opts, output, (src,), lambda b, a: self._c.all_to_all(src, b, None, None, a))
        in_row = inp.numel() // inp.size(0) if inp.dim() and inp.size(0) else 1
        out_row = output.numel() // output.size(0) if output.dim() and output.size(0) else 1
        isz = list(input_split_sizes) or [inp.size(0) // n] * n
        osz = list(output_split_sizes) or [output.size(0) // n] * n
        sc = [s * in_row for s in isz]
        rc = [s * out_row for s in osz]
        return self._run(opts, output, (src,), lambda b, a: self._c.all_to_all(src, b, sc, rc, a))

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("gather", inputs)
        root = opts.rootRank
        for i, inp in enumerate(inputs):
            if self.rank() == root:
                outs = output_lists[i]
                counts = [o.numel() for o in outs]
                flat = torch.empty(sum(counts), dtype=inp.dtype)
                self._c.gather(_flat(inp), flat, root, counts)
                with torch.no_grad():
                    for o, part in zip(outs, flat.split(counts)):
                        o.copy_(part.view_as(o))
            else:
                self._c.gather(_flat(inp), None, root)
        return _Work([o for outs in output_lists for o in outs])

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any) -> _Work:
        _check_cpu("scatter", outputs)
        root = opts.rootRank
        for i, out in enumerate(outputs):
            if self.rank() == root:
                flat = torch.cat([_flat(t) for t in input_lists[i]])
                _in_place(out, lambda b: self._c.scatter(flat, b, root))
            else:
                _in_place(out, lambda b: self._c.scatter(None, b, root))
        return _Work(outputs)

    def barrier(self, opts: Any = None) -> _Work:
        self._c.barrier()
        return _Work([])

    # -- point-to-point --------------------------------------------------------------------

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        _check_cpu("send", tensors)
        for t in tensors:
            self._c.send(dst, tag, _flat(t))
        return _Work(tensors)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> _Work:
        _check_cpu("recv", tensors)
        for t in tensors:
            _in_place(t, lambda b: self._c.recv(src, tag, b))
        return _Work(tensors)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> _Work:
        raise InvalidArgumentError("hcomm backend: receiving from any source is not supported; name the source rank")

    def abort(self) -> None:
        self._c.abort()

    def shutdown(self) -> None:
        pass


def communicator_of(group: Any = None) -> Communicator:
    """The hcomm :class:`~hcomm.Communicator` behind a process group of the "hcomm" backend
    (default: the default group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, HcommBackend):
        raise InvalidArgumentError(f"the process group's CPU backend is {type(backend).__name__}, not hcomm")
    return backend.comm


# ----------------------------------------------------------------------------------------------
# DDP communication hook: gradient buckets all-reduced compressed by hcomm


class CompressionHookState:
    """The state of :func:`compression_hook`: the compressor, whether error feedback is on,
    the communicator, and one :class:`hcomm.CompressionState` (residuals) per DDP bucket::

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = hcomm.torch.CompressionHookState("int8", error_feedback=True)
        ddp.register_comm_hook(state, hcomm.torch.compression_hook)

    `compressor` is an hcomm compressor string (``"fp16"``, ``"bf16"``, ``"int8[:BLOCK]"``,
    ``"sign[:BLOCK]"``, ``"topk:K|P%"``, ``"randk:K|P%"``, ``"none"``). The communicator is
    `comm` if given, else the one behind `process_group` (or the default group) when its
    backend is ``"hcomm"``, else hcomm's default communicator (``hcomm.InitHcom()``); it is
    resolved at the first bucket. Buckets that are not float32 are all-reduced exactly.

    A bucket's state is keyed by (bucket index, elements). DDP rebuilds its buckets once,
    after the first iteration; the first iteration's residuals are then dropped (counted in
    :attr:`dropped_states`), which loses one step's compression error."""

    def __init__(
        self,
        compressor: str = "int8",
        error_feedback: bool = True,
        comm: Optional[Communicator] = None,
        process_group: Any = None,
    ) -> None:
        CompressionState(compressor)  # validate now (InvalidArgumentError), not in backward
        self.compressor = compressor
        self.error_feedback = bool(error_feedback)
        self.comm = comm
        self.process_group = process_group
        #: Compression state per (bucket index, elements).
        self.states: dict = {}
        #: States of buckets that no longer exist (after DDP's bucket rebuild).
        self.dropped_states = 0
        self._waiter = _Waiter("hcomm-comm-hook")

    def communicator(self) -> Communicator:
        """The hcomm communicator the hook uses (resolved once)."""
        if self.comm is None:
            try:
                self.comm = communicator_of(self.process_group)
            except (ValueError, RuntimeError, AttributeError):
                from . import _core

                if _core._default is None:
                    raise InvalidArgumentError(
                        "hcomm compression hook: the process group's backend is not hcomm and hcomm.InitHcom() was not "
                        "called; pass comm= (an hcomm.Communicator) to CompressionHookState"
                    ) from None
                self.comm = _core._default
        return self.comm

    def state_for(self, index: int, numel: int) -> CompressionState:
        """The compression state of bucket `index` of `numel` elements (made on first use)."""
        key = (index, numel)
        st = self.states.get(key)
        if st is None:
            stale = [k for k in self.states if k[0] == index]
            for k in stale:
                del self.states[k]
            self.dropped_states += len(stale)
            st = CompressionState(self.compressor, self.error_feedback, key=(index << 32) ^ numel)
            self.states[key] = st
        return st

    def __repr__(self) -> str:
        return f"<hcomm.torch.CompressionHookState {self.compressor} error_feedback={self.error_feedback} buckets={len(self.states)}>"


def compression_hook(state: CompressionHookState, bucket: Any) -> torch.futures.Future:
    """A DDP communication hook (``ddp.register_comm_hook(state, compression_hook)``): each
    gradient bucket is averaged over the ranks by hcomm's compressed all-reduce, started at
    once on hcomm's progress engine (so it overlaps with the rest of backward), with the
    bucket's residual kept in `state` (:class:`CompressionHookState`) between iterations.
    The future holds the bucket's buffer, averaged in place."""
    buf = bucket.buffer()
    comm = state.communicator()
    if buf.dtype != torch.float32 or buf.device.type != "cpu":
        if buf.device.type != "cpu":
            raise InvalidArgumentError(f"hcomm compression hook: the bucket is on {buf.device}; hcomm communicates CPU tensors")
        work = comm.all_reduce_async(buf, op="mean")
    else:
        st = state.state_for(bucket.index(), buf.numel())
        work = comm.all_reduce_compressed_async(buf, state=st, op="mean")
    fut: torch.futures.Future = torch.futures.Future()

    def finish() -> torch.Tensor:
        work.wait()
        return buf

    state._waiter.put(finish, fut)
    return fut


# DDP checks a hook's annotations as objects (this module's are strings: `from __future__
# import annotations`).
compression_hook.__annotations__ = {
    "state": CompressionHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> HcommBackend:
    return HcommBackend(store, rank, size, timeout)


if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
