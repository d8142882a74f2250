//! Point-to-point operations that progress in the background: [`Communicator::send_async`]
//! and [`Communicator::recv_async`] post a message and return at once.
//!
//! Posted messages are carried by one *progress loop* per communicator, an engine job that
//! drives every posted send and receive at once (the same protocol as the blocking calls:
//! eager messages up to [`EAGER_MAX`] bytes, RTS / Ready / data above, size mismatches
//! reported to both ends). Messages posted while the loop runs join it at once, so no posting
//! order can deadlock: both ranks receiving first, both sending first (large messages
//! included), many messages outstanding per peer, all pairs at once.
//!
//! Ordering with the rest:
//! * The loop takes a turn like any operation (see `crate::engine`): an operation issued
//!   while messages are posted runs once every message posted before it has completed (and
//!   any posted meanwhile). A blocking `send` / `recv` / `send_recv` issued while the loop is
//!   queued or running joins it instead, so it cannot wait for the loop that waits for it.
//! * Messages between two ranks with one tag are matched in the order they were posted.
//!
//! Memory: nothing is copied; each posted buffer belongs to its operation until its [`Work`]
//! is done. What a peer sends before its receive is posted is what the blocking calls buffer:
//! eager messages only, at most [`MAX_UNEXPECTED_BYTES`](crate::transport::tcp::MAX_UNEXPECTED_BYTES)
//! per peer (large messages wait for the receive).

use super::{Communicator, Inner};
use crate::base::dtype::Element;
use crate::base::error::{Error, OpContext, Result};
use crate::engine::{Slot, Work};
use crate::lent::{hold_for_recv, hold_for_send, Held};
use crate::transport::tcp::{Interrupter, RecvOp, SendOp, TcpLinks, EAGER_MAX};
use crate::wire::frame::{Header, Kind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Messages posted and not yet taken by the progress loop, and whether a loop is queued or
/// running.
#[derive(Default)]
pub(crate) struct Posted {
    state: Mutex<PostedState>,
}

#[derive(Default)]
struct PostedState {
    new: Vec<Message>,
    /// A progress loop is queued or running: it will take what is posted.
    driving: bool,
    /// Wakes the running loop when something is posted.
    interrupter: Option<Interrupter>,
}

impl Posted {
    fn lock(&self) -> std::sync::MutexGuard<'_, PostedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True while a progress loop is queued or running.
    pub(crate) fn driving(&self) -> bool {
        self.lock().driving
    }

    /// Hand `m` to the progress loop: `true` when the caller must start one.
    fn push(&self, m: Message) -> bool {
        let mut st = self.lock();
        st.new.push(m);
        if let Some(i) = &st.interrupter {
            i.interrupt();
        }
        !std::mem::replace(&mut st.driving, true)
    }

    /// Hand `messages` to the progress loop if one is queued or running (all or none); else
    /// give them back.
    fn push_if_driving(&self, messages: Vec<Message>) -> std::result::Result<(), Vec<Message>> {
        let mut st = self.lock();
        if !st.driving {
            return Err(messages);
        }
        st.new.extend(messages);
        if let Some(i) = &st.interrupter {
            i.interrupt();
        }
        Ok(())
    }

    /// The messages posted since the last call; `None` (and the loop is over) when there are
    /// none and the loop has nothing left (`idle`).
    fn take(&self, idle: bool) -> Option<Vec<Message>> {
        let mut st = self.lock();
        if st.new.is_empty() && idle {
            st.driving = false;
            st.interrupter = None;
            return None;
        }
        Some(std::mem::take(&mut st.new))
    }

    fn set_interrupter(&self, i: Interrupter) {
        self.lock().interrupter = Some(i);
    }
}

/// One posted send or receive.
pub(crate) struct Message {
    op: &'static str,
    peer: usize,
    tag: u32,
    bytes: Bytes,
    deadline: Instant,
    /// Completes the operation's [`Work`] with the peer it exchanged with, giving its buffer
    /// back. Called once no operation of the loop borrows `bytes` any more.
    finish: Finish,
}

/// See [`Message::finish`].
type Finish = Box<dyn FnOnce(Result<usize>) + Send>;

/// The `peer` of a receive from any source (bound to a peer when a message for it arrives).
const ANY_SOURCE: usize = usize::MAX;

/// The bytes of a posted message: views of a [`Held`] buffer that its `finish` owns.
enum Bytes {
    Send(&'static [u8]),
    Recv(&'static mut [u8]),
}

/// What a frame of the loop is for (parallel to its `sends` / `recvs`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// An answer to a peer's RTS (Ready or Nack): nobody's completion.
    Answer,
    /// The RTS of the send with this key.
    Rts(u64),
    /// The data of the send with this key (eager or after Ready).
    Data(u64),
    /// The receiver's answer to the send with this key.
    Reply(u64),
    /// The first frame (eager data or RTS) for the receive with this key.
    First(u64),
    /// The rendezvous data for the receive with this key.
    RecvData(u64),
}

impl Role {
    fn key(self) -> Option<u64> {
        match self {
            Role::Answer => None,
            Role::Rts(k) | Role::Data(k) | Role::Reply(k) | Role::First(k) | Role::RecvData(k) => {
                Some(k)
            }
        }
    }
}

/// A message the loop is carrying.
struct Active {
    key: u64,
    ctx: OpContext,
    peer: usize,
    tag: u32,
    deadline: Instant,
    /// A large send's data, sent once the receiver is ready.
    pending_data: Option<&'static [u8]>,
    /// The message id of a send.
    id: u64,
    finish: Finish,
}

/// The progress loop's operations in flight.
#[derive(Default)]
struct Flight {
    active: Vec<Active>,
    sends: Vec<SendOp<'static>>,
    send_roles: Vec<Role>,
    recvs: Vec<RecvOp<'static>>,
    recv_roles: Vec<Role>,
    /// Receives from any source not bound to a peer yet, in posting order.
    wild: Vec<(u64, &'static mut [u8])>,
    /// Where the next binding starts looking (so no peer is always first).
    bind_from: usize,
    next_key: u64,
}

/// A flight dropped with messages still active is a progress loop that panicked (it ends
/// normally only once every message is finished): their operations fail rather than leave
/// their `Work`s waiting for ever.
impl Drop for Flight {
    fn drop(&mut self) {
        if self.active.is_empty() {
            return;
        }
        let e = Error::Panicked {
            op: "send/recv",
            msg: "the point-to-point progress loop stopped (a bug in hcomm)".into(),
        };
        self.fail_all(&e);
    }
}

fn size_err(ctx: &OpContext, peer: usize, tag: u32, msg: String) -> Error {
    Error::SizeMismatch {
        ctx: ctx.clone(),
        peer,
        tag,
        msg,
    }
}

/// A Nack `peer` sent about an earlier eager message, as the error of the next operation with
/// that peer (see [`crate::comm::p2p`]).
fn earlier_nack(links: &mut TcpLinks, ctx: &OpContext, peer: usize) -> Option<Error> {
    let n = links.take_nack(peer)?;
    Some(size_err(
        ctx,
        peer,
        n.tag,
        format!(
            "an earlier message with tag {} to rank {peer} did not match its {}-byte receive",
            n.tag, n.count
        ),
    ))
}

impl Flight {
    fn idle(&self) -> bool {
        self.active.is_empty() && self.sends.is_empty()
    }

    /// The earliest deadline of the messages (answers to a peer's RTS alone: `timeout`).
    fn deadline(&self, timeout: Duration) -> Instant {
        let answers = Instant::now() + timeout;
        self.active
            .iter()
            .map(|a| a.deadline)
            .min()
            .unwrap_or(answers)
    }

    /// Start carrying `m`.
    fn start(&mut self, links: &mut TcpLinks, ids: &mut [u64], seq: u64, m: Message) {
        let ctx = OpContext { op: m.op, seq };
        if let Some(e) = (m.peer != ANY_SOURCE)
            .then(|| earlier_nack(links, &ctx, m.peer))
            .flatten()
        {
            (m.finish)(Err(e));
            return;
        }
        self.next_key += 1;
        let key = self.next_key;
        let mut a = Active {
            key,
            ctx,
            peer: m.peer,
            tag: m.tag,
            deadline: m.deadline,
            pending_data: None,
            id: 0,
            finish: m.finish,
        };
        match m.bytes {
            Bytes::Send(data) => {
                ids[m.peer] += 1;
                a.id = ids[m.peer];
                let hdr = Header {
                    count: data.len() as u64,
                    seq: a.id,
                    ..Header::new(Kind::P2p, m.tag, 0)
                };
                if data.len() <= EAGER_MAX {
                    let hdr = Header {
                        len: data.len() as u64,
                        ..hdr
                    };
                    self.push_send(SendOp::new(m.peer, hdr, data), Role::Data(key));
                } else {
                    let rts = Header {
                        kind: Kind::Rts,
                        ..hdr
                    };
                    self.push_send(SendOp::new(m.peer, rts, &[]), Role::Rts(key));
                    self.push_recv(RecvOp::reply(m.peer, m.tag, a.id), Role::Reply(key));
                    a.pending_data = Some(data);
                }
            }
            Bytes::Recv(buf) if m.peer == ANY_SOURCE => self.wild.push((key, buf)),
            Bytes::Recv(buf) => {
                self.push_recv(RecvOp::p2p_first(m.peer, m.tag, buf), Role::First(key));
            }
        }
        self.active.push(a);
    }

    /// Bind each receive from any source, in posting order, to a peer whose message with its
    /// tag has arrived (and that no receive posted for that peer and tag waits for already).
    /// True while some are still unbound.
    fn bind_wildcards(&mut self, links: &TcpLinks) -> bool {
        let mut i = 0;
        while i < self.wild.len() {
            let key = self.wild[i].0;
            let tag = self.active(key).tag;
            let taken = |p: usize| {
                self.recvs.iter().zip(&self.recv_roles).any(|(r, role)| {
                    matches!(role, Role::First(_))
                        && r.peer() == p
                        && !r.is_done()
                        && self
                            .active
                            .iter()
                            .any(|a| Some(a.key) == role.key() && a.tag == tag)
                })
            };
            match links.first_message_from(tag, self.bind_from, taken) {
                Some(p) => {
                    self.bind_from = p + 1;
                    let (_, buf) = self.wild.remove(i);
                    self.active(key).peer = p;
                    self.push_recv(RecvOp::p2p_first(p, tag, buf), Role::First(key));
                }
                None => i += 1,
            }
        }
        !self.wild.is_empty()
    }

    fn push_send(&mut self, s: SendOp<'static>, role: Role) {
        self.sends.push(s);
        self.send_roles.push(role);
    }

    fn push_recv(&mut self, r: RecvOp<'static>, role: Role) {
        self.recvs.push(r);
        self.recv_roles.push(role);
    }

    fn active(&mut self, key: u64) -> &mut Active {
        self.active
            .iter_mut()
            .find(|a| a.key == key)
            .expect("every frame's message is active")
    }

    /// Complete the message `key` with `r`: its frames are dropped first (they borrow its
    /// bytes), then its `Work` is completed.
    fn complete(&mut self, links: &mut TcpLinks, key: u64, r: Result<()>) {
        self.drop_frames(key);
        let Some(pos) = self.active.iter().position(|a| a.key == key) else {
            return;
        };
        let a = self.active.remove(pos);
        let r = r.and_then(|()| earlier_nack(links, &a.ctx, a.peer).map_or(Ok(a.peer), Err));
        (a.finish)(r);
    }

    fn drop_frames(&mut self, key: u64) {
        for i in (0..self.sends.len()).rev() {
            if self.send_roles[i].key() == Some(key) {
                self.sends.remove(i);
                self.send_roles.remove(i);
            }
        }
        for i in (0..self.recvs.len()).rev() {
            if self.recv_roles[i].key() == Some(key) {
                self.recvs.remove(i);
                self.recv_roles.remove(i);
            }
        }
    }

    /// Fail every message with `e` (the links failed: nothing more can be carried).
    fn fail_all(&mut self, e: &Error) {
        self.sends.clear();
        self.send_roles.clear();
        self.recvs.clear();
        self.recv_roles.clear();
        self.wild.clear();
        for a in self.active.drain(..) {
            (a.finish)(Err(e.clone()));
        }
    }

    /// Act on the frames an exchange completed: answer RTSs, send data after Ready, complete
    /// messages.
    fn advance(&mut self, links: &mut TcpLinks) {
        let mut i = 0;
        while i < self.recvs.len() {
            if !self.recvs[i].is_done() {
                i += 1;
                continue;
            }
            let r = self.recvs.remove(i);
            let role = self.recv_roles.remove(i);
            let h = r.header().expect("done");
            let peer = r.peer();
            match (role, h.kind) {
                (Role::Reply(key), Kind::Ready) => {
                    let a = self.active(key);
                    let data = a.pending_data.take().expect("a large send waits for Ready");
                    let hdr = Header {
                        count: data.len() as u64,
                        len: data.len() as u64,
                        seq: a.id,
                        ..Header::new(Kind::P2p, a.tag, 0)
                    };
                    self.push_send(SendOp::new(peer, hdr, data), Role::Data(key));
                }
                (Role::Reply(key), _) => {
                    // Nack: the receiver posted another size.
                    let a = self.active(key);
                    let len = a.pending_data.map_or(0, <[u8]>::len);
                    let e = size_err(
                        &a.ctx,
                        peer,
                        a.tag,
                        format!(
                            "this rank sends {len} bytes, rank {peer} posted a {}-byte receive",
                            h.count
                        ),
                    );
                    self.complete(links, key, Err(e));
                }
                (Role::First(key), _) => {
                    let buf = r.into_buf();
                    let mine = buf.len();
                    let answer = |kind| Header {
                        count: mine as u64,
                        seq: h.seq,
                        ..Header::new(kind, h.tag, 0)
                    };
                    if h.count as usize != mine {
                        self.push_send(SendOp::new(peer, answer(Kind::Nack), &[]), Role::Answer);
                        let ctx = self.active(key).ctx.clone();
                        let e = size_err(
                            &ctx,
                            peer,
                            h.tag,
                            format!(
                                "rank {peer} sent {} bytes, this rank posted a {mine}-byte receive",
                                h.count
                            ),
                        );
                        self.complete(links, key, Err(e));
                    } else if h.kind == Kind::Rts {
                        self.push_send(SendOp::new(peer, answer(Kind::Ready), &[]), Role::Answer);
                        self.push_recv(
                            RecvOp::p2p_data(peer, h.tag, h.seq, buf),
                            Role::RecvData(key),
                        );
                    } else {
                        self.complete(links, key, Ok(()));
                    }
                }
                (Role::RecvData(key), _) => {
                    drop(r);
                    self.complete(links, key, Ok(()));
                }
                (Role::Answer | Role::Rts(_) | Role::Data(_), _) => {
                    unreachable!("receives have receive roles")
                }
            }
        }
        let mut i = 0;
        while i < self.sends.len() {
            if !self.sends[i].is_done() {
                i += 1;
                continue;
            }
            self.sends.remove(i);
            let role = self.send_roles.remove(i);
            if let Role::Data(key) = role {
                self.complete(links, key, Ok(()));
            }
        }
    }
}

impl Communicator {
    /// Send `buf` to `peer` with `tag` in the background: returns at once with a [`Work`]
    /// that gives the buffer back when the message is handed over (eager messages, up to
    /// 64 KiB: once written; larger ones: once the receiver posted its receive and the data
    /// went out). Any posting order of sends and receives completes (see
    /// [`crate::comm::posted`]); messages with one (peer, tag) match in posting order.
    pub fn send_async<T, S>(self: &Arc<Self>, peer: usize, tag: u32, buf: S) -> Work<S>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
    {
        // The view lives in the message, whose `finish` owns `held` (see `lent::Held`).
        let (view, held) = hold_for_send(buf);
        let (work, m) = self.message("send", peer, tag, Bytes::Send(view), held, |_, b| b);
        self.post(m);
        work
    }

    /// Receive into `buf` the message `peer` sends with `tag`, in the background: returns at
    /// once with a [`Work`] that gives the filled buffer back (see
    /// [`send_async`](Self::send_async)).
    pub fn recv_async<T, B>(self: &Arc<Self>, peer: usize, tag: u32, buf: B) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let (view, held) = hold_for_recv(buf);
        let (work, m) = self.message("recv", peer, tag, Bytes::Recv(view), held, |_, b| b);
        self.post(m);
        work
    }

    /// Receive into `buf` the first message with `tag` that arrives from any rank (MPI's
    /// `MPI_ANY_SOURCE`), in the background: the [`Work`] gives the sender's rank and the
    /// filled buffer. Receives posted for that rank and tag before it are served first.
    pub fn recv_any_async<T, B>(self: &Arc<Self>, tag: u32, buf: B) -> Work<(usize, B)>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let (view, held) = hold_for_recv(buf);
        let (work, m) = self.message(
            "recv_any",
            ANY_SOURCE,
            tag,
            Bytes::Recv(view),
            held,
            |p, b| (p, b),
        );
        self.post(m);
        work
    }

    /// Receive into `buf` the first message with `tag` from any rank; returns the sender's
    /// rank (see [`recv_any_async`](Self::recv_any_async)). The call carries the posted
    /// messages itself when no progress loop runs.
    pub fn recv_any<T: Element>(&self, tag: u32, buf: &mut [T]) -> Result<usize> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        crate::lent::scope(|lender| {
            let (view, held) = hold_for_recv(lender.lend(bytes));
            let (work, m) = self.message(
                "recv_any",
                ANY_SOURCE,
                tag,
                Bytes::Recv(view),
                held,
                |p, _| p,
            );
            if let Some(m) = m {
                if self.posted.push(m) {
                    // No loop runs: this call is it (in its turn, on this thread).
                    self.drive_posted();
                }
            }
            work.wait()
        })
    }

    /// A message for the progress loop and the [`Work`] it completes with
    /// `out(peer, buffer)`. A bad peer completes it at once (the message is then not posted).
    fn message<B: Send + 'static, R: Send + 'static>(
        &self,
        op: &'static str,
        peer: usize,
        tag: u32,
        bytes: Bytes,
        held: Held<B>,
        out: impl FnOnce(usize, B) -> R + Send + 'static,
    ) -> (Work<R>, Option<Message>) {
        let slot = Slot::new();
        let done = slot.clone();
        let finish: Finish = Box::new(move |r: Result<usize>| {
            done.complete(r.map(|peer| out(peer, held.into_inner())))
        });
        if peer != ANY_SOURCE {
            if let Err(e) = self.check_peer(op, peer) {
                finish(Err(e));
                return (Work::new(slot, op), None);
            }
        }
        let m = Message {
            op,
            peer,
            tag,
            bytes,
            deadline: Instant::now() + self.timeout(),
            finish,
        };
        (Work::new(slot, op), Some(m))
    }

    /// Hand `m` to the progress loop, starting one if none is queued or running.
    fn post(self: &Arc<Self>, m: Option<Message>) {
        if let Some(m) = m {
            if self.posted.push(m) {
                self.start_progress_loop();
            }
        }
    }

    /// Queue the progress loop (its turn comes after every operation issued before).
    fn start_progress_loop(self: &Arc<Self>) {
        let comm = self.clone();
        let job = Box::new(move || {
            // A panic (a bug) must not leave the engine thread dead and every posted message
            // and later call waiting: the communicator is poisoned, the messages the loop
            // carried failed (by `Flight`'s drop), and those posted since refused.
            let run = std::panic::AssertUnwindSafe(|| comm.drive_posted());
            if let Err(p) = std::panic::catch_unwind(run) {
                let e = Error::Panicked {
                    op: "send/recv",
                    msg: crate::engine::panic_message(&*p),
                };
                comm.fail_with(&e);
                while let Some(new) = comm.posted.take(true) {
                    for m in new {
                        (m.finish)(Err(e.clone()));
                    }
                }
            }
        });
        if let Err(e) = self.engine().submit(self.id(), job) {
            // No engine thread: nothing posted can be carried.
            while let Some(new) = self.posted.take(true) {
                for m in new {
                    (m.finish)(Err(e.clone()));
                }
            }
        }
    }

    /// Post a blocking call's message to the progress loop if one is queued or running (then
    /// the call must not wait for its turn: the loop holds it and may wait for this message),
    /// and wait for it. `None` when no loop runs: the caller goes the direct way.
    pub(super) fn join_progress_loop(
        &self,
        send: Option<(usize, u32, &[u8])>,
        recv: &mut Option<(usize, u32, &mut [u8])>,
    ) -> Option<Result<()>> {
        if !self.posted.driving() {
            return None;
        }
        let op = match (&send, &*recv) {
            (Some(_), Some(_)) => "send_recv",
            (Some(_), None) => "send",
            _ => "recv",
        };
        let deadline = Instant::now() + self.timeout();
        // A blocking send's bytes are copied (they are borrowed); a blocking receive lends its
        // buffer for as long as this call waits.
        crate::lent::scope(|lender| {
            let mut messages = Vec::new();
            let mut works = Vec::new();
            let message = |peer, tag, bytes, finish| Message {
                op,
                peer,
                tag,
                bytes,
                deadline,
                finish,
            };
            if let Some((peer, tag, data)) = send {
                let (view, held) = hold_for_send(data.to_vec());
                let bytes = Bytes::Send(view);
                let slot = Slot::new();
                let done = slot.clone();
                let finish: Finish = Box::new(move |r: Result<usize>| {
                    done.complete(r.map(|_| drop(held.into_inner())))
                });
                messages.push(message(peer, tag, bytes, finish));
                works.push(Work::new(slot, op));
            }
            if let Some((peer, tag, buf)) = recv.as_mut() {
                let (peer, tag) = (*peer, *tag);
                // The lent buffer is returned (dropped) when the message is finished, which
                // this scope waits for.
                let (view, held) = hold_for_recv(lender.lend(buf));
                let bytes = Bytes::Recv(view);
                let slot = Slot::new();
                let done = slot.clone();
                let finish: Finish = Box::new(move |r: Result<usize>| {
                    done.complete(r.map(|_| drop(held.into_inner())))
                });
                messages.push(message(peer, tag, bytes, finish));
                works.push(Work::new(slot, op));
            }
            if let Err(refused) = self.posted.push_if_driving(messages) {
                // The loop ended meanwhile: the caller goes the direct way.
                for m in refused {
                    (m.finish)(Ok(m.peer));
                }
                return None;
            }
            let mut out = Ok(());
            for w in works {
                let r = w.wait();
                if out.is_ok() {
                    out = r;
                }
            }
            Some(out)
        })
    }

    /// The progress loop (an engine job, in its turn): carry every posted message until none
    /// is left.
    fn drive_posted(&self) {
        let (mut inner, ctx) = match self.lock("send/recv") {
            Ok(x) => x,
            Err(e) => {
                while let Some(new) = self.posted.take(true) {
                    for m in new {
                        (m.finish)(Err(e.clone()));
                    }
                }
                return;
            }
        };
        self.posted.set_interrupter(inner.links.interrupter());
        let mut flight = Flight::default();
        let mut failed: Option<Error> = None;
        while let Some(new) = self.posted.take(flight.idle()) {
            for m in new {
                if let Some(e) = &failed {
                    // Posted after the loop failed (and had failed the messages it carried):
                    // refused as `lock` refuses a later operation (aborted, revoked or
                    // poisoned), not given the failure of messages it was never part of; only
                    // a failure that leaves the communicator usable is passed on as it is.
                    let ctx = OpContext {
                        op: m.op,
                        seq: inner.seq,
                    };
                    let refused = if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
                        match self.revocation.revoked_by() {
                            Some(by) => Error::Revoked { ctx, by },
                            None => Error::Aborted { ctx },
                        }
                    } else {
                        match &inner.poisoned {
                            Some(first) => Error::Poisoned {
                                ctx,
                                first: first.clone(),
                            },
                            None => e.clone(),
                        }
                    };
                    (m.finish)(Err(refused));
                    continue;
                }
                let state: &mut Inner = &mut inner;
                let Inner {
                    links,
                    p2p_ids,
                    seq,
                    ..
                } = state;
                flight.start(links, p2p_ids, *seq, m);
            }
            if flight.idle() {
                continue;
            }
            let waiting_for_any = flight.bind_wildcards(&inner.links);
            inner.links.set_wake_on_stash(waiting_for_any);
            let deadline = flight.deadline(self.timeout());
            inner.links.set_op_timeout(self.timeout());
            let r = inner.links.exchange_until(
                &ctx,
                &mut flight.sends,
                &mut flight.recvs,
                deadline,
                true,
            );
            inner.links.set_wake_on_stash(false);
            match r {
                Ok(()) => flight.advance(&mut inner.links),
                Err(e) => {
                    let e = Self::finish(&mut inner, false, Err::<(), _>(e))
                        .expect_err("an error stays one");
                    flight.fail_all(&e);
                    failed = Some(e);
                }
            }
        }
        if failed.is_none() {
            let _ = Self::finish(&mut inner, false, Ok(()));
        }
    }
}
