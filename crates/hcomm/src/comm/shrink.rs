//! Surviving a lost rank: [`Communicator::revoke`], [`Communicator::shrink`] and
//! [`Communicator::shrink_excluding`] (semantics beside NCCL's and ULFM's in
//! `docs/fault-tolerance.md`).
//!
//! A shrink revokes the communicator, agrees with the other survivors on which ranks are gone
//! ([`crate::algo::agree`], over the recovery connections of `transport::tcp::recovery`, so it
//! needs neither the old links nor the rendezvous store, which rank 0 may have taken with it),
//! and builds the survivors' communicator through a store the agreement's coordinator hosts
//! (every survivor starts one, in case it is the coordinator; the others drop theirs). The
//! new communicator goes through the same [`Communicator::build`] as every other, so its
//! links, shared-memory segments, hierarchical layout and algorithm choices are made for the
//! new membership; it inherits the parent's job token, settings and forced algorithms.
//!
//! It may use the communicator's state, the agreement, the bootstrap store and
//! [`super::build`].

use super::build::BuildArgs;
use super::Communicator;
use crate::algo::agree::{AgreeError, Agreement};
use crate::base::error::{Error, OpContext, Result};
use crate::bootstrap::store::{StoreClient, StoreServer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a survivor tries to reach the coordinator's store before it takes the coordinator
/// for gone (the store was up before the coordinator decided, so a refusal means it died).
const COORDINATOR_STORE_WITHIN: Duration = Duration::from_secs(2);

impl Communicator {
    /// Revoke this communicator: every operation in flight on it or started later, on every
    /// rank, fails with [`Error::Revoked`] naming this rank, promptly (not at a deadline),
    /// including ranks blocked in shared-memory waits and socket reads and ranks with no
    /// operation in flight (their next one fails). Safe to call from any thread, any number of
    /// times. What to do next: [`shrink`](Self::shrink), on every rank that is left.
    pub fn revoke(&self) {
        self.revocation.revoke(self.rank);
        // Internal sub-communicators (hierarchical all-reduce) stop too; the parent's
        // operation that used them fails as revoked.
        if let Ok(guard) = self.hierarchy.try_lock() {
            if let Some(h) = guard.as_ref() {
                h.within.abort();
                h.across.abort();
            }
        }
        // One short connection to every peer: its acceptor marks the communicator revoked and
        // wakes it, whatever it is doing.
        let by = self.revocation.revoked_by().unwrap_or(self.rank);
        self.notifier.notify_all(by, self.timeout());
    }

    /// True once this communicator was revoked (by this rank or, as far as this rank has
    /// heard, by another).
    pub fn is_revoked(&self) -> bool {
        self.revocation.revoked_by().is_some()
    }

    /// After a failure: the communicator of the ranks that are left, ranks renumbered in order.
    /// Collective over the survivors (every rank that is alive calls it, or is dropped after
    /// the timeout); revokes this communicator first, so ranks still inside an operation on it
    /// join in. See [`shrink_excluding`](Self::shrink_excluding).
    pub fn shrink(&self) -> Result<Communicator> {
        self.shrink_excluding(&[])
    }

    /// [`shrink`](Self::shrink), also dropping `exclude` (ranks alive but unwanted, or stopped
    /// ones: a rank that does not answer is dropped only after the whole timeout).
    ///
    /// What it guarantees: every survivor that returns `Ok` returns a communicator of the same
    /// members, which excludes every rank known to be gone when the agreement ended; the ranks
    /// keep their order. It fails (every survivor with an error, never a hang past a few
    /// timeouts) when this rank is among the dropped, when the agreement's coordinator stays
    /// alive but silent, when the ranks that reach each other are not a majority of those
    /// not known to have exited (a network partition: the other side may be going on;
    /// [`Error::Timeout`] naming the unreachable ranks; see docs/fault-tolerance.md), or when the new communicator cannot be built after as many tries as
    /// there are ranks. The old communicator stays revoked: keep it until the new one is built
    /// on every rank (dropping it closes the connections the agreement runs over), then drop
    /// it.
    pub fn shrink_excluding(&self, exclude: &[usize]) -> Result<Communicator> {
        let ctx = OpContext {
            op: "shrink",
            seq: self.peek_seq(),
        };
        if let Some(&r) = exclude.iter().find(|&&r| r >= self.size) {
            return Err(Error::invalid(
                "shrink",
                ctx.seq,
                format!(
                    "rank {r} is out of range for a communicator of {} ranks",
                    self.size
                ),
            ));
        }
        if exclude.contains(&self.rank) {
            return Err(Error::invalid(
                "shrink",
                ctx.seq,
                format!("this rank ({}) is in the ranks to exclude", self.rank),
            ));
        }
        let start = Instant::now();
        self.revoke();
        let timeout = self.timeout();
        let mut agreement = Agreement::new(exclude.iter().copied());
        let mut last_error = None;
        for attempt in 0..self.size.max(1) {
            // Our store, in case this rank coordinates (its address is our proposal's payload).
            let server = StoreServer::start(SocketAddr::new(self.listen_ip, 0), self.token.clone())
                .map_err(|e| {
                    Error::io(
                        ctx.clone(),
                        None,
                        format!("shrink: cannot start a store: {e}"),
                    )
                })?;
            let payload = server.addr().to_string();
            let decision = {
                let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                let mut mesh = inner.links.mesh();
                agreement.run(&mut mesh, payload.as_bytes(), timeout)
            };
            let decision = decision.map_err(|e| agree_error(&ctx, e, timeout))?;
            let survivors = decision.survivors(self.size);
            let rank = survivors
                .iter()
                .position(|&r| r == self.rank)
                .expect("a survivor");
            let coordinator = decision.coordinator;
            let store_addr = String::from_utf8_lossy(&decision.payload).into_owned();
            tracing::info!(
                attempt,
                ?survivors,
                coordinator,
                "shrink: agreed in {:?}; building the survivors' communicator",
                start.elapsed()
            );
            let (store_addr, server) = if coordinator == self.rank {
                (payload, Some(Arc::new(server)))
            } else {
                drop(server);
                (store_addr, None)
            };
            let within = COORDINATOR_STORE_WITHIN.min(timeout);
            let store = match StoreClient::connect(&store_addr, within, self.token.as_ref()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(
                        coordinator,
                        "shrink: the coordinator's store at {store_addr} is unreachable ({e}); \
                         taking rank {coordinator} for gone and agreeing again"
                    );
                    agreement.add_dead(coordinator);
                    last_error = Some(Error::PeerClosed {
                        ctx: ctx.clone(),
                        peer: coordinator,
                        detail: format!("the shrink's coordinator store at {store_addr}: {e}"),
                    });
                    continue;
                }
            };
            if self.tuning.die_in_shrink_setup {
                tracing::warn!("HCOMM_FAULT_INJECT=die-in-shrink-setup: killing this process");
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::this(),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let list: Vec<String> = survivors.iter().map(|r| r.to_string()).collect();
            let tuning = self.inherited_tuning();
            let built = Self::build(BuildArgs {
                // The same on every rank that has this decision, and no other's: the
                // coordinator's store is new for each decision it makes.
                comm_id: format!("{}/shrink[{}]@{store_addr}", self.comm_id, list.join(",")),
                rank,
                size: survivors.len(),
                store,
                store_addr,
                server,
                ip: self.listen_ip,
                listener: None,
                host_id: self.host_id.clone(),
                timeout,
                local_size_hint: None,
                tuning,
                transport: self.transport,
                token: self.token.clone(),
                nsocks: self.nsocks,
                tracer: self.tracer(),
            });
            match built {
                Ok(mut c) => {
                    c.thresholds = self.thresholds;
                    tracing::info!(
                        old_rank = self.rank,
                        rank,
                        size = survivors.len(),
                        "shrink: done in {:?} (dropped {:?})",
                        start.elapsed(),
                        decision.dead
                    );
                    return Ok(c);
                }
                Err(e) => {
                    // A member died while it was being built: agree again (the recovery
                    // connections report it gone).
                    tracing::warn!(
                        "shrink: building the survivors' communicator failed: {e}; agreeing again"
                    );
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or_else(|| Error::invalid("shrink", ctx.seq, "no attempt")))
    }
}

fn agree_error(ctx: &OpContext, e: AgreeError, timeout: Duration) -> Error {
    match e {
        AgreeError::CoordinatorSilent { coordinator, after } => Error::Timeout {
            ctx: ctx.clone(),
            peers: vec![coordinator],
            after,
            detail: format!("shrink: {e}"),
        },
        AgreeError::Minority {
            ref unreachable, ..
        } => Error::Timeout {
            ctx: ctx.clone(),
            peers: unreachable.clone(),
            after: timeout,
            detail: format!("shrink: {e}"),
        },
        AgreeError::Excluded { by } => Error::Remote {
            ctx: ctx.clone(),
            peer: by.unwrap_or(usize::MAX),
            culprit: None,
            msg: format!("shrink: {e}"),
        },
    }
}
