//! hcomm's errors as the exceptions of `hcomm.errors`, and the one way this crate calls into
//! the library: without the GIL and under `catch_unwind`.

use hcomm::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    ERRORS
        .get_or_try_init(py, || py.import("hcomm.errors").map(Bound::unbind))?
        .bind(py)
        .getattr(name)
}

/// An instance of `hcomm.errors.<name>(message)` with attributes set, as a `PyErr`.
fn make(py: Python<'_>, name: &str, msg: String, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    let built = (|| -> PyResult<PyErr> {
        let inst = class(py, name)?.call1((msg.clone(),))?;
        for (k, v) in attrs {
            inst.setattr(*k, v.bind(py))?;
        }
        Ok(PyErr::from_value(inst))
    })();
    built.unwrap_or_else(|e| {
        PyRuntimeError::new_err(format!("{msg} (and hcomm.errors.{name} is unusable: {e})"))
    })
}

/// The panic's message.
pub fn panic_message(p: &Box<dyn Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".into()
    }
}

/// An hcomm error as the matching exception: `InvalidArgumentError` (also a `ValueError`),
/// `HcommTimeoutError` (also a `TimeoutError`), `PeerError` (peer closed, remote failure,
/// protocol error), `AbortedError`, `RevokedError`, `MismatchError`, `PoisonedError`, `ConfigError`,
/// `AuthenticationError` (also a `PermissionError`), or
/// `HcommError` itself. Attributes: `op`, `seq`, `peers`, `fatal`.
pub fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let (name, ctx, peers): (&str, Option<&hcomm::OpContext>, Vec<usize>) = match &e {
        Error::InvalidArgument { ctx, .. } => ("InvalidArgumentError", Some(ctx), vec![]),
        Error::Timeout { ctx, peers, .. } => ("HcommTimeoutError", Some(ctx), peers.clone()),
        Error::WaitTimeout { .. } => ("HcommTimeoutError", None, vec![]),
        Error::PeerClosed { ctx, peer, .. } | Error::Protocol { ctx, peer, .. } => {
            ("PeerError", Some(ctx), vec![*peer])
        }
        // A failure another rank reported: the rank it blames (the one to drop in a shrink),
        // or the reporter when it blames none.
        Error::Remote {
            ctx, peer, culprit, ..
        } => ("PeerError", Some(ctx), vec![culprit.unwrap_or(*peer)]),
        Error::Mismatch { ctx, peer, .. } | Error::SizeMismatch { ctx, peer, .. } => {
            ("MismatchError", Some(ctx), vec![*peer])
        }
        Error::Poisoned { ctx, .. } => ("PoisonedError", Some(ctx), vec![]),
        Error::Aborted { ctx } => ("AbortedError", Some(ctx), vec![]),
        Error::Revoked { ctx, by } => ("RevokedError", Some(ctx), vec![*by]),
        Error::Io { ctx, peer, .. } => ("HcommError", Some(ctx), peer.iter().copied().collect()),
        Error::Auth { ctx, peer, .. } => (
            "AuthenticationError",
            Some(ctx),
            peer.iter().copied().collect(),
        ),
        Error::Config(_) => ("ConfigError", None, vec![]),
        // The library may grow variants: they are HcommErrors until mapped here.
        #[allow(unreachable_patterns)]
        _ => ("HcommError", None, vec![]),
    };
    let fatal = pyo3::types::PyBool::new(py, e.is_fatal()).to_owned();
    let mut attrs: Vec<(&str, Py<PyAny>)> = vec![("fatal", fatal.into_any().unbind())];
    if let Ok(p) = pyo3::types::PyTuple::new(py, &peers) {
        attrs.push(("peers", p.into_any().unbind()));
    }
    if let Some(c) = ctx {
        let Ok(op) = c.op.into_pyobject(py);
        let Ok(seq) = c.seq.into_pyobject(py);
        attrs.push(("op", op.into_any().unbind()));
        attrs.push(("seq", seq.into_any().unbind()));
    }
    make(py, name, e.to_string(), &attrs)
}

/// `hcomm.errors.InvalidArgumentError(message)` (also a `ValueError`): an argument refused
/// before anything was sent.
pub fn invalid_argument(msg: impl Into<String>) -> PyErr {
    Python::attach(|py| make(py, "InvalidArgumentError", msg.into(), &[]))
}

/// `hcomm.errors.LaunchError(message)` with `exit_code`.
pub fn launch_error(py: Python<'_>, msg: String, exit_code: i32) -> PyErr {
    let code = exit_code
        .into_pyobject(py)
        .map(|c| c.into_any().unbind())
        .unwrap_or_else(|_| py.None());
    make(py, "LaunchError", msg, &[("exit_code", code)])
}

/// Run `f` without the GIL (it may block) and with panics caught: its error or panic comes
/// back as a Python exception.
pub fn blocking<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> hcomm::Result<T> + Send,
) -> PyResult<T> {
    match py.detach(move || catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_pyerr(py, e)),
        Err(p) => Err(make(
            py,
            "HcommError",
            format!(
                "internal error (a bug in hcomm, please report it): {}",
                panic_message(&p)
            ),
            &[],
        )),
    }
}
