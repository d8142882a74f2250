//! `hcomm bench fusion`: what gradient fusion and overlap buy on a real model's gradients.
//!
//! The gradients are those of BERT-base (199 tensors, 109.5 M floats, generated, not
//! downloaded). Modes, each timed as the median step (max over ranks) of `--steps` steps after
//! one warm-up step:
//! * `per-tensor`: one blocking all-reduce per tensor, in backward order;
//! * `fused, all packed`: every tensor copied into buckets ([`Fusion`]), at each cap of the
//!   sweep;
//! * `fused (default)`: small tensors packed into 25 MiB buckets, tensors of 1 MiB and more
//!   all-reduced in place (no copy);
//! * `compute only`: the synthetic backward pass alone (calibrated to take about as long as
//!   the default fused all-reduce, so overlap has something to hide);
//! * `serial`: the backward pass, then the fused all-reduce;
//! * `overlapped`: each tensor pushed to the bucketer as soon as its share of the backward pass
//!   is done, so buckets are in flight while the rest is computed.

use hcomm::fusion::{Fusion, FusionOptions};
use hcomm::{Communicator, ReduceOp, Result};
use std::sync::Arc;
use std::time::Instant;

/// Parameter shapes of BERT-base (uncased): embeddings, 12 encoder layers, pooler, in
/// forward order.
pub fn bert_base_shapes() -> Vec<(String, Vec<usize>)> {
    let (h, ffn, vocab, pos) = (768, 3072, 30522, 512);
    let mut v: Vec<(String, Vec<usize>)> = vec![
        ("embeddings.word_embeddings.weight".into(), vec![vocab, h]),
        ("embeddings.position_embeddings.weight".into(), vec![pos, h]),
        ("embeddings.token_type_embeddings.weight".into(), vec![2, h]),
        ("embeddings.LayerNorm.weight".into(), vec![h]),
        ("embeddings.LayerNorm.bias".into(), vec![h]),
    ];
    for l in 0..12 {
        let p = format!("encoder.layer.{l}");
        for m in ["query", "key", "value"] {
            v.push((format!("{p}.attention.self.{m}.weight"), vec![h, h]));
            v.push((format!("{p}.attention.self.{m}.bias"), vec![h]));
        }
        v.push((format!("{p}.attention.output.dense.weight"), vec![h, h]));
        v.push((format!("{p}.attention.output.dense.bias"), vec![h]));
        v.push((format!("{p}.attention.output.LayerNorm.weight"), vec![h]));
        v.push((format!("{p}.attention.output.LayerNorm.bias"), vec![h]));
        v.push((format!("{p}.intermediate.dense.weight"), vec![ffn, h]));
        v.push((format!("{p}.intermediate.dense.bias"), vec![ffn]));
        v.push((format!("{p}.output.dense.weight"), vec![h, ffn]));
        v.push((format!("{p}.output.dense.bias"), vec![h]));
        v.push((format!("{p}.output.LayerNorm.weight"), vec![h]));
        v.push((format!("{p}.output.LayerNorm.bias"), vec![h]));
    }
    v.push(("pooler.dense.weight".into(), vec![h, h]));
    v.push(("pooler.dense.bias".into(), vec![h]));
    v
}

/// Options of the fusion benchmark.
#[derive(Clone, Debug)]
pub struct FusionBenchOpts {
    /// Timed steps per mode (median reported).
    pub steps: usize,
    /// Bucket caps of the sweep, in MiB.
    pub caps_mib: Vec<f64>,
    /// Multiply every tensor's element count by this (1.0 = real BERT-base; smaller for quick
    /// runs and tests); every tensor keeps at least one element.
    pub scale: f64,
    /// One JSON object per row instead of the table.
    pub json: bool,
}

impl Default for FusionBenchOpts {
    fn default() -> Self {
        FusionBenchOpts {
            steps: 5,
            caps_mib: vec![1.0, 4.0, 25.0, 100.0],
            scale: 1.0,
            json: false,
        }
    }
}

/// One row of the report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FusionRow {
    /// `per-tensor`, `fused`, `compute only`, `serial` or `overlapped`.
    pub mode: String,
    /// Bucket cap in MiB (fused modes).
    pub cap_mib: Option<f64>,
    /// All-reduces per step.
    pub collectives: usize,
    /// Median step time, max over ranks, in ms.
    pub ms_per_step: f64,
    /// Speed-up against the row's baseline (`per-tensor` for fusion, `serial` for overlap).
    pub speedup: Option<f64>,
}

/// A synthetic backward pass: `units` rounds of fused multiply-adds over a small, cache-resident
/// array (no memory traffic to compete with the all-reduce for bandwidth, only the core).
struct Compute {
    scratch: Vec<f32>,
    secs_per_unit: f64,
}

impl Compute {
    fn new() -> Compute {
        let mut c = Compute {
            scratch: vec![1.0; 2048],
            secs_per_unit: 0.0,
        };
        c.run(200); // warm
        let t = Instant::now();
        c.run(2000);
        c.secs_per_unit = t.elapsed().as_secs_f64() / 2000.0;
        c
    }

    fn run(&mut self, units: u64) {
        for _ in 0..units {
            for x in self.scratch.iter_mut() {
                *x = x.mul_add(0.999_999, 1e-6);
            }
            std::hint::black_box(&mut self.scratch);
        }
    }
}

/// Run the benchmark on this rank; rank 0 prints. Returns the rows.
pub fn run(comm: &Arc<Communicator>, o: &FusionBenchOpts) -> Result<Vec<FusionRow>> {
    let shapes = bert_base_shapes();
    let counts: Vec<usize> = shapes
        .iter()
        .map(|(_, s)| ((s.iter().product::<usize>() as f64 * o.scale) as usize).max(1))
        .collect();
    let total: usize = counts.iter().sum();
    let mut grads: Vec<Vec<f32>> = counts
        .iter()
        .enumerate()
        .map(|(k, &n)| vec![(comm.rank() + k) as f32 * 0.5; n])
        .collect();
    let n = comm.world_size();
    let steps = o.steps.max(1);
    let print = comm.rank() == 0;
    if print && !o.json {
        println!(
            "# hcomm bench fusion: BERT-base gradients x{}: {} tensors, {} floats ({:.1} MiB) per rank, {} ranks, transport {}",
            o.scale,
            counts.len(),
            total,
            (total * 4) as f64 / (1 << 20) as f64,
            n,
            if comm.has_shared_memory() { "shm" } else { "tcp" },
        );
        println!("# steps: median of {steps} (max over ranks), after one warm-up step");
        println!(
            "#{:>29} {:>9} {:>12} {:>14} {:>9}",
            "mode", "cap(MiB)", "collectives", "time/step(ms)", "speed-up"
        );
    }
    let mut rows = Vec::new();
    let emit = |row: FusionRow, rows: &mut Vec<FusionRow>| {
        if print {
            if o.json {
                println!("{}", serde_json::to_string(&row).unwrap_or_default());
            } else {
                println!(
                    " {:>29} {:>9} {:>12} {:>14.2} {:>9}",
                    row.mode,
                    row.cap_mib.map_or("-".into(), |c| format!("{c}")),
                    row.collectives,
                    row.ms_per_step,
                    row.speedup.map_or("-".into(), |s| format!("{s:.2}x")),
                );
            }
        }
        rows.push(row);
    };

    // Median step time, max over ranks.
    let time_step = |f: &mut dyn FnMut(&mut Vec<Vec<f32>>) -> Result<usize>,
                     grads: &mut Vec<Vec<f32>>|
     -> Result<(f64, usize)> {
        let mut calls = f(grads)?; // warm-up
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            comm.barrier()?;
            let t = Instant::now();
            calls = f(grads)?;
            let mut el = [t.elapsed().as_secs_f64()];
            comm.all_reduce_in_place(&mut el, ReduceOp::Max)?;
            times.push(el[0]);
        }
        times.sort_by(f64::total_cmp);
        Ok((times[times.len() / 2] * 1e3, calls))
    };

    let (per_tensor, calls) = time_step(
        &mut |g| {
            for t in g.iter_mut().rev() {
                comm.all_reduce_in_place(t, ReduceOp::Sum)?;
            }
            Ok(g.len())
        },
        &mut grads,
    )?;
    emit(
        FusionRow {
            mode: "per-tensor (blocking)".into(),
            cap_mib: None,
            collectives: calls,
            ms_per_step: per_tensor,
            speedup: Some(1.0),
        },
        &mut rows,
    );

    let fused_step = |fusion: &Fusion,
                      g: &mut Vec<Vec<f32>>,
                      compute: Option<(&mut Compute, &[u64])>|
     -> Result<usize> {
        fusion.step(|b| {
            match compute {
                Some((c, units)) => {
                    for (k, t) in g.iter_mut().enumerate().rev() {
                        c.run(units[k]);
                        b.push(t)?;
                    }
                }
                None => {
                    for t in g.iter_mut().rev() {
                        b.push(t)?;
                    }
                }
            }
            b.flush();
            Ok(b.buckets_launched())
        })
    };
    // Every tensor packed, at each cap of the sweep.
    for &cap in &o.caps_mib {
        let fusion = Fusion::new(
            comm,
            ReduceOp::Sum,
            FusionOptions::with_cap((cap * (1 << 20) as f64) as usize),
        );
        let (ms, buckets) = time_step(&mut |g| fused_step(&fusion, g, None), &mut grads)?;
        emit(
            FusionRow {
                mode: "fused, all packed".into(),
                cap_mib: Some(cap),
                collectives: buckets,
                ms_per_step: ms,
                speedup: Some(per_tensor / ms),
            },
            &mut rows,
        );
    }
    // The default: small tensors packed, tensors of 1 MiB and more reduced in place.
    let fusion = Fusion::new(comm, ReduceOp::Sum, FusionOptions::default());
    let (fused_default, buckets) = time_step(&mut |g| fused_step(&fusion, g, None), &mut grads)?;
    emit(
        FusionRow {
            mode: "fused (default)".into(),
            cap_mib: Some(25.0),
            collectives: buckets,
            ms_per_step: fused_default,
            speedup: Some(per_tensor / fused_default),
        },
        &mut rows,
    );

    // Where fusion pays: the small tensors alone (start-up cost dominates), 10 passes per
    // timed step.
    let mut small: Vec<Vec<f32>> = grads
        .iter()
        .filter(|g| g.len() * 4 < (1 << 20))
        .cloned()
        .collect();
    let small_floats: usize = small.iter().map(|g| g.len()).sum();
    let (small_per_tensor, calls) = time_step(
        &mut |g| {
            for _ in 0..10 {
                for t in g.iter_mut().rev() {
                    comm.all_reduce_in_place(t, ReduceOp::Sum)?;
                }
            }
            Ok(g.len())
        },
        &mut small,
    )?;
    emit(
        FusionRow {
            mode: format!("small only: per-tensor ({} KiB)", (small_floats * 4) >> 10),
            cap_mib: None,
            collectives: calls,
            ms_per_step: small_per_tensor / 10.0,
            speedup: Some(1.0),
        },
        &mut rows,
    );
    let (small_fused, buckets) = time_step(
        &mut |g| {
            let mut b = 0;
            for _ in 0..10 {
                b = fused_step(&fusion, g, None)?;
            }
            Ok(b)
        },
        &mut small,
    )?;
    emit(
        FusionRow {
            mode: "small only: fused (default)".into(),
            cap_mib: Some(25.0),
            collectives: buckets,
            ms_per_step: small_fused / 10.0,
            speedup: Some(small_per_tensor / small_fused),
        },
        &mut rows,
    );

    // Overlap: a backward pass as long as the fused all-reduce, shared among the tensors in
    // proportion to their size; every rank runs the same number of units (rank 0's
    // calibration).
    let mut compute = Compute::new();
    let mut spu = [compute.secs_per_unit];
    comm.broadcast(&mut spu, 0)?;
    let total_units = (fused_default / 1e3 / spu[0]).max(1.0);
    let units: Vec<u64> = counts
        .iter()
        .map(|&c| (total_units * c as f64 / total as f64).round() as u64)
        .collect();
    let all_units: u64 = units.iter().sum();
    let (compute_ms, _) = time_step(
        &mut |_| {
            compute.run(all_units);
            Ok(0)
        },
        &mut grads,
    )?;
    emit(
        FusionRow {
            mode: "compute only".into(),
            cap_mib: None,
            collectives: 0,
            ms_per_step: compute_ms,
            speedup: None,
        },
        &mut rows,
    );
    let (serial, calls) = time_step(
        &mut |g| {
            compute.run(all_units);
            fused_step(&fusion, g, None)
        },
        &mut grads,
    )?;
    emit(
        FusionRow {
            mode: "serial (compute, then fused)".into(),
            cap_mib: Some(25.0),
            collectives: calls,
            ms_per_step: serial,
            speedup: Some(1.0),
        },
        &mut rows,
    );
    let (overlapped, calls) = time_step(
        &mut |g| fused_step(&fusion, g, Some((&mut compute, &units))),
        &mut grads,
    )?;
    emit(
        FusionRow {
            mode: "overlapped".into(),
            cap_mib: Some(25.0),
            collectives: calls,
            ms_per_step: overlapped,
            speedup: Some(serial / overlapped),
        },
        &mut rows,
    );
    if print && !o.json {
        println!(
            "# overlap bound: serial / max(compute, fused) = {:.2}x",
            serial / compute_ms.max(fused_default)
        );
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bert_base_has_199_tensors_and_about_110m_parameters() {
        let s = bert_base_shapes();
        assert_eq!(s.len(), 199);
        let total: usize = s.iter().map(|(_, d)| d.iter().product::<usize>()).sum();
        assert_eq!(total, 109_482_240);
    }
}
