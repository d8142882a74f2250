"""FSDP2 on CPU, one line after ``fully_shard``: :func:`overlap_fsdp` (all-gathers prefetched
and reduce-scatters left running while backward goes on, bitwise the same results) and
:func:`compress_fsdp` (gradient reduce-scatters compressed by hcomm, with error feedback).
Both reach into FSDP2's private state (``_get_fsdp_state``, ``set_custom_reduce_scatter``),
checked where it is read."""

from __future__ import annotations

import weakref
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .._core import CompressionState
from ..errors import InvalidArgumentError
from ._backend import _plan, communicator_of


def overlap_fsdp(model: torch.nn.Module, depth: int = 1, reduce_scatter: bool = True) -> int:
    """Make FSDP2's all-gathers and reduce-scatters overlap with compute on CPU: one line
    after ``fully_shard``.

    FSDP2 issues its collectives with ``async_op=False`` and overlaps them through CUDA
    streams; on CPU each one blocks the training thread until it is done. This

    * sets every FSDP2 unit of ``model`` to unshard asynchronously
      (``_set_unshard_async_op(True)``, torch's private switch) and each unit below the root
      to prefetch the next ``depth`` units' all-gathers in forward and the previous ``depth``
      in backward (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``),
      taking the units in ``model.modules()`` order, which must be the order forward runs
      them (true of a stack of layers sharded one by one);
    * with ``reduce_scatter=True`` (the default), gives every unit an
      :class:`OverlappedReduceScatter` (``set_custom_reduce_scatter``): a unit's gradient
      reduce-scatter is started and left running while backward goes on to the next unit,
      and all of them are awaited when backward ends (an autograd final callback), before
      ``loss.backward()`` returns. Where FSDP2 would read the output at once (gradient
      accumulation into existing ``.grad``, a dtype cast, a SUM that FSDP2 divides
      afterwards, CPU offload, HSDP, hooks on the gradients) that unit's reduce-scatter
      runs blocking, as without this. :func:`compress_fsdp`'s compressed reduce-scatters
      (before or after this call) are overlapped the same way; a reduce-scatter of your own
      (``set_custom_reduce_scatter``) stays as it is.

    It changes when data arrive, not what is computed: the results are bitwise those without
    it. Works on any backend (gloo too). Returns the number of FSDP2 units. Measured on the
    6x512 encoder, 2 hosts at 1 Gbit/s: docs/training.md."""
    from torch.distributed.fsdp import FSDPModule

    if depth < 1:
        raise InvalidArgumentError(f"overlap_fsdp: depth must be at least 1, got {depth}")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise InvalidArgumentError("overlap_fsdp: no FSDP2 unit in the model (call fully_shard first)")
    for m in units:
        m._set_unshard_async_op(True)
    inner = [m for m in units if m is not model]
    for i, m in enumerate(inner):
        forward = inner[i + 1:i + 1 + depth]
        backward = inner[max(0, i - depth):i][::-1]
        if forward:
            m.set_modules_to_forward_prefetch(forward)
        if backward:
            m.set_modules_to_backward_prefetch(backward)
    if reduce_scatter:
        base = _fsdp_reduce_scatter_base()
        kind = type("HcommOverlappedReduceScatter", (OverlappedReduceScatter, base), {})
        pending = _PendingReduceScatters()
        for m in units:
            group = _fsdp_param_group(m)
            comm = getattr(group, "_reduce_scatter_comm", None)
            if isinstance(comm, _Overlappable):
                comm._overlap(m, pending)  # compress_fsdp's: its compressed form, overlapped
            elif group is not None and _has_default_reduce_scatter(group):
                m.set_custom_reduce_scatter(kind(m, pending))
            # (a user's own reduce-scatter stays as it is)
    return len(units)


def _fsdp_param_group(unit: Any) -> Any:
    """The FSDPParamGroup of an FSDP2 unit (torch's private state), or None."""
    try:
        return unit._get_fsdp_state()._fsdp_param_group
    except AttributeError:
        return None


def _has_default_reduce_scatter(group: Any) -> bool:
    comm = getattr(group, "_reduce_scatter_comm", None)
    return comm is None or type(comm).__name__ == "DefaultReduceScatter"


def overlap_fsdp_counts(model: torch.nn.Module) -> dict:
    """How many of ``model``'s FSDP2 reduce-scatters :func:`overlap_fsdp` left running while
    backward went on (``"overlapped"``) and how many ran blocking (``"blocking"``), summed
    over its units, with the reason of the last blocking one (``"reason"``)."""
    from torch.distributed.fsdp import FSDPModule

    out: dict = {"overlapped": 0, "blocking": 0, "reason": None}
    for m in model.modules():
        group = _fsdp_param_group(m) if isinstance(m, FSDPModule) else None
        comm = getattr(group, "_reduce_scatter_comm", None)
        if isinstance(comm, _Overlappable):
            out["overlapped"] += comm.overlapped
            out["blocking"] += comm.blocking
            out["reason"] = comm.last_blocking_reason or out["reason"]
    return out


class _PendingReduceScatters:
    """The reduce-scatters of one model started by :class:`OverlappedReduceScatter` and not
    yet awaited, with the tensors they read and write (kept alive until then)."""

    def __init__(self) -> None:
        self.works: list = []

    def add(self, work: Any, *tensors: torch.Tensor) -> None:
        """Keep `work` until the end of the current backward pass. Every call queues its own
        final callback (the first to run waits for all, the others find nothing left): a
        flag saying "already queued" would outlive a backward pass that failed before its
        callbacks ran, and the next one would then wait for nothing."""
        self.works.append((work, tensors))
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.wait_all)
        except RuntimeError:  # not inside a backward pass: nothing would wait later
            self.wait_all()

    def wait_all(self) -> None:
        """Wait for every started reduce-scatter (the first failure is raised, after all
        have been awaited)."""
        works, self.works = self.works, []
        first: Optional[BaseException] = None
        for work, _ in works:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first


def _fsdp_reads_output_at_once(unit_ref: Any, output_tensor: torch.Tensor, op: Any) -> Optional[str]:
    """Why FSDP2 would read this reduce-scatter's output before backward ends (so it must
    run blocking), or None: FSDP2's ``foreach_reduce`` reads it at once to divide it (after
    a SUM), cast it, accumulate it into existing ``.grad``, copy it to CPU (offload), all-reduce
    it (HSDP) or hand it to hooks; otherwise it only makes the sharded gradients views of it.
    `unit_ref` is a weak reference to the FSDP2 unit."""
    kind = getattr(op, "op", op)
    if kind not in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        # FSDP2 sums and then divides the output itself (set_force_sum_reduction_for_comms
        # or a dtype that could overflow)
        return f"op {kind} (FSDP2 divides the output afterwards)"
    unit = unit_ref()
    group = _fsdp_param_group(unit) if unit is not None else None
    if group is None:
        return "the FSDP2 unit is gone"
    try:
        if type(group.mesh_info).__name__ != "FSDPMeshInfo" or group._all_reduce_hook is not None:
            return "HSDP or an all-reduce hook reads the output"
        for p in group.fsdp_params:
            if p.offload_to_cpu:
                return "CPU offload copies the output"
            if p.sharded_param.grad is not None:
                return "gradients accumulate into existing .grad"
            if p.sharded_grad_dtype not in (None, output_tensor.dtype):
                return f"the gradient is cast from {output_tensor.dtype} to {p.sharded_grad_dtype}"
            if getattr(p.sharded_param, "_post_accumulate_grad_hooks", None):
                return "a post-accumulate-grad hook reads the gradient"
    except AttributeError as e:  # another torch: its internals are not the ones checked
        return f"FSDP2's internals differ from those checked ({e})"
    return None


class _Overlappable:
    """What :class:`OverlappedReduceScatter` and :class:`FsdpCompression` share: the unit
    (weakly), the model's pending reduce-scatters once :func:`overlap_fsdp` was called, and
    the counters."""

    def _init_overlap(self) -> None:
        self._unit: Any = lambda: None
        self._pending: Optional[_PendingReduceScatters] = None
        #: Reduce-scatters started and awaited at the end of backward / run blocking.
        self.overlapped = 0
        self.blocking = 0
        #: Why the last blocking one could not be left running (None: none was).
        self.last_blocking_reason: Optional[str] = None

    def _overlap(self, unit: Any, pending: "_PendingReduceScatters") -> None:
        self._unit = weakref.ref(unit)
        self._pending = pending

    def _may_overlap(self, output_tensor: torch.Tensor, op: Any) -> bool:
        """Whether this reduce-scatter may be left running; counts a blocking one."""
        reason = "overlap_fsdp was not called" if self._pending is None else _fsdp_reads_output_at_once(self._unit, output_tensor, op)
        if reason is not None:
            self.blocking += 1
            self.last_blocking_reason = reason
            return False
        return True

    def _started(self, work: Any, *tensors: torch.Tensor) -> None:
        assert self._pending is not None
        self.overlapped += 1
        self._pending.add(work, *tensors)


class OverlappedReduceScatter(_Overlappable):
    """FSDP2's gradient reduce-scatter for one unit, left running while backward goes on (made
    by :func:`overlap_fsdp`; see there). Counts the reduce-scatters it started
    (:attr:`overlapped`) and those it ran blocking (:attr:`blocking`, with the reason of the
    last in :attr:`last_blocking_reason`)."""

    def __init__(self, unit: Any, pending: _PendingReduceScatters) -> None:
        self._init_overlap()
        self._overlap(unit, pending)

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Optional[Any]:
        if async_op or not self._may_overlap(output_tensor, op):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self._started(dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=True), output_tensor, input_tensor)
        return None

    def __repr__(self) -> str:
        return f"<hcomm.torch.OverlappedReduceScatter overlapped={self.overlapped} blocking={self.blocking}>"


def _fsdp_reduce_scatter_base() -> type:
    """FSDP2's ``ReduceScatter`` interface (torch 2.8+), imported when first needed."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError as e:  # pragma: no cover - older torch
        raise InvalidArgumentError(f"compress_fsdp needs FSDP2's set_custom_reduce_scatter (torch 2.8 or later): {e}") from None
    return ReduceScatter


class FsdpCompression(_Overlappable):
    """FSDP2's gradient reduce-scatter compressed by hcomm, for one FSDP2 unit (made by
    :func:`compress_fsdp`; see there). Holds one :class:`hcomm.CompressionState` (residuals)
    per reduce-scatter size of its unit, and counts the reductions it ran compressed and
    those it passed to the exact reduce-scatter (inputs that are not float32). With
    :func:`overlap_fsdp` too, the compressed reduce-scatters are left running while backward
    goes on, as :class:`OverlappedReduceScatter` does with the exact ones."""

    def __init__(self, compressor: str, error_feedback: bool = True) -> None:
        CompressionState(compressor)  # validate now (InvalidArgumentError), not in backward
        self._init_overlap()
        self.compressor = compressor
        self.error_feedback = bool(error_feedback)
        #: Compression state per reduce-scatter input size (elements).
        self.states: dict = {}
        #: Reduce-scatters run compressed / exactly (not float32).
        self.compressed = 0
        self.exact = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Optional[Any]:
        red = _plan(op, getattr(op, "op", op), input_tensor.dtype, "FSDP reduce-scatter")
        if input_tensor.dtype != torch.float32 or red.core not in ("sum", "mean"):
            self.exact += 1
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        comm = communicator_of(group)
        n = input_tensor.numel()
        st = self.states.get(n)
        if st is None:
            st = self.states[n] = CompressionState(self.compressor, self.error_feedback, key=n)
        if red.factor is not None:  # PREMUL_SUM: FSDP's own scratch buffer, scaled in place
            with torch.no_grad():
                input_tensor.mul_(red.factor)
        self.compressed += 1
        if not async_op and self._may_overlap(output_tensor, op):
            work = comm.reduce_scatter_compressed_async(input_tensor, state=st, op=red.core, out=output_tensor)
            self._started(work, output_tensor, input_tensor)
            return None
        comm.reduce_scatter_compressed(input_tensor, state=st, op=red.core, out=output_tensor)
        return None

    def __repr__(self) -> str:
        return f"<hcomm.torch.FsdpCompression {self.compressor} error_feedback={self.error_feedback} compressed={self.compressed} exact={self.exact}>"


def compress_fsdp(model: torch.nn.Module, compressor: str = "int8", error_feedback: bool = True) -> List[FsdpCompression]:
    """Compress FSDP2's gradient reduce-scatters with hcomm: one line after ``fully_shard``
    (the FSDP2 counterpart of :func:`compression_hook` for DDP)::

        fully_shard(layer) for each layer; fully_shard(model)
        hcomm.torch.compress_fsdp(model, "int8")

    Every FSDP2 unit of `model` gets its own :class:`FsdpCompression`
    (``set_custom_reduce_scatter``), which reduce-scatters the unit's float32 gradients with
    :meth:`hcomm.Communicator.reduce_scatter_compressed` (``"fp16"``, ``"bf16"``,
    ``"int8[:BLOCK]"``, ``"int8sr[:BLOCK]"``, ``"sign[:BLOCK]"``) and keeps what compression
    dropped for the next step (error feedback, one residual per element of the unit's
    unsharded gradients on each rank). FSDP's averaging (AVG, or PREMUL_SUM with
    ``set_gradient_divide_factor``) is kept; gradients reduced in another dtype (mixed
    precision's ``reduce_dtype``) go through the exact reduce-scatter. The units' process
    group must be an hcomm one. Returns the units' objects (their counters say what ran).
    Loss tolerance measured on the training report's encoder: docs/training.md."""
    from torch.distributed.fsdp import FSDPModule

    base = _fsdp_reduce_scatter_base()
    made = CompressionState(compressor).compressor
    if made.startswith(("topk", "randk")):
        raise InvalidArgumentError(
            f"compress_fsdp: {made} picks elements of the whole vector; a compressed reduce-scatter takes fp16, bf16, int8, int8sr or sign"
        )
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise InvalidArgumentError("compress_fsdp: no FSDP2 unit in the model (call fully_shard first)")
    kind = type("HcommFsdpCompression", (FsdpCompression, base), {})
    out = []
    for m in units:
        comm = kind(compressor, error_feedback)
        before = getattr(_fsdp_param_group(m), "_reduce_scatter_comm", None)
        if isinstance(before, _Overlappable) and before._pending is not None:
            comm._overlap(m, before._pending)  # overlap_fsdp came first: still overlapped
        m.set_custom_reduce_scatter(comm)
        out.append(comm)
    return out
