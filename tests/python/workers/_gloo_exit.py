"""Leave a process that used a gloo group without CPython's interpreter teardown.

torch 2.15's gloo worker threads (``ProcessGroupGloo::runLoop``) drop each finished work only
after the caller's ``wait()`` has returned. If the work's tensors have lost their Python objects
by then, that drop takes the GIL (``TensorImpl::decref_pyobject``). If the main thread has begun
``Py_FinalizeEx`` meanwhile, CPython ends the gloo thread with ``pthread_exit``; its forced
unwinding meets a ``noexcept`` destructor (``~AsyncAllgatherWork``) and ``std::terminate`` aborts
the process after every check passed: "terminate called without an active exception", SIGABRT.

Seen on 2026-12-06 in a clean-clone CI run (rank 0 of ``ddp_compression.py``) and reproduced
without hcomm in the process: a gloo-only script (20 ``all_gather``s on 2 ranks, no
``destroy_process_group``) aborted in 2 of 10 runs. Its core dump has the gloo thread in
``take_gil`` -> ``PyThread_exit_thread`` from ``~AsyncAllgatherWork`` and the main thread in
``Py_FinalizeEx``'s garbage collection. hcomm's own process groups run no such threads, so the
workers that use no gloo group keep the normal teardown (and so keep testing it)."""

import os
import sys


def leave(code: int = 0) -> None:
    """Flush and end the process with `code` at once, skipping the interpreter's teardown.
    Call it last, after ``destroy_process_group()`` and the final "WORKER OK"."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
