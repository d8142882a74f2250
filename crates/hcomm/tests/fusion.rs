//! Fusion: fused all-reduces equal unfused ones bitwise (integer-valued data, several dtypes
//! and sizes, 1–4 ranks, TCP and shared memory), with the bucketer fed one tensor at a time.

use half::bf16;
use hcomm::config::TransportKind;
use hcomm::fusion::{Fusion, FusionOptions, TensorMut};
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Communicator, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

fn ranks<F>(n: usize, transport: TransportKind, f: F)
where
    F: Fn(Arc<Communicator>) -> hcomm::Result<()> + Sync,
{
    let t = Duration::from_secs(30);
    expect_all(run_threads_with(n, transport, t, |c| f(Arc::new(c))));
}

/// A model's worth of gradients: mixed sizes (0, 1, odd, large) and three dtypes.
struct Grads {
    f: Vec<Vec<f32>>,
    b: Vec<Vec<bf16>>,
    i: Vec<Vec<i32>>,
}

fn grads(rank: usize) -> Grads {
    let sizes = [0usize, 1, 7, 1000, 3, 40_000, 129, 5, 250_000, 2];
    let v = |k: usize, j: usize| ((rank * 7 + k * 3 + j) % 13) as f32 - 6.0;
    Grads {
        f: sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|j| v(k, j)).collect())
            .collect(),
        b: sizes[..6]
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|j| bf16::from_f32(v(k + 20, j))).collect())
            .collect(),
        i: sizes[3..]
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|j| v(k + 40, j) as i32).collect())
            .collect(),
    }
}

#[test]
fn fused_equals_unfused_bitwise() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for n in 1..=4 {
            ranks(n, transport, |c| {
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
                    let mut want = grads(c.rank());
                    for t in &mut want.f {
                        c.all_reduce_in_place(t, op)?;
                    }
                    for t in &mut want.b {
                        c.all_reduce_in_place(t, op)?;
                    }
                    for t in &mut want.i {
                        c.all_reduce_in_place(t, op)?;
                    }
                    for opts in [
                        FusionOptions::default(),
                        FusionOptions::with_cap(4096),
                        FusionOptions {
                            cap_bytes: 200_000,
                            first_bucket_bytes: 100,
                            direct_bytes: 100_000,
                            skip_zero_blocks: false,
                            encode_on_push: false,
                        },
                        FusionOptions {
                            skip_zero_blocks: true,
                            ..FusionOptions::with_cap(300_000)
                        },
                    ] {
                        let mut got = grads(c.rank());
                        // Interleave dtypes, last tensor first (backward order).
                        let mut list: Vec<TensorMut> = Vec::new();
                        let mut fs = got.f.iter_mut().rev();
                        let mut bs = got.b.iter_mut().rev();
                        let mut is = got.i.iter_mut().rev();
                        loop {
                            let mut any = false;
                            if let Some(t) = fs.next() {
                                list.push(t.into());
                                any = true;
                            }
                            if let Some(t) = bs.next() {
                                list.push(t.into());
                                any = true;
                            }
                            if let Some(t) = is.next() {
                                list.push(t.into());
                                any = true;
                            }
                            if !any {
                                break;
                            }
                        }
                        c.all_reduce_coalesced(list, op, opts)?;
                        assert_eq!(got.f, want.f, "f32 {op:?} {opts:?}");
                        let bits = |v: &Vec<Vec<bf16>>| -> Vec<Vec<u16>> {
                            v.iter()
                                .map(|t| t.iter().map(|x| x.to_bits()).collect())
                                .collect()
                        };
                        assert_eq!(bits(&got.b), bits(&want.b), "bf16 {op:?} {opts:?}");
                        assert_eq!(got.i, want.i, "i32 {op:?} {opts:?}");
                    }
                }
                Ok(())
            });
        }
    }
}

#[test]
fn bucketer_launches_while_tensors_arrive_and_reuses_its_buffers() {
    ranks(3, TransportKind::Auto, |c| {
        let opts = FusionOptions {
            direct_bytes: 200_000,
            ..FusionOptions::with_cap(100_000)
        };
        let fusion = Fusion::new(&c, ReduceOp::Sum, opts);
        for step in 0..3 {
            // 50 tensors of 40 kB (packed, 2 per bucket) and every tenth one of 400 kB (direct).
            let mut layers: Vec<Vec<f32>> = (0..50)
                .map(|k| vec![(k + step) as f32; if k % 10 == 0 { 100_000 } else { 10_000 }])
                .collect();
            let launched = fusion.step(|b| {
                for (k, l) in layers.iter_mut().enumerate().rev() {
                    b.push(l)?;
                    if k == 25 {
                        // Half the tensors in: buckets are already on their way.
                        assert!(b.buckets_launched() >= 5, "{}", b.buckets_launched());
                    }
                }
                b.flush();
                Ok(b.buckets_launched())
            })?;
            assert_eq!(launched, 5 + 23, "5 direct, 45 packed two by two");
            for (k, l) in layers.iter().enumerate() {
                assert!(
                    l.iter().all(|&x| x == 3.0 * (k + step) as f32),
                    "tensor {k}"
                );
            }
            // Buffers came back to the pool (and are reused on the next step).
            assert!(
                fusion.pool().idle_bytes() >= 80_000,
                "{}",
                fusion.pool().idle_bytes()
            );
        }
        Ok(())
    });
}

#[test]
fn a_panic_in_the_step_waits_for_buckets_in_flight() {
    ranks(2, TransportKind::Auto, |c| {
        let fusion = Fusion::new(&c, ReduceOp::Sum, FusionOptions::default());
        let mut big = vec![1.0f32; 1 << 20]; // direct: reduced in place
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = fusion.step(|b| -> hcomm::Result<()> {
                b.push(&mut big)?;
                panic!("user code failed mid-step");
            });
        }));
        assert!(r.is_err());
        // The step waited: the in-place all-reduce is complete and the buffer is ours again.
        assert!(big.iter().all(|&x| x == 2.0));
        Ok(())
    });
}

#[test]
fn fusion_errors_come_back_from_finish() {
    ranks(2, TransportKind::Auto, |c| {
        if c.rank() == 0 {
            c.abort();
            let mut t = vec![1.0f32; 10];
            let e = c
                .all_reduce_coalesced(
                    vec![(&mut t).into()],
                    ReduceOp::Sum,
                    FusionOptions::default(),
                )
                .unwrap_err();
            assert!(matches!(e, hcomm::Error::Aborted { .. }), "{e}");
        }
        Ok(())
    });
}
