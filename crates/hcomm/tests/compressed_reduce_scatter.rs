//! The compressed reduce-scatter (`Communicator::reduce_scatter_compressed`, FSDP's gradient
//! reduction): int8 and sign bitwise against a local simulation from the codecs, every codec
//! within its bound of the exact sum, at 1–4 ranks over TCP and shared memory, empty, one
//! element, odd and multi-block chunks; error feedback's conservation law; mean; the bytes it
//! moves; typed errors that leave the ranks in step.

use hcomm::compress::{mix_seed, Codec, Int8Block, SignBlock, SplitMix64};
use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Communicator, CompressionState, Compressor, Density, Error, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

const BLOCK: usize = 64;

fn ranks<R: Send, F>(n: usize, transport: TransportKind, f: F) -> Vec<R>
where
    F: Fn(Arc<Communicator>) -> hcomm::Result<R> + Sync,
{
    expect_all(run_threads_with(
        n,
        transport,
        Duration::from_secs(60),
        |c| f(Arc::new(c)),
    ))
}

/// Rank `rank`'s input of `n` elements for `step`: magnitudes over six decades, mixed signs,
/// some exact zeros (every rank can make every other rank's).
fn gradient(rank: usize, n: usize, step: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(mix_seed(&[rank as u64, step, 7]));
    (0..n)
        .map(|i| {
            let u = rng.next_unit_f32();
            if i % 41 == 5 {
                return 0.0;
            }
            (u - 0.5) * 10f32.powi((i / 89 % 6) as i32 - 4)
        })
        .collect()
}

fn compressors() -> Vec<Compressor> {
    vec![
        Compressor::None,
        Compressor::Fp16,
        Compressor::Bf16,
        Compressor::Int8 {
            block: BLOCK,
            stochastic: false,
        },
        Compressor::Int8 {
            block: BLOCK,
            stochastic: true,
        },
        Compressor::Sign { block: BLOCK },
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What rank `owner` must get from int8/sign without error feedback at step 0: every rank
/// encodes its chunks in order with its own codec, the owner decodes and adds in rank order.
fn simulate(comp: Compressor, world: usize, m: usize, owner: usize) -> Vec<f32> {
    let mut out = vec![0f32; m];
    for src in 0..world {
        let x = gradient(src, world * m, 0);
        let mut codec: Box<dyn Codec> = match comp {
            Compressor::Int8 { block, stochastic } => Box::new(if stochastic {
                Int8Block::stochastic(block, mix_seed(&[0, 0, src as u64, 0x5c7])).unwrap()
            } else {
                Int8Block::new(block).unwrap()
            }),
            Compressor::Sign { block } => Box::new(SignBlock::new(block).unwrap()),
            other => panic!("no simulation for {other}"),
        };
        let len = codec.encoded_len(m);
        let mut enc = vec![0u8; len];
        for c in 0..=owner {
            codec.encode(&x[c * m..(c + 1) * m], &mut enc).unwrap();
        }
        codec.decode_add(&enc, &mut out).unwrap();
    }
    out
}

fn run(
    c: &Communicator,
    comp: Compressor,
    m: usize,
    steps: u64,
    ef: bool,
    op: ReduceOp,
) -> hcomm::Result<(Vec<Vec<f32>>, CompressionState)> {
    let mut state = CompressionState::new(comp)?.with_error_feedback(ef);
    let mut outs = Vec::new();
    for step in 0..steps {
        let send = gradient(c.rank(), c.world_size() * m, step);
        let mut recv = vec![f32::NAN; m];
        c.reduce_scatter_compressed(&send, &mut recv, op, &mut state)?;
        outs.push(recv);
    }
    Ok((outs, state))
}

#[test]
fn matches_the_simulation_bitwise_and_the_exact_sum_within_each_codec_bound() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for world in 1..=4usize {
            let got = ranks(world, transport, |c| {
                let mut all = Vec::new();
                for m in [0usize, 1, 7, 1000] {
                    for comp in compressors() {
                        all.push((m, comp, run(&c, comp, m, 1, false, ReduceOp::Sum)?.0));
                    }
                }
                Ok(all)
            });
            for (owner, per_rank) in got.iter().enumerate() {
                for (m, comp, outs) in per_rank {
                    let (m, comp) = (*m, *comp);
                    let ctx = format!(
                        "{comp}, {world} ranks, {m} per chunk, rank {owner}, {transport:?}"
                    );
                    let got = &outs[0];
                    assert_eq!(got.len(), m, "{ctx}");
                    if matches!(comp, Compressor::Int8 { .. } | Compressor::Sign { .. }) {
                        assert_eq!(bits(got), bits(&simulate(comp, world, m, owner)), "{ctx}");
                    }
                    let rel = match comp {
                        Compressor::None => 1e-6,
                        Compressor::Fp16 => world as f64 / 2048.0,
                        Compressor::Bf16 => world as f64 / 256.0,
                        _ => continue, // bitwise above; the codec bounds are codec tests
                    };
                    let inputs: Vec<Vec<f32>> =
                        (0..world).map(|r| gradient(r, world * m, 0)).collect();
                    for (i, &y) in got.iter().enumerate() {
                        let at = owner * m + i;
                        let exact: f64 = inputs.iter().map(|x| x[at] as f64).sum();
                        let scale: f64 = inputs.iter().map(|x| x[at].abs() as f64).sum();
                        let tol = rel * scale + world as f64 * 1e-7;
                        assert!(
                            (y as f64 - exact).abs() <= tol,
                            "{ctx} [{i}]: {y} vs {exact} (tol {tol})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn error_feedback_conserves_the_sum_of_inputs() {
    // After T steps: the owner's outputs + every rank's residual of that chunk == the sum of
    // every input of that chunk (f32 rounding; fp16/bf16 also round their partial sums).
    let (m, steps) = (777usize, 4u64);
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for world in [1usize, 2, 3] {
            for comp in compressors() {
                let runs = ranks(world, transport, |c| {
                    run(&c, comp, m, steps, true, ReduceOp::Sum)
                });
                let ctx = format!("{comp} at {world} ranks, {transport:?}");
                for (owner, (outs, _)) in runs.iter().enumerate() {
                    let chunk = owner * m..(owner + 1) * m;
                    // rounding is relative to what each term holds: outputs, residuals, inputs
                    let (mut lhs, mut scale) = (vec![0f64; m], vec![0f64; m]);
                    for o in outs {
                        for (i, &b) in o.iter().enumerate() {
                            lhs[i] += b as f64;
                            scale[i] += b.abs() as f64;
                        }
                    }
                    let mut rhs = vec![0f64; m];
                    for (r, (_, st)) in runs.iter().enumerate() {
                        if comp.is_lossy() {
                            assert_eq!(st.residual().len(), world * m, "{ctx}");
                            // (the half casts' bound below is loose: this is what checks them)
                            assert!(
                                st.residual().iter().any(|v| *v != 0.0),
                                "{ctx}: nothing fed back"
                            );
                            for (i, v) in st.residual()[chunk.clone()].iter().enumerate() {
                                lhs[i] += *v as f64;
                                scale[i] += v.abs() as f64;
                            }
                        } else {
                            assert!(st.residual().is_empty(), "{ctx}");
                        }
                        for t in 0..steps {
                            for (i, v) in
                                gradient(r, world * m, t)[chunk.clone()].iter().enumerate()
                            {
                                rhs[i] += *v as f64;
                                scale[i] += v.abs() as f64;
                            }
                        }
                    }
                    let rel = match comp {
                        Compressor::Fp16 => 2.0 * world as f64 / 2048.0,
                        Compressor::Bf16 => 2.0 * world as f64 / 256.0,
                        _ => 1e-5,
                    };
                    for i in 0..m {
                        let tol = rel * scale[i] + 1e-7;
                        assert!(
                            (lhs[i] - rhs[i]).abs() <= tol,
                            "{ctx}, rank {owner} [{i}]: {} vs {} (tol {tol})",
                            lhs[i],
                            rhs[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn mean_is_the_sum_over_ranks_and_the_first_step_ignores_error_feedback() {
    ranks(3, TransportKind::Auto, |c| {
        for comp in compressors() {
            let (sum, _) = run(&c, comp, 300, 1, false, ReduceOp::Sum)?;
            let (mean, _) = run(&c, comp, 300, 1, false, ReduceOp::Mean)?;
            let want: Vec<f32> = sum[0].iter().map(|x| x / 3.0).collect();
            assert_eq!(bits(&mean[0]), bits(&want), "{comp}");
            let (with_ef, st) = run(&c, comp, 300, 1, true, ReduceOp::Sum)?;
            assert_eq!(bits(&with_ef[0]), bits(&sum[0]), "{comp}");
            assert_eq!(st.steps(), 1);
        }
        Ok(())
    });
}

#[test]
fn compression_moves_fewer_bytes_as_measured() {
    let (world, m) = (4usize, 1usize << 18); // 4 MiB of f32 in, 1 MiB out
    let sent = ranks(world, TransportKind::Tcp, |c| {
        let mut sent = Vec::new();
        for comp in [
            Compressor::None,
            Compressor::Fp16,
            Compressor::INT8,
            Compressor::SIGN,
        ] {
            c.reset_traffic();
            run(&c, comp, m, 1, true, ReduceOp::Mean)?;
            let t = c.traffic();
            assert_eq!(t.len(), 1, "{comp}: one row, the parts are in it: {t:?}");
            assert_eq!(
                (t[0].op, t[0].calls),
                ("reduce_scatter_compressed", 1),
                "{t:?}"
            );
            sent.push(t[0].tcp_sent);
        }
        Ok(sent)
    });
    // a ring reduce-scatter of the dense vector sends (n-1)/n of it
    let dense = ((world - 1) * 4 * m) as f64;
    for per_rank in &sent {
        let ratio = |i: usize| dense / per_rank[i] as f64;
        assert!((0.98..1.01).contains(&ratio(0)), "none: {}", ratio(0));
        assert!((1.95..2.01).contains(&ratio(1)), "fp16: {}", ratio(1));
        assert!((3.7..4.0).contains(&ratio(2)), "int8: {}", ratio(2));
        assert!((25.0..32.0).contains(&ratio(3)), "sign: {}", ratio(3));
    }
}

#[test]
fn bad_input_is_a_typed_error_and_the_ranks_stay_in_step() {
    ranks(2, TransportKind::Auto, |c| {
        let send = vec![1f32; 8];
        let mut recv = vec![0f32; 4];
        let mut st = CompressionState::new(Compressor::INT8)?;
        let msg = |e: Error| {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            e.to_string()
        };
        let e = c
            .reduce_scatter_compressed(&send, &mut recv, ReduceOp::Max, &mut st)
            .unwrap_err();
        assert!(msg(e).contains("sums or averages; got op max"));
        let e = c
            .reduce_scatter_compressed(&send, &mut recv[..3], ReduceOp::Sum, &mut st)
            .unwrap_err();
        assert!(msg(e)
            .contains("send buffer has 8 elements, expected world_size (2) x recv count (3) = 6"));
        for comp in [
            Compressor::TopK(Density::Fraction(0.1)),
            Compressor::RandomK {
                density: Density::Fraction(0.1),
                seed: 1,
            },
        ] {
            let mut s = CompressionState::new(comp)?;
            let e = c
                .reduce_scatter_compressed(&send, &mut recv, ReduceOp::Sum, &mut s)
                .unwrap_err();
            assert!(msg(e).contains("picks elements of the whole vector"));
        }
        let e = c
            .reduce_scatter_compressed_bytes(
                &[0u8; 8],
                &mut [0u8; 4],
                hcomm::DType::F16,
                ReduceOp::Sum,
                &mut st,
            )
            .unwrap_err();
        let m = msg(e);
        assert!(m.contains("takes f32 data; got half"), "{m}");
        // bound to 8 elements by a good call; another length is refused
        c.reduce_scatter_compressed(&send, &mut recv, ReduceOp::Sum, &mut st)?;
        assert_eq!(recv, vec![2.0; 4]);
        let e = c
            .reduce_scatter_compressed(&send[..4], &mut recv[..2], ReduceOp::Sum, &mut st)
            .unwrap_err();
        assert!(msg(e).contains("belongs to a 8-element tensor"));
        // nothing was sent by the refused calls: the next collective pairs up
        let mut x = vec![c.rank() as f32 + 1.0; 3];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        assert_eq!(x, vec![3.0; 3]);
        Ok(())
    });
}
