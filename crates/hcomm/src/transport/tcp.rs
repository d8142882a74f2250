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
}

/// What a receive waits for.
#[derive(Clone, Copy, Debug)]
pub enum Expect {
    /// A collective frame with this fingerprint (and `len` equal to the sink's size).
    Coll(Header),
    /// A control frame (Ready, Signal, Connect, Close) of this kind and tag.
    Control(Kind, u32),
    /// Point-to-point data with this tag.
    P2p(u32),
}

/// A frame to receive.
pub struct RecvOp<'a> {
    peer: usize,
    expect: Expect,
    sink: Sink<'a>,
    /// Set when the frame is complete; for control frames, the received header.
    got: Option<Header>,
    /// Header of the data frame being received into this op.
    pending: Option<Header>,
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

    /// Receive point-to-point data with `tag` into `buf`.
    pub fn p2p(peer: usize, tag: u32, buf: &'a mut [u8]) -> RecvOp<'a> {
        Self::make(peer, Expect::P2p(tag), Sink::Buf(buf))
    }

    /// Receive a control frame.
    pub fn control(peer: usize, kind: Kind, tag: u32) -> RecvOp<'a> {
        Self::make(peer, Expect::Control(kind, tag), Sink::Buf(&mut []))
    }

    fn make(peer: usize, expect: Expect, sink: Sink<'a>) -> RecvOp<'a> {
        RecvOp {
            peer,
            expect,
            sink,
            got: None,
            pending: None,
            delivered: 0,
            staging: Vec::new(),
            staged: 0,
        }
    }

    /// The header received (once complete).
    pub fn header(&self) -> Option<Header> {
        self.got
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

/// Incoming side of a link: a socket plus its input buffer and frame state.
struct Inbound {
    sock: Socket,
    ibuf: Vec<u8>,
    ipos: usize,
    iend: usize,
    /// The frame being read: (index of the receive it belongs to, payload bytes left).
    cur: Option<(usize, usize)>,
    /// Control frames that arrived before anyone waited for them.
    stash: VecDeque<Header>,
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
        }
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
        for s in sends.iter() {
            self.connect_out(ctx, s.peer, deadline)?;
        }
        for r in recvs.iter_mut() {
            if matches!(r.sink, Sink::Reduce { .. }) && r.staging.is_empty() {
                r.staging = self.take_staging();
            }
        }
        // Control frames that were stashed earlier.
        for r in recvs.iter_mut() {
            if let Expect::Control(kind, tag) = r.expect {
                if let Some(inb) = self.inb[r.peer].as_mut() {
                    if let Some(pos) = inb
                        .stash
                        .iter()
                        .position(|h| h.kind == kind && h.tag == tag)
                    {
                        r.got = inb.stash.remove(pos);
                    }
                }
            }
        }
        let result = self.drive(ctx, sends, recvs, deadline);
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
                Expect::P2p(tag) => format!("message tag {tag}"),
                Expect::Control(k, tag) => format!("{k:?} tag {tag}"),
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

    /// Read and dispatch frames from `peer` as long as data is available and someone wants it.
    fn pump_recv(&mut self, ctx: &OpContext, peer: usize, recvs: &mut [RecvOp]) -> Result<bool> {
        let inb = self.inb[peer].as_mut().expect("accepted");
        let mut progress = false;
        loop {
            // Payload of the current frame.
            if let Some((idx, left)) = inb.cur {
                if left == 0 {
                    let r = &mut recvs[idx];
                    r.flush_staging();
                    r.got = r.pending;
                    inb.cur = None;
                    progress = true;
                    if !recvs.iter().any(|r| r.peer == peer && !r.done()) {
                        return Ok(progress);
                    }
                    continue;
                }
                let buffered = inb.iend - inb.ipos;
                if buffered > 0 {
                    let n = buffered.min(left);
                    recvs[idx].deliver(&inb.ibuf[inb.ipos..inb.ipos + n]);
                    inb.ipos += n;
                    inb.cur = Some((idx, left - n));
                    progress = true;
                    continue;
                }
                inb.ipos = 0;
                inb.iend = 0;
                if left >= DIRECT_READ_MIN {
                    let target = recvs[idx].direct_target(left);
                    match (&inb.sock).read(target) {
                        Ok(0) => return Err(closed(ctx, peer)),
                        Ok(n) => {
                            recvs[idx].direct_done(n);
                            inb.cur = Some((idx, left - n));
                            progress = true;
                            continue;
                        }
                        Err(e) if would_block(&e) => return Ok(progress),
                        Err(e) => return Err(peer_io_error(ctx, peer, e)),
                    }
                }
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
            match hdr.kind {
                Kind::Collective | Kind::P2p => {
                    let idx = match_frame(ctx, peer, &hdr, recvs)?;
                    recvs[idx].pending = Some(hdr);
                    inb.cur = Some((idx, hdr.len as usize));
                }
                Kind::Ready | Kind::Signal | Kind::Connect | Kind::Close => {
                    if hdr.len != 0 {
                        return Err(Error::Remote {
                            ctx: ctx.clone(),
                            peer,
                            msg: format!("protocol error: {:?} frame with a payload", hdr.kind),
                        });
                    }
                    let waiting = recvs.iter_mut().find(|r| {
                        r.peer == peer && !r.done() && matches!(r.expect, Expect::Control(k, t) if k == hdr.kind && t == hdr.tag)
                    });
                    match waiting {
                        Some(r) => r.got = Some(hdr),
                        None => {
                            if inb.stash.len() >= MAX_STASH {
                                return Err(Error::Remote {
                                    ctx: ctx.clone(),
                                    peer,
                                    msg: "too many unconsumed signals/control frames".into(),
                                });
                            }
                            inb.stash.push_back(hdr);
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

/// Find the receive a data frame belongs to: the first pending collective/p2p receive of the
/// peer. Anything else is a mismatch between the two ranks' programs.
fn match_frame(ctx: &OpContext, peer: usize, hdr: &Header, recvs: &[RecvOp]) -> Result<usize> {
    let cand = recvs.iter().position(|r| {
        r.peer == peer
            && !r.done()
            && r.pending.is_none()
            && matches!(r.expect, Expect::Coll(_) | Expect::P2p(_))
    });
    let describe = |h: &Header| crate::comm::describe_frame(h);
    let Some(idx) = cand else {
        return Err(Error::Mismatch {
            ctx: ctx.clone(),
            peer,
            msg: format!(
                "rank {peer} sent {} while this rank expected no data from it",
                describe(hdr)
            ),
        });
    };
    let r = &recvs[idx];
    match (r.expect, hdr.kind) {
        (Expect::Coll(fp), Kind::Collective)
            if fp.same_fingerprint(hdr)
                && hdr.tag == fp.tag
                && hdr.len as usize == r.sink.len() =>
        {
            Ok(idx)
        }
        (Expect::Coll(fp), _) => Err(Error::Mismatch {
            ctx: ctx.clone(),
            peer,
            msg: format!(
                "rank {peer} called {} while this rank called {}",
                describe(hdr),
                describe(&Header {
                    len: r.sink.len() as u64,
                    ..fp
                })
            ),
        }),
        (Expect::P2p(tag), Kind::P2p) if hdr.tag == tag => {
            if hdr.count as usize != r.sink.len() || hdr.len as usize != r.sink.len() {
                Err(Error::SizeMismatch {
                    ctx: ctx.clone(),
                    peer,
                    tag,
                    msg: format!(
                        "rank {peer} sent {} bytes, this rank posted a {}-byte receive",
                        hdr.count,
                        r.sink.len()
                    ),
                })
            } else {
                Ok(idx)
            }
        }
        (Expect::P2p(tag), _) => Err(Error::Mismatch {
            ctx: ctx.clone(),
            peer,
            msg: format!(
                "rank {peer} sent {} while this rank waited for a message with tag {tag}",
                describe(hdr)
            ),
        }),
        (Expect::Control(..), _) => unreachable!("filtered above"),
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
