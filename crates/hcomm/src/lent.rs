//! A buffer lent to the progress engine by a scope that waits for it.
//!
//! The engine runs jobs that must be `'static`; a caller's borrowed tensor is not. A
//! [`LentBuf`] carries the borrowed bytes as a raw pointer so a job can reduce them in place
//! (no copy), under a rule the lender enforces: it keeps the `&mut` borrow alive and untouched
//! until the job has finished — [`crate::fusion::Fusion::step`] waits for every job before it
//! returns, also when the caller's closure panics.

/// Bytes borrowed from a caller for the duration of one asynchronous job.
pub(crate) struct LentBuf {
    ptr: *mut u8,
    len: usize,
}

impl LentBuf {
    /// Lend `bytes`.
    ///
    /// # Safety
    /// The caller must keep `bytes` borrowed, and must neither read, write nor free it, until
    /// the job this `LentBuf` is moved into has finished (its `Work` has completed), and must
    /// make sure nothing else gets a view of the `LentBuf`.
    pub(crate) unsafe fn new(bytes: &mut [u8]) -> LentBuf {
        LentBuf {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
        }
    }
}

// SAFETY: a LentBuf is the only access to its bytes while it exists (the lender's contract in
// `LentBuf::new`), so moving it to the engine thread is like moving a `&mut [u8]`.
unsafe impl Send for LentBuf {}

impl AsMut<[u8]> for LentBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr`/`len` come from a live `&mut [u8]` that the lender keeps borrowed and
        // untouched while this LentBuf exists (see `LentBuf::new`), and `&mut self` makes this
        // the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
