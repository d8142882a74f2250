//! `hcomm demo`: every primitive on the local ranks, each checked against the CPU reference,
//! with its time and bandwidth.

use crate::bench::{run_size, BenchOp, BenchOpts};
use hcomm::testing::{run_case, Case};
use hcomm::{Algo, Collective, Communicator, DType, ReduceOp, Result};
use std::time::Instant;

/// One line of the demo table.
pub struct DemoRow {
    /// Primitive.
    pub name: String,
    /// Bytes moved per call (nccl-tests convention).
    pub bytes: usize,
    /// Time per call, µs.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Algorithm used.
    pub algo: String,
    /// All results matched the reference on every rank.
    pub correct: bool,
}

fn all_agree(comm: &Communicator, ok: bool) -> Result<bool> {
    let mut bad = [u32::from(!ok)];
    comm.all_reduce_in_place(&mut bad, ReduceOp::Sum)?;
    Ok(bad[0] == 0)
}

/// Run the demo on this rank; rank 0 gets the rows.
pub fn run(comm: &Communicator, bytes: usize, iters: usize) -> Result<Vec<DemoRow>> {
    let n = comm.world_size();
    let mut rows = Vec::new();
    for coll in Collective::ALL {
        // Correctness at several shapes (odd, prime, not divisible by the world size) and roots.
        let mut ok = true;
        for &count in &[1usize, 7, 1031, 65_537] {
            for dtype in [DType::F32, DType::BF16, DType::I64] {
                let root = count % n;
                let case = Case {
                    coll,
                    dtype,
                    op: ReduceOp::Sum,
                    count,
                    root,
                    in_place: false,
                    algo: Algo::Auto,
                    seed: 3,
                    deterministic: false,
                };
                if let Some(m) = run_case(comm, &case)? {
                    crate::say!("rank {}: {case}: {m}", comm.rank());
                    ok = false;
                }
            }
        }
        let size = if coll == Collective::Barrier {
            0
        } else {
            bytes
        };
        rows.push(bench_row(
            comm,
            BenchOp::Coll(coll),
            coll.name(),
            size,
            iters,
            ok,
        )?);
    }
    if n >= 2 {
        rows.push(bench_row(
            comm,
            BenchOp::SendRecv,
            "send/recv",
            bytes,
            iters,
            true,
        )?);
        rows.push(signal_row(comm, iters)?);
        rows.push(connection_row(comm)?);
    }
    rows.push(split_row(comm)?);
    Ok(rows)
}

/// A row measured (and checked) by the benchmark's loop; correct only if `ok` and the check
/// passed on every rank.
fn bench_row(
    comm: &Communicator,
    op: BenchOp,
    name: &str,
    bytes: usize,
    iters: usize,
    ok: bool,
) -> Result<DemoRow> {
    let o = BenchOpts {
        min_bytes: bytes,
        max_bytes: bytes,
        warmup: 2,
        iters,
        ..BenchOpts::new(op)
    };
    let row = run_size(comm, &o, bytes)?;
    let correct = all_agree(comm, ok && row.wrong == 0)?;
    Ok(DemoRow {
        name: name.into(),
        bytes: row.bytes,
        time_us: row.time_us,
        algbw: row.algbw,
        busbw: row.busbw,
        algo: row.algo,
        correct,
    })
}

/// A row of a primitive timed by its slowest rank (no bandwidth columns), correct only if
/// correct on every rank.
fn latency_row(
    comm: &Communicator,
    name: &str,
    bytes: usize,
    algo: &str,
    secs: f64,
    ok: bool,
) -> Result<DemoRow> {
    let mut per = [secs];
    comm.all_reduce_in_place(&mut per, ReduceOp::Max)?;
    Ok(DemoRow {
        name: name.into(),
        bytes,
        time_us: per[0] * 1e6,
        algbw: 0.0,
        busbw: 0.0,
        algo: algo.into(),
        correct: all_agree(comm, ok)?,
    })
}

/// Signal / wait around a ring: each rank signals its right neighbour and waits for its left.
fn signal_row(comm: &Communicator, iters: usize) -> Result<DemoRow> {
    let n = comm.world_size();
    let (me, right, left) = (
        comm.rank(),
        (comm.rank() + 1) % n,
        (comm.rank() + n - 1) % n,
    );
    comm.barrier()?;
    let t = Instant::now();
    for i in 0..iters {
        let tag = (i % 3) as u32;
        if me == 0 {
            comm.signal(right, tag)?;
            comm.wait_signal(left, tag)?;
        } else {
            comm.wait_signal(left, tag)?;
            comm.signal(right, tag)?;
        }
    }
    latency_row(
        comm,
        "signal/wait",
        0,
        "ring",
        t.elapsed().as_secs_f64() / iters.max(1) as f64 / n as f64,
        true,
    )
}

/// Connection objects: out-of-order tags between neighbours.
fn connection_row(comm: &Communicator) -> Result<DemoRow> {
    let n = comm.world_size();
    let me = comm.rank();
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let t = Instant::now();
    let mut ok = true;
    // Send tags 1 then 2 to the right; receive 2 then 1 from the left (matching by tag).
    let data1: Vec<i32> = (0..100).map(|i| i + me as i32 * 1000).collect();
    let data2: Vec<i32> = (0..50).map(|i| -i - me as i32 * 1000).collect();
    let mut got1 = vec![0i32; 100];
    let mut got2 = vec![0i32; 50];
    let r1 = comm.connect(right, 1)?;
    let r2 = comm.connect(right, 2)?;
    let left_conns = if left == right {
        None
    } else {
        Some((comm.connect(left, 1)?, comm.connect(left, 2)?))
    };
    r1.send(&data1)?;
    r2.send(&data2)?;
    {
        let (l1, l2) = match &left_conns {
            Some((a, b)) => (a, b),
            None => (&r1, &r2),
        };
        l2.recv(&mut got2)?;
        l1.recv(&mut got1)?;
    }
    r1.close()?;
    r2.close()?;
    if let Some((a, b)) = left_conns {
        a.close()?;
        b.close()?;
    }
    ok &= got1 == (0..100).map(|i| i + left as i32 * 1000).collect::<Vec<_>>();
    ok &= got2 == (0..50).map(|i| -i - left as i32 * 1000).collect::<Vec<_>>();
    latency_row(
        comm,
        "connect/send/recv (tags)",
        600,
        "p2p",
        t.elapsed().as_secs_f64(),
        ok,
    )
}

/// Split into even/odd ranks and all-reduce within each half.
fn split_row(comm: &Communicator) -> Result<DemoRow> {
    let me = comm.rank();
    let n = comm.world_size();
    let t = Instant::now();
    let sub = comm
        .split(Some((me % 2) as u32), me as i64)?
        .expect("member");
    let mut v = [me as i64];
    sub.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    let want: i64 = (0..n).filter(|r| r % 2 == me % 2).map(|r| r as i64).sum();
    let ok = v[0] == want
        && sub.world_size() == (0..n).filter(|r| r % 2 == me % 2).count()
        && sub.rank() == me / 2;
    latency_row(
        comm,
        "split + all_reduce",
        8,
        "ring/rd",
        t.elapsed().as_secs_f64(),
        ok,
    )
}

/// Print the table.
pub fn print(rows: &[DemoRow], n: usize, shared_memory: bool, p2p_shared_memory: bool) {
    let transport = match (shared_memory, p2p_shared_memory) {
        (true, true) => "shared memory for collectives and point-to-point",
        (true, false) => "shared memory for collectives, TCP loopback for point-to-point",
        (false, true) => "TCP loopback for collectives, shared memory for point-to-point",
        (false, false) => "TCP loopback",
    };
    println!("hcomm demo: {n} ranks on this host, {transport}; every result checked against a CPU reference");
    println!(
        "{:<26} {:>10} {:>12} {:>9} {:>9} {:>14} {:>8}",
        "primitive", "bytes", "time (us)", "algbw", "busbw", "algorithm", "correct"
    );
    println!(
        "{:<26} {:>10} {:>12} {:>9} {:>9} {:>14} {:>8}",
        "", "", "", "(GB/s)", "(GB/s)", "", ""
    );
    for r in rows {
        println!(
            "{:<26} {:>10} {:>12.2} {:>9.3} {:>9.3} {:>14} {:>8}",
            r.name,
            r.bytes,
            r.time_us,
            r.algbw,
            r.busbw,
            r.algo,
            if r.correct { "yes" } else { "NO" }
        );
    }
    let bad = rows.iter().filter(|r| !r.correct).count();
    println!("{} of {} primitives correct", rows.len() - bad, rows.len());
}
