"""Data-parallel training of a BERT-style transformer encoder on CPU, with every way hcomm can
average the gradients, timed side by side (issue #10).

    hcomm run -n 2 python examples/train_ddp.py                      # every mode, default model
    hcomm run -n 2 python examples/train_ddp.py --quick              # tiny model, 3 steps (tests)
    hcomm run -n 2 python examples/train_ddp.py --modes naive,overlap --layers 6 --hidden 512

Modes (every one trains the same model from the same seed on the same per-rank batches):

  local        no communication: the compute-only lower bound (each rank trains its own copy)
  naive        after backward, one blocking hcomm all-reduce (mean) per parameter
  fused        after backward, one bucketed all-reduce of every gradient (AllReduceCoalesced)
  overlap      buckets launched asynchronously from gradient hooks during backward
               (hcomm.Fusion fed by register_post_accumulate_grad_hook), waited for before
               the optimizer step
  compressed:C overlap, each bucket compressed with C (fp16, int8, topk:1%, ...; error
               feedback on)
  ddp-hcomm    torch DistributedDataParallel on the "hcomm" torch.distributed backend
  ddp-gloo     torch DistributedDataParallel on gloo

Per mode, rank 0 prints one line with: step time (per step the max over ranks, median over
the timed steps), the time a step waits for communication after backward (naive, fused,
overlap, compressed: measured around the wait; DDP waits inside backward, so "-"), hcomm's
bytes sent per step and rank (its counters: TCP + shared memory; ddp-gloo and local: none),
the bytes that left this host's network interface per step (only when the ranks run in
network namespaces, see scripts/training-report.py), the training loss of the first and last
step (mean over ranks), and whether every rank ended with identical parameters. With --json
FILE, rank 0 appends one JSON object per mode. The last line is "EXAMPLE OK" on every rank.

Model (like ../shared/bench/ddp_train_bench.py): token + learned position embeddings,
LayerNorm, nn.TransformerEncoder (post-norm, GELU, dropout 0.1), a pooler on the first token
and a classification head; AdamW (lr 1e-3). Data: deterministic synthetic token sequences per
rank (seeded by --seed and the rank), label = first token mod classes (learnable).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import hcomm
import hcomm.torch  # noqa: F401  (registers the "hcomm" backend)

MODES = ("local", "naive", "fused", "overlap", "compressed", "ddp-hcomm", "ddp-gloo")
DEFAULT_MODES = "local,naive,fused,overlap,compressed:fp16,compressed:int8,compressed:topk:1%,ddp-hcomm,ddp-gloo"
TAG = "TRAIN_DDP_RESULT "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated [{DEFAULT_MODES}]")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode [10]")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first [2]")
    p.add_argument("--layers", type=int, default=4, help="encoder layers [4]")
    p.add_argument("--hidden", type=int, default=256, help="d_model [256]")
    p.add_argument("--heads", type=int, default=0, help="attention heads [hidden/64]")
    p.add_argument("--ff", type=int, default=0, help="feed-forward width [4*hidden]")
    p.add_argument("--vocab", type=int, default=8000, help="vocabulary [8000]")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence [128]")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step [8]")
    p.add_argument("--classes", type=int, default=4, help="classes [4]")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout [0.1]")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate [1e-3]")
    p.add_argument("--seed", type=int, default=1234, help="weights and data [1234]")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap (fused, overlap, compressed, DDP) in MiB [25]")
    p.add_argument("--first-bucket-mb", type=float, default=1.0, help="first bucket (overlap, compressed) in MiB [1]")
    p.add_argument("--direct-mb", type=float, default=1.0, help="overlap/compressed: tensors this large are reduced alone, unpacked [1]")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank [1]")
    p.add_argument("--link-iface", default="", help="count the bytes this interface sends (e.g. eth0 in the namespace cluster) [none]")
    p.add_argument("--link-gbit", type=float, default=0.0, help="the link's rate, for the utilisation column [unknown]")
    p.add_argument("--label", default="", help="a label copied into every JSON result (e.g. the link)")
    p.add_argument("--json", default="", help="rank 0 appends one JSON object per mode to this file")
    p.add_argument("--quick", action="store_true", help="tiny model (2 layers, hidden 64, seq 32), 1 + 3 steps")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.vocab, a.seq, a.batch = 2, 64, 1000, 32, 4
        a.steps, a.warmup = min(a.steps, 3), min(a.warmup, 1)
    a.heads = a.heads or max(1, a.hidden // 64)
    a.ff = a.ff or 4 * a.hidden
    if a.hidden % a.heads:
        p.error("--hidden must be a multiple of --heads")
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        base, _, comp = m.partition(":")
        if base not in MODES:
            p.error(f"unknown mode {m!r} (one of {', '.join(MODES)}; compressed:COMPRESSOR)")
        if base == "compressed" and not comp:
            p.error("compressed needs a compressor: compressed:fp16, compressed:int8, compressed:topk:1%")
        if comp and base != "compressed":
            p.error(f"mode {m!r}: only compressed takes a compressor")
        if comp:
            hcomm.CompressionState(comp)  # an unknown compressor fails here, on every rank
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be at least 1 and --warmup non-negative")
    return a


def build_model(a):
    nn = torch.nn

    class Encoder(nn.Module):
        """BERT-style encoder: embeddings, post-norm transformer layers, pooler, head."""

        def __init__(self):
            super().__init__()
            d = a.hidden
            self.tok = nn.Embedding(a.vocab, d)
            self.pos = nn.Embedding(a.seq, d)
            self.norm = nn.LayerNorm(d)
            self.drop = nn.Dropout(a.dropout)
            layer = nn.TransformerEncoderLayer(d, a.heads, a.ff, dropout=a.dropout, activation="gelu", batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
            self.pool = nn.Linear(d, d)
            self.head = nn.Linear(d, a.classes)

        def forward(self, x):
            pos = torch.arange(x.shape[1], device=x.device)
            h = self.drop(self.norm(self.tok(x) + self.pos(pos)))
            h = self.encoder(h)
            return self.head(torch.tanh(self.pool(h[:, 0])))

    return Encoder()


def make_data(a, rank):
    """Deterministic batches of this rank: tokens uniform in [0, vocab), label = first token
    mod classes. The same for every mode."""
    g = torch.Generator().manual_seed(a.seed * 1000003 + 7919 * rank + 1)
    out = []
    for _ in range(a.warmup + a.steps):
        x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        out.append((x, x[:, 0] % a.classes))
    return out


def iface_tx_bytes(iface):
    """Bytes interface `iface` of this process's network namespace has sent (/proc/net/dev),
    or None without an interface name."""
    if not iface:
        return None
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, rest = line.split(":", 1)
            if name.strip() == iface:
                return int(rest.split()[8])
    raise SystemExit(f"train_ddp: no network interface {iface!r} in /proc/net/dev")


def train_mode(a, mode, comm, gloo, meta, rank, world):
    base, _, compressor = mode.partition(":")
    torch.manual_seed(a.seed)  # identical initial weights on every rank and in every mode
    model = build_model(a)
    params = [p for p in model.parameters() if p.requires_grad]
    mb = 1 << 20
    net = model
    if base == "ddp-hcomm":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    elif base == "ddp-gloo":
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=gloo, bucket_cap_mb=a.bucket_mb)
    fusion, hooks = None, []
    if base in ("overlap", "compressed"):
        fusion = comm.fusion(
            op="mean",
            cap_bytes=int(a.bucket_mb * mb),
            first_bucket_bytes=int(a.first_bucket_mb * mb),
            direct_bytes=int(a.direct_mb * mb),
            compression=compressor or None,
            error_feedback=True,
        )
        hooks = [p.register_post_accumulate_grad_hook(lambda p: fusion.push(p.grad)) for p in params]
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr)
    lossf = torch.nn.CrossEntropyLoss()
    data = make_data(a, rank)
    torch.manual_seed(a.seed + 1 + rank)  # dropout masks: per rank, the same in every mode
    net.train()
    times, waits, losses = [], [], []
    buckets = 0
    start = None
    for step, (x, y) in enumerate(data):
        if step == a.warmup:  # the timed window starts: counters from here
            dist.barrier(group=meta)
            comm.reset_traffic()
            start = (iface_tx_bytes(a.link_iface), time.perf_counter())
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = lossf(net(x), y)
        loss.backward()
        tb = time.perf_counter()
        if base == "naive":
            for p in params:
                comm.all_reduce(p.grad, op="mean")  # blocking, one call per parameter
        elif base == "fused":
            comm.all_reduce_coalesced([p.grad for p in params], op="mean", cap_bytes=int(a.bucket_mb * mb))
        elif fusion is not None:
            buckets = fusion.finish()  # waits for the buckets launched during backward
        tc = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        waits.append(tc - tb)
        losses.append(loss.item())
    dist.barrier(group=meta)
    end = (iface_tx_bytes(a.link_iface), time.perf_counter())
    traffic = comm.traffic()
    for h in hooks:
        h.remove()
    sent = sum(t.bytes_sent for t in traffic)
    tcp = sum(t.tcp_sent for t in traffic)
    link = None if start[0] is None or end[0] is None else end[0] - start[0]
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
    mine = {
        "times": times[a.warmup:],
        "waits": waits[a.warmup:],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "sent": sent,
        "tcp": tcp,
        "link": link,
        "host": comm._c.host_id,
        "local_rank": comm._c.local_rank,
        "csum": [float(flat.double().sum()), float(flat.double().abs().sum())],
        "buckets": buckets,
    }
    every = [None] * world
    dist.all_gather_object(every, mine, group=meta)
    del net, model, opt, fusion
    if rank != 0:
        return None
    n = a.steps
    per_step = [max(r["times"][i] for r in every) for i in range(n)]
    wait_step = [max(r["waits"][i] for r in every) for i in range(n)]
    hosts = {}
    for r in every:
        if r["link"] is not None and r["local_rank"] == 0:
            hosts[r["host"]] = r["link"]
    step_s = statistics.median(per_step)
    link_per_step = statistics.mean(hosts.values()) / n if hosts else None
    uses_hcomm = base not in ("local", "ddp-gloo")
    return {
        "mode": mode,
        "label": a.label,
        "ranks": world,
        "hosts": len({r["host"] for r in every}),
        "model": f"{a.layers}x{a.hidden}",
        "params": sum(p.numel() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "steps": n,
        "step_ms": step_s * 1e3,
        "step_ms_min": min(per_step) * 1e3,
        "wait_ms": statistics.median(wait_step) * 1e3 if base in ("naive", "fused", "overlap", "compressed") else None,
        "hcomm_sent_per_step": statistics.mean(r["sent"] for r in every) / n if uses_hcomm else None,
        "hcomm_tcp_per_step": statistics.mean(r["tcp"] for r in every) / n if uses_hcomm else None,
        "link_bytes_per_step": link_per_step,
        "link_util": (link_per_step * 8 / (a.link_gbit * 1e9) / step_s) if link_per_step is not None and a.link_gbit > 0 else None,
        "first_loss": statistics.mean(r["first_loss"] for r in every),
        "loss": statistics.mean(r["last_loss"] for r in every),
        "replicas_identical": all(r["csum"] == every[0]["csum"] for r in every),
        "buckets": every[0]["buckets"],
    }


def fmt(v, spec, none="-"):
    return none if v is None else spec % v


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    tmo = datetime.timedelta(seconds=300)  # torch's groups; HCOMM_TIMEOUT, if set, is hcomm's
    dist.init_process_group("hcomm", timeout=tmo)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = hcomm.torch.communicator_of()
    gloo = dist.new_group(backend="gloo", timeout=tmo) if any(m == "ddp-gloo" for m in a.modes) else None
    meta = dist.new_group(backend="gloo", timeout=tmo)  # bookkeeping, off hcomm's counters
    results = []
    for mode in a.modes:
        r = train_mode(a, mode, comm, gloo, meta, rank, world)
        if rank == 0:
            results.append(r)
            print(TAG + json.dumps(r), flush=True)
    ok = True
    if rank == 0:
        local = next((r["step_ms"] for r in results if r["mode"] == "local"), None)
        print(f"# {world} ranks on {results[0]['hosts']} host(s), model {results[0]['model']} "
              f"({results[0]['params'] / 1e6:.2f} M parameters, {results[0]['grad_bytes'] / 1e6:.1f} MB of gradients), "
              f"{a.steps} timed steps", flush=True)
        print(f"{'mode':22s} {'step ms':>8s} {'wait ms':>8s} {'exposed':>8s} {'hcomm MB':>9s} {'link MB':>8s} {'util':>6s} {'loss':>8s}  identical", flush=True)
        for r in results:
            exposed = (r["step_ms"] - local) / r["step_ms"] if local and r["mode"] != "local" else None
            print(f"{r['mode']:22s} {r['step_ms']:8.1f} {fmt(r['wait_ms'], '%8.1f', '       -')} {fmt(exposed, '%8.3f', '       -')} "
                  f"{fmt(r['hcomm_sent_per_step'] and r['hcomm_sent_per_step'] / 1e6, '%9.2f', '        -')} "
                  f"{fmt(r['link_bytes_per_step'] and r['link_bytes_per_step'] / 1e6, '%8.2f', '       -')} "
                  f"{fmt(r['link_util'], '%6.2f', '     -')} {r['loss']:8.4f}  {'-' if r['mode'] == 'local' else 'yes' if r['replicas_identical'] else 'NO'}", flush=True)
            if r["mode"] != "local" and world > 1 and not r["replicas_identical"]:
                print(f"# ERROR: {r['mode']}: ranks ended with different parameters", file=sys.stderr, flush=True)
                ok = False
        if a.json:
            with open(a.json, "a") as f:
                for r in results:
                    f.write(json.dumps(r) + "\n")
    dist.barrier(group=meta)
    dist.destroy_process_group()
    if not ok:
        return 1
    print("EXAMPLE OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
