//! Transports: how bytes move between ranks, and the contract the algorithms program against.
//!
//! An algorithm ([`crate::algo`]) sees only [`Links`]: it hands over the frames one step of its
//! schedule sends and receives ([`ops::SendOp`], [`ops::RecvOp`]), each receive with a
//! [`ops::Sink`] saying where the payload goes (copied, or reduced into an accumulator in the
//! algorithm's operand order), and the links move them. What implements it:
//!
//! * [`tcp::TcpLinks`]: a socket (or several, striped) per peer, or the shared-memory rings of
//!   [`crate::shm::p2p`] with a peer on the same host; links are set up lazily, inside the
//!   first exchange that needs them (part of the contract: an exchange may connect);
//! * [`mem::MemLinks`]: an in-process fabric, so that every schedule can be run for any world
//!   size in one test process against a reference ([`crate::algo`]'s schedule tests).
//!
//! The shared-memory collectives of [`crate::shm`] are a different kind of transport: whole
//! collectives on a segment every rank of a host maps, chosen as [`crate::Algo::Shm`] by the
//! communicator; they do not go through [`Links`].
//!
//! A second, much smaller contract is [`Mesh`]: messages between any two ranks that keep
//! working after the communicator failed, for the fault-tolerant agreement of
//! [`crate::algo::agree`] (implemented by `tcp::recovery` on connections of their own, and by
//! [`mem::MemMesh`], which can kill a rank at any message, for its tests).
//!
//! Rules (checked by `tests/layering.rs`): a transport never imports [`crate::algo`],
//! [`crate::comm`] or [`crate::bootstrap`]; it describes frames through [`crate::wire`].

pub mod mem;
pub mod ops;
pub mod tcp;

use crate::base::error::{OpContext, Result};
use ops::{RecvOp, SendOp};
use std::time::Instant;

/// What [`Mesh::next`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeshEvent {
    /// A whole message from rank `from`.
    Message {
        /// The sender.
        from: usize,
        /// The message.
        bytes: Vec<u8>,
    },
    /// Rank `rank` is gone for good (its process exited: connection refused or closed). Every
    /// message it sent before is delivered first. A rank that is merely silent never shows up
    /// here: that is for the caller's deadline to judge.
    Gone(usize),
    /// Rank `rank` cannot be reached, with no sign that its process exited (no connection
    /// or handshake in time, a send that timed out): a network partition, a dead host or a
    /// stopped process. The agreement goes on without it, but does not count it as gone when
    /// it checks that the survivors are the majority (see [`crate::algo::agree`]).
    Unreachable(usize),
    /// The deadline passed.
    Timeout,
}

/// Reliable, ordered messages between the ranks of a communicator, that work after the
/// communicator's own links failed (the agreement of a shrink runs over it).
pub trait Mesh {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Send `bytes` to `to`, in order with earlier messages to it. False when `to` is gone.
    fn send(&mut self, to: usize, bytes: &[u8]) -> bool;
    /// The next message or departure, waiting until `deadline` at most.
    fn next(&mut self, deadline: Instant) -> MeshEvent;
}

/// The point-to-point links of one communicator, as an algorithm uses them.
pub trait Links {
    /// Run `sends` and `recvs` concurrently until all are complete, or fail by `deadline`.
    ///
    /// Sends to one peer go out in the order given; receives from one peer are matched in the
    /// order given. A collective receive accepts only a frame with its fingerprint and size:
    /// anything else is a [`crate::Error::Mismatch`] naming both calls. On error the links are
    /// in an undefined state and the caller must poison the communicator.
    fn exchange(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
    ) -> Result<()>;
}
