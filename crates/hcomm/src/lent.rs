//! Buffers lent to the progress engine by a scope that waits for them: the library's only
//! `unsafe` code for foreign (borrowed) buffers.
//!
//! The engine runs jobs that must be `'static`; a caller's borrowed tensor is not. [`scope`]
//! lets a caller lend `&'env mut [u8]` buffers to such jobs as [`LentBuf`]s (a raw pointer, so
//! a job can reduce them in place, with no copy), under one invariant this module upholds by
//! itself: **a lent buffer is used only while its `LentBuf` exists, and [`scope`] does not
//! return — also not by unwinding — before every `LentBuf` lent in it has been dropped.** The
//! borrow `'env` outlives the call to `scope`, and the `&mut` borrow moved into
//! [`Lender::lend`] keeps the caller away from the bytes meanwhile, so the bytes stay alive and
//! untouched while a job uses them, whatever the job or the caller does (a `LentBuf` that is
//! leaked makes `scope` wait forever: a hang, never a dangling access).

use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};

/// Buffers lent and not yet returned (dropped), with a condition signalled at each return.
#[derive(Default)]
struct Outstanding {
    count: Mutex<usize>,
    returned: Condvar,
}

impl Outstanding {
    fn lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.count.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Lends buffers borrowed for `'env` within one [`scope`].
pub(crate) struct Lender<'env> {
    outstanding: Arc<Outstanding>,
    /// Invariant in `'env`: only buffers of exactly the scope's borrow are lent.
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'env> Lender<'env> {
    /// Lend `bytes` to a job: they come back (the borrow ends) when the scope returns, after
    /// the `LentBuf` has been dropped.
    pub(crate) fn lend(&self, bytes: &'env mut [u8]) -> LentBuf {
        *self.outstanding.lock() += 1;
        LentBuf {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            outstanding: self.outstanding.clone(),
        }
    }
}

/// Waits, on drop, until every buffer of its scope has been returned.
struct WaitOnDrop(Arc<Outstanding>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        let mut n = self.0.lock();
        while *n > 0 {
            n = self.0.returned.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Run `f` with a [`Lender`] for buffers borrowed for `'env`; returns (or unwinds) only once
/// every buffer lent in it has been returned.
pub(crate) fn scope<'env, R>(f: impl FnOnce(&Lender<'env>) -> R) -> R {
    let lender = Lender {
        outstanding: Arc::new(Outstanding::default()),
        _env: PhantomData,
    };
    let _wait = WaitOnDrop(lender.outstanding.clone());
    f(&lender)
}

/// Bytes borrowed from a [`scope`]'s caller for the duration of one asynchronous job.
pub(crate) struct LentBuf {
    ptr: *mut u8,
    len: usize,
    outstanding: Arc<Outstanding>,
}

// SAFETY: a LentBuf is the only access to its bytes while it exists (the `&mut` borrow moved
// into `Lender::lend` lasts until the scope returns, which waits for this LentBuf), so moving it
// to the engine thread is like moving a `&mut [u8]`.
unsafe impl Send for LentBuf {}

impl AsMut<[u8]> for LentBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr`/`len` come from a `&'env mut [u8]` moved into `Lender::lend`; `'env`
        // outlives the scope, which does not end before this LentBuf is dropped (the module's
        // invariant), so the bytes are alive and nobody else accesses them; `&mut self` makes
        // this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for LentBuf {
    fn drop(&mut self) {
        // The job's last access to the bytes happens before this unlock, so before the scope's
        // wait (the same mutex) sees the count fall and returns.
        let mut n = self.outstanding.lock();
        *n -= 1;
        if *n == 0 {
            self.outstanding.returned.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_waits_for_a_lent_buffer_used_on_another_thread() {
        let mut data = vec![0u8; 1 << 16];
        scope(|lender| {
            let mut lent = lender.lend(&mut data);
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                lent.as_mut().fill(7);
            });
        });
        assert!(data.iter().all(|&b| b == 7));
    }
}
