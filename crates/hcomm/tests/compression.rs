//! Gradient compression: codec round trips and bounds (proptests), the compressed all-reduce
//! against a local simulation (bitwise) and the exact sum (within each codec's bound) at 1–4
//! ranks over TCP and shared memory, bitwise agreement between ranks, error feedback's
//! conservation law, random-k's shared indices, measured byte reductions, fusion with
//! compression, and typed errors.

use hcomm::algo::even_segments;
use hcomm::compress::{
    mix_seed, top_k_indices, top_k_take, Codec, Half, Int8Block, RandomK, SignBlock, SplitMix64,
    TopK,
};
use hcomm::config::TransportKind;
use hcomm::fusion::{plan_buckets, Fusion, FusionOptions, TensorMut};
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Communicator, OpTraffic};
use hcomm::{CompressionState, Compressor, DType, Density, Error, ReduceOp};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

// ---------- helpers ----------

fn ranks<R: Send, F>(n: usize, transport: TransportKind, f: F) -> Vec<R>
where
    F: Fn(Arc<Communicator>) -> hcomm::Result<R> + Sync,
{
    let t = Duration::from_secs(60);
    expect_all(run_threads_with(n, transport, t, |c| f(Arc::new(c))))
}

/// Rank `rank`'s gradient for `step`: magnitudes varying by region over six decades, signs
/// mixed, some exact zeros. Every rank can regenerate every other rank's.
fn gradient(rank: usize, n: usize, step: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(mix_seed(&[rank as u64, step, 99]));
    (0..n)
        .map(|i| {
            let u = rng.next_unit_f32();
            if i % 53 == 7 {
                return 0.0;
            }
            let scale = 10f32.powi((i / 97 % 6) as i32 - 4);
            (u - 0.5) * scale
        })
        .collect()
}

fn exact_sum(inputs: &[Vec<f32>]) -> Vec<f64> {
    let mut s = vec![0f64; inputs[0].len()];
    for x in inputs {
        s.iter_mut().zip(x).for_each(|(a, &b)| *a += b as f64);
    }
    s
}

fn abs_sum(inputs: &[Vec<f32>]) -> Vec<f64> {
    let mut s = vec![0f64; inputs[0].len()];
    for x in inputs {
        s.iter_mut().zip(x).for_each(|(a, &b)| *a += b.abs() as f64);
    }
    s
}

/// The chunks of the compressed all-reduce: one per rank, at block boundaries.
fn chunks(n: usize, block: usize, world: usize) -> Vec<std::ops::Range<usize>> {
    even_segments(n.div_ceil(block), world, 1)
        .into_iter()
        .map(|b| (b.start * block).min(n)..(b.end * block).min(n))
        .collect()
}

/// The two-stage compressed all-reduce, simulated locally from the codecs.
fn two_stage_sim<C: Codec>(inputs: &[Vec<f32>], codec: &mut C, block: usize) -> Vec<f32> {
    let chunks = chunks(inputs[0].len(), block, inputs.len());
    hcomm::testing::two_stage_compressed(inputs, codec, chunks)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn row<'a>(t: &'a [OpTraffic], op: &str) -> &'a OpTraffic {
    t.iter()
        .find(|r| r.op == op)
        .unwrap_or_else(|| panic!("no row {op} in {t:?}"))
}

const BLOCK: usize = 64;

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
        Compressor::TopK(Density::Fraction(0.05)),
        Compressor::RandomK {
            density: Density::Fraction(0.05),
            seed: 11,
        },
        Compressor::Sign { block: BLOCK },
    ]
}

// ---------- codecs ----------

fn vec_strategy() -> impl Strategy<Value = Vec<f32>> {
    // Mixed magnitudes, repeated values (ties), zeros.
    proptest::collection::vec(
        prop_oneof![
            4 => -1.0f32..1.0,
            2 => -1e6f32..1e6,
            1 => -1e-6f32..1e-6,
            1 => Just(0.0f32),
            1 => Just(0.25f32),
            1 => Just(-0.25f32),
        ],
        0..600,
    )
}

/// [`vec_strategy`] with the values a kernel gets wrong: NaN, infinities, signed zeros,
/// subnormals and the extremes of f32.
fn special_vec_strategy() -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(
        prop_oneof![
            8 => -1.0f32..1.0,
            2 => -1e6f32..1e6,
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NEG_INFINITY),
            1 => Just(-0.0f32),
            1 => Just(0.0f32),
            1 => Just(f32::MIN_POSITIVE / 4.0),
            1 => Just(f32::MAX),
            1 => Just(f32::MIN),
        ],
        0..600,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn top_k_keeps_exactly_the_k_largest(x in vec_strategy(), k in 1usize..700) {
        let idx = top_k_indices(&x, k);
        let want = k.min(x.len());
        prop_assert_eq!(idx.len(), want);
        prop_assert!(idx.windows(2).all(|w| w[0] < w[1]), "ascending, distinct");
        let mut kept = vec![false; x.len()];
        for &i in &idx {
            kept[i as usize] = true;
        }
        let min_kept = idx.iter().map(|&i| x[i as usize].abs()).fold(f32::INFINITY, f32::min);
        for (i, v) in x.iter().enumerate() {
            if !kept[i] {
                prop_assert!(v.abs() <= min_kept, "dropped {} > kept {}", v.abs(), min_kept);
                // Ties keep the lower indices.
                if v.abs() == min_kept {
                    prop_assert!(idx.iter().all(|&j| (j as usize) < i || x[j as usize].abs() > min_kept));
                }
            }
        }
        // Round trip: the kept values exactly, zeros elsewhere.
        let mut codec = TopK::new(k).unwrap();
        let mut enc = vec![0u8; codec.encoded_len(x.len())];
        prop_assert_eq!(enc.len(), 8 * want);
        codec.encode(&x, &mut enc).unwrap();
        let mut dec = vec![1.0f32; x.len()];
        codec.decode(&enc, &mut dec).unwrap();
        for i in 0..x.len() {
            prop_assert_eq!(dec[i].to_bits(), if kept[i] { x[i].to_bits() } else { 0f32.to_bits() });
        }
    }

    #[test]
    fn encoding_keeping_the_error_is_add_encode_decode_subtract(x in vec_strategy(), block in 1usize..300, sr in any::<bool>(), seed in any::<u64>()) {
        let r0: Vec<f32> = x.iter().enumerate().map(|(i, v)| if i % 3 == 0 { v * 0.5 } else { -(i as f32) * 1e-3 }).collect();
        let codecs: Vec<Box<dyn Fn() -> Box<dyn Codec>>> = vec![
            Box::new(move || Box::new(if sr { Int8Block::stochastic(block, seed) } else { Int8Block::new(block) }.unwrap())),
            Box::new(move || Box::new(SignBlock::new(block).unwrap())),
            Box::new(|| Box::new(Half::F16)),
            Box::new(|| Box::new(Half::Bf16)),
        ];
        for make in codecs {
            let (mut a, mut b) = (make(), make());
            let len = a.encoded_len(x.len());
            // step by step
            let sum: Vec<f32> = x.iter().zip(&r0).map(|(v, r)| v + r).collect();
            let mut want_enc = vec![0u8; len];
            a.encode(&sum, &mut want_enc).unwrap();
            let mut dec = vec![0f32; x.len()];
            a.decode(&want_enc, &mut dec).unwrap();
            let want_r: Vec<f32> = sum.iter().zip(&dec).map(|(v, d)| v - d).collect();
            // in one
            let mut enc = vec![0u8; len];
            let mut r = r0.clone();
            b.encode_keeping_error(&x, &mut r, &mut enc).unwrap();
            prop_assert_eq!(&enc, &want_enc);
            prop_assert_eq!(bits(&r), bits(&want_r));
        }
    }

    #[test]
    fn int8_bytes_are_the_specifications_one_element_at_a_time(x in special_vec_strategy(), block in 1usize..300) {
        // The wire format is shared by every rank and every version: pin it to the
        // specification written out scalar (scale = largest finite |x| over 127, negated if the
        // block holds a NaN or an infinity; such an element's code is -128; else code = floor(x / scale + 128.5) saturated to
        // 1..=255, minus 128, in f32 where 1 / scale is finite, in f64 where it is not),
        // whatever the kernels do.
        let mut want = Vec::new();
        let mut codes = Vec::new();
        for xb in x.chunks(block) {
            let m = xb.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
            let s = m / 127.0;
            // negated when the block holds a non-finite element
            let sent = if xb.iter().all(|v| v.is_finite()) { s } else { -s };
            want.extend_from_slice(&sent.to_ne_bytes());
            let inv = 1.0 / s;
            codes.extend(xb.iter().map(|&v| {
                if !v.is_finite() {
                    0x80
                } else if s == 0.0 {
                    0
                } else if inv.is_finite() {
                    ((v * inv + 128.5) as u8).max(1) ^ 0x80
                } else {
                    ((v as f64 * 127.0 / m as f64 + 128.5).clamp(1.0, 255.0) as u8) ^ 0x80
                }
            }));
        }
        want.extend(codes);
        let mut codec = Int8Block::new(block).unwrap();
        let mut enc = vec![0u8; codec.encoded_len(x.len())];
        codec.encode(&x, &mut enc).unwrap();
        prop_assert_eq!(enc, want);
    }

    #[test]
    fn sign_decodes_as_the_specification_one_element_at_a_time(x in special_vec_strategy(), block in 1usize..300, to in -2.0f32..2.0) {
        // Blocks that start a byte (block % 8 == 0) take a kernel of their own: both paths
        // must add +s for a set bit and -s for a clear one, each element its block's scale.
        let block = if block % 3 == 0 { block - block % 8 + 8 } else { block };
        let mut codec = SignBlock::new(block).unwrap();
        let mut enc = vec![0u8; codec.encoded_len(x.len())];
        codec.encode(&x, &mut enc).unwrap();
        let (scales, bits) = enc.split_at(4 * x.len().div_ceil(block));
        let want: Vec<u32> = (0..x.len())
            .map(|i| {
                let s = f32::from_ne_bytes(scales[4 * (i / block)..][..4].try_into().unwrap());
                let set = bits[i / 8] >> (i % 8) & 1 == 1;
                (to + if set { s } else { -s }).to_bits()
            })
            .collect();
        let mut got = vec![to; x.len()];
        codec.decode_add(&enc, &mut got).unwrap();
        prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }

    #[test]
    fn int8_round_trip_is_within_its_bound(x in vec_strategy(), block in 1usize..300, sr in any::<bool>(), seed in any::<u64>()) {
        let mut codec = if sr { Int8Block::stochastic(block, seed) } else { Int8Block::new(block) }.unwrap();
        let mut enc = vec![0u8; codec.encoded_len(x.len())];
        prop_assert_eq!(enc.len(), x.len() + 4 * x.len().div_ceil(block));
        codec.encode(&x, &mut enc).unwrap();
        let mut dec = vec![0f32; x.len()];
        codec.decode(&enc, &mut dec).unwrap();
        for (xb, db) in x.chunks(block).zip(dec.chunks(block)) {
            let m = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let bound = codec.error_bound(m);
            for (a, b) in xb.iter().zip(db) {
                prop_assert!((a - b).abs() <= bound, "|{a} - {b}| > {bound} (block max {m}, sr {sr})");
            }
        }
    }

    #[test]
    fn sign_round_trip_is_within_its_bound_and_keeps_l1(x in vec_strategy(), block in 1usize..300) {
        let mut codec = SignBlock::new(block).unwrap();
        let mut enc = vec![0u8; codec.encoded_len(x.len())];
        prop_assert_eq!(enc.len(), x.len().div_ceil(8) + 4 * x.len().div_ceil(block));
        codec.encode(&x, &mut enc).unwrap();
        let mut dec = vec![0f32; x.len()];
        codec.decode(&enc, &mut dec).unwrap();
        for (xb, db) in x.chunks(block).zip(dec.chunks(block)) {
            let m = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let l1: f64 = xb.iter().map(|v| v.abs() as f64).sum();
            let l1d: f64 = db.iter().map(|v| v.abs() as f64).sum();
            prop_assert!((l1 - l1d).abs() <= 1e-5 * l1 + 1e-30, "L1 {l1} vs {l1d}");
            for (a, b) in xb.iter().zip(db) {
                prop_assert!((a - b).abs() <= m * (1.0 + 1e-6), "|{a} - {b}| > {m}");
                prop_assert!(*a == 0.0 || (*a < 0.0) == (*b < 0.0), "sign of {a} lost: {b}");
            }
        }
    }

    #[test]
    fn half_round_trip_is_within_its_bound(x in vec_strategy(), bf in any::<bool>()) {
        let mut codec = if bf { Half::Bf16 } else { Half::F16 };
        let mut enc = vec![0u8; codec.encoded_len(x.len())];
        codec.encode(&x, &mut enc).unwrap();
        let mut dec = vec![0f32; x.len()];
        codec.decode(&enc, &mut dec).unwrap();
        for (a, b) in x.iter().zip(&dec) {
            let a_sat = if bf { *a } else { a.clamp(-65504.0, 65504.0) };
            let bound = codec.unit_roundoff() * a_sat.abs() + codec.subnormal_step();
            prop_assert!((a_sat - b).abs() <= bound, "|{a_sat} - {b}| > {bound}");
        }
    }

    #[test]
    fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), n in 0usize..100, block in 1usize..20) {
        let mut out = vec![0f32; n];
        let _ = Int8Block::new(block).unwrap().decode(&bytes, &mut out);
        let _ = SignBlock::new(block).unwrap().decode(&bytes, &mut out);
        let _ = TopK::new(block).unwrap().decode(&bytes, &mut out);
        let _ = Half::F16.decode(&bytes, &mut out);
        let _ = RandomK::new(1, n, block).unwrap().decode(&bytes, &mut out);
    }
}

#[test]
fn int8_stochastic_rounding_is_unbiased() {
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.7) / 97.0).collect();
    let mut mean = vec![0f64; x.len()];
    let trials = 4000;
    for s in 0..trials {
        let mut c = Int8Block::stochastic(64, s).unwrap();
        let mut enc = vec![0u8; c.encoded_len(x.len())];
        c.encode(&x, &mut enc).unwrap();
        let mut dec = vec![0f32; x.len()];
        c.decode(&enc, &mut dec).unwrap();
        mean.iter_mut().zip(&dec).for_each(|(m, &d)| *m += d as f64);
    }
    let step = x.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
    for (m, &v) in mean.iter().zip(&x) {
        let m = m / trials as f64;
        // Standard error of the mean is at most step / 2 / sqrt(trials) ~ step / 126.
        assert!((m - v as f64).abs() < step / 20.0, "mean {m} vs {v}");
    }
}

#[test]
fn f16_saturates_instead_of_overflowing() {
    let x = [1e6f32, -1e6, 70000.0, 1.0];
    let mut c = Half::F16;
    let mut enc = vec![0u8; 8];
    c.encode(&x, &mut enc).unwrap();
    let mut dec = [0f32; 4];
    c.decode(&enc, &mut dec).unwrap();
    assert_eq!(dec, [65504.0, -65504.0, 65504.0, 1.0]);
}

#[test]
fn malformed_encodings_are_typed_errors() {
    let mut out = vec![0f32; 10];
    for e in [
        Int8Block::new(4).unwrap().decode(&[0u8; 3], &mut out),
        SignBlock::new(4).unwrap().decode(&[0u8; 100], &mut out),
        Half::Bf16.decode(&[0u8; 19], &mut out),
        // Index 99 of a 10-element vector.
        TopK::new(1)
            .unwrap()
            .decode(&[99, 0, 0, 0, 0, 0, 128, 63], &mut out),
        RandomK::new(1, 11, 3).unwrap().decode(&[0u8; 12], &mut out),
    ] {
        let e = e.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }
    assert!(TopK::new(0).unwrap_err().to_string().contains("k = 0"));
    assert!(Int8Block::new(0)
        .unwrap_err()
        .to_string()
        .contains("block size 0"));
    let mut c = Int8Block::new(4).unwrap();
    assert!(
        c.encode(&[1.0; 8], &mut [0u8; 9]).is_err(),
        "wrong output size"
    );
}

// ---------- compressed all-reduce ----------

/// Per rank: every step's result, then the state.
type RankRun = (Vec<Vec<f32>>, CompressionState);

fn run_steps(
    c: &Communicator,
    comp: Compressor,
    n: usize,
    steps: u64,
    ef: bool,
    op: ReduceOp,
) -> hcomm::Result<RankRun> {
    let mut state = CompressionState::new(comp)?.with_error_feedback(ef);
    let mut out = Vec::new();
    for t in 0..steps {
        let mut g = gradient(c.rank(), n, t);
        c.all_reduce_compressed(&mut g, op, &mut state)?;
        out.push(g);
    }
    Ok((out, state))
}

#[test]
fn compressed_all_reduce_matches_simulation_and_bound_and_ranks_agree() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for world in 1..=4 {
            for n in [5usize, 10_007] {
                for comp in compressors() {
                    let runs = ranks(world, transport, |c| {
                        run_steps(&c, comp, n, 1, false, ReduceOp::Sum)
                    });
                    let ctx = format!("{comp} at {world} ranks, n = {n}, {transport:?}");
                    let got = &runs[0].0[0];
                    for (r, run) in runs.iter().enumerate() {
                        assert_eq!(
                            bits(&run.0[0]),
                            bits(got),
                            "rank {r} differs from rank 0: {ctx}"
                        );
                    }
                    let inputs: Vec<Vec<f32>> = (0..world).map(|r| gradient(r, n, 0)).collect();
                    let exact = exact_sum(&inputs);
                    let mag = abs_sum(&inputs);
                    let w = world as f64;
                    let f32_tol = |i: usize| w * 2f64.powi(-23) * mag[i];
                    match comp {
                        Compressor::None => {
                            for i in 0..n {
                                assert!(
                                    (got[i] as f64 - exact[i]).abs() <= f32_tol(i),
                                    "{ctx} [{i}]"
                                );
                            }
                        }
                        Compressor::Fp16 | Compressor::Bf16 => {
                            let h = if comp == Compressor::Fp16 {
                                Half::F16
                            } else {
                                Half::Bf16
                            };
                            let u = h.unit_roundoff() as f64;
                            let eta = h.subnormal_step() as f64;
                            for i in 0..n {
                                let bound = 2.0 * w * (u * mag[i] + eta);
                                assert!(
                                    (got[i] as f64 - exact[i]).abs() <= bound,
                                    "{ctx} [{i}]: {} vs {}",
                                    got[i],
                                    exact[i]
                                );
                            }
                        }
                        Compressor::Int8 { block, stochastic } => {
                            if !stochastic {
                                let want = two_stage_sim(
                                    &inputs,
                                    &mut Int8Block::new(block).unwrap(),
                                    block,
                                );
                                assert_eq!(
                                    bits(got),
                                    bits(&want),
                                    "{ctx}: differs from the simulation"
                                );
                            }
                            let codec = if stochastic {
                                Int8Block::stochastic(block, 0)
                            } else {
                                Int8Block::new(block)
                            }
                            .unwrap();
                            for s in (0..n).step_by(block) {
                                let e = (s + block).min(n);
                                let maxes: Vec<f32> = inputs
                                    .iter()
                                    .map(|x| x[s..e].iter().fold(0f32, |a, v| a.max(v.abs())))
                                    .collect();
                                let stage1: f64 =
                                    maxes.iter().map(|&m| codec.error_bound(m) as f64).sum();
                                let sum_max: f32 = maxes.iter().sum::<f32>() * (1.0 + 2.0 / 127.0);
                                let bound = stage1
                                    + codec.error_bound(sum_max) as f64
                                    + 1e-6 * sum_max as f64;
                                for i in s..e {
                                    assert!(
                                        (got[i] as f64 - exact[i]).abs() <= bound,
                                        "{ctx} [{i}]: {} vs {} (bound {bound})",
                                        got[i],
                                        exact[i]
                                    );
                                }
                            }
                        }
                        Compressor::Sign { block } => {
                            let want =
                                two_stage_sim(&inputs, &mut SignBlock::new(block).unwrap(), block);
                            assert_eq!(
                                bits(got),
                                bits(&want),
                                "{ctx}: differs from the simulation"
                            );
                            for s in (0..n).step_by(block) {
                                let e = (s + block).min(n);
                                let bound: f64 = inputs
                                    .iter()
                                    .map(|x| {
                                        x[s..e].iter().fold(0f32, |a, v| a.max(v.abs())) as f64
                                    })
                                    .sum::<f64>()
                                    * 2.0
                                    * (1.0 + 1e-5);
                                for i in s..e {
                                    assert!(
                                        (got[i] as f64 - exact[i]).abs() <= bound,
                                        "{ctx} [{i}]"
                                    );
                                }
                            }
                        }
                        Compressor::TopK(d) => {
                            let k = d.k(n);
                            let mut want = vec![0f32; n];
                            for x in &inputs {
                                for i in top_k_indices(x, k) {
                                    want[i as usize] += x[i as usize];
                                }
                            }
                            assert_eq!(
                                bits(got),
                                bits(&want),
                                "{ctx}: differs from the simulation"
                            );
                        }
                        Compressor::RandomK { density, .. } => {
                            // The same k indices everywhere: exact sums there (up to the
                            // all-reduce's f32 rounding), zero elsewhere.
                            let k = density.k(n);
                            let nonzero = (0..n).filter(|&i| got[i] != 0.0).count();
                            assert!(nonzero <= k, "{ctx}: {nonzero} non-zeros, k = {k}");
                            for i in 0..n {
                                if got[i] != 0.0 {
                                    assert!(
                                        (got[i] as f64 - exact[i]).abs() <= f32_tol(i),
                                        "{ctx} [{i}]"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn random_k_indices_agree_across_ranks_and_change_with_the_step() {
    let n = 5000;
    let comp = Compressor::RandomK {
        density: Density::Count(100),
        seed: 5,
    };
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        let runs = ranks(4, transport, |c| {
            let mut state = CompressionState::new(comp)?;
            let nonzero = |g: &[f32]| -> Vec<usize> { (0..n).filter(|&i| g[i] != 0.0).collect() };
            // Step 0: the residual (error feedback on, zero before) is zero exactly where this
            // rank sent its values, i.e. at its own choice of indices.
            let mut g = vec![1.0f32; n];
            c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut state)?;
            assert!(g.iter().all(|&x| x == 0.0 || x == 4.0));
            let mine: Vec<usize> = (0..n).filter(|&i| state.residual()[i] == 0.0).collect();
            let step0 = nonzero(&g);
            // Step 1 draws again.
            let mut g = vec![1.0f32; n];
            c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut state)?;
            let step1 = nonzero(&g);
            // A fresh start draws step 0's indices again.
            state.reset();
            let mut g = vec![1.0f32; n];
            c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut state)?;
            Ok((mine, step0, step1, nonzero(&g)))
        });
        let (mine, step0, step1, again) = &runs[0];
        assert_eq!(mine.len(), 100);
        assert_eq!(
            mine, step0,
            "the result is non-zero exactly at the chosen indices"
        );
        assert_eq!(again, step0, "the same seed and step draw the same indices");
        assert!(
            step1.len() <= 100 && step1 != step0,
            "the next step draws other indices"
        );
        for r in &runs {
            assert_eq!(r, &runs[0], "every rank chose the same indices");
        }
    }
}

#[test]
fn error_feedback_conserves_the_sum_of_inputs() {
    // After T steps: sum of results + every residual == sum of every input (f32 rounding),
    // for every compressor but the half casts (their in-network rounding is not fed back).
    let n = 3001;
    let steps = 4;
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for world in [1usize, 3, 4] {
            for comp in compressors() {
                let runs = ranks(world, transport, |c| {
                    run_steps(&c, comp, n, steps, true, ReduceOp::Sum)
                });
                let ctx = format!("{comp} at {world} ranks, {transport:?}");
                let mut lhs = vec![0f64; n];
                for step in &runs[0].0 {
                    lhs.iter_mut().zip(step).for_each(|(a, &b)| *a += b as f64);
                }
                let mut scale = vec![0f64; n];
                for (_, st) in &runs {
                    if comp.is_lossy() {
                        assert_eq!(st.residual().len(), n, "{ctx}");
                    }
                    hcomm::testing::add_held_back(st, &mut lhs, &mut scale);
                }
                let mut rhs = vec![0f64; n];
                for r in 0..world {
                    for t in 0..steps {
                        for (i, v) in gradient(r, n, t).iter().enumerate() {
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
                for i in 0..n {
                    let tol = rel * scale[i] + 1e-9;
                    assert!(
                        (lhs[i] - rhs[i]).abs() <= tol,
                        "{ctx} [{i}]: {} vs {} (tol {tol})",
                        lhs[i],
                        rhs[i]
                    );
                }
            }
        }
    }
}

#[test]
fn error_feedback_can_be_turned_off_and_mean_is_the_sum_over_ranks() {
    ranks(3, TransportKind::Auto, |c| {
        for comp in compressors() {
            let (sum, st) = run_steps(&c, comp, 2000, 1, false, ReduceOp::Sum)?;
            assert!(st.residual().is_empty() && st.owner_residual().is_empty());
            assert!(!st.error_feedback());
            let (mean, _) = run_steps(&c, comp, 2000, 1, false, ReduceOp::Mean)?;
            let want: Vec<f32> = sum[0].iter().map(|x| x / 3.0).collect();
            assert_eq!(bits(&mean[0]), bits(&want), "{comp}");
            // With error feedback, the first step gives the same result (the residual is 0).
            let (with_ef, st) = run_steps(&c, comp, 2000, 1, true, ReduceOp::Sum)?;
            assert_eq!(bits(&with_ef[0]), bits(&sum[0]), "{comp}");
            assert_eq!(st.steps(), 1);
        }
        Ok(())
    });
}

#[test]
fn compression_moves_fewer_bytes_as_measured() {
    let n = 1 << 20; // 4 MiB of f32
    let world = 4;
    let results = ranks(world, TransportKind::Tcp, |c| {
        let mut sent = Vec::new();
        for comp in [
            Compressor::None,
            Compressor::Fp16,
            Compressor::INT8,
            Compressor::SIGN,
            Compressor::TopK(Density::Fraction(0.01)),
            Compressor::RandomK {
                density: Density::Fraction(0.01),
                seed: 1,
            },
        ] {
            c.reset_traffic();
            let mut state = CompressionState::new(comp)?;
            let mut g = gradient(c.rank(), n, 0);
            c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut state)?;
            let t = c.traffic();
            let r = row(&t, "all_reduce_compressed");
            assert_eq!(
                r.calls, 1,
                "{comp}: one call, its collectives are part of it: {t:?}"
            );
            assert_eq!(t.len(), 1, "{comp}: no rows for the parts: {t:?}");
            sent.push((comp, r.tcp_sent));
        }
        Ok(sent)
    });
    let dense = (2 * (world - 1) * 4 * n / world) as f64;
    for per_rank in &results {
        let ratio = |i: usize| dense / per_rank[i].1 as f64;
        assert!((0.98..1.0).contains(&ratio(0)), "none: {}", ratio(0));
        assert!((1.9..2.0).contains(&ratio(1)), "fp16: {}", ratio(1));
        assert!((3.7..4.0).contains(&ratio(2)), "int8: {}", ratio(2));
        assert!((25.0..32.0).contains(&ratio(3)), "sign: {}", ratio(3));
        // top-k 1%: (n-1) x 8k bytes gathered vs 8(n-1)/n x N dense: 25x at 4 ranks.
        assert!((20.0..26.0).contains(&ratio(4)), "top-k 1%: {}", ratio(4));
        // random-k 1%: a dense all-reduce of 1% of the values (41 kB: recursive doubling,
        // which sends the vector log2(4) = 2 times instead of the ring's 1.5).
        assert!(
            (70.0..101.0).contains(&ratio(5)),
            "random-k 1%: {}",
            ratio(5)
        );
    }
}

#[test]
fn async_form_and_state_misuse() {
    ranks(2, TransportKind::Auto, |c| {
        let state = CompressionState::new(Compressor::INT8)?;
        let (g, mut state) = c
            .all_reduce_compressed_async(vec![1.0f32; 1000], ReduceOp::Mean, state)
            .wait()?;
        assert!(
            g.iter().all(|&x| x == 1.0),
            "int8 is exact on a constant block"
        );
        assert_eq!(state.steps(), 1);
        // The state is bound to 1000 elements on 2 ranks.
        let e = c
            .all_reduce_compressed(&mut [1.0f32; 999], ReduceOp::Sum, &mut state)
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("1000-element"),
            "{e}"
        );
        state.reset();
        c.all_reduce_compressed(&mut [1.0f32; 999], ReduceOp::Sum, &mut state)?;
        let e = c
            .all_reduce_compressed(&mut [1.0f32; 999], ReduceOp::Max, &mut state)
            .unwrap_err();
        assert!(e.to_string().contains("max"), "{e}");
        let mut raw = vec![0u8; 20];
        let e = c
            .all_reduce_compressed_bytes(&mut raw, DType::BF16, ReduceOp::Sum, &mut state)
            .unwrap_err();
        assert!(e.to_string().contains("bfloat16"), "{e}");
        // Nothing was sent by the refused calls: the communicator still works.
        let mut x = [1.0f32];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        assert_eq!(x[0], 2.0);
        Ok(())
    });
}

// ---------- fusion ----------

/// Tensors of a model: small ones (packed) and one large (direct), all f32.
fn model(rank: usize, step: u64) -> Vec<Vec<f32>> {
    [0usize, 3, 1000, 77, 40_000, 5, 300_000, 129]
        .iter()
        .enumerate()
        .map(|(k, &n)| gradient(rank * 31 + k, n, step))
        .collect()
}

#[test]
fn fused_compression_equals_per_bucket_compression_with_state_kept_per_bucket() {
    // (and with the local part done on the pushing thread: the same bits)
    for (transport, encode_on_push) in [
        (TransportKind::Tcp, false),
        (TransportKind::Auto, false),
        (TransportKind::Auto, true),
    ] {
        let opts = FusionOptions {
            cap_bytes: 100_000,
            first_bucket_bytes: 10_000,
            direct_bytes: 1_000_000,
            skip_zero_blocks: false,
            encode_on_push,
        };
        for world in [1usize, 3] {
            for comp in [
                Compressor::None,
                Compressor::Fp16,
                Compressor::Int8 {
                    block: 100,
                    stochastic: false,
                },
                Compressor::Sign { block: 100 },
                Compressor::TopK(Density::Fraction(0.1)),
            ] {
                ranks(world, transport, |c| {
                    let fusion =
                        Fusion::new(&c, ReduceOp::Mean, opts).with_compression(comp, true)?;
                    let sizes: Vec<(DType, usize)> = model(0, 0)
                        .iter()
                        .map(|t| (DType::F32, 4 * t.len()))
                        .collect();
                    let plan = plan_buckets(&sizes, opts);
                    let mut states: HashMap<Vec<usize>, CompressionState> = HashMap::new();
                    for step in 0..3 {
                        let mut fused = model(c.rank(), step);
                        fusion.step(|b| {
                            for t in fused.iter_mut() {
                                b.push(t)?;
                            }
                            Ok(())
                        })?;
                        // The same buckets, packed by hand, each with its own state.
                        let mut manual = model(c.rank(), step);
                        for bucket in &plan {
                            let mut packed: Vec<f32> = bucket
                                .members
                                .iter()
                                .flat_map(|&i| manual[i].clone())
                                .collect();
                            let st = match states.entry(bucket.members.clone()) {
                                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                                std::collections::hash_map::Entry::Vacant(e) => {
                                    e.insert(CompressionState::new(comp)?)
                                }
                            };
                            c.all_reduce_compressed(&mut packed, ReduceOp::Mean, st)?;
                            let mut off = 0;
                            for &i in &bucket.members {
                                let len = manual[i].len();
                                manual[i].copy_from_slice(&packed[off..off + len]);
                                off += len;
                            }
                        }
                        for (k, (f, m)) in fused.iter().zip(&manual).enumerate() {
                            assert_eq!(
                                bits(f),
                                bits(m),
                                "{comp}, step {step}, tensor {k}, encode_on_push {encode_on_push}"
                            );
                        }
                    }
                    let (buckets, bytes) = fusion.compression_memory();
                    assert_eq!(buckets, if comp.is_lossy() { plan.len() } else { 0 });
                    if comp.is_lossy() {
                        assert!(bytes >= 4 * sizes.iter().map(|s| s.1 / 4).sum::<usize>());
                    }
                    Ok(())
                });
            }
        }
    }
}

#[test]
fn fused_random_k_agrees_across_ranks_and_fusion_refuses_bad_input() {
    let comp = Compressor::RandomK {
        density: Density::Fraction(0.2),
        seed: 3,
    };
    let out = ranks(3, TransportKind::Auto, |c| {
        let fusion = Fusion::new(&c, ReduceOp::Sum, FusionOptions::with_cap(50_000))
            .with_compression(comp, true)?;
        let mut m = model(c.rank(), 0);
        fusion.step(|b| {
            for t in m.iter_mut() {
                b.push(t)?;
            }
            Ok(())
        })?;
        // Compression takes f32 tensors only; a bf16 tensor is refused at push.
        let mut h = [half::bf16::ONE; 10];
        let mut f = vec![1.0f32; 10];
        let fp16 = Fusion::new(&c, ReduceOp::Sum, FusionOptions::default())
            .with_compression(Compressor::Fp16, true)?;
        let e = fp16
            .step(|b| {
                b.push(&mut f)?;
                b.push(TensorMut::new(&mut h[..]))
            })
            .unwrap_err();
        assert!(
            e.to_string().contains("tensor #1") && e.to_string().contains("bfloat16"),
            "{e}"
        );
        // The step stopped at the error: the open bucket (holding the f32 tensor) was not
        // launched, so no rank runs a collective its peers might not run.
        assert_eq!(f, vec![1.0; 10], "the open bucket was not launched");
        // Without a lossy compressor every dtype goes through.
        Fusion::new(&c, ReduceOp::Sum, FusionOptions::default())
            .with_compression(Compressor::None, true)?
            .step(|b| b.push(TensorMut::new(&mut h[..])))?;
        assert!(h.iter().all(|x| x.to_f32() == 3.0));
        let e = Fusion::new(&c, ReduceOp::Max, FusionOptions::default())
            .with_compression(Compressor::Fp16, true)
            .unwrap_err();
        assert!(e.to_string().contains("max"), "{e}");
        Ok(m)
    });
    for m in &out[1..] {
        for (a, b) in m.iter().zip(&out[0]) {
            assert_eq!(bits(a), bits(b));
        }
    }
}

/// The top-k by the definition: magnitudes descending (NaN largest), lower index first among
/// equals; the first `k`, ascending.
fn top_k_reference(x: &[f32], k: usize) -> Vec<u32> {
    let key = |v: f32| {
        if v.is_nan() {
            f32::INFINITY.to_bits() + 1
        } else {
            v.abs().to_bits()
        }
    };
    let mut order: Vec<u32> = (0..x.len() as u32).collect();
    order.sort_by(|&a, &b| key(x[b as usize]).cmp(&key(x[a as usize])).then(a.cmp(&b)));
    let mut out = order[..k.min(x.len())].to_vec();
    out.sort_unstable();
    out
}

#[test]
fn top_k_of_large_inputs_equals_the_definition() {
    // Large enough for the sampled threshold; distributions with and without ties, a few
    // non-zeros among zeros (k reaches into the zeros), all equal (the guess keeps everything:
    // the full selection runs), NaNs, and a heavy tail.
    let mut rng = SplitMix64::new(7);
    let mut uniform =
        |scale: f32| (rng.next_u64() >> 40) as f32 / 16_777_216.0 * scale - scale / 2.0;
    for n in [65_536usize, 100_003, 262_147] {
        let dists: Vec<(&str, Vec<f32>)> = vec![
            ("uniform", (0..n).map(|_| uniform(2e-3)).collect()),
            (
                "8 levels",
                (0..n).map(|_| (uniform(8.0) as i32) as f32 * 0.5).collect(),
            ),
            (
                "sparse",
                (0..n)
                    .map(|i| if i % 997 == 0 { uniform(1.0) } else { 0.0 })
                    .collect(),
            ),
            ("equal", vec![0.125; n]),
            (
                "nan",
                (0..n)
                    .map(|i| {
                        if i % 50_000 == 3 {
                            f32::NAN
                        } else {
                            uniform(1.0)
                        }
                    })
                    .collect(),
            ),
            (
                "tail",
                (0..n)
                    .map(|_| {
                        let u = uniform(1.0);
                        u * u * u * 1e6
                    })
                    .collect(),
            ),
        ];
        let noise: Vec<f32> = (0..n).map(|_| uniform(1e-3)).collect();
        for (name, x) in &dists {
            for k in [1, 7, n / 1000, n / 100, n / 100 + 1, n / 9, n / 8] {
                assert_eq!(
                    top_k_indices(x, k),
                    top_k_reference(x, k),
                    "{name}, n {n}, k {k}"
                );
                // the one-pass form with error feedback: the top k of buf + residual
                for residual in [vec![0.0; n], noise.clone()] {
                    let sum: Vec<f32> = x.iter().zip(&residual).map(|(b, r)| b + r).collect();
                    let (mut buf, mut res) = (x.clone(), residual);
                    let (idx, vals) = top_k_take(&mut buf, &mut res, k);
                    let ctx = format!("top_k_take: {name}, n {n}, k {k}");
                    assert_eq!(idx, top_k_reference(&sum, k), "{ctx}");
                    assert_eq!(
                        bits(&vals),
                        idx.iter()
                            .map(|&i| sum[i as usize].to_bits())
                            .collect::<Vec<_>>(),
                        "{ctx}"
                    );
                    assert!(buf.iter().all(|v| v.to_bits() == 0), "{ctx}: buf cleared");
                    let mut left = sum;
                    for &i in &idx {
                        left[i as usize] = 0.0;
                    }
                    assert_eq!(bits(&res), bits(&left), "{ctx}: residual = the rest");
                }
            }
        }
    }
    // small inputs (the plain path) and the edges of k
    for (n, k) in [(0usize, 1usize), (1, 1), (5, 0), (5, 5), (5, 9), (1000, 10)] {
        let x: Vec<f32> = (0..n).map(|_| uniform(1.0)).collect();
        let (mut buf, mut res) = (x.clone(), vec![0.5; n]);
        let sum: Vec<f32> = x.iter().map(|b| b + 0.5).collect();
        let (idx, _) = top_k_take(&mut buf, &mut res, k);
        assert_eq!(idx, top_k_reference(&sum, k), "n {n}, k {k}");
        assert!(buf.iter().all(|v| v.to_bits() == 0));
    }
}

#[test]
fn prepared_top_k_gives_the_same_bits_and_checks_its_length() {
    ranks(3, TransportKind::Auto, |c| {
        let comp = Compressor::TopK(Density::Fraction(0.05));
        let (mut plain, mut ahead) = (CompressionState::new(comp)?, CompressionState::new(comp)?);
        for step in 0..3 {
            let mut a = gradient(c.rank(), 10_007, step);
            let mut b = a.clone();
            c.all_reduce_compressed(&mut a, ReduceOp::Mean, &mut plain)?;
            assert!(ahead.prepare(&mut b), "top-k with error feedback prepares");
            c.all_reduce_compressed(&mut b, ReduceOp::Mean, &mut ahead)?;
            assert_eq!(bits(&a), bits(&b), "step {step}");
            assert_eq!(
                bits(plain.residual()),
                bits(ahead.residual()),
                "step {step}"
            );
        }
        // other compressors and top-k without error feedback: nothing done ahead
        let mut v = gradient(c.rank(), 100, 0);
        assert!(!CompressionState::new(Compressor::INT8)?.prepare(&mut v));
        let mut no_ef = CompressionState::new(comp)?.with_error_feedback(false);
        assert!(!no_ef.prepare(&mut v));
        // prepared for one length, called with another: an error naming both
        let mut st = CompressionState::new(comp)?;
        assert!(st.prepare(&mut [1.0f32; 50]));
        let e = c
            .all_reduce_compressed(&mut vec![1.0f32; 60], ReduceOp::Sum, &mut st)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("prepared for another buffer (50 elements), called with 60 elements"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn top_k_parts_sum_in_rank_order_each_element_written_once() {
    // three ranks' picks over 10 elements, overlapping; the reference decodes each part in
    // rank order into zeros and divides every touched element once
    let picks: [&[(u32, f32)]; 3] = [
        &[(0, 1.0), (3, 0.1), (9, -2.0)],
        &[(3, 0.2), (4, 5.0), (9, 1e-8)],
        &[(1, 3.0), (3, 0.3), (4, -5.0)],
    ];
    let codec = TopK::new(3).unwrap();
    let mut all = Vec::new();
    for p in picks {
        let (idx, vals): (Vec<u32>, Vec<f32>) = p.iter().copied().unzip();
        let mut enc = vec![0u8; 24];
        TopK::write(&idx, &vals, &mut enc);
        all.extend(enc);
    }
    for divisor in [None, Some(3.0f32)] {
        let mut want = vec![0f32; 10];
        for part in all.chunks(24) {
            codec.decode_add(part, &mut want).unwrap();
        }
        if let Some(d) = divisor {
            for i in [0usize, 1, 3, 4, 9] {
                want[i] /= d;
            }
        }
        let mut got = vec![0f32; 10];
        TopK::sum_parts(&all, 24, &mut got, divisor).unwrap();
        assert_eq!(bits(&got), bits(&want), "divisor {divisor:?}");
    }
    // many ranks (the decode path above 16 parts) and few (the merge): the same bits
    let mut rng = SplitMix64::new(3);
    for world in [2usize, 16, 17, 40] {
        let (n, k) = (500usize, 40usize);
        let mut all = Vec::new();
        for _ in 0..world {
            let mut idx: Vec<u32> = Vec::new();
            while idx.len() < k {
                let i = (rng.next_u64() % n as u64) as u32;
                if !idx.contains(&i) {
                    idx.push(i);
                }
            }
            idx.sort_unstable();
            let vals: Vec<f32> = idx
                .iter()
                .map(|_| (rng.next_u64() >> 40) as f32 * 1e-3 - 8e3)
                .collect();
            let mut enc = vec![0u8; 8 * k];
            TopK::write(&idx, &vals, &mut enc);
            all.extend(enc);
        }
        let codec = TopK::new(k).unwrap();
        let mut want = vec![0f32; n];
        let mut touched = vec![false; n];
        for part in all.chunks(8 * k) {
            codec.decode_add(part, &mut want).unwrap();
            for i in TopK::indices(part).unwrap() {
                touched[i as usize] = true;
            }
        }
        for (w, t) in want.iter_mut().zip(&touched) {
            if *t {
                *w /= world as f32;
            }
        }
        let mut got = vec![0f32; n];
        TopK::sum_parts(&all, 8 * k, &mut got, Some(world as f32)).unwrap();
        assert_eq!(bits(&got), bits(&want), "{world} ranks");
    }
    // malformed: out of range, not ascending, ragged
    let mut got = vec![0f32; 4];
    let e = TopK::sum_parts(&all, 24, &mut got, None).unwrap_err();
    assert!(
        e.to_string().contains("is out of range for 4 elements"),
        "{e}"
    );
    let mut bad = vec![0u8; 16];
    TopK::write(&[5, 2], &[1.0, 1.0], &mut bad);
    let e = TopK::sum_parts(&bad, 16, &mut [0f32; 10], None).unwrap_err();
    assert!(e.to_string().contains("not ascending"), "{e}");
    assert!(TopK::sum_parts(&all[..20], 24, &mut [0f32; 10], None).is_err());
}

/// A NaN or an infinity in a gradient must stay visible after an int8 round trip (as NaN:
/// a gradient scaler checks exactly that), must not spoil the other elements of its block
/// (int8 gave `[-inf, -inf, -inf, -inf]` for `[inf, 1, 2, 3]` and a finite -6 for a NaN),
/// and error feedback must not carry it into later steps.
#[test]
fn int8_keeps_nan_and_infinity_visible_and_its_block_intact() {
    for x in [
        vec![f32::NAN, 1.0, 2.0, 3.0],
        vec![f32::INFINITY, 1.0, 2.0, 3.0],
        vec![1.0, f32::NEG_INFINITY, -2.0, 3.0],
        vec![0.0, f32::NAN, 0.0, 0.0],
        vec![f32::INFINITY, f32::NAN, f32::NEG_INFINITY, 0.0],
    ] {
        for sr in [false, true] {
            let mut codec = if sr {
                Int8Block::stochastic(4, 1)
            } else {
                Int8Block::new(4)
            }
            .unwrap();
            let mut enc = vec![0u8; codec.encoded_len(4)];
            codec.encode(&x, &mut enc).unwrap();
            let mut dec = vec![0f32; 4];
            codec.decode(&enc, &mut dec).unwrap();
            let m = x
                .iter()
                .filter(|v| v.is_finite())
                .fold(0f32, |m, v| m.max(v.abs()));
            for (v, d) in x.iter().zip(&dec) {
                if v.is_finite() {
                    assert!((v - d).abs() <= codec.error_bound(m), "{x:?} -> {dec:?}");
                } else {
                    assert!(d.is_nan(), "{x:?} -> {dec:?}");
                }
            }
            // Error feedback: nothing non-finite is kept, and the next step is clean.
            let mut residual = vec![0f32; 4];
            codec
                .encode_keeping_error(&x, &mut residual, &mut enc)
                .unwrap();
            assert!(
                residual.iter().all(|r| r.is_finite()),
                "{x:?}: {residual:?}"
            );
            let clean = [1.0f32, 2.0, 3.0, 4.0];
            codec
                .encode_keeping_error(&clean, &mut residual, &mut enc)
                .unwrap();
            codec.decode(&enc, &mut dec).unwrap();
            assert!(
                dec.iter().all(|d| d.is_finite()),
                "{x:?} then clean: {dec:?}"
            );
        }
    }
}

/// Error feedback of every codec forgets a non-finite error: one NaN step must not leave the
/// element NaN in every later step.
#[test]
fn error_feedback_does_not_carry_a_nan_into_later_steps() {
    let codecs: Vec<(&str, Box<dyn Codec>)> = vec![
        ("fp16", Box::new(Half::F16)),
        ("bf16", Box::new(Half::Bf16)),
        ("int8", Box::new(Int8Block::new(4).unwrap())),
        ("sign", Box::new(SignBlock::new(4).unwrap())),
        ("topk", Box::new(TopK::new(2).unwrap())),
    ];
    for (name, mut codec) in codecs {
        let mut residual = vec![0f32; 8];
        let mut enc = vec![0u8; codec.encoded_len(8)];
        let mut x = vec![1.0f32; 8];
        x[3] = f32::NAN;
        codec
            .encode_keeping_error(&x, &mut residual, &mut enc)
            .unwrap();
        let mut dec = vec![0f32; 8];
        for _ in 0..3 {
            codec
                .encode_keeping_error(&[1.0; 8], &mut residual, &mut enc)
                .unwrap();
            codec.decode(&enc, &mut dec).unwrap();
        }
        assert!(dec.iter().all(|d| d.is_finite()), "{name}: {dec:?}");
        assert!(
            residual.iter().all(|r| r.is_finite()),
            "{name}: {residual:?}"
        );
    }
}

/// End to end: a compressed all-reduce (int8, 2 and 3 ranks, both transports) in which one
/// rank's gradient holds a NaN and another's an infinity gives NaN at those elements and the
/// right sums elsewhere.
#[test]
fn a_compressed_all_reduce_keeps_non_finite_elements_visible() {
    let n = 64;
    for world in [2usize, 3] {
        for transport in [TransportKind::Tcp, TransportKind::Auto] {
            let out = ranks(world, transport, |c| {
                let mut state = CompressionState::new(Compressor::INT8)?;
                let mut g: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
                match c.rank() {
                    0 => g[5] = f32::NAN,
                    1 => g[40] = f32::INFINITY,
                    _ => {}
                }
                c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut state)?;
                Ok(g)
            });
            for g in out {
                for (i, v) in g.iter().enumerate() {
                    if i == 5 || i == 40 {
                        assert!(v.is_nan(), "{world} ranks {transport:?}: element {i} = {v}");
                    } else {
                        let want = world as f32 * ((i % 7) as f32 - 3.0);
                        assert!(
                            (v - want).abs() <= 0.1 * world as f32,
                            "element {i}: {v} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// Random-k sends only its sample: a NaN or infinity outside it must still show in its
/// step's result (any non-finite element: a gradient scaler skips the step), and must not be
/// kept in the residual to come out at whichever later step samples it (it did, 2026-12-07).
/// With and without error feedback, 2 and 3 ranks, both transports.
#[test]
fn random_k_shows_a_non_finite_element_in_its_own_step_only() {
    let n = 256;
    for world in [2usize, 3] {
        for transport in [TransportKind::Tcp, TransportKind::Auto] {
            for error_feedback in [true, false] {
                let out = ranks(world, transport, |c| {
                    let mut state = CompressionState::new(Compressor::RandomK {
                        density: Density::Count(8),
                        seed: 7,
                    })?
                    .with_error_feedback(error_feedback);
                    let mut steps = Vec::new();
                    for step in 0..14 {
                        let mut g = vec![1.0f32; n];
                        if step < 10 && c.rank() == 1 {
                            // one NaN or infinity a step, which the sample of 8 mostly misses
                            g[(37 * step + 5) % n] = if step % 2 == 0 {
                                f32::NAN
                            } else {
                                f32::INFINITY
                            };
                        }
                        c.all_reduce_compressed(&mut g, ReduceOp::Sum, &mut state)?;
                        steps.push(g.iter().filter(|v| !v.is_finite()).count());
                    }
                    Ok(steps)
                });
                for (rank, steps) in out.iter().enumerate() {
                    let what = format!(
                        "{world} ranks, {transport:?}, error feedback {error_feedback}, rank {rank}: non-finite elements per step {steps:?}"
                    );
                    assert!(steps[..10].iter().all(|&k| k > 0), "{what}");
                    assert!(steps[10..].iter().all(|&k| k == 0), "{what}");
                }
            }
        }
    }
}
