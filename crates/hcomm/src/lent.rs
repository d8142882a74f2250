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

/// A buffer an asynchronous point-to-point operation owns while it is in flight
/// ([`crate::comm::posted`]), and the view of its bytes the progress loop uses.
///
/// The progress loop's operations borrow their bytes for as long as they run, and new
/// operations join a running loop, so the bytes cannot be a borrow of anything the loop owns.
/// [`hold_for_send`] and [`hold_for_recv`] therefore keep the buffer behind a raw pointer (from
/// `Box::into_raw`, so moving the `Held` moves neither the buffer nor its bytes) and return a
/// view of unbounded lifetime beside it, under one invariant that their only user,
/// `comm::posted`, upholds: **a view is used only while its `Held` exists and never after
/// [`Held::into_inner`]**. The progress loop drops every frame that borrows a message's view
/// before it completes the message's `Work` (`Flight::complete`, `Flight::fail_all`), which is
/// what calls `into_inner`; a message refused before it starts never uses its view.
pub(crate) struct Held<B> {
    owner: *mut B,
}

// SAFETY: a Held is the only owner of its buffer; moving it to another thread is moving a
// `Box<B>` (the view handed out beside it follows the invariant above).
unsafe impl<B: Send> Send for Held<B> {}

/// Own `buf`, whose bytes will only be read (a send); its bytes, viewed under [`Held`]'s
/// invariant.
pub(crate) fn hold_for_send<T: bytemuck::Pod, B: AsRef<[T]> + 'static>(
    buf: B,
) -> (&'static [u8], Held<B>) {
    let owner = Box::into_raw(Box::new(buf));
    // SAFETY: `owner` comes from `Box::into_raw` just above: valid, aligned and unaliased. The
    // view outlives this borrow only under the invariant of `Held` (the buffer stays where it
    // is until `into_inner` or drop, and the view is not used after them).
    let bytes: &'static [u8] = bytemuck::cast_slice(unsafe { &*owner }.as_ref());
    (bytes, Held { owner })
}

/// Own `buf`, whose bytes will be written (a receive); the only view of its bytes, under
/// [`Held`]'s invariant.
pub(crate) fn hold_for_recv<T: bytemuck::Pod, B: AsMut<[T]> + 'static>(
    buf: B,
) -> (&'static mut [u8], Held<B>) {
    let owner = Box::into_raw(Box::new(buf));
    // SAFETY: as in `hold_for_send`; nothing else views the buffer until `into_inner`.
    let bytes: &'static mut [u8] = bytemuck::cast_slice_mut(unsafe { &mut *owner }.as_mut());
    (bytes, Held { owner })
}

impl<B> Held<B> {
    /// The buffer back (every view of it is gone: the type's invariant).
    pub(crate) fn into_inner(self) -> B {
        let owner = self.owner;
        std::mem::forget(self);
        // SAFETY: `owner` comes from `Box::into_raw` and is turned back only here (the drop
        // that would do it too is skipped).
        *unsafe { Box::from_raw(owner) }
    }
}

impl<B> Drop for Held<B> {
    fn drop(&mut self) {
        // SAFETY: `owner` comes from `Box::into_raw`; `into_inner` forgets the Held, so this
        // runs at most once and only when the buffer was not given back.
        drop(unsafe { Box::from_raw(self.owner) });
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

    #[test]
    fn a_held_buffer_is_written_through_its_view_and_given_back() {
        let (bytes, held) = hold_for_recv(vec![0u32; 4]);
        bytes[4] = 1;
        assert_eq!(held.into_inner(), [0, 1, 0, 0]);
        // An array moves into the box: the view is of the boxed copy.
        let (bytes, held) = hold_for_send([7u8, 8, 9]);
        assert_eq!(bytes, &[7, 8, 9]);
        assert_eq!(held.into_inner(), [7, 8, 9]);
        drop(hold_for_send(vec![1u8; 3]).1); // freed without being given back
    }
}
