//! Sparse all-reduce of row-sparse tensors (an embedding's gradient: only the rows of the
//! batch's tokens are non-zero).
//!
//! A dense all-reduce of a `vocab × dim` gradient moves the whole table even when a step
//! touches a few hundred rows. [`Communicator::sparse_all_reduce`] moves only the rows each
//! rank has: it all-gathers every rank's (row index, row values) pairs and sums them, the way
//! Gloo's and Horovod's sparse all-reduce do. It costs `sum over ranks of rows × dim` bytes
//! received per rank, so it wins while the union of the ranks' rows is a small part of the
//! table (for `n` ranks each touching a fraction `f` of the rows, roughly when `n · f < 1`;
//! the dense ring moves `2 (n - 1) / n` tables).
//!
//! The result is the same on every rank, bit for bit: every rank combines the same gathered
//! rows in the same order, each rank's repeated rows first (in the order it gave them), then
//! the ranks in rank order. That is the canonical expression of deterministic mode, so a row
//! has bitwise the value the deterministic dense all-reduce of the ranks' tables gives it
//! (`tests/deterministic.rs`); f16/bf16 are accumulated across the ranks in f32 and rounded
//! once, as there.
//! Rows absent on a rank count as zero, so [`ReduceOp::Mean`] divides by the world size, as the
//! dense mean of the same tensors would. Only `Sum` and `Mean` are defined (a max over rows that
//! some ranks lack is not the dense max), as in Gloo.

use std::collections::HashMap;

use crate::base::dtype::{DType, Element, ReduceOp};
use crate::base::error::{Error, Result};
use crate::base::reduce::{finalize_mean, fold_in_order, reduce_into, Order};
use crate::base::zero_blocks::all_zero_bits;
use crate::comm::traffic::TrafficScope;
use crate::comm::Communicator;
use crate::engine::Work;
use std::sync::Arc;

const OP: &str = "sparse_all_reduce";

/// Entries of each rank's header in [`Communicator::sparse_all_reduce_table_bytes`]: rows,
/// row length, dtype, verdict, table rows ([`NOT_GIVEN`] when not given).
const HEADER: usize = 5;

/// A header's table rows when the rank did not give them.
const NOT_GIVEN: u64 = u64::MAX;

/// A row-sparse tensor: row `indices[i]` of the dense tensor holds
/// `values[i * row_len .. (i + 1) * row_len]`; every other row is zero.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseRows<T> {
    /// Row indices, ascending and unique in results of [`Communicator::sparse_all_reduce`].
    pub indices: Vec<i64>,
    /// `indices.len() * row_len` values, row after row.
    pub values: Vec<T>,
    /// Elements per row.
    pub row_len: usize,
}

impl<T: Element> SparseRows<T> {
    /// Scatter-add these rows into a dense row-major tensor of `dense.len() / row_len` rows.
    /// Fails when an index is outside the tensor.
    pub fn add_to_dense(&self, dense: &mut [T]) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dense);
        let row_bytes = self.row_len * T::DTYPE.size();
        // rows of zero elements: every index fits (nothing is written)
        let rows = bytes.len().checked_div(row_bytes).unwrap_or(usize::MAX);
        if let Some(&idx) = self.indices.iter().find(|&&i| i < 0 || i as usize >= rows) {
            return Err(Error::invalid(
                "add_to_dense",
                0,
                format!("row index {idx} is outside a dense tensor of {rows} rows"),
            ));
        }
        let src: &[u8] = bytemuck::cast_slice(&self.values);
        for (i, &idx) in self.indices.iter().enumerate() {
            let at = idx as usize * row_bytes;
            reduce_into(
                T::DTYPE,
                ReduceOp::Sum,
                &mut bytes[at..at + row_bytes],
                &src[i * row_bytes..(i + 1) * row_bytes],
                Order::AccFirst,
            );
        }
        Ok(())
    }
}

impl Communicator {
    /// Sparse all-reduce: every rank gives the rows it has of a row-sparse tensor (`indices`,
    /// and `indices.len() * row_len` `values`, row after row); every rank gets the rows of the
    /// sum (or mean) over ranks, indices ascending and unique. Indices may repeat within a rank
    /// (repeats are summed). `row_len` and the dtype must agree across ranks; the number of rows
    /// may differ. See the [module docs](crate::sparse) for cost and determinism.
    ///
    /// ```no_run
    /// # use hcomm::{Communicator, ReduceOp};
    /// let comm = Communicator::from_env()?;
    /// // this rank's batch touched rows 3 and 7 of a 4-wide embedding table
    /// let rows = comm.sparse_all_reduce(&[3, 7], &[1.0f32; 8], 4, ReduceOp::Mean)?;
    /// let mut table_grad = vec![0.0f32; 10 * 4];
    /// rows.add_to_dense(&mut table_grad)?;
    /// # Ok::<(), hcomm::Error>(())
    /// ```
    pub fn sparse_all_reduce<T: Element>(
        &self,
        indices: &[i64],
        values: &[T],
        row_len: usize,
        op: ReduceOp,
    ) -> Result<SparseRows<T>> {
        let (indices, values) = self.sparse_all_reduce_bytes(
            indices,
            bytemuck::cast_slice(values),
            row_len,
            T::DTYPE,
            op,
        )?;
        let mut typed = vec![T::zeroed(); values.len() / T::DTYPE.size()];
        bytemuck::cast_slice_mut::<T, u8>(&mut typed).copy_from_slice(&values);
        Ok(SparseRows {
            indices,
            values: typed,
            row_len,
        })
    }

    /// Byte-level [`sparse_all_reduce`](Self::sparse_all_reduce): `values` holds
    /// `indices.len() * row_len` elements of `dtype`; returns the indices and the values' bytes.
    pub fn sparse_all_reduce_bytes(
        &self,
        indices: &[i64],
        values: &[u8],
        row_len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(Vec<i64>, Vec<u8>)> {
        self.sparse_all_reduce_table_bytes(indices, values, row_len, None, dtype, op)
    }

    /// [`sparse_all_reduce_bytes`](Self::sparse_all_reduce_bytes) of rows of a tensor with
    /// `table_rows` rows (a sparse torch tensor's first dimension), when known: every index
    /// must be below it, and the ranks that give it must give the same (ranks whose tensors
    /// differ in size used to end with results of different shapes, or only some of them
    /// failing). Like every check here, a violation fails every rank, naming the rank.
    pub fn sparse_all_reduce_table_bytes(
        &self,
        indices: &[i64],
        values: &[u8],
        row_len: usize,
        table_rows: Option<usize>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(Vec<i64>, Vec<u8>)> {
        let bad = |msg: String| Error::invalid(OP, 0, msg);
        let row_bytes = row_len.checked_mul(dtype.size());
        // Checked here, but reported only after every rank has said whether its arguments are
        // good: a rank with bad ones must not leave the others waiting in the gathers.
        let local = (|| {
            if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                return Err(bad(format!(
                    "op {op} is not defined for sparse tensors (rows a rank lacks are zero); use sum or mean"
                )));
            }
            let row_bytes =
                row_bytes.ok_or_else(|| bad(format!("row_len {row_len} is too large")))?;
            if indices.len().checked_mul(row_bytes) != Some(values.len()) {
                return Err(bad(format!(
                    "values are {} bytes, expected {} rows × {row_len} {dtype} elements = {} bytes",
                    values.len(),
                    indices.len(),
                    indices.len().saturating_mul(row_bytes)
                )));
            }
            if let Some(i) = indices.iter().position(|&i| i < 0) {
                return Err(bad(format!(
                    "indices[{i}] is {}, row indices must be >= 0",
                    indices[i]
                )));
            }
            if let Some(rows) = table_rows {
                if let Some(i) = indices.iter().position(|&i| i as u64 >= rows as u64) {
                    return Err(bad(format!(
                        "indices[{i}] is {}, beyond this rank's tensor of {rows} rows",
                        indices[i]
                    )));
                }
            }
            Ok(row_bytes)
        })();

        // Every rank's row count, row length, dtype and verdict: the gather sizes, and a check
        // that the ranks agree (every rank sees every header, so all fail together, naming the
        // rank).
        let n = self.world_size();
        let mine = [
            indices.len() as u64,
            row_len as u64,
            dtype as u8 as u64,
            u64::from(local.is_ok()),
            table_rows.map_or(NOT_GIVEN, |t| t as u64),
        ];
        let mut headers = vec![0u64; HEADER * n];
        self.all_gather(&mine, &mut headers)?;
        let row_bytes = local?;
        if let Some(r) = headers.chunks(HEADER).position(|h| h[3] == 0) {
            return Err(Error::Remote {
                ctx: crate::base::error::OpContext { op: OP, seq: 0 },
                peer: r,
                culprit: Some(r),
                msg: format!(
                    "rank {r} called {OP} with invalid arguments (its own error says which)"
                ),
            });
        }
        // Every rank compares every given number of rows with the first given (not only with
        // its own, which it may not have given), so that all reach the same verdict.
        let given = headers
            .chunks(HEADER)
            .enumerate()
            .filter(|(_, h)| h[4] != NOT_GIVEN);
        if let Some((first, f)) = given.clone().next() {
            if let Some((r, h)) = given.clone().find(|(_, h)| h[4] != f[4]) {
                return Err(disagreement(
                    OP,
                    if table_rows == Some(h[4] as usize) { first } else { r },
                    format!(
                        "rank {first}'s tensor has {} rows, rank {r}'s {}{}: every rank must reduce a tensor of the same size",
                        f[4],
                        h[4],
                        table_rows.map_or(String::new(), |t| format!(" (this rank's {t})"))
                    ),
                ));
            }
        }
        for (r, h) in headers.chunks(HEADER).enumerate() {
            if h[1] != row_len as u64 || h[2] != dtype as u8 as u64 {
                return Err(disagreement(
                    OP,
                    r,
                    format!(
                        "this rank has rows of {row_len} {dtype} elements, rank {r} rows of {} {} elements",
                        h[1],
                        dtype_name(h[2])
                    ),
                ));
            }
        }
        let counts: Vec<usize> = headers.chunks(HEADER).map(|h| h[0] as usize).collect();
        let (all_indices, all_values) =
            self.gather_rows(indices, values, &counts, row_len, dtype)?;
        let (out_indices, mut out) =
            sum_in_rank_order(&all_indices, &all_values, &counts, row_bytes, dtype);
        if op == ReduceOp::Mean {
            finalize_mean(dtype, &mut out, n);
        }
        Ok((out_indices, out))
    }

    /// The data phase of a sparse all-reduce whose row counts (`counts`, per rank) every rank
    /// knows: every rank's indices and rows, in rank order.
    fn gather_rows(
        &self,
        indices: &[i64],
        values: &[u8],
        counts: &[usize],
        row_len: usize,
        dtype: DType,
    ) -> Result<(Vec<i64>, Vec<u8>)> {
        let total: usize = counts.iter().sum();
        let mut all_indices = vec![0i64; total];
        self.all_gather_v_unkept(
            Some(bytemuck::cast_slice(indices)),
            bytemuck::cast_slice_mut(&mut all_indices),
            counts,
            DType::I64,
        )?;
        let value_counts: Vec<usize> = counts.iter().map(|c| c * row_len).collect();
        let mut all_values = vec![0u8; total * row_len * dtype.size()];
        self.all_gather_v_unkept(Some(values), &mut all_values, &value_counts, dtype)?;
        Ok((all_indices, all_values))
    }

    /// Dense all-reduce that skips zero blocks: the tensor is cut into blocks of
    /// [`ZERO_BLOCK_BYTES`]; when the blocks that are not all zero bits, summed over the
    /// ranks, are few enough that gathering them moves less than the dense ring (at most
    /// `(n - 1) / n` of the blocks), every rank sends only those (an all-gather, as
    /// [`sparse_all_reduce`](Self::sparse_all_reduce)) and rebuilds the dense result; otherwise
    /// it runs the dense all-reduce. Lossless either way: a block that is zero on a rank adds
    /// nothing (a `-0.0` is not a zero bit pattern, so it travels, and a block some ranks did
    /// not send gets their `+0.0`, as in the dense sum). An embedding's dense
    /// gradient (only the batch's rows non-zero) moves a fraction of its bytes, with no change
    /// to the model (the idea of OmniReduce's block-sparse all-reduce).
    ///
    /// Costs over the dense all-reduce: a scan of the tensor (stopping early when this rank
    /// alone has too many non-zero blocks) and a small all-gather of the counts, which picks
    /// the same path on every rank. The sparse path computes every block as the rank-order fold
    /// of the ranks' blocks (`((x0 + x1) + x2) + …`, f16/bf16 accumulated in f32 and rounded
    /// once): bitwise what the dense all-reduce of deterministic mode gives, so in that mode
    /// the result does not depend on which path ran (without it, the default dense schedules
    /// may round a sum of three or more non-zero blocks differently in the last bit). Only `Sum` and
    /// `Mean` skip (zero is their identity); other reductions, and tensors under 64 blocks,
    /// run the dense all-reduce. Returns whether the sparse path ran. Every rank must pass the
    /// same length and dtype ([`Error::Mismatch`] on every rank otherwise).
    pub fn all_reduce_skipping_zeros_bytes(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<bool> {
        self.check_len(SKIP_OP, "buffer", buf, dtype)?;
        let size = dtype.size();
        let block = (ZERO_BLOCK_BYTES / size).max(1);
        let block_bytes = block * size;
        let n = self.world_size();
        let blocks = buf.len().div_ceil(block_bytes);
        if n == 1 || !matches!(op, ReduceOp::Sum | ReduceOp::Mean) || blocks < 64 {
            self.all_reduce_bytes(None, buf, dtype, op)?;
            return Ok(false);
        }
        if op == ReduceOp::Mean && self.means_in_f32(dtype) {
            // As the dense all-reduce: f16/bf16 summed in f32, divided, rounded once.
            let mut sums = crate::base::half_mean::widen(dtype, buf);
            let sparse = Self::canonically(|| {
                self.all_reduce_skipping_zeros_bytes(
                    bytemuck::cast_slice_mut(&mut sums),
                    DType::F32,
                    ReduceOp::Sum,
                )
            })?;
            crate::base::half_mean::narrow_mean(dtype, &sums, n, buf);
            return Ok(sparse);
        }
        let _turn = self.engine().turns.enter();
        let _traffic = TrafficScope::enter(self, SKIP_OP);
        // the sparse path pays while the ranks' non-zero blocks together are at most
        // (n - 1) / n of the blocks (the dense ring moves 2 (n - 1) / n tensors per rank,
        // the gather the non-zero blocks of every rank plus an index each)
        let limit = blocks * (n - 1) / n;
        let mut nonzero: Vec<i64> = Vec::new();
        let mut too_many = false;
        for (b, chunk) in buf.chunks(block_bytes).enumerate() {
            if !all_zero_bits(chunk) {
                if nonzero.len() == limit {
                    too_many = true;
                    break;
                }
                nonzero.push(b as i64);
            }
        }
        let mine = [
            if too_many {
                u64::MAX
            } else {
                nonzero.len() as u64
            },
            buf.len() as u64,
            dtype as u8 as u64,
            u64::from(op == ReduceOp::Mean),
        ];
        let mut headers = vec![0u64; 4 * n];
        self.all_gather(&mine, &mut headers)?;
        for (r, h) in headers.chunks(4).enumerate() {
            if h[1] != buf.len() as u64 || h[2] != dtype as u8 as u64 || h[3] != mine[3] {
                let their_op = if h[3] == 1 {
                    ReduceOp::Mean
                } else {
                    ReduceOp::Sum
                };
                return Err(disagreement(
                    SKIP_OP,
                    r,
                    format!(
                        "this rank has {} bytes of {dtype} ({op}), rank {r} {} bytes of {} ({their_op})",
                        buf.len(),
                        h[1],
                        dtype_name(h[2])
                    ),
                ));
            }
        }
        let total = headers
            .chunks(4)
            .try_fold(0usize, |t, h| t.checked_add(usize::try_from(h[0]).ok()?));
        if total.is_none_or(|t| t > limit) {
            self.all_reduce_bytes(None, buf, dtype, op)?;
            return Ok(false);
        }
        let counts: Vec<usize> = headers.chunks(4).map(|h| h[0] as usize).collect();
        let mut values = vec![0u8; nonzero.len() * block_bytes];
        for (&b, dst) in nonzero.iter().zip(values.chunks_exact_mut(block_bytes)) {
            let at = b as usize * block_bytes;
            let src = &buf[at..(at + block_bytes).min(buf.len())];
            dst[..src.len()].copy_from_slice(src); // the last block may be short: zero padding
        }
        let (indices, rows) = self.gather_rows(&nonzero, &values, &counts, block, dtype)?;
        buf.fill(0);
        let len = buf.len();
        // Each block that some rank sent is the canonical rank-order fold of every rank's
        // block (`fold_in_order`: f16/bf16 accumulated in f32), a rank that sent nothing
        // contributing its zeros: bitwise the deterministic dense all-reduce, whichever path
        // the counts pick. `sent[b * n + r]` is the row rank `r` sent for block `b`.
        let mut sent: Vec<Option<usize>> = vec![None; blocks * n];
        let mut start = 0;
        for (r, &c) in counts.iter().enumerate() {
            for (k, &b) in indices.iter().enumerate().skip(start).take(c) {
                sent[b as usize * n + r] = Some(k);
            }
            start += c;
        }
        let zeros = vec![0u8; block_bytes];
        for (b, senders) in sent.chunks_exact(n).enumerate() {
            if senders.iter().all(Option::is_none) {
                continue; // zero on every rank: stays zero
            }
            let at = b * block_bytes;
            let dst = &mut buf[at..(at + block_bytes).min(len)];
            let short = dst.len();
            let parts: Vec<&[u8]> = senders
                .iter()
                .map(|s| match s {
                    Some(k) => &rows[k * block_bytes..k * block_bytes + short],
                    None => &zeros[..short],
                })
                .collect();
            fold_in_order(dtype, ReduceOp::Sum, dst, &parts);
            if op == ReduceOp::Mean {
                finalize_mean(dtype, dst, n);
            }
        }
        Ok(true)
    }

    /// [`all_reduce_skipping_zeros_bytes`](Self::all_reduce_skipping_zeros_bytes) on a typed
    /// slice.
    pub fn all_reduce_skipping_zeros<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<bool> {
        self.all_reduce_skipping_zeros_bytes(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }
}

/// Block size of [`Communicator::all_reduce_skipping_zeros_bytes`]: 1 KiB (256 f32), so the
/// rows of an embedding with a multiple of 256 columns (f32) are whole blocks.
pub use crate::base::zero_blocks::ZERO_BLOCK_BYTES;

const SKIP_OP: &str = "all_reduce_skipping_zeros";

/// Ranks that disagree, as every rank sees it in the exchanged headers (so all fail together).
fn disagreement(op: &'static str, peer: usize, msg: String) -> Error {
    Error::Mismatch {
        ctx: crate::base::error::OpContext { op, seq: 0 },
        peer,
        msg,
    }
}

/// A dtype code from a peer's header, for messages.
fn dtype_name(code: u64) -> String {
    DType::from_code(code as u8).map_or("?".into(), |d| d.to_string())
}

/// The gathered rows of every rank (`counts[r]` rows from rank `r`, in rank order) summed the
/// way the dense all-reduce of deterministic mode sums the ranks' tables: each rank's repeats
/// first (its own dense row, [`coalesce`]), then the ranks' rows in rank order,
/// `((x0 + x1) + x2) + …` ([`fold_in_order`]: f16/bf16 accumulated in f32, rounded once), a
/// rank without the row contributing its table's zero row. Sorted by index.
fn sum_in_rank_order(
    indices: &[i64],
    values: &[u8],
    counts: &[usize],
    row_bytes: usize,
    dtype: DType,
) -> (Vec<i64>, Vec<u8>) {
    let mut per_rank = Vec::with_capacity(counts.len());
    let mut start = 0;
    for &c in counts {
        let (idx, vals) = (
            &indices[start..start + c],
            &values[start * row_bytes..(start + c) * row_bytes],
        );
        per_rank.push(coalesce(idx, vals, row_bytes, dtype));
        start += c;
    }
    // Every index is now once per rank: fold each one's rows over the ranks in rank order,
    // the ranks without it giving zeros, as their dense tables would.
    let mut unique: Vec<i64> = per_rank
        .iter()
        .flat_map(|(i, _)| i.iter().copied())
        .collect();
    unique.sort_unstable();
    unique.dedup();
    let slot: HashMap<i64, usize> = unique.iter().enumerate().map(|(s, &i)| (i, s)).collect();
    let zeros = vec![0u8; row_bytes];
    let mut parts: Vec<Vec<&[u8]>> = vec![vec![&zeros[..]; per_rank.len()]; unique.len()];
    for (r, (idx, vals)) in per_rank.iter().enumerate() {
        for (k, i) in idx.iter().enumerate() {
            parts[slot[i]][r] = &vals[k * row_bytes..(k + 1) * row_bytes];
        }
    }
    let mut out = vec![0u8; unique.len() * row_bytes];
    for (dst, rows) in out.chunks_exact_mut(row_bytes.max(1)).zip(&parts) {
        fold_in_order(dtype, ReduceOp::Sum, dst, rows);
    }
    (unique, out)
}

/// Rows with the same index summed in the order given (the first copied, each later one
/// added to it), sorted by index.
fn coalesce(indices: &[i64], values: &[u8], row_bytes: usize, dtype: DType) -> (Vec<i64>, Vec<u8>) {
    let mut unique: Vec<i64> = indices.to_vec();
    unique.sort_unstable();
    unique.dedup();
    let slot: HashMap<i64, usize> = unique.iter().enumerate().map(|(s, &i)| (i, s)).collect();
    let mut out = vec![0u8; unique.len() * row_bytes];
    let mut seen = vec![false; unique.len()];
    for (k, idx) in indices.iter().enumerate() {
        let s = slot[idx];
        let row = &values[k * row_bytes..(k + 1) * row_bytes];
        let acc = &mut out[s * row_bytes..(s + 1) * row_bytes];
        if seen[s] {
            reduce_into(dtype, ReduceOp::Sum, acc, row, Order::AccFirst);
        } else {
            acc.copy_from_slice(row);
            seen[s] = true;
        }
    }
    (unique, out)
}

impl Communicator {
    /// Non-blocking [`sparse_all_reduce`](Self::sparse_all_reduce): takes the rows, gives the
    /// reduced rows.
    pub fn sparse_all_reduce_async<T: Element>(
        self: &Arc<Self>,
        indices: Vec<i64>,
        values: Vec<T>,
        row_len: usize,
        op: ReduceOp,
    ) -> Work<SparseRows<T>> {
        self.run_async("sparse_all_reduce", move |c| {
            c.sparse_all_reduce(&indices, &values, row_len, op)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_sums_repeats_in_order_and_sorts() {
        let idx = [5i64, 1, 5, 3, 1];
        let vals: Vec<f32> = vec![1.0, 2.0, 10.0, 20.0, 100.0, 200.0, 1000.0, 2000.0, 5.0, 6.0];
        let (i, v) = coalesce(&idx, bytemuck::cast_slice(&vals), 8, DType::F32);
        assert_eq!(i, vec![1, 3, 5]);
        let v: Vec<f32> = v
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(v, vec![15.0, 26.0, 1000.0, 2000.0, 101.0, 202.0]);
    }

    #[test]
    fn repeats_are_summed_per_rank_before_the_ranks_are() {
        // rank 0: row 0 = 2^24 (where f32's step is 2); rank 1: row 0 twice, 1 and 1. Per
        // rank, then in rank order: 2^24 + (1 + 1) = 2^24 + 2 exactly, as the dense sum of
        // the ranks' tables; one flat fold of the rows gives (2^24 + 1) + 1, rounded to 2^24
        // at each step.
        let big = 16_777_216.0f32;
        let idx = [0i64, 0, 0];
        let vals = [big, 1.0, 1.0];
        let (i, v) = sum_in_rank_order(&idx, bytemuck::cast_slice(&vals), &[1, 2], 4, DType::F32);
        assert_eq!(i, vec![0]);
        let got = f32::from_le_bytes(v[..4].try_into().unwrap());
        assert_eq!(got, big + 2.0);
        let (_, flat) = coalesce(&idx, bytemuck::cast_slice(&vals), 4, DType::F32);
        assert_eq!(f32::from_le_bytes(flat[..4].try_into().unwrap()), big);
    }

    #[test]
    fn add_to_dense_rejects_rows_outside_the_tensor() {
        let rows = SparseRows {
            indices: vec![0, 4],
            values: vec![1.0f32; 4],
            row_len: 2,
        };
        let mut dense = vec![0.0f32; 8];
        let e = rows.add_to_dense(&mut dense).unwrap_err().to_string();
        assert!(e.contains("row index 4") && e.contains("4 rows"), "{e}");
        assert!(
            dense.iter().all(|&x| x == 0.0),
            "nothing is added when a row is out of range"
        );
        let mut dense = vec![0.0f32; 10];
        rows.add_to_dense(&mut dense).unwrap();
        assert_eq!(dense, vec![1., 1., 0., 0., 0., 0., 0., 0., 1., 1.]);
    }
}
