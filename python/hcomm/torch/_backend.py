"""The ``"hcomm"`` torch.distributed backend itself (see the package's docstring): the
process group, its Work handles, bootstrap through torch's store, sub-groups and the
registration with torch."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import queue
import secrets
import socket
import threading
import weakref
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.distributed import ReduceOp

from .. import _hcomm
from .._core import Communicator
from ..errors import HcommError, HcommTimeoutError, InvalidArgumentError, PeerError


#: The name to pass to ``init_process_group`` / ``new_group``.
BACKEND_NAME = "hcomm"

#: ReduceOps hcomm's core reduces itself (AVG is its mean).
_CORE_OPS = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "mean",
}

#: Bitwise ReduceOps: gathered, then folded here (hcomm's core has no bitwise reduction).
_BITWISE = {
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}

#: torch.bool travels as uint8 0/1, where OR is MAX and AND is MIN; SUM and PRODUCT of bools
#: are OR and AND, as gloo reduces them.
_BOOL_CORE = {
    ReduceOp.SUM: "max",
    ReduceOp.MAX: "max",
    ReduceOp.BOR: "max",
    ReduceOp.PRODUCT: "min",
    ReduceOp.MIN: "min",
    ReduceOp.BAND: "min",
}

_STORE_KEY = "hcomm/rendezvous"


class _Reduction:
    """How one ReduceOp reduces one dtype: by hcomm's core (`core`, an hcomm op name), after
    multiplying every rank's input by `factor` (PREMUL_SUM), or by gathering every rank's
    input and folding it here with `local` (bitwise ops)."""

    __slots__ = ("name", "core", "local", "factor")

    def __init__(self, name: str, core: Optional[str] = None, local: Optional[Callable[..., Any]] = None, factor: Any = None) -> None:
        self.name = name
        self.core = core
        self.local = local
        self.factor = factor

    def scaled(self, t: torch.Tensor) -> torch.Tensor:
        """`t` times the PREMUL_SUM factor (a new tensor of t's dtype), or `t` itself."""
        if self.factor is None:
            return t
        with torch.no_grad():
            return (t * self.factor).to(t.dtype)

    def fold(self, rows: torch.Tensor) -> torch.Tensor:
        """Reduce the rows of a (ranks, n) tensor with `local`."""
        acc = rows[0].clone()
        for r in rows[1:]:
            self.local(acc, r, out=acc)  # type: ignore[misc]
        return acc


#: Plans already made, by (op, dtype): every op but PREMUL_SUM (whose factor changes per
#: call) plans the same way each time, and planning is a visible part of a small call.
_PLANS: dict = {}


def _reduction(opts: Any, dtype: torch.dtype, what: str) -> _Reduction:
    """The plan for `opts.reduceOp` on `dtype`, or an InvalidArgumentError naming both."""
    red = opts.reduceOp
    kind = getattr(red, "op", red)
    try:
        plan = _PLANS.get((kind, dtype))
    except TypeError:  # an op that cannot be a key: planned each time
        plan = None
    if plan is not None:
        return plan
    plan = _plan(red, kind, dtype, what)
    if kind != ReduceOp.PREMUL_SUM:
        try:
            _PLANS[(kind, dtype)] = plan
        except TypeError:
            pass
    return plan


def _plan(red: Any, kind: Any, dtype: torch.dtype, what: str) -> _Reduction:
    name = f"ReduceOp.{getattr(kind, 'name', kind)}"

    def refuse(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"hcomm backend: {what} with {name} on {dtype}: {why}")

    if dtype == torch.bool:
        if kind in _BOOL_CORE:
            return _Reduction(name, core=_BOOL_CORE[kind])
        if kind == ReduceOp.BXOR:
            return _Reduction(name, local=torch.bitwise_xor)
        raise refuse("bool tensors reduce with SUM, PRODUCT, MIN, MAX, BAND, BOR or BXOR")
    if kind in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise refuse("bitwise reductions take integer or bool tensors")
        return _Reduction(name, local=_BITWISE[kind])
    if dtype.is_complex and kind not in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        raise refuse("complex tensors reduce with SUM, AVG or PREMUL_SUM")
    if kind == ReduceOp.PREMUL_SUM:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise refuse("PREMUL_SUM takes floating-point or complex tensors")
        factor = red.factor
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1 or factor.device.type != "cpu":
                raise refuse(f"the factor must be one number on the CPU, got a tensor of shape {tuple(factor.shape)} on {factor.device}")
            factor = factor.reshape(())
        return _Reduction(name, core="sum", factor=factor)
    if kind in _CORE_OPS:  # AVG of integers divides the sum as integers do (as NCCL's does)
        return _Reduction(name, core=_CORE_OPS[kind])
    raise refuse("not supported (SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM, BAND, BOR, BXOR are)")


def _wire(t: torch.Tensor) -> torch.Tensor:
    """`t` as hcomm communicates it, sharing its memory: bool as uint8, complex as its real
    view (two floats per element, as gloo sends it); other dtypes as they are."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    return t


def _root(op: str, root: int, size: int) -> int:
    """`root` checked against the group's size, so that an out-of-range rank is an error naming
    it (not the binding's bare OverflowError for a negative one)."""
    if not 0 <= root < size:
        raise InvalidArgumentError(f"hcomm backend: {op}: root rank {root} is out of range for a group of {size} ranks")
    return root


def _check_cpu(op: str, tensors: List[torch.Tensor]) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise InvalidArgumentError(f"hcomm backend: {op} got a tensor on {t.device}; hcomm communicates CPU tensors")


def _check_list(op: str, what: str, tensors: List[torch.Tensor], n: int, like: torch.Tensor, own: Optional[int] = None) -> None:
    """A list of one tensor per rank (``what``: its name in torch's API) against ``like`` (the
    tensor this rank sends or receives): gloo's check. Every tensor must have ``like``'s dtype;
    the shape is checked for every tensor, or (``own`` given: the others may come from ranks
    whose tensors differ, as NCCL allows) for ``tensors[own]`` only. A tensor of another shape
    with as many elements used to be filled silently in the wrong layout."""
    if len(tensors) != n:
        raise InvalidArgumentError(f"hcomm backend: {op}: {what} has {len(tensors)} tensors, expected one per rank ({n})")
    for i, t in enumerate(tensors):
        if t.dtype != like.dtype:
            raise InvalidArgumentError(f"hcomm backend: {op}: {what}[{i}] has dtype {t.dtype}, expected {like.dtype}")
        if (own is None or i == own) and t.shape != like.shape:
            raise InvalidArgumentError(
                f"hcomm backend: {op}: {what}[{i}] has shape {tuple(t.shape)}, expected {tuple(like.shape)}"
            )


# torch wraps the Work a Python backend returns (a PyWorkHolder) and forwards only wait() and
# get_future() to it: is_completed(), is_success() and exception() of the handle the user gets
# are the holder's own (never completed). `_install_work_queries` makes those three ask the
# hcomm Work behind the holder, found through get_future(): asked while `_probe.on` is set,
# an hcomm Work records itself in `_probe.hit` (and returns a completed future, queueing
# nothing). Handles of other backends are answered by torch's own methods, as before.
_probe = threading.local()


def _probing(work: Any) -> bool:
    if getattr(_probe, "on", False):
        _probe.hit = work
        return True
    return False


def _hcomm_work_behind(handle: Any) -> Optional[Any]:
    """The hcomm Work (`_Work` / `_AsyncWork`) behind a torch Work handle, or None."""
    _probe.on, _probe.hit = True, None
    try:
        handle.get_future()
    except Exception:  # noqa: BLE001 - a backend without futures: not ours
        return None
    finally:
        _probe.on = False
    hit, _probe.hit = _probe.hit, None
    return hit


def _install_work_queries() -> None:
    cls = dist._Work
    if getattr(cls.is_completed, "_hcomm", False):
        return
    originals = {name: getattr(cls, name) for name in ("is_completed", "is_success", "exception", "_source_rank")}

    def forward(name: str) -> Callable[..., Any]:
        orig = originals[name]

        def query(self: Any) -> Any:
            if name == "is_completed" and orig(self):
                return True
            mine = _hcomm_work_behind(self)
            if mine is None:
                return orig(self)
            return getattr(mine, name)()

        query.__name__ = name
        query.__doc__ = orig.__doc__
        query._hcomm = True  # type: ignore[attr-defined]
        return query

    for name in originals:
        setattr(cls, name, forward(name))


_TORCH_FLAVOURS: "dict[type, type]" = {}


def _torch_error(e: BaseException) -> BaseException:
    """An hcomm failure as torch code expects a backend's: the same hcomm class (so
    ``except hcomm.HcommTimeoutError`` still works), also a ``torch.distributed.DistBackendError``
    (a ``RuntimeError``, what gloo raises), with the same message and fields; a timeout says
    where the group's timeout comes from. Refused arguments stay ``InvalidArgumentError``
    (a ``ValueError``, as torch raises for bad input); anything else is returned as it is."""
    if not isinstance(e, HcommError) or isinstance(e, (InvalidArgumentError, dist.DistBackendError)):
        return e
    cls = type(e)
    flavour = _TORCH_FLAVOURS.get(cls)
    if flavour is None:
        doc = f"{cls.__name__} raised through the torch backend: also a torch.distributed.DistBackendError."
        flavour = type(cls.__name__, (cls, dist.DistBackendError), {"__module__": cls.__module__, "__doc__": doc})
        _TORCH_FLAVOURS[cls] = flavour
    message = str(e)
    if isinstance(e, HcommTimeoutError):
        message += " (raise the group's timeout with init_process_group(timeout=...) or HCOMM_TIMEOUT)"
    out = flavour(message)
    out.__dict__.update(e.__dict__)
    return out


def _done_future(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _unwrap(fut: torch.futures.Future) -> Any:
    ok, value = fut.value()
    if ok:
        return value
    raise value


def _outcome_future() -> "tuple[torch.futures.Future, torch.futures.Future]":
    """(base, result): set base to (True, value) or (False, exception); result then holds
    the value, or fails with the exception. torch keeps ``Future.set_exception`` in the Python
    wrapper of the future, which is lost when the future crosses torch's C++ code (a Work's
    get_future, DDP's reducer): its ``value()`` would then be the exception object. An error
    raised in a ``then`` callback is kept by the C++ future itself."""
    base: torch.futures.Future = torch.futures.Future()
    return base, base.then(_unwrap)


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

    def exception(self) -> Optional[BaseException]:
        return None

    def result(self) -> List[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        if _probing(self):
            return _done_future(None)
        return _done_future(self._outputs)

    def _complete(self, timeout: Optional[float] = None) -> None:
        pass


def _seconds(timeout: Optional[datetime.timedelta]) -> Optional[float]:
    """A Work.wait timeout in seconds; None for none (torch passes kNoTimeout, -1 ms, or 0)."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else None


class _AsyncWork(dist._Work):
    """An operation running on hcomm's progress engine. ``wait()`` blocks (without the GIL)
    until hcomm is done, then runs `post` (copies out of staging buffers, local reductions);
    ``get_future()`` is set by the group's waiter thread."""

    def __init__(self, waiter: "_Waiter", engine: Any, outputs: List[torch.Tensor], keep: tuple, post: Optional[Callable[[], None]]) -> None:
        super().__init__()
        self._waiter = waiter
        self._engine = engine
        self._outputs = outputs
        self._keep = keep
        self._post = post
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None

    def _complete(self, timeout: Optional[float] = None) -> None:
        with self._lock:
            if self._engine is None:
                if self._error is not None:
                    raise self._error
                return
            try:
                self._engine.wait(timeout)
            except BaseException as e:
                err = _torch_error(e)
                if timeout is not None and not self._engine.is_completed():
                    raise err from e  # the wait's own deadline: the operation goes on
                self._error = self._waiter.failure = err
                self._finish_with_error()
                raise err from e
            try:
                if self._post is not None:
                    self._post()
            except BaseException:
                self._finish_with_error()
                raise
            self._engine = None
            self._keep = ()
            self._post = None

    def _source_rank(self) -> int:
        """The sender of a receive from any source (after ``wait()``)."""
        src = getattr(self, "_source", None)
        rank = src.source_rank() if src is not None else None
        if rank is None:
            raise RuntimeError("hcomm backend: _source_rank() is known once a receive from any source completed")
        return rank

    def _finish_with_error(self) -> None:
        import sys

        if self._error is None:
            self._error = sys.exc_info()[1]
        self._engine = None
        self._keep = ()
        self._post = None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        self._complete(_seconds(timeout))
        return True

    def is_completed(self) -> bool:
        e = self._engine
        if e is None:
            return True
        if not e.is_completed():
            return False
        try:
            self._complete()  # hcomm is done: run the copy-out now (does not block)
        except BaseException:  # noqa: BLE001 - kept in _error, reported by wait()/exception()
            pass
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> List[torch.Tensor]:
        self._complete()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        if _probing(self):
            return _done_future(None)
        with self._lock:
            fut, base = self._future, None
            if fut is None:
                base, fut = _outcome_future()
                self._future = fut
        if base is not None:  # outside the lock: the waiter may complete it right here
            self._waiter.put(self.result, base)
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
    (DDP's bucket futures). Every one is stopped at exit (`_stop_waiters`).

    A future's callbacks (``fut.then(...)``) run on this thread. When one of them issues
    another operation and asks for its future (PowerSGD's hook does, and waits for it), that
    future is completed right there, on this thread, instead of being queued behind the
    callback that waits for it: hcomm's engine runs the operation on its own, so waiting for
    it here cannot deadlock."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        #: the last communication failure of the group's operations (its ``get_error``)
        self.failure: Optional[BaseException] = None
        _WAITERS.add(self)

    def stop(self) -> None:
        """Finish the queued futures, then end the thread (waits for it)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout=60)

    def put(self, finish: Callable[[], Any], fut: torch.futures.Future) -> None:
        """Set `fut` to (True, what `finish()` returns) or (False, its exception), after the
        futures put before it (at once when called from this waiter's own thread)."""
        with self._lock:
            if self._thread is threading.current_thread():
                inline = True
            else:
                inline = False
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
        if inline:
            self._settle(finish, fut)
        else:
            self._q.put((finish, fut))

    @staticmethod
    def _settle(finish: Callable[[], Any], fut: torch.futures.Future) -> None:
        try:
            result = finish()
        except BaseException as e:  # noqa: BLE001 - handed to the future's owner
            fut.set_result((False, e))
        else:
            fut.set_result((True, result))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._settle(*item)


def _in_place(t: torch.Tensor, f: Any) -> None:
    """Run `f` on `t`'s memory as hcomm communicates it (`_wire`), through a contiguous copy if
    `t` is not contiguous."""
    w = _wire(t)
    if w.is_contiguous():
        f(w)
    else:
        tmp = w.contiguous()
        f(tmp)
        with torch.no_grad():
            _write_back(w, tmp)


def _write_back(w: torch.Tensor, tmp: torch.Tensor) -> None:
    """``w.copy_(tmp)``, also when ``w`` repeats elements along dimensions of stride 0 (an
    ``expand()``ed tensor, which torch will not copy into): the positions that share an element
    held the same value on each rank, so they hold the same result, written once (gloo writes
    every position into the smaller storage, past its end). Other overlapping layouts are
    refused by name."""
    if torch._debug_has_internal_overlap(w) != 1:  # 0: none, 2: too hard to tell (copy_ checks)
        w.copy_(tmp)
        return
    whole = tmp
    for d in range(w.dim()):
        if w.stride(d) == 0 and w.size(d) > 1:
            w, tmp = w.narrow(d, 0, 1), tmp.narrow(d, 0, 1)
    if torch._debug_has_internal_overlap(w) == 1:
        raise InvalidArgumentError(
            f"hcomm backend: the tensor (shape {tuple(w.shape)}, strides {w.stride()}) has elements that overlap "
            "other than along expanded dimensions; pass a tensor without overlapping elements"
        )
    # Only a result that repeats along the expanded dimensions fits (an all-reduce's does; an
    # all-gather's or a scatter's into an expanded output does not).
    again = tmp.expand_as(whole)
    same = again == whole
    if whole.is_floating_point():
        same |= again.isnan() & whole.isnan()
    if not bool(same.all()):
        raise InvalidArgumentError(
            "hcomm backend: the output is an expand()ed tensor (stride 0) but the result differs along its "
            "expanded dimensions; pass an output that does not repeat its elements"
        )
    w.copy_(tmp)


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


def _check_block_of(op: str, block: torch.Tensor, whole: torch.Tensor, rank: int) -> None:
    """Refuse `block` lying in `whole`'s memory other than as this rank's block (FSDP's in-place
    form), naming the block it is: the core would only say that the buffers overlap."""
    n = block.numel() * block.element_size()
    start, end = whole.data_ptr(), whole.data_ptr() + whole.numel() * whole.element_size()
    if n == 0 or not start <= block.data_ptr() < end or _is_own_block(block, whole, rank):
        return
    offset = block.data_ptr() - start
    where = f"block {offset // n} of the larger tensor" if offset % n == 0 and block.is_contiguous() else "inside the larger tensor"
    raise InvalidArgumentError(
        f"hcomm backend: {op}: the smaller tensor is {where}, but this is rank {rank}: in place, it must be block {rank}; "
        "else pass tensors that do not overlap"
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as hcomm communicates them (`_wire`), contiguous and one-dimensional."""
    return _wire(t.detach().contiguous()).reshape(-1)


def _numel(t: torch.Tensor) -> int:
    """Elements of `t` as hcomm counts them (a complex number is two)."""
    return t.numel() * (2 if t.is_complex() else 1)


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `_wire` gives a tensor of `dtype`."""
    if dtype == torch.bool:
        return torch.uint8
    return dtype.to_real() if dtype.is_complex else dtype


class _Engines:
    """Several Works waited for as one (the coalesced entry points)."""

    def __init__(self, works: List[Any]) -> None:
        self._works = works

    def wait(self, timeout: Optional[float] = None) -> None:
        for w in self._works:
            w._complete(timeout)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class _AllOf:
    """Several hcomm Works waited for as one (a send or receive of several tensors)."""

    def __init__(self, works: List[Any]) -> None:
        self._works = works

    def wait(self, timeout: Optional[float] = None) -> None:
        for w in self._works:
            w.wait(timeout)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


#: Backends alive (until their shutdown). torch keeps only the C++ side of a Python backend
#: it wraps (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every one in a ProcessGroupWrapper): without
#: this reference the Python object goes, and every call on the C++ side falls through to
#: torch's base class ("getBackendName is not implemented").
_LIVE: "dict[int, HcommBackend]" = {}


class MonitoredBarrierError(HcommTimeoutError, dist.DistBackendError):
    """``monitored_barrier`` failed: ``peers`` are the ranks that did not arrive in time (on
    rank 0), or rank 0 (on the others). A ``RuntimeError`` (torch's ``DistBackendError``), as
    gloo's is, and an :class:`~hcomm.errors.HcommTimeoutError`."""


def _monitored_error(message: str, peers: "tuple[int, ...]") -> MonitoredBarrierError:
    err = MonitoredBarrierError(message)
    err.peers, err.op = peers, "monitored_barrier"
    return err


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
        self._timeout = timeout
        self.comm = comm if comm is not None else _bootstrap(store, rank, size, timeout)
        self._store = store
        self._waiter = _Waiter("hcomm-torch-waiter")
        self._barriers = 0  # monitored barriers so far (their store keys)
        self._seq = 0  # operations so far (_get_sequence_number_for_group)
        _LIVE[id(self)] = self

    @property
    def _c(self) -> Any:
        # Looked up on every call, so that a destroyed communicator is refused here too.
        return self.comm._c

    def _run(
        self,
        opts: Any,
        out: torch.Tensor,
        call: Callable[[torch.Tensor, bool], Any],
        after: Optional[Callable[[torch.Tensor], None]] = None,
        result: Optional[List[torch.Tensor]] = None,
    ) -> dist._Work:
        """Run `call(buffer, async_op)`, where buffer is `out` as hcomm communicates it
        (`_wire`; a contiguous copy if `out` is not contiguous), then `after(buffer)` (a
        local fold), then copy the buffer into `out` if it is a copy; asynchronously when the
        caller asked for it. The Work's result is `result` (default: [out])."""
        buf = out if out.is_contiguous() else out.contiguous()
        w = _wire(buf)
        res = [out] if result is None else result

        def post() -> None:
            with torch.no_grad():
                if after is not None:
                    after(w)
                if buf is not out:
                    _write_back(out, buf)

        needs_post = after is not None or buf is not out
        if not getattr(opts, "asyncOp", False):
            call(w, False)
            if needs_post:
                post()
            return _Work(res)
        engine = call(w, True)
        return _AsyncWork(self._waiter, engine, res, (buf,), post if needs_post else None)

    def _coalesced(self, works: List[Any], outputs: List[torch.Tensor]) -> dist._Work:
        """One Work for several (``*_coalesced``): complete when all are."""
        if all(isinstance(w, _Work) for w in works):
            return _Work(outputs)
        return _AsyncWork(self._waiter, _Engines(works), outputs, (), None)

    @property
    def options(self) -> Any:
        return self._options

    @property
    def supports_splitting(self) -> bool:
        return True

    def split(self, store: Any, ranks: List[int], opts: Any = None) -> "HcommBackend":
        """``torch.distributed.split_group``: the backend of `ranks` (this group's ranks, in
        the new group's order), made by :meth:`hcomm.Communicator.new_group` on this group's
        communicator, so that it joins through the job's rendezvous store with its token (no
        new torch store key, no new master port). Only the members call it."""
        members = [int(r) for r in ranks]
        if self.rank() not in members:
            raise InvalidArgumentError(f"hcomm backend: split: this rank ({self.rank()}) is not in the ranks {members}")
        timeout = getattr(opts, "_timeout", None) if opts is not None else None
        if not isinstance(timeout, datetime.timedelta):
            timeout = self._timeout
        new = _subgroup(self.comm, members, timeout)
        return HcommBackend(store, new.rank, new.world_size, timeout, comm=new)

    @property
    def supports_coalescing(self) -> bool:
        return False

    @property
    def supports_shrinking(self) -> bool:
        return True

    def shrink(self, ranks_to_exclude: List[int], shrink_flags: int = 0, opts: Any = None) -> "HcommBackend":
        """``torch.distributed.shrink_group``: the backend of the ranks left
        (:meth:`hcomm.Communicator.shrink`, which revokes this one first, so that
        ``SHRINK_ABORT`` and the default behave alike). Every rank not in `ranks_to_exclude`
        calls it; a rank that died and is not listed makes it fail, naming it."""
        excluded = sorted(int(r) for r in ranks_to_exclude)
        new = self.comm.shrink(exclude=excluded)
        want = self.size() - len(excluded)
        if new.world_size != want:
            names = [int(r) for r in new.all_gather(torch.tensor([self.rank()], dtype=torch.int64), dim=0)]
            gone = sorted(set(range(self.size())) - set(names) - set(excluded))
            raise RuntimeError(f"shrink_group: rank(s) {gone} are gone too; list them in ranks_to_exclude")
        return HcommBackend(self._store, new.rank, new.world_size, self._timeout, comm=new)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The deadline of every operation issued after this call (``dist.set_timeout``, routed
        here by :func:`_install_set_timeout`: torch's C++ ``ProcessGroup::setTimeout`` cannot
        reach a backend written in Python). It wins over ``HCOMM_TIMEOUT``, being the later,
        explicit choice."""
        if not isinstance(timeout, datetime.timedelta):
            raise InvalidArgumentError(f"hcomm backend: set_timeout: expected a datetime.timedelta, got {type(timeout).__name__}")
        seconds = timeout.total_seconds()
        if not seconds > 0:
            raise InvalidArgumentError(f"hcomm backend: set_timeout: the timeout must be positive, got {timeout}")
        self.comm.timeout = seconds
        self._timeout = timeout
        try:
            self._options._timeout = timeout
        except (AttributeError, TypeError):  # read-only in some torch versions
            pass

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def get_error(self) -> Any:
        """``ProcessGroup.get_error``: the kind of this group's last communication failure
        (``TIMEOUT``; ``REMOTE_ERROR`` when a peer failed or went away; ``COMM_ERROR``
        otherwise), ``SUCCESS`` while there was none. Refused arguments do not count."""
        from torch._C._distributed_c10d import ErrorType

        e = self._waiter.failure
        if e is None:
            return ErrorType.SUCCESS
        if isinstance(e, HcommTimeoutError):
            return ErrorType.TIMEOUT
        if isinstance(e, PeerError):
            return ErrorType.REMOTE_ERROR
        return ErrorType.COMM_ERROR

    # -- collectives -----------------------------------------------------------------------

    def allreduce(self, tensors: List[torch.Tensor], opts: Any) -> dist._Work:
        _check_cpu("allreduce", tensors)
        if any(t.is_sparse for t in tensors):
            red = _reduction(opts, tensors[0].dtype, "allreduce")
            return self._sparse_allreduce(tensors, red)
        plans = [_reduction(opts, t.dtype, "allreduce") for t in tensors]  # all refused first
        if len(tensors) == 1:
            return self._allreduce_one(opts, tensors[0], plans[0])
        for t, red in zip(tensors, plans):
            self._allreduce_one(None, t, red)
        return _Work(tensors)

    def _allreduce_one(self, opts: Any, t: torch.Tensor, red: _Reduction) -> dist._Work:
        c = self._c
        if red.local is not None:  # bitwise: gather every rank's tensor, fold here
            rows = torch.empty(self.size(), _numel(t), dtype=_wire_dtype(t.dtype))
            return self._run(
                opts,
                t,
                lambda w, a: c.all_gather(w.reshape(-1), rows.view(-1), None, a),
                after=lambda w: w.view(-1).copy_(red.fold(rows)),
            )
        if red.factor is not None:

            def premul(w: torch.Tensor, a: bool) -> Any:
                with torch.no_grad():
                    w.mul_(red.factor)  # the buffer is overwritten by the sum anyway
                return c.all_reduce(None, w, "sum", a)

            return self._run(opts, t, premul)
        return self._run(opts, t, lambda w, a: c.all_reduce(None, w, red.core, a))

    def _sparse_allreduce(self, tensors: List[torch.Tensor], red: _Reduction) -> _Work:
        """Sparse tensors (an ``nn.Embedding(sparse=True)`` gradient under DDP): hcomm's sparse
        all-reduce, which moves only the rows (like gloo's). Each input is replaced by the
        coalesced result, which is also the work's result (what DDP's reducer reads)."""
        if red.core not in ("sum", "mean") or red.factor is not None:
            raise InvalidArgumentError(f"hcomm backend: sparse allreduce sums or averages, not {red.name}")
        if not all(t.is_sparse for t in tensors):
            raise InvalidArgumentError("hcomm backend: allreduce got sparse and dense tensors together")
        out = []
        for t in tensors:
            res = self._sparse_allreduce_one(t, red.core)
            with torch.no_grad():
                t.copy_(res)
            out.append(res)
        return _Work(out)

    def _sparse_allreduce_one(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """One sparse COO tensor reduced (hcomm's row-sparse all-reduce): with several sparse
        dimensions, their indices go as one linear index (row-major over the sparse
        dimensions) and come back unravelled."""
        sparse_dims = t.sparse_dim()
        if sparse_dims == 1:
            return self.comm.sparse_all_reduce(t, op=op)
        t = t.coalesce()
        grid = list(t.shape[:sparse_dims])
        rows = 1
        for d in grid:
            rows *= d
        if rows >= 1 << 63:
            raise InvalidArgumentError(f"hcomm backend: sparse allreduce: sparse shape {grid} has more than 2**63 positions")
        strides = torch.tensor([int(torch.tensor(grid[i + 1 :], dtype=torch.int64).prod()) for i in range(sparse_dims)], dtype=torch.int64)
        linear = (t.indices() * strides[:, None]).sum(0, keepdim=True)
        flat = torch.sparse_coo_tensor(linear, t.values(), [rows] + list(t.shape[sparse_dims:]))
        res = self.comm.sparse_all_reduce(flat, op=op).coalesce()
        lin = res.indices()[0]
        indices = torch.stack([(lin // strides[i]) % grid[i] for i in range(sparse_dims)])
        return torch.sparse_coo_tensor(indices, res.values(), t.shape).coalesce()

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any) -> dist._Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> dist._Work:
        _check_cpu("broadcast", tensors)
        c, root = self._c, _root("broadcast", opts.rootRank, self.size())
        if len(tensors) == 1:
            return self._run(opts, tensors[0], lambda w, a: c.broadcast(w, root, a))
        for t in tensors:
            _in_place(t, lambda b: c.broadcast(b, root))
        return _Work(tensors)

    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("reduce", tensors)
        c, root = self._c, _root("reduce", opts.rootRank, self.size())
        plans = [_reduction(opts, t.dtype, "reduce") for t in tensors]
        for t, red in zip(tensors, plans):
            if red.local is not None:  # bitwise: gather onto the root, fold there
                send = _flat(t)
                if self.rank() != root:
                    c.gather(send, None, root)
                    continue
                rows = torch.empty(self.size() * send.numel(), dtype=send.dtype)
                c.gather(send, rows, root)
                folded = red.fold(rows.view(self.size(), -1))
                _in_place(t, lambda b: b.view(-1).copy_(folded))
            elif red.factor is not None:  # scale a copy: a non-root's tensor stays as it was
                send = _flat(red.scaled(t))
                if self.rank() == root:
                    _in_place(t, lambda b: c.reduce(send, b, "sum", root))
                else:
                    c.reduce(send, None, "sum", root)
            else:
                _in_place(t, lambda b: c.reduce(None, b, red.core, root))
        return _Work(tensors)

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("allgather", inputs)
        for outs, inp in zip(output_lists, inputs):
            _check_cpu("allgather", outs)
            _check_list("allgather", "tensor_list", outs, self.size(), inp, own=self.rank())
            counts = [_numel(o) for o in outs]
            flat = torch.empty(sum(counts), dtype=_wire_dtype(inp.dtype))
            self._c.all_gather(_flat(inp), flat, counts)
            with torch.no_grad():
                for o, part in zip(outs, flat.split(counts)):
                    w = _wire(o)
                    w.copy_(part.view(w.shape))
        return _Work([o for outs in output_lists for o in outs])

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> _Work:
        """``all_gather_coalesced``: ``output_lists[r][j]`` receives rank r's ``inputs[j]``.
        The tensors may differ in shape (the same ones on every rank) and be empty; they go as
        one all-gather of their concatenation. One wire dtype for all of them (complex travels
        as its real view, bool as uint8)."""
        op = "allgather_coalesced"
        _check_cpu(op, inputs)
        n = self.size()
        if len(output_lists) != n:
            raise InvalidArgumentError(f"hcomm backend: {op} needs one output list per rank ({n}), got {len(output_lists)}")
        counts = [_numel(t) for t in inputs]
        kinds = {_wire_dtype(t.dtype) for t in inputs}
        for r, outs in enumerate(output_lists):
            _check_cpu(op, outs)
            got = [_numel(o) for o in outs]
            if got != counts:
                raise InvalidArgumentError(f"hcomm backend: {op}: output list {r} has {got} elements per tensor, the inputs {counts}")
            kinds |= {_wire_dtype(o.dtype) for o in outs}
        if len(kinds) > 1:
            raise InvalidArgumentError(f"hcomm backend: {op} takes tensors of one dtype, got {sorted(map(str, kinds))}")
        dtype = kinds.pop() if kinds else torch.float32
        send = torch.cat([_flat(t) for t in inputs]) if inputs else torch.empty(0, dtype=dtype)
        recv = torch.empty(n * send.numel(), dtype=dtype)
        self._c.all_gather(send, recv, None)
        with torch.no_grad():
            for outs, block in zip(output_lists, recv.view(n, send.numel())):
                for o, part in zip(outs, block.split(counts)):
                    w = _wire(o)
                    w.copy_(part.view(w.shape))
        return _Work([o for outs in output_lists for o in outs])

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> dist._Work:
        _check_cpu("all_gather_into_tensor", [output, inp])
        c = self._c
        if _numel(output) != self.size() * _numel(inp):
            raise InvalidArgumentError(
                f"hcomm backend: all_gather_into_tensor: the output has {_numel(output)} elements and the input "
                f"{_numel(inp)}: the output must hold world_size ({self.size()}) times the input's elements"
            )
        src = _flat(inp)
        _check_block_of("all_gather_into_tensor", src, _wire(output), self.rank())
        if _is_own_block(src, _wire(output), self.rank()):  # in place (FSDP's usage)
            return self._run(opts, output, lambda w, a: c.all_gather(None, w, None, a))
        return self._run(opts, output, lambda w, a: c.all_gather(src, w, None, a))

    def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> dist._Work:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._coalesced(works, outputs)

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> dist._Work:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any) -> _Work:
        _check_cpu("reduce_scatter", outputs)
        c, n, me = self._c, self.size(), self.rank()
        plans = [_reduction(opts, o.dtype, "reduce_scatter") for o in outputs]
        for out, ins, red in zip(outputs, input_lists, plans):
            _check_cpu("reduce_scatter", ins)
            counts = [_numel(t) for t in ins]
            flat = torch.cat([_flat(red.scaled(t)) for t in ins])
            if red.local is None:
                _in_place(out, lambda b: c.reduce_scatter(flat, b, red.core, counts))
            else:  # bitwise: every rank's block for this rank comes here, folded here
                recv = torch.empty(n * counts[me], dtype=flat.dtype)
                c.all_to_all(flat, recv, counts, [counts[me]] * n)
                folded = red.fold(recv.view(n, -1))
                _in_place(out, lambda b: b.view(-1).copy_(folded))
        return _Work(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any) -> dist._Work:
        _check_cpu("reduce_scatter_tensor", [output, inp])
        c, n = self._c, self.size()
        if _numel(inp) != n * _numel(output):
            raise InvalidArgumentError(
                f"hcomm backend: reduce_scatter_tensor: the output has {_numel(output)} elements and the input "
                f"{_numel(inp)}: the input must hold world_size ({n}) times the output's elements"
            )
        red = _reduction(opts, output.dtype, "reduce_scatter_tensor")
        if red.local is not None:  # bitwise: all-to-all the blocks, fold this rank's
            src = _flat(inp)
            recv = torch.empty(src.numel(), dtype=src.dtype)
            return self._run(
                opts,
                output,
                lambda w, a: c.all_to_all(src, recv, None, None, a),
                after=lambda w: w.view(-1).copy_(red.fold(recv.view(n, -1))),
            )
        if inp.is_contiguous():
            _check_block_of("reduce_scatter_tensor", _wire(output), _wire(inp), self.rank())
        if red.factor is None and inp.is_contiguous() and _is_own_block(_wire(output), _wire(inp), self.rank()):
            # in place: the result lands in this rank's block of the input
            return self._run(opts, inp, lambda w, a: c.reduce_scatter(None, w, red.core, None, a), result=[output])
        src = _flat(red.scaled(inp))
        return self._run(opts, output, lambda w, a: c.reduce_scatter(src, w, red.core, None, a))

    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> dist._Work:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._coalesced(works, outputs)

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> dist._Work:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("alltoall", outputs + inputs)
        send = torch.cat([_flat(t) for t in inputs]) if inputs else torch.empty(0)
        rcounts = [_numel(t) for t in outputs]
        recv = torch.empty(sum(rcounts), dtype=send.dtype)
        self._c.all_to_all(send, recv, [_numel(t) for t in inputs], rcounts)
        with torch.no_grad():
            for o, part in zip(outputs, recv.split(rcounts)):
                w = _wire(o)
                w.copy_(part.view(w.shape))
        return _Work(outputs)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: List[int], input_split_sizes: List[int], opts: Any) -> dist._Work:
        _check_cpu("all_to_all_single", [output, inp])
        c, n = self._c, self.size()
        src = _flat(inp)
        if not output_split_sizes and not input_split_sizes:
            return self._run(opts, output, lambda w, a: c.all_to_all(src, w, None, None, a))
        in_row = _numel(inp) // inp.size(0) if inp.dim() and inp.size(0) else 1
        out_row = _numel(output) // output.size(0) if output.dim() and output.size(0) else 1
        isz = list(input_split_sizes) or [inp.size(0) // n] * n
        osz = list(output_split_sizes) or [output.size(0) // n] * n
        sc = [s * in_row for s in isz]
        rc = [s * out_row for s in osz]
        return self._run(opts, output, lambda w, a: c.all_to_all(src, w, sc, rc, a))

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any) -> _Work:
        _check_cpu("gather", inputs)
        root = _root("gather", opts.rootRank, self.size())
        for i, inp in enumerate(inputs):
            if self.rank() == root:
                outs = output_lists[i]
                _check_cpu("gather", outs)
                _check_list("gather", "gather_list", outs, self.size(), inp, own=root)
                counts = [_numel(o) for o in outs]
                flat = torch.empty(sum(counts), dtype=_wire_dtype(inp.dtype))
                self._c.gather(_flat(inp), flat, root, counts)
                with torch.no_grad():
                    for o, part in zip(outs, flat.split(counts)):
                        w = _wire(o)
                        w.copy_(part.view(w.shape))
            else:
                self._c.gather(_flat(inp), None, root)
        return _Work([o for outs in output_lists for o in outs])

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any) -> _Work:
        _check_cpu("scatter", outputs)
        c, root = self._c, _root("scatter", opts.rootRank, self.size())
        for i, out in enumerate(outputs):
            if self.rank() == root:
                _check_cpu("scatter", input_lists[i])
                _check_list("scatter", "scatter_list", input_lists[i], self.size(), out)
                flat = torch.cat([_flat(t) for t in input_lists[i]])
                _in_place(out, lambda b: c.scatter(flat, b, root))
            else:
                _in_place(out, lambda b: c.scatter(None, b, root))
        return _Work(outputs)

    def barrier(self, opts: Any = None) -> _Work:
        self._c.barrier()
        return _Work([])

    def monitored_barrier(self, opts: Any, wait_all_ranks: bool = False) -> None:
        """gloo's monitoredBarrier, through torch's store (so that a rank that does not come
        leaves hcomm's communicator as it was): every rank but 0 checks in and waits for rank
        0's verdict; rank 0 waits for each rank in turn, until `opts.timeout` after it came.
        A rank that did not check in by then is named: at once (the first one), or, with
        `wait_all_ranks`, all of them together; the others then fail at once too, told to look
        at rank 0. The messages are gloo's. Raises :class:`MonitoredBarrierError` (a
        ``RuntimeError`` as gloo's errors are, and an :class:`HcommTimeoutError`)."""
        import time

        if self._store is None:
            raise InvalidArgumentError("hcomm backend: monitored_barrier needs the store torch gives the backend")
        timeout = opts.timeout if isinstance(opts.timeout, datetime.timedelta) else self._options._timeout
        ms = int(timeout.total_seconds() * 1000)
        seq, self._barriers = self._barriers, self._barriers + 1
        key = f"hcomm/monitored_barrier/{seq}/"
        me, n, store = self.rank(), self.size(), self._store
        if me != 0:
            store.set(key + str(me), b"1")
            try:
                store.wait([key + "verdict"], timeout)
                verdict = store.get(key + "verdict").decode()
            except RuntimeError:
                verdict = f"no word from rank 0 in {ms} ms"
            if verdict != "passed":
                raise _monitored_error(
                    f"[Rank {me}]: Rank {me} successfully reached monitoredBarrier, but received errors while "
                    f"waiting for send/recv from rank 0 ({verdict}). Please check rank 0 logs for faulty rank.",
                    (0,),
                )
            return
        deadline = time.monotonic() + timeout.total_seconds()
        processed: List[int] = []
        missing: List[int] = []

        def fail(message: str, ranks: List[int]) -> None:
            store.set(key + "verdict", f"rank 0: {message}".encode())
            raise _monitored_error(f"[Rank 0]: {message}", tuple(ranks))

        for r in range(1, n):
            left = deadline - time.monotonic()
            if left > 0:
                try:
                    store.wait([key + str(r)], datetime.timedelta(seconds=left))
                    processed.append(r)
                    continue
                except RuntimeError:
                    pass
            elif store.check([key + str(r)]):
                processed.append(r)
                continue
            if wait_all_ranks:
                missing.append(r)
            elif left > 0:
                fail(f"Rank {r} failed to pass monitoredBarrier in {ms} ms", [r])
            else:  # the time was up before rank 0 came to wait for r (gloo's wording)
                done = f"Successfully processed ranks: {', '.join(map(str, processed))}" if processed else "No ranks successfully processed in monitoredBarrier."
                fail(f"Rank 0 timed out in monitoredBarrier after {ms} ms (rank {r} had not come). {done}", [r])
        if missing:
            fail(f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms", missing)
        store.set(key + "verdict", b"passed")

    # -- point-to-point --------------------------------------------------------------------

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> dist._Work:
        """Post the send (hcomm's ``send_async``): it progresses in the background with every
        other posted send and receive of the group, so ``isend`` / ``irecv`` /
        ``batch_isend_irecv`` complete in any posting order. The tensor must not change until
        the Work is done (as with gloo)."""
        _check_cpu("send", tensors)
        bufs = [_flat(t) for t in tensors]
        engines = [self._c.send(dst, tag, b, True) for b in bufs]
        return _AsyncWork(self._waiter, _AllOf(engines), tensors, tuple(bufs), None)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> dist._Work:
        """Post the receive (see :meth:`send`); a non-contiguous tensor is filled from a
        contiguous copy when the message is in."""
        _check_cpu("recv", tensors)
        engines, keep, copies = [], [], []
        for t in tensors:
            w = _wire(t)
            buf = w if w.is_contiguous() else w.contiguous()
            if buf is not w:
                copies.append((w, buf))
            engines.append(self._c.recv(src, tag, buf, True))
            keep.append(buf)

        def post() -> None:
            with torch.no_grad():
                for w, buf in copies:
                    w.copy_(buf)

        return _AsyncWork(self._waiter, _AllOf(engines), tensors, tuple(keep), post if copies else None)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> dist._Work:
        """``recv`` / ``irecv`` without a source: a posted receive from any rank (hcomm's
        ``recv_any``); the Work's ``_source_rank()`` names the sender once waited for."""
        _check_cpu("recv", tensors)
        if len(tensors) != 1:
            raise InvalidArgumentError(f"hcomm backend: recv from any source takes one tensor, got {len(tensors)}")
        w = _wire(tensors[0])
        buf = w if w.is_contiguous() else w.contiguous()
        engine = self._c.recv_any(tag, buf, True)

        def post() -> None:
            if buf is not w:
                with torch.no_grad():
                    w.copy_(buf)

        work = _AsyncWork(self._waiter, engine, tensors, (buf,), post)
        work._source = engine
        return work

    def abort(self) -> None:
        self._c.abort()

    def shutdown(self) -> None:
        _LIVE.pop(id(self), None)
        if not self.comm.destroyed:
            # torch may keep the backend (and so the communicator) alive after
            # destroy_process_group: write what the trace holds now.
            self.comm.flush_trace()

    # -- sequence numbers (TORCH_DISTRIBUTED_DEBUG=DETAIL checks them across the ranks) -------

    def _set_sequence_number_for_group(self) -> None:
        self._seq = 0

    def _get_sequence_number_for_group(self) -> int:
        return self._seq


def _counted(f: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: HcommBackend, *args: Any, **kwargs: Any) -> Any:
        self._seq += 1
        try:
            return f(self, *args, **kwargs)
        except HcommError as e:
            err = _torch_error(e)
            if err is e:
                raise
            self._waiter.failure = err
            raise err from e

    call.__name__, call.__qualname__, call.__doc__ = f.__name__, f.__qualname__, f.__doc__
    return call


# Every operation torch issues counts one (as gloo counts them), whichever way it runs, and
# its hcomm failures reach torch as torch's (`_torch_error`), remembered for `get_error`.
for _name in (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "allgather_coalesced",
    "all_gather_single", "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced", "alltoall", "all_to_all_single", "gather", "scatter",
    "barrier", "monitored_barrier", "send", "recv", "recv_anysource",
):  # fmt: skip
    setattr(HcommBackend, _name, _counted(getattr(HcommBackend, _name)))
del _name


def communicator_of(group: Any = None) -> Communicator:
    """The hcomm :class:`~hcomm.Communicator` behind a process group of the "hcomm" backend
    (default: the default group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend (a ProcessGroupWrapper)
    backend = getattr(backend, "wrapped_pg", backend)
    if not isinstance(backend, HcommBackend):
        raise InvalidArgumentError(f"the process group's CPU backend is {type(backend).__name__}, not hcomm")
    return backend.comm


@contextlib.contextmanager
def reductions(group: Any = None, *, deterministic: Optional[bool] = None, accumulate: Optional[str] = None) -> Iterator[Communicator]:
    """Within the block, the reductions issued on `group` (default: the default group) run
    with these settings, restored after it (torch's collectives take no extra arguments, so
    this is the per-call form of :attr:`hcomm.Communicator.deterministic` and
    :attr:`hcomm.Communicator.accumulate`)::

        with hcomm.torch.reductions(deterministic=True):
            dist.all_reduce(t)          # the rank-order fold, bitwise, whatever the size

    The settings take effect in issue order, so asynchronous operations issued before the
    block keep the old ones and those issued inside keep the new ones however late they
    run. Every rank of the group must enter and leave the block at the same point. Yields
    the group's communicator."""
    comm = communicator_of(group)
    before = (comm.deterministic, comm.accumulate)
    if accumulate is not None:
        comm.accumulate = accumulate  # checked first: a bad value changes nothing
    if deterministic is not None:
        comm.deterministic = bool(deterministic)
    try:
        yield comm
    finally:
        if not comm.destroyed:
            comm.deterministic, comm.accumulate = before


#: The default group's backend (the one torch made with no list of ranks), while it lives:
#: the groups made later come from its communicator (see `_create`).
_WORLD: "Optional[weakref.ref[HcommBackend]]" = None


def _world_backend() -> Optional[HcommBackend]:
    world = _WORLD() if _WORLD is not None else None
    if world is None or id(world) not in _LIVE or world.comm.destroyed:
        return None
    return world


def _create(opts: Any, backend_options: Any = None) -> HcommBackend:
    """torch's creator (extended API). The default group bootstraps its communicator through
    torch's store (`_bootstrap`). A group made later (``new_group``, DeviceMesh) is made by
    :meth:`hcomm.Communicator.new_group` on the default group's communicator when that is an
    hcomm one: through hcomm's own rendezvous store with the job's token, so no new port, no
    store key and no second rendezvous; the global ranks are the default group's ranks."""
    global _WORLD
    store, rank, size, timeout = opts.store, int(opts.group_rank), int(opts.group_size), opts.timeout
    ranks = [int(r) for r in (opts.global_ranks_in_group or [])]
    if not ranks:
        backend = HcommBackend(store, rank, size, timeout)
        _WORLD = weakref.ref(backend)
        return backend
    world = _world_backend()
    if world is None:
        return HcommBackend(store, rank, size, timeout)
    comm = _subgroup(world.comm, ranks, timeout)
    if (comm.rank, comm.world_size) != (rank, size):
        raise HcommError(
            f"hcomm backend: new_group {ranks}: torch numbers this rank {rank} of {size}, hcomm {comm.rank} of {comm.world_size}"
        )
    return HcommBackend(store, rank, size, timeout, comm=comm)


def _subgroup(parent: Communicator, ranks: List[int], timeout: Optional[datetime.timedelta]) -> Communicator:
    """`parent.new_group(ranks)` with torch's timeout (unless ``HCOMM_TIMEOUT`` is set: the
    variable wins, as in `_bootstrap`)."""
    new = parent.new_group(ranks)
    if isinstance(timeout, datetime.timedelta) and not os.environ.get("HCOMM_TIMEOUT"):
        new.timeout = max(timeout.total_seconds(), 0.001)
    return new


def _hcomm_backend_of(group: Any) -> Optional["HcommBackend"]:
    """The hcomm backend serving `group` on CPU, if it is one."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError, ValueError):
        return None
    return backend if isinstance(backend, HcommBackend) else None


def _install_set_timeout() -> None:
    """Make ``dist.set_timeout`` (and the older ``_set_pg_timeout``) reach hcomm groups: torch
    forwards it from C++ (``ProcessGroup::setTimeout``), which has no trampoline into a backend
    written in Python and only warns that the value is ignored. Groups of other backends get
    torch's own function."""
    original = c10d.set_timeout
    if getattr(original, "_hcomm", False):
        return

    @functools.wraps(original)
    def set_timeout(timeout: datetime.timedelta, group: Any = None) -> None:
        target = group if group is not None else c10d._get_default_group()
        backend = _hcomm_backend_of(target)
        if backend is None:
            return original(timeout, group)
        if c10d._rank_not_in_group(target):
            raise ValueError("Invalid process group specified")
        backend.set_timeout(timeout)

    set_timeout._hcomm = True  # type: ignore[attr-defined]
    c10d.set_timeout = set_timeout
    if getattr(dist, "set_timeout", None) is original:
        dist.set_timeout = set_timeout


if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
_install_work_queries()
_install_set_timeout()
