//! `hcomm bench compression`: what each gradient compressor moves and costs, measured.
//!
//! Every rank holds an f32 gradient of `--size` bytes (generated: magnitudes varying by
//! region over four decades, like a model's layers). For each compressor:
//! * the first call, on a fresh state (no residual), is compared with the exact sum (every
//!   rank's gradient summed in f64 on rank 0, rounded to f32): relative L2 error and largest
//!   absolute error;
//! * then `--steps` calls are timed (median, max over ranks), with the communicator's byte
//!   counters reset before them: the wire bytes are the bytes this rank really wrote to / read
//!   from its TCP links or shared-memory segment during those calls (the
//!   `all_reduce_compressed` row of [`Communicator::traffic`]), per call, averaged over ranks.
//!
//! The logical size is the f32 gradient itself; `vs none` is the uncompressed all-reduce's
//! measured bytes over this compressor's. `err of mean` is the error of the average of all
//! the calls' results (same gradient every call): error feedback makes it shrink with the
//! number of calls.

use hcomm::compress::{mix_seed, SplitMix64};
use hcomm::{Communicator, CompressionState, Compressor, ReduceOp, Result};
use std::time::Instant;

/// The compressors measured by default.
pub const DEFAULT_COMPRESSORS: &str = "none,fp16,bf16,int8,int8sr,sign,topk:1%,randk:1%";

/// Options of the compression benchmark.
#[derive(Clone, Debug)]
pub struct CompressionBenchOpts {
    /// Bytes of f32 gradient per rank.
    pub bytes: usize,
    /// Timed calls per compressor (median reported).
    pub steps: usize,
    /// Compressors, in order.
    pub compressors: Vec<Compressor>,
    /// Error feedback on (the states keep residuals between the timed calls).
    pub error_feedback: bool,
    /// One JSON object per row instead of the table.
    pub json: bool,
}

/// One row of the report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CompressionRow {
    /// The compressor (`none`, `int8:256`, `topk:1%`, …).
    pub compressor: String,
    /// `tcp` or `shm`.
    pub transport: String,
    /// Ranks.
    pub ranks: usize,
    /// Bytes of the f32 gradient per rank.
    pub logical_bytes: u64,
    /// Measured bytes sent per rank per call (mean over ranks).
    pub wire_bytes_sent: u64,
    /// Measured bytes received per rank per call (mean over ranks).
    pub wire_bytes_received: u64,
    /// Of `wire_bytes_sent`, the bytes written to TCP links (mean over ranks): what crosses
    /// hosts when some ranks share one (the rest went through shared memory).
    pub tcp_bytes_sent: u64,
    /// The uncompressed all-reduce's bytes sent over this one's (when `none` was measured).
    pub reduction_vs_none: Option<f64>,
    /// Median time per call, max over ranks, in ms.
    pub ms_per_call: f64,
    /// ||result - exact|| / ||exact|| of a first call (fresh state).
    pub rel_l2_error: f64,
    /// Largest |result - exact| of that call.
    pub max_abs_error: f64,
    /// ||mean of every call's result - exact|| / ||exact|| over the first call and the timed
    /// ones (all on the same gradient): with error feedback, what compression dropped in one
    /// call is sent in the next, so this shrinks as calls accumulate.
    pub rel_l2_error_of_mean: f64,
}

/// Rank `rank`'s gradient: uniform in ±scale/2, the scale changing every 4096 elements
/// among 1e-4, 1e-3, 1e-2, 1e-1.
pub fn gradient(rank: usize, n: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(mix_seed(&[rank as u64, 0xbe9c4]));
    (0..n)
        .map(|i| {
            let scale = [1e-4f32, 1e-3, 1e-2, 1e-1][(i >> 12) % 4];
            (rng.next_unit_f32() - 0.5) * scale
        })
        .collect()
}

/// Run the benchmark on this rank; rank 0 prints. Returns the rows.
pub fn run(comm: &Communicator, o: &CompressionBenchOpts) -> Result<Vec<CompressionRow>> {
    let n = o.bytes / 4;
    let world = comm.world_size();
    let grad = gradient(comm.rank(), n);
    let print = comm.rank() == 0;
    let transport = if comm.has_shared_memory() {
        "shm"
    } else {
        "tcp"
    };
    // The exact sum, on rank 0 only.
    let exact: Vec<f32> = if print {
        let mut s = vec![0f64; n];
        for r in 0..world {
            for (a, b) in s.iter_mut().zip(gradient(r, n)) {
                *a += b as f64;
            }
        }
        s.into_iter().map(|x| x as f32).collect()
    } else {
        Vec::new()
    };
    if print && !o.json {
        println!(
            "# hcomm bench compression: f32 gradient of {} bytes ({n} elements) per rank, {world} ranks, transport {transport}, error feedback {}",
            n * 4,
            if o.error_feedback { "on" } else { "off" },
        );
        println!(
            "# wire bytes: measured (bytes this rank wrote to / read from its links or shared segment) per call, mean over ranks; time: median of {} calls, max over ranks; error: first call vs the exact sum",
            o.steps.max(1)
        );
        println!(
            "#{:>15} {:>12} {:>14} {:>14} {:>13} {:>8} {:>10} {:>11} {:>10} {:>12}",
            "compressor",
            "logical(MiB)",
            "sent/rank(MiB)",
            "recv/rank(MiB)",
            "tcp/rank(MiB)",
            "vs none",
            "time(ms)",
            "rel.L2 err",
            "max|err|",
            "err of mean"
        );
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut rows: Vec<CompressionRow> = Vec::new();
    let mut buf = vec![0f32; n];
    for &comp in &o.compressors {
        // Accuracy: one call on a fresh state.
        let mut state = CompressionState::new(comp)?.with_error_feedback(o.error_feedback);
        buf.copy_from_slice(&grad);
        comm.all_reduce_compressed(&mut buf, ReduceOp::Sum, &mut state)?;
        let (mut err2, mut ref2, mut max_abs) = (0f64, 0f64, 0f64);
        let mut acc: Vec<f64> = Vec::new();
        if print {
            for (&g, &e) in buf.iter().zip(&exact) {
                let d = (g - e) as f64;
                err2 += d * d;
                ref2 += (e as f64) * (e as f64);
                max_abs = max_abs.max(d.abs());
            }
            acc = buf.iter().map(|&x| x as f64).collect();
        }
        // Time and bytes: the same state goes on (its residual is carried, as in training).
        comm.barrier()?;
        comm.reset_traffic();
        let mut times = Vec::with_capacity(o.steps.max(1));
        let (mut sent, mut received, mut tcp, mut calls) = (0u64, 0u64, 0u64, 0u64);
        for _ in 0..o.steps.max(1) {
            buf.copy_from_slice(&grad);
            comm.barrier()?;
            let t = Instant::now();
            comm.all_reduce_compressed(&mut buf, ReduceOp::Sum, &mut state)?;
            let el = t.elapsed().as_secs_f64();
            acc.iter_mut().zip(&buf).for_each(|(a, &b)| *a += b as f64);
            // Read the counters before the timing all-reduce below adds its own row.
            if let Some(r) = comm
                .traffic()
                .into_iter()
                .find(|r| r.op == "all_reduce_compressed")
            {
                (sent, received, tcp, calls) =
                    (r.bytes_sent(), r.bytes_received(), r.tcp_sent, r.calls);
            }
            let mut el = [el];
            comm.all_reduce_in_place(&mut el, ReduceOp::Max)?;
            times.push(el[0]);
        }
        times.sort_by(f64::total_cmp);
        let results = (o.steps.max(1) + 1) as f64;
        let mean_err2: f64 = acc
            .iter()
            .zip(&exact)
            .map(|(&a, &e)| (a / results - e as f64).powi(2))
            .sum();
        let per_call = [
            sent as f64 / calls.max(1) as f64,
            received as f64 / calls.max(1) as f64,
            tcp as f64 / calls.max(1) as f64,
        ];
        let mut mean = per_call;
        comm.all_reduce_in_place(&mut mean, ReduceOp::Mean)?;
        let none_sent = rows
            .iter()
            .find(|r| r.compressor == "none")
            .map(|r| r.wire_bytes_sent)
            .filter(|&b| b > 0);
        let row = CompressionRow {
            compressor: comp.to_string(),
            transport: transport.into(),
            ranks: world,
            logical_bytes: (n * 4) as u64,
            wire_bytes_sent: mean[0].round() as u64,
            wire_bytes_received: mean[1].round() as u64,
            tcp_bytes_sent: mean[2].round() as u64,
            reduction_vs_none: none_sent.map(|d| d as f64 / mean[0].max(1.0)),
            ms_per_call: times[times.len() / 2] * 1e3,
            rel_l2_error: if ref2 > 0.0 {
                (err2 / ref2).sqrt()
            } else {
                0.0
            },
            max_abs_error: max_abs,
            rel_l2_error_of_mean: if ref2 > 0.0 {
                (mean_err2 / ref2).sqrt()
            } else {
                0.0
            },
        };
        if print {
            if o.json {
                println!("{}", serde_json::to_string(&row).unwrap_or_default());
            } else {
                println!(
                    " {:>15} {:>12.1} {:>14.2} {:>14.2} {:>13.2} {:>8} {:>10.1} {:>11.2e} {:>10.2e} {:>12.2e}",
                    row.compressor,
                    mib(row.logical_bytes),
                    mib(row.wire_bytes_sent),
                    mib(row.wire_bytes_received),
                    mib(row.tcp_bytes_sent),
                    row.reduction_vs_none
                        .map_or("-".into(), |r| format!("{r:.1}x")),
                    row.ms_per_call,
                    row.rel_l2_error,
                    row.max_abs_error,
                    row.rel_l2_error_of_mean,
                );
            }
        }
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_compressors_parse() {
        for c in DEFAULT_COMPRESSORS.split(',') {
            c.parse::<Compressor>().unwrap();
        }
    }
}
