//! `hcomm bench OP`: nccl-tests style benchmark with an optional correctness check.
//!
//! Timing as nccl-tests (and `../shared/bench`): warm-up, barrier, `iters` back-to-back calls on
//! the same buffers, mean time per call on each rank, max over ranks. `algbw = bytes / time`,
//! `busbw = algbw × factor` with nccl-tests' factors (all-reduce `2(n-1)/n`; all-gather,
//! reduce-scatter, all-to-all, gather, scatter `(n-1)/n`; broadcast, reduce, send/recv 1).

use hcomm::testing::{count_wrong, input, reference};
use hcomm::{Algo, Collective, Communicator, DType, ReduceOp, Result};
use serde::Serialize;
use std::time::Instant;

/// What `hcomm bench` can measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchOp {
    /// A collective.
    Coll(Collective),
    /// Ping-pong between ranks 0 and 1 (time = half the round trip).
    SendRecv,
}

impl BenchOp {
    /// Parse `allreduce`, `all_reduce`, `sendrecv`, `pingpong`, …
    pub fn parse(s: &str) -> Option<BenchOp> {
        let k = s.to_ascii_lowercase().replace(['_', '-'], "");
        if k == "sendrecv" || k == "pingpong" {
            return Some(BenchOp::SendRecv);
        }
        Collective::parse(&k).map(BenchOp::Coll)
    }

    /// nccl-tests style name.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::SendRecv => "sendrecv",
            BenchOp::Coll(c) => match c {
                Collective::AllReduce => "allreduce",
                Collective::AllGather => "allgather",
                Collective::ReduceScatter => "reducescatter",
                Collective::Broadcast => "broadcast",
                Collective::Reduce => "reduce",
                Collective::Gather => "gather",
                Collective::Scatter => "scatter",
                Collective::AllToAll => "alltoall",
                Collective::Barrier => "barrier",
            },
        }
    }

    /// Operations whose size is `ranks × block` (the nccl-tests convention) and whose busbw
    /// factor is `(n-1)/n`.
    fn blocked(self) -> bool {
        matches!(
            self,
            BenchOp::Coll(
                Collective::AllGather
                    | Collective::ReduceScatter
                    | Collective::AllToAll
                    | Collective::Gather
                    | Collective::Scatter
            )
        )
    }

    /// nccl-tests bus-bandwidth factor for `n` ranks.
    pub fn busbw_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::Coll(Collective::AllReduce) => 2.0 * (n - 1.0) / n,
            op if op.blocked() => (n - 1.0) / n,
            BenchOp::Coll(Collective::Barrier) => 0.0,
            // Broadcast, reduce, send/recv.
            _ => 1.0,
        }
    }

    fn reduces(self) -> bool {
        matches!(
            self,
            BenchOp::Coll(Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce)
        )
    }

    fn rooted(self) -> bool {
        matches!(
            self,
            BenchOp::Coll(
                Collective::Broadcast
                    | Collective::Reduce
                    | Collective::Gather
                    | Collective::Scatter
            )
        )
    }
}

/// Settings of one benchmark run.
#[derive(Clone, Debug)]
pub struct BenchOpts {
    /// Operation.
    pub op: BenchOp,
    /// Smallest size in bytes.
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Size step factor.
    pub factor: usize,
    /// Warm-up calls per size.
    pub warmup: usize,
    /// Timed calls per size.
    pub iters: usize,
    /// Check the result against the CPU reference.
    pub check: bool,
    /// Element type.
    pub dtype: DType,
    /// Reduction.
    pub redop: ReduceOp,
    /// Root of rooted operations.
    pub root: usize,
    /// Algorithm to force.
    pub algo: Algo,
    /// When > 0: choose the iterations per repeat so that one repeat takes about this many
    /// seconds (the loop of `../shared/bench`), instead of `iters`.
    pub target_secs: f64,
    /// Timed repeats per size; the row reports the median (and the fastest).
    pub reps: usize,
    /// All-reduce only: the buffers live in a shared window (`alloc_window`) and the zero-copy
    /// `all_reduce_window` runs on them.
    pub window: bool,
    /// Busy processes the driver runs beside the ranks (`--noise N`; reported in the header).
    pub noise: usize,
}

impl BenchOpts {
    /// Defaults as nccl-tests: 5 warm-up and 20 timed calls, one repeat, checked.
    pub fn new(op: BenchOp) -> BenchOpts {
        BenchOpts {
            op,
            min_bytes: 8,
            max_bytes: 64 << 20,
            factor: 2,
            warmup: 5,
            iters: 20,
            check: true,
            dtype: DType::F32,
            redop: ReduceOp::Sum,
            root: 0,
            algo: Algo::Auto,
            target_secs: 0.0,
            reps: 1,
            window: false,
            noise: 0,
        }
    }
}

/// One result row.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Operation name.
    pub op: String,
    /// Number of ranks.
    pub ranks: usize,
    /// Size in bytes (nccl-tests convention: the largest buffer of the call).
    pub bytes: usize,
    /// Elements in that buffer.
    pub count: usize,
    /// Element type.
    pub dtype: String,
    /// Reduction, or "none".
    pub redop: String,
    /// Root, or -1.
    pub root: i64,
    /// Algorithm the selector used.
    pub algo: String,
    /// Transport.
    pub transport: String,
    /// Mean time per call, max over ranks, in microseconds (median over repeats).
    pub time_us: f64,
    /// The fastest repeat's time per call.
    pub time_us_min: f64,
    /// The slowest repeat's time per call.
    pub time_us_max: f64,
    /// Calls per repeat.
    pub iters: usize,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements (summed over ranks), or -1 when not checked.
    pub wrong: i64,
    /// Steal time while this size ran: the share of all CPUs' time the hypervisor gave to
    /// others (`/proc/stat`, seen by rank 0), in percent; absent where it cannot be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steal_pct: Option<f64>,
    /// Busy processes that ran beside the ranks (`--noise`).
    pub noise: usize,
    /// The cross-core turn before and after the run, in µs ([`crate::cross_core`], seen by
    /// rank 0): runs whose turns differ past [`crate::cross_core::SAME_STATE`] ran in
    /// different states of the machine and are not compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cross_core_us: Option<[f64; 2]>,
}

/// The CPU time counters of `/proc/stat` (all CPUs): (steal, total), in clock ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTimes {
    /// Time stolen by the hypervisor.
    pub steal: u64,
    /// Every kind of time (user, nice, system, idle, iowait, irq, softirq, steal).
    pub total: u64,
}

impl CpuTimes {
    /// Now, from `/proc/stat` (None where there is none).
    pub fn now() -> Option<CpuTimes> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The first (`cpu `) line of a `/proc/stat` text.
    pub fn parse(stat: &str) -> Option<CpuTimes> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        (v.len() == 8).then(|| CpuTimes {
            steal: v[7],
            total: v.iter().sum(),
        })
    }

    /// Steal between `self` and the later `then`, in percent of all CPU time (None without
    /// any time passing).
    pub fn steal_pct_until(self, then: CpuTimes) -> Option<f64> {
        let total = then.total.checked_sub(self.total)?;
        let steal = then.steal.checked_sub(self.steal)?;
        (total > 0).then(|| 100.0 * steal as f64 / total as f64)
    }
}

/// Sizes from `min` to `max` multiplying by `factor`.
pub fn sizes(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min;
    loop {
        v.push(s);
        if s >= max || factor < 2 {
            break;
        }
        s = (s * factor).min(max);
    }
    v
}

/// Buffers for one size: (input, output) per the operation's shapes.
struct Bufs {
    send: Vec<u8>,
    recv: Vec<u8>,
    block: usize,
    /// Elements per rank of the v-collectives (`block` for every rank), made once per size
    /// so that the timed loop allocates nothing of its own.
    counts: Vec<usize>,
}

fn make_bufs(
    op: BenchOp,
    comm: &Communicator,
    bytes: usize,
    dtype: DType,
    redop: ReduceOp,
    root: usize,
) -> Bufs {
    let n = comm.world_size();
    let me = comm.rank();
    let es = dtype.size();
    let count = bytes / es;
    let block = count / n;
    let (send_elems, recv_elems) = match op {
        BenchOp::Coll(Collective::AllReduce | Collective::Broadcast) | BenchOp::SendRecv => {
            (count, count)
        }
        BenchOp::Coll(Collective::Reduce) => (count, if me == root { count } else { 0 }),
        BenchOp::Coll(Collective::AllGather) => (block, block * n),
        BenchOp::Coll(Collective::ReduceScatter) => (block * n, block),
        BenchOp::Coll(Collective::Gather) => (block, if me == root { block * n } else { 0 }),
        BenchOp::Coll(Collective::Scatter) => (if me == root { block * n } else { 0 }, block),
        BenchOp::Coll(Collective::AllToAll) => (block * n, block * n),
        BenchOp::Coll(Collective::Barrier) => (0, 0),
    };
    let send = match op {
        BenchOp::Coll(Collective::Broadcast) if me == root => {
            input(dtype, redop, root, send_elems, 7)
        }
        BenchOp::Coll(Collective::Broadcast) => vec![0u8; send_elems * es],
        BenchOp::Coll(Collective::Scatter) => input(dtype, redop, root, send_elems, 7),
        _ => input(dtype, redop, me, send_elems, 7),
    };
    Bufs {
        send,
        recv: vec![0u8; recv_elems * es],
        block,
        counts: vec![block; n],
    }
}

fn call(
    op: BenchOp,
    comm: &Communicator,
    b: &mut Bufs,
    dtype: DType,
    redop: ReduceOp,
    root: usize,
) -> Result<()> {
    let counts = &b.counts;
    match op {
        BenchOp::Coll(c) => match c {
            Collective::AllReduce => {
                comm.all_reduce_bytes(Some(&b.send), &mut b.recv, dtype, redop)
            }
            Collective::AllGather => {
                comm.all_gather_v_bytes(Some(&b.send), &mut b.recv, counts, dtype)
            }
            Collective::ReduceScatter => {
                comm.reduce_scatter_v_bytes(Some(&b.send), &mut b.recv, counts, dtype, redop)
            }
            Collective::Broadcast => comm.broadcast_bytes(&mut b.send, dtype, root),
            Collective::Reduce => comm.reduce_bytes(Some(&b.send), &mut b.recv, dtype, redop, root),
            Collective::Gather => comm.gather_v_bytes(&b.send, &mut b.recv, counts, dtype, root),
            Collective::Scatter => comm.scatter_v_bytes(&b.send, &mut b.recv, counts, dtype, root),
            Collective::AllToAll => {
                comm.all_to_all_v_bytes(&b.send, counts, &mut b.recv, counts, dtype)
            }
            Collective::Barrier => comm.barrier(),
        },
        BenchOp::SendRecv => match comm.rank() {
            0 => {
                comm.send_bytes(1, 0, &b.send)?;
                comm.recv_bytes(1, 0, &mut b.recv)
            }
            1 => {
                comm.recv_bytes(0, 0, &mut b.recv)?;
                comm.send_bytes(0, 0, &b.recv)
            }
            _ => Ok(()),
        },
    }
}

/// Wrong elements on this rank after one call (the result buffer against the reference).
fn check_once(op: BenchOp, comm: &Communicator, b: &mut Bufs, o: &BenchOpts) -> Result<usize> {
    let n = comm.world_size();
    let me = comm.rank();
    let (dt, rop, root) = (o.dtype, o.redop, o.root);
    call(op, comm, b, dt, rop, root)?;
    let es = dt.size();
    let blk = b.block;
    let seed = 7;
    Ok(match op {
        BenchOp::Coll(Collective::AllReduce) => {
            count_wrong(dt, &b.recv, &reference(dt, rop, n, b.recv.len() / es, seed))
        }
        BenchOp::Coll(Collective::Reduce) if me == root => {
            count_wrong(dt, &b.recv, &reference(dt, rop, n, b.recv.len() / es, seed))
        }
        BenchOp::Coll(Collective::ReduceScatter) => {
            let full = reference(dt, rop, n, blk * n, seed);
            count_wrong(dt, &b.recv, &full[me * blk * es..(me + 1) * blk * es])
        }
        BenchOp::Coll(Collective::AllGather) => {
            let want: Vec<u8> = (0..n).flat_map(|r| input(dt, rop, r, blk, seed)).collect();
            count_wrong(dt, &b.recv, &want)
        }
        BenchOp::Coll(Collective::Gather) if me == root => {
            let want: Vec<u8> = (0..n).flat_map(|r| input(dt, rop, r, blk, seed)).collect();
            count_wrong(dt, &b.recv, &want)
        }
        BenchOp::Coll(Collective::Broadcast) => {
            count_wrong(dt, &b.send, &input(dt, rop, root, b.send.len() / es, seed))
        }
        BenchOp::Coll(Collective::Scatter) => {
            let all = input(dt, rop, root, blk * n, seed);
            count_wrong(dt, &b.recv, &all[me * blk * es..(me + 1) * blk * es])
        }
        BenchOp::Coll(Collective::AllToAll) => {
            let want: Vec<u8> = (0..n)
                .flat_map(|p| {
                    input(dt, rop, p, blk * n, seed)[me * blk * es..(me + 1) * blk * es].to_vec()
                })
                .collect();
            count_wrong(dt, &b.recv, &want)
        }
        BenchOp::SendRecv if me == 0 => count_wrong(dt, &b.recv, &b.send),
        _ => 0,
    })
}

/// Median and fastest time per call (max over ranks) and the calls per repeat: warm-up, then
/// `o.reps` repeats of back-to-back calls, each bracketed by a barrier (the nccl-tests loop).
/// With `o.target_secs`, the calls per repeat are calibrated so that a repeat takes about
/// that long; every rank agrees on the slowest estimate so that all run the same calls.
fn time_calls(
    comm: &Communicator,
    o: &BenchOpts,
    call: &mut dyn FnMut() -> Result<()>,
) -> Result<Timing> {
    for _ in 0..o.warmup {
        call()?;
    }
    let mut timed = |iters: usize| -> Result<f64> {
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            call()?;
        }
        let mut per = [t0.elapsed().as_secs_f64() / iters as f64];
        comm.all_reduce_in_place(&mut per, ReduceOp::Max)?;
        Ok(per[0])
    };
    let iters = if o.target_secs > 0.0 {
        ((o.target_secs / timed(1)?.max(1e-7)) as usize).clamp(1, 1_000_000)
    } else {
        o.iters.max(1)
    };
    let mut times = (0..o.reps.max(1))
        .map(|_| timed(iters))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    Ok(Timing {
        median: times[times.len() / 2],
        fastest: times[0],
        slowest: times[times.len() - 1],
        iters,
    })
}

/// Seconds per call of one size: the median, fastest and slowest of the timed repeats.
struct Timing {
    median: f64,
    fastest: f64,
    slowest: f64,
    iters: usize,
}

/// The zero-copy window all-reduce: the data live in a shared window; timed like `run_size`.
fn run_window_size(comm: &Communicator, o: &BenchOpts, bytes: usize) -> Result<Row> {
    let n = comm.world_size();
    let es = o.dtype.size();
    let bytes = bytes / es * es;
    let win = comm.alloc_window(bytes)?;
    let fill = || {
        win.local()
            .write(0, &input(o.dtype, o.redop, comm.rank(), bytes / es, 7))
    };
    fill()?;
    comm.all_reduce_window(&win, bytes, o.dtype, o.redop)?;
    let mut got = vec![0u8; bytes];
    win.local().read(0, &mut got)?;
    let mut wrong = [count_wrong(
        o.dtype,
        &got,
        &reference(o.dtype, o.redop, n, bytes / es, 7),
    ) as u64];
    comm.all_reduce_in_place(&mut wrong, ReduceOp::Sum)?;
    fill()?;
    let timing = time_calls(comm, o, &mut || {
        comm.all_reduce_window(&win, bytes, o.dtype, o.redop)
    })?;
    let per_call = timing.median;
    let algbw = if per_call > 0.0 {
        bytes as f64 / per_call / 1e9
    } else {
        0.0
    };
    Ok(Row {
        op: "allreduce".into(),
        ranks: n,
        bytes,
        count: bytes / es,
        dtype: o.dtype.to_string(),
        redop: o.redop.to_string(),
        root: -1,
        algo: "shm-window".into(),
        transport: "shm".into(),
        time_us: per_call * 1e6,
        time_us_min: timing.fastest * 1e6,
        time_us_max: timing.slowest * 1e6,
        iters: timing.iters,
        algbw,
        busbw: algbw * BenchOp::Coll(Collective::AllReduce).busbw_factor(n),
        wrong: if o.check { wrong[0] as i64 } else { -1 },
        steal_pct: None,
        cross_core_us: None,
        noise: o.noise,
    })
}

/// Measure one size. Every rank must call it with the same arguments.
pub fn run_size(comm: &Communicator, o: &BenchOpts, bytes: usize) -> Result<Row> {
    if o.window && o.op == BenchOp::Coll(Collective::AllReduce) {
        return run_window_size(comm, o, bytes);
    }
    let n = comm.world_size();
    let op = o.op;
    // `--algo auto` leaves HCOMM_ALGO (or an earlier set_algorithm) in force.
    if let (BenchOp::Coll(c), false) = (op, o.algo == Algo::Auto) {
        comm.set_algorithm(c, o.algo)?;
    }
    let root = if op.rooted() { o.root } else { 0 };
    let mut b = make_bufs(op, comm, bytes, o.dtype, o.redop, root);
    let wrong = if o.check {
        let w = check_once(op, comm, &mut b, o)? as u64;
        let mut total = [w];
        comm.all_reduce_in_place(&mut total, ReduceOp::Sum)?;
        b = make_bufs(op, comm, bytes, o.dtype, o.redop, root);
        total[0] as i64
    } else {
        -1
    };
    let timing = time_calls(comm, o, &mut || {
        call(op, comm, &mut b, o.dtype, o.redop, root)
    })?;
    // Ping-pong: one call is a round trip; report one way.
    let one_way = if op == BenchOp::SendRecv { 2.0 } else { 1.0 };
    let (per_call, fastest, slowest) = (
        timing.median / one_way,
        timing.fastest / one_way,
        timing.slowest / one_way,
    );
    let es = o.dtype.size();
    let shown = match op {
        op if op.blocked() => b.block * n * es,
        BenchOp::Coll(Collective::Barrier) => 0,
        _ => bytes / es * es,
    };
    let algbw = if per_call > 0.0 {
        shown as f64 / per_call / 1e9
    } else {
        0.0
    };
    let algo = match op {
        BenchOp::Coll(c) => comm.algorithm_for_dtype(c, shown, o.dtype).to_string(),
        BenchOp::SendRecv => "p2p".into(),
    };
    let transport = match op {
        // Ranks 0 and 1 ping-pong: over shared-memory rings when they share a host.
        BenchOp::SendRecv
            if comm.world_size() > 1
                && comm.p2p_over_shared_memory(if comm.rank() == 0 { 1 } else { 0 }) =>
        {
            "shm"
        }
        _ if algo == "shm" => "shm",
        _ => "tcp",
    };
    Ok(Row {
        op: op.name().into(),
        ranks: n,
        bytes: shown,
        count: shown / es,
        dtype: o.dtype.to_string(),
        redop: if op.reduces() {
            o.redop.to_string()
        } else {
            "none".into()
        },
        root: if op.rooted() { root as i64 } else { -1 },
        algo,
        transport: transport.into(),
        time_us: per_call * 1e6,
        time_us_min: fastest * 1e6,
        time_us_max: slowest * 1e6,
        iters: timing.iters,
        algbw,
        busbw: algbw * op.busbw_factor(n),
        wrong,
        steal_pct: None,
        cross_core_us: None,
        noise: o.noise,
    })
}

/// The header's line on the machine's conditions: the noise asked for, and the steal time of
/// the last 200 ms before the run (from `/proc/stat`).
pub fn conditions_line(noise: usize) -> String {
    let before = CpuTimes::now();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let steal = before
        .zip(CpuTimes::now())
        .and_then(|(b, a)| b.steal_pct_until(a));
    format!(
        "# conditions: {} busy process(es) beside the ranks (--noise), {} cores, steal {} just before the run",
        noise,
        online_cpus(),
        steal.map_or("unknown".to_string(), |s| format!("{s:.1}%"))
    )
}

/// The machine's online CPUs. Not `available_parallelism`: the launcher binds each rank to
/// its own CPUs, so a rank's affinity mask says 1 on a machine of 2.
fn online_cpus() -> usize {
    use nix::unistd::{sysconf, SysconfVar};
    match sysconf(SysconfVar::_NPROCESSORS_ONLN) {
        Ok(Some(n)) if n > 0 => n as usize,
        _ => std::thread::available_parallelism().map_or(0, |n| n.get()),
    }
}

/// The nccl-tests table header.
pub fn header() -> String {
    format!(
        "#{:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}  {}\n#{:>12} {:>12} {:>8} {:>6} {:>6} {:>10} {:>8} {:>8} {:>6}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "algo",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    )
}

/// One table line.
pub fn format_row(r: &Row) -> String {
    let wrong = if r.wrong < 0 {
        "N/A".to_string()
    } else {
        r.wrong.to_string()
    };
    format!(
        " {:>12} {:>12} {:>8} {:>6} {:>6} {:>10.2} {:>8.2} {:>8.2} {:>6}  {}",
        r.bytes, r.count, r.dtype, r.redop, r.root, r.time_us, r.algbw, r.busbw, wrong, r.algo
    )
}

/// Where a sweep's results go besides the table.
#[derive(Clone, Debug, Default)]
pub struct Output {
    /// One JSON object per row on stdout instead of the table.
    pub json: bool,
    /// Write an SVG plot of busbw and time against size here.
    pub plot: Option<std::path::PathBuf>,
    /// Append the rows (with a timestamp) to this JSON-lines file, and compare each row with
    /// the last run of the same configuration found there.
    pub results: Option<std::path::PathBuf>,
}

impl Output {
    /// Refuse output paths whose folder does not exist, before any measuring.
    pub fn check_paths(&self) -> Result<(), String> {
        for (flag, path) in [("--plot", &self.plot), ("--results", &self.results)] {
            let Some(path) = path else { continue };
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => std::path::Path::new("."),
            };
            if !dir.is_dir() {
                return Err(format!(
                    "{flag} {}: the folder {} does not exist",
                    path.display(),
                    dir.display()
                ));
            }
        }
        Ok(())
    }
}

/// What [`run`] measured: wrong elements (summed over ranks, 0 when not checked), and whether
/// an output file could not be written (reported on stderr as it happened).
pub struct Outcome {
    /// Wrong elements summed over sizes and ranks.
    pub wrong: i64,
    /// A `--plot` or `--results` file could not be written.
    pub output_failed: bool,
}

/// Key of a configuration in the results history: runs compare only with runs of the same
/// operation, shape, algorithm, transport and noise.
fn history_key(r: &serde_json::Value) -> String {
    [
        "op",
        "ranks",
        "bytes",
        "dtype",
        "redop",
        "root",
        "transport",
        "algo",
    ]
    .iter()
    .map(|k| r.get(*k).map(|v| v.to_string()).unwrap_or_default())
    .chain(std::iter::once(
        // Rows written before `noise` was recorded ran without it.
        r.get("noise")
            .and_then(|v| v.as_u64())
            .unwrap_or(0)
            .to_string(),
    ))
    .collect::<Vec<_>>()
    .join("|")
}

/// The times per call of one size in one run, in microseconds: the median, fastest and
/// slowest of its repeats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// Median repeat.
    pub median: f64,
    /// Fastest repeat.
    pub fastest: f64,
    /// Slowest repeat.
    pub slowest: f64,
}

impl Spread {
    /// The spread a results-file row records (`time_us`, `time_us_min`, `time_us_max`); rows
    /// written before the slowest repeat was recorded count their median as the slowest.
    fn of_record(v: &serde_json::Value) -> Option<Spread> {
        let median = v.get("time_us")?.as_f64()?;
        let fastest = v
            .get("time_us_min")
            .and_then(|x| x.as_f64())
            .unwrap_or(median);
        let slowest = v
            .get("time_us_max")
            .and_then(|x| x.as_f64())
            .unwrap_or(median);
        (median > 0.0).then_some(Spread {
            median,
            fastest,
            slowest,
        })
    }
}

/// Earlier runs a comparison looks at, at most.
pub const HISTORY_RUNS: usize = 5;

/// How a run compares with the earlier runs of the same configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every repeat now beats the fastest earlier run's median, and the median by over 5 %.
    Faster,
    /// Every repeat now is slower than the slowest earlier run's median, and the median by
    /// over 5 %.
    Slower,
    /// Inside the earlier runs' range, or within 5 % of it.
    AboutTheSame,
}

impl Verdict {
    /// Compare `now` with the `earlier` runs (the last [`HISTORY_RUNS`]). On a shared VM the
    /// figure moves more between runs (where the scheduler puts the ranks) than between the
    /// repeats of one run, so the band to leave is the range of the earlier runs' medians, and
    /// all of this run's repeats must leave it: a lone slow repeat, or one run against one
    /// other, reads as noise more often than not. With no earlier run there is no verdict.
    pub fn of(earlier: &[Spread], now: Spread) -> Option<Verdict> {
        let lo = earlier.iter().map(|s| s.median).reduce(f64::min)?;
        let hi = earlier.iter().map(|s| s.median).reduce(f64::max)?;
        Some(if now.median * 1.05 < lo && now.slowest < lo {
            Verdict::Faster
        } else if now.median > hi * 1.05 && now.fastest > hi {
            Verdict::Slower
        } else {
            Verdict::AboutTheSame
        })
    }

    /// The word the comparison line prints.
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Faster => "faster",
            Verdict::Slower => "slower",
            Verdict::AboutTheSame => "about the same",
        }
    }
}

/// Which earlier runs of a configuration a run compares with ([`same_state_runs`]).
#[derive(Debug, PartialEq)]
enum SameState {
    /// These (all of them where either side has no cross-core turn recorded).
    Runs(Vec<serde_json::Value>),
    /// None: the run's own turns before and after (µs) say the state changed meanwhile.
    ChangedDuringRun([f64; 2]),
    /// None: every earlier run's turns (the last one's `then`) differ from this one's (`now`).
    NoneOf {
        /// This run's turn before it, µs.
        now: f64,
        /// The last earlier run's, µs.
        then: f64,
    },
}

/// The earlier runs (`all`) made in the same state of the machine as `now`: both the turns
/// before and after within [`crate::cross_core::SAME_STATE`] of each other's.
fn same_state_runs(now: &serde_json::Value, all: &[serde_json::Value]) -> SameState {
    let turn = |v: &serde_json::Value| -> Option<[f64; 2]> {
        let t = v.get("cross_core_us")?.as_array()?;
        Some([t.first()?.as_f64()?, t.get(1)?.as_f64()?])
    };
    let same = crate::cross_core::same_state;
    let Some([b, a]) = turn(now) else {
        return SameState::Runs(all.to_vec());
    };
    if all.is_empty() {
        return SameState::Runs(Vec::new());
    }
    if !same(b, a) {
        return SameState::ChangedDuringRun([b, a]);
    }
    let runs: Vec<serde_json::Value> = all
        .iter()
        .filter(|e| turn(e).is_none_or(|[eb, ea]| same(b, eb) && same(a, ea)))
        .cloned()
        .collect();
    if runs.is_empty() {
        let then = turn(all.last().expect("not empty")).map_or(0.0, |t| t[0]);
        return SameState::NoneOf { now: b, then };
    }
    SameState::Runs(runs)
}

/// Compare `rows` with the earlier rows of the same configuration in `path` (the last
/// [`HISTORY_RUNS`] of each), print the comparison, then append `rows`.
fn record_history(path: &std::path::Path, rows: &[Row]) -> std::io::Result<()> {
    use std::io::Write;
    let mut earlier: std::collections::HashMap<String, Vec<serde_json::Value>> =
        std::collections::HashMap::new();
    if let Ok(text) = std::fs::read_to_string(path) {
        for line in text.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                let runs = earlier.entry(history_key(&v)).or_default();
                runs.push(v);
                if runs.len() > HISTORY_RUNS {
                    runs.remove(0);
                }
            }
        }
    }
    let when = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    for r in rows {
        let mut v = serde_json::to_value(r).expect("row serialises");
        v["unix_time"] = when.into();
        v["host"] = host.clone().into();
        let all_runs = earlier.get(&history_key(&v)).map_or(&[][..], |r| &r[..]);
        let label = format!(
            "# {} {} ranks {} {} B noise {}",
            r.op, r.ranks, r.transport, r.bytes, r.noise
        );
        let runs = match same_state_runs(&v, all_runs) {
            SameState::Runs(runs) => runs,
            SameState::ChangedDuringRun([b, a]) => {
                println!(
                    "{label}: no verdict: the machine changed state during the run (cross-core turn {b:.1} µs before, {a:.1} after)"
                );
                writeln!(file, "{v}")?;
                continue;
            }
            SameState::NoneOf { now, then } => {
                println!(
                    "{label}: no verdict: the last {} run(s) ran in another state of the machine (cross-core turn {now:.1} µs now, {then:.1} the last time)",
                    all_runs.len()
                );
                writeln!(file, "{v}")?;
                continue;
            }
        };
        let left_out = all_runs.len() - runs.len();
        let spreads: Vec<Spread> = runs.iter().filter_map(Spread::of_record).collect();
        if let (Some(now), Some(last)) = (Spread::of_record(&v), runs.last()) {
            if let Some(verdict) = Verdict::of(&spreads, now) {
                let lo = spreads.iter().map(|s| s.median).fold(f64::MAX, f64::min);
                let hi = spreads.iter().map(|s| s.median).fold(0.0, f64::max);
                println!(
                    "{label}: {:.2} us now (repeats {:.2}-{:.2}); last time {:.2} us ({} s ago on {}), the last {} run(s) {:.2}-{:.2} us: {} ({:.2}x the last){}",
                    now.median,
                    now.fastest,
                    now.slowest,
                    last["time_us"].as_f64().unwrap_or(0.0),
                    when.saturating_sub(last["unix_time"].as_u64().unwrap_or(when)),
                    last["host"].as_str().unwrap_or("?"),
                    spreads.len(),
                    lo,
                    hi,
                    verdict.word(),
                    last["time_us"].as_f64().unwrap_or(0.0) / now.median,
                    if left_out > 0 {
                        format!("; {left_out} earlier run(s) in another state of the machine left out")
                    } else {
                        String::new()
                    },
                );
            }
        }
        writeln!(file, "{v}")?;
    }
    Ok(())
}

/// Run the whole sweep on this rank; rank 0 prints. Returns the number of wrong elements.
/// A header line saying which sizes an operation of `ranks × block` bytes
/// ([`BenchOp::blocked`]) rounds down (to a multiple of `n` elements), so that a row of fewer
/// bytes than asked for, or of none, is not a surprise; `None` when no size is rounded.
fn rounding_note(op: BenchOp, n: usize, dtype: DType, sizes: &[usize]) -> Option<String> {
    let unit = n * dtype.size();
    if !op.blocked() || unit == 0 {
        return None;
    }
    let rounded: Vec<String> = sizes
        .iter()
        .filter(|&&b| b % unit != 0)
        .map(|&b| format!("{b} -> {}", b / unit * unit))
        .collect();
    if rounded.is_empty() {
        return None;
    }
    let shown = rounded.len().min(4);
    let more = if rounded.len() > shown { ", ..." } else { "" };
    Some(format!(
        "# {} moves {n} equal blocks: sizes are rounded down to a multiple of {n} ranks x {} B ({dtype}) = {unit} B: {}{more}",
        op.name(),
        dtype.size(),
        rounded[..shown].join(", ")
    ))
}

pub fn run(comm: &Communicator, o: &BenchOpts, out: &Output) -> Result<Outcome> {
    use std::io::IsTerminal;
    let me = comm.rank();
    let json = out.json;
    if me == 0 && !json {
        let iters = if o.target_secs > 0.0 {
            format!("~{} s per repeat", o.target_secs)
        } else {
            o.iters.to_string()
        };
        println!(
            "# hcomm bench {}: {} ranks, dtype {}, op {}, root {}, warm-up {}, iters {iters}, repeats {}, check {}",
            o.op.name(),
            comm.world_size(),
            o.dtype,
            o.redop,
            // as the rows: -1 for an operation without a root (nccl-tests' convention)
            if o.op.rooted() { o.root as i64 } else { -1 },
            o.warmup,
            o.reps.max(1),
            o.check
        );
        println!("{}", conditions_line(o.noise));
    }
    let run_start = (me == 0).then(CpuTimes::now).flatten();
    // The cross-core turn before the run (and after it, below): what state the machine was in.
    let turn_before = (me == 0).then(crate::cross_core::turn_time).flatten();
    let all_sizes = sizes(o.min_bytes, o.max_bytes, o.factor);
    if me == 0 && !json {
        println!("{}", crate::cross_core::line(turn_before, "before the run"));
        if let Some(note) = rounding_note(o.op, comm.world_size(), o.dtype, &all_sizes) {
            println!("{note}");
        }
        println!("{}", header());
    }
    let progress = me == 0 && std::io::stderr().is_terminal() && all_sizes.len() > 1;
    let mut rows = Vec::new();
    for (i, &bytes) in all_sizes.iter().enumerate() {
        if progress {
            eprint!(
                "\r[bench] {}/{} sizes, now {bytes} B   ",
                i + 1,
                all_sizes.len()
            );
        }
        let before = (me == 0).then(CpuTimes::now).flatten();
        let mut row = run_size(comm, o, bytes)?;
        if let (Some(b), Some(a)) = (before, CpuTimes::now().filter(|_| me == 0)) {
            row.steal_pct = b.steal_pct_until(a);
        }
        if me == 0 {
            if json {
                println!("{}", serde_json::to_string(&row).expect("row serialises"));
            } else {
                if progress {
                    eprint!("\r\x1b[K");
                }
                println!("{}", format_row(&row));
            }
        }
        rows.push(row);
    }
    if progress {
        eprint!("\r\x1b[K");
    }
    let turn_after = (me == 0).then(crate::cross_core::turn_time).flatten();
    if let (Some(b), Some(a)) = (turn_before, turn_after) {
        let us = [b.as_secs_f64() * 1e6, a.as_secs_f64() * 1e6];
        for r in &mut rows {
            r.cross_core_us = Some(us);
        }
    }
    let wrong: i64 = rows.iter().map(|r| r.wrong.max(0)).sum();
    let mut output_failed = false;
    if me == 0 {
        if !json {
            println!(
                "# Out of bounds values : {wrong} {}",
                if wrong == 0 { "OK" } else { "FAILED" }
            );
            println!(
                "# Avg bus bandwidth    : {:.4}",
                rows.iter().map(|r| r.busbw).sum::<f64>() / rows.len().max(1) as f64
            );
            let whole = run_start
                .zip(CpuTimes::now())
                .and_then(|(b, a)| b.steal_pct_until(a));
            let worst = rows
                .iter()
                .filter_map(|r| r.steal_pct)
                .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
            if let (Some(whole), Some(worst)) = (whole, worst) {
                println!(
                    "# Steal time           : {whole:.1}% of CPU time during the run, {worst:.1}% in the worst size (/proc/stat){}",
                    if whole >= 5.0 { ": a noisy machine, compare with care" } else { "" }
                );
            }
            println!("{}", crate::cross_core::line(turn_after, "after the run"));
        }
        if let Some(path) = &out.plot {
            let series = vec![crate::plot::Series {
                label: format!(
                    "hcomm {} {} ranks {} {}",
                    o.op.name(),
                    comm.world_size(),
                    o.dtype,
                    rows.first().map(|r| r.transport.as_str()).unwrap_or("")
                ),
                points: rows
                    .iter()
                    .map(|r| (r.bytes as f64, r.busbw, r.time_us))
                    .collect(),
            }];
            match crate::plot::write(path, &format!("hcomm bench {}", o.op.name()), &series) {
                Ok(()) => println!("# plot written to {}", path.display()),
                Err(e) => {
                    crate::say!("hcomm bench: cannot write the plot {}: {e}", path.display());
                    output_failed = true;
                }
            }
        }
        if let Some(path) = &out.results {
            if let Err(e) = record_history(path, &rows) {
                crate::say!("hcomm bench: cannot update {}: {e}", path.display());
                output_failed = true;
            }
        }
    }
    // Every rank leaves only after rank 0 has written its report: a rank exiting with a
    // failure first would have the launcher stop rank 0 mid-report.
    comm.barrier()?;
    Ok(Outcome {
        wrong,
        output_failed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_in_the_same_state_of_the_machine_compare() {
        let run = |t: f64, turns: Option<[f64; 2]>| match turns {
            Some(c) => serde_json::json!({"time_us": t, "cross_core_us": c}),
            None => serde_json::json!({"time_us": t}),
        };
        let shared = Some([28.0, 30.0]);
        let apart = Some([110.0, 95.0]);
        let earlier = vec![
            run(85.0, shared),
            run(340.0, apart),
            run(90.0, None),
            run(88.0, shared),
        ];
        match same_state_runs(&run(87.0, shared), &earlier) {
            SameState::Runs(runs) => {
                let times: Vec<f64> = runs
                    .iter()
                    .map(|r| r["time_us"].as_f64().unwrap())
                    .collect();
                assert_eq!(
                    times,
                    [85.0, 90.0, 88.0],
                    "the run of the other state left out"
                );
            }
            other => panic!("{other:?}"),
        }
        match same_state_runs(&run(330.0, apart), &earlier) {
            SameState::Runs(runs) => assert_eq!(runs.len(), 2, "its own state, and the unknown"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            same_state_runs(&run(200.0, Some([30.0, 100.0])), &earlier),
            SameState::ChangedDuringRun([30.0, 100.0])
        );
        assert_eq!(
            same_state_runs(&run(330.0, apart), &[run(85.0, shared)]),
            SameState::NoneOf {
                now: 110.0,
                then: 28.0
            }
        );
        // No turn recorded now (an older binary, or one CPU): every earlier run compares.
        assert_eq!(
            same_state_runs(&run(87.0, None), &earlier),
            SameState::Runs(earlier.clone())
        );
        assert_eq!(
            same_state_runs(&run(87.0, shared), &[]),
            SameState::Runs(vec![])
        );
    }

    fn spread(median: f64, fastest: f64, slowest: f64) -> Spread {
        Spread {
            median,
            fastest,
            slowest,
        }
    }

    #[test]
    fn a_verdict_needs_every_repeat_outside_the_earlier_runs_range() {
        let earlier = [spread(10.0, 9.0, 12.0), spread(12.0, 11.0, 13.0)];
        let of = |now| Verdict::of(&earlier, now);
        assert_eq!(of(spread(5.0, 4.0, 6.0)), Some(Verdict::Faster));
        assert_eq!(of(spread(20.0, 15.0, 30.0)), Some(Verdict::Slower));
        // Twice as slow at the median, but one repeat inside the earlier range: not a
        // regression.
        assert_eq!(of(spread(20.0, 11.5, 30.0)), Some(Verdict::AboutTheSame));
        // Inside the range of the earlier runs: the same, though 10 % off the last one.
        assert_eq!(of(spread(10.8, 10.7, 10.9)), Some(Verdict::AboutTheSame));
        // Outside the range by under 5 %: the same.
        assert_eq!(of(spread(12.4, 12.3, 12.5)), Some(Verdict::AboutTheSame));
        assert_eq!(Verdict::of(&[], spread(1.0, 1.0, 1.0)), None);
    }

    #[test]
    fn old_records_without_the_slowest_repeat_or_noise_still_compare() {
        let old =
            serde_json::json!({"op": "allreduce", "ranks": 2, "time_us": 8.0, "time_us_min": 7.0});
        assert_eq!(Spread::of_record(&old), Some(spread(8.0, 7.0, 8.0)));
        let mut new = old.clone();
        new["noise"] = 0.into();
        assert_eq!(history_key(&old), history_key(&new));
        new["noise"] = 1.into();
        assert_ne!(history_key(&old), history_key(&new));
        assert_eq!(
            Spread::of_record(&serde_json::json!({"time_us": 0.0})),
            None
        );
    }

    #[test]
    fn steal_comes_from_the_cpu_line_of_proc_stat() {
        let a = CpuTimes::parse("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3 4 5 6 7 8\n").unwrap();
        assert_eq!(
            a,
            CpuTimes {
                steal: 35,
                total: 1000
            }
        );
        let b = CpuTimes::parse("cpu  150 0 60 900 10 0 5 75 0 0\n").unwrap();
        // 40 of the 200 ticks that passed were stolen.
        assert_eq!(a.steal_pct_until(b), Some(20.0));
        assert_eq!(a.steal_pct_until(a), None);
        assert_eq!(CpuTimes::parse("intr 1 2 3"), None);
        assert_eq!(CpuTimes::parse("cpu 1 2 3"), None);
        if std::path::Path::new("/proc/stat").exists() {
            assert!(CpuTimes::now().is_some());
        }
    }

    #[test]
    fn busbw_factors_are_the_nccl_tests_ones() {
        let f = |op: &str, n| BenchOp::parse(op).unwrap().busbw_factor(n);
        assert_eq!(f("allreduce", 4), 1.5);
        assert_eq!(f("allreduce", 2), 1.0);
        assert_eq!(f("allgather", 4), 0.75);
        assert_eq!(f("reducescatter", 8), 0.875);
        assert_eq!(f("alltoall", 2), 0.5);
        assert_eq!(f("broadcast", 4), 1.0);
        assert_eq!(f("reduce", 3), 1.0);
        assert_eq!(f("sendrecv", 2), 1.0);
        assert_eq!(f("barrier", 4), 0.0);
    }

    #[test]
    fn a_blocked_operation_says_which_sizes_it_rounds_down() {
        let op = BenchOp::parse("alltoall").unwrap();
        let note = rounding_note(op, 4, DType::F32, &[8, 16, 24]).unwrap();
        assert!(
            note.contains("multiple of 4 ranks x 4 B (float) = 16 B"),
            "{note}"
        );
        assert!(note.contains("8 -> 0, 24 -> 16"), "{note}");
        assert!(!note.contains("16 ->"), "{note}");
        // Whole multiples, or an operation that is not blocked: nothing to say.
        assert_eq!(rounding_note(op, 4, DType::F32, &[16, 32]), None);
        let all_reduce = BenchOp::parse("allreduce").unwrap();
        assert_eq!(rounding_note(all_reduce, 4, DType::F32, &[8]), None);
        let many = rounding_note(op, 3, DType::F32, &[4, 8, 16, 32, 64, 128]).unwrap();
        assert!(many.ends_with(", ..."), "{many}");
    }

    #[test]
    fn sizes_step_and_stop_at_the_maximum() {
        assert_eq!(sizes(8, 1024, 4), vec![8, 32, 128, 512, 1024]);
        assert_eq!(sizes(1, 1, 2), vec![1]);
        assert_eq!(sizes(8, 64, 1), vec![8]);
    }

    #[test]
    fn op_names_parse_both_spellings() {
        for (s, want) in [
            ("allreduce", "allreduce"),
            ("all_reduce", "allreduce"),
            ("bcast", "broadcast"),
            ("pingpong", "sendrecv"),
            ("reduce-scatter", "reducescatter"),
        ] {
            assert_eq!(BenchOp::parse(s).map(|o| o.name()), Some(want), "{s}");
        }
        assert!(BenchOp::parse("allreduc").is_none());
    }
}
