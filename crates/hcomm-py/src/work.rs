//! Asynchronous operations: `Work` handles over the communicator's progress engine.

use crate::errors::{blocking, to_pyerr};
use hcomm::{Communicator as Comm, Error};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
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

enum State {
    Pending(hcomm::Work<()>),
    Done(Result<(), Error>),
}

/// A handle on an asynchronous operation (see `hcomm.Work`).
#[pyclass(name = "Work", module = "hcomm._hcomm", frozen)]
pub struct PyWork {
    state: Mutex<State>,
    done: Arc<AtomicBool>,
    op: &'static str,
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
        state: Mutex::new(State::Pending(work)),
        done,
        op,
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
        self.done.load(Ordering::Acquire)
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
