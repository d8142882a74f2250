//! Collective algorithms: schedules of sends, receives and reductions over the links of one
//! communicator. Algorithms never name a transport: they run steps through [`Run`], which
//! holds the communicator's links as a [`Links`] (the contract of [`crate::transport`]), so
//! the same schedule runs over TCP, shared-memory pipes or the in-memory fabric of the
//! schedule tests. The choice among them by size and topology is [`select`]'s.
//!
//! Reduction order (what makes results deterministic and identical on every rank):
//! * ring: segment `s` is accumulated along the ring starting at rank `s + 1`
//!   (`((x[s+1] ⊕ x[s+2]) ⊕ …) ⊕ x[s]`), then copied to every rank;
//! * recursive doubling: pairwise, lower rank's partial first, so both partners compute the same
//!   bits; the `n - 2^k` extra ranks are folded in first (rank `2i` into `2i + 1`);
//! * binomial tree and chain (reduce): in virtual-rank order counted from the root.

pub mod agree;
pub mod basic;
pub mod canonical;
pub mod gather_cache;
pub mod ring;
pub mod select;
pub mod skip_zeros;
pub mod tree;

#[cfg(test)]
mod schedule_tests;

pub use crate::base::segments::{count_segments, even_segments, split_two};
pub use crate::wire::collective::Algo;

use crate::base::deadline::Deadline;
use crate::base::error::{OpContext, Result};
use crate::transport::ops::{RecvOp, SendOp, Sink};
use crate::transport::Links;
use crate::wire::frame::Header;

/// Step tag of the root check of the collectives in which only the root sends (broadcast,
/// scatter): the rank before the root (the last virtual rank, a leaf of the tree and the tail
/// of the chain) sends the root an empty frame carrying its fingerprint (which names the root)
/// while it receives, and the root receives it while it sends. Without it, ranks that
/// disagree about the root could all believe they are the root, all send, none receive, and
/// each return its own buffer as the result: silently wrong. With it a root returns only once
/// a rank that agrees has said so; a rank that disagrees sends it either its check with
/// another root in the fingerprint or, believing itself root, its data (the rank after it is
/// its child in the tree and the chain): a `Mismatch` error, as for any other argument the
/// ranks disagree on. Where neither reaches it, it fails at the timeout, never silently.
pub const ROOT_CHECK_STEP: u32 = u32::MAX - 1;

/// One collective's execution context: the links, who we are, the fingerprint every frame
/// carries, and the deadline.
pub struct Run<'a> {
    /// Links of the communicator.
    pub links: &'a mut dyn Links,
    /// This rank.
    pub rank: usize,
    /// World size.
    pub size: usize,
    /// Operation and sequence number, for errors.
    pub ctx: OpContext,
    /// Fingerprint (kind = Collective); `tag` and `len` are filled per frame.
    pub fp: Header,
    /// When to give up (and the timeout, for messages).
    pub deadline: Deadline<'a>,
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
            .exchange(&self.ctx, &mut s, &mut r, self.deadline.at())
    }
}
