"""Exceptions raised by hcomm.

Every failure of the library is an :class:`HcommError`; the subclasses say what kind:

=========================  ==================================================================
``InvalidArgumentError``   a bad argument (also a :class:`ValueError`); nothing was sent
``HcommTimeoutError``      a deadline passed waiting for the ranks in ``peers`` (also a
                           :class:`TimeoutError`)
``PeerError``              a peer closed its connection, died, reported a failure, or sent
                           garbage
``AbortedError``           the communicator was aborted
``RevokedError``           the communicator was revoked (``peers``: the rank that revoked it);
                           ``shrink()`` makes a working one of the ranks that are left
``MismatchError``          ranks called different collectives, or disagree on a message size
``PoisonedError``          the communicator failed earlier and must be rebuilt
``ConfigError``            the environment or rank table does not describe a job
``AuthenticationError``    a peer or the rendezvous refused this process's job token, or the
                           other way round (also a :class:`PermissionError`)
``LaunchError``            ``hcomm run`` could not start the ranks
=========================  ==================================================================

Arguments of the wrong Python type or dtype raise :class:`TypeError`, and tensors that are not
contiguous, not on the CPU, or read-only where a result must be written raise
:class:`ValueError`, before anything is sent.

Attributes set on the exceptions from the library: ``op`` (the operation, e.g. ``"all_reduce"``),
``seq`` (its sequence number on the communicator), ``peers`` (the ranks involved), ``fatal``
(whether the communicator is unusable afterwards).
"""

from __future__ import annotations

__all__ = [
    "HcommError",
    "InvalidArgumentError",
    "HcommTimeoutError",
    "PeerError",
    "AbortedError",
    "RevokedError",
    "MismatchError",
    "PoisonedError",
    "ConfigError",
    "AuthenticationError",
    "LaunchError",
]


class HcommError(Exception):
    """Base class of every hcomm failure."""

    op: str | None = None
    seq: int | None = None
    peers: tuple[int, ...] = ()
    fatal: bool = False


class InvalidArgumentError(HcommError, ValueError):
    """An argument the library refused (size, rank, root, counts, ...). Nothing was sent."""


class HcommTimeoutError(HcommError, TimeoutError):
    """A deadline (``HCOMM_TIMEOUT``, ``Communicator.timeout``) passed waiting for ``peers``."""


class PeerError(HcommError):
    """A peer closed its connection, died, reported an error, or broke the protocol."""


class AbortedError(HcommError):
    """The communicator was aborted (``Communicator.abort()``)."""


class RevokedError(HcommError):
    """The communicator was revoked (``Communicator.revoke()`` on some rank, or a
    ``shrink()`` started); ``peers`` holds the rank that revoked it. Every operation on it
    fails from then on: call ``shrink()`` on every surviving rank for a working one."""


class MismatchError(HcommError):
    """Ranks called different collectives or with different arguments, or a point-to-point
    message does not match the receive's size."""


class PoisonedError(HcommError):
    """The communicator failed earlier (``fatal`` error) and must be rebuilt."""


class ConfigError(HcommError):
    """The environment or rank table does not describe a job."""


class AuthenticationError(HcommError, PermissionError):
    """A connection failed the job-token check (``HCOMM_JOB_TOKEN`` / ``HCOMM_TOKEN_FILE``
    differ between ranks, or one has none)."""


class LaunchError(HcommError):
    """``hcomm run`` could not start the ranks; ``exit_code`` is what the command returns."""

    exit_code: int = 1
