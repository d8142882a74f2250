"""Fault-tolerant data-parallel training: one rank is SIGKILLed in the middle of a step; the
survivors detect it, shrink the communicator, roll back to the last step every rank completed
(kept in memory: no checkpoint files), and finish the run with identical parameters, equal
to those of a run without the failure.

    hcomm run --keep-going -n 4 python examples/fault_tolerant_training.py --kill-rank 2 --kill-at allreduce
    hcomm run --keep-going -n 4 python examples/fault_tolerant_training.py --replace   # a new process takes its place

--kill-at: backward (while autograd runs), allreduce (with a gradient bucket's all-reduce in
flight), optimizer (inside optimizer.step()), commit (inside the end-of-step agreement), none.
``--keep-going`` keeps the launcher from stopping the job when a rank dies. With --replace,
rank 0 of the survivors then starts a replacement process, which joins with
``hcomm.JoinGrown`` while the survivors call ``grow``, and gets the state by broadcast.

How it stays consistent: every step ends with a small all-reduce (the commit); a rank keeps
the state after each of its last two committed steps. A rank can only finish commit s when
every rank has finished commit s - 1, so after a failure the survivors' last commits differ by
at most one: they restart from the smallest, which every one of them has. The global batch is
the same whatever the number of ranks (each rank takes its share of it), so the parameters
are those of an uninterrupted run, up to the order of floating-point sums.
"""

import argparse
import copy
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

import hcomm

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--steps", type=int, default=24)
p.add_argument("--kill-rank", type=int, default=1)
p.add_argument("--kill-step", type=int, default=8)
p.add_argument("--kill-at", default="allreduce", choices=["backward", "allreduce", "optimizer", "commit", "none"])
p.add_argument("--replace", action="store_true", help="after the shrink, a new process joins (grow)")
p.add_argument("--join", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the replacement process
p.add_argument("--name", type=int, help=argparse.SUPPRESS)
args = p.parse_args()

torch.set_num_threads(1)  # ranks share the cores
BATCH = 96  # global batch: divisible by 1, 2, 3 and 4 ranks


def die(where: str) -> None:
    print(f"rank {me}: killed {where} at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def make_model() -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def batch(s: int) -> tuple:
    g = torch.Generator().manual_seed(1000 + s)
    x = torch.randn(BATCH, 32, generator=g)
    y = (x[:, :10] * torch.arange(1, 11)).argmax(dim=1)  # a learnable labelling
    return x, y


def loss_of(model, x, y) -> torch.Tensor:
    # Summed over this rank's rows and divided by the global batch: the all-reduced sum of
    # the ranks' gradients is the gradient of the global mean.
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / BATCH


def snapshot(model, opt) -> dict:
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}


def share_state(comm, step: int) -> int:
    """Rank 0's step, model and optimizer state to every rank (a replacement has none)."""
    blob = io.BytesIO()
    if comm.rank == 0:
        torch.save({"step": step, **snapshot(model, opt)}, blob)
    size = comm.broadcast(torch.tensor([blob.getbuffer().nbytes], dtype=torch.int64), 0)
    data = torch.zeros(int(size), dtype=torch.uint8)
    if comm.rank == 0:
        data.copy_(torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8))
    comm.broadcast(data, 0)
    state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"]


def names_of(comm) -> list:
    return [int(r) for r in comm.all_gather(torch.tensor([me], dtype=torch.int64), dim=0)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


model, opt = make_model()
if args.join:
    # A replacement: join the survivors' communicator and take their state.
    t0 = time.perf_counter()
    comm = hcomm.JoinGrown(args.join)
    me, n0 = args.name, comm.world_size
    step = share_state(comm, 0)
    members = names_of(comm)
    saved = {step: snapshot(model, opt)}
    print(f"rank {me}: joined as rank {comm.rank} of {comm.world_size} at step {step} in {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
else:
    comm = hcomm.InitHcom()
    me, n0 = comm.rank, comm.world_size  # this process's rank in the original job (kept as its name)
    members = list(range(comm.world_size))  # the names of the current communicator's ranks
    step = 0
    saved = {0: snapshot(model, opt)}  # committed step count -> state after it
params = list(model.parameters())
buckets = [params[:2], params[2:]]  # two gradient buckets
lost_s, recoveries, joiner = 0.0, [], None
victim = not args.join and args.kill_at != "none" and me == args.kill_rank

if victim and args.kill_at == "backward":
    params[0].register_hook(lambda g: die("during backward") if step == args.kill_step else g)
if victim and args.kill_at == "optimizer":
    opt.register_step_pre_hook(lambda o, a, k: die("inside optimizer.step()") if step == args.kill_step else None)

while step < args.steps:
    try:
        x, y = batch(step)
        share = BATCH // len(members)
        i = members.index(me)
        opt.zero_grad()
        loss_of(model, x[i * share : (i + 1) * share], y[i * share : (i + 1) * share]).backward()
        works = []
        for b in buckets:
            flat = torch.cat([q.grad.reshape(-1) for q in b])
            works.append((b, flat, comm.all_reduce_async(flat, "sum")))
            if victim and args.kill_at == "allreduce" and step == args.kill_step:
                die("with a bucket's all-reduce in flight")
        for b, flat, w in works:
            w.wait()
            off = 0
            for q in b:
                q.grad.copy_(flat[off : off + q.numel()].view_as(q))
                off += q.numel()
        opt.step()
        if victim and args.kill_at == "commit" and step == args.kill_step:
            threading.Timer(0.0005, die, ("inside the commit all-reduce",)).start()
        comm.all_reduce(torch.tensor([step], dtype=torch.int64), "min")  # the commit
        step += 1
        saved[step] = snapshot(model, opt)
        saved.pop(step - 2, None)
    except hcomm.HcommError as e:
        t0 = time.perf_counter()
        print(f"rank {me}: step {step} failed: {type(e).__name__}: {e}", flush=True)
        old = comm
        comm = old.shrink()
        old.destroy()
        members = names_of(comm)
        # Restart from the last step every survivor committed (they differ by one at most).
        restart = int(comm.all_reduce(torch.tensor([max(saved)], dtype=torch.int64), "min"))
        assert restart in saved, (restart, sorted(saved))
        model.load_state_dict(saved[restart]["model"])
        opt.load_state_dict(saved[restart]["opt"])
        redo = step - restart
        step = restart
        shrunk_s = time.perf_counter() - t0
        grow_note = ""
        if args.replace and joiner is None:
            # Rank 0 starts a replacement, which joins while everyone grows the communicator.
            addr = f"127.0.0.1:{free_port()}"
            if comm.rank == 0:
                name = max(range(n0)) + 1  # a name no rank had
                joiner = subprocess.Popen([sys.executable, __file__, "--join", addr, "--name", str(name), "--steps", str(args.steps)])
            else:
                joiner = True
            old = comm
            comm = old.grow(1, addr)
            old.destroy()
            share_state(comm, step)
            members = names_of(comm)
            grow_note = f"; a replacement started and joined {(time.perf_counter() - t0 - shrunk_s) * 1e3:.0f} ms later"
        took = time.perf_counter() - t0
        lost_s += took
        recoveries.append((took, redo))
        print(
            f"rank {me}: shrunk and rolled back to step {restart} ({redo} step(s) to redo) in {shrunk_s * 1e3:.1f} ms{grow_note}; "
            f"now {comm.world_size} ranks {members}",
            flush=True,
        )

# Every survivor holds the same parameters ...
flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
everyone = comm.all_gather(flat.unsqueeze(0), dim=0)
assert all(torch.equal(r, flat) for r in everyone), "survivors differ"
# ... and they are those of a run without the failure (same global batches, one process).
ref, ref_opt = make_model()
for s in range(args.steps):
    x, y = batch(s)
    ref_opt.zero_grad()
    loss_of(ref, x, y).backward()
    ref_opt.step()
ref_flat = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
err = (flat - ref_flat).abs().max().item()
assert err < 1e-4, f"parameters differ from the uninterrupted run by {err}"
x, y = batch(args.steps)
final_loss = loss_of(model, x, y).item()
print(
    f"rank {me}: {args.steps} steps on {comm.world_size} of {n0} ranks; "
    f"{len(recoveries)} recovery(ies), {lost_s * 1e3:.1f} ms in them; "
    f"max |parameter - uninterrupted run| {err:.1e}; held-out loss {final_loss:.3f}",
    flush=True,
)
if isinstance(joiner, subprocess.Popen):
    assert joiner.wait(timeout=120) == 0, "the replacement failed"
print("EXAMPLE OK", flush=True)
