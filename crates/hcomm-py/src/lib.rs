//! `hcomm._hcomm`: the thin PyO3 layer between Python and the hcomm library.
//!
//! This module only converts: Python buffers (numpy arrays, CPU torch tensors) to byte slices,
//! Python arguments to hcomm's types, and hcomm's errors to the exceptions of `hcomm.errors`.
//! Every call that can block releases the GIL, and every call into the library runs under
//! `catch_unwind`, so a panic surfaces as `hcomm.HcommError` instead of crossing the FFI
//! boundary. The Pythonic API (HCCL names, shapes, output allocation) is `python/hcomm/`.

// `unsafe` is allowed only where Python buffers are viewed as byte slices: in `buffer` (the
// views themselves) and on the functions below (and in `fusion`) that hand such views to the
// library, each with a `// SAFETY:` note on why the object outlives the view and the views
// are disjoint.
#![deny(unsafe_code)]

// Raw views (`&[u8]` / `&mut [u8]`) of the memory of Python objects that export a contiguous
// buffer. Invariant its `unsafe fn`s state as their contract: the object stays alive, unmoved
// and unresized while a view is used, and a mutable view overlaps no other view.
#[allow(unsafe_code)]
mod buffer;
mod compression;
mod errors;
mod fusion;
mod sparse;
mod work;

use buffer::{buffer, dtype_name, opt_buffer, same_dtype, Buf};
use compression::{parse_compressor, PyCompression};
use errors::{blocking, invalid_argument, to_pyerr};
use fusion::PyFusion;
use hcomm::fusion::FusionOptions;
use hcomm::{Communicator as Comm, DType, ReduceOp};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use sparse::PySparseResult;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use work::PyWork;

fn parse_op(op: &str) -> PyResult<ReduceOp> {
    op.parse::<ReduceOp>().map_err(invalid_argument)
}

fn parse_dtype(d: &str) -> PyResult<DType> {
    d.parse::<DType>().map_err(invalid_argument)
}

/// Equal per-rank counts for a buffer of `total` elements split `n` ways, or a ValueError.
fn equal_counts(op: &str, what: &str, total: usize, n: usize) -> PyResult<Vec<usize>> {
    if !total.is_multiple_of(n) {
        return Err(invalid_argument(format!(
            "{op}: {what} has {total} elements, which do not split into {n} equal blocks (one per rank)"
        )));
    }
    Ok(vec![total / n; n])
}

/// What the output buffer is called in errors: `tensor` in place, `out` otherwise.
fn out_name(send: Option<&Bound<'_, PyAny>>) -> &'static str {
    if send.is_some_and(|s| !s.is_none()) {
        "out"
    } else {
        "tensor"
    }
}

/// `send` as an input separate from `recv`, or `None` when it is absent or the same memory
/// (in place). Partly overlapping buffers are refused.
fn input_of(op: &str, send: Option<Buf>, recv: &Buf) -> PyResult<Option<Buf>> {
    match send {
        None => Ok(None),
        Some(s) if s.same_memory(recv) => Ok(None),
        Some(s) if s.overlaps(recv) => Err(invalid_argument(format!(
            "{op}: the input and output buffers partly overlap; pass the same buffer (in place) or separate ones"
        ))),
        Some(s) => Ok(Some(s)),
    }
}

/// Input and output of a collective that cannot work in place: they must not overlap and
/// must have one dtype.
fn separate(op: &str, s: &Buf, r: &Buf) -> PyResult<()> {
    if s.overlaps(r) {
        return Err(invalid_argument(format!(
            "{op}: the input and output buffers overlap ({op} does not work in place)"
        )));
    }
    same_dtype(op, Some(s), r)
}

/// A communicator: a group of ranks that run collectives together (see `hcomm.Communicator`
/// for the documented API; this class is its engine).
#[pyclass(name = "Communicator", module = "hcomm._hcomm", frozen)]
struct PyComm {
    comm: Arc<Comm>,
}

impl PyComm {
    fn wrap(comm: Comm) -> PyComm {
        PyComm {
            comm: Arc::new(comm),
        }
    }

    /// Run `job` now (blocking, without the GIL) or, with `async_op`, on the communicator's
    /// progress engine, returning its handle; `objects` are kept alive until it finishes.
    fn dispatch(
        &self,
        py: Python<'_>,
        op: &'static str,
        async_op: bool,
        objects: Vec<Py<PyAny>>,
        job: impl FnOnce(&Comm) -> hcomm::Result<()> + Send + 'static,
    ) -> PyResult<Option<PyWork>> {
        if async_op {
            return Ok(Some(work::submit(&self.comm, op, objects, job)));
        }
        let c = self.comm.clone();
        blocking(py, move || job(&c)).map(|()| None)
    }
}

/// The Python objects among `objs`, as owned references, held until the operation ends (by
/// asynchronous jobs, and by blocking calls while the GIL is released). A torch tensor's
/// storage is kept too: the tensor object alone does not keep its memory (`t.set_()` swaps
/// the storage, freeing the old one the operation writes into). Resizing the storage itself
/// during the operation stays undefined, as with torch's own backends.
pub(crate) fn keep(objs: &[Option<&Bound<'_, PyAny>>]) -> Vec<Py<PyAny>> {
    let mut kept = Vec::with_capacity(objs.len() * 2);
    for o in objs.iter().flatten().filter(|o| !o.is_none()) {
        kept.push((*o).clone().unbind());
        if o.hasattr("untyped_storage").unwrap_or(false) {
            if let Ok(storage) = o.call_method0("untyped_storage") {
                kept.push(storage.unbind());
            }
        }
    }
    kept
}

#[pymethods]
impl PyComm {
    /// Join the job described by the environment (HCOMM_*, torchrun, Open MPI, PMI, Slurm
    /// variables, or HCOMM_RANK_TABLE).
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<PyComm> {
        blocking(py, Comm::from_env).map(PyComm::wrap)
    }

    /// Join the job described by a rank table (`hcom_config.json`) as `rank`.
    #[staticmethod]
    fn from_rank_table(py: Python<'_>, path: std::path::PathBuf, rank: usize) -> PyResult<PyComm> {
        blocking(py, move || Comm::from_rank_table(path, rank)).map(PyComm::wrap)
    }

    /// Join a job described by `vars` (variable name to value, e.g. HCOMM_RANK,
    /// HCOMM_WORLD_SIZE, HCOMM_MASTER_ADDR, HCOMM_MASTER_PORT), falling back to the process
    /// environment for the variables it does not name. A value of None hides the variable.
    #[staticmethod]
    fn from_vars(
        py: Python<'_>,
        vars: std::collections::HashMap<String, Option<String>>,
    ) -> PyResult<PyComm> {
        blocking(py, move || {
            let cfg = hcomm::BootstrapConfig::from_vars(|k| match vars.get(k) {
                Some(v) => v.clone(),
                None => std::env::var(k).ok(),
            })?;
            Comm::from_config(&cfg)
        })
        .map(PyComm::wrap)
    }

    /// Join a communicator that grows (`grow(count, addr)` on its ranks) through `addr`
    /// (HOST:PORT); the job token, timeout and transport come from the environment.
    #[staticmethod]
    fn join_grown(py: Python<'_>, addr: String) -> PyResult<PyComm> {
        blocking(py, move || {
            let cfg = hcomm::BootstrapConfig::for_joining(&addr)?;
            Comm::join_grown(&cfg)
        })
        .map(PyComm::wrap)
    }

    /// This rank, 0..world_size.
    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// This rank's index among the ranks of its host.
    #[getter]
    fn local_rank(&self) -> usize {
        self.comm.local_rank()
    }

    /// Number of ranks on this rank's host.
    #[getter]
    fn local_world_size(&self) -> usize {
        self.comm.local_world_size()
    }

    /// This rank's host identity.
    #[getter]
    fn host_id(&self) -> String {
        self.comm.host_id().to_string()
    }

    /// The communicator's id (unique within the job).
    #[getter]
    fn id(&self) -> String {
        self.comm.id().to_string()
    }

    /// True when the ranks share a host and collectives use shared memory.
    #[getter]
    fn has_shared_memory(&self) -> bool {
        self.comm.has_shared_memory()
    }

    /// Deadline of every blocking call, in seconds.
    #[getter]
    fn get_timeout(&self) -> f64 {
        self.comm.timeout().as_secs_f64()
    }

    #[setter]
    fn set_timeout(&self, seconds: f64) -> PyResult<()> {
        if !(seconds.is_finite() && seconds > 0.0) {
            return Err(invalid_argument(format!(
                "timeout must be a positive number of seconds, got {seconds}"
            )));
        }
        let max = hcomm::config::BootstrapConfig::MAX_TIMEOUT.as_secs_f64();
        if seconds > max {
            return Err(invalid_argument(format!(
                "timeout {seconds} s is too large: the longest timeout is 100 years ({max} s)"
            )));
        }
        self.comm.set_timeout(Duration::from_secs_f64(seconds));
        Ok(())
    }

    /// Deterministic reductions (`HCOMM_DETERMINISTIC`): all-reduce, reduce-scatter and
    /// reduce combine the ranks in rank order, f16/bf16 in f32, so the bits do not depend on
    /// size, bucket, transport or layout. Every rank must set the same value.
    #[getter]
    fn get_deterministic(&self) -> bool {
        self.comm.is_deterministic()
    }

    #[setter]
    fn set_deterministic(&self, py: Python<'_>, on: bool) {
        let comm = self.comm.clone();
        py.detach(move || comm.set_deterministic(on));
    }

    /// Skip zero blocks between hosts (`HCOMM_SKIP_ZEROS`, on by default): sum and mean
    /// all-reduces of two ranks on different hosts (and the cross-host step of the
    /// hierarchical all-reduce on two hosts) send only the 1 KiB blocks that are not all zero
    /// bits, with the dense result's bits. Every rank must set the same value.
    #[getter]
    fn get_skip_zeros(&self) -> bool {
        self.comm.skips_zeros()
    }

    #[setter]
    fn set_skip_zeros(&self, py: Python<'_>, on: bool) {
        let comm = self.comm.clone();
        py.detach(move || comm.set_skip_zeros(on));
    }

    /// Bytes of all-gather outputs kept between hosts (`HCOMM_GATHER_CACHE_MB`): a block that
    /// is bitwise one its rank sent in a kept all-gather goes as a reference; 0 turns it off.
    /// Every rank must set the same value.
    #[getter]
    fn get_gather_cache_budget(&self) -> usize {
        self.comm.gather_cache_budget()
    }

    #[setter]
    fn set_gather_cache_budget(&self, py: Python<'_>, bytes: usize) {
        let comm = self.comm.clone();
        py.detach(move || comm.set_gather_cache_budget(bytes));
    }

    /// Bytes of all-gather outputs kept now.
    #[getter]
    fn gather_cache_held(&self) -> usize {
        self.comm.gather_cache_held()
    }

    /// Write a Chrome / Perfetto trace of this communicator's operations (and of those made
    /// from it afterwards) to `path`: a directory (`hcomm-trace-rank{R}.json` in it) or a
    /// file name with `{rank}` in it (`HCOMM_TRACE` does this at creation).
    fn trace_to(&self, py: Python<'_>, path: &str) -> PyResult<()> {
        let comm = self.comm.clone();
        let path = path.to_string();
        py.detach(move || comm.trace_to(&path))
            .map_err(|e| to_pyerr(py, e))
    }

    /// Stop tracing this communicator.
    fn stop_trace(&self, py: Python<'_>) {
        let comm = self.comm.clone();
        py.detach(move || comm.stop_trace());
    }

    /// Write the trace's buffered events now.
    fn flush_trace(&self) {
        self.comm.flush_trace();
    }

    /// The file this communicator's trace goes to, or None.
    #[getter]
    fn trace_file(&self) -> Option<String> {
        self.comm
            .trace_file()
            .map(|p| p.to_string_lossy().into_owned())
    }

    /// Attach `label` to every operation issued from now on (its trace slice's
    /// `args.label`), or none.
    #[pyo3(signature = (label))]
    fn set_trace_label(&self, label: Option<&str>) {
        self.comm.set_trace_label(label);
    }

    /// How f16/bf16 reductions accumulate (`HCOMM_ACCUMULATE`): "f32" (in f32, rounded once:
    /// the canonical schedules) or "native" (rounded at every step). Every rank must set the
    /// same value.
    #[getter]
    fn get_accumulate(&self) -> &'static str {
        if self.comm.accumulates_f32() {
            "f32"
        } else {
            "native"
        }
    }

    #[setter]
    fn set_accumulate(&self, py: Python<'_>, how: &str) -> PyResult<()> {
        let on = match how {
            "f32" => true,
            "native" => false,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "accumulate = {other:?}: expected \"f32\" (f16 and bf16 accumulated in f32) or \"native\""
                )))
            }
        };
        let comm = self.comm.clone();
        py.detach(move || comm.set_accumulate_f32(on));
        Ok(())
    }

    /// Abort: every operation in flight and every later one fails with AbortedError. Safe to
    /// call from any thread.
    fn abort(&self) {
        self.comm.abort();
    }

    /// Revoke: every operation in flight or started later, on every rank, fails with
    /// RevokedError naming this rank. Safe to call from any thread.
    fn revoke(&self) {
        self.comm.revoke();
    }

    /// True once this communicator was revoked (here or, as far as this rank heard, elsewhere).
    #[getter]
    fn revoked(&self) -> bool {
        self.comm.is_revoked()
    }

    /// The communicator of the ranks that are left (collective over the survivors), also
    /// dropping `exclude`; revokes this one first.
    #[pyo3(signature = (exclude = Vec::new()))]
    fn shrink(&self, py: Python<'_>, exclude: Vec<usize>) -> PyResult<PyComm> {
        let c = self.comm.clone();
        blocking(py, move || c.shrink_excluding(&exclude)).map(PyComm::wrap)
    }

    /// This communicator's ranks and `count` new processes (which call `join_grown(addr)`);
    /// rank 0 hosts the rendezvous on `addr`.
    fn grow(&self, py: Python<'_>, count: usize, addr: String) -> PyResult<PyComm> {
        let c = self.comm.clone();
        blocking(py, move || c.grow(count, &addr)).map(PyComm::wrap)
    }

    /// All-reduce `send` into `recv` with `op`; `send=None` (or the same buffer) is in place.
    #[pyo3(signature = (send, recv, op = "sum", async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn all_reduce(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "all_reduce";
        let op = parse_op(op)?;
        let r = buffer(OP, out_name(send), recv, true)?;
        let s = input_of(OP, opt_buffer(OP, "tensor", send, false)?, &r)?;
        same_dtype(OP, s.as_ref(), &r)?;
        // No byte view made from a `Buf` in the jobs of this impl outlives the object behind
        // it: the job runs inside this call (which borrows the objects) or, with `async_op`, on
        // the engine while the Work keeps the objects (`keep`) until the job has ended; and the
        // caller must not touch them before `wait()` returns (docs/python.md).
        self.dispatch(
            py,
            OP,
            async_op,
            keep(&[send, Some(recv)]),
            // SAFETY: the objects outlive the job (see above); `input_of` made `s` None when
            // it is the same memory as `r` and refused a partial overlap, so the read view
            // and the written view are disjoint.
            move |c| unsafe {
                c.all_reduce_bytes(s.map(|s| s.bytes()), r.bytes_mut(), r.dtype, op)
            },
        )
    }

    /// All-gather: `recv` receives every rank's `send` in rank order. `counts` (elements per
    /// rank) defaults to equal blocks. `send=None` is in place (this rank's block already in
    /// `recv`).
    #[pyo3(signature = (send, recv, counts = None, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn all_gather(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        counts: Option<Vec<usize>>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "all_gather";
        let n = self.comm.world_size();
        let r = buffer(OP, out_name(send), recv, true)?;
        let s = input_of(OP, opt_buffer(OP, "tensor", send, false)?, &r)?;
        same_dtype(OP, s.as_ref(), &r)?;
        let counts = match (counts, &s) {
            (Some(c), _) => c,
            (None, Some(s)) => vec![s.elements(); n],
            (None, None) => equal_counts(OP, "the output", r.elements(), n)?,
        };
        self.dispatch(
            py,
            OP,
            async_op,
            keep(&[send, Some(recv)]),
            // SAFETY: the objects outlive the job (see all_reduce); `input_of` made `s` None
            // when in place and refused a partial overlap, so the two views are disjoint.
            move |c| unsafe {
                c.all_gather_v_bytes(s.map(|s| s.bytes()), r.bytes_mut(), &counts, r.dtype)
            },
        )
    }

    /// Reduce-scatter: rank p receives in `recv` the reduction of block p of every rank's
    /// `send`. `counts` defaults to equal blocks. `send=None`: `recv` is the whole buffer and
    /// the result lands in this rank's block of it.
    #[pyo3(signature = (send, recv, op = "sum", counts = None, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        op: &str,
        counts: Option<Vec<usize>>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "reduce_scatter";
        let op = parse_op(op)?;
        let n = self.comm.world_size();
        let r = buffer(OP, out_name(send), recv, true)?;
        let s = input_of(OP, opt_buffer(OP, "tensor", send, false)?, &r)?;
        same_dtype(OP, s.as_ref(), &r)?;
        let counts = match (counts, &s) {
            (Some(c), _) => c,
            (None, Some(_)) => vec![r.elements(); n],
            (None, None) => equal_counts(OP, "the buffer", r.elements(), n)?,
        };
        self.dispatch(
            py,
            OP,
            async_op,
            keep(&[send, Some(recv)]),
            // SAFETY: the objects outlive the job (see all_reduce); `input_of` made `s` None
            // when in place and refused a partial overlap, so the two views are disjoint.
            move |c| unsafe {
                c.reduce_scatter_v_bytes(s.map(|s| s.bytes()), r.bytes_mut(), &counts, r.dtype, op)
            },
        )
    }

    /// Broadcast `buf` from `root` to every rank, in place.
    #[pyo3(signature = (buf, root, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn broadcast(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        root: usize,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "broadcast";
        let b = buffer(OP, "tensor", buf, true)?;
        // SAFETY: the object outlives the job (see all_reduce), and this is its only view.
        self.dispatch(py, OP, async_op, keep(&[Some(buf)]), move |c| unsafe {
            c.broadcast_bytes(b.bytes_mut(), b.dtype, root)
        })
    }

    /// Reduce `send` over all ranks into `recv` on `root`. `recv` may be None on other ranks;
    /// `send=None` (or the same buffer) is in place on `recv`.
    #[pyo3(signature = (send, recv, op, root, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn reduce(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: Option<&Bound<'_, PyAny>>,
        op: &str,
        root: usize,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "reduce";
        let op = parse_op(op)?;
        let (s, r) = match opt_buffer(OP, out_name(send), recv, true)? {
            Some(r) => (input_of(OP, opt_buffer(OP, "tensor", send, false)?, &r)?, r),
            None => {
                let s = opt_buffer(OP, "tensor", send, false)?
                    .ok_or_else(|| invalid_argument("reduce: give an input, an output, or both"))?;
                (Some(s), Buf::empty(s.dtype))
            }
        };
        same_dtype(OP, s.as_ref(), &r)?;
        // SAFETY: the objects outlive the job (see all_reduce). With an output, `input_of`
        // made `s` None when in place and refused a partial overlap; without one, `r` is
        // empty and views no memory. Either way the two views are disjoint.
        self.dispatch(py, OP, async_op, keep(&[send, recv]), move |c| unsafe {
            c.reduce_bytes(s.map(|s| s.bytes()), r.bytes_mut(), r.dtype, op, root)
        })
    }

    /// Gather every rank's `send` into `recv` on `root` (None elsewhere). `counts` defaults
    /// to equal blocks.
    #[pyo3(signature = (send, recv, root, counts = None, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        root: usize,
        counts: Option<Vec<usize>>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "gather";
        let s = buffer(OP, "tensor", send, false)?;
        let r = opt_buffer(OP, "out", recv, true)?.unwrap_or(Buf::empty(s.dtype));
        separate(OP, &s, &r)?;
        let counts = counts.unwrap_or_else(|| vec![s.elements(); self.comm.world_size()]);
        self.dispatch(
            py,
            OP,
            async_op,
            keep(&[Some(send), recv]),
            // SAFETY: the objects outlive the job (see all_reduce), and `separate` refused
            // overlapping input and output (an absent output is empty and views no memory).
            move |c| unsafe { c.gather_v_bytes(s.bytes(), r.bytes_mut(), &counts, s.dtype, root) },
        )
    }

    /// Scatter `root`'s `send` (None elsewhere) in rank order: every rank receives its block
    /// in `recv`. `counts` defaults to equal blocks.
    #[pyo3(signature = (send, recv, root, counts = None, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        root: usize,
        counts: Option<Vec<usize>>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "scatter";
        let r = buffer(OP, "out", recv, true)?;
        let s = opt_buffer(OP, "tensor", send, false)?.unwrap_or(Buf::empty(r.dtype));
        separate(OP, &s, &r)?;
        let counts = counts.unwrap_or_else(|| vec![r.elements(); self.comm.world_size()]);
        self.dispatch(
            py,
            OP,
            async_op,
            keep(&[send, Some(recv)]),
            // SAFETY: the objects outlive the job (see all_reduce), and `separate` refused
            // overlapping input and output (an absent input is empty and views no memory).
            move |c| unsafe { c.scatter_v_bytes(s.bytes(), r.bytes_mut(), &counts, r.dtype, root) },
        )
    }

    /// All-to-all: block p of `send` goes to rank p; block p of `recv` comes from rank p.
    /// Counts (elements per peer) default to equal blocks.
    #[pyo3(signature = (send, recv, send_counts = None, recv_counts = None, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn all_to_all(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        send_counts: Option<Vec<usize>>,
        recv_counts: Option<Vec<usize>>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "all_to_all";
        let n = self.comm.world_size();
        let s = buffer(OP, "tensor", send, false)?;
        let r = buffer(OP, "out", recv, true)?;
        separate(OP, &s, &r)?;
        let sc = match send_counts {
            Some(c) => c,
            None => equal_counts(OP, "the input", s.elements(), n)?,
        };
        let rc = match recv_counts {
            Some(c) => c,
            None => equal_counts(OP, "the output", r.elements(), n)?,
        };
        self.dispatch(
            py,
            OP,
            async_op,
            keep(&[Some(send), Some(recv)]),
            // SAFETY: the objects outlive the job (see all_reduce), and `separate` refused
            // overlapping input and output.
            move |c| unsafe { c.all_to_all_v_bytes(s.bytes(), &sc, r.bytes_mut(), &rc, r.dtype) },
        )
    }

    /// Block until every rank has called barrier.
    #[pyo3(signature = (async_op = false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> PyResult<Option<PyWork>> {
        self.dispatch(py, "barrier", async_op, vec![], |c| c.barrier())
    }

    /// Send `buf` to `peer` with `tag`.
    #[pyo3(signature = (peer, tag, buf, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn send(
        &self,
        py: Python<'_>,
        peer: usize,
        tag: u32,
        buf: &Bound<'_, PyAny>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        let b = buffer("send", "tensor", buf, false)?;
        if async_op {
            // Posted: it progresses with every other posted send and receive (any order).
            let kept = work::Kept::new(b, keep(&[Some(buf)]));
            return Ok(Some(work::started(
                self.comm.send_async::<u8, _>(peer, tag, kept),
            )));
        }
        // SAFETY: the object outlives the call, and it is only read.
        self.dispatch(py, "send", false, Vec::new(), move |c| unsafe {
            c.send_bytes(peer, tag, b.bytes())
        })
    }

    /// Receive into `buf` the message `peer` sent with `tag` (sizes must match).
    #[pyo3(signature = (peer, tag, buf, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn recv(
        &self,
        py: Python<'_>,
        peer: usize,
        tag: u32,
        buf: &Bound<'_, PyAny>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        let b = buffer("recv", "tensor", buf, true)?;
        if async_op {
            // Posted: see `send`.
            let kept = work::Kept::new(b, keep(&[Some(buf)]));
            return Ok(Some(work::started(
                self.comm.recv_async::<u8, _>(peer, tag, kept),
            )));
        }
        // SAFETY: the object outlives the call, and this is its only view.
        self.dispatch(py, "recv", false, Vec::new(), move |c| unsafe {
            c.recv_bytes(peer, tag, b.bytes_mut())
        })
    }

    /// Receive into `buf` the first message with `tag` from any rank: the sender's rank, or
    /// with `async_op` a Work whose `source_rank()` tells it once waited for.
    #[pyo3(signature = (tag, buf, async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn recv_any(
        &self,
        py: Python<'_>,
        tag: u32,
        buf: &Bound<'_, PyAny>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let b = buffer("recv_any", "tensor", buf, true)?;
        if async_op {
            let kept = work::Kept::new(b, keep(&[Some(buf)]));
            let w = work::started_any(self.comm.recv_any_async::<u8, _>(tag, kept));
            return Ok(Py::new(py, w)?.into_any());
        }
        let c = self.comm.clone();
        // SAFETY: the object outlives the call, and this is its only view.
        let src = blocking(py, move || c.recv_any(tag, unsafe { b.bytes_mut() }))?;
        Ok(src.into_pyobject(py)?.into_any().unbind())
    }

    /// Send `send` to `dst` and receive `recv` from `src` at the same time.
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn send_recv(
        &self,
        py: Python<'_>,
        dst: usize,
        send: &Bound<'_, PyAny>,
        src: usize,
        recv: &Bound<'_, PyAny>,
        tag: u32,
    ) -> PyResult<()> {
        const OP: &str = "send_recv";
        let s = buffer(OP, "send", send, false)?;
        let r = buffer(OP, "recv", recv, true)?;
        if s.overlaps(&r) {
            return Err(invalid_argument(
                "send_recv: the send and recv buffers overlap",
            ));
        }
        let c = self.comm.clone();
        // SAFETY: both Python objects are borrowed for this blocking call, and they do not
        // overlap (checked above).
        blocking(py, move || unsafe {
            c.send_recv::<u8>(dst, s.bytes(), src, r.bytes_mut(), tag)
        })
    }

    /// Post a signal to `peer` (does not wait for it to be consumed).
    fn signal(&self, py: Python<'_>, peer: usize, tag: u32) -> PyResult<()> {
        let c = self.comm.clone();
        blocking(py, move || c.signal(peer, tag))
    }

    /// Wait for a signal from `peer` with `tag`.
    #[pyo3(signature = (peer, tag, async_op = false))]
    fn wait_signal(
        &self,
        py: Python<'_>,
        peer: usize,
        tag: u32,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        self.dispatch(py, "wait_signal", async_op, vec![], move |c| {
            c.wait_signal(peer, tag)
        })
    }

    /// Fused all-reduces on this communicator (see `hcomm.Fusion`). With `compressor` (a
    /// compressor string), every bucket is all-reduced compressed, each keeping its own
    /// compression state (with error feedback unless `error_feedback` is false) from step to
    /// step; `op` must then be sum or mean, and lossy compressors take float32 tensors only.
    /// With `skip_zeros`, uncompressed buckets skip their zero blocks (lossless; see
    /// `FusionOptions::skip_zero_blocks`).
    /// With `encode_on_push`, compressed buckets do the compressor's local part (top-k's
    /// selection) on the pushing thread (see `FusionOptions::encode_on_push`).
    #[pyo3(signature = (op = "sum", cap_bytes = 25 << 20, first_bucket_bytes = 1 << 20, direct_bytes = 1 << 20, compressor = None, error_feedback = true, skip_zeros = false, encode_on_push = false))]
    #[allow(clippy::too_many_arguments)]
    fn fusion(
        &self,
        py: Python<'_>,
        op: &str,
        cap_bytes: usize,
        first_bucket_bytes: usize,
        direct_bytes: usize,
        compressor: Option<&str>,
        error_feedback: bool,
        skip_zeros: bool,
        encode_on_push: bool,
    ) -> PyResult<PyFusion> {
        let opts = FusionOptions {
            cap_bytes,
            first_bucket_bytes,
            direct_bytes,
            skip_zero_blocks: skip_zeros,
            encode_on_push,
        };
        let op = parse_op(op)?;
        let compression = match compressor {
            None => None,
            Some(s) => {
                let c = parse_compressor(py, "fusion", s)?;
                if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                    return Err(to_pyerr(
                        py,
                        hcomm::Error::invalid(
                            "fusion",
                            0,
                            format!("compressed buckets are summed or averaged; this fusion reduces with {op}"),
                        ),
                    ));
                }
                let state = hcomm::CompressionState::new(c)
                    .map_err(|e| to_pyerr(py, e))?
                    .with_error_feedback(error_feedback);
                Some(state)
            }
        };
        Ok(PyFusion::new(self.comm.clone(), op, opts, compression))
    }

    /// All-reduce `buf` (float32, in place) compressed with `state`'s compressor (see
    /// `hcomm.CompressionState`); `op` is sum or mean. The operation always runs on the
    /// progress engine (the blocking form waits for it), so that the state is used in issue
    /// order. Errors: a dtype other than float32, another op, a state bound to another tensor
    /// size (`InvalidArgumentError`).
    #[pyo3(signature = (buf, state, op = "sum", async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn all_reduce_compressed(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        state: &Bound<'_, PyCompression>,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "all_reduce_compressed";
        let op = parse_op(op)?;
        let b = buffer(OP, "tensor", buf, true)?;
        let st = state.get().state.clone();
        if b.dtype != DType::F32 {
            let c = state.get().with(py, |s| s.compressor());
            return Err(to_pyerr(
                py,
                hcomm::Error::invalid(
                    OP,
                    0,
                    format!(
                        "tensor has dtype {}; compressed all-reduce takes float32 (compressor {c})",
                        dtype_name(b.dtype)
                    ),
                ),
            ));
        }
        if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
            return Err(to_pyerr(
                py,
                hcomm::Error::invalid(
                    OP,
                    0,
                    format!("compressed all-reduce sums or averages; got op {op}"),
                ),
            ));
        }
        let objects = keep(&[Some(buf), Some(state.as_any())]);
        let w = work::submit(&self.comm, OP, objects, move |c| {
            // Locked on the engine, in this operation's turn (a lock taken on the caller's
            // thread before the turn could wait for an earlier operation on the same state).
            let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: `buf` is kept alive by the Work until this job ends; nothing else views
            // it meanwhile (the caller must not touch it before wait()).
            unsafe { c.all_reduce_compressed_bytes(b.bytes_mut(), b.dtype, op, &mut s) }
        });
        if async_op {
            return Ok(Some(w));
        }
        w.wait(py, None)?;
        Ok(None)
    }

    /// Reduce-scatter `send` (float32, `world_size` equal chunks) into `recv` (one chunk)
    /// compressed with `state`'s compressor (fp16, bf16, int8, int8sr, sign or none); `op` is
    /// sum or mean. Runs on the progress engine, like `all_reduce_compressed`. Errors: a dtype
    /// other than float32, another op, sizes that do not match, a top-k or random-k state, a
    /// state bound to another tensor size (`InvalidArgumentError`).
    #[pyo3(signature = (send, recv, state, op = "sum", async_op = false))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn reduce_scatter_compressed(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        state: &Bound<'_, PyCompression>,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        const OP: &str = "reduce_scatter_compressed";
        let op = parse_op(op)?;
        let r = buffer(OP, "out", recv, true)?;
        let s = buffer(OP, "tensor", send, false)?;
        for (what, b) in [("tensor", &s), ("out", &r)] {
            if b.dtype != DType::F32 {
                let c = state.get().with(py, |s| s.compressor());
                return Err(to_pyerr(
                    py,
                    hcomm::Error::invalid(
                        OP,
                        0,
                        format!(
                            "{what} has dtype {}; compressed reduce-scatter takes float32 (compressor {c})",
                            dtype_name(b.dtype)
                        ),
                    ),
                ));
            }
        }
        separate(OP, &s, &r)?;
        let st = state.get().state.clone();
        let objects = keep(&[Some(send), Some(recv), Some(state.as_any())]);
        let w = work::submit(&self.comm, OP, objects, move |c| {
            let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: `send` and `recv` are kept alive by the Work until this job ends, and
            // do not overlap (checked above); the caller must not touch them before wait().
            unsafe {
                c.reduce_scatter_compressed_bytes(s.bytes(), r.bytes_mut(), r.dtype, op, &mut st)
            }
        });
        if async_op {
            return Ok(Some(w));
        }
        w.wait(py, None)?;
        Ok(None)
    }

    /// Sparse all-reduce of a row-sparse tensor: `indices` (int64, one per row) and `values`
    /// (`len(indices) * row_len` elements, row after row); `op` is sum or mean. The inputs are
    /// copied at the call. Returns (Work or None, result holder): the holder's `take()` gives
    /// the reduced rows once the operation has completed. `table_rows`: the rows of the tensor
    /// the rows belong to, when known (the ranks' must agree, every index be below it).
    #[pyo3(signature = (indices, values, row_len, op = "sum", async_op = false, table_rows = None))]
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one parameter each.
    fn sparse_all_reduce(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        row_len: usize,
        op: &str,
        async_op: bool,
        table_rows: Option<usize>,
    ) -> PyResult<(Option<PyWork>, PySparseResult)> {
        const OP: &str = "sparse_all_reduce";
        let op = parse_op(op)?;
        let ib = buffer(OP, "indices", indices, false)?;
        let vb = buffer(OP, "values", values, false)?;
        if ib.dtype != DType::I64 {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "{OP}: indices have dtype {}, expected int64",
                dtype_name(ib.dtype)
            )));
        }
        // SAFETY: both objects are borrowed for this call, and only read here.
        let (idx, vals): (Vec<i64>, Vec<u8>) = unsafe {
            (
                ib.bytes()
                    .chunks_exact(8)
                    .map(|b| i64::from_ne_bytes(b.try_into().expect("8 bytes")))
                    .collect(),
                vb.bytes().to_vec(),
            )
        };
        let dtype = vb.dtype;
        let slot = Arc::new(Mutex::new(None));
        let out = slot.clone();
        let work = self.dispatch(py, OP, async_op, Vec::new(), move |c| {
            let rows =
                c.sparse_all_reduce_table_bytes(&idx, &vals, row_len, table_rows, dtype, op)?;
            *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(rows);
            Ok(())
        })?;
        Ok((work, PySparseResult { slot }))
    }

    /// Bytes this rank moved per kind of operation since the communicator was made or
    /// `reset_traffic()` last ran: a list of (op, calls, tcp_sent, tcp_received, shm_written,
    /// shm_read).
    fn traffic(&self, py: Python<'_>) -> PyResult<Vec<compression::TrafficRow>> {
        compression::traffic(py, &self.comm)
    }

    /// Zero the byte counters of `traffic()`.
    fn reset_traffic(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.comm.clone();
        blocking(py, move || {
            c.reset_traffic();
            Ok(())
        })
    }

    /// Open a connection to `peer` under `tag` (both ranks call it with each other's rank).
    fn connect(&self, py: Python<'_>, peer: usize, tag: u32) -> PyResult<PyConnection> {
        let c = self.comm.clone();
        // The connection keeps the communicator alive itself (no borrow to extend).
        let conn = blocking(py, move || c.connect_shared(peer, tag))?;
        Ok(PyConnection {
            conn: Mutex::new(Some(conn)),
            peer,
            tag,
        })
    }

    /// Allocate `size` bytes of shared memory and publish it for the ranks of this host.
    /// Not collective.
    fn alloc_shared(&self, py: Python<'_>, size: usize) -> PyResult<PySharedMemory> {
        let c = self.comm.clone();
        blocking(py, move || c.alloc_shared(size)).map(PySharedMemory::new)
    }

    /// Map the shared memory `src_rank` allocated (waits for it up to the timeout).
    fn get_shared(&self, py: Python<'_>, src_rank: usize) -> PyResult<PySharedMemory> {
        let c = self.comm.clone();
        blocking(py, move || c.get_shared(src_rank)).map(PySharedMemory::new)
    }

    /// Split into sub-communicators (collective): ranks passing the same `color` form one,
    /// ordered by (key, rank). color=None leaves this rank out (returns None).
    #[pyo3(signature = (color, key = 0))]
    fn split(&self, py: Python<'_>, color: Option<u32>, key: i64) -> PyResult<Option<PyComm>> {
        let c = self.comm.clone();
        blocking(py, move || c.split(color, key)).map(|o| o.map(PyComm::wrap))
    }

    /// A communicator of `ranks` (only they call it, each with the same list).
    fn new_group(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<PyComm> {
        let c = self.comm.clone();
        blocking(py, move || c.new_group(&ranks)).map(PyComm::wrap)
    }

    fn __repr__(&self) -> String {
        format!(
            "<hcomm._hcomm.Communicator {} rank {} of {}>",
            self.comm.id(),
            self.comm.rank(),
            self.comm.world_size()
        )
    }
}

/// A connection to one peer under one tag (HCCL's CreateConnection).
#[pyclass(name = "Connection", module = "hcomm._hcomm", frozen)]
struct PyConnection {
    conn: Mutex<Option<hcomm::Connection<'static>>>,
    peer: usize,
    tag: u32,
}

impl PyConnection {
    fn with<R>(
        &self,
        f: impl FnOnce(&hcomm::Connection<'static>) -> hcomm::Result<R>,
    ) -> hcomm::Result<R> {
        let guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(c) => f(c),
            None => Err(hcomm::Error::invalid(
                "connection",
                0,
                format!(
                    "the connection to rank {} with tag {} is closed",
                    self.peer, self.tag
                ),
            )),
        }
    }
}

#[pymethods]
impl PyConnection {
    /// The peer's rank.
    #[getter]
    fn peer(&self) -> usize {
        self.peer
    }

    /// The tag.
    #[getter]
    fn tag(&self) -> u32 {
        self.tag
    }

    /// True once closed.
    #[getter]
    fn closed(&self) -> bool {
        self.conn.lock().map(|g| g.is_none()).unwrap_or(true)
    }

    /// Send `buf` on the connection.
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = buffer("send", "tensor", buf, false)?;
        blocking(py, move || {
            // SAFETY: the Python object is borrowed for this blocking call, and only read.
            self.with(|c| unsafe { c.send::<u8>(b.bytes()) })
        })
    }

    /// Receive into `buf` from the connection (sizes must match).
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = buffer("recv", "tensor", buf, true)?;
        blocking(py, move || {
            // SAFETY: the Python object is borrowed for this blocking call, and this is its
            // only view meanwhile.
            self.with(|c| unsafe { c.recv::<u8>(b.bytes_mut()) })
        })
    }

    /// Close the connection (local; closing twice is harmless).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner()).take();
        match conn {
            Some(c) => blocking(py, move || c.close()),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<hcomm._hcomm.Connection peer={} tag={}{}>",
            self.peer,
            self.tag,
            if self.closed() { " closed" } else { "" }
        )
    }
}

/// Shared memory of one rank, mapped here. `free()` unmaps it (and, for the owner,
/// unpublishes it); the address is invalid afterwards.
#[pyclass(name = "SharedMemory", module = "hcomm._hcomm", frozen)]
struct PySharedMemory {
    shm: RwLock<Option<hcomm::SharedMemory>>,
    owner: usize,
    size: usize,
    path: String,
}

impl PySharedMemory {
    fn new(shm: hcomm::SharedMemory) -> PySharedMemory {
        PySharedMemory {
            owner: shm.owner(),
            size: shm.len(),
            path: shm.path().to_string(),
            shm: RwLock::new(Some(shm)),
        }
    }

    fn freed_error(&self) -> PyErr {
        invalid_argument(format!(
            "the shared memory of rank {} ({}) was freed",
            self.owner, self.path
        ))
    }
}

#[pymethods]
impl PySharedMemory {
    /// Usable bytes.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// The rank that allocated it.
    #[getter]
    fn owner(&self) -> usize {
        self.owner
    }

    /// A file that maps the same memory (data at offset 0), valid while the owner holds it.
    #[getter]
    fn path(&self) -> String {
        self.path.clone()
    }

    /// Byte offset of the data in the file at `path` (0).
    #[getter]
    fn data_offset(&self) -> usize {
        0
    }

    /// Address of the first byte (for zero-copy views); an error once freed.
    #[getter]
    fn address(&self) -> PyResult<usize> {
        let g = self.shm.read().unwrap_or_else(|p| p.into_inner());
        g.as_ref()
            .map(|s| s.as_ptr() as usize)
            .ok_or_else(|| self.freed_error())
    }

    /// True once freed.
    #[getter]
    fn freed(&self) -> bool {
        self.shm.read().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    /// Copy `data` (bytes-like) into the memory at `offset`.
    #[pyo3(signature = (data, offset = 0))]
    fn write(&self, py: Python<'_>, data: Vec<u8>, offset: usize) -> PyResult<()> {
        let g = self.shm.read().unwrap_or_else(|p| p.into_inner());
        let s = g.as_ref().ok_or_else(|| self.freed_error())?;
        s.write(offset, &data).map_err(|e| to_pyerr(py, e))
    }

    /// Copy `size` bytes at `offset` out of the memory.
    #[pyo3(signature = (size, offset = 0))]
    fn read(&self, py: Python<'_>, size: usize, offset: usize) -> PyResult<Vec<u8>> {
        let g = self.shm.read().unwrap_or_else(|p| p.into_inner());
        let s = g.as_ref().ok_or_else(|| self.freed_error())?;
        // Checked before allocating: a size beyond the memory is an error, not an abort.
        if offset.checked_add(size).is_none_or(|end| end > s.len()) {
            return Err(invalid_argument(format!(
                "SharedMemory.read: {size} bytes at offset {offset} go beyond its {} bytes",
                s.len()
            )));
        }
        let mut out = vec![0u8; size];
        s.read(offset, &mut out).map_err(|e| to_pyerr(py, e))?;
        Ok(out)
    }

    /// Unmap (and, for the owner, free) the memory. Views made from `address` must be gone.
    fn free(&self) {
        let shm = self.shm.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(shm);
    }

    fn __repr__(&self) -> String {
        format!(
            "<hcomm._hcomm.SharedMemory owner={} size={} path={}{}>",
            self.owner,
            self.size,
            self.path,
            if self.freed() { " freed" } else { "" }
        )
    }
}

/// Start `nprocs` local ranks of `program args…` with the hcomm and torch launch variables
/// set (what `hcomm run` does); returns the first non-zero exit code, or 0. `bind` is the
/// CPU placement: `"spread"` (each rank its own share of the CPUs, when they do not
/// outnumber them) or `"none"`.
#[pyfunction]
#[pyo3(signature = (program, args, nprocs = 1, nnodes = 1, node_rank = 0, master_addr = None, master_port = None, prefix_output = true, grace_ms = 3000, keep_going = false, bind = "spread"))]
#[allow(clippy::too_many_arguments)]
fn launch(
    py: Python<'_>,
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    nprocs: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: Option<String>,
    master_port: Option<u16>,
    prefix_output: bool,
    grace_ms: u64,
    keep_going: bool,
    bind: &str,
) -> PyResult<i32> {
    use hcomm_launch::{launch, Bind, LaunchError, LaunchSpec};
    let bind: Bind = bind
        .parse()
        .map_err(|e: String| pyo3::exceptions::PyValueError::new_err(format!("bind: {e}")))?;
    let mut spec = LaunchSpec::new(nprocs, program, args);
    spec.bind = bind;
    spec.nnodes = nnodes;
    spec.node_rank = node_rank;
    if let Some(a) = master_addr {
        spec.master_addr = a;
    }
    spec.master_port = master_port;
    spec.prefix_output = prefix_output;
    spec.grace = Duration::from_millis(grace_ms);
    spec.keep_going = keep_going;
    let r = py.detach(move || std::panic::catch_unwind(move || launch(&spec)));
    match r {
        Ok(Ok(code)) => Ok(code),
        Ok(Err(e)) => {
            let code = if matches!(e, LaunchError::Spawn { .. }) {
                127
            } else {
                1
            };
            Err(errors::launch_error(py, e.to_string(), code))
        }
        Err(p) => Err(PyRuntimeError::new_err(format!(
            "hcomm run: internal error (a bug in hcomm): {}",
            errors::panic_message(&p)
        ))),
    }
}

/// The element types hcomm communicates, by numpy name.
#[pyfunction]
fn dtypes() -> Vec<&'static str> {
    buffer::DTYPE_NAMES.iter().map(|(n, _)| *n).collect()
}

/// Size in bytes of one element of dtype `name` (`float32`, `bf16`, ...).
#[pyfunction]
fn dtype_size(name: &str) -> PyResult<usize> {
    parse_dtype(name).map(|d| d.size())
}

/// A TCP port free on `host` now, outside the system's ephemeral range (so nothing the system
/// numbers itself takes it before rank 0 binds it) and new to this process.
#[pyfunction]
fn free_master_port(host: &str) -> PyResult<u16> {
    hcomm::bootstrap::free_master_port(host)
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("no free port on {host}: {e}")))
}

/// The Rust extension of the `hcomm` package.
#[pymodule]
fn _hcomm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    hcomm_launch::init_logging();
    m.add_class::<PyComm>()?;
    m.add_class::<PyConnection>()?;
    m.add_class::<PySharedMemory>()?;
    m.add_class::<PyWork>()?;
    m.add_class::<PyFusion>()?;
    m.add_class::<PyCompression>()?;
    m.add_class::<PySparseResult>()?;
    m.add_function(wrap_pyfunction!(launch, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_size, m)?)?;
    m.add_function(wrap_pyfunction!(free_master_port, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
