//! `CompressionState::prepare` (top-k's local part done ahead, `FusionOptions::encode_on_push`):
//! the same bits as without it, and no prepared encoding is ever used for another call or
//! lost: refused calls give it back to the residual, a second prepare does nothing, clones and
//! error feedback turned off drop it. (Written by a review of the first version, which failed
//! every one of these.)
use hcomm::compress::{mix_seed, SplitMix64};
use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Communicator, CompressionState, Compressor, Density, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

fn ranks<R: Send, F>(n: usize, f: F) -> Vec<R>
where
    F: Fn(Arc<Communicator>) -> hcomm::Result<R> + Sync,
{
    expect_all(run_threads_with(
        n,
        TransportKind::Tcp,
        Duration::from_secs(60),
        |c| f(Arc::new(c)),
    ))
}

fn gradient(rank: usize, n: usize, step: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(mix_seed(&[rank as u64, step, 99]));
    (0..n).map(|_| rng.next_unit_f32() - 0.5).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const TOPK: Compressor = Compressor::TopK(Density::Fraction(0.05));

/// A call refused after prepare must not leave the encoding for the next call (which would
/// then send stale picks and leave its own buffer unreduced: ranks would disagree).
#[test]
fn stale_prepared_after_a_refused_call_breaks_rank_agreement() {
    let results = ranks(2, |c| {
        let mut st = CompressionState::new(TOPK)?;
        let mut a = gradient(c.rank(), 1000, 0);
        let a0 = a.clone();
        assert!(st.prepare(&mut a));
        let e = c.all_reduce_compressed(&mut a, ReduceOp::Max, &mut st);
        assert!(e.is_err(), "max is refused");
        // "InvalidArgument, nothing sent" -- but the input is gone already
        let a_lost = a.iter().all(|&x| x == 0.0) && a0.iter().any(|&x| x != 0.0);
        let mut b = gradient(c.rank(), 1000, 1);
        c.all_reduce_compressed(&mut b, ReduceOp::Sum, &mut st)?;
        Ok((a_lost, bits(&b)))
    });
    let differ = results[0]
        .1
        .iter()
        .zip(&results[1].1)
        .filter(|(x, y)| x != y)
        .count();
    assert_eq!(
        differ, 0,
        "ranks disagree on {differ} of 1000 elements after a stale prepared encoding"
    );
    let _ = results[0].0;
}

/// A call refused after prepare: the prepared buffer's values are in the residual (nothing
/// lost; the next call sends them), the buffer itself stays cleared.
#[test]
fn refused_call_after_prepare_gives_the_values_back_to_the_residual() {
    ranks(1, |c| {
        let mut st = CompressionState::new(TOPK)?;
        let input = gradient(0, 1000, 0);
        let mut a = input.clone();
        assert!(st.prepare(&mut a));
        assert!(c
            .all_reduce_compressed(&mut a, ReduceOp::Max, &mut st)
            .is_err());
        assert!(a.iter().all(|&x| x == 0.0));
        assert_eq!(bits(st.residual()), bits(&input));
        // another buffer than the prepared one: refused the same way
        let mut b = input.clone();
        let mut st2 = CompressionState::new(TOPK)?;
        assert!(st2.prepare(&mut b));
        let mut other = input.clone();
        let e = c
            .all_reduce_compressed(&mut other, ReduceOp::Sum, &mut st2)
            .unwrap_err();
        assert!(e.to_string().contains("prepared for another buffer"), "{e}");
        assert_eq!(bits(st2.residual()), bits(&input));
        Ok(())
    });
}

/// Same, the stale encoding reaching a correctly-sized call: the second buffer's values are
/// never sent nor kept in the residual (error feedback's conservation law breaks).
#[test]
fn stale_prepared_loses_the_next_input_world1() {
    ranks(1, |c| {
        let mut st = CompressionState::new(TOPK)?;
        let mut a = gradient(0, 1000, 0);
        st.prepare(&mut a);
        let _ = c.all_reduce_compressed(&mut a, ReduceOp::Max, &mut st);
        // conservation at world 1 with top-k: result + new residual == input + old residual
        let old_res = st.residual().to_vec();
        let b_in = gradient(0, 1000, 1);
        let mut b = b_in.clone();
        c.all_reduce_compressed(&mut b, ReduceOp::Sum, &mut st)?;
        let bad = (0..1000)
            .filter(|&i| b[i] + st.residual()[i] != b_in[i] + old_res[i])
            .count();
        assert_eq!(
            bad, 0,
            "{bad} of 1000 elements break result + residual == input + old residual"
        );
        Ok(())
    });
}

/// Two prepares without a call: the second does nothing, the first one's picks are sent.
#[test]
fn second_prepare_silently_drops_the_first_ones_picks() {
    ranks(1, |c| {
        let mut st = CompressionState::new(TOPK)?;
        let input = gradient(0, 1000, 0);
        let mut a = input.clone();
        assert!(st.prepare(&mut a));
        assert!(!st.prepare(&mut a), "a second prepare does nothing"); // e.g. a retry of a push
        c.all_reduce_compressed(&mut a, ReduceOp::Sum, &mut st)?;
        let bad = (0..1000)
            .filter(|&i| a[i] + st.residual()[i] != input[i])
            .count();
        assert_eq!(bad, 0, "{bad} elements lost: result + residual != input");
        Ok(())
    });
}

/// reset() between prepare and the call forgets the encoding with the residual (documented):
/// the call then reduces the cleared buffer, and nothing stale is sent.
#[test]
fn reset_between_prepare_and_call_forgets_the_encoding() {
    ranks(1, |c| {
        let mut st = CompressionState::new(TOPK)?;
        let mut a = gradient(0, 1000, 0);
        st.prepare(&mut a);
        st.reset();
        c.all_reduce_compressed(&mut a, ReduceOp::Sum, &mut st)?;
        assert!(a.iter().all(|&x| x == 0.0));
        assert!(st.residual().iter().all(|&x| x == 0.0));
        Ok(())
    });
}

/// A clone made between prepare and the call does not carry the encoding.
#[test]
fn clone_after_prepare_carries_the_encoding() {
    ranks(1, |c| {
        let mut st = CompressionState::new(TOPK)?;
        let mut a = gradient(0, 1000, 0);
        st.prepare(&mut a);
        let mut copy = st.clone();
        let mut other = gradient(0, 1000, 5);
        let other_in = other.clone();
        c.all_reduce_compressed(&mut a, ReduceOp::Sum, &mut st)?;
        c.all_reduce_compressed(&mut other, ReduceOp::Sum, &mut copy)?;
        // at world 1 a top-k (k = 50 of 1000) result has at most 50 non-zero elements
        let nonzero = other.iter().filter(|&&x| x != 0.0).count();
        let kept_own = (0..1000).filter(|&i| other[i] == other_in[i]).count();
        assert!(nonzero <= 50, "clone's call was not top-k of its input: {nonzero} non-zeros, {kept_own} raw inputs kept");
        Ok(())
    });
}

/// with_error_feedback(false) after prepare drops the encoding with the residual.
#[test]
fn error_feedback_off_after_prepare_keeps_the_encoding() {
    let mut st = CompressionState::new(TOPK).unwrap();
    let mut a = gradient(0, 1000, 0);
    st.prepare(&mut a);
    let st = st.with_error_feedback(false);
    let dbg = format!("{st:?}");
    assert!(
        dbg.contains("prepared: Pending(None)"),
        "prepared survives with_error_feedback(false): {dbg}"
    );
}

/// encode_on_push on vs off: the same bits, for aligned and misaligned direct tensors,
/// packed buckets, sum and mean, sampled (large) and small top-k, k >= n.
#[test]
fn fusion_encode_on_push_is_bit_identical_incl_misaligned() {
    use hcomm::fusion::{Fusion, FusionOptions, TensorMut};
    use hcomm::DType;
    for comp in [
        Compressor::TopK(Density::Fraction(0.01)),
        Compressor::TopK(Density::Count(3)),
    ] {
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let sizes = [0usize, 2, 5, 1000, 70_000, 300_000, 3];
            let run = |encode_on_push: bool| {
                ranks(2, |c| {
                    let opts = FusionOptions {
                        cap_bytes: 100_000,
                        first_bucket_bytes: 10_000,
                        direct_bytes: 200_000,
                        skip_zero_blocks: false,
                        encode_on_push,
                    };
                    let fusion = Fusion::new(&c, op, opts).with_compression(comp, true)?;
                    let mut out = Vec::new();
                    for step in 0..3u64 {
                        // every tensor stored at byte offset 1 (misaligned) or 0
                        let mut stores: Vec<Vec<u8>> = sizes
                            .iter()
                            .enumerate()
                            .map(|(k, &n)| {
                                let g = gradient(c.rank() * 7 + k, n, step);
                                let off = k % 2;
                                let mut v = vec![0u8; 4 * n + off];
                                v[off..].copy_from_slice(bytemuck::cast_slice(&g));
                                v
                            })
                            .collect();
                        fusion.step(|b| {
                            for (k, s) in stores.iter_mut().enumerate() {
                                let off = k % 2;
                                b.push(TensorMut::from_bytes(DType::F32, &mut s[off..])?)?;
                            }
                            Ok(())
                        })?;
                        out.push(stores);
                    }
                    Ok(out)
                })
            };
            assert_eq!(run(false), run(true), "{comp} {op}");
        }
    }
}
