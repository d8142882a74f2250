//! Gradient compression for Python: a [`CompressionState`] object (compressor, error feedback,
//! residuals) that `Communicator.all_reduce_compressed` and compressed fusion use, and the
//! per-operation byte counters. The Python side is `hcomm.CompressionState` and
//! `hcomm.Communicator.all_reduce_compressed`.

use crate::errors::{blocking, to_pyerr};
use hcomm::{CompressionState, Compressor};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::{Arc, Mutex};

/// Parse a compressor string (`none`, `fp16`, `bf16`, `int8[:BLOCK]`, `int8sr[:BLOCK]`,
/// `sign[:BLOCK]`, `topk:K|P%`, `randk:K|P%[:SEED]`); a bad one is an `InvalidArgumentError`
/// (also a `ValueError`) naming it.
pub fn parse_compressor(py: Python<'_>, what: &'static str, s: &str) -> PyResult<Compressor> {
    s.parse::<Compressor>().map_err(|e| {
        // The library's parameter check names its own operation inside the message; the
        // compressor string is what the caller gave here.
        let e = e.replace("all_reduce_compressed (seq 0): invalid argument: ", "");
        to_pyerr(py, hcomm::Error::invalid(what, 0, e))
    })
}

/// One tensor's compression state (see `hcomm.CompressionState`): shared between the Python
/// object and the operations using it; an operation holds the lock while it runs on the
/// progress engine, so operations on one state run one at a time, in issue order.
#[pyclass(name = "CompressionState", module = "hcomm._hcomm", frozen)]
pub struct PyCompression {
    pub state: Arc<Mutex<CompressionState>>,
}

impl PyCompression {
    /// `f` on the state, locked without the GIL (an operation in flight may hold it).
    pub fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CompressionState) -> R + Send,
    ) -> R {
        py.detach(|| f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner())))
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(v.len() * 4);
    for x in v {
        bytes.extend_from_slice(&x.to_ne_bytes());
    }
    bytes
}

#[pymethods]
impl PyCompression {
    /// A fresh state for `compressor` (a string as in `hcomm bench compression
    /// --compressors`), with or without error feedback. `key` is mixed into random-k's seed
    /// (give each tensor its own, the same on every rank).
    #[new]
    #[pyo3(signature = (compressor, error_feedback = true, key = 0))]
    fn new(py: Python<'_>, compressor: &str, error_feedback: bool, key: u64) -> PyResult<Self> {
        let c = parse_compressor(py, "compression", compressor)?;
        let state = CompressionState::new(c)
            .map_err(|e| to_pyerr(py, e))?
            .with_error_feedback(error_feedback)
            .with_key(key);
        Ok(PyCompression {
            state: Arc::new(Mutex::new(state)),
        })
    }

    /// The compressor, in its canonical string form (`int8:256`, `topk:1%`, …).
    #[getter]
    fn compressor(&self, py: Python<'_>) -> String {
        self.with(py, |s| s.compressor().to_string())
    }

    /// Whether error feedback is on.
    #[getter]
    fn error_feedback(&self, py: Python<'_>) -> bool {
        self.with(py, |s| s.error_feedback())
    }

    /// Compressed all-reduces run with this state.
    #[getter]
    fn steps(&self, py: Python<'_>) -> u64 {
        self.with(py, |s| s.steps())
    }

    /// What this rank's compression dropped and will add to the next input, as native f32
    /// bytes (empty before the first step, without error feedback, and for `none`).
    #[getter]
    fn residual<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let b = self.with(py, |s| f32_bytes(s.residual()));
        PyBytes::new(py, &b)
    }

    /// int8 and sign: what re-encoding the sum of the chunk this rank owns dropped (elements
    /// `owner_range`), as native f32 bytes; empty otherwise.
    #[getter]
    fn owner_residual<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let b = self.with(py, |s| f32_bytes(s.owner_residual()));
        PyBytes::new(py, &b)
    }

    /// int8 and sign: (start, end) of the elements this rank owns, once the state was used.
    #[getter]
    fn owner_range(&self, py: Python<'_>) -> Option<(usize, usize)> {
        self.with(py, |s| s.owner_range().map(|r| (r.start, r.end)))
    }

    /// int8 and sign on several hosts of several ranks: (start, end) of the elements whose
    /// host sum this rank compresses across hosts (`residual` and `owner_range` then refer to
    /// them), once the state was used; None otherwise.
    #[getter]
    fn slice(&self, py: Python<'_>) -> Option<(usize, usize)> {
        self.with(py, |s| s.slice().map(|r| (r.start, r.end)))
    }

    /// Bytes of memory the residuals hold.
    #[getter]
    fn memory_bytes(&self, py: Python<'_>) -> usize {
        self.with(py, |s| s.memory_bytes())
    }

    /// Forget the residuals, the step count and the binding to a tensor.
    fn reset(&self, py: Python<'_>) {
        self.with(py, |s| s.reset());
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.with(py, |g| {
            format!(
                "<hcomm._hcomm.CompressionState {} error_feedback={} steps={}>",
                g.compressor(),
                if g.error_feedback() { "True" } else { "False" },
                g.steps()
            )
        })
    }
}

/// One row of `Communicator.traffic()`: (op, calls, tcp_sent, tcp_received, shm_written,
/// shm_read).
pub type TrafficRow = (String, u64, u64, u64, u64, u64);

/// The communicator's byte counters, read without the GIL (reading waits for an operation in
/// progress on another thread).
pub fn traffic(py: Python<'_>, comm: &Arc<hcomm::Communicator>) -> PyResult<Vec<TrafficRow>> {
    let c = comm.clone();
    blocking(py, move || {
        Ok(c.traffic()
            .into_iter()
            .map(|t| {
                (
                    t.op.to_string(),
                    t.calls,
                    t.tcp_sent,
                    t.tcp_received,
                    t.shm_written,
                    t.shm_read,
                )
            })
            .collect())
    })
}
