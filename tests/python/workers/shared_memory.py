"""Shared memory seen by two ranks (the documented example): rank 0 allocates and fills it,
rank 1 maps it with GetSharedMemory(src_rank=0), reads it as numpy and torch views and through
torch.from_file(shm.path) and numpy.memmap(os.fspath(shm)), writes back; rank 0 sees the
writes. Allocation is per rank, not collective."""

import os
import sys

import numpy as np

import hcomm

KIND = sys.argv[1] if len(sys.argv) > 1 else "numpy"
if KIND == "torch":
    import torch

hcomm.InitHcom()
R = hcomm.GetRank()
N = 1 << 16  # float32 elements

if R == 0:
    shm = hcomm.AllocateSharedMemory(N * 4)
    assert shm.size == N * 4 and shm.owner == 0 and shm.data_offset == 0
    assert os.fspath(shm) == shm.path and shm.path.startswith("/proc/")
    view = shm.numpy(np.float32)
    assert view.shape == (N,)
    view[:] = np.arange(N, dtype=np.float32)  # written in place: no copy anywhere
    hcomm.Signal(1, tag=1)
    hcomm.Wait(src_rank=1, tag=2)
    assert view[0] == -1.0 and view[N - 1] == -2.0, (view[0], view[N - 1])
    if KIND == "torch":
        t = shm.torch(torch.float32, shape=(N // 4, 4))
        assert t[0, 0].item() == -1.0 and t[-1, -1].item() == -2.0
        ints = shm.torch(torch.int32, shape=(2,), offset=8)
        assert ints.dtype == torch.int32 and tuple(ints.shape) == (2,)
        del t, ints
    # Freeing while views are alive is refused (it would unmap memory they point to).
    try:
        hcomm.FreeSharedMemory(shm)
        raise AssertionError("free must refuse while a view is alive")
    except BufferError:
        pass
    del view
    hcomm.Wait(src_rank=1, tag=3)  # rank 1 has mapped what it needs
    hcomm.FreeSharedMemory(shm)
    assert shm.freed
    try:
        shm.numpy()
        raise AssertionError("a freed segment has no memory")
    except ValueError:
        pass
else:
    hcomm.Wait(src_rank=0, tag=1)
    shm = hcomm.GetSharedMemory(src_rank=0)
    assert shm.size == N * 4 and shm.owner == 0
    a = shm.numpy(np.float32)
    np.testing.assert_array_equal(a, np.arange(N, dtype=np.float32))
    m = np.memmap(os.fspath(shm), dtype=np.float32, mode="r", shape=(N,))
    np.testing.assert_array_equal(m, np.arange(N, dtype=np.float32))
    if KIND == "torch":
        f = torch.from_file(shm.path, shared=True, size=N)  # float32 by default
        assert torch.equal(f, torch.arange(N, dtype=torch.float32)), "torch.from_file maps the data"
        t = shm.torch(torch.float32)
        t[N - 1] = -2.0  # through a torch view
        f[0] = -1.0  # through torch.from_file's own mapping of the same memory
    else:
        a[N - 1] = -2.0
        a[0] = -1.0
    assert a[0] == -1.0 and a[N - 1] == -2.0, "every view sees every write"
    hcomm.Signal(0, tag=2)
    ro = hcomm.GetSharedMemory(src_rank=0, flags="read_only").numpy(np.float32)
    assert not ro.flags.writeable
    hcomm.Signal(0, tag=3)
hcomm.Barrier()
print("WORKER OK", flush=True)
