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
               The optimizer steps each bucket's parameters as soon as that bucket has
               arrived, while later buckets are still in flight (--no-early-step: after all)
  skipzeros    overlap, each bucket all-reduced skipping its zero blocks (hcomm's lossless
               block-sparse all-reduce): the dense token-embedding gradient, zero but for the
               batch's rows, moves only those rows; the model is unchanged, the result exact
  compressed:C overlap, each bucket compressed with C (fp16, int8, topk:1%, ...; error
               feedback on; top-k selects on the training thread, --no-encode-on-push: on
               hcomm's engine)
  sparse       overlap, except the token embedding: its gradient is sparse (only the rows of
               the batch's tokens; nn.Embedding(sparse=True)) and goes through one
               sparse_all_reduce (an all-gather of rows) instead of a dense all-reduce of
               the whole table; exact, like overlap
  ddp-hcomm    torch DistributedDataParallel on the "hcomm" torch.distributed backend
  ddp-gloo     torch DistributedDataParallel on gloo
  ddp-hcomm-sparse, ddp-gloo-sparse
               DDP with the sparse token embedding of `sparse` (each backend's sparse
               all-reduce; the gradient is made dense for AdamW after backward)
  ddp-hcomm-dense
               ddp-hcomm with HCOMM_SKIP_ZEROS=0 (comm.skip_zeros off for its steps): every
               block of every bucket crosses the link, as before hcomm skipped zero blocks
  fsdp2-hcomm, fsdp2-gloo
               FSDP2 (fully_shard on each encoder layer, then the root) on the "hcomm"
               backend and on gloo
  fsdp2-hcomm-prefetch, fsdp2-gloo-prefetch
               the same with hcomm.torch.overlap_fsdp(model): asynchronous all-gathers,
               explicit prefetching (the next layer's all-gather runs while this layer
               computes) and reduce-scatters left running while backward goes on,
               awaited when it ends (FSDP2's own overlap works through CUDA streams)
  ddp-hcomm:C  ddp-hcomm with one more line, the compression hook:
               ddp.register_comm_hook(hcomm.torch.CompressionHookState(C), compression_hook)
  fsdp2-hcomm:C, fsdp2-hcomm-prefetch:C
               the FSDP2 modes with one more line, hcomm.torch.compress_fsdp(model, C): the
               gradient reduce-scatters compressed (fp16, bf16, int8, sign; error feedback)

The modes' steps interleave (step i of every mode, then step i + 1; each mode keeps its own
model, optimizer and dropout generator), so that load from elsewhere on the machine falls on
every mode alike. Per mode, rank 0 prints one line with: step time (per step the max over ranks, median over
the timed steps), the time a step waits for communication after backward (naive, fused,
overlap, compressed: measured around the wait; DDP waits inside backward, so "-"), hcomm's
bytes sent per step and rank (its counters: TCP + shared memory; ddp-gloo and local: none),
the bytes that left this host's network interface per step (only when the ranks run in
network namespaces, see scripts/training-report.py), the training loss of the first and last
step (mean over ranks), and whether every rank ended with identical parameters. With --json
FILE, rank 0 appends one JSON object per mode. The last line is "EXAMPLE OK" on every rank.

Model (like ../shared/bench/ddp_train_bench.py): token + learned position embeddings,
LayerNorm, nn.TransformerEncoder (post-norm, GELU, dropout 0.1), a pooler on the first token
and a classification head; AdamW (lr 1e-3; torch's fused implementation unless --adamw
foreach). Data: deterministic synthetic token sequences per rank (seeded by --seed and the
rank), label = first token mod classes (learnable).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import hcomm
import hcomm.torch  # noqa: F401  (registers the "hcomm" backend)

MODES = ("local", "naive", "fused", "overlap", "skipzeros", "compressed", "sparse", "ddp-hcomm", "ddp-hcomm-sparse", "ddp-gloo", "ddp-gloo-sparse",
         "ddp-hcomm-dense", "fsdp2-hcomm", "fsdp2-gloo", "fsdp2-hcomm-prefetch", "fsdp2-gloo-prefetch")
#: modes whose collectives run on torch's gloo group (no hcomm bytes)
GLOO_MODES = ("ddp-gloo", "ddp-gloo-sparse", "fsdp2-gloo", "fsdp2-gloo-prefetch")
#: modes that take a compressor (MODE:COMPRESSOR): hcomm's own loop, DDP on hcomm with
#: hcomm.torch.compression_hook, FSDP2 on hcomm with hcomm.torch.compress_fsdp
COMPRESSIBLE = ("compressed", "ddp-hcomm", "fsdp2-hcomm", "fsdp2-hcomm-prefetch")
DEFAULT_MODES = ("local,naive,fused,overlap,skipzeros,sparse,compressed:fp16,compressed:int8,compressed:topk:1%,ddp-hcomm,ddp-hcomm-sparse,"
                 "ddp-gloo,ddp-gloo-sparse,fsdp2-hcomm,fsdp2-gloo,fsdp2-hcomm-prefetch,ddp-hcomm:int8,fsdp2-hcomm:int8")
TAG = "TRAIN_DDP_RESULT "
#: modes that wait for communication after backward (DDP waits inside it)
WAITS_AFTER_BACKWARD = ("naive", "fused", "overlap", "skipzeros", "compressed", "sparse")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated (default: %(default)s)")
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
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches (the same on every rank) whose accuracy each mode's model is scored on "
                        "after the timed steps [4]")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout [0.1]")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate [1e-3]")
    p.add_argument("--adamw", choices=("fused", "foreach"), default="fused",
                   help="torch's AdamW implementation, the same in every mode [fused: one kernel per step; "
                        "foreach (torch's default) takes 3x as long here, and twice that again on the mostly-zero "
                        "gradients of top-k]")
    p.add_argument("--seed", type=int, default=1234, help="weights and data [1234]")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap (fused, overlap, compressed, DDP) in MiB [25]")
    p.add_argument("--first-bucket-mb", type=float, default=1.0, help="first bucket (overlap, compressed) in MiB [1]")
    p.add_argument("--direct-mb", type=float, default=1.0, help="overlap/compressed: tensors this large are reduced alone, unpacked [1]")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank [1]")
    p.add_argument("--encode-on-push", action=argparse.BooleanOptionalAction, default=True,
                   help="compressed: top-k's selection on the training thread as each bucket closes, not on hcomm's "
                        "engine (each rank pays for its own: every core computes here) [on]")
    p.add_argument("--no-early-step", dest="early_step", action="store_false",
                   help="overlap, sparse, compressed: step the optimizer only after every bucket has arrived "
                        "(default: step each bucket's parameters as soon as it arrives, while later buckets are in flight)")
    p.add_argument("--link-iface", default="", help="count the bytes this interface sends (e.g. eth0 in the namespace cluster) [none]")
    p.add_argument("--link-gbit", type=float, default=0.0, help="the link's rate, for the utilisation column [unknown]")
    p.add_argument("--label", default="", help="a label copied into every JSON result (e.g. the link)")
    p.add_argument("--json", default="", help="rank 0 appends one JSON object per mode to this file")
    p.add_argument("--timeline", default="",
                   help="each rank writes PREFIX.rankN.jsonl: per mode and step, when forward and backward ended, "
                        "when each gradient was pushed and each bucket arrived (seconds of one monotonic clock, "
                        "comparable across ranks on one machine; add 'wall' for Unix time, as HCOMM_TRACE's) [none]")
    p.add_argument("--quick", action="store_true", help="tiny model (2 layers, hidden 64, vocab 4000, seq 32), 1 + 3 steps")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.vocab, a.seq, a.batch = 2, 64, 4000, 32, 4
        a.steps, a.warmup = min(a.steps, 3), min(a.warmup, 1)
    a.heads = a.heads or max(1, a.hidden // 64)
    a.ff = a.ff or 4 * a.hidden
    if a.hidden % a.heads:
        p.error("--hidden must be a multiple of --heads")
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        base, _, comp = m.partition(":")
        if base not in MODES:
            p.error(f"unknown mode {m!r} (one of {', '.join(MODES)}; {', '.join(COMPRESSIBLE)} take :COMPRESSOR)")
        if base == "compressed" and not comp:
            p.error("compressed needs a compressor: compressed:fp16, compressed:int8, compressed:topk:1%")
        if comp and base not in COMPRESSIBLE:
            p.error(f"mode {m!r}: only {', '.join(COMPRESSIBLE)} take a compressor")
        if comp:
            hcomm.CompressionState(comp)  # an unknown compressor fails here, on every rank
            if base != "compressed" and comp.startswith(("topk", "randk")) and base.startswith("fsdp2"):
                p.error(f"mode {m!r}: FSDP2's reduce-scatter compresses with fp16, bf16, int8 or sign")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be at least 1 and --warmup non-negative")
    return a


def build_model(a, sparse=False):
    """The encoder; with `sparse`, the token embedding's gradient is a sparse tensor (the rows
    of the batch's tokens). The initial weights do not depend on `sparse`."""
    nn = torch.nn

    class Encoder(nn.Module):
        """BERT-style encoder: embeddings, post-norm transformer layers, pooler, head."""

        def __init__(self):
            super().__init__()
            d = a.hidden
            self.tok = nn.Embedding(a.vocab, d, sparse=sparse)
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


def make_eval(a):
    """Held-out batches, the same on every rank and in every mode (another seed than the
    training data's)."""
    g = torch.Generator().manual_seed(a.seed * 1000003 + 999_999_937)
    out = []
    for _ in range(a.eval_batches):
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


class Trainer:
    """One mode's model, optimizer, data and dropout RNG. Every mode starts from the same
    weights (seed) and sees the same batches and dropout masks; `step` runs one training step
    and records its time, its wait after backward, its loss and its bytes."""

    def __init__(self, a, mode, comm, gloo, rank):
        self.a, self.mode, self.comm = a, mode, comm
        self.base, _, compressor = mode.partition(":")
        torch.manual_seed(a.seed)  # identical initial weights on every rank and in every mode
        self.sparse = self.base in ("sparse", "ddp-hcomm-sparse", "ddp-gloo-sparse")
        self.model = build_model(a, sparse=self.sparse)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        mb = 1 << 20
        self.net = self.model
        if self.base in ("ddp-hcomm", "ddp-hcomm-sparse", "ddp-hcomm-dense"):
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=a.bucket_mb)
            if compressor:  # one line: DDP's buckets all-reduced compressed by hcomm
                self.net.register_comm_hook(hcomm.torch.CompressionHookState(compressor), hcomm.torch.compression_hook)
        elif self.base in ("ddp-gloo", "ddp-gloo-sparse"):
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, process_group=gloo, bucket_cap_mb=a.bucket_mb)
        elif self.base.startswith("fsdp2-"):
            # FSDP2 as its users write it: each encoder layer a unit, then the root (embeddings,
            # pooler, head); parameters sharded over the group, gathered for forward and backward
            # (prefetching the next layer), gradients reduce-scattered and averaged
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(gloo if self.base in GLOO_MODES else dist.group.WORLD, "cpu")
            layers = list(self.model.encoder.layers)
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            if self.base.endswith("-prefetch"):
                # FSDP2 issues its all-gathers with async_op=False and overlaps them through
                # CUDA streams; on CPU each one blocks the training thread. overlap_fsdp makes
                # the unshards asynchronous and each layer prefetch its neighbour's all-gather
                # (the next in forward, the previous in backward), and leaves each layer's
                # gradient reduce-scatter running until backward ends, on any backend.
                hcomm.torch.overlap_fsdp(self.model)
            if compressor:  # one line: FSDP2's reduce-scatters compressed by hcomm
                hcomm.torch.compress_fsdp(self.model, compressor)
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.fusion = None
        self.sparse_work = None
        if self.base in ("overlap", "skipzeros", "compressed", "sparse"):
            self.fusion = comm.fusion(
                op="mean",
                cap_bytes=int(a.bucket_mb * mb),
                first_bucket_bytes=int(a.first_bucket_mb * mb),
                direct_bytes=int(a.direct_mb * mb),
                compression=compressor or None,
                error_feedback=True,
                skip_zeros=self.base == "skipzeros",
                encode_on_push=a.encode_on_push,
            )
            for p in self.params:  # each gradient starts its bucket's all-reduce as it is ready
                if self.sparse and p is self.model.tok.weight:
                    p.register_post_accumulate_grad_hook(self.launch_sparse)
                else:
                    p.register_post_accumulate_grad_hook(self.push)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=a.lr, fused=a.adamw == "fused", foreach=a.adamw == "foreach")
        # early step: the parameters of buckets that have arrived are stepped at once (one
        # AdamW over all of them), while later buckets are still in flight; AdamW is
        # per-element, so stepping in parts is the same update
        self.early = self.fusion is not None and a.early_step
        self.grad_owner, self.stepped = {}, set()
        self.early_s = 0.0
        self.lossf = torch.nn.CrossEntropyLoss()
        self.data = make_data(a, rank)
        # dropout masks: per rank, the same in every mode (each mode keeps its own generator
        # state, since the modes' steps interleave)
        torch.manual_seed(a.seed + 1 + rank)
        self.rng = torch.get_rng_state()
        self.net.train()
        self.times, self.waits, self.computes, self.losses = [], [], [], []
        self.sent, self.tcp, self.link = [], [], []
        self.buckets = 0
        self.eval_acc = None
        #: --timeline: this step's events, and the file they go to
        self.events = None
        self.timeline = open(f"{a.timeline}.rank{rank}.jsonl", "a") if a.timeline else None

    def push(self, p):
        self.grad_owner[id(p.grad)] = p
        if self.events is not None:
            self.events["push"].append((time.perf_counter(), p.grad.numel() * p.grad.element_size()))
        self.fusion.push(p.grad)

    def bucket_arrived(self, grads):
        """fusion.finish's callback: these gradients (every bucket that has arrived since the
        last call) are averaged; step their parameters."""
        t0 = time.perf_counter()
        if self.events is not None:
            self.events["arrived"].append((t0, sum(g.numel() * g.element_size() for g in grads)))
        params = [self.grad_owner[id(g)] for g in grads]
        self.step_only(params)
        self.stepped.update(id(p) for p in params)
        self.early_s += time.perf_counter() - t0

    def step_only(self, params):
        """One AdamW step of `params` alone: the optimizer's single parameter group holds
        just them for the call (its state is per parameter, so the others are untouched)."""
        group = self.opt.param_groups[0]
        every = group["params"]
        group["params"] = params
        try:
            self.opt.step()
        finally:
            group["params"] = every

    def optimizer_step(self):
        """Step what the early steps have not (all parameters without early stepping)."""
        if not self.early:
            self.opt.step()
            return
        rest = [p for p in self.params if id(p) not in self.stepped]
        if rest:
            self.step_only(rest)

    def launch_sparse(self, p):
        """The token embedding's sparse gradient, ready: start its sparse all-reduce (the
        rows of every rank's tokens, averaged) on hcomm's engine, after the buckets launched
        before it."""
        self.sparse_work = self.comm.sparse_all_reduce_async(p.grad, op="mean")

    def step(self, i):
        a, params, comm = self.a, self.params, self.comm
        x, y = self.data[i]
        torch.set_rng_state(self.rng)
        mb = 1 << 20
        before = comm.traffic() if self.base != "local" and self.base not in GLOO_MODES else None
        link0 = iface_tx_bytes(a.link_iface)
        if self.timeline:
            self.events = {"push": [], "arrived": []}
        if self.base == "ddp-hcomm-dense":
            comm.skip_zeros = False  # HCOMM_SKIP_ZEROS=0 for this mode's step (in issue order)
        if self.base.startswith("fsdp2-") and self.base not in GLOO_MODES:
            # hcomm keeps all-gather outputs (the gather cache) per communicator, and the
            # exact FSDP2 modes train bitwise the same parameters with their steps
            # interleaved on the one world group: a mode's all-gathers would find the shards
            # another mode just sent and send references. Drop what is kept (every rank, at
            # the same point): a step's backward still finds its own forward's gathers, and a
            # previous step's are of parameters the optimizer has changed since. (A group per
            # mode would keep up to 256 MiB more per mode and rank: the full report's 6x512
            # run ran out of memory that way.)
            budget = comm.gather_cache_budget
            comm.gather_cache_budget = 0
            comm.gather_cache_budget = budget
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        loss = self.lossf(self.net(x), y)
        tf = time.perf_counter()
        loss.backward()
        tb = time.perf_counter()
        if self.base == "naive":
            for p in params:
                comm.all_reduce(p.grad, op="mean")  # blocking, one call per parameter
        elif self.base == "fused":
            comm.all_reduce_coalesced([p.grad for p in params], op="mean", cap_bytes=int(a.bucket_mb * mb))
        elif self.fusion is not None:
            # waits for the buckets launched during backward (stepping each one's parameters
            # as it arrives, with early stepping)
            self.early_s = 0.0
            self.stepped.clear()
            self.buckets = self.fusion.finish(self.bucket_arrived if self.early else None)
            self.grad_owner.clear()
        if self.sparse_work is not None:
            self.model.tok.weight.grad = self.sparse_work.wait().to_dense()  # AdamW takes dense
            self.sparse_work = None
        elif self.base in ("ddp-hcomm-sparse", "ddp-gloo-sparse"):
            self.model.tok.weight.grad = self.model.tok.weight.grad.to_dense()
        tc = time.perf_counter()
        self.optimizer_step()
        t1 = time.perf_counter()
        if self.base == "ddp-hcomm-dense":
            comm.skip_zeros = True
        tc -= self.early_s  # optimizer time inside finish() is compute, not waiting
        # (after the clock) the gradients go now, not at this mode's next step: every mode's
        # step allocates them anew in backward, and 21 modes of the 6x512 model each holding
        # 93 MB of them between their steps took ~2 GB per rank (the full report's two ranks
        # reached 24 GB)
        for p in params:
            p.grad = None
        self.rng = torch.get_rng_state()
        self.times.append(t1 - t0)
        self.waits.append(tc - tb)
        self.computes.append((tb - t0) + (t1 - tc))
        self.losses.append(loss.item())
        if self.timeline:
            ev = {"mode": self.mode, "step": i, "wall": time.time() - time.perf_counter(), "start": t0, "forward_end": tf, "backward_end": tb,
                  "comm_end": tc + self.early_s, "end": t1, **self.events}
            self.timeline.write(json.dumps(ev) + "\n")
            self.events = None
        return before, link0

    def account(self, before, link0):
        """Bytes of the step just run (called once every rank has finished it)."""
        if before is not None:
            was = {t.op: t for t in before}
            now = self.comm.traffic()
            self.sent.append(sum(t.bytes_sent - (was[t.op].bytes_sent if t.op in was else 0) for t in now))
            self.tcp.append(sum(t.tcp_sent - (was[t.op].tcp_sent if t.op in was else 0) for t in now))
        link1 = iface_tx_bytes(self.a.link_iface)
        if link0 is not None:
            self.link.append(link1 - link0)

    def evaluate(self, batches):
        """Accuracy of this mode's model (dropout off) on the held-out `batches`."""
        self.model.eval()
        right = total = 0
        with torch.no_grad():
            for x, y in batches:
                right += int((self.model(x).argmax(dim=1) == y).sum())
                total += len(y)
        self.model.train()
        return right / total if total else None

    def summary(self, world):
        a = self.a
        with torch.no_grad():
            # FSDP2's parameters are shards: gather each whole (a collective, in the same order
            # on every rank)
            full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.params]
            flat = torch.cat([p.detach().reshape(-1) for p in full])
        w = a.warmup
        return {
            "times": self.times[w:],
            "waits": self.waits[w:],
            "computes": self.computes[w:],
            "losses": self.losses,
            "first_loss": self.losses[0],
            "last_loss": self.losses[-1],
            "sent": sum(self.sent[w:]) if self.sent else None,
            "tcp": sum(self.tcp[w:]) if self.tcp else None,
            "link": sum(self.link[w:]) if self.link else None,
            "host": self.comm._c.host_id,
            "local_rank": self.comm._c.local_rank,
            "csum": [float(flat.double().sum()), float(flat.double().abs().sum())],
            "buckets": self.buckets,
            "eval_acc": self.eval_acc,
            # FSDP2 with overlap_fsdp: reduce-scatters left running while backward went on
            "rs_overlapped": hcomm.torch.overlap_fsdp_counts(self.model)["overlapped"] if self.base.endswith("-prefetch") else None,
        }


def summarize(a, mode, every, world):
    """Rank 0: one mode's result from every rank's summary."""
    base = mode.partition(":")[0]
    n = a.steps
    per_step = [max(r["times"][i] for r in every) for i in range(n)]
    wait_step = [max(r["waits"][i] for r in every) for i in range(n)]
    compute_step = [max(r["computes"][i] for r in every) for i in range(n)]
    hosts = {r["host"]: r["link"] for r in every if r["link"] is not None and r["local_rank"] == 0}
    step_s = statistics.median(per_step)
    link_per_step = statistics.mean(hosts.values()) / n if hosts else None
    uses_hcomm = base != "local" and base not in GLOO_MODES
    return {
        "mode": mode,
        "label": a.label,
        "ranks": world,
        "hosts": len({r["host"] for r in every}),
        "model": f"{a.layers}x{a.hidden}",
        "params": every[0]["params"],
        "grad_bytes": every[0]["grad_bytes"],
        "steps": n,
        "step_ms": step_s * 1e3,
        "step_ms_min": min(per_step) * 1e3,
        "step_ms_max": max(per_step) * 1e3,
        "wait_ms": statistics.median(wait_step) * 1e3 if base in WAITS_AFTER_BACKWARD else None,
        "wait_ms_at_min": wait_step[per_step.index(min(per_step))] * 1e3 if base in WAITS_AFTER_BACKWARD else None,
        # forward + backward + optimizer (the step without the wait after backward; for DDP
        # this includes its waits inside backward): per step the slowest rank, median, and the
        # value in the fastest step
        "compute_ms": statistics.median(compute_step) * 1e3,
        "compute_ms_at_min": compute_step[per_step.index(min(per_step))] * 1e3,
        "hcomm_sent_per_step": statistics.mean(r["sent"] for r in every) / n if uses_hcomm else None,
        "hcomm_tcp_per_step": statistics.mean(r["tcp"] for r in every) / n if uses_hcomm else None,
        "link_bytes_per_step": link_per_step,
        "link_util": (link_per_step * 8 / (a.link_gbit * 1e9) / step_s) if link_per_step is not None and a.link_gbit > 0 else None,
        "first_loss": statistics.mean(r["first_loss"] for r in every),
        "loss": statistics.mean(r["last_loss"] for r in every),
        # every step's loss (warm-up included), mean over ranks
        "loss_curve": [statistics.mean(r["losses"][i] for r in every) for i in range(len(every[0]["losses"]))],
        "replicas_identical": all(r["csum"] == every[0]["csum"] for r in every),
        # the parameters' sum and sum of magnitudes (rank 0's): modes that must end with the
        # same parameters (FSDP2 on hcomm and on gloo) compare these
        "csum": every[0]["csum"],
        # accuracy on the held-out batches after the timed steps, mean over ranks (the
        # replicas are identical in every mode but local)
        "eval_acc": statistics.mean(r["eval_acc"] for r in every) if every[0]["eval_acc"] is not None else None,
        "buckets": every[0]["buckets"],
        "rs_overlapped": every[0]["rs_overlapped"],
    }


def train(a, comm, gloo, meta, rank, world):
    """Every mode, their steps interleaved (step i of every mode, then step i + 1), so that
    load from elsewhere on the machine falls on every mode alike. A barrier after each step
    keeps one mode's traffic out of the next one's byte counts."""
    trainers = [Trainer(a, m, comm, gloo, rank) for m in a.modes]
    for i in range(a.warmup + a.steps):
        for t in trainers:
            marks = t.step(i)
            dist.barrier(group=meta)  # every rank done with this mode's step: its bytes have arrived
            t.account(*marks)
    held_out = make_eval(a)
    for t in trainers:
        t.eval_acc = t.evaluate(held_out)
    results = []
    for t in trainers:
        mine = t.summary(world)
        mine["params"] = sum(p.numel() for p in t.params)
        mine["grad_bytes"] = sum(p.numel() * p.element_size() for p in t.params)
        every = [None] * world
        dist.all_gather_object(every, mine, group=meta)
        if rank == 0:
            results.append(summarize(a, t.mode, every, world))
    return results


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
    gloo = dist.new_group(backend="gloo", timeout=tmo) if any(m.partition(":")[0] in GLOO_MODES for m in a.modes) else None
    meta = dist.new_group(backend="gloo", timeout=tmo)  # bookkeeping, off hcomm's counters
    results = train(a, comm, gloo, meta, rank, world)
    for r in results:
        print(TAG + json.dumps(r), flush=True)
    ok = True
    if rank == 0:
        local = next((r["step_ms"] for r in results if r["mode"] == "local"), None)
        print(f"# {world} ranks on {results[0]['hosts']} host(s), model {results[0]['model']} "
              f"({results[0]['params'] / 1e6:.2f} M parameters, {results[0]['grad_bytes'] / 1e6:.1f} MB of gradients), "
              f"{a.steps} timed steps", flush=True)
        print(f"{'mode':26s} {'step ms':>8s} {'wait ms':>8s} {'exposed':>8s} {'hcomm MB':>9s} {'link MB':>8s} {'util':>6s} {'loss':>8s} {'eval acc':>8s}  identical", flush=True)
        for r in results:
            exposed = (r["step_ms"] - local) / r["step_ms"] if local and r["mode"] != "local" else None
            print(f"{r['mode']:26s} {r['step_ms']:8.1f} {fmt(r['wait_ms'], '%8.1f', '       -')} {fmt(exposed, '%8.3f', '       -')} "
                  f"{fmt(r['hcomm_sent_per_step'] and r['hcomm_sent_per_step'] / 1e6, '%9.2f', '        -')} "
                  f"{fmt(r['link_bytes_per_step'] and r['link_bytes_per_step'] / 1e6, '%8.2f', '       -')} "
                  f"{fmt(r['link_util'], '%6.2f', '     -')} {r['loss']:8.4f} {fmt(r['eval_acc'], '%8.3f', '       -')}  "
                  f"{'-' if r['mode'] == 'local' else 'yes' if r['replicas_identical'] else 'NO'}", flush=True)
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
    code = main()
    # Every rank used gloo groups (`meta` at least). torch 2.15's gloo worker threads can still be
    # dropping a finished work's tensors when the interpreter finalizes, and that aborts the
    # process ("terminate called without an active exception") after the run succeeded; see
    # examples/torch_workloads.py. Everything is written and the groups destroyed: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
