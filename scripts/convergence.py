#!/usr/bin/env python3
"""Convergence of data-parallel training with each gradient compressor (issue #8).

Trains a small MLP on scikit-learn's bundled handwritten digits (`load_digits`: 1,797 8x8
images, 10 classes; shipped with the package, nothing is downloaded) data-parallel over N
ranks, once per compressor, with and without error feedback, from the same initial weights
through the same global batches, and writes a Markdown table of the final test accuracy and
losses against the uncompressed run.

    python3 scripts/convergence.py                     # 2 and 4 ranks, 400 steps -> docs/convergence.md
    python3 scripts/convergence.py --quick --out /tmp/c.md
    python3 scripts/convergence.py --ranks 2 --steps 200 --compressors none,int8,topk:1%

Each step takes a global batch of 64 training images (one shuffled order per epoch, from the
seed) and gives each rank an equal, disjoint part of it; the gradients are averaged with
hcomm's fusion (one bucket; `Fusion(compression=C, error_feedback=EF)` for the compressed
runs), so the uncompressed runs at 2 and 4 ranks follow the same trajectory up to float
rounding. Optimizer: SGD, lr 0.05, momentum 0.9. Model: 64-256-128-10 MLP (ReLU), 50,186
parameters. Needs torch, scikit-learn and the hcomm package (scripts/test-python.sh installs
it into target/python-venv; run this script with that Python or one where hcomm is installed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = "CONVERGENCE_RESULT "
DEFAULT_COMPRESSORS = "none,fp16,bf16,int8,topk:1%,randk:1%,sign"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes [2,4]")
    p.add_argument("--steps", type=int, default=400, help="training steps per run [400]")
    p.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks) [64]")
    p.add_argument("--lr", default="0.05,0.01", help="SGD learning rates, one table each [0.05,0.01]")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum [0.9]")
    p.add_argument("--seed", type=int, default=0, help="weights and data order [0]")
    p.add_argument("--compressors", default=DEFAULT_COMPRESSORS, help="comma-separated (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="60 steps, 2 ranks only (for tests)")
    p.add_argument("--out", default=str(ROOT / "docs" / "convergence.md"), help="Markdown output [docs/convergence.md]")
    p.add_argument("--json", default="", help="also write every run's result as JSON lines here")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per world size [600]")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps = min(a.steps, 60)
        if a.ranks == "2,4":
            a.ranks = "2"
    a.ranks = [int(r) for r in a.ranks.split(",") if r.strip()]
    a.lrs = [float(x) for x in str(a.lr).split(",") if x.strip()]
    if a.quick and len(a.lrs) > 1 and str(a.lr) == "0.05,0.01":
        a.lrs = a.lrs[:1]
    a.lr = a.lrs[0]
    a.compressors = [c.strip() for c in a.compressors.split(",") if c.strip()]
    if any(r < 1 for r in a.ranks):
        p.error("--ranks must be positive")
    for r in a.ranks:
        if a.batch % r:
            p.error(f"--batch {a.batch} does not split evenly over {r} ranks")
    if "none" not in a.compressors:
        a.compressors.insert(0, "none")
    return a


# ---------------------------------------------------------------- worker (one rank)


def configs(compressors):
    """(compressor, error_feedback) pairs: `none` once, every lossy compressor with and
    without error feedback."""
    out = []
    for c in compressors:
        if c == "none":
            out.append((c, False))
        else:
            out += [(c, True), (c, False)]
    return out


def worker(a) -> int:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hcomm

    torch.set_num_threads(1)
    comm = hcomm.InitHcom("convergence")
    rank, world = comm.rank, comm.world_size
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    xtr, xte = torch.from_numpy(xtr), torch.from_numpy(xte)
    ytr, yte = torch.from_numpy(ytr).long(), torch.from_numpy(yte).long()
    per_rank = a.batch // world
    lossf = torch.nn.CrossEntropyLoss()

    def evaluate(model):
        with torch.no_grad():
            tr = lossf(model(xtr), ytr).item()
            out = model(xte)
            te = lossf(out, yte).item()
            acc = (out.argmax(1) == yte).float().mean().item()
        return tr, te, acc

    for comp, ef in configs(a.compressors):
        torch.manual_seed(a.seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=a.lr, momentum=a.momentum)
        fusion = comm.fusion(op="mean", compression=None if comp == "none" else comp, error_feedback=ef)
        order_rng = np.random.default_rng(a.seed)
        order = np.empty(0, dtype=np.int64)
        curve = {}
        checkpoints = {a.steps // 4, a.steps // 2, a.steps}
        comm.reset_traffic()
        t0 = time.perf_counter()
        for step in range(1, a.steps + 1):
            if order.size < a.batch:  # a new epoch: one shuffled order, the same on every rank
                order = np.concatenate([order, order_rng.permutation(len(xtr))])
            batch, order = order[: a.batch], order[a.batch :]
            mine = torch.from_numpy(batch[rank * per_rank : (rank + 1) * per_rank])
            opt.zero_grad(set_to_none=True)
            loss = lossf(model(xtr[mine]), ytr[mine])
            loss.backward()
            with fusion.step() as f:
                for p in params:
                    f.push(p.grad)
            opt.step()
            if step in checkpoints:
                curve[step] = evaluate(model)[2]
            # Diverged: stop. The parameters are bitwise identical on every rank, so every
            # rank stops at the same step without communicating.
            if not all(bool(torch.isfinite(p).all()) for p in params):
                diverged = step
                break
        else:
            diverged = None
        ran = step
        seconds = time.perf_counter() - t0
        sent = sum(t.bytes_sent for t in comm.traffic())
        tr, te, acc = evaluate(model)
        # every replica must be identical (the compressed results are the same on every rank)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        every = comm.all_gather(flat[None, :], dim=0)
        bits = flat.view(torch.int32)  # bitwise (NaN == NaN after a divergence)
        same = bool(all(torch.equal(every[r].view(torch.int32), bits) for r in range(world)))
        if rank == 0:
            res = {
                "compressor": comp,
                "canonical": fusion.compression or "none",
                "error_feedback": ef,
                "ranks": world,
                "steps": a.steps,
                "train_loss": tr,
                "test_loss": te,
                "test_acc": acc,
                "curve": curve,
                "sent_bytes_per_step": sent / ran,
                "diverged_at": diverged,
                "seconds": seconds,
                "lr": a.lr,
                "replicas_identical": same,
                "params": sum(p.numel() for p in params),
            }
            print(TAG + json.dumps(res), flush=True)
        if not same:
            print(f"rank {rank}: {comp} ef={ef}: replicas differ", file=sys.stderr, flush=True)
            return 1
    return 0


# ---------------------------------------------------------------- driver


def run_world(a, n, lr) -> list:
    cmd = [sys.executable, "-m", "hcomm", "run", "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--steps", str(a.steps), "--batch", str(a.batch), "--lr", str(lr), "--momentum", str(a.momentum), "--seed", str(a.seed),
           "--compressors", ",".join(a.compressors)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.setdefault("HCOMM_TIMEOUT", "120")
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=a.timeout)
    results = []
    for line in p.stdout.splitlines():
        i = line.find(TAG)
        if i >= 0:
            results.append(json.loads(line[i + len(TAG):]))
    if p.returncode != 0 or len(results) != len(configs(a.compressors)):
        sys.stderr.write(p.stdout)
        raise SystemExit(f"convergence: the {n}-rank job failed (exit {p.returncode}, {len(results)} results)")
    print(f"# {n} ranks, lr {lr}: {len(results)} runs in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return results


def loss_text(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 1000 else f"{x:.1e}"


def table(a, results, lr) -> str:
    by = {(r["compressor"], r["error_feedback"], r["ranks"]): r for r in results if r["lr"] == lr}
    ranks = a.ranks
    head = ["compressor", "error feedback"]
    for n in ranks:
        head += [f"test acc ({n} ranks)", f"vs none", f"test loss", f"train loss", f"acc at {a.steps // 4} / {a.steps // 2} steps", "sent KiB/step/rank"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for comp, ef in configs(a.compressors):
        row = [by[(comp, ef, ranks[0])]["canonical"], "-" if comp == "none" else ("on" if ef else "off")]
        for n in ranks:
            r, base = by[(comp, ef, n)], by[("none", False, n)]
            d = (r["test_acc"] - base["test_acc"]) * 100
            curve = r["curve"]
            early = " / ".join(f"{100 * curve.get(str(s), curve.get(s, float('nan'))):.1f}" for s in (a.steps // 4, a.steps // 2))
            if r.get("diverged_at"):
                row += [f"diverged at step {r['diverged_at']}", "-", "-", "-", early, f"{r['sent_bytes_per_step'] / 1024:.1f}"]
                continue
            row += [f"{100 * r['test_acc']:.1f}%", "-" if comp == "none" else f"{d:+.1f} pt", loss_text(r["test_loss"]),
                    loss_text(r["train_loss"]), early, f"{r['sent_bytes_per_step'] / 1024:.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    t0 = time.time()
    results = []
    for lr in a.lrs:
        for n in a.ranks:
            results += run_world(a, n, lr)
    if a.json:
        with open(a.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    cmd = "python3 scripts/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    r0 = results[0]
    text = f"""# Convergence with gradient compression

Written by `{cmd.strip()}` on {when} ({time.time() - t0:.0f} s; {platform.node()}, {os.cpu_count()} CPUs).
What it measures and how: `scripts/convergence.py` (docstring). The discussion is in
[compression.md](compression.md#convergence).

Data: scikit-learn's bundled `load_digits` (1,797 8x8 images, 10 classes), 75% / 25% stratified
train / test split (1,347 / 450 images, `random_state=0`). Model: MLP 64-256-128-10 (ReLU),
{r0['params']:,} parameters. {a.steps} steps of SGD (momentum {a.momentum}; one table per learning rate), global batch
{a.batch} split evenly over the ranks, the same initial weights (seed {a.seed}) and the same batch
order in every run. Gradients averaged by hcomm's fusion (one bucket per step), compressed with
the compressor shown, with or without error feedback. *test acc*: on the 450 held-out images
after the last step; *vs none*: difference to the uncompressed run with the same rank count,
in percentage points; *test loss*, *train loss*: cross-entropy on the whole split; *acc at*:
test accuracy part-way; *diverged*: the parameters stopped being finite (the run stops); *sent*: bytes this rank sent per step, measured by hcomm's counters
(shared memory: bytes written into the segment). Every run ended with identical parameters on
every rank: {'yes' if all(r['replicas_identical'] for r in results) else 'NO'}.
""" + "".join(f"""
## Learning rate {lr}

{table(a, results, lr)}
""" for lr in a.lrs)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"# wrote {out}", file=sys.stderr)
    return 0 if all(r["replicas_identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
