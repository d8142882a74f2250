//! TCP links between the ranks of one communicator, and the progress loop that drives many
//! transfers at once (full duplex) with one thread.
//!
//! * Each rank listens on one address (the chosen interface, never all interfaces by default).
//! * Links are made lazily, per direction: the first time rank `a` sends to `b` it connects to
//!   `b`'s listener; the first time `b` receives from `a` it accepts that connection. A ring
//!   therefore opens 2 sockets per rank, not `n - 1`.
//! * Every frame starts with a [`Header`]; collectives carry their fingerprint in it.
//! * Point-to-point data uses a receiver-ready protocol: `recv` sends a `Ready` frame with its
//!   buffer size, `send` waits for it and sends the data. Both sides therefore see a size
//!   mismatch, and data never arrives unannounced (no unbounded buffering).
//! * Memory per link: a 64 KiB input buffer; reducing receives use a 256 KiB staging buffer.

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, OpContext, Result};
use crate::reduce::{reduce_into, Order};
use crate::transport::frame::{Header, Kind, HEADER_LEN};
use crate::transport::wait::{Spinner, WaitPolicy};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::collections::VecDeque;
use std::io::{self, IoSlice, Read};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const HELLO_MAGIC: u32 = 0x4843_4f48; // "HCOH"
const IBUF: usize = 64 << 10;
/// Staging size for reducing receives.
pub const STAGING: usize = 256 << 10;
const DIRECT_READ_MIN: usize = 16 << 10;
/// Largest stash of control frames (signals, ready, connect) per peer before we call it abuse.
const MAX_STASH: usize = 1 << 20;

/// Where received payload goes.
pub enum Sink<'a> {
    /// Copy into this buffer.
    Buf(&'a mut [u8]),
    /// Reduce into this buffer.
    Reduce {
        /// Accumulator.
        dst: &'a mut [u8],
        /// Element type.
        dtype: DType,
        /// Operator.
        op: ReduceOp,
        /// Operand order.
        order: Order,
    },
}

impl Sink<'_> {
    fn len(&self) -> usize {
        match self {
            Sink::Buf(b) => b.len(),
            Sink::Reduce { dst, .. } => dst.len(),
        }
    }
}

/// A frame to send.
pub struct SendOp<'a> {
    peer: usize,
    hdr: [u8; HEADER_LEN],
    data: &'a [u8],
    written: usize,
}

impl<'a> SendOp<'a> {
    /// Send `hdr` followed by `data` (`hdr.len` must equal `data.len()`).
    pub fn new(peer: usize, hdr: Header, data: &'a [u8]) -> SendOp<'a> {
        debug_assert_eq!(hdr.len as usize, data.len());
        SendOp {
            peer,
            hdr: hdr.encode(),
            data,
            written: 0,
        }
    }

    fn total(&self) -> usize {
        HEADER_LEN + self.data.len()
    }

    fn done(&self) -> bool {
        self.written == self.total()
    }

    /// True once every byte is handed to the kernel.
    pub fn is_done(&self) -> bool {
        self.done()
    }
}

/// A set of control-frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KindSet(u16);

impl KindSet {
    /// The set of `kinds`.
    pub fn of(kinds: &[Kind]) -> KindSet {
        KindSet(kinds.iter().fold(0, |m, k| m | (1 << *k as u8)))
    }

    fn has(self, k: Kind) -> bool {
        self.0 & (1 << k as u8) != 0
    }
}

/// What a receive waits for.
#[derive(Clone, Copy, Debug)]
pub enum Expect {
    /// A collective frame with this fingerprint (and `len` equal to the sink's size).
    Coll(Header),
    /// A control frame (no payload) of one of these kinds with this tag.
    Control(KindSet, u32),
    /// Point-to-point data with this tag, after the RTS/Ready handshake.
    P2pData(u32),
    /// The first frame of a point-to-point message with this tag: eager data, or an RTS.
    P2pFirst(u32),
}

impl Expect {
    fn p2p_tag(&self) -> Option<u32> {
        match *self {
            Expect::P2pData(t) | Expect::P2pFirst(t) => Some(t),
            _ => None,
        }
    }
}

/// Messages up to this size are sent eagerly (no handshake) and buffered by the receiver if
/// it has not posted the receive yet; larger ones wait for the receiver (RTS / Ready).
pub const EAGER_MAX: usize = 64 << 10;
/// Most unreceived eager bytes buffered from one peer.
pub const MAX_UNEXPECTED_BYTES: usize = 64 << 20;

/// A frame to receive.
pub struct RecvOp<'a> {
    peer: usize,
    expect: Expect,
    sink: Sink<'a>,
    /// Set when the frame is complete; for control frames, the received header.
    got: Option<Header>,
    /// Header of the data frame being received into this op.
    pending: Option<Header>,
    /// Identity while a frame is read into it across calls (0 = not assigned yet).
    id: u64,
    /// Payload bytes delivered so far.
    delivered: usize,
    staging: Vec<u64>,
    staged: usize,
}

impl<'a> RecvOp<'a> {
    /// Receive a collective frame.
    pub fn coll(peer: usize, fp: Header, sink: Sink<'a>) -> RecvOp<'a> {
        Self::make(peer, Expect::Coll(fp), sink)
    }

    /// Receive the first frame of a point-to-point message with `tag`: eager data into `buf`
    /// (when its size matches; else the data is dropped and [`header`](Self::header) tells the
    /// sender's size), or an RTS header.
    pub fn p2p_first(peer: usize, tag: u32, buf: &'a mut [u8]) -> RecvOp<'a> {
        Self::make(peer, Expect::P2pFirst(tag), Sink::Buf(buf))
    }

    /// Receive rendezvous data with `tag` into `buf`.
    pub fn p2p_data(peer: usize, tag: u32, buf: &'a mut [u8]) -> RecvOp<'a> {
        Self::make(peer, Expect::P2pData(tag), Sink::Buf(buf))
    }

    /// Receive a control frame of one of `kinds`.
    pub fn control(peer: usize, kinds: &[Kind], tag: u32) -> RecvOp<'a> {
        Self::make(
            peer,
            Expect::Control(KindSet::of(kinds), tag),
            Sink::Buf(&mut []),
        )
    }

    fn make(peer: usize, expect: Expect, sink: Sink<'a>) -> RecvOp<'a> {
        RecvOp {
            peer,
            expect,
            sink,
            got: None,
            pending: None,
            id: 0,
            delivered: 0,
            staging: Vec::new(),
            staged: 0,
        }
    }

    /// The header received (once complete).
    pub fn header(&self) -> Option<Header> {
        self.got
    }

    /// The peer.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// True once the frame is complete.
    pub fn is_done(&self) -> bool {
        self.got.is_some()
    }

    /// Give back the receive buffer (for a follow-up receive into the same memory).
    pub fn into_buf(self) -> &'a mut [u8] {
        match self.sink {
            Sink::Buf(b) => b,
            Sink::Reduce { dst, .. } => dst,
        }
    }

    fn done(&self) -> bool {
        self.got.is_some()
    }

    /// Deliver payload bytes (never more than the frame holds).
    fn deliver(&mut self, bytes: &[u8]) {
        match &mut self.sink {
            Sink::Buf(b) => {
                b[self.delivered..self.delivered + bytes.len()].copy_from_slice(bytes);
                self.delivered += bytes.len();
            }
            Sink::Reduce { .. } => {
                let mut rest = bytes;
                while !rest.is_empty() {
                    let stg = bytemuck::cast_slice_mut::<u64, u8>(&mut self.staging);
                    let n = rest.len().min(stg.len() - self.staged);
                    stg[self.staged..self.staged + n].copy_from_slice(&rest[..n]);
                    self.staged += n;
                    rest = &rest[n..];
                    self.flush_staging_if_full();
                }
            }
        }
    }

    fn flush_staging_if_full(&mut self) {
        let cap = self.staging.len() * 8;
        let total = self.sink.len();
        if self.staged == cap || self.delivered + self.staged == total {
            self.flush_staging();
        }
    }

    fn flush_staging(&mut self) {
        if let Sink::Reduce {
            dst,
            dtype,
            op,
            order,
        } = &mut self.sink
        {
            let stg = bytemuck::cast_slice::<u64, u8>(&self.staging);
            let n = self.staged;
            reduce_into(
                *dtype,
                *op,
                &mut dst[self.delivered..self.delivered + n],
                &stg[..n],
                *order,
            );
            self.delivered += n;
            self.staged = 0;
        }
    }

    /// A buffer to read payload into directly (no copy through the link's input buffer).
    fn direct_target(&mut self, frame_left: usize) -> &mut [u8] {
        match &mut self.sink {
            Sink::Buf(b) => &mut b[self.delivered..self.delivered + frame_left],
            Sink::Reduce { .. } => {
                let stg = bytemuck::cast_slice_mut::<u64, u8>(&mut self.staging);
                let end = stg.len().min(self.staged + frame_left);
                &mut stg[self.staged..end]
            }
        }
    }

    fn direct_done(&mut self, n: usize) {
        match &mut self.sink {
            Sink::Buf(_) => self.delivered += n,
            Sink::Reduce { .. } => {
                self.staged += n;
                self.flush_staging_if_full();
            }
        }
    }
}

/// A frame that arrived before anyone waited for it.
enum Stashed {
    /// A control frame (signal, connect, RTS, …).
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

/// Incoming side of a link: a socket plus its input buffer and frame state.
struct Inbound {
    sock: Socket,
    ibuf: Vec<u8>,
    ipos: usize,
    iend: usize,
    /// The frame being read and its payload bytes left.
    cur: Option<(Target, usize)>,
    /// Frames that arrived before anyone waited for them, in arrival order.
    stash: VecDeque<Stashed>,
    stash_bytes: usize,
}

impl Inbound {
    /// Complete `r` from the stash if a matching frame is there.
    fn take_stashed(&mut self, r: &mut RecvOp) {
        let pos = self.stash.iter().position(|s| match (s, r.expect) {
            (Stashed::Control(h), Expect::Control(set, tag)) => set.has(h.kind) && h.tag == tag,
            (Stashed::Control(h), Expect::P2pFirst(tag)) => h.kind == Kind::Rts && h.tag == tag,
            (Stashed::Eager(h, _), Expect::P2pFirst(tag)) => h.tag == tag,
            _ => false,
        });
        let Some(pos) = pos else { return };
        match self.stash.remove(pos).expect("present") {
            Stashed::Control(h) => r.got = Some(h),
            Stashed::Eager(h, data) => {
                self.stash_bytes -= data.len();
                if data.len() == r.sink.len() {
                    r.deliver(&data);
                }
                r.got = Some(h);
            }
        }
    }

    /// Take a stashed `Nack` from this peer, if any.
    fn take_nack(&mut self) -> Option<Header> {
        let pos = self
            .stash
            .iter()
            .position(|s| matches!(s, Stashed::Control(h) if h.kind == Kind::Nack))?;
        match self.stash.remove(pos) {
            Some(Stashed::Control(h)) => Some(h),
            _ => None,
        }
    }
}

/// The TCP links of one communicator.
pub struct TcpLinks {
    rank: usize,
    peers: Vec<SocketAddr>,
    comm_hash: u64,
    listener: Socket,
    out: Vec<Option<Socket>>,
    inb: Vec<Option<Inbound>>,
    policy: WaitPolicy,
    /// Reused staging buffers for reducing receives.
    staging_pool: Vec<Vec<u64>>,
    /// Set by `Communicator::abort`: every wait gives up.
    abort: Arc<AtomicBool>,
    /// Source of receive ids.
    next_id: u64,
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted
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

    /// Links for `rank` given every rank's listening address (index = rank).
    pub fn new(
        rank: usize,
        listener: Socket,
        peers: Vec<SocketAddr>,
        comm_hash: u64,
        policy: WaitPolicy,
    ) -> TcpLinks {
        let n = peers.len();
        TcpLinks {
            rank,
            peers,
            comm_hash,
            listener,
            out: (0..n).map(|_| None).collect(),
            inb: (0..n).map(|_| None).collect(),
            policy,
            staging_pool: Vec::new(),
            abort: Arc::new(AtomicBool::new(false)),
            next_id: 1,
        }
    }

    /// Share the communicator's abort flag.
    pub fn set_abort_flag(&mut self, flag: Arc<AtomicBool>) {
        self.abort = flag;
    }

    /// The IP address the listener is bound to.
    pub fn listen_ip(&self) -> std::net::IpAddr {
        self.listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(|a| a.ip())
            .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
    }

    /// The number of sockets currently open (both directions), for memory/fd accounting.
    pub fn open_links(&self) -> usize {
        self.out.iter().filter(|s| s.is_some()).count()
            + self.inb.iter().filter(|s| s.is_some()).count()
    }

    fn connect_out(&mut self, ctx: &OpContext, peer: usize, deadline: Instant) -> Result<()> {
        if self.out[peer].is_some() {
            return Ok(());
        }
        let addr = self.peers[peer];
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
        s.connect_timeout(&SockAddr::from(addr), left.min(Duration::from_secs(30)))
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
        let mut hello = [0u8; 16];
        hello[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello[4..8].copy_from_slice(&(self.rank as u32).to_le_bytes());
        hello[8..16].copy_from_slice(&self.comm_hash.to_le_bytes());
        let mut w = &s;
        std::io::Write::write_all(&mut w, &hello)
            .map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
        s.set_nonblocking(true)
            .map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
        self.out[peer] = Some(s);
        Ok(())
    }

    /// Accept every pending connection and register the ones that greet correctly.
    fn accept_pending(&mut self, ctx: &OpContext) -> Result<bool> {
        let mut any = false;
        loop {
            let (s, _) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if would_block(&e) => return Ok(any),
                Err(e) => return Err(Error::io(ctx.clone(), None, format!("accept: {e}"))),
            };
            // A stranger that does not greet within a second is dropped; the job goes on.
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let mut hello = [0u8; 16];
            let mut r = &s;
            if r.read_exact(&mut hello).is_err() {
                continue;
            }
            let magic = u32::from_le_bytes(hello[0..4].try_into().unwrap());
            let peer = u32::from_le_bytes(hello[4..8].try_into().unwrap()) as usize;
            let hash = u64::from_le_bytes(hello[8..16].try_into().unwrap());
            if magic != HELLO_MAGIC
                || hash != self.comm_hash
                || peer >= self.peers.len()
                || self.inb[peer].is_some()
            {
                tracing::warn!(peer, "dropping a data connection with a bad greeting");
                continue;
            }
            let _ = s.set_read_timeout(None);
            s.set_nonblocking(true)
                .map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
            let _ = s.set_nodelay(true);
            self.inb[peer] = Some(Inbound {
                sock: s,
                ibuf: vec![0u8; IBUF],
                ipos: 0,
                iend: 0,
                cur: None,
                stash: VecDeque::new(),
                stash_bytes: 0,
            });
            any = true;
        }
    }

    fn take_staging(&mut self) -> Vec<u64> {
        self.staging_pool
            .pop()
            .unwrap_or_else(|| vec![0u64; STAGING / 8])
    }

    /// Drive all `sends` and `recvs` to completion, concurrently, before `deadline`.
    ///
    /// Sends to one peer go out in the order given; receives from one peer are matched in the
    /// order given. On error the links are in an undefined state and the communicator must be
    /// poisoned by the caller.
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
        for s in sends.iter() {
            self.connect_out(ctx, s.peer, deadline)?;
        }
        for r in recvs.iter_mut() {
            if r.id == 0 {
                r.id = self.next_id;
                self.next_id += 1;
            }
            if matches!(r.sink, Sink::Reduce { .. }) && r.staging.is_empty() {
                r.staging = self.take_staging();
            }
        }
        // Frames that arrived earlier.
        for r in recvs.iter_mut() {
            if matches!(r.expect, Expect::Control(..) | Expect::P2pFirst(_)) {
                if let Some(inb) = self.inb[r.peer].as_mut() {
                    inb.take_stashed(r);
                }
            }
        }
        let result = self.drive(ctx, sends, recvs, deadline, any);
        for r in recvs.iter_mut() {
            if !r.staging.is_empty() {
                self.staging_pool.push(std::mem::take(&mut r.staging));
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
        let mut spinner = Spinner::new(self.policy);
        loop {
            let mut progress = false;
            // Sends: the first unfinished send of each peer.
            for i in 0..sends.len() {
                if sends[i].done()
                    || sends[..i]
                        .iter()
                        .any(|s| s.peer == sends[i].peer && !s.done())
                {
                    continue;
                }
                progress |= self.pump_send(ctx, &mut sends[i])?;
            }
            // Receives: read from every peer we expect something from.
            let mut need_accept = false;
            for i in 0..recvs.len() {
                if recvs[i].done()
                    || recvs[..i]
                        .iter()
                        .any(|r| r.peer == recvs[i].peer && !r.done())
                {
                    continue;
                }
                let peer = recvs[i].peer;
                if self.inb[peer].is_none() {
                    need_accept = true;
                    continue;
                }
                progress |= self.pump_recv(ctx, peer, recvs)?;
            }
            if need_accept {
                progress |= self.accept_pending(ctx)?;
            }
            if sends.iter().all(|s| s.done()) && recvs.iter().all(|r| r.done()) {
                return Ok(());
            }
            if any && recvs.iter().any(|r| r.done()) {
                return Ok(());
            }
            if self.abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted { ctx: ctx.clone() });
            }
            if progress {
                spinner.reset();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout_error(ctx, sends, recvs, deadline, now));
            }
            if spinner.idle() {
                self.block(ctx, sends, recvs, need_accept, deadline)?;
                spinner.reset();
            }
        }
    }

    fn timeout_error(
        &self,
        ctx: &OpContext,
        sends: &[SendOp],
        recvs: &[RecvOp],
        deadline: Instant,
        now: Instant,
    ) -> Error {
        let mut peers = Vec::new();
        let mut detail = Vec::new();
        for r in recvs.iter().filter(|r| !r.done()) {
            peers.push(r.peer);
            let what = match r.expect {
                Expect::Coll(h) => format!("step {}", h.tag),
                Expect::P2pData(tag) | Expect::P2pFirst(tag) => format!("message tag {tag}"),
                Expect::Control(_, tag) => format!("signal/handshake tag {tag}"),
            };
            detail.push(format!(
                "receive {what} from rank {} ({} of {} bytes)",
                r.peer,
                r.delivered + r.staged,
                r.sink.len()
            ));
        }
        for s in sends.iter().filter(|s| !s.done()) {
            peers.push(s.peer);
            detail.push(format!(
                "send to rank {} ({} of {} bytes)",
                s.peer,
                s.written,
                s.total()
            ));
        }
        peers.sort_unstable();
        peers.dedup();
        let _ = now;
        Error::Timeout {
            ctx: ctx.clone(),
            peers,
            after: deadline.saturating_duration_since(now).max(Duration::ZERO),
            detail: format!("still waiting to {}", detail.join("; ")),
        }
    }

    /// Block in poll(2) until a socket we care about is ready or the deadline passes.
    fn block(
        &self,
        ctx: &OpContext,
        sends: &[SendOp],
        recvs: &[RecvOp],
        need_accept: bool,
        deadline: Instant,
    ) -> Result<()> {
        let mut fds: Vec<PollFd> = Vec::with_capacity(sends.len() + recvs.len() + 1);
        for s in sends.iter().filter(|s| !s.done()) {
            if let Some(sock) = &self.out[s.peer] {
                fds.push(PollFd::new(sock.as_fd(), PollFlags::POLLOUT));
            }
        }
        for r in recvs.iter().filter(|r| !r.done()) {
            if let Some(inb) = &self.inb[r.peer] {
                fds.push(PollFd::new(inb.sock.as_fd(), PollFlags::POLLIN));
            }
        }
        if need_accept {
            fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
        }
        // Wake at least every 100 ms so that a deadline is honoured promptly.
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(100));
        let ms = left.as_millis().max(1) as u16;
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(e) => Err(Error::io(ctx.clone(), None, format!("poll: {e}"))),
        }
    }

    fn pump_send(&mut self, ctx: &OpContext, s: &mut SendOp) -> Result<bool> {
        let sock = self.out[s.peer].as_ref().expect("connected");
        let mut progress = false;
        while !s.done() {
            let res = if s.written < HEADER_LEN {
                let bufs = [IoSlice::new(&s.hdr[s.written..]), IoSlice::new(s.data)];
                sock.send_vectored_with_flags(&bufs, libc_nosignal())
            } else {
                let off = s.written - HEADER_LEN;
                sock.send_with_flags(&s.data[off..], libc_nosignal())
            };
            match res {
                Ok(0) => break,
                Ok(n) => {
                    s.written += n;
                    progress = true;
                }
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(peer_io_error(ctx, s.peer, e)),
            }
        }
        Ok(progress)
    }

    /// Take a `Nack` that `peer` sent about an earlier eager message, if any.
    pub fn take_nack(&mut self, peer: usize) -> Option<Header> {
        self.inb.get_mut(peer)?.as_mut()?.take_nack()
    }

    /// Read and dispatch frames from `peer` as long as data is available and someone wants it.
    fn pump_recv(&mut self, ctx: &OpContext, peer: usize, recvs: &mut [RecvOp]) -> Result<bool> {
        let inb = self.inb[peer].as_mut().expect("accepted");
        let mut progress = false;
        loop {
            // Payload of the current frame.
            if let Some((target, left)) = inb.cur.take() {
                let slot = |id: u64| recvs.iter().position(|r| r.id == id);
                let idx = match &target {
                    Target::Recv(id) | Target::Discard(id) => match slot(*id) {
                        Some(i) => i,
                        None => {
                            return Err(Error::io(
                                ctx.clone(),
                                Some(peer),
                                "internal: a partly received message lost its receive",
                            ));
                        }
                    },
                    Target::Stash(..) => usize::MAX,
                };
                if left == 0 {
                    match target {
                        Target::Recv(_) => {
                            let r = &mut recvs[idx];
                            r.flush_staging();
                            r.got = r.pending;
                        }
                        Target::Discard(_) => recvs[idx].got = recvs[idx].pending,
                        Target::Stash(h, data) => inb.stash.push_back(Stashed::Eager(h, data)),
                    }
                    progress = true;
                    if !recvs.iter().any(|r| r.peer == peer && !r.done()) {
                        return Ok(progress);
                    }
                    continue;
                }
                let buffered = inb.iend - inb.ipos;
                if buffered > 0 {
                    let n = buffered.min(left);
                    let bytes = &inb.ibuf[inb.ipos..inb.ipos + n];
                    match &target {
                        Target::Recv(_) => recvs[idx].deliver(bytes),
                        Target::Discard(_) => {}
                        Target::Stash(..) => {}
                    }
                    let mut target = target;
                    if let Target::Stash(_, v) = &mut target {
                        v.extend_from_slice(bytes);
                    }
                    inb.ipos += n;
                    inb.cur = Some((target, left - n));
                    progress = true;
                    continue;
                }
                inb.ipos = 0;
                inb.iend = 0;
                if let (Target::Recv(_), true) = (&target, left >= DIRECT_READ_MIN) {
                    let buf = recvs[idx].direct_target(left);
                    match (&inb.sock).read(buf) {
                        Ok(0) => return Err(closed(ctx, peer)),
                        Ok(n) => {
                            recvs[idx].direct_done(n);
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
                match fill(inb, ctx, peer)? {
                    true => continue,
                    false => return Ok(progress),
                }
            }
            // Need a header.
            if inb.iend - inb.ipos < HEADER_LEN {
                if inb.ipos > 0 {
                    inb.ibuf.copy_within(inb.ipos..inb.iend, 0);
                    inb.iend -= inb.ipos;
                    inb.ipos = 0;
                }
                match fill(inb, ctx, peer)? {
                    true => continue,
                    false => return Ok(progress),
                }
            }
            let raw: [u8; HEADER_LEN] = inb.ibuf[inb.ipos..inb.ipos + HEADER_LEN]
                .try_into()
                .unwrap();
            let hdr = Header::decode(&raw).map_err(|m| Error::Remote {
                ctx: ctx.clone(),
                peer,
                msg: format!("protocol error: {m}"),
            })?;
            inb.ipos += HEADER_LEN;
            progress = true;
            let pending_of = |recvs: &[RecvOp], pred: &dyn Fn(&RecvOp) -> bool| {
                recvs
                    .iter()
                    .position(|r| r.peer == peer && !r.done() && r.pending.is_none() && pred(r))
            };
            match hdr.kind {
                Kind::Collective => {
                    let idx = match_collective(ctx, peer, &hdr, recvs)?;
                    recvs[idx].pending = Some(hdr);
                    inb.cur = Some((Target::Recv(recvs[idx].id), hdr.len as usize));
                }
                Kind::P2p => {
                    let len = hdr.len as usize;
                    if let Some(idx) = pending_of(recvs, &|r| r.expect.p2p_tag() == Some(hdr.tag)) {
                        recvs[idx].pending = Some(hdr);
                        let id = recvs[idx].id;
                        let t = if len == recvs[idx].sink.len() {
                            Target::Recv(id)
                        } else {
                            Target::Discard(id)
                        };
                        inb.cur = Some((t, len));
                    } else if len <= EAGER_MAX {
                        if inb.stash_bytes + len > MAX_UNEXPECTED_BYTES {
                            return Err(Error::Remote {
                                ctx: ctx.clone(),
                                peer,
                                msg: format!("rank {peer} sent more than {MAX_UNEXPECTED_BYTES} bytes of messages that no receive has been posted for"),
                            });
                        }
                        inb.stash_bytes += len;
                        inb.cur = Some((Target::Stash(hdr, Vec::with_capacity(len)), len));
                    } else if let Some(idx) =
                        pending_of(recvs, &|r| matches!(r.expect, Expect::Coll(_)))
                    {
                        let _ = idx;
                        return Err(unexpected(ctx, peer, &hdr, recvs));
                    } else {
                        return Err(Error::Remote {
                            ctx: ctx.clone(),
                            peer,
                            msg: format!("protocol error: {len}-byte message with tag {} sent without a handshake", hdr.tag),
                        });
                    }
                }
                _ => {
                    if hdr.len != 0 {
                        return Err(Error::Remote {
                            ctx: ctx.clone(),
                            peer,
                            msg: format!("protocol error: {:?} frame with a payload", hdr.kind),
                        });
                    }
                    let waiting = pending_of(recvs, &|r| match r.expect {
                        Expect::Control(set, t) => set.has(hdr.kind) && t == hdr.tag,
                        Expect::P2pFirst(t) => hdr.kind == Kind::Rts && t == hdr.tag,
                        _ => false,
                    });
                    match waiting {
                        Some(idx) => recvs[idx].got = Some(hdr),
                        None if hdr.kind == Kind::Nack => {
                            return Err(Error::SizeMismatch {
                                ctx: ctx.clone(),
                                peer,
                                tag: hdr.tag,
                                msg: format!(
                                    "rank {peer} rejected an earlier message with tag {}: its receive is {} bytes",
                                    hdr.tag, hdr.count
                                ),
                            })
                        }
                        None => {
                            if inb.stash.len() >= MAX_STASH {
                                return Err(Error::Remote {
                                    ctx: ctx.clone(),
                                    peer,
                                    msg: "too many unconsumed signals/control frames".into(),
                                });
                            }
                            inb.stash.push_back(Stashed::Control(hdr));
                        }
                    }
                    if !recvs.iter().any(|r| r.peer == peer && !r.done()) {
                        return Ok(progress);
                    }
                }
            }
        }
    }
}

fn unexpected(ctx: &OpContext, peer: usize, hdr: &Header, recvs: &[RecvOp]) -> Error {
    let describe = crate::comm::describe_frame;
    let mine = recvs
        .iter()
        .find(|r| r.peer == peer && !r.done())
        .map(|r| match r.expect {
            Expect::Coll(fp) => describe(&Header {
                len: r.sink.len() as u64,
                ..fp
            }),
            Expect::P2pData(t) | Expect::P2pFirst(t) => {
                format!("recv(tag={t}, {} bytes)", r.sink.len())
            }
            Expect::Control(_, t) => format!("a signal/handshake with tag {t}"),
        })
        .unwrap_or_else(|| "nothing from it".into());
    Error::Mismatch {
        ctx: ctx.clone(),
        peer,
        msg: format!(
            "rank {peer} called {} while this rank waits for {mine}",
            describe(hdr)
        ),
    }
}

/// Find the receive a collective frame belongs to: the first pending collective receive of the
/// peer, with the same fingerprint. Anything else is a mismatch between the ranks' programs.
fn match_collective(ctx: &OpContext, peer: usize, hdr: &Header, recvs: &[RecvOp]) -> Result<usize> {
    let idx = recvs
        .iter()
        .position(|r| {
            r.peer == peer
                && !r.done()
                && r.pending.is_none()
                && matches!(r.expect, Expect::Coll(_))
        })
        .ok_or_else(|| unexpected(ctx, peer, hdr, recvs))?;
    let r = &recvs[idx];
    let Expect::Coll(fp) = r.expect else {
        unreachable!()
    };
    if fp.same_fingerprint(hdr) && hdr.tag == fp.tag && hdr.len as usize == r.sink.len() {
        Ok(idx)
    } else {
        Err(unexpected(ctx, peer, hdr, recvs))
    }
}

fn fill(inb: &mut Inbound, ctx: &OpContext, peer: usize) -> Result<bool> {
    match (&inb.sock).read(&mut inb.ibuf[inb.iend..]) {
        Ok(0) => Err(closed(ctx, peer)),
        Ok(n) => {
            inb.iend += n;
            Ok(true)
        }
        Err(e) if would_block(&e) => Ok(false),
        Err(e) => Err(peer_io_error(ctx, peer, e)),
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

fn libc_nosignal() -> i32 {
    nix::sys::socket::MsgFlags::MSG_NOSIGNAL.bits()
}
