//! Gradient fusion for Python: tensors pushed one at a time as they become ready are packed
//! into buckets (hcomm's `BucketPlanner`) whose all-reduces start at once on the progress
//! engine; `finish` waits for them and unpacks. The Python side is `hcomm.Fusion`.

use crate::buffer::{buffer, Buf};
use crate::errors::blocking;
use hcomm::fusion::{Bucket, BucketPlanner, FusionOptions};
use hcomm::{Communicator as Comm, ReduceOp};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

struct Pushed {
    buf: Buf,
    /// Keeps the tensor alive until the step has finished.
    _owner: Py<PyAny>,
}

struct Step {
    planner: BucketPlanner,
    tensors: Vec<Pushed>,
    in_flight: Vec<(Bucket, hcomm::Work<Option<Vec<u8>>>)>,
    launched: usize,
}

/// Fused all-reduces for one communicator (see `hcomm.Fusion`).
#[pyclass(name = "Fusion", module = "hcomm._hcomm", frozen)]
pub struct PyFusion {
    comm: Arc<Comm>,
    op: ReduceOp,
    opts: FusionOptions,
    step: Mutex<Step>,
}

impl PyFusion {
    pub fn new(comm: Arc<Comm>, op: ReduceOp, opts: FusionOptions) -> PyFusion {
        PyFusion {
            comm,
            op,
            opts,
            step: Mutex::new(Step {
                planner: BucketPlanner::new(opts),
                tensors: Vec::new(),
                in_flight: Vec::new(),
                launched: 0,
            }),
        }
    }

    fn launch(&self, s: &mut Step, bucket: Bucket) {
        let (dtype, op) = (bucket.dtype, self.op);
        let work = if bucket.direct {
            let b = s.tensors[bucket.members[0]].buf;
            self.comm.run_async("all_reduce", move |c| {
                // SAFETY: the tensor is kept alive by the step (`Pushed::_owner`) until
                // `finish` has waited for this job; the caller must not touch it meanwhile.
                c.all_reduce_bytes(None, unsafe { b.bytes_mut() }, dtype, op)?;
                Ok(None)
            })
        } else {
            let mut buf = Vec::with_capacity(bucket.bytes);
            for &i in &bucket.members {
                // SAFETY: alive (kept by the step); only read.
                buf.extend_from_slice(unsafe { s.tensors[i].buf.bytes() });
            }
            self.comm.run_async("all_reduce", move |c| {
                c.all_reduce_bytes(None, &mut buf, dtype, op)?;
                Ok(Some(buf))
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
    fn push(&self, tensor: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = buffer("fusion", "tensor", tensor, true)?;
        let mut s = self.step.lock().unwrap_or_else(|p| p.into_inner());
        if s.tensors.iter().any(|t| t.buf.overlaps(&b)) {
            return Err(PyValueError::new_err(
                "fusion: this tensor's memory overlaps a tensor already pushed in this step",
            ));
        }
        let index = s.tensors.len();
        s.tensors.push(Pushed {
            buf: b,
            _owner: tensor.clone().unbind(),
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
    fn finish(&self, py: Python<'_>) -> PyResult<usize> {
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
        let r = blocking(py, move || {
            let mut first_err = None;
            for (bucket, work) in in_flight {
                match work.wait() {
                    Ok(Some(packed)) => {
                        let mut off = 0;
                        for &i in &bucket.members {
                            // SAFETY: the tensor is alive (`tensors` is dropped after this
                            // closure) and its job has finished.
                            let t = unsafe { bufs[i].bytes_mut() };
                            t.copy_from_slice(&packed[off..off + t.len()]);
                            off += t.len();
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            first_err.map_or(Ok(()), Err)
        });
        drop(tensors);
        r.map(|()| launched)
    }

    fn __repr__(&self) -> String {
        format!(
            "<hcomm._hcomm.Fusion op={} cap_bytes={} first_bucket_bytes={} direct_bytes={}>",
            self.op, self.opts.cap_bytes, self.opts.first_bucket_bytes, self.opts.direct_bytes
        )
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
