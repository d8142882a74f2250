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
//! rows in the same order (rank 0's rows first, each rank's rows in the order it gave them).
//! Rows absent on a rank count as zero, so [`ReduceOp::Mean`] divides by the world size, as the
//! dense mean of the same tensors would. Only `Sum` and `Mean` are defined (a max over rows that
//! some ranks lack is not the dense max), as in Gloo.

use std::collections::HashMap;

use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::{finalize_mean, reduce_into, Order};

const OP: &str = "sparse_all_reduce";

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
        ];
        let mut headers = vec![0u64; 4 * n];
        self.all_gather(&mine, &mut headers)?;
        let row_bytes = local?;
        if let Some(r) = headers.chunks(4).position(|h| h[3] == 0) {
            return Err(Error::Remote {
                ctx: crate::error::OpContext { op: OP, seq: 0 },
                peer: r,
                culprit: Some(r),
                msg: format!(
                    "rank {r} called {OP} with invalid arguments (its own error says which)"
                ),
            });
        }
        for (r, h) in headers.chunks(4).enumerate() {
            if h[1] != row_len as u64 || h[2] != dtype as u8 as u64 {
                let theirs = DType::from_code(h[2] as u8).map_or("?".into(), |d| d.to_string());
                return Err(Error::Mismatch {
                    ctx: crate::error::OpContext { op: OP, seq: 0 },
                    peer: r,
                    msg: format!(
                        "this rank has rows of {row_len} {dtype} elements, rank {r} rows of {} {theirs} elements",
                        h[1]
                    ),
                });
            }
        }
        let counts: Vec<usize> = headers.chunks(4).map(|h| h[0] as usize).collect();
        let total: usize = counts.iter().sum();

        let mut all_indices = vec![0i64; total];
        self.all_gather_v(indices, &mut all_indices, &counts)?;
        let value_counts: Vec<usize> = counts.iter().map(|c| c * row_len).collect();
        let mut all_values = vec![0u8; total * row_bytes];
        self.all_gather_v_bytes(Some(values), &mut all_values, &value_counts, dtype)?;

        let (out_indices, mut out) = coalesce(&all_indices, &all_values, row_bytes, dtype);
        if op == ReduceOp::Mean {
            finalize_mean(dtype, &mut out, n);
        }
        Ok((out_indices, out))
    }
}

/// Sum rows with equal indices, in the order given (the first occurrence is copied, later ones
/// added to it); indices come back ascending.
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
