//! Asynchronous operations: `Work` handles over the communicator's progress engine.

use crate::errors::{blocking, to_pyerr};
use hcomm::{Communicator as Comm, Error};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Owned by an asynchronous job: the Python objects whose memory it uses, released when the
/// job ends (on the engine thread, without the GIL: pyo3 defers the decrements), and the
/// completion flag `is_completed` reads, set whichever way the job ends.
pub struct Keep {
    done: Arc<AtomicBool>,
    _objects: Vec<Py<PyAny>>,
}

impl Drop for Keep {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
    }
}

/// An operation in flight, whatever its result type (the buffers it gives back are the
/// Python objects' own memory: nothing to return).
trait Pending: Send {
    fn wait(self: Box<Self>) -> Result<(), Error>;
    fn wait_timeout(&mut self, d: Duration) -> Result<(), Error>;
}

impl<R: Send> Pending for hcomm::Work<R> {
    fn wait(self: Box<Self>) -> Result<(), Error> {
        hcomm::Work::wait(*self).map(drop)
    }

    fn wait_timeout(&mut self, d: Duration) -> Result<(), Error> {
        hcomm::Work::wait_timeout(self, d).map(drop)
    }
}

enum State {
    Pending(Box<dyn Pending>),
    Done(Result<(), Error>),
}

/// How a handle learns that its operation finished without waiting for it.
enum Finished {
    /// Set when the job (and the Python objects it kept) is done.
    Flag(Arc<AtomicBool>),
    /// The core's own completion state.
    Probe(hcomm::Completion),
}

/// A handle on an asynchronous operation (see `hcomm.Work`).
#[pyclass(name = "Work", module = "hcomm._hcomm", frozen)]
pub struct PyWork {
    state: Mutex<State>,
    done: Finished,
    op: &'static str,
    /// The sender of a receive from any source, once waited for (-1 before, and for others).
    source: Arc<AtomicI64>,
}

/// A receive from any source: waiting records the sender.
struct FromAny {
    work: hcomm::Work<(usize, Kept)>,
    source: Arc<AtomicI64>,
}

impl Pending for FromAny {
    fn wait(self: Box<Self>) -> Result<(), Error> {
        let (src, _) = self.work.wait()?;
        self.source.store(src as i64, Ordering::Release);
        Ok(())
    }

    fn wait_timeout(&mut self, d: Duration) -> Result<(), Error> {
        let (src, _) = self.work.wait_timeout(d)?;
        self.source.store(src as i64, Ordering::Release);
        Ok(())
    }
}

/// A handle on a posted receive from any source (`source_rank()` tells the sender).
pub fn started_any(work: hcomm::Work<(usize, Kept)>) -> PyWork {
    let source = Arc::new(AtomicI64::new(-1));
    PyWork {
        op: work.op(),
        done: Finished::Probe(work.completion()),
        source: source.clone(),
        state: Mutex::new(State::Pending(Box::new(FromAny { work, source }))),
    }
}

/// Run `f` on `comm`'s progress engine, after every operation issued before it; `objects`
/// (the Python owners of the memory `f` uses) stay alive until it has finished.
pub fn submit(
    comm: &Arc<Comm>,
    op: &'static str,
    objects: Vec<Py<PyAny>>,
    f: impl FnOnce(&Comm) -> hcomm::Result<()> + Send + 'static,
) -> PyWork {
    let done = Arc::new(AtomicBool::new(false));
    let keep = Keep {
        done: done.clone(),
        _objects: objects,
    };
    let work = comm.run_async(op, move |c| {
        let r = f(c);
        drop(keep);
        r
    });
    PyWork {
        state: Mutex::new(State::Pending(Box::new(work))),
        done: Finished::Flag(done),
        op,
        source: Arc::new(AtomicI64::new(-1)),
    }
}

/// A handle on an operation the core started itself (a posted send or receive, whose buffer
/// keeps the Python objects alive).
pub fn started<R: Send + 'static>(work: hcomm::Work<R>) -> PyWork {
    PyWork {
        op: work.op(),
        done: Finished::Probe(work.completion()),
        state: Mutex::new(State::Pending(Box::new(work))),
        source: Arc::new(AtomicI64::new(-1)),
    }
}

/// The bytes of Python objects, kept alive by the operation that owns this (a posted send or
/// receive: see `hcomm::Communicator::send_async`).
pub struct Kept {
    buf: crate::buffer::Buf,
    _objects: Vec<Py<PyAny>>,
}

impl Kept {
    pub fn new(buf: crate::buffer::Buf, objects: Vec<Py<PyAny>>) -> Kept {
        Kept {
            buf,
            _objects: objects,
        }
    }
}

impl AsRef<[u8]> for Kept {
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `_objects` keeps the object alive as long as this exists, and the range
        // was checked to be its contiguous data; the core reads it only.
        unsafe { self.buf.bytes() }
    }
}

impl AsMut<[u8]> for Kept {
    #[allow(unsafe_code)] // Views of the Python buffers it was given: see `buffer::Buf`.
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_ref`; the object reported the range writable, and the core's
        // receive holds the only view while it is in flight.
        unsafe { self.buf.bytes_mut() }
    }
}

impl PyWork {
    /// Wait (at most `limit`); the outcome is kept, so later waits report it again.
    fn wait_for(&self, limit: Option<Duration>) -> Result<(), Error> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let outcome = match &mut *g {
            State::Done(r) => return r.clone(),
            State::Pending(w) => match limit {
                Some(d) => match w.wait_timeout(d) {
                    Err(e @ Error::WaitTimeout { .. }) => return Err(e),
                    r => r,
                },
                None => {
                    let State::Pending(w) = std::mem::replace(&mut *g, State::Done(Ok(()))) else {
                        unreachable!("matched Pending above")
                    };
                    w.wait()
                }
            },
        };
        *g = State::Done(outcome.clone());
        outcome
    }
}

#[pymethods]
impl PyWork {
    /// Wait for the operation; with `timeout` (seconds), raise HcommTimeoutError if it is still
    /// in flight then (it goes on; wait again). Raises the operation's error if it failed, on
    /// every call.
    #[pyo3(signature = (timeout = None))]
    pub fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let limit = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => {
                return Err(crate::errors::invalid_argument(format!(
                    "timeout must be a non-negative number of seconds, got {t}"
                )))
            }
        };
        blocking(py, move || self.wait_for(limit))
    }

    /// True once the operation has finished (successfully or not). Never blocks.
    fn is_completed(&self) -> bool {
        match &self.done {
            Finished::Flag(f) => f.load(Ordering::Acquire),
            Finished::Probe(p) => p.is_completed(),
        }
    }

    /// The sender of a receive from any source once it was waited for; None before, and for
    /// other operations.
    fn source_rank(&self) -> Option<i64> {
        Some(self.source.load(Ordering::Acquire)).filter(|&s| s >= 0)
    }

    /// The operation's name.
    #[getter]
    fn op(&self) -> &'static str {
        self.op
    }

    /// The operation's error if it finished with one (without waiting), else None.
    fn exception(&self, py: Python<'_>) -> Option<PyErr> {
        let g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &*g {
            State::Done(Err(e)) => Some(to_pyerr(py, e.clone())),
            _ => None,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<hcomm._hcomm.Work {} {}>",
            self.op,
            if self.is_completed() {
                "completed"
            } else {
                "pending"
            }
        )
    }
}
