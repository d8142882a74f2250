"""Non-blocking point-to-point on the "hcomm" backend (issue #18): isend / irecv in every
posting order, batch_isend_irecv, and torch.distributed.pipelining schedules, each compared
with gloo on the same inputs. Run under a launcher that sets torch's variables:

    python -m hcomm run -n N python torch_p2p.py CASE

CASE is orders, batch, pipeline or any_source. Prints "ok <check>" lines and WORKER OK at the end. The
group timeout (20 s) bounds every wait: a deadlock fails as a timeout, never a hang.
"""

import datetime
import sys

import torch
import torch.distributed as dist

import hcomm.torch  # noqa: F401  (registers "hcomm")
from _gloo_exit import leave

torch.set_num_threads(1)  # ranks share the cores

CASE = sys.argv[1]
dist.init_process_group("hcomm", timeout=datetime.timedelta(seconds=20))
R, W = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))


def ok(name):
    print(f"ok {name}", flush=True)


def message(src, dst, k, nbytes):
    """What `src` sends `dst` as its k-th message: every element depends on all three."""
    n = max(nbytes // 4, 1) if nbytes else 0
    return (torch.arange(n, dtype=torch.int64) * 2654435761 + src * 131 + dst * 31 + k * 7).remainder(1 << 24).to(torch.float32)


def exchange(order, nbytes, group=None, per_peer=1):
    """Every rank exchanges `per_peer` messages with every other rank, posted in `order`."""
    peers = [p for p in range(W) if p != R]
    recvs, sends, bufs = [], [], []

    def post_recvs(ps):
        for p in ps:
            for k in range(per_peer):
                b = torch.zeros_like(message(p, R, k, nbytes))
                bufs.append((p, k, b))
                recvs.append(dist.irecv(b, src=p, group=group, tag=5))

    def post_sends(ps):
        for p in ps:
            for k in range(per_peer):
                sends.append(dist.isend(message(R, p, k, nbytes), dst=p, group=group, tag=5))

    receive_first = {"recv-first": True, "send-first": False, "mixed": R % 2 == 0}[order]
    if receive_first:
        post_recvs(peers)
        post_sends(peers)
    else:
        post_sends(peers)
        post_recvs(peers)
    for w in reversed(recvs):
        w.wait()
    for w in sends:
        w.wait()
    for p, k, b in bufs:
        assert torch.equal(b, message(p, R, k, nbytes)), f"{order} {nbytes} B: message {k} from {p} wrong"


if CASE == "orders":
    for nbytes in (8, 64 << 10, 4 << 20):
        for order in ("recv-first", "send-first", "mixed"):
            exchange(order, nbytes)
        ok(f"isend/irecv all pairs, every order, {nbytes} B")
    exchange("recv-first", 64 << 10, per_peer=3)
    exchange("send-first", 1 << 20, per_peer=2)
    ok("several messages per peer match in posting order")
    # is_completed() by polling, without wait()
    peer = (R + 1) % W
    src = (R - 1) % W
    b = torch.zeros(1 << 18)
    rw = dist.irecv(b, src=src)
    sw = dist.isend(message(R, peer, 0, 1 << 20), dst=peer)
    import time

    deadline = time.monotonic() + 20
    while not (rw.is_completed() and sw.is_completed()):
        assert time.monotonic() < deadline, "is_completed() never turned true"
        time.sleep(0.001)
    assert torch.equal(b, message(src, R, 0, 1 << 20))
    ok("posted p2p is_completed by polling")
    # Blocking send/recv among posted ones: a ring where everyone posts a large send first.
    sw = dist.isend(message(R, peer, 1, 1 << 21), dst=peer)
    got = torch.zeros(1 << 19)
    dist.recv(got, src=src)
    sw.wait()
    assert torch.equal(got, message(src, R, 1, 1 << 21))
    ok("blocking recv after a posted large send")

elif CASE == "batch":
    # The documented ring exchange, then all pairs at once, on hcomm and on gloo.
    for group, tag in ((None, "hcomm"), (gloo, "gloo")):
        for nbytes in (8, 256 << 10, 4 << 20):
            send = message(R, (R + 1) % W, 0, nbytes)
            recv = torch.zeros_like(message((R - 1) % W, R, 0, nbytes))
            ops = [
                dist.P2POp(dist.irecv, recv, (R - 1) % W, group=group),
                dist.P2POp(dist.isend, send, (R + 1) % W, group=group),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            assert torch.equal(recv, message((R - 1) % W, R, 0, nbytes)), f"{tag} ring {nbytes}"
            ops, bufs = [], []
            for p in range(W):
                if p != R:
                    b = torch.zeros_like(message(p, R, 0, nbytes))
                    bufs.append((p, b))
                    ops.append(dist.P2POp(dist.irecv, b, p, group=group))
                    ops.append(dist.P2POp(dist.isend, message(R, p, 0, nbytes), p, group=group))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            for p, b in bufs:
                assert torch.equal(b, message(p, R, 0, nbytes)), f"{tag} all pairs {nbytes} from {p}"
        ok(f"batch_isend_irecv ring and all pairs on {tag}")

elif CASE == "pipeline":
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    D, MB, N_MB = 256, 256, 4  # activations of 256 x 256 floats: 256 KiB per microbatch

    def run(schedule_cls, group):
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(W)]
        stage_mod = layers[R]
        stage = PipelineStage(stage_mod, R, W, torch.device("cpu"), group=group)
        loss_fn = torch.nn.MSELoss()
        sched = schedule_cls(stage, N_MB, loss_fn=loss_fn)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(MB * N_MB, D, generator=g)
        y = torch.randn(MB * N_MB, D, generator=g)
        losses = []
        if W == 1:
            sched.step(x, target=y, losses=losses)
        elif R == 0:
            sched.step(x)
        elif R == W - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        grads = torch.cat([p.grad.reshape(-1) for p in stage_mod.parameters()])
        return grads, [l.detach() for l in losses]

    for cls in (ScheduleGPipe, Schedule1F1B):
        g_h, l_h = run(cls, None)
        g_g, l_g = run(cls, gloo)
        assert torch.equal(g_h, g_g), f"{cls.__name__}: gradients differ from gloo's"
        assert len(l_h) == len(l_g) and all(torch.equal(a, b) for a, b in zip(l_h, l_g)), f"{cls.__name__}: losses differ"
        ok(f"pipelining {cls.__name__} over {W} stages equals gloo's")

elif CASE == "any_source":
    # recv without src returns the sender (as on gloo); irecv without src too.
    for group, tag in ((None, "hcomm"), (gloo, "gloo")):
        for nbytes in (8, 1 << 20):
            if R == 0:
                seen = []
                for _ in range(W - 1):
                    b = torch.zeros_like(message(1, 0, 0, nbytes))
                    src = dist.recv(b, group=group, tag=2)
                    assert torch.equal(b, message(src, 0, 0, nbytes)), f"{tag}: message from {src}"
                    seen.append(src)
                assert sorted(seen) == list(range(1, W)), f"{tag}: senders {seen}"
                works = [dist.irecv(torch.zeros_like(message(1, 0, 1, nbytes)), group=group, tag=3) for _ in range(W - 1)]
                srcs = []
                for w in works:
                    w.wait()
                    srcs.append(w._source_rank())
                assert sorted(srcs) == list(range(1, W)), f"{tag}: irecv senders {srcs}"
            else:
                dist.send(message(R, 0, 0, nbytes), dst=0, group=group, tag=2)
                dist.send(message(R, 0, 1, nbytes), dst=0, group=group, tag=3)
            dist.barrier(group=group)
        ok(f"recv from any source on {tag}")

else:
    raise SystemExit(f"unknown case {CASE}")

dist.barrier()
dist.destroy_process_group()
print("WORKER OK", flush=True)
leave()  # past torch's gloo teardown race (_gloo_exit.py)
