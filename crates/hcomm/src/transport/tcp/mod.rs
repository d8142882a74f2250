//! TCP links between the ranks of one communicator, and the progress loop that drives many
//! transfers at once (full duplex) with one thread.
//!
//! * Each rank listens on one address (the chosen interface, never all interfaces by default).
//! * One socket per pair of ranks, used in both directions (so acknowledgements ride on data:
//!   two one-way sockets cost ~2.5 µs more per message on loopback), made lazily the first
//!   time either rank needs it. The lower rank connects. A higher rank that needs the link
//!   first connects and asks; the lower rank adopts that socket and answers with one ack byte,
//!   or drops it when it has connected itself (then the higher rank accepts that one). A ring
//!   therefore opens 2 sockets per rank, not `n - 1`.
//! * Every connection starts with the handshake of [`crate::auth`]: the dialer names its rank
//!   and communicator and, with a job token, both sides prove they know it. A thread per
//!   communicator accepts connections and authenticates each on a short-lived thread of its own
//!   (at most [`crate::auth::MAX_PENDING`] at once, each within
//!   [`crate::auth::PRE_AUTH_DEADLINE`]), so strangers, garbage and silent
//!   connections are dropped without ever reaching, or stalling, the progress loop; only
//!   authenticated sockets are handed to it.
//! * With `nsocks` > 1 (`HCOMM_NSOCKS`) a link is that many sockets: whoever opened socket 0
//!   opens the others, and each dialer names its socket (and `nsocks`) in two bytes after the
//!   handshake. Payloads of `2 ×` [`STRIPE_MIN`] bytes or more whose size both sides know
//!   (collective frames, rendezvous data) are cut into [`stripes`] contiguous slices
//!   ([`stripe_bounds`]), each a frame of its own on its socket, read straight into its part
//!   of the destination. Control frames and eager messages use socket 0. Each socket keeps
//!   frame order; a receive (a [`RecvOp`] of several parts) completes with its last slice. The
//!   same loop drives every socket: no threads (see `docs/design.md`).
//! * Every frame starts with a [`Header`]; collectives carry their fingerprint in it.
//! * Point-to-point: messages up to [`EAGER_MAX`] bytes are sent at once and stashed by the
//!   receiver until its receive is posted; larger ones send an RTS, wait for the receiver's
//!   Ready (or Nack on a size mismatch), then the data. Ready and Nack name the message id.
//! * While a rank waits with nothing to do, it also drains control frames and eager messages
//!   from links it is not reading for the current operation (so two ranks that both send
//!   first never deadlock on full socket buffers); a link whose next frame belongs to a later
//!   operation is parked until that operation reads it.
//! * Memory per link: a 64 KiB input buffer per socket, stashed eager messages up to
//!   [`MAX_UNEXPECTED_BYTES`]; reducing receives use a [`STAGING`]-byte staging buffer per
//!   slice.
//!
//! The files: this one holds [`TcpLinks`] itself (its state, routing of a peer to its link,
//! accessors, and [`TcpLinks::exchange`], the entry point); `connect.rs` makes links
//! (listening, the authenticating acceptor, dialling and adoption); `inbound.rs` is what a
//! link holds of its peer's bytes (the pipe, input buffer, stash, abort notices);
//! `progress.rs` is the loop that drives an exchange (`drive` → `block` → `pump_send` /
//! `pump_recv`) and blames a failing peer. The operations it carries out and their striping
//! are the contract's ([`crate::transport::ops`]).

use crate::auth::{
    self, ConnectionStats, Counters, HandshakeError, JobToken, Local, PendingSlot, Role,
    PRE_AUTH_DEADLINE,
};
use crate::base::error::{Error, OpContext, Result};
use crate::shm::p2p::{P2pShm, ShmPipe};
pub use crate::transport::ops::{
    stripe_bounds, stripes, KindSet, RecvOp, SendOp, Sink, STRIPE_MIN,
};
use crate::transport::ops::{unexpected, Expect};
use crate::wait::{Spinner, WaitHistory, WaitPolicy};
use crate::wire::frame::{Header, Kind, HEADER_LEN};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

mod connect;
mod inbound;
pub use connect::SharedListener;
mod progress;
pub mod recovery;

use connect::*;
use inbound::*;

/// The byte a lower rank sends on a socket a higher rank opened, adopting it as their link.
pub(super) const ADOPT_ACK: u8 = 0xA5;
/// A higher rank whose ask was dropped asks again after this long without a link.
pub(super) const ASK_AGAIN: Duration = Duration::from_secs(1);
pub(super) const IBUF: usize = 64 << 10;
/// Staging size for reducing receives.
pub const STAGING: usize = 256 << 10;
pub(super) const DIRECT_READ_MIN: usize = 16 << 10;
/// Messages up to this size are sent eagerly (no handshake) and buffered by the receiver if
/// it has not posted the receive yet; larger ones wait for the receiver (RTS / Ready).
pub const EAGER_MAX: usize = 64 << 10;
/// Most bytes of frames nobody has asked for yet buffered from one peer (each counts its
/// payload plus [`STASH_ENTRY_COST`]).
pub const MAX_UNEXPECTED_BYTES: usize = 64 << 20;
/// Accounting cost of one stashed frame besides its payload.
pub const STASH_ENTRY_COST: usize = 64;

/// The TCP links of one communicator.
pub struct TcpLinks {
    rank: usize,
    peers: Vec<SocketAddr>,
    me: Identity,
    acceptor: Acceptor,
    /// Number of ranks.
    n: usize,
    /// The links. Index `p`: the link with peer `p`, `nsocks` sockets (index = stripe), each
    /// used in both directions; socket 0 carries every unstriped frame. Index `n + p`: the
    /// shared-memory pipe with `p` (one "stripe") when `p` shares this host, for
    /// point-to-point frames only (see [`route`](Self::route)).
    inb: Vec<Option<Vec<Inbound>>>,
    /// The point-to-point segment of this host, when the pipes exist.
    shm: Option<Arc<P2pShm>>,
    /// When the shared-memory peers' processes were last checked for life.
    shm_checked: Instant,
    /// Sockets of links still being put together (they arrive one by one through the
    /// acceptor): one slot per stripe.
    forming: Vec<Vec<Option<Socket>>>,
    /// Sockets this (higher) rank opened to a lower rank, waiting for its adoption ack.
    asking: Vec<Option<Socket>>,
    /// When each peer was last asked (a dropped ask is repeated after [`ASK_AGAIN`]).
    asked_at: Vec<Option<Instant>>,
    policy: WaitPolicy,
    /// Send and receive buffer size of the sockets (`HCOMM_SOCKET_BUF`; 0: the kernel's).
    socket_buf: usize,
    /// How long recent waits lasted: spin only while that pays.
    waits: WaitHistory,
    /// Reused staging buffers for reducing receives.
    staging_pool: Vec<Vec<u64>>,
    /// Set by `Communicator::abort` (and by a revocation): every wait gives up.
    abort: Arc<AtomicBool>,
    /// Who revoked the communicator, shared with the acceptor (which takes the notices).
    revocation: Arc<Revocation>,
    /// The connections of [`recovery`] (made by the first shrink, kept for the links' life).
    recovery: recovery::RecoveryState,
    /// Source of receive ids.
    next_id: u64,
    /// The deadline's length of the current operation (for error messages).
    op_timeout: Duration,
    /// poll(2) saw the acceptor hand over a connection.
    listener_ready: bool,
    /// Set by an [`Interrupter`]: an exchange that may return early (`any`) returns.
    interrupted: Arc<AtomicBool>,
    /// An exchange with `any` also returns when a frame is stashed (and waits even with
    /// nothing to move): a receive from any source is waiting for a message to bind to.
    wake_on_stash: bool,
    /// Bytes written to the links (frame headers and payload), ever: `[tcp, shm]`.
    sent: [u64; 2],
    /// Bytes of frames (headers and payload) taken from the links, ever: `[tcp, shm]`.
    received: [u64; 2],
    /// Peers an exchange was posted with since [`take_touched`](Self::take_touched) (for
    /// traces; one store per send / receive posted).
    touched: Vec<bool>,
}

/// A communicator's abort flag and which rank revoked it, if one did. The acceptor thread sets
/// it when a peer's revocation notice arrives, whatever this rank is doing, so a rank blocked
/// in a socket or shared-memory wait gives up at once.
#[derive(Debug, Default)]
pub struct Revocation {
    aborted: Arc<AtomicBool>,
    /// The revoking rank plus one (0: not revoked).
    by: std::sync::atomic::AtomicU64,
}

impl Revocation {
    /// Record that `by` revoked the communicator (the first revoker stays) and abort.
    pub fn revoke(&self, by: usize) {
        let _ = self
            .by
            .compare_exchange(0, by as u64 + 1, Ordering::SeqCst, Ordering::SeqCst);
        self.aborted.store(true, Ordering::SeqCst);
    }

    /// The rank that revoked the communicator, if one did.
    pub fn revoked_by(&self) -> Option<usize> {
        match self.by.load(Ordering::SeqCst) {
            0 => None,
            r => Some(r as usize - 1),
        }
    }
}

/// Wakes an exchange of [`TcpLinks`] that may return early (see [`TcpLinks::interrupter`]).
#[derive(Clone)]
pub struct Interrupter {
    flag: Arc<AtomicBool>,
    waker: Arc<UnixStream>,
    shm: Option<Arc<P2pShm>>,
}

impl Interrupter {
    /// Make the links' current (or next) exchange with `any` return.
    pub fn interrupt(&self) {
        self.flag.store(true, Ordering::Release);
        // Wakes poll(2): the wake-up socket is in every poll set. A full socket means a wake-up
        // is pending already.
        let _ = (&*self.waker).write(&[1]);
        if let Some(shm) = &self.shm {
            shm.wake_self();
        }
    }
}

pub(super) fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted
}

/// How `pump_recv` reads a link.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Someone in this exchange waits for this peer: read and dispatch everything.
    Posted,
    /// Nobody waits: take only frames that can be stashed, park at anything else.
    Opportunistic,
}

/// The receive part a frame is read into: (receive index, part index).
pub(super) fn find_part(recvs: &[RecvOp], id: u64) -> Option<(usize, usize)> {
    recvs
        .iter()
        .enumerate()
        .find_map(|(i, r)| r.parts.iter().position(|p| p.id == id).map(|j| (i, j)))
}

impl super::Links for TcpLinks {
    fn exchange(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
    ) -> Result<()> {
        TcpLinks::exchange(self, ctx, sends, recvs, deadline)
    }
}

impl TcpLinks {
    /// Links for `rank` given every rank's listening address (index = rank), accepting
    /// connections on `listener` from this communicator's ranks only (named by `comm_hash`)
    /// and, with a `token`, only from those who prove they know it. Each link has `nsocks`
    /// sockets (1 to 255; every rank must use the same number). The listener may serve other
    /// communicators too (a parent and its sub-communicators share one): `comm_hash` must
    /// differ from theirs.
    pub fn new(
        rank: usize,
        listener: SharedListener,
        peers: Vec<SocketAddr>,
        comm_hash: u64,
        token: Option<JobToken>,
        policy: WaitPolicy,
        nsocks: usize,
    ) -> io::Result<TcpLinks> {
        if !(1..=255).contains(&nsocks) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{nsocks} sockets per peer (1 to 255)"),
            ));
        }
        let n = peers.len();
        let me = Identity {
            rank,
            size: n,
            comm_hash,
            token,
            nsocks,
        };
        let revocation = Arc::new(Revocation::default());
        Ok(TcpLinks {
            rank,
            peers,
            acceptor: Acceptor::start(listener, me.clone(), revocation.clone())?,
            abort: revocation.aborted.clone(),
            revocation,
            recovery: recovery::RecoveryState::new(n),
            me,
            n,
            inb: (0..2 * n).map(|_| None).collect(),
            shm: None,
            shm_checked: Instant::now(),
            forming: (0..n)
                .map(|_| (0..nsocks).map(|_| None).collect())
                .collect(),
            asking: (0..n).map(|_| None).collect(),
            asked_at: vec![None; n],
            policy,
            socket_buf: 0,
            waits: WaitHistory::default(),
            staging_pool: Vec::new(),
            next_id: 0,
            op_timeout: Duration::ZERO,
            listener_ready: false,
            interrupted: Arc::new(AtomicBool::new(false)),
            wake_on_stash: false,
            sent: [0; 2],
            received: [0; 2],
            touched: vec![false; n],
        })
    }

    /// Sockets per peer.
    pub fn nsocks(&self) -> usize {
        self.me.nsocks
    }

    /// Bytes written to and read from the links' sockets since they were made:
    /// `(sent, received)`. Every frame counts, header included (a striped payload is one frame
    /// per socket it uses): sent bytes when `send(2)` takes them, received bytes when the
    /// frame's header and payload are taken from the socket or from the link's read-ahead
    /// buffer (so bytes read ahead during one operation count for the operation whose frame
    /// they belong to). The connection handshakes (a greeting, two bytes naming the socket
    /// and a 1-byte adoption answer per link, once) do not count.
    pub fn bytes_moved(&self) -> (u64, u64) {
        (self.sent[0], self.received[0])
    }

    /// This rank and the number of ranks the links join.
    pub fn rank_and_size(&self) -> (usize, usize) {
        (self.rank, self.n)
    }

    /// The peers exchanges were posted with since the last call (ascending), and forget them.
    pub fn take_touched(&mut self) -> Vec<usize> {
        let mut peers = Vec::new();
        for (p, t) in self.touched.iter_mut().enumerate() {
            if std::mem::take(t) {
                peers.push(p);
            }
        }
        peers
    }

    /// Like [`bytes_moved`](Self::bytes_moved), for the shared-memory pipes: bytes copied into
    /// and out of the rings, `(written, read)`.
    pub fn shm_bytes_moved(&self) -> (u64, u64) {
        (self.sent[1], self.received[1])
    }

    /// Carry point-to-point with the given peers over `shm` (`peers[i]` = the communicator
    /// rank of local index `i`; this rank is among them).
    pub fn attach_shm(&mut self, shm: Arc<P2pShm>, peers: &[usize]) {
        for (i, &p) in peers.iter().enumerate() {
            if p != self.rank {
                self.inb[self.n + p] = Some(vec![Inbound::with_pipe(Pipe::Shm(shm.pipe(i)))]);
            }
        }
        self.shm = Some(shm);
    }

    /// True if point-to-point with `peer` goes over shared memory.
    pub fn p2p_over_shm(&self, peer: usize) -> bool {
        self.inb.get(self.n + peer).is_some_and(|l| l.is_some())
    }

    /// The link a frame to or from `peer` goes on: point-to-point frames (data, handshakes,
    /// signals) over the shared-memory pipe when there is one, everything else (collectives)
    /// over the socket(s).
    fn route(&self, peer: usize, p2p: bool) -> usize {
        if p2p && self.p2p_over_shm(peer) {
            self.n + peer
        } else {
            peer
        }
    }

    /// 0 for a socket, 1 for a shared-memory pipe (index into the byte counters).
    fn kind_of(&self, link: usize) -> usize {
        usize::from(link >= self.n)
    }

    /// Stripes of a link: `nsocks` for sockets, one for a shared-memory pipe.
    fn stripes_of(&self, link: usize) -> usize {
        if link >= self.n {
            1
        } else {
            self.me.nsocks
        }
    }

    /// True if this rank has any link (socket or pipe) a peer could hear a notice on.
    pub fn any_links(&self) -> bool {
        self.inb.iter().any(|l| l.is_some())
    }

    /// A handle that makes a running [`exchange_until`](Self::exchange_until) with `any`
    /// return soon (at once, or from its wait on sockets or the shared-memory doorbell), from
    /// any thread: how new work reaches a progress loop that is already waiting.
    pub fn interrupter(&self) -> Interrupter {
        Interrupter {
            flag: self.interrupted.clone(),
            waker: self.acceptor.waker.clone(),
            shm: self.shm.clone(),
        }
    }

    /// The abort flag every wait of these links checks (the communicator's: set by `abort`,
    /// and by a revocation, whoever sent it).
    pub fn abort_flag(&self) -> Arc<AtomicBool> {
        self.abort.clone()
    }

    /// Who revoked this communicator (see [`Revocation`]).
    pub fn revocation(&self) -> Arc<Revocation> {
        self.revocation.clone()
    }

    /// Give the sockets of links made from now on send and receive buffers of `bytes`
    /// (`HCOMM_SOCKET_BUF`, [`Tuning::socket_buf`](crate::config::Tuning::socket_buf)); 0, the
    /// default, keeps the kernel's autotuning. Links are made on first use, so call it before
    /// the first operation.
    pub fn set_socket_buf(&mut self, bytes: usize) {
        self.socket_buf = bytes;
    }

    /// The timeout of the operation about to run (reported in timeout errors).
    pub fn set_op_timeout(&mut self, d: Duration) {
        self.op_timeout = d;
    }

    /// The IP address the listener is bound to.
    pub fn listen_ip(&self) -> std::net::IpAddr {
        self.acceptor.addr.ip()
    }

    /// The address the listener is bound to.
    pub fn listen_addr(&self) -> SocketAddr {
        self.acceptor.addr
    }

    /// The listener these links accept on, to share with a sub-communicator's links.
    pub fn shared_listener(&self) -> SharedListener {
        self.acceptor.listener.clone()
    }

    /// What became of the connections the listener accepted so far (authenticated, or turned
    /// away and why), for every communicator on it.
    pub fn connection_stats(&self) -> ConnectionStats {
        self.acceptor.counters.snapshot()
    }

    /// The live counters behind [`connection_stats`](Self::connection_stats).
    pub(crate) fn counters(&self) -> Arc<Counters> {
        self.acceptor.counters.clone()
    }

    /// The number of data sockets currently open (both directions; `nsocks` per linked peer),
    /// for memory/fd accounting.
    pub fn open_links(&self) -> usize {
        self.inb[..self.n].iter().flatten().map(Vec::len).sum()
    }

    fn take_staging(&mut self) -> Vec<u64> {
        self.staging_pool
            .pop()
            .unwrap_or_else(|| vec![0u64; STAGING / 8])
    }

    /// Make exchanges with `any` return when a frame is stashed, and wait for one even with
    /// nothing to send or receive (see [`first_message_from`](Self::first_message_from)).
    pub fn set_wake_on_stash(&mut self, on: bool) {
        self.wake_on_stash = on;
    }

    /// Frames stashed on every link now.
    pub(super) fn stashed_frames(&self) -> usize {
        self.inb
            .iter()
            .flatten()
            .filter_map(|socks| socks.first())
            .map(|inb| inb.stash.len())
            .sum()
    }

    /// A peer from which the first frame of a point-to-point message with `tag` (eager data
    /// or an RTS) is stashed, looking at the peers from `start` on (wrapping) and skipping
    /// those `skip` names: what a receive from any source binds to.
    pub fn first_message_from(
        &self,
        tag: u32,
        start: usize,
        skip: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        (0..self.n)
            .map(|i| (start + i) % self.n)
            .filter(|&p| p != self.rank && !skip(p))
            .find(|&p| {
                let link = self.route(p, true);
                self.inb[link]
                    .as_ref()
                    .and_then(|socks| socks.first())
                    .is_some_and(|inb| {
                        inb.stash.iter().any(|s| match s {
                            Stashed::Control(h) => h.kind == Kind::Rts && h.tag == tag,
                            Stashed::Eager(h, _) => h.tag == tag,
                        })
                    })
            })
    }

    /// Take a `Nack` that `peer` sent about an earlier eager message, if any.
    pub fn take_nack(&mut self, peer: usize) -> Option<Header> {
        let link = self.route(peer, true);
        self.inb.get_mut(link)?.as_mut()?.first_mut()?.take_nack()
    }

    /// Drive all `sends` and `recvs` to completion, concurrently, before `deadline`.
    ///
    /// Sends to one peer go out in the order given; receives from one peer are matched in the
    /// order given (both per socket, when large payloads are striped across several). On
    /// error the links are in an undefined state and the communicator must be poisoned by
    /// the caller.
    pub fn exchange(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
    ) -> Result<()> {
        self.exchange_until(ctx, sends, recvs, deadline, false)
    }

    /// Like [`exchange`](Self::exchange), but with `any` it returns as soon as one receive is
    /// complete (sends may then be unfinished: pass them again to continue).
    pub fn exchange_until(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
        any: bool,
    ) -> Result<()> {
        for s in sends.iter_mut() {
            if let Some(t) = self.touched.get_mut(s.peer) {
                *t = true;
            }
            if s.parts.is_empty() {
                s.link = self.route(s.peer, s.hdr.kind != Kind::Collective);
            }
            s.split(self.stripes_of(s.link));
            self.ensure_link(ctx, s.link, deadline)?;
        }
        for r in recvs.iter_mut() {
            if let Some(t) = self.touched.get_mut(r.peer) {
                *t = true;
            }
            if r.parts.is_empty() {
                r.link = self.route(r.peer, !matches!(r.expect, Expect::Coll(_)));
            }
            self.ensure_link(ctx, r.link, deadline)?;
        }
        for r in recvs.iter_mut() {
            r.split(self.stripes_of(r.link), &mut self.next_id);
            if matches!(r.sink, Sink::Reduce { .. }) {
                for j in 0..r.parts.len() {
                    if r.parts[j].staging.is_empty() && !r.parts[j].done {
                        r.parts[j].staging = self.take_staging();
                    }
                }
            }
            if let Some(socks) = self.inb[r.link].as_mut() {
                socks[0].take_stashed(r);
            }
        }
        let result = self.drive(ctx, sends, recvs, deadline, any);
        for r in recvs.iter_mut() {
            for p in &mut r.parts {
                // A partly filled staging buffer stays with its receive.
                if !p.staging.is_empty() && (p.done || p.staged == 0) {
                    self.staging_pool.push(std::mem::take(&mut p.staging));
                }
            }
        }
        result
    }
}

pub(super) fn closed(ctx: &OpContext, peer: usize) -> Error {
    Error::PeerClosed {
        ctx: ctx.clone(),
        peer,
        detail: String::new(),
    }
}

pub(super) fn peer_io_error(ctx: &OpContext, peer: usize, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted => Error::PeerClosed {
            ctx: ctx.clone(),
            peer,
            detail: e.to_string(),
        },
        _ => Error::io(ctx.clone(), Some(peer), e),
    }
}

pub(super) fn nosignal() -> i32 {
    nix::sys::socket::MsgFlags::MSG_NOSIGNAL.bits()
}

pub(super) fn dontwait() -> i32 {
    nix::sys::socket::MsgFlags::MSG_DONTWAIT.bits()
}
