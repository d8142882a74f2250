//! Shared memory between the ranks of one host, as the documented
//! `AllocateSharedMemory` / `GetSharedMemory(src_rank)` / `FreeSharedMemory`:
//!
//! * [`Communicator::alloc_shared`] creates and publishes this rank's segment (not collective);
//! * [`Communicator::get_shared`] maps the segment `src_rank` published, waiting for it up to the
//!   communicator's timeout; ranks on other hosts get an error;
//! * [`Communicator::alloc_window`] is the collective form: every rank allocates its part and
//!   maps every peer's.
//!
//! Segments are anonymous memory files (memfd): they have no name in `/dev/shm`, so none can
//! outlive the job; a peer opens the owner's `/proc/<pid>/fd/<fd>` while the owner holds it.
//! The owner's [`SharedMemory`] frees its segment on drop (peers keep their mappings valid).
//! The data start at offset 0 of the file (so `torch.from_file(path, shared=True, size=n)` or
//! `numpy.memmap(path)` map them as they are); a 64-byte trailer after them (at the data length
//! rounded up to 64: magic, a random id, the size) is what `get_shared` checks, so a stale
//! record can never map the wrong memory.

use crate::base::error::{Error, Result};
use crate::comm::Communicator;
use crate::shm::segment::Segment;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const WIN_MAGIC: u64 = 0x6863_6f6d_6d77_696e; // "hcommwin"
/// Size of the trailer that follows the data.
const WIN_TRAILER: usize = 64;

/// Offset of the trailer in a segment with `len` data bytes (64-byte aligned, so its words are
/// aligned for atomics).
fn trailer_at(len: usize) -> usize {
    len.div_ceil(WIN_TRAILER) * WIN_TRAILER
}

/// Bytes of a segment with `len` data bytes.
fn segment_len(len: usize) -> usize {
    trailer_at(len) + WIN_TRAILER
}

/// A shared segment: this rank's own ([`Communicator::alloc_shared`]) or a peer's
/// ([`Communicator::get_shared`]).
pub struct SharedMemory {
    seg: Segment,
    owner: usize,
    len: usize,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("owner", &self.owner)
            .field("len", &self.len)
            .field("path", &self.path())
            .finish()
    }
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("rank", &self.rank)
            .field("parts", &self.parts)
            .finish()
    }
}

impl SharedMemory {
    /// Usable bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero bytes were allocated.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rank that allocated it.
    pub fn owner(&self) -> usize {
        self.owner
    }

    /// A path that maps the same memory (`/proc/<pid>/fd/<fd>` of the owner; the data start at
    /// offset 0, followed by hcomm's 64-byte trailer). Valid while the owner holds the segment.
    pub fn path(&self) -> &str {
        self.seg.name()
    }

    /// Byte offset of the data in the file at [`path`](Self::path) (0).
    pub fn data_offset(&self) -> usize {
        0
    }

    /// Address of the first data byte (for zero-copy views from other languages).
    pub fn as_ptr(&self) -> *mut u8 {
        self.seg.as_ptr()
    }

    /// Copy `src` into the segment at `offset`. Ranks sharing a segment order their accesses
    /// themselves (e.g. with `signal` / `wait_signal` or a barrier).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // Ordering with other ranks is the caller's protocol (the windows' part of the
        // invariant in `shm/segment.rs`).
        self.seg.put(offset, src);
        Ok(())
    }

    /// Copy bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // As for `write`.
        self.seg.get(offset, dst);
        Ok(())
    }

    /// The data as a slice.
    ///
    /// # Safety
    /// No rank may write the segment while the slice lives.
    // The two views are `unsafe` by nature (other processes share the memory); each is one
    // call of the matching `Segment` view with the same contract, so the allowance is limited
    // to these two functions.
    #[allow(unsafe_code)]
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: caller's obligation, see above.
        unsafe { self.seg.bytes(0, self.len) }
    }

    /// The data as a mutable slice.
    ///
    /// # Safety
    /// No other rank may access the segment while the slice lives.
    #[allow(unsafe_code)] // See `as_slice`.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: caller's obligation, see above.
        unsafe { self.seg.bytes_mut(0, self.len) }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(
                "shared_memory",
                0,
                format!(
                    "{len} bytes at offset {offset} do not fit in a {}-byte segment",
                    self.len
                ),
            ));
        }
        Ok(())
    }
}

/// Every local rank's part of a window ([`Communicator::alloc_window`]).
pub struct Window {
    parts: Vec<SharedMemory>,
    rank: usize,
}

impl Window {
    /// This rank's part.
    pub fn local(&self) -> &SharedMemory {
        &self.parts[self.rank]
    }

    /// Rank `r`'s part.
    pub fn part(&self, r: usize) -> &SharedMemory {
        &self.parts[r]
    }

    /// Number of parts (the communicator's size).
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    /// True for an empty communicator (never).
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }
}

/// Refuse `bytes` of new shared memory that this host cannot hold: one segment (`parts` = 1)
/// or the `parts` parts of a window together. An anonymous segment is a memfd, which no tmpfs
/// size limits: reserving more than the host has would wake the kernel's OOM killer, which may
/// pick any process of the host, instead of failing this call.
fn check_fits(op: &'static str, bytes: u64, parts: usize) -> Result<()> {
    let Some(free) = crate::comm::host_memory::available() else {
        return Ok(());
    };
    if bytes > free {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let what = if parts == 1 {
            format!("{bytes} bytes of shared memory is")
        } else {
            format!("the window's {parts} parts need {bytes} bytes of shared memory together,")
        };
        return Err(Error::invalid(
            op,
            0,
            format!(
                "{what} more than this host has available ({:.1} GiB: MemAvailable in \
                 /proc/meminfo, or the room under this process's memory cgroup limit if less)",
                gib(free)
            ),
        ));
    }
    Ok(())
}

/// Holds the host's allocation lock (an `flock` on `hcomm-alloc.lock` in `/dev/shm`, or in
/// the temporary directory where that is missing) while a rank checks the memory it may take
/// and takes it, so that two processes of the host cannot both see room for their segment and
/// together reserve more than there is. The kernel releases the lock when the file closes,
/// also when its process dies. Best effort: where the file cannot be opened, no lock is held.
struct HostAllocLock {
    _file: Option<std::fs::File>,
}

impl HostAllocLock {
    fn acquire() -> Self {
        let dir = std::path::Path::new("/dev/shm");
        let dir = if dir.is_dir() {
            dir.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let path = dir.join("hcomm-alloc.lock");
        // Another user's lock file may not be writable: `flock` needs only an open file.
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o666)
                .open(&path)
        }
        .or_else(|_| std::fs::File::open(&path))
        .ok()
        .filter(|f| rustix::fs::flock(f, rustix::fs::FlockOperation::LockExclusive).is_ok());
        if file.is_none() {
            tracing::debug!("no host allocation lock at {}", path.display());
        }
        Self { _file: file }
    }
}

/// A new anonymous segment of `bytes` usable bytes with its trailer written; returns its id.
fn new_segment(op: &'static str, bytes: usize) -> Result<(Segment, u64)> {
    let seg = {
        let _lock = HostAllocLock::acquire();
        check_fits(op, bytes as u64, 1)?;
        Segment::anonymous(segment_len(bytes))
            .map_err(|e| Error::io(crate::base::error::OpContext { op, seq: 0 }, None, e))?
    };
    let id = crate::base::ids::random_u64();
    let t = trailer_at(bytes);
    seg.atomic_u64(t + 8).store(id, Ordering::Relaxed);
    seg.atomic_u64(t + 16)
        .store(bytes as u64, Ordering::Relaxed);
    seg.atomic_u64(t).store(WIN_MAGIC, Ordering::Release);
    Ok((seg, id))
}

/// How a window's record starts when its rank could not reserve its part (the reason follows).
const FAILED: &str = "failed: ";

fn record(path: &str, id: u64, len: usize) -> Vec<u8> {
    format!("{path} {id:x} {len}").into_bytes()
}

impl Communicator {
    fn check_same_host(&self, op: &'static str, r: usize) -> Result<()> {
        if r >= self.world_size() {
            return Err(Error::invalid(
                op,
                0,
                format!(
                    "rank {r} is out of range for a communicator of {} ranks",
                    self.world_size()
                ),
            ));
        }
        let (mine, theirs) = (self.host_id(), &self.host_ids()[r]);
        if mine != theirs {
            return Err(Error::invalid(op, 0, format!("rank {r} is on host '{theirs}', this rank on '{mine}': shared memory works only between ranks of one host")));
        }
        Ok(())
    }

    /// Allocate `bytes` of shared memory and publish it for the ranks of this host
    /// (`AllocateSharedMemory`). Not collective.
    pub fn alloc_shared(&self, bytes: usize) -> Result<SharedMemory> {
        let (seg, id) = new_segment("alloc_shared", bytes)?;
        self.store_set(
            &format!("{}/shared/{}", self.id(), self.rank()),
            &record(seg.name(), id, bytes),
        )?;
        Ok(SharedMemory {
            seg,
            owner: self.rank(),
            len: bytes,
        })
    }

    /// Map the segment `src_rank` published with [`alloc_shared`](Self::alloc_shared)
    /// (`GetSharedMemory`), waiting for it up to the timeout. Zero-copy, read-write.
    pub fn get_shared(&self, src_rank: usize) -> Result<SharedMemory> {
        self.check_same_host("get_shared", src_rank)?;
        if src_rank == self.rank() {
            // Nobody else can publish this rank's memory: waiting for it would only time out.
            let key = format!("{}/shared/{src_rank}", self.id());
            if let Err(Error::Timeout { .. }) = self.store_get(&key, Instant::now()) {
                return Err(Error::invalid(
                    "get_shared",
                    0,
                    format!(
                        "rank {src_rank} is this rank, which has no shared memory published: \
                         call AllocateSharedMemory / alloc_shared first"
                    ),
                ));
            }
        }
        self.map_published(
            &format!("{}/shared/{src_rank}", self.id()),
            src_rank,
            "get_shared",
        )
    }

    /// Map the segment `owner` publishes under `key` (for `op`: `get_shared` or
    /// `alloc_window`), waiting for it until the communicator's timeout.
    fn map_published(&self, key: &str, owner: usize, op: &'static str) -> Result<SharedMemory> {
        let ctx = crate::base::error::OpContext { op, seq: 0 };
        let call = match op {
            "get_shared" => "AllocateSharedMemory / alloc_shared",
            _ => op,
        };
        let deadline = Instant::now() + self.timeout();
        loop {
            let rec = self.store_get(key, deadline).map_err(|e| match e {
                // Say whom this rank waited for, and for what (not the store's key).
                Error::Timeout { after, .. } => Error::Timeout {
                    ctx: ctx.clone(),
                    peers: vec![owner],
                    after,
                    detail: format!("rank {owner} has not called {call}"),
                },
                other => other,
            })?;
            let text = String::from_utf8_lossy(&rec).into_owned();
            if let Some(reason) = text.strip_prefix(FAILED) {
                // Like the failing rank's own error, not fatal: nothing was kept anywhere.
                return Err(Error::invalid(
                    op,
                    0,
                    format!("rank {owner} could not reserve its part: {reason}"),
                ));
            }
            let f: Vec<&str> = text.split(' ').collect();
            let bad = || Error::Protocol {
                ctx: ctx.clone(),
                peer: owner,
                msg: format!("bad shared memory record '{text}'"),
            };
            if f.len() != 3 {
                return Err(bad());
            }
            let id = u64::from_str_radix(f[1], 16).map_err(|_| bad())?;
            let len: usize = f[2]
                .parse()
                .ok()
                .filter(|&l: &usize| l <= isize::MAX as usize / 2)
                .ok_or_else(bad)?;
            // The record names another process's fd: it must still be our memfd (an fd number
            // can be reused for anything once the owner freed the segment).
            let path = f[0];
            let pid_dir = path.rsplitn(3, '/').nth(2).unwrap_or("");
            if !pid_dir.is_empty() && !std::path::Path::new(pid_dir).exists() {
                return Err(Error::PeerClosed {
                    ctx,
                    peer: owner,
                    detail: format!("its process ({pid_dir}) is gone"),
                });
            }
            let is_ours = std::fs::read_link(path)
                .is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:hcomm-window"));
            let mapped = if is_ours {
                Segment::open_path(path, segment_len(len)).ok()
            } else {
                None
            };
            match mapped {
                Some(seg)
                    if seg.atomic_u64(trailer_at(len)).load(Ordering::Acquire) == WIN_MAGIC
                        && seg.atomic_u64(trailer_at(len) + 8).load(Ordering::Relaxed) == id =>
                {
                    return Ok(SharedMemory { seg, owner, len });
                }
                // Stale (the owner freed that segment): wait for a new record.
                _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                // The owner is alive (its process is there) but freed that segment and has
                // not published another: a wait that timed out, not a closed connection.
                _ => {
                    return Err(Error::Timeout {
                        ctx,
                        peers: vec![owner],
                        after: self.timeout(),
                        detail: format!(
                            "rank {owner} freed its shared memory ({path}) and has not called \
                             {call} again"
                        ),
                    })
                }
            }
        }
    }

    /// Collective: every rank allocates `bytes` and maps every other rank's part. All ranks must
    /// share a host.
    pub fn alloc_window(&self, bytes: usize) -> Result<Window> {
        for r in 0..self.world_size() {
            self.check_same_host("alloc_window", r)?;
        }
        let n = self.next_window_number();
        // Every part must fit, and all of them together: ranks that each checked only their own
        // part could reserve, between them, more than the host has.
        let mut sizes = vec![0u64; self.world_size()];
        self.all_gather(&[bytes as u64], &mut sizes)?;
        let total = sizes.iter().fold(0u64, |t, &b| t.saturating_add(b));
        let key = format!("{}/window{n}/{}", self.id(), self.rank());
        let reserved = check_fits("alloc_window", total, sizes.len())
            .and_then(|()| new_segment("alloc_window", bytes));
        let (seg, id) = match reserved {
            Ok(part) => part,
            Err(e) => {
                // The ranks mapping this part learn why it will not come, and fail now naming
                // this rank and the cause instead of timing out (the readings of the host's
                // memory differ a little between ranks, and other processes take memory too).
                let _ = self.store_set(&key, format!("{FAILED}{e}").as_bytes());
                return Err(e);
            }
        };
        self.store_set(&key, &record(seg.name(), id, bytes))?;
        let mut parts = Vec::with_capacity(self.world_size());
        let mut mine = Some(SharedMemory {
            seg,
            owner: self.rank(),
            len: bytes,
        });
        for r in 0..self.world_size() {
            if r == self.rank() {
                parts.push(mine.take().expect("own part"));
            } else {
                parts.push(self.map_published(
                    &format!("{}/window{n}/{r}", self.id()),
                    r,
                    "alloc_window",
                )?);
            }
        }
        // Nobody frees its part before everyone has mapped it.
        self.barrier()?;
        Ok(Window {
            parts,
            rank: self.rank(),
        })
    }
}

impl Communicator {
    /// All-reduce in place on the first `bytes` of every rank's part of `win` (zero-copy: no
    /// staging). Collective. Each rank reduces its slice from every part, in rank order, and
    /// writes the result into that slice of every part; two barriers bracket the work, so the
    /// parts must not be touched by anyone else between the call and its return.
    pub fn all_reduce_window(
        &self,
        win: &Window,
        bytes: usize,
        dtype: crate::base::dtype::DType,
        op: crate::base::dtype::ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce_window";
        let n = self.world_size();
        if win.len() != n {
            return Err(Error::invalid(
                OP,
                0,
                format!("window has {} parts, communicator {n} ranks", win.len()),
            ));
        }
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(Error::invalid(
                OP,
                0,
                format!("{bytes} bytes is not a whole number of {dtype} elements"),
            ));
        }
        if let Some(p) = win.parts.iter().find(|p| p.len() < bytes) {
            return Err(Error::invalid(
                OP,
                0,
                format!(
                    "rank {}'s part holds {} bytes, fewer than {bytes}",
                    p.owner(),
                    p.len()
                ),
            ));
        }
        let segs = crate::base::segments::even_segments(bytes / dtype.size(), n, dtype.size());
        let mine = segs[self.rank()].clone();
        // Entry: every rank has written its input.
        self.barrier()?;
        // In pieces through a small buffer (cache-resident, and no large allocation per call).
        const PIECE: usize = 64 << 10;
        let piece = PIECE / dtype.size() * dtype.size();
        let mut acc = vec![0u8; piece.min(mine.len())];
        let mut off = mine.start;
        while off < mine.end {
            let l = piece.min(mine.end - off);
            let acc = &mut acc[..l];
            for (p, part) in win.parts.iter().enumerate() {
                // Protocol: between the two barriers, slice `mine` of every part is read and
                // written by this rank only (each rank owns a different slice; the caller
                // guarantees nobody else touches the window during the call).
                let src = part.seg.view(off, l);
                if p == 0 {
                    acc.copy_from_slice(src);
                } else {
                    crate::base::reduce::reduce_into(
                        dtype,
                        op,
                        acc,
                        src,
                        crate::base::reduce::Order::AccFirst,
                    );
                }
            }
            if op == crate::base::dtype::ReduceOp::Mean {
                crate::base::reduce::finalize_mean(dtype, acc, n);
            }
            for part in &win.parts {
                // Protocol: as above, this rank's slice, between the barriers.
                part.seg.put(off, acc);
            }
            off += l;
        }
        // Exit: every slice of every part holds the result.
        self.barrier()
    }
}
