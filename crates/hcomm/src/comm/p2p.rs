//! Point-to-point: send/recv/send_recv, signals, and connections ([`Connection`]), over
//! [`p2p_protocol`] (eager messages up to [`EAGER_MAX`] bytes, rendezvous above; size
//! mismatches reported to both ends).
//!
//! It may use the communicator's plumbing (`lock`, `finish`, `check_peer`, its state) and the
//! TCP links' exchange; it never runs a collective.

use super::Communicator;
use crate::base::dtype::Element;
use crate::base::error::{Error, OpContext, Result};
use crate::transport::tcp::{RecvOp, SendOp, TcpLinks, EAGER_MAX};
use crate::wire::frame::{Header, Kind};
use std::sync::Arc;
use std::time::Instant;

impl Communicator {
    /// Send `buf` to `peer` with `tag`.
    ///
    /// Messages up to 64 KiB are eager: `send` returns once the data is handed to the kernel,
    /// and the receiver buffers it until its matching [`recv`](Self::recv). Larger messages are
    /// rendezvous: `send` returns once the receiver has posted the matching receive and the
    /// data is handed over (two ranks that both send a large message to each other before
    /// receiving wait until the timeout; use [`send_recv`](Self::send_recv) to exchange, or
    /// post with [`send_async`](Self::send_async)). Issued while posted messages are in flight,
    /// it joins them.
    /// Sizes must match: a mismatch fails the receive, and the send (large messages) or the
    /// sender's next point-to-point call with that peer (eager ones).
    pub fn send<T: Element>(&self, peer: usize, tag: u32, buf: &[T]) -> Result<()> {
        self.send_bytes(peer, tag, bytemuck::cast_slice(buf))
    }

    /// Receive into `buf` the message `peer` sent with `tag`. Messages are matched by
    /// (peer, tag), whatever order the sender posted them in.
    pub fn recv<T: Element>(&self, peer: usize, tag: u32, buf: &mut [T]) -> Result<()> {
        self.recv_bytes(peer, tag, bytemuck::cast_slice_mut(buf))
    }

    /// Send to `dst` and receive from `src` at the same time (no deadlock when two ranks
    /// exchange).
    pub fn send_recv<T: Element>(
        &self,
        dst: usize,
        send: &[T],
        src: usize,
        recv: &mut [T],
        tag: u32,
    ) -> Result<()> {
        self.p2p(
            Some((dst, tag, bytemuck::cast_slice(send))),
            Some((src, tag, bytemuck::cast_slice_mut(recv))),
        )
    }

    /// Byte-level [`send`](Self::send).
    pub fn send_bytes(&self, peer: usize, tag: u32, buf: &[u8]) -> Result<()> {
        self.p2p(Some((peer, tag, buf)), None)
    }

    /// Byte-level [`recv`](Self::recv).
    pub fn recv_bytes(&self, peer: usize, tag: u32, buf: &mut [u8]) -> Result<()> {
        self.p2p(None, Some((peer, tag, buf)))
    }

    fn p2p(
        &self,
        send: Option<(usize, u32, &[u8])>,
        mut recv: Option<(usize, u32, &mut [u8])>,
    ) -> Result<()> {
        let op = match (&send, &recv) {
            (Some(_), Some(_)) => "send_recv",
            (Some(_), None) => "send",
            _ => "recv",
        };
        if let Some((p, _, _)) = &send {
            self.check_peer(op, *p)?;
        }
        if let Some((p, _, _)) = &recv {
            self.check_peer(op, *p)?;
        }
        // Messages posted with `send_async` / `recv_async` are being carried: join them (the
        // progress loop holds the turn, and may wait for this very message).
        if let Some(r) = self.join_progress_loop(send, &mut recv) {
            return r;
        }
        let (mut inner, ctx) = self.lock(op)?;
        if let Some(span) = inner.span.as_mut() {
            let sent = send.as_ref().map(|(p, t, d)| (*p, *t, d.len()));
            let received = recv.as_ref().map(|(p, t, d)| (*p, *t, d.len()));
            if let Some((peer, tag, bytes)) = sent.or(received) {
                (span.peer, span.tag, span.bytes) = (Some(peer), Some(tag), Some(bytes));
            }
        }
        let timeout = self.timeout();
        inner.links.set_op_timeout(timeout);
        let deadline = inner.history.deadline(timeout);
        let send_id = match &send {
            Some((p, _, _)) => {
                inner.p2p_ids[*p] += 1;
                inner.p2p_ids[*p]
            }
            None => 0,
        };
        let result = p2p_protocol(
            &mut inner.links,
            &ctx,
            send.map(|(p, t, d)| (p, t, send_id, d)),
            recv,
            deadline,
        );
        Self::finish(&mut inner, false, result)
    }

    /// Post a signal to `peer` (does not wait). Signals with the same (peer, tag) are counted:
    /// each [`wait_signal`](Self::wait_signal) consumes one.
    pub fn signal(&self, peer: usize, tag: u32) -> Result<()> {
        self.control_send("signal", peer, Kind::Signal, tag)
    }

    /// Wait for a signal from `peer` with `tag`.
    pub fn wait_signal(&self, peer: usize, tag: u32) -> Result<()> {
        self.control_recv("wait_signal", peer, Kind::Signal, tag)
    }

    fn control_send(&self, op: &'static str, peer: usize, kind: Kind, tag: u32) -> Result<()> {
        self.check_peer(op, peer)?;
        let (mut inner, ctx) = self.lock(op)?;
        if let Some(span) = inner.span.as_mut() {
            (span.peer, span.tag) = (Some(peer), Some(tag));
        }
        let timeout = self.timeout();
        inner.links.set_op_timeout(timeout);
        let deadline = inner.history.deadline(timeout);
        let mut sends = vec![SendOp::new(peer, Header::new(kind, tag, 0), &[])];
        let r = inner.links.exchange(&ctx, &mut sends, &mut [], deadline);
        Self::finish(&mut inner, false, r)
    }

    fn control_recv(&self, op: &'static str, peer: usize, kind: Kind, tag: u32) -> Result<()> {
        self.check_peer(op, peer)?;
        let (mut inner, ctx) = self.lock(op)?;
        if let Some(span) = inner.span.as_mut() {
            (span.peer, span.tag) = (Some(peer), Some(tag));
        }
        let timeout = self.timeout();
        inner.links.set_op_timeout(timeout);
        let deadline = inner.history.deadline(timeout);
        let mut recvs = vec![RecvOp::control(peer, &[kind], tag)];
        let r = inner.links.exchange(&ctx, &mut [], &mut recvs, deadline);
        Self::finish(&mut inner, false, r)
    }

    /// Open a connection to `peer` identified by `tag` (HCCL's `CreateConnection`). Both ranks
    /// call `connect` with each other's rank and the same tag, in any order: the handshake is
    /// sent at once and checked by the first transfer on the connection.
    pub fn connect(&self, peer: usize, tag: u32) -> Result<Connection<'_>> {
        self.open_connection(peer, tag)?;
        Ok(Connection {
            comm: CommRef::Borrowed(self),
            peer,
            tag,
            open: true,
            confirmed: std::cell::Cell::new(false),
        })
    }

    /// [`connect`](Self::connect) for a connection that keeps the communicator alive itself
    /// (no borrow: it can be stored, e.g. by a language binding).
    pub fn connect_shared(self: &Arc<Self>, peer: usize, tag: u32) -> Result<Connection<'static>> {
        self.open_connection(peer, tag)?;
        Ok(Connection {
            comm: CommRef::Shared(self.clone()),
            peer,
            tag,
            open: true,
            confirmed: std::cell::Cell::new(false),
        })
    }

    fn open_connection(&self, peer: usize, tag: u32) -> Result<()> {
        self.check_peer("connect", peer)?;
        {
            let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if inner.open_conns.contains(&(peer, tag)) {
                return Err(Error::invalid(
                    "connect",
                    inner.seq,
                    format!("a connection to rank {peer} with tag {tag} is already open"),
                ));
            }
        }
        self.control_send("connect", peer, Kind::Connect, tag)?;
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .open_conns
            .insert((peer, tag));
        Ok(())
    }
}

/// The point-to-point protocol. Messages up to [`EAGER_MAX`] bytes go at once (the receiver
/// stashes them if its receive is not posted yet, so messages match by (peer, tag) whatever
/// order they are posted in); larger ones announce themselves (RTS), wait for the receiver's
/// Ready, then send. Every message carries an id (per sender and receiver) that Ready and Nack
/// echo. A size mismatch fails the receive at once and is reported to the sender with a Nack:
/// at once for large messages; for eager ones (whose `send` has already returned) by the
/// sender's next point-to-point call with that peer that sees the Nack, at its start or its
/// end (a receive from that peer always does, since the Nack precedes the peer's later data).
fn p2p_protocol(
    links: &mut TcpLinks,
    ctx: &OpContext,
    send: Option<(usize, u32, u64, &[u8])>,
    recv: Option<(usize, u32, &mut [u8])>,
    deadline: Instant,
) -> Result<()> {
    let size_err = |peer: usize, tag: u32, msg: String| Error::SizeMismatch {
        ctx: ctx.clone(),
        peer,
        tag,
        msg,
    };
    let peers: Vec<usize> = send
        .iter()
        .map(|s| s.0)
        .chain(recv.iter().map(|r| r.0))
        .collect();
    // A Nack for an earlier eager message (checked again at the end: it may arrive meanwhile).
    let earlier_nack = |links: &mut TcpLinks| -> Result<()> {
        for &p in &peers {
            if let Some(n) = links.take_nack(p) {
                let msg = format!(
                    "an earlier message with tag {} to rank {p} did not match its {}-byte receive",
                    n.tag, n.count
                );
                return Err(size_err(p, n.tag, msg));
            }
        }
        Ok(())
    };
    earlier_nack(links)?;
    let mut sends: Vec<SendOp> = Vec::new();
    let mut recvs: Vec<RecvOp> = Vec::new();
    let mut deferred: Option<Error> = None;
    let mut big_send: Option<(usize, u32, u64, &[u8])> = None;
    if let Some((p, tag, id, data)) = send {
        let hdr = Header {
            count: data.len() as u64,
            seq: id,
            ..Header::new(Kind::P2p, tag, 0)
        };
        if data.len() <= EAGER_MAX {
            sends.push(SendOp::new(
                p,
                Header {
                    len: data.len() as u64,
                    ..hdr
                },
                data,
            ));
        } else {
            sends.push(SendOp::new(
                p,
                Header {
                    kind: Kind::Rts,
                    ..hdr
                },
                &[],
            ));
            recvs.push(RecvOp::reply(p, tag, id));
            big_send = Some((p, tag, id, data));
        }
    }
    if let Some((p, tag, buf)) = recv {
        recvs.push(RecvOp::p2p_first(p, tag, buf));
    }
    while !(recvs.is_empty() && sends.iter().all(|s| s.is_done())) {
        links.exchange_until(ctx, &mut sends, &mut recvs, deadline, true)?;
        let mut i = 0;
        while i < recvs.len() {
            if !recvs[i].is_done() {
                i += 1;
                continue;
            }
            let r = recvs.remove(i);
            let h = r.header().expect("done");
            let peer = r.peer();
            match h.kind {
                Kind::Ready => {
                    let (p, tag, id, data) = big_send.take().expect("a large send waits for Ready");
                    let hdr = Header {
                        count: data.len() as u64,
                        len: data.len() as u64,
                        seq: id,
                        ..Header::new(Kind::P2p, tag, 0)
                    };
                    sends.push(SendOp::new(p, hdr, data));
                }
                Kind::Nack => {
                    let (p, tag, _, data) = big_send.take().expect("a large send gets the Nack");
                    deferred.get_or_insert(size_err(
                        p,
                        tag,
                        format!(
                            "this rank sends {} bytes, rank {p} posted a {}-byte receive",
                            data.len(),
                            h.count
                        ),
                    ));
                }
                Kind::P2p | Kind::Rts => {
                    let buf = r.into_buf();
                    let mine = buf.len();
                    let answer = |kind| Header {
                        count: mine as u64,
                        seq: h.seq,
                        ..Header::new(kind, h.tag, 0)
                    };
                    if h.count as usize != mine {
                        sends.push(SendOp::new(peer, answer(Kind::Nack), &[]));
                        deferred.get_or_insert(size_err(
                            peer,
                            h.tag,
                            format!(
                                "rank {peer} sent {} bytes, this rank posted a {mine}-byte receive",
                                h.count
                            ),
                        ));
                    } else if h.kind == Kind::Rts {
                        sends.push(SendOp::new(peer, answer(Kind::Ready), &[]));
                        recvs.push(RecvOp::p2p_data(peer, h.tag, h.seq, buf));
                    }
                }
                _ => unreachable!("only p2p frames are awaited here"),
            }
        }
    }
    if let Some(e) = deferred {
        return Err(e);
    }
    earlier_nack(links)
}

/// A connection to one peer under one tag (connection-oriented point-to-point, as HCCL's
/// `CreateConnection`). Closing is announced to the peer.
pub struct Connection<'c> {
    comm: CommRef<'c>,
    peer: usize,
    tag: u32,
    open: bool,
    confirmed: std::cell::Cell<bool>,
}

/// How a connection holds its communicator: borrowed ([`Communicator::connect`]) or shared
/// ([`Communicator::connect_shared`], for owners such as language bindings).
enum CommRef<'c> {
    Borrowed(&'c Communicator),
    Shared(Arc<Communicator>),
}

impl std::ops::Deref for CommRef<'_> {
    type Target = Communicator;
    fn deref(&self) -> &Communicator {
        match self {
            CommRef::Borrowed(c) => c,
            CommRef::Shared(c) => c,
        }
    }
}

impl Connection<'_> {
    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The tag.
    pub fn tag(&self) -> u32 {
        self.tag
    }

    fn confirm(&self) -> Result<()> {
        if !self.confirmed.get() {
            self.comm
                .control_recv("connect", self.peer, Kind::Connect, self.tag)?;
            self.confirmed.set(true);
        }
        Ok(())
    }

    /// Send `buf` (see [`Communicator::send`]).
    pub fn send<T: Element>(&self, buf: &[T]) -> Result<()> {
        self.confirm()?;
        self.comm.send(self.peer, self.tag, buf)
    }

    /// Receive into `buf` (see [`Communicator::recv`]).
    pub fn recv<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.confirm()?;
        self.comm.recv(self.peer, self.tag, buf)
    }

    /// Close the connection (a local operation: nothing is sent; messages already sent on it
    /// can still be received through [`Communicator::recv`]).
    pub fn close(mut self) -> Result<()> {
        self.open = false;
        self.comm
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .open_conns
            .remove(&(self.peer, self.tag));
        Ok(())
    }
}

impl Drop for Connection<'_> {
    fn drop(&mut self) {
        if self.open {
            let mut i = self.comm.inner.lock().unwrap_or_else(|p| p.into_inner());
            i.open_conns.remove(&(self.peer, self.tag));
        }
    }
}
