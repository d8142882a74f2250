//! A POSIX shared-memory segment mapped into this process.
//!
//! With [`super::ring`] (the ring's unsafe `Bytes` contract), this file holds the library's
//! only `unsafe` code for shared memory ([`super::futex`] needs none: rustix's futex calls are
//! safe). Everything else — the collectives in `shm/mod.rs`, the point-to-point rings in
//! `shm/p2p.rs`, the windows in `comm/window.rs` — reaches the bytes through the safe,
//! crate-internal accessors below (`Segment::put`, `Segment::get`, `Segment::view`,
//! `Segment::view_mut`) and the atomics ([`Segment::atomic_u32`], [`Segment::atomic_u64`]).
//!
//! # The invariant those accessors rely on
//!
//! Every access is bounds-checked once per call (a slice-level check, never per element); what
//! cannot be checked here is exclusion between ranks. It is stated once, here: **while a copy
//! into or out of a byte range runs, or a view of it lives, the range is either written by this
//! rank alone (`put`, `view_mut`) or written by nobody (`get`, `view`)**, as the protocol that
//! owns the segment orders it:
//!
//! * the collectives (`shm/mod.rs`, `shm/all_to_all_v.rs`): arrivals with release/acquire
//!   ordering hand each slot, staging and result range to one writer per phase (README.md
//!   beside this file); every call site says which step of the protocol grants the range;
//! * the rings (`shm/p2p.rs`): the single-producer/single-consumer protocol of `ring.rs`;
//! * windows (`comm/window.rs`): the users' own ordering (signals, barriers), as
//!   `SharedMemory`'s documentation requires, and `all_reduce_window`'s two barriers.
//!
//! The accessors are `pub(crate)` so that no code outside the library can call them; the public
//! `unsafe` methods ([`Segment::write`], [`Segment::read`], [`Segment::bytes`],
//! [`Segment::bytes_mut`]) state the same obligation as their `# Safety` contract.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;

use rustix::fs::Mode;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::shm::OFlags;

/// A mapped segment. Unmapped on drop; the name is unlinked by whoever called
/// [`Segment::unlink`] (the creator, once every local rank has attached), so that a crash of
/// any rank leaves nothing in /dev/shm.
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    name: String,
    /// For anonymous (memfd) segments: the descriptor that lets peers open
    /// `/proc/<pid>/fd/<fd>` while this process keeps it.
    fd: Option<rustix::fd::OwnedFd>,
}

// SAFETY: the mapping is plain shared memory; every access from this crate goes through atomic
// types or through byte ranges whose exclusive use is guaranteed by the protocol in README.md.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Create a new segment `name` of `len` bytes (0600, must not exist) and map it.
    pub fn create(name: &str, len: usize) -> io::Result<Segment> {
        let fd = rustix::shm::open(
            name,
            OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
            Mode::RUSR | Mode::WUSR,
        )?;
        // Reserve the pages now: on a full tmpfs this fails here (and the caller falls back to
        // TCP) instead of raising SIGBUS at the first touch of a missing page.
        if let Err(e) = rustix::fs::ftruncate(&fd, len as u64).and_then(|()| {
            rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, len as u64)
        }) {
            let _ = rustix::shm::unlink(name);
            return Err(e.into());
        }
        Self::map(fd, name, len).inspect_err(|_| {
            let _ = rustix::shm::unlink(name);
        })
    }

    /// Map the existing segment `name`, which must be `len` bytes.
    pub fn open(name: &str, len: usize) -> io::Result<Segment> {
        let fd = rustix::shm::open(name, OFlags::RDWR, Mode::empty())?;
        let st = rustix::fs::fstat(&fd)?;
        if (st.st_size as u64) < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "shared memory {name} is {} bytes, expected {len}",
                    st.st_size
                ),
            ));
        }
        Self::map(fd, name, len)
    }

    fn map(fd: rustix::fd::OwnedFd, name: &str, len: usize) -> io::Result<Segment> {
        // SAFETY: a fresh shared mapping of a file we hold open; no existing memory is affected.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Segment {
            ptr,
            len,
            name: name.to_string(),
            fd: None,
        })
    }

    /// Create an anonymous segment (memfd): it has no name in /dev/shm, so it can never be
    /// left behind; other local processes open it through [`name`](Self::name)
    /// (`/proc/<pid>/fd/<fd>`) while this segment lives.
    pub fn anonymous(len: usize) -> io::Result<Segment> {
        let fd = rustix::fs::memfd_create("hcomm-window", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, len as u64)?;
        let keep = fd.try_clone()?;
        let mut seg = Self::map(fd, "", len.max(1))?;
        seg.name = format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            std::os::fd::AsRawFd::as_raw_fd(&keep)
        );
        seg.fd = Some(keep);
        Ok(seg)
    }

    /// Map the file at `path` (another process's anonymous segment), which must hold at least
    /// `len` bytes.
    pub fn open_path(path: &str, len: usize) -> io::Result<Segment> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let size = file.metadata()?.len();
        if size < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} is {size} bytes, expected {len}"),
            ));
        }
        Self::map(rustix::fd::OwnedFd::from(file), path, len.max(1))
    }

    /// Base address of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Remove the name (the memory lives on while mapped).
    pub fn unlink(&self) -> io::Result<()> {
        rustix::shm::unlink(self.name.as_str()).map_err(Into::into)
    }

    /// The segment's name (for anonymous segments: the `/proc/<pid>/fd/<fd>` path).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length segment.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 32-bit atomic at byte offset `off` (4-byte aligned, inside the segment).
    pub fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "atomic at {off} outside the segment"
        );
        // SAFETY: in bounds and aligned (checked above; the mapping is page-aligned); AtomicU32
        // has the layout of u32 and the memory lives as long as `self`.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// The 64-bit atomic at byte offset `off` (8-byte aligned, inside the segment).
    pub fn atomic_u64(&self, off: usize) -> &std::sync::atomic::AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "atomic at {off} outside the segment"
        );
        // SAFETY: as for `atomic_u32`.
        unsafe {
            &*self
                .ptr
                .as_ptr()
                .add(off)
                .cast::<std::sync::atomic::AtomicU64>()
        }
    }

    /// Copy `src` into the segment at `off`.
    ///
    /// # Safety
    /// No other rank may access these bytes until this rank publishes them with a release store
    /// (the protocol in README.md gives the range to this rank alone).
    pub unsafe fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off + src.len() <= self.len,
            "write of {} bytes at {off} outside the segment",
            src.len()
        );
        // SAFETY: in bounds; a `&[u8]` cannot alias the exclusively owned target range (caller's
        // obligation), so the copy does not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        }
    }

    /// Copy bytes at `off` into `dst`.
    ///
    /// # Safety
    /// The writer must have published the bytes (release) and this rank observed that
    /// (acquire), and nobody may write them until this rank says it is done.
    pub unsafe fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off + dst.len() <= self.len,
            "read of {} bytes at {off} outside the segment",
            dst.len()
        );
        // SAFETY: in bounds; `dst` is exclusively borrowed, so it cannot overlap a range that is
        // only read here.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// A shared view of `len` bytes at `off`.
    ///
    /// # Safety
    /// Nobody may write the range while the view lives (as for [`read`](Self::read)).
    pub unsafe fn bytes(&self, off: usize, len: usize) -> &[u8] {
        assert!(
            off + len <= self.len,
            "view of {len} bytes at {off} outside the segment"
        );
        // SAFETY: in bounds; no concurrent writer is the caller's obligation (see # Safety).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// An exclusive view of `len` bytes at `off`.
    ///
    /// # Safety
    /// Nobody else may read or write the range while the view lives (as for
    /// [`write`](Self::write)), and this rank must hold no other view of it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(
            off + len <= self.len,
            "view of {len} bytes at {off} outside the segment"
        );
        // SAFETY: in bounds; exclusivity is the caller's obligation (see # Safety).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

/// Protocol-ordered access for the library itself (see "The invariant" in the module header).
impl Segment {
    /// Copy `src` into the segment at `off` (bounds checked). The protocol must give this rank
    /// the range alone until it publishes it with a release store.
    pub(crate) fn put(&self, off: usize, src: &[u8]) {
        // SAFETY: every caller is a step of the segment's protocol that gives this rank the
        // range alone (the invariant in the module header); `write` checks the bounds.
        unsafe { self.write(off, src) }
    }

    /// Copy the bytes at `off` into `dst` (bounds checked). The protocol must have published
    /// them to this rank and keep them unwritten until this rank says it is done.
    pub(crate) fn get(&self, off: usize, dst: &mut [u8]) {
        // SAFETY: every caller is a step of the segment's protocol in which nobody writes the
        // range (the invariant in the module header); `read` checks the bounds.
        unsafe { self.read(off, dst) }
    }

    /// A shared view of `len` bytes at `off` (bounds checked once), for reading in place. The
    /// protocol must keep the range unwritten while the view lives.
    pub(crate) fn view(&self, off: usize, len: usize) -> &[u8] {
        // SAFETY: every caller holds the view only during a step of the segment's protocol in
        // which nobody writes the range (the invariant in the module header).
        unsafe { self.bytes(off, len) }
    }

    /// An exclusive view of `len` bytes at `off` (bounds checked once), for reducing in place.
    /// The protocol must give this rank the range alone while the view lives, and the caller
    /// holds no other view of it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn view_mut(&self, off: usize, len: usize) -> &mut [u8] {
        // SAFETY: every caller holds the view only during a step of the segment's protocol that
        // gives this rank the range alone, and takes one view of it at a time (the invariant in
        // the module header).
        unsafe { self.bytes_mut(off, len) }
    }
}

/// The data bytes of one ring (`cap` bytes at offset `at`) of a segment, for [`super::ring`].
pub(crate) struct RingBytes<'a> {
    seg: &'a Segment,
    at: usize,
    cap: usize,
}

impl<'a> RingBytes<'a> {
    /// The `cap` bytes at `at` of `seg` (checked against the segment's size).
    pub(crate) fn new(seg: &'a Segment, at: usize, cap: usize) -> RingBytes<'a> {
        assert!(
            at.checked_add(cap).is_some_and(|end| end <= seg.len()),
            "ring of {cap} bytes at {at} outside the segment"
        );
        RingBytes { seg, at, cap }
    }
}

impl super::ring::Bytes for RingBytes<'_> {
    fn capacity(&self) -> usize {
        self.cap
    }
    unsafe fn copy_in(&self, at: usize, src: &[u8]) {
        assert!(at + src.len() <= self.cap);
        // SAFETY: inside this ring's data; exclusivity is the caller's contract (ring.rs).
        unsafe { self.seg.write(self.at + at, src) }
    }
    unsafe fn copy_out(&self, at: usize, dst: &mut [u8]) {
        assert!(at + dst.len() <= self.cap);
        // SAFETY: inside this ring's data; publication is the caller's contract (ring.rs).
        unsafe { self.seg.read(self.at + at, dst) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range and nothing borrows it past `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
