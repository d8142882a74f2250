//! Collective algorithms: schedules of sends, receives and reductions over the links of one
//! communicator. Algorithms never name a socket: they run steps through [`Run`].
//!
//! Reduction order (what makes results deterministic and identical on every rank):
//! * ring: segment `s` is accumulated along the ring starting at rank `s + 1`
//!   (`((x[s+1] ⊕ x[s+2]) ⊕ …) ⊕ x[s]`), then copied to every rank;
//! * recursive doubling: pairwise, lower rank's partial first, so both partners compute the same
//!   bits; the `n - 2^k` extra ranks are folded in first (rank `2i` into `2i + 1`);
//! * binomial tree and chain (reduce): in virtual-rank order counted from the root.

pub mod basic;
pub mod ring;
pub mod tree;

use crate::error::{OpContext, Result};
use crate::transport::frame::Header;
use crate::transport::tcp::{RecvOp, SendOp, Sink, TcpLinks};
use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::time::Instant;

/// An algorithm a collective can run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Let the selector choose by size, world size and topology.
    Auto,
    /// Ring: reduce-scatter + all-gather, bandwidth-optimal for large messages.
    Ring,
    /// Recursive doubling: log2(n) exchanges of the whole vector; latency-optimal.
    RecursiveDoubling,
    /// Binomial tree (broadcast, reduce).
    Tree,
    /// Pipelined chain in chunks (broadcast, reduce): bandwidth-optimal for large messages.
    Chain,
    /// Root talks to every rank directly (gather, scatter).
    Linear,
    /// Every pair exchanges directly, all at once (all-to-all).
    Pairwise,
    /// Dissemination (barrier).
    Dissemination,
    /// Shared memory: every rank works directly on a segment mapped by all ranks of the host.
    Shm,
    /// Several hosts with several ranks each: reduce-scatter within each host (shared memory),
    /// all-reduce of each slice across hosts (TCP, all slices in parallel), all-gather within
    /// each host. Only `1/L` of the data crosses the network per rank (L ranks per host).
    Hierarchical,
}

impl Algo {
    /// Code carried in collective fingerprints.
    pub fn code(self) -> u8 {
        match self {
            Algo::Auto => 0,
            Algo::Ring => 1,
            Algo::RecursiveDoubling => 2,
            Algo::Tree => 3,
            Algo::Chain => 4,
            Algo::Linear => 5,
            Algo::Pairwise => 6,
            Algo::Dissemination => 7,
            Algo::Shm => 8,
            Algo::Hierarchical => 9,
        }
    }

    /// Decode a fingerprint code.
    pub fn from_code(c: u8) -> Option<Algo> {
        [
            Algo::Auto,
            Algo::Ring,
            Algo::RecursiveDoubling,
            Algo::Tree,
            Algo::Chain,
            Algo::Linear,
            Algo::Pairwise,
            Algo::Dissemination,
        ]
        .into_iter()
        .find(|a| a.code() == c)
    }

    /// Name used by `HCOMM_ALGO` and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::Tree => "tree",
            Algo::Chain => "chain",
            Algo::Linear => "linear",
            Algo::Pairwise => "pairwise",
            Algo::Dissemination => "dissemination",
            Algo::Shm => "shm",
            Algo::Hierarchical => "hierarchical",
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Algo::Auto,
            "ring" => Algo::Ring,
            "rd" | "recursive_doubling" | "recursive-doubling" => Algo::RecursiveDoubling,
            "tree" | "binomial" => Algo::Tree,
            "chain" | "pipeline" => Algo::Chain,
            "linear" | "direct" => Algo::Linear,
            "pairwise" => Algo::Pairwise,
            "dissemination" => Algo::Dissemination,
            "shm" | "shared_memory" => Algo::Shm,
            "hier" | "hierarchical" => Algo::Hierarchical,
            other => {
                return Err(format!(
                    "unknown algorithm '{other}' (expected auto, ring, rd, tree, chain, linear, pairwise, dissemination, shm, hierarchical)"
                ))
            }
        })
    }
}

/// One collective's execution context: the links, who we are, the fingerprint every frame
/// carries, and the deadline.
pub struct Run<'a> {
    /// Links of the communicator.
    pub links: &'a mut TcpLinks,
    /// This rank.
    pub rank: usize,
    /// World size.
    pub size: usize,
    /// Operation and sequence number, for errors.
    pub ctx: OpContext,
    /// Fingerprint (kind = Collective); `tag` and `len` are filled per frame.
    pub fp: Header,
    /// When to give up.
    pub deadline: Instant,
    /// The operation's timeout (for messages).
    pub timeout: std::time::Duration,
    /// The shared-memory group, when every rank shares this host.
    pub shm: Option<&'a mut crate::shm::ShmGroup>,
    /// Extra fingerprint (e.g. a hash of per-rank counts) that must agree on every rank.
    pub fp_extra: u64,
}

impl Run<'_> {
    /// The shared-memory group and the waiting context for its calls.
    pub fn shm_parts(
        &mut self,
    ) -> (
        &mut crate::shm::ShmGroup,
        crate::shm::WaitCtx<'_>,
        crate::shm::Fingerprint,
    ) {
        let detail = [self.fp.count, self.fp.algo as u64, self.fp_extra]
            .iter()
            .fold(0xcbf29ce484222325u64, |h, v| {
                (h ^ v).wrapping_mul(0x100000001b3).rotate_left(17)
            });
        let fp = crate::shm::Fingerprint {
            detail,
            seq: self.fp.seq,
            word: (self.fp.coll as u64)
                | (self.fp.dtype as u64) << 8
                | (self.fp.redop as u64) << 16
                | (self.fp.root as u64 & 0xffff) << 24
                | (self.fp.count & 0xff_ffff) << 40,
        };
        let w = crate::shm::WaitCtx {
            ctx: &self.ctx,
            deadline: self.deadline,
            timeout: self.timeout,
        };
        (self.shm.as_deref_mut().expect("shared memory group"), w, fp)
    }
}

impl Run<'_> {
    fn hdr(&self, step: u32, len: usize) -> Header {
        Header {
            tag: step,
            len: len as u64,
            ..self.fp
        }
    }

    /// Run one step: at most one send and one receive, concurrently.
    pub fn step(
        &mut self,
        step: u32,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, Sink)>,
    ) -> Result<()> {
        let sends: Vec<(usize, u32, &[u8])> = send.into_iter().map(|(p, d)| (p, step, d)).collect();
        let recvs: Vec<(usize, u32, Sink)> = recv.into_iter().map(|(p, s)| (p, step, s)).collect();
        self.exchange(sends, recvs)
    }

    /// Run any number of sends and receives concurrently: `(peer, step, data)`.
    pub fn exchange(
        &mut self,
        sends: Vec<(usize, u32, &[u8])>,
        recvs: Vec<(usize, u32, Sink)>,
    ) -> Result<()> {
        let mut s: Vec<SendOp> = sends
            .into_iter()
            .map(|(p, st, d)| SendOp::new(p, self.hdr(st, d.len()), d))
            .collect();
        let mut r: Vec<RecvOp> = recvs
            .into_iter()
            .map(|(p, st, sink)| {
                let len = match &sink {
                    Sink::Buf(b) => b.len(),
                    Sink::Reduce { dst, .. } => dst.len(),
                };
                RecvOp::coll(p, self.hdr(st, len), sink)
            })
            .collect();
        self.links
            .exchange(&self.ctx, &mut s, &mut r, self.deadline)
    }
}

/// Split `total` elements into `n` contiguous segments (the first `total % n` one longer),
/// as byte ranges.
pub fn even_segments(total: usize, n: usize, esize: usize) -> Vec<Range<usize>> {
    let base = total / n;
    let extra = total % n;
    let mut off = 0;
    (0..n)
        .map(|i| {
            let len = (base + usize::from(i < extra)) * esize;
            let r = off..off + len;
            off += len;
            r
        })
        .collect()
}

/// Segments from explicit per-rank element counts, as byte ranges.
pub fn count_segments(counts: &[usize], esize: usize) -> Vec<Range<usize>> {
    let mut off = 0;
    counts
        .iter()
        .map(|&c| {
            let r = off..off + c * esize;
            off += c * esize;
            r
        })
        .collect()
}

/// Borrow two disjoint ranges of `buf`, one shared and one mutable.
pub fn split_two(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty());
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}
