"""``python -m hcomm run -n 4 python train.py`` (also the ``hcomm`` command a pip install puts
on PATH): start N local ranks with the hcomm and torch launch variables set, as the Rust
``hcomm run`` does. Other subcommands (demo, check, bench, doctor) belong to the Rust CLI
(``cargo build --release -p hcomm-cli``); they are passed on to an ``hcomm`` executable found
on PATH that is not this one."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional, Sequence


def _int_from(low: int, high: Optional[int] = None):
    """An argparse type: an int in [low, high] (argparse then names the option in its error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(
                f"{v} is not in {low}..{high}" if high is not None else f"{v} is less than {low}"
            )
        return v

    return parse


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hcomm run",
        description="Start N local ranks of PROGRAM with the hcomm (and torchrun) launch variables set: "
        "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and their HCOMM_ twins.",
    )
    p.add_argument("-n", "--nprocs", type=_int_from(1), default=1, help="ranks to start on this node (default 1)")
    p.add_argument("--nnodes", type=_int_from(1), default=1, help="number of nodes (each runs hcomm run with its --node-rank)")
    p.add_argument("--node-rank", type=_int_from(0), default=0, help="this node's index")
    p.add_argument("--master", help="rendezvous address HOST:PORT (default 127.0.0.1 and a free port)")
    p.add_argument("--port", type=_int_from(1, 65535), help="master port (alternative to --master)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--grace-ms", type=_int_from(0), default=3000, help="milliseconds between SIGTERM and SIGKILL when stopping ranks")
    p.add_argument("--keep-going", action="store_true", help="a rank killed by a signal does not stop the others (fault-tolerant programs that shrink)")
    p.add_argument(
        "--bind",
        choices=["spread", "none"],
        default="spread",
        help="CPU placement: spread (each rank its own share of the CPUs, when they do not outnumber them) or none",
    )
    p.add_argument("program", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def run(argv: Sequence[str]) -> int:
    """`hcomm run ARGS`; returns the exit code."""
    from . import _hcomm
    from .errors import LaunchError

    a = _run_parser().parse_args(list(argv))
    program = list(a.program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        print("hcomm run: no program given", file=sys.stderr)
        return 2
    addr: Optional[str] = None
    port: Optional[int] = a.port
    if a.master:
        host, sep, p = a.master.rpartition(":")
        if not sep or not p.isdigit() or not host or not 1 <= int(p) <= 65535:
            print(f"hcomm run: --master must be HOST:PORT (port 1..65535), got '{a.master}'", file=sys.stderr)
            return 2
        addr, port = host, int(p)
    try:
        code = _hcomm.launch(
            program[0],
            program[1:],
            nprocs=a.nprocs,
            nnodes=a.nnodes,
            node_rank=a.node_rank,
            master_addr=addr,
            master_port=port,
            prefix_output=not a.no_prefix,
            grace_ms=a.grace_ms,
            keep_going=a.keep_going,
            bind=a.bind,
        )
    except LaunchError as e:
        print(f"hcomm run: {e}", file=sys.stderr)
        return e.exit_code
    return max(0, min(255, code))


def _native_cli() -> Optional[str]:
    """An `hcomm` executable on PATH other than this script."""
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cand = shutil.which("hcomm", path=d) if d else None
        if cand and os.path.realpath(cand) != me:
            with open(cand, "rb") as f:
                if f.read(2) != b"#!":  # a binary, not another Python entry point
                    return cand
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nusage: hcomm run [-n N] [--master HOST:PORT] [--no-prefix] PROGRAM [ARGS...]")
        return 0 if argv else 2
    if argv[0] == "run":
        return run(argv[1:])
    native = _native_cli()
    if native is None:
        print(
            f"hcomm: '{argv[0]}' is a subcommand of the Rust hcomm command, which is not on PATH "
            "(build it with `cargo build --release -p hcomm-cli`); the Python package has only `run`",
            file=sys.stderr,
        )
        return 2
    os.execv(native, [native] + argv)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
