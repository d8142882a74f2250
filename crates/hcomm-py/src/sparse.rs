//! Sparse all-reduce (row-sparse tensors such as an embedding's gradient): the result holder
//! an operation fills on the progress engine and Python reads after `wait()`.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use std::sync::{Arc, Mutex};

/// Reduced rows: ascending unique indices and their values' bytes.
pub type Rows = (Vec<i64>, Vec<u8>);

/// Where a sparse all-reduce leaves its result (filled when the operation completes).
#[pyclass(name = "SparseResult", module = "hcomm._hcomm", frozen)]
pub struct PySparseResult {
    pub slot: Arc<Mutex<Option<Rows>>>,
}

#[pymethods]
impl PySparseResult {
    /// The result as two bytearrays (int64 indices, values in the input's dtype); raises if the
    /// operation has not completed successfully or the result was already taken.
    fn take<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyByteArray>, Bound<'py, PyByteArray>)> {
        let rows = self.slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (indices, values) = rows.ok_or_else(|| {
            PyRuntimeError::new_err(
                "sparse_all_reduce: no result (the operation has not completed, failed, or its result was taken)",
            )
        })?;
        let index_bytes: Vec<u8> = indices.iter().flat_map(|i| i.to_ne_bytes()).collect();
        Ok((
            PyByteArray::new(py, &index_bytes),
            PyByteArray::new(py, &values),
        ))
    }
}
