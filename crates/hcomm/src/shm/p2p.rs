//! Point-to-point over shared memory: one segment per communicator and host holding a
//! single-producer/single-consumer byte ring ([`super::ring`]) per ordered pair of the host's
//! ranks. A [`ShmPipe`] is one rank's end of the two rings it shares with a peer; the TCP
//! links' progress loop ([`crate::transport::tcp`]) uses it exactly like a non-blocking socket,
//! so point-to-point keeps one protocol (eager, rendezvous, matching, size checks, abort
//! notices) whatever carries the bytes.
//!
//! Waiting: every rank has a doorbell (a 32-bit counter) and a count of sleepers in its control
//! line. A rank with nothing to do sleeps on its own doorbell (futex); a peer that appends to
//! one of its rings, or frees space in one, rings it when somebody sleeps there. The handshake
//! and the layout are in `README.md` ("Point-to-point rings").

use super::ring::Ring;
use super::segment::{RingBytes, Segment};
use super::{futex, pid_namespace, process_gone};
use std::io;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MAGIC: u64 = 0x6863_6f6d_6d70_3270; // "hcommp2p"
const HEADER: usize = 128;
const LINE: usize = 128;
/// Per ring: `head` and `tail` in lines of their own.
const RING_HEADER: usize = 2 * LINE;

// Offsets inside a rank's control line.
const BELL: usize = 0;
const SLEEPERS: usize = 4;
const PID: usize = 8;
const PIDNS: usize = 12;
const CLOSED: usize = 16;

/// Default bytes of each ring (one per ordered pair of ranks on a host), for up to 16 ranks.
pub const DEFAULT_RING_BYTES: usize = 256 << 10;
/// Default budget of all of a host's rings together: with more than 16 local ranks the rings
/// shrink (to 4 KiB at least) so that the `n (n - 1)` of them stay within it.
pub const DEFAULT_RINGS_BUDGET: usize = 64 << 20;

pub use crate::config::SHM_P2P_BYTES_RANGE as RING_BYTES_RANGE;

/// The ring size for `ranks` ranks on a host: `set` (`HCOMM_SHM_P2P_BYTES`, as
/// [`Tuning::shm_p2p_bytes`](crate::config::Tuning::shm_p2p_bytes) holds it: 0 turns
/// point-to-point over shared memory off, other values are 4 KiB ..= 64 MiB, rounded up to
/// 4 KiB), else [`DEFAULT_RING_BYTES`], made smaller when the host's rings would exceed
/// [`DEFAULT_RINGS_BUDGET`].
pub fn ring_bytes_for(ranks: usize, set: Option<usize>) -> usize {
    match set {
        Some(0) => 0,
        Some(v) => {
            v.clamp(*RING_BYTES_RANGE.start(), *RING_BYTES_RANGE.end())
                .div_ceil(4096)
                * 4096
        }
        None => {
            let pairs = (ranks * ranks.saturating_sub(1)).max(1);
            (DEFAULT_RINGS_BUDGET / pairs / 4096 * 4096).clamp(4 << 10, DEFAULT_RING_BYTES)
        }
    }
}

/// Layout of a point-to-point segment for `ranks` ranks on one host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pLayout {
    /// Ranks on the host (indexes 0..ranks are their order by communicator rank).
    pub ranks: usize,
    /// Data bytes of each ring.
    pub ring: usize,
}

impl P2pLayout {
    fn ctrl(&self, r: usize) -> usize {
        HEADER + r * LINE
    }
    /// The ring that carries bytes from local rank `from` to local rank `to`.
    fn ring_at(&self, from: usize, to: usize) -> usize {
        debug_assert!(from != to && from < self.ranks && to < self.ranks);
        let k = from * (self.ranks - 1) + if to < from { to } else { to - 1 };
        HEADER + self.ranks * LINE + k * (RING_HEADER + self.ring)
    }
    /// Total bytes: `128 + n·128 + n(n−1)·(256 + ring)`.
    pub fn bytes(&self) -> usize {
        HEADER + self.ranks * LINE + self.ranks * (self.ranks - 1) * (RING_HEADER + self.ring)
    }
}

/// One rank's mapping of its host's point-to-point segment.
pub struct P2pShm {
    seg: Segment,
    layout: P2pLayout,
    /// This rank's local index.
    me: usize,
    pidns: u32,
}

impl P2pShm {
    /// Create the segment `name` (the host's lowest rank does this) and initialise it.
    pub fn create(name: &str, layout: P2pLayout, me: usize) -> io::Result<P2pShm> {
        let seg = Segment::create(name, layout.bytes())?;
        seg.atomic_u32(8)
            .store(layout.ranks as u32, Ordering::Relaxed);
        seg.atomic_u32(12)
            .store(layout.ring as u32, Ordering::Relaxed);
        seg.atomic_u64(0).store(MAGIC, Ordering::Release);
        Ok(Self::new(seg, layout, me))
    }

    /// Attach to the segment `name` created by the host's lowest rank.
    pub fn attach(name: &str, layout: P2pLayout, me: usize) -> io::Result<P2pShm> {
        let seg = Segment::open(name, layout.bytes())?;
        if seg.atomic_u64(0).load(Ordering::Acquire) != MAGIC
            || seg.atomic_u32(8).load(Ordering::Relaxed) as usize != layout.ranks
            || seg.atomic_u32(12).load(Ordering::Relaxed) as usize != layout.ring
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("shared memory {name} has another layout"),
            ));
        }
        Ok(Self::new(seg, layout, me))
    }

    fn new(seg: Segment, layout: P2pLayout, me: usize) -> P2pShm {
        let pidns = pid_namespace();
        let line = layout.ctrl(me);
        seg.atomic_u32(line + PIDNS).store(pidns, Ordering::Relaxed);
        seg.atomic_u32(line + PID)
            .store(std::process::id(), Ordering::Release);
        P2pShm {
            seg,
            layout,
            me,
            pidns,
        }
    }

    /// Remove the segment's name (once every local rank has attached).
    pub fn unlink(&self) -> io::Result<()> {
        self.seg.unlink()
    }

    /// Bytes of shared memory the segment takes.
    pub fn footprint(&self) -> usize {
        self.layout.bytes()
    }

    fn bell(&self, r: usize) -> &AtomicU32 {
        self.seg.atomic_u32(self.layout.ctrl(r) + BELL)
    }

    fn sleepers(&self, r: usize) -> &AtomicU32 {
        self.seg.atomic_u32(self.layout.ctrl(r) + SLEEPERS)
    }

    /// Ring local rank `r`'s doorbell if it sleeps (after a change to one of its rings).
    fn notify(&self, r: usize) {
        // Dekker with `sleep`: our ring update, fence, their sleepers; their sleepers, fence,
        // our ring update. One of the two sides sees the other.
        fence(Ordering::SeqCst);
        if self.sleepers(r).load(Ordering::Relaxed) != 0 {
            let bell = self.bell(r);
            bell.fetch_add(1, Ordering::Release);
            futex::wake_all(bell);
        }
    }

    /// Wake this rank's own sleep on its doorbell (another thread of this process has work
    /// for it).
    pub fn wake_self(&self) {
        self.notify(self.me);
    }

    /// Sleep on this rank's doorbell for at most `timeout`, unless `ready()` (which must look
    /// at the rings this rank waits for) says there is something to do already.
    pub fn sleep(&self, ready: impl Fn() -> bool, timeout: Duration) {
        let sleepers = self.sleepers(self.me);
        let bell = self.bell(self.me);
        sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let seen = bell.load(Ordering::Acquire);
        if !ready() {
            futex::wait(bell, seen, timeout);
        }
        sleepers.fetch_sub(1, Ordering::Relaxed);
    }

    /// This rank's end of the rings it shares with local rank `peer`.
    pub fn pipe(self: &Arc<Self>, peer: usize) -> ShmPipe {
        assert!(peer != self.me && peer < self.layout.ranks);
        ShmPipe {
            shm: self.clone(),
            peer,
            tx: self.layout.ring_at(self.me, peer),
            rx: self.layout.ring_at(peer, self.me),
        }
    }
}

impl Drop for P2pShm {
    fn drop(&mut self) {
        // Peers reading from us see the end of the stream once our rings are drained (as a
        // closed socket); peers writing to us get an error.
        self.seg
            .atomic_u32(self.layout.ctrl(self.me) + CLOSED)
            .store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        for r in (0..self.layout.ranks).filter(|&r| r != self.me) {
            let bell = self.bell(r);
            bell.fetch_add(1, Ordering::Release);
            futex::wake_all(bell);
        }
    }
}

/// One rank's end of the two rings it shares with a peer on its host: a non-blocking byte
/// stream in each direction, used like a socket.
pub struct ShmPipe {
    shm: Arc<P2pShm>,
    /// The peer's local index.
    peer: usize,
    /// Offsets of the ring we write and the ring we read.
    tx: usize,
    rx: usize,
}

impl ShmPipe {
    fn with_ring<R>(
        &self,
        at: usize,
        f: impl FnOnce(&Ring<'_, AtomicU64, RingBytes<'_>>) -> R,
    ) -> R {
        let seg = &self.shm.seg;
        let bytes = RingBytes::new(seg, at + RING_HEADER, self.shm.layout.ring);
        f(&Ring {
            head: seg.atomic_u64(at),
            tail: seg.atomic_u64(at + LINE),
            bytes: &bytes,
        })
    }

    fn peer_closed(&self) -> bool {
        self.shm
            .seg
            .atomic_u32(self.shm.layout.ctrl(self.peer) + CLOSED)
            .load(Ordering::Acquire)
            != 0
    }

    /// Take up to `buf.len()` bytes: `Ok(0)` at the end of the stream (the peer closed and
    /// everything it sent was read), `WouldBlock` when nothing is there yet.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // Closed is loaded before the ring: once we see it, we see all the peer wrote.
        let closed = self.peer_closed();
        let n = self.with_ring(self.rx, |r| r.pop(buf));
        if n > 0 {
            self.shm.notify(self.peer);
            Ok(n)
        } else if closed {
            Ok(0)
        } else {
            Err(io::ErrorKind::WouldBlock.into())
        }
    }

    /// Append as much of the concatenation of `parts` as fits: `WouldBlock` when the ring is
    /// full, `BrokenPipe` when the peer has closed.
    pub fn write(&self, parts: &[&[u8]]) -> io::Result<usize> {
        if self.peer_closed() {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let n = self.with_ring(self.tx, |r| r.push(parts));
        if n > 0 {
            self.shm.notify(self.peer);
            Ok(n)
        } else if parts.iter().all(|p| p.is_empty()) {
            Ok(0)
        } else {
            Err(io::ErrorKind::WouldBlock.into())
        }
    }

    /// Append all of `bytes` or nothing (for a notice that must not be cut).
    pub fn write_whole(&self, bytes: &[u8]) -> io::Result<usize> {
        if self.with_ring(self.tx, |r| r.free()) < bytes.len() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.write(&[bytes])
    }

    /// Something to read (or the end of the stream).
    pub fn readable(&self) -> bool {
        self.with_ring(self.rx, |r| r.available()) > 0 || self.peer_closed()
    }

    /// Room to write (or an error to report).
    pub fn writable(&self) -> bool {
        self.with_ring(self.tx, |r| r.free()) > 0 || self.peer_closed()
    }

    /// Why the peer's process is gone, if it is (killed, or exited without closing).
    pub fn peer_gone(&self) -> Option<String> {
        let line = self.shm.layout.ctrl(self.peer);
        let pid = self.shm.seg.atomic_u32(line + PID).load(Ordering::Acquire);
        let ns = self
            .shm
            .seg
            .atomic_u32(line + PIDNS)
            .load(Ordering::Relaxed);
        process_gone(pid, ns, self.shm.pidns)
    }

    /// The segment this pipe lives in (to sleep on this rank's doorbell).
    pub fn shm(&self) -> &Arc<P2pShm> {
        &self.shm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_shrink_to_the_budget_with_many_ranks() {
        assert_eq!(ring_bytes_for(2, None), DEFAULT_RING_BYTES);
        // A setting wins, whatever the number of ranks.
        assert_eq!(ring_bytes_for(512, Some(0)), 0);
        assert_eq!(ring_bytes_for(512, Some(8192)), 8192);
        assert_eq!(ring_bytes_for(2, Some(5000)), 8192);
        assert_eq!(ring_bytes_for(16, None), DEFAULT_RING_BYTES); // 240 rings: 60 MiB
        assert_eq!(ring_bytes_for(32, None), 64 << 10); // 992 rings: 62 MiB
        assert_eq!(ring_bytes_for(64, None), 16 << 10);
        assert_eq!(ring_bytes_for(512, None), 4 << 10); // the floor
        for n in [17, 24, 40, 100, 128] {
            assert!(
                n * (n - 1) * ring_bytes_for(n, None) <= DEFAULT_RINGS_BUDGET,
                "{n} ranks"
            );
        }
    }

    #[test]
    fn layout_places_every_ring_apart() {
        for ranks in 2..6 {
            let l = P2pLayout { ranks, ring: 4096 };
            let mut at: Vec<usize> = (0..ranks)
                .flat_map(|a| (0..ranks).filter(move |&b| b != a).map(move |b| (a, b)))
                .map(|(a, b)| l.ring_at(a, b))
                .collect();
            at.sort_unstable();
            at.dedup();
            assert_eq!(at.len(), ranks * (ranks - 1));
            assert_eq!(*at.last().unwrap() + RING_HEADER + 4096, l.bytes());
        }
        assert_eq!(
            P2pLayout {
                ranks: 2,
                ring: DEFAULT_RING_BYTES
            }
            .bytes(),
            128 + 2 * 128 + 2 * (256 + (256 << 10))
        );
    }

    #[test]
    fn pipes_stream_both_ways_and_report_the_close() {
        let name = format!("/hcomm-test-p2p-{}", std::process::id());
        let layout = P2pLayout {
            ranks: 2,
            ring: 4096,
        };
        let a = Arc::new(P2pShm::create(&name, layout, 0).unwrap());
        let b = Arc::new(P2pShm::attach(&name, layout, 1).unwrap());
        a.unlink().unwrap();
        let (pa, pb) = (a.pipe(1), b.pipe(0));
        let msg: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut got = vec![0u8; msg.len()];
        let (mut sent, mut read) = (0, 0);
        while read < msg.len() {
            if sent < msg.len() {
                sent += pa.write(&[&msg[sent..]]).unwrap_or(0);
            }
            match pb.read(&mut got[read..]) {
                Ok(n) => read += n,
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
        }
        assert_eq!(got, msg);
        assert!(!pb.readable());
        pb.write(&[b"back"]).unwrap();
        drop(pb);
        drop(b);
        let mut four = [0u8; 4];
        assert_eq!(pa.read(&mut four).unwrap(), 4);
        assert_eq!(&four, b"back");
        assert_eq!(pa.read(&mut four).unwrap(), 0, "end of stream after close");
        assert_eq!(
            pa.write(&[b"x"]).unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
    }
}
