//! What works after a communicator failed: revocation notices and the recovery connections
//! the agreement of a shrink runs over ([`TcpMesh`], a [`Mesh`]).
//!
//! Both are connections of their own to the peers' listeners, authenticated like data links
//! (the acceptor tells them apart by the two bytes after the handshake, `Purpose`), so they
//! never meet a data link's half-sent frames:
//!
//! * a **revocation notice** carries only the revoker's rank (four bytes): the peer's acceptor
//!   thread marks the communicator revoked by it and wakes its progress loop, whatever the peer
//!   is doing ([`Notifier`]);
//! * a **recovery connection** per ordered pair (each rank dials every other once, at the
//!   first shrink, and sends on that connection; it reads what the peers dialed): messages
//!   `[u32 length][bytes]`. A rank is reported [`MeshEvent::Gone`] when its listener refuses
//!   the dial, or either connection with it closes; everything it sent before is delivered
//!   first. They stay open as long as the links, so a rank that returned from one agreement
//!   is still reachable for the next (a retry), and a rank never looks gone merely because it
//!   finished.

use super::connect::{DialError, Dialer, ANNOUNCE_RECOVERY, ANNOUNCE_REVOKE};
use super::*;
use crate::transport::{Mesh, MeshEvent};

/// Longest message accepted on a recovery connection.
const MAX_MESSAGE: usize = 1 << 20;
/// How long a dial (connect and handshake) may take before the peer counts as unreachable.
const DIAL_WITHIN: Duration = Duration::from_secs(2);

/// Sends revocation notices to every peer (cloneable, usable from any thread).
#[derive(Clone)]
pub struct Notifier {
    dialer: Dialer,
}

impl Notifier {
    /// Tell every other rank, in the background, that this communicator is revoked: one
    /// short connection each, all at once, tried again (a loaded machine may be slow to
    /// answer) until it is delivered, the rank is found gone (its listener refuses), or
    /// `within` has passed.
    /// The notice names `by`, the rank that revoked it (this one, or the first revoker this
    /// rank heard of), so every rank reports the same revoker.
    pub fn notify_all(&self, by: usize, within: Duration) {
        let me = self.dialer.me.rank;
        for peer in (0..self.dialer.peers.len()).filter(|&p| p != me) {
            let dialer = self.dialer.clone();
            let spawned = std::thread::Builder::new()
                .name("hcomm-revoke".into())
                .spawn(move || {
                    let ctx = OpContext {
                        op: "revoke",
                        seq: 0,
                    };
                    let give_up = Instant::now() + within;
                    loop {
                        let deadline = (Instant::now() + DIAL_WITHIN).min(give_up);
                        let sent = dialer
                            .dial_once(&ctx, peer, ANNOUNCE_REVOKE, deadline)
                            .and_then(|s| {
                                let mut s = TcpStream::from(s);
                                let _ = s.set_nonblocking(false);
                                let _ = s.set_write_timeout(Some(DIAL_WITHIN));
                                s.write_all(&(by as u32).to_le_bytes()).map_err(|e| {
                                    DialError::Handshake(HandshakeError::Io(e.to_string()))
                                })
                            });
                        match sent {
                            // The acceptor reads nothing more: closing ends the notice.
                            Ok(()) => {
                                tracing::debug!(peer, "revocation notice delivered");
                                return;
                            }
                            Err(DialError::Other(Error::PeerClosed { .. })) => {
                                tracing::debug!(peer, "no revocation notice: the rank is gone");
                                return;
                            }
                            Err(_) if Instant::now() < give_up => {
                                std::thread::sleep(Duration::from_millis(50));
                            }
                            Err(_) => {
                                tracing::info!(
                                    peer,
                                    "revocation notice not delivered within {within:?}"
                                );
                                return;
                            }
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("cannot start a thread for a revocation notice: {e}");
            }
        }
    }
}

/// One inbound recovery connection and the bytes read from it.
struct InConn {
    sock: TcpStream,
    buf: Vec<u8>,
    eof: bool,
}

/// The recovery connections of one communicator's links.
pub(super) struct RecoveryState {
    /// What this rank dialed, per peer: it sends there (and sees the peer close it).
    out: Vec<Option<TcpStream>>,
    /// What each peer dialed: this rank reads there.
    inn: Vec<Option<InConn>>,
    /// Peers reported gone (never reported twice, never used again).
    gone: Vec<bool>,
    /// Peers found gone or unreachable and not reported yet: `Some(true)` when their process
    /// exited (a dial refused, a connection reset), `Some(false)` when they could not be
    /// reached (see [`MeshEvent::Unreachable`]).
    pending: Vec<Option<bool>>,
}

impl RecoveryState {
    pub(super) fn new(n: usize) -> RecoveryState {
        RecoveryState {
            out: (0..n).map(|_| None).collect(),
            inn: (0..n).map(|_| None).collect(),
            gone: vec![false; n],
            pending: vec![None; n],
        }
    }

    /// A recovery connection `peer` opened (a newer one replaces an older one).
    pub(super) fn accepted(&mut self, peer: usize, sock: Socket) {
        let sock = TcpStream::from(sock);
        let _ = sock.set_nonblocking(true);
        self.inn[peer] = Some(InConn {
            sock,
            buf: Vec::new(),
            eof: false,
        });
    }
}

impl TcpLinks {
    /// What sends this communicator's revocation notices.
    pub fn notifier(&self) -> Notifier {
        Notifier {
            dialer: self.dialer(),
        }
    }

    /// The recovery mesh over these links (dialling the peers not dialled yet).
    pub fn mesh(&mut self) -> TcpMesh<'_> {
        let me = self.rank;
        for p in (0..self.n).filter(|&p| p != me) {
            if self.recovery.out[p].is_none()
                && !self.recovery.gone[p]
                && self.recovery.pending[p].is_none()
            {
                self.dial_recovery(p);
            }
        }
        TcpMesh { links: self }
    }

    /// Dial `peer`'s recovery connection. A peer whose listener refuses is marked to be
    /// reported gone; one that cannot be reached otherwise (no connection or handshake within
    /// 2 s, three times; no route) unreachable.
    fn dial_recovery(&mut self, peer: usize) -> bool {
        let ctx = OpContext {
            op: "shrink",
            seq: 0,
        };
        let dialer = self.dialer();
        for _ in 0..3 {
            let deadline = Instant::now() + DIAL_WITHIN;
            match dialer.dial_once(&ctx, peer, ANNOUNCE_RECOVERY, deadline) {
                Ok(s) => {
                    let s = TcpStream::from(s);
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_write_timeout(Some(DIAL_WITHIN));
                    self.recovery.out[peer] = Some(s);
                    return true;
                }
                Err(DialError::Handshake(e)) if e.is_transient() => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    let exited = matches!(e, DialError::Other(Error::PeerClosed { .. }));
                    let why = match e {
                        DialError::Handshake(e) => e.to_string(),
                        DialError::Other(e) => e.to_string(),
                    };
                    tracing::info!(peer, "recovery: rank {peer} unreachable: {why}");
                    self.recovery.pending[peer] = Some(exited);
                    return false;
                }
            }
        }
        self.recovery.pending[peer] = Some(false);
        false
    }
}

/// True for the errors of a connection whose other end closed or reset it (its process
/// exited, the kernel answering for it); false for those of an unreachable peer (no route,
/// timed out), which may be alive across a network partition.
fn peer_closed(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof | NotConnected
    )
}

/// The [`Mesh`] of a communicator's recovery connections (see the module doc).
pub struct TcpMesh<'a> {
    links: &'a mut TcpLinks,
}

impl TcpMesh<'_> {
    /// A complete message waiting on some inbound connection.
    fn ready_message(&mut self) -> Option<(usize, Vec<u8>)> {
        let st = &mut self.links.recovery;
        for (p, conn) in st.inn.iter_mut().enumerate() {
            let Some(c) = conn.as_mut() else { continue };
            if st.gone[p] || c.buf.len() < 4 {
                continue;
            }
            let len = u32::from_le_bytes(c.buf[..4].try_into().expect("4 bytes")) as usize;
            if len > MAX_MESSAGE {
                tracing::warn!(
                    peer = p,
                    "recovery: oversized message ({len} bytes); closing"
                );
                c.eof = true;
                c.buf.clear();
                continue;
            }
            if c.buf.len() >= 4 + len {
                let msg = c.buf[4..4 + len].to_vec();
                c.buf.drain(..4 + len);
                return Some((p, msg));
            }
        }
        None
    }

    /// Read what the inbound connections hold; note the ones that closed.
    fn read_all(&mut self) {
        let mut chunk = [0u8; 4096];
        let st = &mut self.links.recovery;
        for (p, conn) in st.inn.iter_mut().enumerate() {
            let Some(c) = conn.as_mut() else { continue };
            while !c.eof {
                match (&c.sock).read(&mut chunk) {
                    Ok(0) => c.eof = true,
                    Ok(k) => c.buf.extend_from_slice(&chunk[..k]),
                    Err(e) if would_block(&e) => break,
                    // Closed by the peer's end: its process exited.
                    Err(e) if peer_closed(&e) => c.eof = true,
                    // No route, timed out: the network, not a sign that the peer exited.
                    Err(_) => {
                        c.eof = true;
                        c.buf.clear();
                        st.pending[p].get_or_insert(false);
                        break;
                    }
                }
            }
        }
    }

    /// A peer found gone or unreachable (and not reported yet): refused or unreachable
    /// earlier, or a connection closed.
    fn newly_gone(&mut self) -> Option<MeshEvent> {
        let st = &mut self.links.recovery;
        for p in 0..st.gone.len() {
            if st.gone[p] || p == self.links.rank {
                continue;
            }
            let in_closed = st.pending[p].is_none()
                && st.inn[p].as_ref().is_some_and(|c| c.eof && c.buf.len() < 4);
            let out_closed = match &st.out[p] {
                None => false,
                Some(s) => {
                    // The peer never writes here: readable means closed (or reset); another
                    // error (no route, timed out) is the network's.
                    let _ = s.set_nonblocking(true);
                    let mut b = [0u8; 1];
                    let closed = match (&*s).read(&mut b) {
                        Ok(0) => true,
                        Ok(_) => false,
                        Err(e) if would_block(&e) => false,
                        Err(e) if peer_closed(&e) => true,
                        Err(_) => {
                            st.pending[p].get_or_insert(false);
                            false
                        }
                    };
                    let _ = s.set_nonblocking(false);
                    closed
                }
            };
            let exited = match st.pending[p] {
                _ if in_closed || out_closed => true,
                Some(exited) => exited,
                None => continue,
            };
            st.gone[p] = true;
            st.out[p] = None;
            st.inn[p] = None;
            return Some(if exited {
                MeshEvent::Gone(p)
            } else {
                MeshEvent::Unreachable(p)
            });
        }
        None
    }

    /// Wait for anything on the recovery connections (or a new one) until `until`.
    fn wait(&mut self, until: Instant) {
        let st = &self.links.recovery;
        let mut fds: Vec<PollFd> = vec![PollFd::new(
            self.links.acceptor.wake.as_fd(),
            PollFlags::POLLIN,
        )];
        for c in st.inn.iter().flatten().filter(|c| !c.eof) {
            fds.push(PollFd::new(c.sock.as_fd(), PollFlags::POLLIN));
        }
        for s in st.out.iter().flatten() {
            fds.push(PollFd::new(s.as_fd(), PollFlags::POLLIN));
        }
        let ms = until
            .saturating_duration_since(Instant::now())
            .as_millis()
            .min(50) as u16;
        let _ = poll(&mut fds, PollTimeout::from(ms));
    }
}

impl Mesh for TcpMesh<'_> {
    fn rank(&self) -> usize {
        self.links.rank
    }

    fn size(&self) -> usize {
        self.links.n
    }

    fn send(&mut self, to: usize, bytes: &[u8]) -> bool {
        if self.links.recovery.gone[to] || self.links.recovery.pending[to].is_some() {
            return false;
        }
        if self.links.recovery.out[to].is_none() && !self.links.dial_recovery(to) {
            // Reported by `next` (gone or unreachable, as the dial found).
            return false;
        }
        let s = self.links.recovery.out[to].as_ref().expect("dialled");
        let mut frame = (bytes.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(bytes);
        if let Err(e) = (&*s).write_all(&frame) {
            // Reset or closed: the process exited; timed out, no route: unreachable.
            let exited = peer_closed(&e);
            let st = &mut self.links.recovery;
            st.pending[to] = Some(exited);
            st.out[to] = None;
            return false;
        }
        true
    }

    fn next(&mut self, deadline: Instant) -> MeshEvent {
        loop {
            self.links.accept_pending();
            self.read_all();
            if let Some((from, bytes)) = self.ready_message() {
                return MeshEvent::Message { from, bytes };
            }
            if let Some(event) = self.newly_gone() {
                return event;
            }
            if Instant::now() >= deadline {
                return MeshEvent::Timeout;
            }
            self.wait(deadline);
        }
    }
}
