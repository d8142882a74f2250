"""DDP communication hooks on hcomm: :func:`compression_hook` (gradient buckets all-reduced
compressed, with error feedback) and :func:`bucket_trace_hook` (DDP's own all-reduce, labelled
with its bucket in the trace)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from .._core import Communicator, CompressionState
from ..errors import InvalidArgumentError
from ._backend import _outcome_future, _Waiter, communicator_of


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
                from .. import _core

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
        with _bucket_label(comm, bucket):
            work = comm.all_reduce_compressed_async(buf, state=st, op="mean")
    base, fut = _outcome_future()

    def finish() -> torch.Tensor:
        work.wait()
        return buf

    state._waiter.put(finish, base)
    return fut


@contextlib.contextmanager
def _bucket_label(comm: Communicator, bucket: Any) -> Iterator[None]:
    """The operations issued in the block are labelled with the DDP bucket in the trace
    (only while the communicator traces: no cost otherwise)."""
    if comm.trace_file is None:
        yield
        return
    comm.set_trace_label(f"ddp bucket {bucket.index()}")
    try:
        yield
    finally:
        comm.set_trace_label(None)


def bucket_trace_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """A DDP communication hook (``ddp.register_comm_hook(None, bucket_trace_hook)``) with
    the result of DDP's own (torch's ``allreduce_hook``: each bucket averaged over the ranks,
    the same bits) whose all-reduce is labelled ``ddp bucket N`` in the trace
    (``HCOMM_TRACE``, :meth:`hcomm.Communicator.trace_to`), so a timeline shows which bucket
    each slice carries. DDP's reducer calls the backend without the bucket's index, so
    without a hook the slices carry no label; :func:`compression_hook` labels its buckets
    too."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with _bucket_label(communicator_of(process_group), bucket):
        return default_hooks.allreduce_hook(process_group, bucket)


bucket_trace_hook.__annotations__ = {
    "process_group": dist.ProcessGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


# DDP checks a hook's annotations as objects (this module's are strings: `from __future__
# import annotations`).
compression_hook.__annotations__ = {
    "state": CompressionHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
