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
use crate::transport::wait::{Spinner, WaitHistory, WaitPolicy};
use crate::wire::frame::{Header, Kind, HEADER_LEN};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The byte a lower rank sends on a socket a higher rank opened, adopting it as their link.
const ADOPT_ACK: u8 = 0xA5;
/// A higher rank whose ask was dropped asks again after this long without a link.
const ASK_AGAIN: Duration = Duration::from_secs(1);
const IBUF: usize = 64 << 10;
/// Staging size for reducing receives.
pub const STAGING: usize = 256 << 10;
const DIRECT_READ_MIN: usize = 16 << 10;
/// Messages up to this size are sent eagerly (no handshake) and buffered by the receiver if
/// it has not posted the receive yet; larger ones wait for the receiver (RTS / Ready).
pub const EAGER_MAX: usize = 64 << 10;
/// Most bytes of frames nobody has asked for yet buffered from one peer (each counts its
/// payload plus [`STASH_ENTRY_COST`]).
pub const MAX_UNEXPECTED_BYTES: usize = 64 << 20;
/// Accounting cost of one stashed frame besides its payload.
pub const STASH_ENTRY_COST: usize = 64;

/// A frame that arrived before anyone waited for it.
enum Stashed {
    /// A control frame (signal, connect, RTS, Nack, …).
    Control(Header),
    /// An eager point-to-point message.
    Eager(Header, Vec<u8>),
}

/// Where the payload of the frame being read goes.
enum Target {
    /// Into the sink of the receive with this id.
    Recv(u64),
    /// Into a buffer for the stash (eager message nobody waits for yet).
    Stash(Header, Vec<u8>),
    /// Nowhere: the receive with this id gets the header only (size mismatch).
    Discard(u64),
}

/// What carries a link's bytes.
enum Pipe {
    /// A TCP socket (non-blocking).
    Tcp(Socket),
    /// The shared-memory rings with a peer on this host (point-to-point only).
    Shm(ShmPipe),
}

impl Pipe {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Pipe::Tcp(s) => (&*s).read(buf),
            Pipe::Shm(p) => p.read(buf),
        }
    }

    /// Write the unsent part of a frame: `hdr[from..]` then `data` when `from` is inside the
    /// header, else `data[from - HEADER_LEN..]`.
    fn send_frame(&self, hdr: &[u8], data: &[u8], from: usize) -> io::Result<usize> {
        match self {
            Pipe::Tcp(sock) if from < HEADER_LEN => {
                let bufs = [IoSlice::new(&hdr[from..]), IoSlice::new(data)];
                sock.send_vectored_with_flags(&bufs, nosignal())
            }
            Pipe::Tcp(sock) => sock.send_with_flags(&data[from - HEADER_LEN..], nosignal()),
            Pipe::Shm(p) if from < HEADER_LEN => p.write(&[&hdr[from..], data]),
            Pipe::Shm(p) => p.write(&[&data[from - HEADER_LEN..]]),
        }
    }

    /// Send a short notice whole or not at all, without blocking.
    fn send_whole(&self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            Pipe::Tcp(sock) => sock.send_with_flags(bytes, nosignal() | dontwait()),
            Pipe::Shm(p) => p.write_whole(bytes),
        }
    }
}

/// Incoming side of a link: a socket (or shared-memory pipe) plus its input buffer and frame
/// state.
struct Inbound {
    pipe: Pipe,
    ibuf: Vec<u8>,
    ipos: usize,
    iend: usize,
    /// The frame being read and its payload bytes left.
    cur: Option<(Target, usize)>,
    /// Frames that arrived before anyone waited for them, in arrival order.
    stash: VecDeque<Stashed>,
    /// Accounting of the stash (payload + per-entry cost).
    stash_bytes: usize,
    /// The next frame belongs to a later operation: do not read until someone asks.
    parked: bool,
    /// The peer closed this link (seen while nobody needed it).
    eof: bool,
    /// A frame was partly sent on this link (an operation failed mid-send): the stream is out
    /// of step, so no abort notice can be sent on it.
    out_mid_frame: bool,
    /// Payload bytes still to skip while looking for abort notices after a failure.
    discard: usize,
}

impl Inbound {
    /// A link's socket, with send and receive buffers of `b` bytes (`HCOMM_SOCKET_BUF`; 0
    /// keeps the kernel's autotuning).
    fn new(sock: Socket, b: usize) -> Inbound {
        if b > 0 {
            let _ = sock.set_send_buffer_size(b);
            let _ = sock.set_recv_buffer_size(b);
        }
        Self::with_pipe(Pipe::Tcp(sock))
    }

    fn with_pipe(pipe: Pipe) -> Inbound {
        Inbound {
            pipe,
            ibuf: vec![0u8; IBUF],
            ipos: 0,
            iend: 0,
            cur: None,
            stash: VecDeque::new(),
            stash_bytes: 0,
            parked: false,
            eof: false,
            out_mid_frame: false,
            discard: 0,
        }
    }

    /// Can `len` more payload bytes be stashed?
    fn room_for(&self, len: usize) -> bool {
        self.stash_bytes + len + STASH_ENTRY_COST <= MAX_UNEXPECTED_BYTES
    }

    fn push_stash(&mut self, s: Stashed) {
        self.stash_bytes += STASH_ENTRY_COST
            + match &s {
                Stashed::Eager(_, d) => d.len(),
                Stashed::Control(_) => 0,
            };
        self.stash.push_back(s);
    }

    /// Complete `r` from the stash if a matching frame is there (first in arrival order). Only
    /// unstriped receives (control frames, the first frame of a point-to-point message) can be
    /// satisfied from the stash.
    fn take_stashed(&mut self, r: &mut RecvOp) {
        if r.done() || r.parts.len() != 1 || r.parts[0].pending.is_some() {
            return;
        }
        let pos = self.stash.iter().position(|s| match s {
            Stashed::Control(h) => r.expect.accepts(h, false),
            Stashed::Eager(h, _) => r.expect.accepts(h, true),
        });
        let Some(pos) = pos else { return };
        match self.stash.remove(pos).expect("present") {
            Stashed::Control(h) => {
                self.stash_bytes -= STASH_ENTRY_COST;
                r.finish_part(0, h);
            }
            Stashed::Eager(h, data) => {
                self.stash_bytes -= STASH_ENTRY_COST + data.len();
                if data.len() == r.sink.len() {
                    let (p, sink) = r.part_mut(0);
                    p.deliver(sink, &data);
                }
                r.finish_part(0, h);
            }
        }
    }

    /// Take a stashed `Nack` (the answer to an earlier eager message), if any.
    fn take_nack(&mut self) -> Option<Header> {
        let pos = self
            .stash
            .iter()
            .position(|s| matches!(s, Stashed::Control(h) if h.kind == Kind::Nack))?;
        self.stash_bytes -= STASH_ENTRY_COST;
        match self.stash.remove(pos) {
            Some(Stashed::Control(h)) => Some(h),
            _ => None,
        }
    }
}

/// Who this side of a communicator's links is, for the handshakes.
#[derive(Clone)]
struct Identity {
    rank: usize,
    size: usize,
    comm_hash: u64,
    token: Option<JobToken>,
    /// Sockets per peer (`HCOMM_NSOCKS`).
    nsocks: usize,
}

impl Identity {
    fn local(&self, role: Role) -> Local {
        Local {
            role,
            rank: self.rank as u32,
            comm_hash: self.comm_hash,
        }
    }
}

/// The accepting side of a communicator's links: a thread that accepts connections and
/// authenticates each on a thread of its own, handing the good ones (with the rank they proved
/// to be) to the progress loop through a channel, and waking it through a socket pair.
struct Acceptor {
    addr: SocketAddr,
    /// Authenticated connections: (peer rank, stripe, socket).
    accepted: mpsc::Receiver<(usize, usize, Socket)>,
    /// Readable when `accepted` has something.
    wake: UnixStream,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

impl Acceptor {
    fn start(listener: Socket, me: Identity) -> io::Result<Acceptor> {
        let addr = listener
            .local_addr()?
            .as_socket()
            .ok_or_else(|| io::Error::other("listener has no IP address"))?;
        let (wake, waker) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        waker.set_nonblocking(true)?;
        let (tx, accepted) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let (st, c) = (stop.clone(), counters.clone());
        std::thread::Builder::new()
            .name("hcomm-accept".into())
            .spawn(move || accept_loop(listener, me, tx, Arc::new(waker), st, c))?;
        Ok(Acceptor {
            addr,
            accepted,
            wake,
            stop,
            counters,
        })
    }

    /// Empty the wake-up socket (the channel is drained by the caller).
    fn drain_wake(&self) {
        let mut b = [0u8; 64];
        while matches!((&self.wake).read(&mut b), Ok(n) if n > 0) {}
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // The accept thread sees this within 100 ms and closes the listener.
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn accept_loop(
    listener: Socket,
    me: Identity,
    tx: mpsc::Sender<(usize, usize, Socket)>,
    waker: Arc<UnixStream>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
) {
    let pending = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(100u16)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                tracing::warn!("link listener: poll: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        loop {
            let (sock, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    // Out of descriptors or similar: do not spin on it.
                    tracing::warn!("link listener: accept: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                    break;
                }
            };
            let from = from.as_socket();
            let Some(slot) = PendingSlot::take(&pending) else {
                counters.overloaded();
                tracing::warn!(
                    ?from,
                    "too many unauthenticated data connections; dropping one"
                );
                continue;
            };
            let (me, tx, waker, counters) =
                (me.clone(), tx.clone(), waker.clone(), counters.clone());
            let spawned = std::thread::Builder::new()
                .name("hcomm-link-auth".into())
                .spawn(move || {
                    let r = authenticate(sock, &me, &counters);
                    drop(slot);
                    match r {
                        Ok((peer, stripe, sock)) => {
                            if tx.send((peer, stripe, sock)).is_ok() {
                                let _ = (&*waker).write(&[1]);
                            }
                        }
                        Err(e) => tracing::warn!(?from, "rejected a data connection: {e}"),
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("cannot start a thread to authenticate a data connection: {e}");
            }
        }
    }
}

/// The accepting side's handshake on a new connection: the peer must be another rank of this
/// communicator (and prove the token, if there is one), then say which of the link's sockets
/// this is ([`announce`]). Returns its rank, the stripe and the socket, ready for the progress
/// loop. The outcome is counted before the socket can close, so a rejected peer sees the
/// close only after it was counted.
fn authenticate(
    sock: Socket,
    me: &Identity,
    counters: &Counters,
) -> Result<(usize, usize, Socket), HandshakeError> {
    let io = |e: io::Error| HandshakeError::Io(e.to_string());
    let _ = sock.set_nodelay(true);
    let mut stream = TcpStream::from(sock);
    let deadline = Instant::now() + PRE_AUTH_DEADLINE;
    let check = |h: &auth::Hello| {
        if h.comm_hash != me.comm_hash {
            return Err(HandshakeError::WrongPeer(format!(
                "a rank of communicator {:#x}, not of this one ({:#x})",
                h.comm_hash, me.comm_hash
            )));
        }
        if h.rank as usize >= me.size || h.rank as usize == me.rank {
            return Err(HandshakeError::WrongPeer(format!(
                "claims rank {} of this {}-rank communicator, as rank {}",
                h.rank, me.size, me.rank
            )));
        }
        Ok(())
    };
    let r = (|| {
        stream.set_nonblocking(false).map_err(io)?;
        let hello = auth::accept(
            &mut stream,
            me.token.as_ref(),
            me.local(Role::LinkAcceptor),
            check,
            deadline,
        )?;
        // Authenticated: which socket of the link is this?
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HandshakeError::TimedOut(PRE_AUTH_DEADLINE));
        }
        stream.set_read_timeout(Some(left)).map_err(io)?;
        let mut a = [0u8; 2];
        stream.read_exact(&mut a).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                HandshakeError::TimedOut(PRE_AUTH_DEADLINE)
            }
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted => HandshakeError::Closed,
            _ => io(e),
        })?;
        let (stripe, nsocks) = (a[0] as usize, a[1] as usize);
        if nsocks != me.nsocks || stripe >= nsocks {
            return Err(HandshakeError::Malformed(format!(
                "rank {} opens socket {stripe} of {nsocks} per peer; this rank uses HCOMM_NSOCKS={} \
                 (every rank must use the same)",
                hello.rank, me.nsocks
            )));
        }
        stream.set_read_timeout(None).map_err(io)?;
        stream.set_write_timeout(None).map_err(io)?;
        stream.set_nonblocking(true).map_err(io)?;
        Ok((hello.rank as usize, stripe))
    })();
    counters.record(&r);
    let (peer, stripe) = r?;
    Ok((peer, stripe, Socket::from(stream)))
}

/// The two bytes a dialer sends right after the handshake: which socket of the link this is
/// (`stripe`), and how many the dialer uses per peer.
fn announce(stripe: usize, nsocks: usize) -> [u8; 2] {
    [stripe as u8, nsocks as u8]
}

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
    /// Set by `Communicator::abort`: every wait gives up.
    abort: Arc<AtomicBool>,
    /// Source of receive ids.
    next_id: u64,
    /// The deadline's length of the current operation (for error messages).
    op_timeout: Duration,
    /// poll(2) saw the acceptor hand over a connection.
    listener_ready: bool,
    /// Bytes written to the links (frame headers and payload), ever: `[tcp, shm]`.
    sent: [u64; 2],
    /// Bytes of frames (headers and payload) taken from the links, ever: `[tcp, shm]`.
    received: [u64; 2],
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted
}

/// How `pump_recv` reads a link.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Someone in this exchange waits for this peer: read and dispatch everything.
    Posted,
    /// Nobody waits: take only frames that can be stashed, park at anything else.
    Opportunistic,
}

/// The receive part a frame is read into: (receive index, part index).
fn find_part(recvs: &[RecvOp], id: u64) -> Option<(usize, usize)> {
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
    /// Create the listening socket on `ip` (port chosen by the kernel).
    pub fn listen(ip: std::net::IpAddr) -> io::Result<Socket> {
        let addr = SocketAddr::new(ip, 0);
        let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        s.set_reuse_address(true)?;
        s.bind(&SockAddr::from(addr))?;
        s.listen(1024)?;
        s.set_nonblocking(true)?;
        Ok(s)
    }

    /// Links for `rank` given every rank's listening address (index = rank), accepting
    /// connections on `listener` from this communicator's ranks only (named by `comm_hash`)
    /// and, with a `token`, only from those who prove they know it. Each link has `nsocks`
    /// sockets (1 to 255; every rank must use the same number).
    pub fn new(
        rank: usize,
        listener: Socket,
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
        Ok(TcpLinks {
            rank,
            peers,
            acceptor: Acceptor::start(listener, me.clone())?,
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
            abort: Arc::new(AtomicBool::new(false)),
            next_id: 0,
            op_timeout: Duration::ZERO,
            listener_ready: false,
            sent: [0; 2],
            received: [0; 2],
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

    /// Share the communicator's abort flag.
    pub fn set_abort_flag(&mut self, flag: Arc<AtomicBool>) {
        self.abort = flag;
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

    /// What became of the connections accepted so far (authenticated, or turned away and why).
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

    /// Make sure a link with `peer` exists or is on its way. Returns whether it exists now.
    ///
    /// The lower rank opens every socket of the link. A higher rank that needs the link first
    /// opens socket 0 and asks; once the lower rank adopts it, the higher rank opens the
    /// others (whoever opened socket 0 opens the rest).
    fn ensure_link(&mut self, ctx: &OpContext, peer: usize, deadline: Instant) -> Result<bool> {
        if self.inb[peer].is_some() {
            return Ok(true);
        }
        if peer >= self.n {
            // Pipes exist from the start or never.
            return Ok(false);
        }
        if self.rank > peer {
            // The lower rank may have connected already (and even left since): take that first.
            self.accept_pending();
            if self.inb[peer].is_some() {
                return Ok(true);
            }
            if self.forming[peer].iter().any(Option::is_some) {
                // The lower rank's sockets are arriving.
                return Ok(false);
            }
            let recently = self.asked_at[peer].is_some_and(|t| t.elapsed() < ASK_AGAIN);
            if self.asking[peer].is_none() && !recently {
                let s = self.dial(ctx, peer, 0, deadline)?;
                self.asking[peer] = Some(s);
                self.asked_at[peer] = Some(Instant::now());
            }
            return Ok(false);
        }
        if self.forming[peer].iter().any(Option::is_some) {
            // We adopted the higher rank's ask: it is opening the other sockets.
            return Ok(false);
        }
        let buf = self.socket_buf;
        let socks = (0..self.me.nsocks)
            .map(|stripe| {
                self.dial(ctx, peer, stripe, deadline)
                    .map(|s| Inbound::new(s, buf))
            })
            .collect::<Result<Vec<_>>>()?;
        self.inb[peer] = Some(socks);
        Ok(true)
    }

    /// Connect to `peer`'s listener, run the handshake and announce socket `stripe` (retried
    /// while the connection is merely lost, as when the peer's listener is overloaded, until
    /// `deadline`).
    fn dial(
        &self,
        ctx: &OpContext,
        peer: usize,
        stripe: usize,
        deadline: Instant,
    ) -> Result<Socket> {
        let mut backoff = Duration::from_millis(5);
        loop {
            match self.dial_once(ctx, peer, stripe, deadline) {
                Err(DialError::Handshake(e)) if e.is_transient() && Instant::now() < deadline => {
                    tracing::debug!(peer, "handshake failed ({e}); trying again");
                    std::thread::sleep(
                        backoff.min(deadline.saturating_duration_since(Instant::now())),
                    );
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                Err(DialError::Handshake(e)) if e.is_transient() => {
                    return Err(Error::Timeout {
                        ctx: ctx.clone(),
                        peers: vec![peer],
                        after: self.op_timeout,
                        detail: format!("connecting to {}: {e}", self.peers[peer]),
                    })
                }
                Err(DialError::Handshake(e)) => {
                    return Err(Error::Auth {
                        ctx: ctx.clone(),
                        peer: Some(peer),
                        msg: format!("data link to {}: {e}", self.peers[peer]),
                    })
                }
                Err(DialError::Other(e)) => return Err(e),
                Ok(s) => return Ok(s),
            }
        }
    }

    fn dial_once(
        &self,
        ctx: &OpContext,
        peer: usize,
        stripe: usize,
        deadline: Instant,
    ) -> std::result::Result<Socket, DialError> {
        let addr = self.peers[peer];
        let left = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(10), Duration::from_secs(30));
        let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
        s.connect_timeout(&SockAddr::from(addr), left)
            .map_err(|e| match e.kind() {
                io::ErrorKind::ConnectionRefused => Error::PeerClosed {
                    ctx: ctx.clone(),
                    peer,
                    detail: format!("connection to {addr} refused: the rank is gone"),
                },
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::Timeout {
                    ctx: ctx.clone(),
                    peers: vec![peer],
                    after: left,
                    detail: format!("connecting to {addr}"),
                },
                _ => Error::io(ctx.clone(), Some(peer), format!("connect to {addr}: {e}")),
            })?;
        s.set_nodelay(true)
            .map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
        let mut stream = TcpStream::from(s);
        // The peer's acceptor answers at once (it is a thread of its own), or drops us.
        let hs_deadline = Instant::now() + left.min(2 * PRE_AUTH_DEADLINE);
        auth::connect(
            &mut stream,
            self.me.token.as_ref(),
            self.me.local(Role::LinkDialer),
            peer as u32,
            hs_deadline,
        )
        .map_err(DialError::Handshake)?;
        // Two bytes into an empty socket buffer; a peer that dropped us shows up as a lost
        // connection (retried) here or at the first read.
        stream
            .write_all(&announce(stripe, self.me.nsocks))
            .map_err(|e| DialError::Handshake(HandshakeError::Io(e.to_string())))?;
        let setup = |stream: &TcpStream| -> io::Result<()> {
            stream.set_read_timeout(None)?;
            stream.set_write_timeout(None)?;
            stream.set_nonblocking(true)
        };
        setup(&stream).map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
        Ok(Socket::from(stream))
    }

    /// Higher rank: read the lower ranks' answers to our asks. An adopted ask becomes socket 0
    /// of the link; this rank then opens the others.
    fn pump_asking(&mut self, ctx: &OpContext, deadline: Instant) -> Result<bool> {
        let mut progress = false;
        for peer in 0..self.asking.len() {
            let Some(sock) = &self.asking[peer] else {
                continue;
            };
            let mut b = [0u8; 1];
            match (&*sock).read(&mut b) {
                Ok(1) if b[0] == ADOPT_ACK => {
                    let s = self.asking[peer].take().expect("asking");
                    if self.inb[peer].is_none() {
                        let buf = self.socket_buf;
                        let mut socks = vec![Inbound::new(s, buf)];
                        for stripe in 1..self.me.nsocks {
                            let s = self.dial(ctx, peer, stripe, deadline)?;
                            socks.push(Inbound::new(s, buf));
                        }
                        self.inb[peer] = Some(socks);
                    }
                    progress = true;
                }
                Err(e) if would_block(&e) => {}
                // Dropped (the lower rank connected itself) or garbage: wait for its connection.
                _ => {
                    self.asking[peer] = None;
                    progress = true;
                }
            }
        }
        Ok(progress)
    }

    /// Take the connections the acceptor has authenticated: a lower rank's are the sockets of
    /// our link with it; a higher rank's socket 0 is an ask, adopted (with an ack byte) unless
    /// we have a link already, and its other sockets complete an adopted link.
    fn accept_pending(&mut self) -> bool {
        self.acceptor.drain_wake();
        let mut progress = false;
        while let Ok((peer, stripe, sock)) = self.acceptor.accepted.try_recv() {
            progress = true;
            if self.inb[peer].is_some() {
                // We already connected to that higher rank: dropping this ask tells it so.
                continue;
            }
            let forming = &mut self.forming[peer];
            if peer < self.rank {
                // The lower rank connected: these are our link's sockets; any ask is moot.
                self.asking[peer] = None;
                if forming[stripe].is_none() {
                    forming[stripe] = Some(sock);
                }
            } else if stripe == 0 {
                // A higher rank asks: adopt its socket (unless an ask was adopted already).
                let mut w = &sock;
                if forming[0].is_none() && w.write_all(&[ADOPT_ACK]).is_ok() {
                    forming[0] = Some(sock);
                }
            } else if forming[0].is_some() && forming[stripe].is_none() {
                // The other sockets of an adopted ask.
                forming[stripe] = Some(sock);
            }
            if forming.iter().all(Option::is_some) {
                let buf = self.socket_buf;
                let socks = forming
                    .iter_mut()
                    .map(|s| Inbound::new(s.take().expect("all present"), buf))
                    .collect();
                self.inb[peer] = Some(socks);
            }
        }
        progress
    }

    fn take_staging(&mut self) -> Vec<u64> {
        self.staging_pool
            .pop()
            .unwrap_or_else(|| vec![0u64; STAGING / 8])
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
            if s.parts.is_empty() {
                s.link = self.route(s.peer, s.hdr.kind != Kind::Collective);
            }
            s.split(self.stripes_of(s.link));
            self.ensure_link(ctx, s.link, deadline)?;
        }
        for r in recvs.iter_mut() {
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

    fn drive(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
        any: bool,
    ) -> Result<()> {
        let mut r = self.drive_until_done(ctx, sends, recvs, deadline, any);
        if let Err(Error::PeerClosed { peer, .. }) = &r {
            // A peer that failed first tells why before it closes; the notice may still sit
            // unread behind the data (a send error is seen before it), on any of its sockets
            // or its shared-memory pipe.
            let peer = *peer;
            let (a, b) = self.inb.split_at_mut(self.n);
            let notice = a[peer]
                .iter_mut()
                .chain(b[peer].iter_mut())
                .flatten()
                .find_map(next_abort);
            if let Some(h) = notice {
                let (reason, culprit) = abort_notice(&h);
                r = Err(reason.remote_error(ctx.clone(), peer, culprit));
            }
        }
        if let Err(e) = &r {
            self.complete_partial_sends(ctx, sends, e);
        }
        r
    }

    /// After a failure: finish the frames half sent to healthy peers (for at most 500 ms), so
    /// that their streams stay in step and can carry the abort notice. Only whole frames of
    /// real data are sent; a frame that cannot be finished leaves its socket without a notice.
    fn complete_partial_sends(&mut self, ctx: &OpContext, sends: &mut [SendOp], e: &Error) {
        let failed: Vec<usize> = match e {
            Error::Timeout { peers, .. } => peers.clone(),
            _ => e.blame().0.into_iter().collect(),
        };
        let end = Instant::now() + Duration::from_millis(500);
        loop {
            let mut pending = false;
            for s in sends.iter_mut() {
                if failed.contains(&s.peer) {
                    continue;
                }
                for j in 0..s.parts.len() {
                    let p = &s.parts[j];
                    if p.written == 0 || p.is_done() {
                        continue;
                    }
                    let stripe = p.stripe;
                    if self.inb[s.link]
                        .as_ref()
                        .is_none_or(|socks| socks[stripe].eof)
                    {
                        continue;
                    }
                    if self.pump_send(ctx, s, j).is_err() {
                        continue;
                    }
                    pending |= !s.parts[j].is_done();
                }
            }
            if !pending || Instant::now() >= end {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn drive_until_done(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
        any: bool,
    ) -> Result<()> {
        let mut spinner = Spinner::adaptive(self.policy, &self.waits);
        let mut woke = false;
        loop {
            let mut progress = false;
            let mut missing = false;
            for i in 0..sends.len() {
                let link = sends[i].link;
                for j in 0..sends[i].parts.len() {
                    let stripe = sends[i].parts[j].stripe;
                    // Frames go out on each socket in the order of the sends.
                    if sends[i].parts[j].is_done()
                        || sends[..i].iter().any(|s| {
                            s.link == link
                                && s.parts.iter().any(|p| p.stripe == stripe && !p.is_done())
                        })
                    {
                        continue;
                    }
                    if self.inb[link].is_none() {
                        missing = true;
                        break;
                    }
                    progress |= self.pump_send(ctx, &mut sends[i], j)?;
                }
            }
            for i in 0..recvs.len() {
                if recvs[i].done() {
                    continue;
                }
                let link = recvs[i].link;
                if self.inb[link].is_none() {
                    missing = true;
                    continue;
                }
                for j in 0..recvs[i].parts.len() {
                    let stripe = recvs[i].parts[j].stripe;
                    // Each socket is read once per pass, for the first receive waiting on it.
                    if recvs[i].parts[j].done
                        || recvs[..i]
                            .iter()
                            .any(|r| r.link == link && r.waits_on(stripe))
                    {
                        continue;
                    }
                    progress |= self.pump_recv(ctx, link, stripe, recvs, Mode::Posted)?;
                }
            }
            if progress {
                // (also the spell that ends the operation: for a small message the only one)
                spinner.progressed(&mut self.waits, self.policy);
            }
            if sends.iter().all(|s| s.is_done()) && recvs.iter().all(|r| r.done()) {
                return Ok(());
            }
            if any && recvs.iter().any(|r| r.done()) {
                return Ok(());
            }
            if missing {
                // Links on their way: asks answered, connections accepted, asks repeated.
                progress |= self.pump_asking(ctx, deadline)?;
                for link in sends
                    .iter()
                    .map(|s| s.link)
                    .chain(recvs.iter().map(|r| r.link))
                {
                    self.ensure_link(ctx, link, deadline)?;
                }
            }
            if missing || woke && self.listener_ready {
                self.listener_ready = false;
                progress |= self.accept_pending();
            }
            if !progress {
                // Idle: drain what other sockets and pipes hold for later operations.
                for link in 0..self.inb.len() {
                    for stripe in 0..self.inb[link].as_ref().map_or(0, Vec::len) {
                        let idle_socket = matches!(&self.inb[link], Some(socks) if !socks[stripe].parked && !socks[stripe].eof)
                            && !recvs.iter().any(|r| r.link == link && r.waits_on(stripe));
                        if idle_socket {
                            progress |=
                                self.pump_recv(ctx, link, stripe, recvs, Mode::Opportunistic)?;
                        }
                    }
                }
            }
            if self.abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted { ctx: ctx.clone() });
            }
            if Instant::now() >= deadline {
                return Err(self.timeout_error(ctx, sends, recvs));
            }
            woke = false;
            if progress {
                spinner.progressed(&mut self.waits, self.policy);
            } else if spinner.idle() {
                self.block(ctx, sends, recvs, deadline)?;
                spinner.woke();
                woke = true;
            }
        }
    }

    fn timeout_error(&self, ctx: &OpContext, sends: &[SendOp], recvs: &[RecvOp]) -> Error {
        let mut peers = Vec::new();
        let mut detail = Vec::new();
        for r in recvs.iter().filter(|r| !r.done()) {
            peers.push(r.peer);
            let what = match r.expect {
                Expect::Coll(h) => format!("step {}", h.tag),
                Expect::P2pData(tag) | Expect::P2pFirst(tag) => format!("message tag {tag}"),
                Expect::Reply { tag, .. } => format!("the go-ahead for message tag {tag}"),
                Expect::Control(_, tag) => format!("signal/handshake tag {tag}"),
            };
            detail.push(format!(
                "receive {what} from rank {} ({} of {} bytes)",
                r.peer,
                r.received(),
                r.sink.len()
            ));
        }
        for s in sends.iter().filter(|s| !s.is_done()) {
            peers.push(s.peer);
            detail.push(format!(
                "send to rank {} ({} of {} bytes)",
                s.peer,
                s.written(),
                s.total()
            ));
        }
        peers.sort_unstable();
        peers.dedup();
        Error::Timeout {
            ctx: ctx.clone(),
            peers,
            after: self.op_timeout,
            detail: format!("still waiting to {}", detail.join("; ")),
        }
    }

    /// Block in poll(2) until a socket we care about is ready or 100 ms pass.
    fn block(
        &mut self,
        ctx: &OpContext,
        sends: &[SendOp],
        recvs: &[RecvOp],
        deadline: Instant,
    ) -> Result<()> {
        let mut fds: Vec<PollFd> = Vec::with_capacity(sends.len() + self.inb.len() + 1);
        // Shared-memory pipes: (link, pipe, wants to read, wants to write, this operation
        // needs the peer).
        let mut pipes: Vec<(usize, &ShmPipe, bool, bool, bool)> = Vec::new();
        for (link, socks) in self.inb.iter().enumerate() {
            let Some(socks) = socks else { continue };
            for (stripe, inb) in socks.iter().enumerate() {
                let wanted = recvs.iter().any(|r| r.link == link && r.waits_on(stripe));
                let read = wanted || !(inb.parked || inb.eof);
                let write = sends.iter().any(|s| {
                    s.link == link && s.parts.iter().any(|p| p.stripe == stripe && !p.is_done())
                });
                match &inb.pipe {
                    Pipe::Tcp(sock) => {
                        let mut flags = PollFlags::empty();
                        if read {
                            flags |= PollFlags::POLLIN;
                        }
                        if write {
                            flags |= PollFlags::POLLOUT;
                        }
                        if !flags.is_empty() {
                            fds.push(PollFd::new(sock.as_fd(), flags));
                        }
                    }
                    Pipe::Shm(p) if read || write => {
                        pipes.push((link, p, read, write, wanted || write))
                    }
                    Pipe::Shm(_) => {}
                }
            }
        }
        for sock in self.asking.iter().flatten() {
            fds.push(PollFd::new(sock.as_fd(), PollFlags::POLLIN));
        }
        fds.push(PollFd::new(self.acceptor.wake.as_fd(), PollFlags::POLLIN));
        // Pipes this operation only drains while idle do not need the doorbell: the sockets'
        // poll below, woken at least every 10 ms to drain them, costs fewer wake-ups than
        // 1 ms naps.
        let drain_only = !pipes.is_empty() && !pipes.iter().any(|p| p.4);
        if !pipes.is_empty() && !drain_only {
            // Shared-memory peers this operation waits for: their processes must still live (a
            // killed one never closes its end), checked every 100 ms. A peer that is merely
            // drained while idle may have finished and left: no error until someone needs it
            // (as a closed socket).
            let now = Instant::now();
            if now.duration_since(self.shm_checked) >= Duration::from_millis(100) {
                for (link, p, .., needed) in &pipes {
                    if !needed {
                        continue;
                    }
                    if let Some(detail) = p.peer_gone() {
                        return Err(Error::PeerClosed {
                            ctx: ctx.clone(),
                            peer: link - self.n,
                            detail,
                        });
                    }
                }
                self.shm_checked = now;
            }
            // Sockets that are ready already come first; then sleep on this rank's doorbell,
            // briefly when sockets matter too (they cannot wake a futex).
            let sockets_ready = |fds: &mut [PollFd]| match poll(fds, PollTimeout::ZERO) {
                Ok(n) => n > 0,
                Err(_) => false,
            };
            let mut any = sockets_ready(&mut fds);
            if !any {
                let shm = pipes[0].1.shm();
                let nap = if fds.len() > 1 { 1 } else { 10 };
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(nap));
                shm.sleep(
                    || {
                        pipes
                            .iter()
                            .any(|(_, p, r, w, _)| *r && p.readable() || *w && p.writable())
                    },
                    left,
                );
                any = sockets_ready(&mut fds);
            }
            let listener_ready = any
                && fds
                    .last()
                    .and_then(|f| f.revents())
                    .is_some_and(|r| r.intersects(PollFlags::POLLIN | PollFlags::POLLERR));
            drop(fds);
            drop(pipes);
            self.listener_ready |= listener_ready;
            return Ok(());
        }
        drop(pipes);
        // Wake at least every 100 ms so that deadlines and aborts are honoured promptly (10 ms
        // when idle pipes wait to be drained).
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(if drain_only { 10 } else { 100 }));
        let ms = left.as_millis().max(1) as u16;
        let listener_ready = match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => fds
                .last()
                .and_then(|f| f.revents())
                .is_some_and(|r| r.intersects(PollFlags::POLLIN | PollFlags::POLLERR)),
            Err(e) => return Err(Error::io(ctx.clone(), None, format!("poll: {e}"))),
        };
        drop(fds);
        self.listener_ready |= listener_ready;
        Ok(())
    }

    /// Write as much of part `j` of `s` as its socket takes now.
    fn pump_send(&mut self, ctx: &OpContext, s: &mut SendOp, j: usize) -> Result<bool> {
        let k = self.kind_of(s.link);
        let p = &mut s.parts[j];
        let inb = &mut self.inb[s.link].as_mut().expect("linked")[p.stripe];
        let data = &s.data[p.lo..p.hi];
        let mut progress = false;
        while !p.is_done() {
            match inb.pipe.send_frame(&p.hdr, data, p.written) {
                Ok(0) => break,
                Ok(n) => {
                    p.written += n;
                    self.sent[k] += n as u64;
                    progress = true;
                }
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(peer_io_error(ctx, s.peer, e)),
            }
        }
        inb.out_mid_frame = p.written > 0 && !p.is_done();
        Ok(progress)
    }

    /// After this communicator timed out waiting for `culprit`: announce it, then listen on
    /// every link for up to `grace` for the others' notices and follow the blame to the rank
    /// that is really stuck. A rank that timed out waiting for another names that one, and
    /// each better answer is announced again, so the answers converge along the chain of
    /// waits (ring: 0 waits for 3, 3 for 2, 2 for the stopped 1 → everyone ends at 1). Data
    /// frames read meanwhile are discarded: the communicator has failed. Returns the culprit.
    pub fn settle_blame(
        &mut self,
        seq: u64,
        mut culprit: Option<usize>,
        reason: u8,
        grace: Duration,
    ) -> Option<usize> {
        self.send_abort(seq, culprit, reason);
        let end = Instant::now() + grace;
        while Instant::now() < end {
            let mut better = None;
            for inb in self.inb.iter_mut().flatten().flatten() {
                // Bounded by the grace period even when a peer keeps sending data.
                while Instant::now() < end {
                    let Some(h) = next_abort(inb) else { break };
                    let c = abort_notice(&h).1;
                    if c.is_some() && c != Some(self.rank) && c != culprit {
                        better = c;
                    }
                }
            }
            if better.is_some() {
                culprit = better;
                self.send_abort(seq, culprit, reason);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        culprit
    }

    /// Tell every linked peer that this communicator failed (blaming `culprit` for `reason`),
    /// best effort and without blocking: a peer waiting on this rank then fails at once, with
    /// the cause, instead of at its deadline. The notice goes on every socket of the link that
    /// is at a frame boundary (sockets with a partly sent frame are skipped).
    pub fn send_abort(&mut self, seq: u64, culprit: Option<usize>, reason: u8) {
        let h = Header {
            root: culprit.map_or(u32::MAX, |c| c as u32),
            seq,
            ..Header::new(Kind::Abort, reason as u32, 0)
        };
        let bytes = h.encode();
        for inb in self.inb.iter_mut().flatten().flatten() {
            if inb.out_mid_frame || inb.eof {
                continue;
            }
            // 40 bytes into a socket buffer: all or nothing in practice. After a partial
            // write the stream is out of step: no further notice goes on this socket.
            match inb.pipe.send_whole(&bytes) {
                Ok(n) if n == bytes.len() => {}
                Ok(0) | Err(_) => {}
                Ok(_) => inb.out_mid_frame = true,
            }
        }
    }

    /// Read and dispatch frames from socket `stripe` of `peer` as long as data is available
    /// and (in `Posted` mode) someone wants it, or (in `Opportunistic` mode) the frames can be
    /// stashed. Only socket 0 carries control frames and eager messages (and so has a stash);
    /// the others carry stripes of large payloads only.
    fn pump_recv(
        &mut self,
        ctx: &OpContext,
        link: usize,
        stripe: usize,
        recvs: &mut [RecvOp],
        mode: Mode,
    ) -> Result<bool> {
        let peer = link % self.n;
        let k = self.kind_of(link);
        let inb = &mut self.inb[link].as_mut().expect("accepted")[stripe];
        if mode == Mode::Posted {
            inb.parked = false;
        }
        let wanted = |recvs: &[RecvOp]| recvs.iter().any(|r| r.link == link && r.waits_on(stripe));
        let mut progress = false;
        loop {
            // Payload of the current frame.
            if let Some((target, left)) = inb.cur.take() {
                let (i, j) = match &target {
                    Target::Recv(id) | Target::Discard(id) => match find_part(recvs, *id) {
                        Some(ij) => ij,
                        None => {
                            // Only an opportunistic pass can see a frame whose receive is not
                            // part of this exchange; leave it for the exchange that owns it.
                            inb.cur = Some((target, left));
                            if mode == Mode::Opportunistic {
                                inb.parked = true;
                                return Ok(progress);
                            }
                            return Err(Error::io(
                                ctx.clone(),
                                Some(peer),
                                "internal: a partly received message lost its receive",
                            ));
                        }
                    },
                    Target::Stash(..) => (usize::MAX, usize::MAX),
                };
                if left == 0 {
                    match target {
                        Target::Recv(_) | Target::Discard(_) => {
                            let r = &mut recvs[i];
                            let (p, sink) = r.part_mut(j);
                            p.flush_staging(sink);
                            let h = p.pending.expect("a frame is being read");
                            r.finish_part(j, h);
                        }
                        Target::Stash(h, data) => {
                            inb.push_stash(Stashed::Eager(h, data));
                            // A receive posted while this frame was on its way takes it now.
                            for r in recvs.iter_mut().filter(|r| r.link == link) {
                                inb.take_stashed(r);
                            }
                        }
                    }
                    progress = true;
                    if mode == Mode::Posted && !wanted(recvs) {
                        return Ok(progress);
                    }
                    continue;
                }
                let buffered = inb.iend - inb.ipos;
                if buffered > 0 {
                    let n = buffered.min(left);
                    let bytes = &inb.ibuf[inb.ipos..inb.ipos + n];
                    let mut target = target;
                    match &mut target {
                        Target::Recv(_) => {
                            let (p, sink) = recvs[i].part_mut(j);
                            p.deliver(sink, bytes);
                        }
                        Target::Stash(_, v) => v.extend_from_slice(bytes),
                        Target::Discard(_) => {}
                    }
                    inb.ipos += n;
                    self.received[k] += n as u64;
                    inb.cur = Some((target, left - n));
                    progress = true;
                    continue;
                }
                inb.ipos = 0;
                inb.iend = 0;
                if matches!(target, Target::Recv(_)) && left >= DIRECT_READ_MIN && !inb.eof {
                    let (p, sink) = recvs[i].part_mut(j);
                    let buf = p.direct_target(sink, left);
                    match inb.pipe.read(buf) {
                        Ok(0) => return Err(closed(ctx, peer)),
                        Ok(n) => {
                            self.received[k] += n as u64;
                            p.direct_done(sink, n);
                            inb.cur = Some((target, left - n));
                            progress = true;
                            continue;
                        }
                        Err(e) if would_block(&e) => {
                            inb.cur = Some((target, left));
                            return Ok(progress);
                        }
                        Err(e) => return Err(peer_io_error(ctx, peer, e)),
                    }
                }
                inb.cur = Some((target, left));
                if !fill(inb, ctx, peer, mode)? {
                    return Ok(progress);
                }
                continue;
            }
            // Need a header.
            if inb.iend - inb.ipos < HEADER_LEN {
                if inb.ipos > 0 {
                    inb.ibuf.copy_within(inb.ipos..inb.iend, 0);
                    inb.iend -= inb.ipos;
                    inb.ipos = 0;
                }
                if !fill(inb, ctx, peer, mode)? {
                    return Ok(progress);
                }
                continue;
            }
            let protocol = |msg: String| Error::Protocol {
                ctx: ctx.clone(),
                peer,
                msg,
            };
            // Control frames carry no payload and no length exceeds MAX_PAYLOAD (checked by
            // decode); every length is then checked against the receive it is for.
            let hdr = Header::decode_prefix(&inb.ibuf[inb.ipos..inb.iend])
                .map_err(|e| protocol(e.to_string()))?;
            let len = usize::try_from(hdr.len)
                .map_err(|_| protocol(format!("{}-byte payload", hdr.len)))?;
            let is_control = !hdr.kind.has_payload();
            if mode == Mode::Opportunistic {
                // Only socket 0 stashes; on the others every frame waits for its receive
                // (an abort notice is read when someone needs the socket).
                let stashable = stripe == 0
                    && if is_control {
                        inb.room_for(0)
                    } else {
                        hdr.kind == Kind::P2p && len <= EAGER_MAX && inb.room_for(len)
                    };
                if !stashable {
                    inb.parked = true;
                    return Ok(progress);
                }
            }
            inb.ipos += HEADER_LEN;
            self.received[k] += HEADER_LEN as u64;
            progress = true;
            // The first receive that waits for a frame on this socket (and satisfies `pred`).
            let pending_of = |recvs: &[RecvOp], pred: &dyn Fn(&RecvOp) -> bool| {
                recvs.iter().enumerate().find_map(|(i, r)| {
                    if r.link != link || r.done() || !pred(r) {
                        return None;
                    }
                    r.parts
                        .iter()
                        .position(|p| p.stripe == stripe && !p.done && p.pending.is_none())
                        .map(|j| (i, j))
                })
            };
            match hdr.kind {
                Kind::Collective => {
                    let (i, j) = match_collective(ctx, peer, stripe, &hdr, recvs)?;
                    let p = &mut recvs[i].parts[j];
                    p.pending = Some(hdr);
                    inb.cur = Some((Target::Recv(p.id), len));
                }
                Kind::P2p => {
                    let matched = pending_of(recvs, &|r| r.expect.p2p_tag() == Some(hdr.tag));
                    // The sender puts the message size in `count`, and in `len` too unless the
                    // frame is one stripe of agreed (RTS / Ready) data.
                    let stripe_of_data = matched.is_some_and(|(i, _)| {
                        matches!(recvs[i].expect, Expect::P2pData(_)) && recvs[i].parts.len() > 1
                    });
                    if hdr.count != hdr.len && !stripe_of_data {
                        return Err(protocol(format!(
                            "point-to-point frame with tag {} carries {len} bytes but announces {}",
                            hdr.tag, hdr.count
                        )));
                    }
                    if let Some((i, j)) = matched {
                        let r = &mut recvs[i];
                        let whole = r.sink.len();
                        let p = &mut r.parts[j];
                        let fits = len == p.len();
                        match r.expect {
                            // The size was agreed (RTS / Ready): anything else is not our peer's
                            // program.
                            Expect::P2pData(_) if !fits || hdr.count != whole as u64 => {
                                return Err(protocol(format!(
                                    "{len}-byte data with tag {} after agreeing on {} bytes",
                                    hdr.tag,
                                    p.len()
                                )));
                            }
                            // Eager data is never larger than EAGER_MAX (larger messages send
                            // an RTS first); a smaller mismatch is discarded and reported.
                            Expect::P2pFirst(_) if len > EAGER_MAX => {
                                return Err(protocol(format!(
                                    "{len}-byte message with tag {} sent without a handshake",
                                    hdr.tag
                                )));
                            }
                            _ => {}
                        }
                        p.pending = Some(hdr);
                        let t = if fits {
                            Target::Recv(p.id)
                        } else {
                            Target::Discard(p.id)
                        };
                        inb.cur = Some((t, len));
                    } else if stripe == 0 && len <= EAGER_MAX && inb.room_for(len) {
                        inb.cur = Some((Target::Stash(hdr, Vec::with_capacity(len)), len));
                    } else if stripe == 0 && len <= EAGER_MAX {
                        return Err(Error::Protocol {
                            ctx: ctx.clone(),
                            peer,
                            msg: format!("more than {MAX_UNEXPECTED_BYTES} bytes of messages that no receive has been posted for"),
                        });
                    } else {
                        return Err(Error::Protocol {
                            ctx: ctx.clone(),
                            peer,
                            msg: format!(
                                "{len}-byte message with tag {} sent without a handshake",
                                hdr.tag
                            ),
                        });
                    }
                }
                Kind::Abort => {
                    let (reason, mut culprit) = abort_notice(&hdr);
                    if culprit == Some(self.rank) {
                        // Blamed while waiting for someone else: the blame passes on to the
                        // rank this one waits for (along the chain to the real cause).
                        if let Some(r) = recvs.iter().find(|r| !r.done() && r.peer != peer) {
                            culprit = Some(r.peer);
                        }
                    }
                    return Err(reason.remote_error(ctx.clone(), peer, culprit));
                }
                _ if stripe != 0 => {
                    return Err(protocol(format!(
                        "{:?} frame on data socket {stripe} (control frames use socket 0)",
                        hdr.kind
                    )));
                }
                _ => {
                    match pending_of(recvs, &|r| r.expect.accepts(&hdr, false)) {
                        Some((i, j)) => recvs[i].finish_part(j, hdr),
                        None if inb.room_for(0) => inb.push_stash(Stashed::Control(hdr)),
                        None => {
                            return Err(Error::Protocol {
                                ctx: ctx.clone(),
                                peer,
                                msg: "too many unconsumed signals/control frames".into(),
                            });
                        }
                    }
                    if mode == Mode::Posted && !wanted(recvs) {
                        return Ok(progress);
                    }
                }
            }
        }
    }
}

/// Find the receive part a collective frame on socket `stripe` belongs to: the first pending
/// collective receive of the peer that waits on that socket, with the same fingerprint and the
/// stripe's size. Anything else is a mismatch between the ranks' programs.
fn match_collective(
    ctx: &OpContext,
    peer: usize,
    stripe: usize,
    hdr: &Header,
    recvs: &[RecvOp],
) -> Result<(usize, usize)> {
    let (i, j) = recvs
        .iter()
        .enumerate()
        .filter(|(_, r)| r.peer == peer && !r.done() && matches!(r.expect, Expect::Coll(_)))
        .find_map(|(i, r)| {
            r.parts
                .iter()
                .position(|p| p.stripe == stripe && !p.done && p.pending.is_none())
                .map(|j| (i, j))
        })
        .ok_or_else(|| unexpected(ctx, peer, hdr, recvs))?;
    let r = &recvs[i];
    let Expect::Coll(fp) = r.expect else {
        unreachable!()
    };
    if fp.same_fingerprint(hdr) && hdr.tag == fp.tag && hdr.len as usize == r.parts[j].len() {
        Ok((i, j))
    } else {
        Err(unexpected(ctx, peer, hdr, recvs))
    }
}

/// Read more into the link's input buffer: `Ok(true)` if bytes came. End of stream is an
/// error when someone waits for this peer (`Posted`), and is only remembered otherwise (a peer
/// that finished and left is no error until somebody needs it).
fn fill(inb: &mut Inbound, ctx: &OpContext, peer: usize, mode: Mode) -> Result<bool> {
    if inb.eof {
        return if mode == Mode::Posted {
            Err(closed(ctx, peer))
        } else {
            Ok(false)
        };
    }
    match inb.pipe.read(&mut inb.ibuf[inb.iend..]) {
        Ok(0) => {
            inb.eof = true;
            if mode == Mode::Posted {
                Err(closed(ctx, peer))
            } else {
                Ok(false)
            }
        }
        Ok(n) => {
            inb.iend += n;
            Ok(true)
        }
        Err(e) if would_block(&e) => Ok(false),
        Err(e) if mode == Mode::Opportunistic => {
            tracing::debug!(peer, "link closed: {e}");
            inb.eof = true;
            Ok(false)
        }
        Err(e) => Err(peer_io_error(ctx, peer, e)),
    }
}

/// The reason and the blamed rank an abort notice carries (see [`Kind::Abort`]).
fn abort_notice(h: &Header) -> (crate::base::error::AbortReason, Option<usize>) {
    (
        crate::base::error::AbortReason::from_u8(h.tag as u8),
        (h.root != u32::MAX).then_some(h.root as usize),
    )
}

/// The next abort notice readable on a failed link without blocking, discarding every other
/// frame (and the rest of a partly read one). `None` when nothing more can be read now.
fn next_abort(inb: &mut Inbound) -> Option<Header> {
    if let Some((_, left)) = inb.cur.take() {
        inb.discard += left;
    }
    // At most 64 reads (4 MiB) per call, so a peer that keeps sending cannot hold us here.
    let mut reads = 0;
    loop {
        if inb.discard > 0 && inb.iend > inb.ipos {
            let n = (inb.iend - inb.ipos).min(inb.discard);
            inb.ipos += n;
            inb.discard -= n;
            continue;
        }
        if inb.discard == 0 && inb.iend - inb.ipos >= HEADER_LEN {
            let Ok(h) = Header::decode_prefix(&inb.ibuf[inb.ipos..inb.iend]) else {
                inb.eof = true; // out of step: nothing more to learn from this link
                return None;
            };
            inb.ipos += HEADER_LEN;
            if h.kind == Kind::Abort {
                return Some(h);
            }
            inb.discard = usize::try_from(h.len).unwrap_or(usize::MAX);
            continue;
        }
        if inb.eof {
            return None;
        }
        if inb.ipos > 0 {
            inb.ibuf.copy_within(inb.ipos..inb.iend, 0);
            inb.iend -= inb.ipos;
            inb.ipos = 0;
        }
        if reads == 64 {
            return None;
        }
        reads += 1;
        match inb.pipe.read(&mut inb.ibuf[inb.iend..]) {
            Ok(0) => {
                inb.eof = true;
                return None;
            }
            Ok(n) => inb.iend += n,
            Err(e) if would_block(&e) => return None,
            Err(_) => {
                inb.eof = true;
                return None;
            }
        }
    }
}

fn closed(ctx: &OpContext, peer: usize) -> Error {
    Error::PeerClosed {
        ctx: ctx.clone(),
        peer,
        detail: String::new(),
    }
}

fn peer_io_error(ctx: &OpContext, peer: usize, e: io::Error) -> Error {
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

/// Why one attempt to open a link failed.
enum DialError {
    /// The handshake failed.
    Handshake(HandshakeError),
    /// Connecting failed.
    Other(Error),
}

impl From<Error> for DialError {
    fn from(e: Error) -> Self {
        DialError::Other(e)
    }
}

fn nosignal() -> i32 {
    nix::sys::socket::MsgFlags::MSG_NOSIGNAL.bits()
}

fn dontwait() -> i32 {
    nix::sys::socket::MsgFlags::MSG_DONTWAIT.bits()
}
