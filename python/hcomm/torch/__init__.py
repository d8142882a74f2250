"""The ``"hcomm"`` backend of ``torch.distributed``.

Importing this module registers it::

    import torch.distributed as dist
    import hcomm.torch  # noqa: F401  (registers "hcomm")

    dist.init_process_group("hcomm")   # under hcomm run or torchrun (env://), or any init_method
    model = torch.nn.parallel.DistributedDataParallel(model)

It implements allreduce, broadcast, reduce, allgather (and ``all_gather_into_tensor``),
reduce_scatter (and ``reduce_scatter_tensor``), alltoall (and ``all_to_all_single``), gather,
scatter, barrier, ``monitored_barrier``, send and recv on CPU tensors, with the reduce ops SUM,
PRODUCT, MIN, MAX, AVG and PREMUL_SUM (hcomm's core reduces them) and BAND, BOR, BXOR (gathered
and folded here), on hcomm's dtypes, ``torch.bool`` (as uint8) and complex (through its real
view). The default group bootstraps an hcomm communicator through the store torch hands it:
rank 0 starts hcomm's rendezvous on a free port of its own and publishes the address there, so
the backend never competes with torch's store for ``MASTER_PORT``. Groups made later
(``new_group``, ``split_group``, DeviceMesh) are sub-communicators of that one
(:meth:`hcomm.Communicator.new_group`): no new port, store key or rendezvous; only when the
default group is not an hcomm one does such a group bootstrap its own. The job token
(``HCOMM_JOB_TOKEN`` / ``HCOMM_TOKEN_FILE``, set by ``hcomm run``) authenticates hcomm's
connections; without one (torchrun) rank 0 makes one and hands it over through the store.
``HCOMM_TIMEOUT`` (if set) or the group's timeout becomes hcomm's deadline.

With ``async_op=True`` (and for DDP's gradient buckets) allreduce, broadcast,
all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single run on hcomm's progress
engine and return at once; their Work completes (and its future is set, by one waiter thread
per process group) when hcomm is done, in issue order. The other operations run when issued
and return a completed Work. Non-contiguous tensors go through a contiguous copy. The Work
handles torch returns answer ``is_completed()``, ``is_success()`` and ``exception()`` from the
hcomm Work behind them (`_install_work_queries`), and a failed operation fails its future.

:func:`compression_hook` with a :class:`CompressionHookState` is a DDP communication hook that
all-reduces DDP's gradient buckets with hcomm's compressed all-reduce (fp16, bf16, int8, sign,
top-k, random-k, with error feedback)::

    ddp.register_comm_hook(hcomm.torch.CompressionHookState("int8"), hcomm.torch.compression_hook)

The package's modules: ``_backend`` (the process group and its registration with torch),
``_ddp`` (DDP communication hooks), ``_fsdp`` (FSDP2's one-line helpers).
"""

from ._backend import BACKEND_NAME, HcommBackend, MonitoredBarrierError, communicator_of, reductions
from ._ddp import CompressionHookState, bucket_trace_hook, compression_hook
from ._fsdp import FsdpCompression, OverlappedReduceScatter, compress_fsdp, overlap_fsdp, overlap_fsdp_counts

__all__ = ["HcommBackend", "BACKEND_NAME", "communicator_of", "CompressionHookState", "compression_hook", "bucket_trace_hook", "MonitoredBarrierError", "reductions",
           "overlap_fsdp", "overlap_fsdp_counts", "OverlappedReduceScatter", "compress_fsdp", "FsdpCompression"]

