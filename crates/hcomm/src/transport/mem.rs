//! An in-process transport: every rank of a world is a thread of one process, and a frame is
//! a copy handed to the receiver's mailbox. It carries collective frames only (what the
//! schedules of [`crate::algo`] send), and exists so that every schedule can be run for any
//! world size in one test process, against a reference, with no socket or segment involved.
//!
//! It keeps the contract's matching rules: frames from one peer are taken in the order sent,
//! and a receive accepts only a frame with its fingerprint, step and size (anything else is a
//! [`Error::Mismatch`] naming both calls, as over TCP). Sends never block (a mailbox has no
//! bound), so an exchange posts its sends first and then completes its receives one by one.

use super::ops::{unexpected, Expect, RecvOp, SendOp};
use super::Links;
use crate::base::error::{Error, OpContext, Result};
use crate::wire::frame::Header;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// One frame in flight.
struct Frame {
    hdr: Header,
    payload: Vec<u8>,
}

/// The frames waiting for one rank, one queue per sender.
struct Mailbox {
    from: Mutex<Vec<VecDeque<Frame>>>,
    arrived: Condvar,
}

/// The mailboxes of a world of `n` ranks; hand one [`MemLinks`] to each rank's thread.
pub struct MemFabric {
    boxes: Vec<Mailbox>,
}

impl MemFabric {
    /// A fabric for `n` ranks.
    pub fn new(n: usize) -> Arc<MemFabric> {
        Arc::new(MemFabric {
            boxes: (0..n)
                .map(|_| Mailbox {
                    from: Mutex::new((0..n).map(|_| VecDeque::new()).collect()),
                    arrived: Condvar::new(),
                })
                .collect(),
        })
    }

    /// The links of `rank`.
    pub fn links(self: &Arc<Self>, rank: usize) -> MemLinks {
        assert!(rank < self.boxes.len(), "rank {rank} out of range");
        MemLinks {
            rank,
            fabric: Arc::clone(self),
            frames_sent: 0,
            bytes_sent: 0,
        }
    }

    /// Frames sent but not received yet, over the whole world (0 after a clean run).
    pub fn frames_in_flight(&self) -> usize {
        self.boxes
            .iter()
            .map(|b| lock(&b.from).iter().map(VecDeque::len).sum::<usize>())
            .sum()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A rank that panicked mid-test poisons nothing that matters here: the queues stay valid.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One rank's end of a [`MemFabric`].
pub struct MemLinks {
    rank: usize,
    fabric: Arc<MemFabric>,
    frames_sent: u64,
    bytes_sent: u64,
}

impl MemLinks {
    /// Frames and payload bytes this rank has sent.
    pub fn sent(&self) -> (u64, u64) {
        (self.frames_sent, self.bytes_sent)
    }

    fn check_peer(&self, ctx: &OpContext, peer: usize) -> Result<()> {
        if peer >= self.fabric.boxes.len() || peer == self.rank {
            return Err(Error::invalid(
                ctx.op,
                ctx.seq,
                format!(
                    "rank {} addressed rank {peer} on a fabric of {} ranks",
                    self.rank,
                    self.fabric.boxes.len()
                ),
            ));
        }
        Ok(())
    }
}

impl Links for MemLinks {
    fn exchange(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
    ) -> Result<()> {
        let start = Instant::now();
        for s in sends.iter() {
            self.check_peer(ctx, s.peer)?;
            let mailbox = &self.fabric.boxes[s.peer];
            lock(&mailbox.from)[self.rank].push_back(Frame {
                hdr: s.hdr,
                payload: s.data.to_vec(),
            });
            mailbox.arrived.notify_all();
            self.frames_sent += 1;
            self.bytes_sent += s.data.len() as u64;
        }
        let mailbox = &self.fabric.boxes[self.rank];
        for i in 0..recvs.len() {
            let peer = recvs[i].peer;
            self.check_peer(ctx, peer)?;
            let Expect::Coll(fp) = recvs[i].expects() else {
                return Err(Error::invalid(
                    ctx.op,
                    ctx.seq,
                    "the in-memory transport carries collective frames only",
                ));
            };
            let mut queues = lock(&mailbox.from);
            let frame = loop {
                if let Some(f) = queues[peer].pop_front() {
                    break f;
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(Error::Timeout {
                        ctx: ctx.clone(),
                        peers: vec![peer],
                        after: deadline.saturating_duration_since(start),
                        detail: format!("step {} of {} bytes", fp.tag, recvs[i].sink.len()),
                    });
                }
                queues = mailbox
                    .arrived
                    .wait_timeout(queues, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            };
            drop(queues);
            let h = frame.hdr;
            if !(fp.same_fingerprint(&h)
                && h.tag == fp.tag
                && h.len as usize == frame.payload.len())
                || frame.payload.len() != recvs[i].sink.len()
            {
                return Err(unexpected(ctx, peer, &h, &recvs[i..]));
            }
            recvs[i].complete_whole(h, &frame.payload);
        }
        Ok(())
    }
}

/// An in-process [`super::Mesh`] for `n` ranks (threads), whose ranks can be made to die at a
/// chosen point: for the agreement's tests.
pub struct MemMeshFabric {
    state: Mutex<MeshState>,
    changed: Condvar,
}

struct MeshState {
    /// Messages waiting for each rank, in arrival order: (sender, bytes).
    queues: Vec<VecDeque<(usize, Vec<u8>)>>,
    dead: Vec<bool>,
    /// `told[r][p]`: rank `r` was told that `p` is gone.
    told: Vec<Vec<bool>>,
    /// `cut[r][p]`: nothing passes between `r` and `p` (a network partition).
    cut: Vec<Vec<bool>>,
}

impl MemMeshFabric {
    /// A mesh of `n` ranks, all alive.
    pub fn new(n: usize) -> Arc<MemMeshFabric> {
        Arc::new(MemMeshFabric {
            state: Mutex::new(MeshState {
                queues: (0..n).map(|_| VecDeque::new()).collect(),
                dead: vec![false; n],
                told: vec![vec![false; n]; n],
                cut: vec![vec![false; n]; n],
            }),
            changed: Condvar::new(),
        })
    }

    /// Rank `rank`'s end; it dies (as a killed process would: what it sent stays delivered)
    /// after `sends_before_death` successful sends, if given (0: dead from the start).
    pub fn mesh(self: &Arc<Self>, rank: usize, sends_before_death: Option<usize>) -> MemMesh {
        if sends_before_death == Some(0) {
            self.kill(rank);
        }
        MemMesh {
            rank,
            fabric: Arc::clone(self),
            sends_left: sends_before_death,
        }
    }

    /// True once `rank` died.
    pub fn is_dead(&self, rank: usize) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).dead[rank]
    }

    /// Cut the network between the ranks of `side` and the others: nothing passes either
    /// way, and each rank is told that those of the other side are unreachable (as a TCP
    /// mesh finds, with no sign that their processes exited).
    pub fn partition(&self, side: &[usize]) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let n = st.dead.len();
        for r in 0..n {
            for p in 0..n {
                if side.contains(&r) != side.contains(&p) {
                    st.cut[r][p] = true;
                }
            }
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Kill `rank` now.
    pub fn kill(&self, rank: usize) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).dead[rank] = true;
        self.changed.notify_all();
    }
}

/// One rank's end of a [`MemMeshFabric`].
pub struct MemMesh {
    rank: usize,
    fabric: Arc<MemMeshFabric>,
    sends_left: Option<usize>,
}

impl super::Mesh for MemMesh {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.fabric
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .dead
            .len()
    }

    fn send(&mut self, to: usize, bytes: &[u8]) -> bool {
        let mut st = self.fabric.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.dead[self.rank] {
            return true; // a dead rank's sends go nowhere; it is about to find out
        }
        if st.dead[to] || st.cut[self.rank][to] {
            return false;
        }
        st.queues[to].push_back((self.rank, bytes.to_vec()));
        if let Some(left) = self.sends_left.as_mut() {
            *left -= 1;
            if *left == 0 {
                st.dead[self.rank] = true;
            }
        }
        drop(st);
        self.fabric.changed.notify_all();
        true
    }

    fn next(&mut self, deadline: Instant) -> super::MeshEvent {
        let mut st = self.fabric.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if st.dead[self.rank] {
                return super::MeshEvent::Gone(self.rank);
            }
            if let Some((from, bytes)) = st.queues[self.rank].pop_front() {
                return super::MeshEvent::Message { from, bytes };
            }
            let me = self.rank;
            if let Some(p) = (0..st.dead.len()).find(|&p| st.dead[p] && !st.told[me][p]) {
                st.told[me][p] = true;
                return super::MeshEvent::Gone(p);
            }
            if let Some(p) = (0..st.dead.len()).find(|&p| st.cut[me][p] && !st.told[me][p]) {
                st.told[me][p] = true;
                return super::MeshEvent::Unreachable(p);
            }
            let now = Instant::now();
            if now >= deadline {
                return super::MeshEvent::Timeout;
            }
            st = self
                .fabric
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
