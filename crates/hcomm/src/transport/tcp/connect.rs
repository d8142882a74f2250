//! Making links: the listening socket, the acceptor thread that authenticates every incoming
//! connection before the progress loop sees it, and dialling, adoption and the extra sockets
//! of a striped link (see the module doc of [`super`] for the protocol).

use super::*;
use std::collections::HashMap;

/// Who this side of a communicator's links is, for the handshakes.
#[derive(Clone)]
pub(super) struct Identity {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) comm_hash: u64,
    pub(super) token: Option<JobToken>,
    /// Sockets per peer (`HCOMM_NSOCKS`).
    pub(super) nsocks: usize,
}

impl Identity {
    pub(super) fn local(&self, role: Role) -> Local {
        Local {
            role,
            rank: self.rank as u32,
            comm_hash: self.comm_hash,
        }
    }
}

/// A listening socket and its accept thread, shared by a communicator and the
/// sub-communicators made from it (`split`, `new_group`): each connection names its
/// communicator (by hash) in the handshake and is authenticated for, and handed to, that
/// communicator's links; a sub-communicator therefore opens no port and starts no thread of its
/// own. The thread stops, and the socket closes, once the last links using it are gone.
#[derive(Clone)]
pub struct SharedListener(Arc<ListenerHandle>);

struct ListenerHandle {
    addr: SocketAddr,
    hub: Arc<Hub>,
}

impl Drop for ListenerHandle {
    fn drop(&mut self) {
        // The accept thread sees this within 100 ms and closes the listener.
        self.hub.stop.store(true, Ordering::SeqCst);
    }
}

/// What the accept thread, its authenticating threads and the links share.
struct Hub {
    /// The communicators answering on this listener, by hash.
    registry: std::sync::Mutex<HashMap<u64, Registration>>,
    /// The last [`DEPARTED_KEPT`] communicators that answered here and were destroyed: dialers
    /// naming one get [`auth::departed_notice`].
    departed: std::sync::Mutex<VecDeque<u64>>,
    stop: AtomicBool,
    /// What became of the connections this listener accepted (for every communicator on it).
    counters: Arc<Counters>,
    /// Where the accept thread stands (see [`Acceptor::settled_since`]).
    progress: AcceptProgress,
}

/// One communicator on a [`SharedListener`]: who it is, and where its connections go.
#[derive(Clone)]
struct Registration {
    me: Identity,
    /// Authenticated connections: (peer rank, what it is for, socket).
    tx: mpsc::Sender<(usize, Purpose, Socket)>,
    /// Wakes the links' progress loop (written after each hand-over).
    waker: Arc<UnixStream>,
    revocation: Arc<Revocation>,
}

/// How long a connection naming a communicator this listener does not (yet) answer for waits
/// for it to register: a peer may dial a communicator the moment it has every rank's address,
/// a little before this rank's links exist.
const REGISTRATION_WAIT: Duration = Duration::from_millis(500);

/// How many destroyed communicators a listener remembers (8 bytes each).
const DEPARTED_KEPT: usize = 1024;

impl SharedListener {
    /// Listen on `ip` (port chosen by the kernel) and start the accept thread.
    pub fn bind(ip: std::net::IpAddr) -> io::Result<SharedListener> {
        let listener = TcpLinks::listen(ip)?;
        let addr = listener
            .local_addr()?
            .as_socket()
            .ok_or_else(|| io::Error::other("listener has no IP address"))?;
        let hub = Arc::new(Hub {
            registry: Default::default(),
            departed: Default::default(),
            stop: AtomicBool::new(false),
            counters: Arc::new(Counters::default()),
            progress: AcceptProgress::default(),
        });
        let h = hub.clone();
        std::thread::Builder::new()
            .name("hcomm-accept".into())
            .spawn(move || accept_loop(listener, h))?;
        Ok(SharedListener(Arc::new(ListenerHandle { addr, hub })))
    }

    /// The address peers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.0.addr
    }

    /// How many communicators answer on this listener now.
    pub fn communicators(&self) -> usize {
        self.0
            .hub
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }
}

/// The accepting side of a communicator's links: its registration on a [`SharedListener`],
/// whose accept thread authenticates every connection on a thread of its own and hands the good
/// ones (with the rank they proved to be) to the progress loop through a channel, waking it
/// through a socket pair.
pub(super) struct Acceptor {
    pub(super) addr: SocketAddr,
    /// Authenticated connections: (peer rank, what it is for, socket).
    pub(super) accepted: mpsc::Receiver<(usize, Purpose, Socket)>,
    /// Readable when `accepted` has something (or someone interrupted the progress loop).
    pub(super) wake: UnixStream,
    /// The other end of `wake` (the accept thread writes to it as well).
    pub(super) waker: Arc<UnixStream>,
    pub(super) counters: Arc<Counters>,
    pub(super) listener: SharedListener,
    comm_hash: u64,
}

/// How far the accept thread has got: connections accepted but still being authenticated,
/// and how many times it has found the listener's backlog empty.
#[derive(Default)]
pub(super) struct AcceptProgress {
    authenticating: Arc<AtomicUsize>,
    sweeps: AtomicU64,
}

impl Acceptor {
    /// Answer for the communicator `me` on `listener` (refused if one of the same hash does
    /// already).
    pub(super) fn start(
        listener: SharedListener,
        me: Identity,
        revocation: Arc<Revocation>,
    ) -> io::Result<Acceptor> {
        let (wake, waker) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        waker.set_nonblocking(true)?;
        let (tx, accepted) = mpsc::channel();
        let waker = Arc::new(waker);
        let comm_hash = me.comm_hash;
        {
            let hub = &listener.0.hub;
            let mut registry = hub.registry.lock().unwrap_or_else(|p| p.into_inner());
            if registry.contains_key(&comm_hash) {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("a communicator of hash {comm_hash:#x} is on this listener already"),
                ));
            }
            let registration = Registration {
                me,
                tx,
                waker: waker.clone(),
                revocation,
            };
            registry.insert(comm_hash, registration);
        }
        Ok(Acceptor {
            addr: listener.addr(),
            accepted,
            wake,
            waker,
            counters: listener.0.hub.counters.clone(),
            listener,
            comm_hash,
        })
    }

    /// A mark to pass to [`Acceptor::settled_since`], taken after the event it is about.
    pub(super) fn mark(&self) -> u64 {
        self.listener.0.hub.progress.sweeps.load(Ordering::SeqCst)
    }

    /// Whether every connection that reached the listener before `mark` was taken has been
    /// through authentication (and, if good, is in `accepted`): the accept thread has found
    /// the backlog empty twice since (so once after the mark), and nothing accepted is still
    /// being authenticated.
    pub(super) fn settled_since(&self, mark: u64) -> bool {
        let progress = &self.listener.0.hub.progress;
        progress.sweeps.load(Ordering::SeqCst) >= mark + 2
            && progress.authenticating.load(Ordering::SeqCst) == 0
    }

    /// Empty the wake-up socket (the channel is drained by the caller).
    pub(super) fn drain_wake(&self) {
        let mut b = [0u8; 64];
        while matches!((&self.wake).read(&mut b), Ok(n) if n > 0) {}
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // Connections naming this communicator are refused from now on; the listener itself
        // closes with its last user.
        let hub = &self.listener.0.hub;
        let mut departed = hub.departed.lock().unwrap_or_else(|p| p.into_inner());
        hub.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.comm_hash);
        if departed.len() == DEPARTED_KEPT {
            departed.pop_front();
        }
        departed.push_back(self.comm_hash);
    }
}

fn accept_loop(listener: Socket, hub: Arc<Hub>) {
    let pending = hub.progress.authenticating.clone();
    while !hub.stop.load(Ordering::SeqCst) {
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
                Err(e) if would_block(&e) => {
                    hub.progress.sweeps.fetch_add(1, Ordering::SeqCst);
                    break;
                }
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
                hub.counters.overloaded();
                tracing::warn!(
                    ?from,
                    "too many unauthenticated data connections; dropping one"
                );
                continue;
            };
            let hub = hub.clone();
            let spawned = std::thread::Builder::new()
                .name("hcomm-link-auth".into())
                .spawn(move || {
                    // The slot is given back only once the outcome is delivered, so that
                    // `settled_since` never sees a good connection in neither place.
                    match authenticate(sock, &hub) {
                        Ok((reg, peer, Purpose::Revoke(by), _)) => {
                            // Handled here, whatever this rank is doing: every wait gives up
                            // (the progress loop is woken to see it).
                            tracing::warn!(peer, "this communicator was revoked by rank {by} (notice from rank {peer})");
                            reg.revocation.revoke(by);
                            let _ = (&*reg.waker).write(&[1]);
                        }
                        Ok((reg, peer, purpose, sock)) => {
                            if reg.tx.send((peer, purpose, sock)).is_ok() {
                                let _ = (&*reg.waker).write(&[1]);
                            }
                        }
                        Err(e) => tracing::warn!(?from, "rejected a data connection: {e}"),
                    }
                    drop(slot);
                });
            if let Err(e) = spawned {
                tracing::warn!("cannot start a thread to authenticate a data connection: {e}");
            }
        }
    }
}

/// What an authenticated connection is for (the two bytes after the handshake,
/// [`announce`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Purpose {
    /// Socket `stripe` of the data link.
    Link(usize),
    /// A recovery connection ([`super::recovery`]): the agreement of a shrink.
    Recovery,
    /// A revocation notice: the communicator was revoked by the rank named in the four bytes
    /// that follow the announce (the dialer, or the rank it heard it from first).
    Revoke(usize),
}

/// The announce bytes of a recovery connection (`nsocks` 0 never names a data link).
pub(super) const ANNOUNCE_RECOVERY: [u8; 2] = [1, 0];
/// The announce bytes of a revocation notice.
pub(super) const ANNOUNCE_REVOKE: [u8; 2] = [2, 0];

/// The accepting side's handshake on a new connection: the peer must be another rank of a
/// communicator registered on the listener (and prove its token, if there is one), then say
/// which of the link's sockets this is, or what else the connection is for ([`announce`],
/// [`Purpose`]). Returns that communicator's registration, the peer's rank, the purpose and the
/// socket, ready for the progress loop. The outcome is counted before the socket can close, so a rejected peer sees the
/// close only after it was counted.
fn authenticate(
    sock: Socket,
    hub: &Hub,
) -> Result<(Registration, usize, Purpose, Socket), HandshakeError> {
    let counters = &hub.counters;
    let io = |e: io::Error| HandshakeError::Io(e.to_string());
    let _ = sock.set_nodelay(true);
    let mut stream = TcpStream::from(sock);
    let deadline = Instant::now() + PRE_AUTH_DEADLINE;
    let resolve = |h: &auth::Hello| {
        let wait_until = deadline.min(Instant::now() + REGISTRATION_WAIT);
        let reg = loop {
            let found = hub
                .registry
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&h.comm_hash)
                .cloned();
            let gone = || {
                (hub.departed.lock())
                    .unwrap_or_else(|p| p.into_inner())
                    .contains(&h.comm_hash)
            };
            match found {
                Some(reg) => break reg,
                None if gone() => return Err(HandshakeError::Departed),
                None if Instant::now() < wait_until && !hub.stop.load(Ordering::SeqCst) => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                None => {
                    let here: Vec<String> = (hub.registry.lock())
                        .unwrap_or_else(|p| p.into_inner())
                        .keys()
                        .map(|k| format!("{k:#x}"))
                        .collect();
                    return Err(HandshakeError::WrongPeer(format!(
                        "a rank of communicator {:#x}, not of one on this listener ({})",
                        h.comm_hash,
                        here.join(", ")
                    )));
                }
            }
        };
        let me = &reg.me;
        if h.rank as usize >= me.size || h.rank as usize == me.rank {
            return Err(HandshakeError::WrongPeer(format!(
                "claims rank {} of this {}-rank communicator, as rank {}",
                h.rank, me.size, me.rank
            )));
        }
        Ok((me.local(Role::LinkAcceptor), me.token.clone(), reg.clone()))
    };
    let r = (|| {
        stream.set_nonblocking(false).map_err(io)?;
        let (hello, reg) =
            match auth::accept_for(&mut stream, Role::LinkAcceptor, resolve, deadline) {
                Err(HandshakeError::Departed) => {
                    // Tell the dialer, which would otherwise retry until its deadline.
                    let _ = stream.write_all(&auth::departed_notice());
                    return Err(HandshakeError::Departed);
                }
                r => r?,
            };
        let me = reg.me.clone();
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
        match a {
            ANNOUNCE_RECOVERY => return Ok((reg, hello.rank as usize, Purpose::Recovery)),
            ANNOUNCE_REVOKE => {
                // Who revoked: four bytes (within the same deadline).
                let mut b = [0u8; 4];
                stream.read_exact(&mut b).map_err(|e| match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        HandshakeError::TimedOut(PRE_AUTH_DEADLINE)
                    }
                    _ => HandshakeError::Closed,
                })?;
                let by = u32::from_le_bytes(b) as usize;
                let by = if by < me.size {
                    by
                } else {
                    hello.rank as usize
                };
                return Ok((reg, hello.rank as usize, Purpose::Revoke(by)));
            }
            _ => {}
        }
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
        Ok((reg, hello.rank as usize, Purpose::Link(stripe)))
    })();
    counters.record(&r);
    let (reg, peer, purpose) = r?;
    Ok((reg, peer, purpose, Socket::from(stream)))
}

/// The two bytes a dialer sends right after the handshake: which socket of the link this is
/// (`stripe`), and how many the dialer uses per peer.
pub(super) fn announce(stripe: usize, nsocks: usize) -> [u8; 2] {
    [stripe as u8, nsocks as u8]
}

/// Why one attempt to open a link failed.
pub(super) enum DialError {
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

    /// Make sure a link with `peer` exists or is on its way. Returns whether it exists now.
    ///
    /// The lower rank opens every socket of the link. A higher rank that needs the link first
    /// opens socket 0 and asks; once the lower rank adopts it, the higher rank opens the
    /// others (whoever opened socket 0 opens the rest).
    pub(super) fn ensure_link(
        &mut self,
        ctx: &OpContext,
        peer: usize,
        deadline: Instant,
    ) -> Result<bool> {
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
                match self.dial(ctx, peer, 0, deadline) {
                    Ok(s) => {
                        self.asking[peer] = Some(s);
                        self.asked_at[peer] = Some(Instant::now());
                    }
                    Err(e @ Error::PeerClosed { .. }) => return self.after_refusal(peer, e),
                    Err(e) => return Err(e),
                }
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

    /// A lower rank's listener refused us: it is gone, but it may have connected to us before
    /// it left (eager sends complete once written), with its sockets still in our acceptor.
    /// Wait until every connection that arrived before the refusal has been through
    /// authentication (a few hundred milliseconds at most: the accept thread polls every
    /// 100 ms), take them, and report `refused` only if the link is still missing.
    fn after_refusal(&mut self, peer: usize, refused: Error) -> Result<bool> {
        // Taken after the refusal: what reached the listener before it is in the backlog now.
        let mark = self.acceptor.mark();
        let give_up = Instant::now() + 2 * PRE_AUTH_DEADLINE;
        loop {
            let settled = self.acceptor.settled_since(mark);
            self.accept_pending();
            if self.inb[peer].is_some() {
                return Ok(true);
            }
            if self.forming[peer].iter().any(Option::is_some) {
                return Ok(false);
            }
            if settled || Instant::now() >= give_up {
                return Err(refused);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Connect to `peer`'s listener, run the handshake and announce socket `stripe` (retried
    /// while the connection is merely lost, as when the peer's listener is overloaded, until
    /// `deadline`).
    pub(super) fn dial(
        &self,
        ctx: &OpContext,
        peer: usize,
        stripe: usize,
        deadline: Instant,
    ) -> Result<Socket> {
        let mut backoff = Duration::from_millis(5);
        loop {
            match self.dial_once(ctx, peer, stripe, deadline) {
                Err(DialError::Handshake(HandshakeError::Departed)) => {
                    return Err(Error::PeerClosed {
                        ctx: ctx.clone(),
                        peer,
                        detail: format!(
                            "rank {peer} has destroyed this communicator (its listener at {} \
                             is still up for others)",
                            self.peers[peer]
                        ),
                    })
                }
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

    pub(super) fn dial_once(
        &self,
        ctx: &OpContext,
        peer: usize,
        stripe: usize,
        deadline: Instant,
    ) -> std::result::Result<Socket, DialError> {
        self.dialer()
            .dial_once(ctx, peer, announce(stripe, self.me.nsocks), deadline)
    }

    /// What dialling a peer needs, to dial from another thread (a revocation notice).
    pub(super) fn dialer(&self) -> Dialer {
        Dialer {
            peers: self.peers.clone(),
            me: self.me.clone(),
        }
    }

    /// Higher rank: read the lower ranks' answers to our asks. An adopted ask becomes socket 0
    /// of the link; this rank then opens the others.
    pub(super) fn pump_asking(&mut self, ctx: &OpContext, deadline: Instant) -> Result<bool> {
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
    pub(super) fn accept_pending(&mut self) -> bool {
        self.acceptor.drain_wake();
        let mut progress = false;
        while let Ok((peer, purpose, sock)) = self.acceptor.accepted.try_recv() {
            progress = true;
            let stripe = match purpose {
                Purpose::Link(stripe) => stripe,
                Purpose::Recovery => {
                    self.recovery.accepted(peer, sock);
                    continue;
                }
                Purpose::Revoke(_) => continue,
            };
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
}

/// Everything needed to open a connection to a rank of the communicator (its address, this
/// side's identity for the handshake): a data link's socket, a recovery connection or a
/// revocation notice.
#[derive(Clone)]
pub(super) struct Dialer {
    pub(super) peers: Vec<SocketAddr>,
    pub(super) me: Identity,
}

impl Dialer {
    /// One attempt: connect to `peer`, run the handshake and send `announce_bytes`.
    pub(super) fn dial_once(
        &self,
        ctx: &OpContext,
        peer: usize,
        announce_bytes: [u8; 2],
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
            .write_all(&announce_bytes)
            .map_err(|e| DialError::Handshake(HandshakeError::Io(e.to_string())))?;
        let setup = |stream: &TcpStream| -> io::Result<()> {
            stream.set_read_timeout(None)?;
            stream.set_write_timeout(None)?;
            stream.set_nonblocking(true)
        };
        setup(&stream).map_err(|e| Error::io(ctx.clone(), Some(peer), e))?;
        Ok(Socket::from(stream))
    }
}
