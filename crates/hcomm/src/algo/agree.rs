//! Fault-tolerant agreement on which ranks are gone: what [`crate::Communicator::shrink`]
//! runs among the survivors before it builds their communicator.
//!
//! It runs over a [`Mesh`] (messages between any two ranks that outlive the communicator's
//! links) and assumes crash failures: a rank is declared gone only when the mesh says so
//! ([`MeshEvent::Gone`]: its process exited, so its connections were refused or closed;
//! [`MeshEvent::Unreachable`]: it cannot be reached at all) or, by the coordinator only, when
//! it stays silent for the whole timeout. No rank in particular needs to be alive: the
//! coordinator is the lowest rank not known to be gone, and its place passes on when it dies.
//!
//! A rank that is unreachable or silent may be alive across a network partition, running
//! this agreement with the ranks it can reach. So the coordinator decides only when the
//! survivors are more than half of the ranks not known to have exited, or exactly half
//! including the lowest of them; otherwise it tells the survivors `Minority` and nobody on
//! that side decides. Each side counts the same ranks, so at most one side goes on.
//!
//! The protocol (a rotating coordinator over the union of what everyone knows):
//!
//! * Every rank keeps `dead`, the ranks it knows are gone (it only grows: every message
//!   received merges the sender's set in).
//! * A rank that is not the coordinator sends `Propose(dead)` to the coordinator, again
//!   whenever its coordinator or its set changes, and waits for `Decide`. When the coordinator
//!   is gone it moves on to the next one. When the coordinator stays silent for the whole
//!   timeout (alive but stopped) it gives up with [`AgreeError::CoordinatorSilent`] rather
//!   than guess: guessing is how two groups would form.
//! * The coordinator waits for a proposal from every rank not in `dead` (a rank that stays
//!   silent for the whole timeout is added to `dead`), then sends `Decide(dead, payload)` to
//!   each of them and returns it. A rank takes a `Decide` from the rank it holds to be the
//!   coordinator (after merging the decision's set into its own).
//!
//! What it guarantees: every rank that returns a decision returns the same one unless a
//! coordinator died part-way through sending its `Decide` (some ranks have it, the others move
//! on to the next coordinator). The decision names the coordinator, whose payload is the
//! address of the store the new communicator is built through, so the ranks that have the dead
//! coordinator's decision find out at once (its store refuses them), add it to `dead` and run
//! [`Agreement::run`] again, which the others, waiting on the next coordinator, are part of
//! already: they all end with the same second decision. A decision may name a rank that died
//! after it proposed; building the new communicator then fails, and the caller runs again
//! with that rank added. State carries over between runs of one [`Agreement`] (proposals
//! received, what was sent), so a retry never waits for a message that was sent already.

use crate::transport::{Mesh, MeshEvent};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const PROPOSE: u8 = 1;
const DECIDE: u8 = 2;
/// The coordinator's verdict that the ranks it can reach are not a majority: nobody decides.
const MINORITY: u8 = 3;

/// The outcome every surviving rank agrees on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The ranks that are gone (or were dropped on purpose).
    pub dead: BTreeSet<usize>,
    /// The rank that decided (the lowest survivor).
    pub coordinator: usize,
    /// The coordinator's payload (the address of its store).
    pub payload: Vec<u8>,
}

impl Decision {
    /// The ranks that are left, in order (their new ranks are their positions).
    pub fn survivors(&self, size: usize) -> Vec<usize> {
        (0..size).filter(|r| !self.dead.contains(r)).collect()
    }
}

/// Why an agreement ended without a decision.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AgreeError {
    /// This rank is among the ranks dropped (named by another rank, or silent for too long).
    #[error("this rank was dropped from the communicator by the others{}", by.map_or(String::new(), |r| format!(" (rank {r} decided)")))]
    Excluded {
        /// The rank that decided, when known.
        by: Option<usize>,
    },
    /// The ranks that can reach each other are not a majority of the ranks that may still
    /// be alive: the others may be going on without them (a network partition), so these
    /// stop rather than form a second communicator.
    #[error("only ranks {reachable:?} can reach each other; ranks {unreachable:?} cannot be reached but are not known to have exited (a network partition, a dead host or stopped processes), and may be going on without these: fewer than half of the {alive} ranks that may be alive, or half without the lowest of them, do not go on")]
    Minority {
        /// The ranks that could reach each other.
        reachable: Vec<usize>,
        /// The ranks dropped for being unreachable or silent, not known to have exited.
        unreachable: Vec<usize>,
        /// How many ranks may be alive (all but those known to have exited).
        alive: usize,
    },
    /// The coordinator is alive (its connections stay open) but did not decide in time.
    #[error("rank {coordinator} (the agreement's coordinator) stayed silent for {after:?}; it may be stopped: drop it explicitly")]
    CoordinatorSilent {
        /// The silent coordinator.
        coordinator: usize,
        /// How long this rank waited.
        after: Duration,
    },
}

/// One rank's side of the agreement (kept between runs of a shrink that must retry).
#[derive(Debug)]
pub struct Agreement {
    dead: BTreeSet<usize>,
    /// The ranks of `dead` known to have exited; the others were unreachable, silent or
    /// dropped on purpose, and may be alive on the other side of a partition.
    exited: BTreeSet<usize>,
    /// Ranks whose proposal this rank holds (valid until a decision is sent).
    proposed: BTreeSet<usize>,
    /// (coordinator, size of `dead`) of the last proposal sent.
    sent: Option<(usize, usize)>,
}

impl Agreement {
    /// Start with the ranks this rank knows are gone (or wants dropped).
    pub fn new(known_dead: impl IntoIterator<Item = usize>) -> Agreement {
        // Ranks dropped on purpose are not taken for exited: both sides of a partition may
        // name the other (torch's `shrink_group` always names someone), and only the mesh's
        // `Gone` proves an exit.
        Agreement {
            exited: BTreeSet::new(),
            dead: known_dead.into_iter().collect(),
            proposed: BTreeSet::new(),
            sent: None,
        }
    }

    /// Add a rank found gone since (the coordinator of a decision whose store refused us;
    /// whether it exited, the mesh tells).
    pub fn add_dead(&mut self, rank: usize) {
        self.dead.insert(rank);
    }

    /// Take in a mesh event about a rank: gone (exited) or unreachable.
    fn lost(&mut self, rank: usize, exited: bool) {
        self.dead.insert(rank);
        if exited {
            self.exited.insert(rank);
        }
    }

    /// The ranks that may be alive (all but those known to have exited) and the survivors:
    /// `Some(error)` unless the survivors are more than half of them, or exactly half with
    /// the lowest of them. Both sides of a partition find the same two sets, so at most one
    /// goes on; a killed rank's closed connections mark it exited, so deaths alone never
    /// stop the survivors.
    fn minority(&self, n: usize) -> Option<AgreeError> {
        let alive: Vec<usize> = (0..n).filter(|r| !self.exited.contains(r)).collect();
        let survivors = (0..n).filter(|r| !self.dead.contains(r)).count();
        let half_with_lowest =
            2 * survivors == alive.len() && alive.first().is_some_and(|r| !self.dead.contains(r));
        if 2 * survivors > alive.len() || half_with_lowest {
            return None;
        }
        Some(AgreeError::Minority {
            reachable: (0..n).filter(|r| !self.dead.contains(r)).collect(),
            unreachable: self.dead.difference(&self.exited).copied().collect(),
            alive: alive.len(),
        })
    }

    /// The ranks known to be gone now.
    pub fn dead(&self) -> &BTreeSet<usize> {
        &self.dead
    }

    /// Run until a decision (see the module doc). `payload` is sent with the decision when
    /// this rank is the one that decides; `timeout` bounds each wait for one coordinator and
    /// the coordinator's wait for the proposals.
    pub fn run(
        &mut self,
        mesh: &mut impl Mesh,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Decision, AgreeError> {
        let (me, n) = (mesh.rank(), mesh.size());
        // Whom we wait for, and since when.
        let mut waiting_on: Option<(usize, Instant)> = None;
        loop {
            if self.dead.contains(&me) {
                return Err(AgreeError::Excluded { by: None });
            }
            let coordinator = (0..n)
                .find(|r| !self.dead.contains(r))
                .expect("this rank is alive");
            let since = match waiting_on {
                Some((c, t)) if c == coordinator => t,
                _ => {
                    let t = Instant::now();
                    waiting_on = Some((coordinator, t));
                    t
                }
            };
            let deadline = since + timeout;
            if coordinator == me {
                let missing: Vec<usize> = (0..n)
                    .filter(|&r| r != me && !self.dead.contains(&r) && !self.proposed.contains(&r))
                    .collect();
                if missing.is_empty() {
                    // Take in what has arrived meanwhile (a last departure) before deciding.
                    if self.drain(mesh) {
                        continue;
                    }
                    if let Some(e) = self.minority(n) {
                        // Tell the survivors why nobody decides (they would wait for the
                        // whole timeout otherwise).
                        let msg = encode(MINORITY, n, &self.dead, &self.exited, &[]);
                        for r in (0..n).filter(|&r| r != me && !self.dead.contains(&r)) {
                            let _ = mesh.send(r, &msg);
                        }
                        tracing::warn!("agreement: {e}");
                        return Err(e);
                    }
                    let msg = encode(DECIDE, n, &self.dead, &self.exited, payload);
                    for r in (0..n).filter(|&r| r != me) {
                        // A survivor that is gone by now cannot take it; the new
                        // communicator's setup finds that out (see the module doc). The
                        // dropped ranks get it too, best effort: one that is alive (dropped
                        // on purpose, or for silence) learns that it is out.
                        let _ = mesh.send(r, &msg);
                    }
                    self.proposed.clear();
                    self.sent = None;
                    return Ok(Decision {
                        dead: self.dead.clone(),
                        coordinator: me,
                        payload: payload.to_vec(),
                    });
                }
                if Instant::now() >= deadline {
                    tracing::warn!(
                        ?missing,
                        "agreement: no proposal from rank(s) {missing:?} within {timeout:?}; dropping them"
                    );
                    self.dead.extend(missing);
                    continue;
                }
            } else {
                if self.sent != Some((coordinator, self.dead.len())) {
                    let msg = encode(PROPOSE, n, &self.dead, &self.exited, &[]);
                    if !mesh.send(coordinator, &msg) {
                        self.dead.insert(coordinator);
                        continue;
                    }
                    self.sent = Some((coordinator, self.dead.len()));
                }
                if Instant::now() >= deadline {
                    return Err(AgreeError::CoordinatorSilent {
                        coordinator,
                        after: timeout,
                    });
                }
            }
            match mesh.next(deadline) {
                MeshEvent::Timeout => {}
                MeshEvent::Gone(r) => self.lost(r, true),
                MeshEvent::Unreachable(r) => self.lost(r, false),
                MeshEvent::Message { from, bytes } => {
                    if let Some(d) = self.take(me, n, coordinator, from, &bytes)? {
                        return Ok(d);
                    }
                }
            }
        }
    }

    /// Handle everything the mesh has now; true if `dead` grew.
    fn drain(&mut self, mesh: &mut impl Mesh) -> bool {
        let before = self.dead.len();
        loop {
            match mesh.next(Instant::now()) {
                MeshEvent::Timeout => break,
                MeshEvent::Gone(r) => self.lost(r, true),
                MeshEvent::Unreachable(r) => self.lost(r, false),
                MeshEvent::Message { from, bytes } => {
                    // Only proposals can reach the coordinator; a decision from a lower rank
                    // would mean this rank is not the coordinator after all: handled next turn.
                    if let Some((PROPOSE, dead, exited, _)) = decode(mesh.size(), &bytes) {
                        if !self.dead.contains(&from) {
                            self.dead.extend(dead);
                            self.exited.extend(exited);
                            self.proposed.insert(from);
                        }
                    }
                }
            }
        }
        self.dead.len() != before
    }

    /// Handle one message; a decision this rank accepts ends the run.
    fn take(
        &mut self,
        me: usize,
        n: usize,
        coordinator: usize,
        from: usize,
        bytes: &[u8],
    ) -> Result<Option<Decision>, AgreeError> {
        let Some((kind, dead, exited, payload)) = decode(n, bytes) else {
            tracing::warn!(from, "agreement: malformed message ignored");
            return Ok(None);
        };
        if self.dead.contains(&from) {
            // A rank this one holds gone (dropped for silence): its word no longer counts.
            return Ok(None);
        }
        match kind {
            PROPOSE => {
                self.dead.extend(dead);
                self.exited.extend(exited);
                self.proposed.insert(from);
                Ok(None)
            }
            DECIDE | MINORITY => {
                if dead.contains(&me) {
                    return Err(AgreeError::Excluded { by: Some(from) });
                }
                let mut merged = self.dead.clone();
                merged.extend(dead.iter().copied());
                let theirs = (0..n).find(|r| !merged.contains(r));
                if from != coordinator && theirs != Some(from) {
                    // Not from whom this rank (even knowing what the sender knows) holds to be
                    // the coordinator: cannot be (crash failures), so ignore it.
                    return Ok(None);
                }
                if kind == MINORITY {
                    let verdict = Agreement {
                        dead,
                        exited,
                        proposed: BTreeSet::new(),
                        sent: None,
                    };
                    return Err(verdict.minority(n).unwrap_or(AgreeError::Minority {
                        reachable: Vec::new(),
                        unreachable: Vec::new(),
                        alive: n,
                    }));
                }
                self.exited.extend(exited);
                self.dead = dead.clone();
                self.proposed.clear();
                self.sent = None;
                Ok(Some(Decision {
                    dead,
                    coordinator: from,
                    payload,
                }))
            }
            _ => Ok(None),
        }
    }
}

/// A message: `[kind u8][n u32]`, then the dead and the exited ranks, each
/// `[count u32][rank u32; count]`, then the payload.
fn encode(
    kind: u8,
    n: usize,
    dead: &BTreeSet<usize>,
    exited: &BTreeSet<usize>,
    payload: &[u8],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(13 + 4 * (dead.len() + exited.len()) + payload.len());
    m.push(kind);
    m.extend_from_slice(&(n as u32).to_le_bytes());
    for set in [dead, exited] {
        m.extend_from_slice(&(set.len() as u32).to_le_bytes());
        for &r in set {
            m.extend_from_slice(&(r as u32).to_le_bytes());
        }
    }
    m.extend_from_slice(payload);
    m
}

/// A decoded message: kind, dead ranks, exited ranks, payload.
type Decoded = (u8, BTreeSet<usize>, BTreeSet<usize>, Vec<u8>);

/// The inverse of [`encode`]; `None` for anything malformed (or of another world size).
fn decode(n: usize, m: &[u8]) -> Option<Decoded> {
    let word = |i: usize| -> Option<usize> {
        m.get(i..i + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
    };
    let kind = *m.first()?;
    if word(1)? != n {
        return None;
    }
    let mut at = 5;
    let mut set = || -> Option<BTreeSet<usize>> {
        let count = word(at)?;
        if count > n {
            return None;
        }
        let mut ranks = BTreeSet::new();
        for i in 0..count {
            let r = word(at + 4 + 4 * i)?;
            if r >= n {
                return None;
            }
            ranks.insert(r);
        }
        at += 4 + 4 * count;
        Some(ranks)
    };
    let dead = set()?;
    let exited = set()?;
    Some((kind, dead, exited, m.get(at..)?.to_vec()))
}

#[cfg(test)]
#[path = "agree_tests.rs"]
mod agree_tests;
