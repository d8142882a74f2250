//! Gradient fusion for Python: tensors pushed one at a time as they become ready are packed
//! into buckets (hcomm's `BucketPlanner`) whose all-reduces start at once on the progress
//! engine; `finish` waits for them and unpacks. The Python side is `hcomm.Fusion`.
//!
//! With a compressor, each bucket is all-reduced with `all_reduce_compressed`, and keeps its
//! compression state (residuals) from step to step, keyed by its members (positions in the
//! step) and its size, as `hcomm::fusion::Fusion::with_compression` does.

use crate::buffer::{buffer, dtype_name, Buf};
use crate::errors::invalid_argument;
use crate::errors::{blocking, to_pyerr};
use hcomm::fusion::{
    prepare_bucket, reduce_bucket, Bucket, BucketPlanner, BucketState, BucketStates, FusionOptions,
};
use hcomm::{Communicator as Comm, CompressionState, DType, ReduceOp};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// What a bucket's job hands back: the packed buffer (None when reduced in place) and the
/// bucket's compression state.
type BucketResult = (Option<Vec<u8>>, Option<BucketState>);

struct Pushed {
    buf: Buf,
    /// Keeps the tensor (and a torch tensor's storage) alive until the step has finished.
    _owner: Vec<Py<PyAny>>,
}

struct Step {
    planner: BucketPlanner,
    tensors: Vec<Pushed>,
    in_flight: Vec<(Bucket, hcomm::Work<BucketResult>)>,
    launched: usize,
}

/// Fused all-reduces for one communicator (see `hcomm.Fusion`).
#[pyclass(name = "Fusion", module = "hcomm._hcomm", frozen)]
pub struct PyFusion {
    comm: Arc<Comm>,
    op: ReduceOp,
    opts: FusionOptions,
    step: Mutex<Step>,
    /// The state a new bucket starts from, when buckets are compressed (lossy compressors
    /// only; `none` runs the plain all-reduce).
    compression: Option<CompressionState>,
    /// Each bucket's compression state between steps.
    states: BucketStates,
}

impl PyFusion {
    pub fn new(
        comm: Arc<Comm>,
        op: ReduceOp,
        opts: FusionOptions,
        compression: Option<CompressionState>,
    ) -> PyFusion {
        PyFusion {
            comm,
            op,
            opts,
            compression: compression.filter(|s| s.compressor().is_lossy()),
            states: BucketStates::default(),
            step: Mutex::new(Step {
                planner: BucketPlanner::new(opts),
                tensors: Vec::new(),
                in_flight: Vec::new(),
                launched: 0,
            }),
        }
    }

    #[allow(unsafe_code)] // Views of the step's Python buffers: see `buffer::Buf`.
    fn launch(&self, s: &mut Step, bucket: Bucket) {
        let (dtype, op, skip_zeros) = (bucket.dtype, self.op, self.opts.skip_zero_blocks);
        let mut comp = self
            .compression
            .as_ref()
            .map(|fresh| self.states.take(fresh, &bucket));
        let reduce = move |c: &Comm, buf: &mut [u8], comp: &mut Option<BucketState>| {
            reduce_bucket(c, buf, dtype, op, comp, skip_zeros)
        };
        // With encode_on_push, the compressor's local part runs here, on the pushing thread.
        let encode_here = self.opts.encode_on_push;
        let work = if bucket.direct {
            let b = s.tensors[bucket.members[0]].buf;
            // SAFETY: alive (kept by the step); nothing else uses it until the job below.
            prepare_bucket(&mut comp, unsafe { b.bytes_mut() }, encode_here);
            self.comm.run_async("all_reduce", move |c| {
                // SAFETY: the tensor is kept alive by the step (`Pushed::_owner`) until
                // `finish` has waited for this job; the caller must not touch it meanwhile.
                reduce(c, unsafe { b.bytes_mut() }, &mut comp)?;
                Ok((None, comp))
            })
        } else {
            let mut buf = Vec::with_capacity(bucket.bytes);
            for &i in &bucket.members {
                // SAFETY: alive (kept by the step); only read.
                buf.extend_from_slice(unsafe { s.tensors[i].buf.bytes() });
            }
            prepare_bucket(&mut comp, &mut buf, encode_here);
            self.comm.run_async("all_reduce", move |c| {
                reduce(c, &mut buf, &mut comp)?;
                Ok((Some(buf), comp))
            })
        };
        s.launched += 1;
        s.in_flight.push((bucket, work));
    }
}

#[pymethods]
impl PyFusion {
    /// Add a ready tensor (numpy array or CPU torch tensor); launches a bucket when this fills
    /// one. Do not touch the tensor until `finish` returns.
    fn push(&self, py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = buffer("fusion", "tensor", tensor, true)?;
        let mut s = self.step.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = &self.compression {
            if b.dtype != DType::F32 {
                return Err(to_pyerr(
                    py,
                    hcomm::Error::invalid(
                        "fusion",
                        0,
                        format!(
                            "compressor {} takes float32 tensors; tensor #{} of this step is {}",
                            c.compressor(),
                            s.tensors.len(),
                            dtype_name(b.dtype)
                        ),
                    ),
                ));
            }
        }
        if s.tensors.iter().any(|t| t.buf.overlaps(&b)) {
            return Err(invalid_argument(
                "fusion: this tensor's memory overlaps a tensor already pushed in this step",
            ));
        }
        let index = s.tensors.len();
        s.tensors.push(Pushed {
            buf: b,
            _owner: crate::keep(&[Some(tensor)]),
        });
        for bucket in s.planner.add(index, b.dtype, b.elements() * b.dtype.size()) {
            self.launch(&mut s, bucket);
        }
        Ok(())
    }

    /// Launch every open bucket now.
    fn flush(&self) {
        let mut s = self.step.lock().unwrap_or_else(|p| p.into_inner());
        for bucket in s.planner.flush() {
            self.launch(&mut s, bucket);
        }
    }

    /// Buckets launched in this step so far.
    #[getter]
    fn buckets_launched(&self) -> usize {
        self.step.lock().unwrap_or_else(|p| p.into_inner()).launched
    }

    /// Launch what is left, wait for every bucket, unpack the results into the tensors, and
    /// start a new step. Returns the number of buckets of the step. Raises the first error
    /// (after waiting for every bucket).
    ///
    /// With `ready`, call `ready(positions)` (step positions of tensors whose results are in,
    /// in launch order) as buckets arrive, while later buckets may still be in flight: each
    /// call covers the bucket just waited for and every following bucket that had already
    /// arrived by then, so a step whose buckets have all arrived makes one call. An exception
    /// from `ready` stops the calls; the remaining buckets are still waited for, then it is
    /// raised.
    #[pyo3(signature = (ready = None))]
    #[allow(unsafe_code)] // Views of the step's Python buffers: see `buffer::Buf`.
    fn finish(&self, py: Python<'_>, ready: Option<Bound<'_, PyAny>>) -> PyResult<usize> {
        self.flush();
        let step = {
            let mut s = self.step.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::replace(
                &mut *s,
                Step {
                    planner: BucketPlanner::new(self.opts),
                    tensors: Vec::new(),
                    in_flight: Vec::new(),
                    launched: 0,
                },
            )
        };
        let Step {
            tensors,
            in_flight,
            launched,
            ..
        } = step;
        let bufs: Vec<Buf> = tensors.iter().map(|t| t.buf).collect();
        let states = &self.states;
        let mut first_err: Option<PyErr> = None;
        let mut ready = ready;
        let mut in_flight = in_flight.into_iter().peekable();
        while let Some(next) = in_flight.next() {
            // This bucket (waited for), then every following one that has already arrived:
            // one callback for all of them, so a caller that steps an optimizer per call
            // pays its per-call cost once for what arrived while it was busy.
            let mut group = vec![next];
            while let Some(more) = in_flight.next_if(|(_, w)| w.is_completed()) {
                group.push(more);
            }
            let mut arrived = Vec::new();
            for (bucket, work) in group {
                let bufs = &bufs;
                let waited = blocking(py, move || {
                    let (buf, comp) = work.wait()?;
                    if let Some(state) = comp {
                        states.put(state);
                    }
                    if let Some(packed) = buf {
                        let mut off = 0;
                        for &i in &bucket.members {
                            // SAFETY: the tensor is alive (`tensors` is dropped after every
                            // bucket has been waited for) and its job has finished.
                            let t = unsafe { bufs[i].bytes_mut() };
                            t.copy_from_slice(&packed[off..off + t.len()]);
                            off += t.len();
                        }
                    }
                    Ok(bucket.members)
                });
                match waited {
                    Ok(members) => arrived.extend(members),
                    Err(e) => {
                        // report what arrived before the failed bucket, then stop calling
                        report_arrived(&mut ready, std::mem::take(&mut arrived), &mut first_err);
                        first_err.get_or_insert(e);
                        ready = None;
                    }
                }
            }
            report_arrived(&mut ready, arrived, &mut first_err);
        }
        drop(tensors);
        first_err.map_or(Ok(launched), Err)
    }

    /// The buckets' compressor (canonical string), or None when buckets are not compressed.
    #[getter]
    fn compressor(&self) -> Option<String> {
        self.compression
            .as_ref()
            .map(|s| s.compressor().to_string())
    }

    /// Whether compressed buckets use error feedback (None without compression).
    #[getter]
    fn error_feedback(&self) -> Option<bool> {
        self.compression.as_ref().map(|s| s.error_feedback())
    }

    /// Forget every bucket's compression state (residuals), e.g. when the model changes.
    fn reset_compression(&self) {
        self.states.clear();
    }

    /// (buckets with a compression state kept between steps, bytes their residuals hold).
    fn compression_memory(&self) -> (usize, usize) {
        self.states.memory()
    }

    fn __repr__(&self) -> String {
        format!(
            "<hcomm._hcomm.Fusion op={} cap_bytes={} first_bucket_bytes={} direct_bytes={} compressor={}>",
            self.op,
            self.opts.cap_bytes,
            self.opts.first_bucket_bytes,
            self.opts.direct_bytes,
            self.compression
                .as_ref()
                .map_or("none".to_string(), |s| s.compressor().to_string())
        )
    }
}

/// `finish`'s callback with the positions that arrived (none: no call); an exception from it
/// is kept as the step's error and stops further calls.
fn report_arrived(
    ready: &mut Option<Bound<'_, PyAny>>,
    arrived: Vec<usize>,
    first_err: &mut Option<PyErr>,
) {
    if let (Some(f), false) = (ready.as_ref(), arrived.is_empty()) {
        if let Err(e) = f.call1((arrived,)) {
            first_err.get_or_insert(e);
            *ready = None;
        }
    }
}

impl Drop for PyFusion {
    /// A step abandoned with buckets in flight: wait for them, so no tensor memory is used
    /// after its owner is released.
    fn drop(&mut self) {
        let s = self.step.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, work) in s.in_flight.drain(..) {
            let _ = work.wait();
        }
    }
}
