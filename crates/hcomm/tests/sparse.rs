//! Sparse all-reduce against a dense reference: 1–4 ranks, TCP and shared memory, ranks with
//! different row counts (including none), repeated indices, f32/f64/bf16/i32, sum and mean,
//! and every rank getting identical bits.

use half::bf16;
use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Communicator, Element, Error, ReduceOp, SparseRows};
use std::sync::Arc;
use std::time::Duration;

const ROWS: usize = 50;

fn ranks<R: Send, F>(n: usize, transport: TransportKind, f: F) -> Vec<R>
where
    F: Fn(Arc<Communicator>) -> hcomm::Result<R> + Sync,
{
    expect_all(run_threads_with(
        n,
        transport,
        Duration::from_secs(30),
        |c| f(Arc::new(c)),
    ))
}

/// Rank `r`'s rows: a rank-dependent subset of the table (rank 2 has none), with repeats.
fn rows_of(rank: usize, row_len: usize) -> (Vec<i64>, Vec<f64>) {
    let idx: Vec<i64> = match rank {
        2 => vec![],
        _ => (0..(7 + 5 * rank))
            .map(|k| ((k * (rank + 3) + rank) % ROWS) as i64)
            .collect(),
    };
    let vals = (0..idx.len() * row_len)
        .map(|j| ((j * 7 + rank * 13) % 11) as f64 - 5.0)
        .collect();
    (idx, vals)
}

/// The dense reference: every rank's rows added into a `ROWS × row_len` table, summed in f64
/// (the values are small integers, exact in every dtype tested).
fn dense_reference(n: usize, row_len: usize, mean: bool) -> Vec<f64> {
    let mut t = vec![0.0; ROWS * row_len];
    for r in 0..n {
        let (idx, vals) = rows_of(r, row_len);
        for (k, &i) in idx.iter().enumerate() {
            for c in 0..row_len {
                t[i as usize * row_len + c] += vals[k * row_len + c];
            }
        }
    }
    if mean {
        t.iter_mut().for_each(|x| *x /= n as f64);
    }
    t
}

fn check<T: Element + Into<f64> + FromF64>(transport: TransportKind, n: usize, row_len: usize) {
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let got = ranks(n, transport, |c| {
            let (idx, vals) = rows_of(c.rank(), row_len);
            let vals: Vec<T> = vals.into_iter().map(T::from_f64).collect();
            if c.rank() % 2 == 1 {
                c.sparse_all_reduce_async(idx, vals, row_len, op).wait()
            } else {
                c.sparse_all_reduce(&idx, &vals, row_len, op)
            }
        });
        let mut want = dense_reference(n, row_len, op == ReduceOp::Mean);
        if !T::DTYPE.is_float() {
            want.iter_mut().for_each(|x| *x = x.trunc()); // integer mean truncates
        }
        for (r, rows) in got.iter().enumerate() {
            assert_eq!(
                rows.indices, got[0].indices,
                "rank {r}'s indices differ from rank 0's"
            );
            let bits = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
            assert_eq!(
                bits(&rows.values),
                bits(&got[0].values),
                "rank {r}'s bits differ"
            );
            assert!(
                rows.indices.windows(2).all(|w| w[0] < w[1]),
                "indices ascending, unique"
            );
            let mut dense = vec![T::from_f64(0.0); ROWS * row_len];
            rows.add_to_dense(&mut dense).unwrap();
            let dense: Vec<f64> = dense.into_iter().map(Into::into).collect();
            for (j, (g, w)) in dense.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-2 * w.abs().max(1.0),
                    "{n} ranks {op} row_len {row_len}: element {j}: got {g}, want {w}"
                );
            }
            // every row a rank touched is present, even where the sum is zero
            let touched: std::collections::BTreeSet<i64> =
                (0..n).flat_map(|r| rows_of(r, row_len).0).collect();
            assert_eq!(rows.indices, touched.into_iter().collect::<Vec<_>>());
        }
    }
}

trait FromF64 {
    fn from_f64(x: f64) -> Self;
}
impl FromF64 for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}
impl FromF64 for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
}
impl FromF64 for i32 {
    fn from_f64(x: f64) -> Self {
        x as i32
    }
}
impl FromF64 for bf16 {
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

#[test]
fn sparse_all_reduce_matches_the_dense_reference() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for n in 1..=4 {
            check::<f32>(transport, n, 3);
            check::<f64>(transport, n, 1);
            check::<i32>(transport, n, 4);
            check::<bf16>(transport, n, 2);
        }
    }
}

#[test]
fn rows_of_zero_length_and_empty_ranks() {
    let got = ranks(3, TransportKind::Auto, |c| {
        let idx: Vec<i64> = if c.rank() == 0 { vec![4, 1] } else { vec![] };
        c.sparse_all_reduce::<f32>(&idx, &[], 0, ReduceOp::Sum)
    });
    for g in got {
        assert_eq!(g.indices, vec![1, 4]);
        assert!(g.values.is_empty());
    }
    let got = ranks(2, TransportKind::Tcp, |c| {
        c.sparse_all_reduce::<f32>(&[], &[], 8, ReduceOp::Mean)
    });
    assert!(got
        .iter()
        .all(|g| g.indices.is_empty() && g.values.is_empty()));
}

#[test]
fn large_rows_over_both_transports() {
    // an embedding-sized exchange: 2,000 rows of 512 floats per rank; rank 0 has the even
    // rows below 4,000, rank 1 the multiples of 3 below 6,000, so multiples of 6 are shared
    let value = |rank: usize, k: usize, c: usize| ((rank * 3 + k + c) % 7) as f32;
    let row_of = |rank: usize, k: usize| (k * (rank + 2)) as i64;
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        let got = ranks(2, transport, |c| {
            let r = c.rank();
            let idx: Vec<i64> = (0..2000).map(|k| row_of(r, k)).collect();
            let vals: Vec<f32> = (0..2000 * 512)
                .map(|j| value(r, j / 512, j % 512))
                .collect();
            c.sparse_all_reduce(&idx, &vals, 512, ReduceOp::Sum)
        });
        assert_eq!(got[0], got[1]);
        let mut want: std::collections::BTreeMap<i64, Vec<f32>> = Default::default();
        for r in 0..2 {
            for k in 0..2000 {
                let row = want.entry(row_of(r, k)).or_insert_with(|| vec![0.0; 512]);
                for (c, x) in row.iter_mut().enumerate() {
                    *x += value(r, k, c);
                }
            }
        }
        assert_eq!(got[0].indices, want.keys().copied().collect::<Vec<_>>());
        assert_eq!(
            got[0].values,
            want.into_values().flatten().collect::<Vec<_>>()
        );
    }
}

#[test]
fn disagreements_and_bad_arguments_are_clear_errors() {
    let results = run_threads_with(2, TransportKind::Tcp, Duration::from_secs(30), |c| {
        let row_len = if c.rank() == 0 { 4 } else { 3 };
        c.sparse_all_reduce::<f32>(&[1], &vec![1.0; row_len], row_len, ReduceOp::Sum)
    });
    for (r, res) in results.into_iter().enumerate() {
        let e = res.unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {e}");
        let s = e.to_string();
        assert!(
            s.contains("rows of 4 float") && s.contains("rows of 3 float"),
            "{s}"
        );
    }
    let results = run_threads_with(1, TransportKind::Tcp, Duration::from_secs(30), |c| {
        let a = c.sparse_all_reduce::<f32>(&[1], &[1.0; 3], 4, ReduceOp::Sum);
        let b = c.sparse_all_reduce::<f32>(&[1], &[1.0; 4], 4, ReduceOp::Max);
        let d = c.sparse_all_reduce::<f32>(&[-2], &[1.0; 4], 4, ReduceOp::Sum);
        Ok([a.unwrap_err(), b.unwrap_err(), d.unwrap_err()].map(|e| e.to_string()))
    });
    let [a, b, d] = results.into_iter().next().unwrap().unwrap();
    assert!(a.contains("expected 1 rows × 4 float"), "{a}");
    assert!(b.contains("op max") && b.contains("sum or mean"), "{b}");
    assert!(d.contains("indices[0] is -2"), "{d}");
}

#[test]
fn sparse_rows_type_is_usable() {
    let r = SparseRows {
        indices: vec![2],
        values: vec![1i32, 2],
        row_len: 2,
    };
    let mut d = vec![0i32; 6];
    r.add_to_dense(&mut d).unwrap();
    assert_eq!(d, vec![0, 0, 0, 0, 1, 2]);
}

#[test]
fn bad_arguments_on_one_rank_fail_every_rank_at_once() {
    // Rank 1 passes an op sparse tensors do not have: it gets the InvalidArgument, the others
    // an error naming it (not a timeout waiting in the gathers).
    let results = run_threads_with(3, TransportKind::Auto, Duration::from_secs(30), |c| {
        c.set_timeout(Duration::from_secs(20));
        let op = if c.rank() == 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        c.sparse_all_reduce::<f32>(&[0], &[1.0; 2], 2, op)
    });
    for (r, res) in results.into_iter().enumerate() {
        let e = res.unwrap_err();
        if r == 1 {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        } else {
            assert!(matches!(e, Error::Remote { peer: 1, .. }), "rank {r}: {e}");
            assert!(
                e.to_string()
                    .contains("rank 1 called sparse_all_reduce with invalid arguments"),
                "{e}"
            );
        }
    }
}

/// Ranks whose tensors have different numbers of rows (said with `table_rows`) all fail,
/// naming the rank; so do all when one rank's index lies beyond its tensor. Before
/// 2026-12-07 the first gave results of different shapes, the second failed one rank only.
#[test]
fn tensors_of_different_sizes_and_rows_beyond_the_tensor_fail_every_rank() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        let results = run_threads_with(3, transport, Duration::from_secs(30), |c| {
            let table = if c.rank() == 2 { 5 } else { 4 };
            c.sparse_all_reduce_table_bytes(
                &[0, 2],
                bytemuck::cast_slice(&[1.0f32, 2.0]),
                1,
                Some(table),
                hcomm::DType::F32,
                ReduceOp::Sum,
            )
        });
        for (r, res) in results.into_iter().enumerate() {
            let e = res.unwrap_err();
            assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {e}");
            assert!(
                e.to_string()
                    .contains("rank 0's tensor has 4 rows, rank 2's 5"),
                "rank {r}: {e}"
            );
        }
        // A rank that does not give its number of rows fails with the others, not in the
        // gathers at its timeout.
        let results = run_threads_with(3, transport, Duration::from_secs(30), |c| {
            let table = [Some(4), Some(5), None][c.rank()];
            c.sparse_all_reduce_table_bytes(
                &[0],
                bytemuck::cast_slice(&[1.0f32]),
                1,
                table,
                hcomm::DType::F32,
                ReduceOp::Sum,
            )
        });
        for (r, res) in results.into_iter().enumerate() {
            let e = res.unwrap_err();
            assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {e}");
            assert!(
                e.to_string()
                    .contains("rank 0's tensor has 4 rows, rank 1's 5"),
                "rank {r}: {e}"
            );
        }
        let results = run_threads_with(2, transport, Duration::from_secs(30), |c| {
            let row = if c.rank() == 1 { 999_999 } else { 2 };
            c.sparse_all_reduce_table_bytes(
                &[0, row],
                bytemuck::cast_slice(&[1.0f32, 2.0]),
                1,
                Some(4),
                hcomm::DType::F32,
                ReduceOp::Sum,
            )
        });
        for (r, res) in results.into_iter().enumerate() {
            let e = res.unwrap_err();
            let s = e.to_string();
            if r == 1 {
                assert!(
                    s.contains("indices[1] is 999999, beyond this rank's tensor of 4 rows"),
                    "{s}"
                );
            } else {
                assert!(matches!(e, Error::Remote { peer: 1, .. }), "rank {r}: {e}");
            }
        }
        // The same size everywhere (and ranks that do not say it) is fine.
        let out = ranks(2, transport, |c| {
            let table = (c.rank() == 0).then_some(4);
            c.sparse_all_reduce_table_bytes(
                &[3],
                bytemuck::cast_slice(&[1.0f32]),
                1,
                table,
                hcomm::DType::F32,
                ReduceOp::Sum,
            )
        });
        for (idx, vals) in out {
            assert_eq!(idx, vec![3]);
            assert_eq!(vals, 2.0f32.to_ne_bytes().to_vec());
        }
    }
}

/// Rank `r`'s dense tensor of `len` elements for the zero-skipping all-reduce: zero except a
/// few rank-dependent runs (an embedding gradient's rows), a `-0.0` on rank 1, and, with
/// `dense`, non-zero everywhere. Integer-valued, so every summation order gives the same sum.
fn mostly_zero(rank: usize, len: usize, dense: bool) -> Vec<f32> {
    let mut v = vec![0f32; len];
    for (j, x) in v.iter_mut().enumerate() {
        let run = (j / 300) % (13 + 4 * rank) == 0;
        if dense || run {
            *x = ((j * 7 + rank * 13) % 11) as f32 - 5.0;
        }
    }
    if rank == 1 && len > 1000 {
        v[1000] = -0.0;
    }
    v
}

#[test]
fn skipping_zeros_equals_the_dense_all_reduce() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for n in 1..=4 {
            // short of 64 blocks (dense path), whole blocks, and a short last block
            for len in [0usize, 1, 5_000, 64 * 256, 100_003] {
                for (dense, op) in [
                    (false, ReduceOp::Sum),
                    (false, ReduceOp::Mean),
                    (true, ReduceOp::Sum),
                    (false, ReduceOp::Max),
                ] {
                    let runs = ranks(n, transport, |c| {
                        let mut want = mostly_zero(c.rank(), len, dense);
                        c.all_reduce_in_place(&mut want, op)?;
                        let mut got = mostly_zero(c.rank(), len, dense);
                        let sparse = c.all_reduce_skipping_zeros(&mut got, op)?;
                        let traffic = c.traffic();
                        Ok((want, got, sparse, traffic))
                    });
                    let ctx =
                        format!("{n} ranks, {len} elements, dense {dense}, {op:?}, {transport:?}");
                    for (r, (want, got, sparse, _)) in runs.iter().enumerate() {
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(got), bits(want), "rank {r}: {ctx}");
                        // the sparse path runs exactly where it moves fewer bytes
                        let expect_sparse =
                            n > 1 && len >= 64 * 256 && !dense && op != ReduceOp::Max;
                        assert_eq!(*sparse, expect_sparse, "rank {r}: {ctx}");
                    }
                    if runs[0].2 {
                        // fewer bytes than the dense ring's 2 (n - 1) / n of the tensor
                        let sent: u64 = runs[0]
                            .3
                            .iter()
                            .filter(|t| t.op == "all_reduce_skipping_zeros")
                            .map(|t| t.bytes_sent())
                            .sum();
                        let dense_bytes = (8 * (n - 1) * len / n) as u64;
                        assert!(
                            sent > 0 && sent < dense_bytes / 2,
                            "sent {sent} of {dense_bytes}: {ctx}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn skipping_zeros_other_dtypes_and_disagreements() {
    ranks(3, TransportKind::Auto, |c| {
        // f64 and i32: rank-order sums of the blocks equal the dense result
        let mut a: Vec<f64> = mostly_zero(c.rank(), 40_000, false)
            .iter()
            .map(|&x| x as f64)
            .collect();
        let mut b = a.clone();
        c.all_reduce_in_place(&mut a, ReduceOp::Mean)?;
        assert!(c.all_reduce_skipping_zeros(&mut b, ReduceOp::Mean)?);
        assert_eq!(a, b);
        let mut a: Vec<i32> = mostly_zero(c.rank(), 40_000, false)
            .iter()
            .map(|&x| x as i32)
            .collect();
        let mut b = a.clone();
        c.all_reduce_in_place(&mut a, ReduceOp::Sum)?;
        assert!(c.all_reduce_skipping_zeros(&mut b, ReduceOp::Sum)?);
        assert_eq!(a, b);
        // all zero: nothing but the counts travels, the result is zero
        let mut z = vec![0f32; 70_000];
        assert!(c.all_reduce_skipping_zeros(&mut z, ReduceOp::Sum)?);
        assert!(z.iter().all(|x| x.to_bits() == 0));
        // a byte length that is not whole elements: an invalid argument, as for all_reduce
        let mut odd = vec![0u8; 65 * 1024 + 2];
        let e = c
            .all_reduce_skipping_zeros_bytes(&mut odd, hcomm::DType::F32, ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("not a whole number of float elements"),
            "{e}"
        );
        // ranks disagreeing on sum and mean: every rank fails naming a rank
        let op = if c.rank() == 1 {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        let mut z = vec![0f32; 70_000];
        let e = c.all_reduce_skipping_zeros(&mut z, op).unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(e.to_string().contains("(avg)"), "{e}");
        Ok(())
    });
    ranks(3, TransportKind::Auto, |c| {
        // ranks disagreeing on the length: every rank fails naming a rank
        let mut v = vec![1f32; 70_000 + c.rank()];
        let e = c
            .all_reduce_skipping_zeros(&mut v, ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(e.to_string().contains("bytes of float (sum), rank"), "{e}");
        Ok(())
    });
}
