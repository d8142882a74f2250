//! The communicator: a group of ranks, their links, and the collectives and point-to-point
//! operations over them.
//!
//! This file holds the [`Communicator`] itself and the plumbing every operation shares: its
//! state (`Inner`, taken for one operation as an `OpGuard`), a collective call (`Call`),
//! the accessors, `lock`/`finish` (turns, abort, poisoning, history, traffic),
//! `collective()` and the algorithm choice (`select`/`choose`, `set_algorithm`), abort, and the
//! traffic and history accessors. It may use every layer below the communicator (algorithms,
//! transports, shared memory, bootstrap, config, wire, engine).
//!
//! The rest of `impl Communicator` is split by concern, each child module using this one's
//! private state:
//!
//! * `build`: construction (`from_env`, `from_rank_table`, `from_config`, `build`);
//! * `join`: the rendezvous-store steps of joining (skipping a stale store, "every rank is
//!   built") and the hierarchical layout of the ranks over hosts;
//! * `shm_setup`: sharing the shared-memory segments of a host at construction;
//! * `p2p`: point-to-point (send/recv, signals, connections) and its protocol;
//! * `groups`: sub-communicators (`split`, `new_group`);
//! * `collectives`, `asynchronous`, `window`, `traffic`: the collectives, their asynchronous
//!   forms, shared windows, and the byte counters.

mod asynchronous;
mod build;
mod collectives;
mod groups;
mod grow;
mod host_memory;
mod join;
mod p2p;
pub mod posted;
mod shm_setup;
mod shrink;
pub mod traffic;
pub(crate) mod window;

pub use p2p::Connection;

use crate::algo::select::{select, Thresholds, Topology};
use crate::algo::Run;
use crate::auth::{ConnectionStats, JobToken};
use crate::base::deadline::Deadline;
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::{Error, OpContext, Result};
use crate::bootstrap::store::{StoreClient, StoreServer};
use crate::config::{TransportKind, Tuning};
use crate::transport::tcp::TcpLinks;
use crate::wire::collective::Algo;
pub use crate::wire::collective::Collective;
use crate::wire::frame::Header;
use join::store_connect_error;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::comm::traffic::{current_label, Counters, OpTraffic, TrafficTable};
use crate::engine::{Engine, TurnGuard};
use crate::history::{History, OpRecord};
use crate::trace::{Span, Tracer, Track, Wire};
use std::time::{Duration, Instant};

/// One collective call as the communicator runs it: the algorithms' [`Run`] over the links,
/// and the host's shared-memory group for the shared-memory algorithm.
pub(crate) struct Call<'a> {
    /// What the schedules of [`crate::algo`] run on.
    pub run: Run<'a>,
    /// The shared-memory group, when every rank shares this host.
    pub shm: Option<&'a mut crate::shm::ShmGroup>,
    /// Extra fingerprint (e.g. a hash of per-rank counts) that must agree on every rank.
    pub fp_extra: u64,
    /// The canonical schedules (deterministic mode, or f16/bf16 accumulated in f32), read in
    /// this call's turn.
    pub canonical: bool,
    /// What the trace names as the algorithm when the body ran another schedule than the
    /// chosen one (the zero-skipping exchange).
    pub ran: Option<&'static str>,
    /// The all-gathers this communicator keeps ([`crate::algo::gather_cache`]).
    pub gather_cache: &'a mut crate::algo::gather_cache::GatherCache,
}

impl<'a> std::ops::Deref for Call<'a> {
    type Target = Run<'a>;
    fn deref(&self) -> &Run<'a> {
        &self.run
    }
}

impl<'a> std::ops::DerefMut for Call<'a> {
    fn deref_mut(&mut self) -> &mut Run<'a> {
        &mut self.run
    }
}

/// Mixed into a shared-memory call's fingerprint when it runs the canonical (widening) fold.
const WIDENED_FOLD: u64 = 0x5744_454e_4544_u64;

impl Call<'_> {
    /// The shared-memory group, the waiting context for its calls and the call's fingerprint.
    pub fn shm_parts(
        &mut self,
    ) -> (
        &mut crate::shm::ShmGroup,
        crate::shm::WaitCtx<'_>,
        crate::wire::collective::ShmFingerprint,
    ) {
        // Every rank folds in rank order on shared memory either way, but only the canonical
        // fold widens f16/bf16: ranks that disagree must fail as a mismatch, not round apart.
        let widened = if self.canonical { WIDENED_FOLD } else { 0 };
        let fp = crate::wire::collective::ShmFingerprint::of(&self.run.fp, self.fp_extra ^ widened);
        let group = self.shm.as_deref_mut().expect("shared memory group");
        group.set_canonical(self.canonical);
        let w = crate::shm::WaitCtx {
            ctx: &self.run.ctx,
            deadline: self.run.deadline,
        };
        (group, w, fp)
    }
}

pub(crate) struct Inner {
    links: TcpLinks,
    seq: u64,
    poisoned: Option<String>,
    /// The algorithm forced per collective (indexed by its code; `Auto` where none is): an
    /// array, not a map, since every collective call reads it.
    algo: [Algo; 16],
    /// Which (collective, algorithm) choices were logged at info level already (bit per algorithm).
    logged: [u16; 16],
    splits: u64,
    /// Grows started on this communicator (part of the grown communicators' names).
    grows: u64,
    groups: HashMap<Vec<usize>, u64>,
    open_conns: HashSet<(usize, u32)>,
    /// Id of the last point-to-point message sent to each peer.
    p2p_ids: Vec<u64>,
    /// The last operations, for hang reports.
    history: History,
    /// Shared memory, when every rank of this communicator shares this host.
    shm: Option<crate::shm::ShmGroup>,
    /// Bytes moved per operation kind (see [`Communicator::traffic`]).
    traffic: TrafficTable,
    /// This communicator's track in the rank's trace (`HCOMM_TRACE`, [`Communicator::trace_to`]).
    trace: Option<Track>,
    /// The operation in progress, while tracing.
    span: Option<Span>,
    /// The all-gathers kept between hosts ([`crate::algo::gather_cache`]).
    gather_cache: crate::algo::gather_cache::GatherCache,
}

impl Inner {
    /// Write the finished operation `span` to the trace, with the bytes it moved.
    fn record_span(&mut self, span: &Span, moved: Counters) {
        let Some(track) = &self.trace else {
            return;
        };
        let mut peers = self.links.take_touched();
        if span.algo == Some(Algo::Shm.name()) {
            // Every rank of the segment reads what this one wrote.
            let (rank, size) = self.links.rank_and_size();
            peers = (0..size).filter(|&r| r != rank).collect();
        }
        let wire = Wire {
            tcp_sent: moved.tcp_sent,
            tcp_received: moved.tcp_received,
            shm_written: moved.shm_written,
            shm_read: moved.shm_read,
            peers,
        };
        track.record(span, &wire, Instant::now());
    }

    /// The transports' byte counters now.
    fn counters(&self) -> Counters {
        let (tcp_sent, tcp_received) = self.links.bytes_moved();
        let (shm_written, shm_read) = self.shm.as_ref().map_or((0, 0), |g| g.bytes_moved());
        let (pipe_written, pipe_read) = self.links.shm_bytes_moved();
        Counters {
            tcp_sent,
            tcp_received,
            shm_written: shm_written + pipe_written,
            shm_read: shm_read + pipe_read,
        }
    }
}

/// A group of ranks that run collectives together.
///
/// All methods take `&self`; operations on one communicator are serialised (a second thread
/// calling in waits for the first), so results are never interleaved. Use one communicator per
/// thread ([`Communicator::split`], [`Communicator::new_group`]) for independent progress.
pub struct Communicator {
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    host_id: String,
    hosts: Vec<String>,
    comm_id: String,
    store_addr: String,
    /// The deadline of every blocking call, in nanoseconds.
    timeout_ns: std::sync::atomic::AtomicU64,
    thresholds: Thresholds,
    aborted: Arc<AtomicBool>,
    /// Which rank revoked this communicator (set by a peer's notice, whatever this rank does).
    revocation: Arc<crate::transport::tcp::Revocation>,
    /// Sends the revocation notices ([`Communicator::revoke`]).
    notifier: crate::transport::tcp::recovery::Notifier,
    /// The address this rank's links listen on (shrunk communicators listen there too).
    listen_ip: std::net::IpAddr,
    inner: Mutex<Inner>,
    /// Keeps rank 0's store alive as long as any communicator of the job on this rank is.
    _server: Option<Arc<StoreServer>>,
    /// Transport setting (inherited by sub-communicators).
    transport: TransportKind,
    /// Data sockets per pair of ranks (`HCOMM_NSOCKS`; inherited by sub-communicators).
    nsocks: usize,
    /// Bytes of shared memory the collectives' segment takes (0 without one).
    shm_bytes: usize,
    /// Bytes of shared memory the point-to-point rings of this host take (0 without).
    p2p_shm_bytes: usize,
    /// A connection to the rendezvous store for after bootstrap (windows), made on first use.
    store: Mutex<Option<StoreClient>>,
    /// Collective window allocations so far.
    windows: std::sync::atomic::AtomicU64,
    /// See [`Communicator::hierarchical_layout`].
    hier_layout: Option<(usize, usize, usize)>,
    /// The hierarchical layout's hosts hold consecutive ranks (host `h` ranks `h·L..(h+1)·L`),
    /// so that the rank order is the host order, then the order within each host.
    hosts_contiguous: bool,
    /// Sub-communicators of the hierarchical all-reduce (made on first use).
    /// (Also the lock that serialises creating them.)
    hierarchy: Mutex<Option<Arc<Hierarchy>>>,
    /// Test hook `HCOMM_FAULT_INJECT=corrupt-one`: the last rank flips one bit of every
    /// collective result (proves that `hcomm check` and the benchmark's check catch errors).
    corrupt_results: bool,
    /// The tuning knobs this communicator was built with (inherited by sub-communicators).
    tuning: Tuning,
    /// Reductions in the canonical order ([`Communicator::set_deterministic`]).
    deterministic: AtomicBool,
    /// `Inner::trace` is set: operations record spans (read before the turn, without the lock).
    tracing: AtomicBool,
    /// Attached to every operation issued while it is set ([`Communicator::set_trace_label`];
    /// its own lock: read when an operation is issued, before its turn).
    trace_label: Mutex<Option<String>>,
    /// f16 and bf16 reductions accumulated in f32 ([`Communicator::set_accumulate_f32`]).
    accumulate_f32: AtomicBool,
    /// Two-rank all-reduces across hosts skip zero blocks ([`Communicator::set_skip_zeros`]).
    skip_zeros: AtomicBool,
    /// Bytes of all-gather outputs kept between hosts ([`Communicator::set_gather_cache_budget`]).
    gather_cache_budget: std::sync::atomic::AtomicUsize,
    /// Buffers the compressed all-reduce reuses between calls (taken in the operation's
    /// turn; see [`crate::base::scratch`]).
    scratch: Mutex<crate::base::scratch::Scratch>,
    /// The job token every connection proves (inherited by sub-communicators).
    token: Option<JobToken>,
    /// Where this rank accepts data links, and what became of the connections there.
    listen_addr: SocketAddr,
    link_counters: Arc<crate::auth::Counters>,
    /// Point-to-point messages posted for the progress loop ([`posted`]).
    posted: posted::Posted,
    /// Turn-taking and the engine thread of asynchronous operations (see [`crate::engine`]).
    /// Declared last: dropped after everything above, so the engine thread never outlives a
    /// communicator a job still uses (jobs hold the communicator through an `Arc`).
    engine: Engine,
}

/// The communicator's state for one operation, held until the operation finishes; then the
/// turn passes to the next operation (fields drop in order: state first, then the turn).
pub(crate) struct OpGuard<'a> {
    inner: MutexGuard<'a, Inner>,
    _turn: Option<TurnGuard<'a>>,
    /// The operation's name and the transport counters when it started (`None` when it was
    /// refused before starting): the bytes it moved are counted when the guard drops.
    traffic: Option<(&'static str, Counters)>,
}

impl Drop for OpGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && self.inner.poisoned.is_none() {
            // The operation panicked half way (code of the caller's, such as a tracing
            // subscriber, runs inside it): its links may be out of step, so later calls must
            // not run on them.
            self.inner.poisoned =
                Some("an operation panicked while it held the communicator".into());
        }
        let mut moved = Counters::default();
        if let Some((op, start)) = self.traffic.take() {
            moved = self.inner.counters().since(start);
            match current_label() {
                // Part of a compound operation, which counts the call itself.
                Some(label) => self.inner.traffic.add(label, 0, moved),
                None => self.inner.traffic.add(op, 1, moved),
            }
        }
        if let Some(span) = self.inner.span.take() {
            self.inner.record_span(&span, moved);
        }
    }
}

impl std::ops::Deref for OpGuard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.inner
    }
}

impl std::ops::DerefMut for OpGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.inner
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("id", &self.comm_id)
            .field("rank", &self.rank)
            .field("world_size", &self.size)
            .field("host_id", &self.host_id)
            .field("shared_memory", &(self.shm_bytes > 0))
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// Data sockets per pair of ranks (`HCOMM_NSOCKS`): TCP payloads of
    /// [`STRIPE_MIN`](crate::transport::ops::STRIPE_MIN) bytes or more are striped across up
    /// to this many sockets per peer.
    pub fn nsocks(&self) -> usize {
        self.nsocks
    }

    /// The address this rank accepts data links of this communicator on (its parent's, for a
    /// sub-communicator: one listener serves them all).
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// What became of the connections to this rank's data-link listener so far: how many were
    /// authenticated, and how many turned away and why. The listener is shared by a
    /// communicator and its sub-communicators, so are these counts.
    pub fn connection_stats(&self) -> ConnectionStats {
        self.link_counters.snapshot()
    }

    /// On the rank that hosts the rendezvous store (rank 0 of the job), what became of the
    /// connections to it so far; `None` on the other ranks.
    pub fn store_connection_stats(&self) -> Option<ConnectionStats> {
        self._server.as_ref().map(|s| s.stats())
    }

    /// Whether this communicator's connections are authenticated with a job token.
    pub fn is_authenticated(&self) -> bool {
        self.token.is_some()
    }

    /// This rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.size
    }

    /// This rank's index among the ranks on its host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of ranks on this rank's host.
    pub fn local_world_size(&self) -> usize {
        self.local_size
    }

    /// This rank's host identity (ranks with the same id share a host).
    pub fn host_id(&self) -> &str {
        &self.host_id
    }

    /// Host identity of every rank.
    pub fn host_ids(&self) -> &[String] {
        &self.hosts
    }

    /// The communicator's id (unique within the job).
    pub fn id(&self) -> &str {
        &self.comm_id
    }

    /// The deadline applied to every blocking call.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Change the deadline of every operation issued after this call (in issue order, like
    /// [`set_algorithm`](Self::set_algorithm): queued asynchronous operations keep theirs). At
    /// most [`BootstrapConfig::MAX_TIMEOUT`](crate::config::BootstrapConfig::MAX_TIMEOUT): a
    /// longer one is held to it.
    pub fn set_timeout(&self, d: Duration) {
        let _turn = self.engine.turns.enter();
        let d = d.min(crate::config::BootstrapConfig::MAX_TIMEOUT);
        self.timeout_ns
            .store(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// (host index, index within the host, ranks per host) of this rank when the ranks form at
    /// least 2 hosts of L ≥ 2 ranks each (hosts numbered by their lowest rank); computed once.
    pub(crate) fn hierarchical_layout(&self) -> Option<(usize, usize, usize)> {
        self.hier_layout
    }

    /// The hierarchy's sub-communicators, made on first use (a collective call: every rank
    /// reaches it in the same all-reduce).
    pub(crate) fn hierarchy(&self) -> Result<Arc<Hierarchy>> {
        // Held while creating, so that two threads cannot both create (the splits are
        // collective and must happen exactly once on every rank).
        let mut guard = self.hierarchy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = guard.as_ref() {
            return Ok(h.clone());
        }
        let (host, local, ranks_per_host) = self
            .hierarchical_layout()
            .ok_or_else(|| Error::invalid("all_reduce", 0, "no hierarchical layout"))?;
        let mut within = self
            .split(Some(host as u32), self.rank as i64)?
            .expect("member");
        let mut across = self
            .split(Some(local as u32), self.rank as i64)?
            .expect("member");
        // Internal communicators: the fault-injection hook applies to the user's calls only.
        within.corrupt_results = false;
        across.corrupt_results = false;
        // The members of each split, in its order (by rank): the ranks of this host, and the
        // ranks with this rank's index in their host (hosts need not hold consecutive ranks).
        let _ = (host, ranks_per_host);
        let local_of = |r: usize| (0..r).filter(|&q| self.hosts[q] == self.hosts[r]).count();
        let h = Arc::new(Hierarchy {
            within,
            within_ranks: (0..self.size)
                .filter(|&r| self.hosts[r] == self.hosts[self.rank])
                .collect(),
            across,
            across_ranks: (0..self.size).filter(|&r| local_of(r) == local).collect(),
        });
        *guard = Some(h.clone());
        Ok(h)
    }

    pub(crate) fn next_window_number(&self) -> u64 {
        self.windows.fetch_add(1, Ordering::Relaxed)
    }

    fn with_store<T>(
        &self,
        f: impl FnOnce(&mut StoreClient) -> std::result::Result<T, crate::bootstrap::store::StoreError>,
    ) -> Result<T> {
        let mut guard = self.store.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            *guard = Some(
                StoreClient::connect(&self.store_addr, self.timeout(), self.token.as_ref())
                    .map_err(|e| store_connect_error("", e))?,
            );
        }
        f(guard.as_mut().expect("connected"))
            .map_err(|e| Error::Config(format!("rendezvous store: {e}")))
    }

    pub(crate) fn store_set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.with_store(|s| s.set(key, value))
    }

    /// A blocking get on a connection of its own (so it never holds up other threads' store
    /// requests, which it may be waiting for).
    pub(crate) fn store_get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut store = StoreClient::connect(
            &self.store_addr,
            left.max(Duration::from_millis(10)),
            self.token.as_ref(),
        )
        .map_err(|e| store_connect_error("", e))?;
        let got = store
            .get(key, left)
            .map_err(|e| Error::Config(format!("rendezvous store: {e}")));
        got.map_err(|e| match e {
            Error::Config(m) if m.contains("timed out") => Error::Timeout {
                ctx: OpContext {
                    op: "get_shared",
                    seq: 0,
                },
                peers: Vec::new(),
                after: self.timeout(),
                detail: m,
            },
            other => other,
        })
    }

    /// Whether `algo` can run on this communicator (shared memory needs one host; hierarchical
    /// needs several hosts with the same number of ranks each).
    pub fn supports(&self, algo: Algo) -> bool {
        match algo {
            Algo::Shm => self.shm_bytes > 0,
            Algo::Hierarchical => self.hierarchical_layout().is_some(),
            _ => true,
        }
    }

    /// True when this communicator's ranks share a host and use shared memory.
    pub fn has_shared_memory(&self) -> bool {
        self.shm_bytes > 0
    }

    /// Bytes of shared memory this communicator maps on this host (0 without): the
    /// collectives' segment plus the point-to-point rings.
    pub fn shared_memory_bytes(&self) -> usize {
        self.shm_bytes + self.p2p_shm_bytes
    }

    /// True when point-to-point with `peer` (send/recv, signals, connections) goes over
    /// shared-memory rings rather than TCP (the peer shares this host, shared memory is
    /// allowed, and `HCOMM_SHM_P2P_BYTES` is not 0).
    pub fn p2p_over_shared_memory(&self, peer: usize) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .links
            .p2p_over_shm(peer)
    }

    /// Deterministic reductions on or off (`HCOMM_DETERMINISTIC=1` sets it at creation;
    /// sub-communicators made later inherit it). On, all-reduce, reduce-scatter and reduce
    /// run the canonical schedules of [`crate::algo::canonical`]: every element is the fold of
    /// the ranks' contributions in rank order (f16 and bf16 accumulated in f32), so results
    /// are bitwise the same for any message size, offset within a bucket, transport, number
    /// of sockets or host layout of the same world size. Every rank must make the same call;
    /// like [`set_algorithm`](Self::set_algorithm) it takes effect in issue order.
    pub fn set_deterministic(&self, on: bool) {
        let _turn = self.engine.turns.enter();
        self.deterministic.store(on, Ordering::Relaxed);
    }

    /// Whether reductions run in the canonical order ([`set_deterministic`](Self::set_deterministic)).
    pub fn is_deterministic(&self) -> bool {
        self.deterministic.load(Ordering::Relaxed)
    }

    /// Accumulate f16 and bf16 reductions in f32 on or off (`HCOMM_ACCUMULATE=f32` sets it at
    /// creation; sub-communicators made later inherit it). On, all-reduce, reduce-scatter(v)
    /// and reduce of those two dtypes run the canonical schedules of deterministic mode
    /// ([`set_deterministic`](Self::set_deterministic)): each element is the rank-order fold
    /// of the contributions computed in f32 and rounded once, instead of being rounded at
    /// every step of the ring or the tree. The other dtypes keep the algorithm the selector
    /// picks. Every rank must make the same call, in issue order.
    pub fn set_accumulate_f32(&self, on: bool) {
        let _turn = self.engine.turns.enter();
        self.accumulate_f32.store(on, Ordering::Relaxed);
    }

    /// Whether f16 and bf16 reductions accumulate in f32
    /// ([`set_accumulate_f32`](Self::set_accumulate_f32)).
    pub fn accumulates_f32(&self) -> bool {
        self.accumulate_f32.load(Ordering::Relaxed)
    }

    /// Skipping zero blocks on or off (`HCOMM_SKIP_ZEROS`, on by default; sub-communicators
    /// made later inherit it). On, a sum or mean all-reduce or reduce-scatter of at least
    /// [`skip_zeros::MIN_BYTES`](crate::algo::skip_zeros::MIN_BYTES) between two ranks on
    /// different hosts, or the cross-host step of the hierarchical all-reduce on two hosts,
    /// sends only the blocks that are not all zero bits ([`crate::algo::skip_zeros`]); the
    /// result is bitwise the dense one's. Every rank must make the same call, in issue order.
    pub fn set_skip_zeros(&self, on: bool) {
        let _turn = self.engine.turns.enter();
        self.skip_zeros.store(on, Ordering::Relaxed);
    }

    /// How this rank's shared-memory collectives write what their peers read next
    /// (`HCOMM_SHM_PUBLISH`, [`crate::shm::publish`]): learned per collective and size
    /// ([`PublishSetting::Auto`](crate::config::PublishSetting::Auto), the default), or always
    /// through the cache or to memory. The results are the same either way, so ranks may
    /// differ; setting it again forgets what was learned. No effect without shared memory.
    pub fn set_shm_publishing(&self, setting: crate::config::PublishSetting) {
        let _turn = self.engine.turns.enter();
        if let Ok(mut inner) = self.inner.lock() {
            if let Some(group) = inner.shm.as_mut() {
                group.set_publishing(setting);
            }
        }
    }

    /// Whether two-rank all-reduces across hosts skip zero blocks
    /// ([`set_skip_zeros`](Self::set_skip_zeros)).
    pub fn skips_zeros(&self) -> bool {
        self.skip_zeros.load(Ordering::Relaxed)
    }

    /// Keep up to `bytes` of all-gather outputs between hosts (`HCOMM_GATHER_CACHE_MB`; 0 turns
    /// it off and drops what is kept; sub-communicators made later start from the knob's
    /// value). On, an all-gather of at least
    /// [`gather_cache::MIN_BYTES`](crate::algo::gather_cache::MIN_BYTES) whose ranks span
    /// hosts sends, for a block that is bitwise one its rank sent in a kept all-gather, a
    /// reference instead ([`crate::algo::gather_cache`]); the output is the same. The ranks use
    /// the smallest budget among them. Every rank must make the same call (on or off), in issue
    /// order.
    pub fn set_gather_cache_budget(&self, bytes: usize) {
        let _turn = self.engine.turns.enter();
        self.gather_cache_budget.store(bytes, Ordering::Relaxed);
        if bytes == 0 {
            if let Ok(mut inner) = self.inner.lock() {
                inner.gather_cache.clear();
            }
        }
    }

    /// The bytes of all-gather outputs this communicator may keep
    /// ([`set_gather_cache_budget`](Self::set_gather_cache_budget)).
    pub fn gather_cache_budget(&self) -> usize {
        self.gather_cache_budget.load(Ordering::Relaxed)
    }

    /// The bytes of all-gather outputs this communicator keeps now.
    pub fn gather_cache_held(&self) -> usize {
        self.inner
            .lock()
            .map_or(0, |inner| inner.gather_cache.held())
    }

    /// Whether an all-gather of `bytes` keeps its output and skips repeated blocks: a budget,
    /// ranks on more than one host, at least
    /// [`gather_cache::MIN_BYTES`](crate::algo::gather_cache::MIN_BYTES).
    pub(crate) fn caches_gathers_for(&self, bytes: usize) -> bool {
        self.gather_cache_budget() > 0
            && self.size > 1
            && bytes >= crate::algo::gather_cache::MIN_BYTES
            && self.host_ids().iter().any(|h| *h != self.host_ids()[0])
    }

    /// Whether an all-reduce (or reduce-scatter) of `bytes` with `op` skips zero blocks here: on, two ranks on
    /// different hosts, a sum or mean, at least [`skip_zeros::MIN_BYTES`](crate::algo::skip_zeros::MIN_BYTES).
    pub(crate) fn skips_zeros_for(&self, bytes: usize, op: ReduceOp) -> bool {
        self.skips_zeros()
            && self.size == 2
            && matches!(op, ReduceOp::Sum | ReduceOp::Mean)
            && bytes >= crate::algo::skip_zeros::MIN_BYTES
            && self.host_ids()[0] != self.host_ids()[1]
    }

    /// Whether a reduction of `dtype` runs the canonical schedules: in deterministic mode, or
    /// for f16 and bf16 when they accumulate in f32.
    fn canonical_for(&self, dtype: Option<DType>) -> bool {
        self.is_deterministic()
            || CANONICAL_HERE.with(|c| c.get())
            || (self.accumulates_f32() && matches!(dtype, Some(DType::F16 | DType::BF16)))
    }

    /// Whether the reductions of `dtype` accumulate 16-bit floats in f32 here (their mean is
    /// then [`crate::base::half_mean`]'s).
    pub(crate) fn means_in_f32(&self, dtype: DType) -> bool {
        crate::base::half_mean::applies(dtype) && self.canonical_for(Some(dtype))
    }

    /// Run `f` (reductions of this thread) on the canonical schedules, whatever the dtype:
    /// the f32 sums of [`crate::base::half_mean`] stay the rank-order fold that f16 and bf16
    /// get with `HCOMM_ACCUMULATE=f32` alone.
    pub(crate) fn canonically<R>(f: impl FnOnce() -> R) -> R {
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                CANONICAL_HERE.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CANONICAL_HERE.with(|c| c.replace(true)));
        f()
    }

    /// Force an algorithm for a collective (`Algo::Auto` restores automatic choice). Takes
    /// effect in issue order: for operations issued after this call, not for asynchronous
    /// ones already queued.
    pub fn set_algorithm(&self, coll: Collective, algo: Algo) -> Result<()> {
        if algo == Algo::Hierarchical && self.hierarchical_layout().is_none() {
            return Err(Error::invalid(
                "set_algorithm",
                0,
                "hierarchical all-reduce needs at least 2 hosts with the same number (at least 2) of ranks each",
            ));
        }
        if algo == Algo::Shm && self.shm_bytes == 0 {
            return Err(Error::invalid(
                "set_algorithm",
                0,
                "no shared memory on this communicator (ranks on several hosts, HCOMM_TRANSPORT=tcp, or /dev/shm unusable)",
            ));
        }
        if algo != Algo::Auto && !coll.algorithms().contains(&algo) {
            return Err(Error::invalid(
                "set_algorithm",
                0,
                format!("{} cannot run with '{algo}'", coll.name()),
            ));
        }
        // In issue order, like an operation: it applies to the operations issued after it,
        // never to asynchronous ones issued before it and still queued.
        let _turn = self.engine.turns.enter();
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).algo[coll as usize] = algo;
        Ok(())
    }

    /// Abort: every operation in flight and every later one fails with [`Error::Aborted`].
    /// Safe to call from another thread.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        // Internal sub-communicators (hierarchical all-reduce) stop too.
        if let Ok(guard) = self.hierarchy.try_lock() {
            if let Some(h) = guard.as_ref() {
                h.within.abort();
                h.across.abort();
            }
        }
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The communicator's reusable buffers, for an operation in its turn (the lock is never
    /// contended: operations run one at a time).
    pub(crate) fn scratch(&self) -> MutexGuard<'_, crate::base::scratch::Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The last operations this communicator finished (at most
    /// [`HISTORY_LEN`](crate::history::HISTORY_LEN), oldest first), with how long each took and
    /// how it ended. A timeout logs them as a hang report.
    pub fn recent_operations(&self) -> Vec<OpRecord> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .history
            .records()
    }

    /// Bytes this rank moved, per kind of operation, since the communicator was made or
    /// [`reset_traffic`](Self::reset_traffic) was last called (rows in the order operations
    /// first ran). See [`crate::comm::traffic`] for what counts: TCP bytes written to / read from
    /// sockets (headers included), shared-memory bytes copied into / out of the segment.
    ///
    /// An operation built from others is one row: a compressed all-reduce counts its
    /// all-to-all and all-gather under `all_reduce_compressed`, the hierarchical all-reduce
    /// counts its sub-communicators' bytes under `all_reduce`. Waits for an operation in
    /// progress on another thread to finish.
    pub fn traffic(&self) -> Vec<OpTraffic> {
        let mut table = self
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .traffic
            .clone();
        if let Some(h) = self.hierarchy_if_made() {
            table.add_bytes_of(&h.within.traffic());
            table.add_bytes_of(&h.across.traffic());
        }
        table.rows()
    }

    /// Zero the counters of [`traffic`](Self::traffic).
    pub fn reset_traffic(&self) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .traffic
            .clear();
        if let Some(h) = self.hierarchy_if_made() {
            h.within.reset_traffic();
            h.across.reset_traffic();
        }
    }

    /// Trace the compound operation `op` that began at `started` and ends now (its parts are
    /// traced on their own, with `part_of` naming it).
    pub(crate) fn trace_compound(&self, op: &'static str, started: Instant) {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(track) = &inner.trace {
            let mut span = Span::new(op, inner.seq, started, started);
            span.compound = true;
            span.label = self.trace_label();
            track.record(&span, &Wire::default(), Instant::now());
        }
    }

    /// Count one call of the compound operation `op` (its bytes are counted by its parts).
    pub(crate) fn count_call(&self, op: &'static str) {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .traffic
            .add(op, 1, Counters::default());
    }

    fn hierarchy_if_made(&self) -> Option<Arc<Hierarchy>> {
        self.hierarchy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Number of open TCP links (both directions), for resource accounting.
    pub fn open_links(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .links
            .open_links()
    }

    /// Write a Chrome / Perfetto trace of this communicator's operations, and of the
    /// communicators made from it afterwards, to `path` (a directory, or a file name with
    /// `{rank}` in it: see [`crate::trace`]); replaces the trace this communicator wrote to
    /// before (`HCOMM_TRACE`'s, for the world), which is closed once no communicator uses it.
    pub fn trace_to(&self, path: &str) -> Result<()> {
        let tracer = Tracer::open(path, self.rank).map_err(|e| {
            Error::Config(format!(
                "trace: cannot create {}: {e}",
                crate::trace::trace_file(path, self.rank).display()
            ))
        })?;
        self.set_tracer(Some(tracer));
        Ok(())
    }

    /// Stop tracing this communicator (its trace file is closed once no communicator uses
    /// it; communicators made from it keep theirs).
    pub fn stop_trace(&self) {
        self.set_tracer(None);
    }

    fn set_tracer(&self, tracer: Option<Arc<Tracer>>) {
        let _turn = self.engine.turns.enter();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.trace =
            tracer.map(|t| t.track(&build::track_name(&self.comm_id, self.rank, self.size)));
        self.tracing.store(inner.trace.is_some(), Ordering::Relaxed);
    }

    /// True while this communicator traces its operations.
    pub fn traces(&self) -> bool {
        self.tracing.load(Ordering::Relaxed)
    }

    /// The file this communicator's trace goes to, if it traces.
    pub fn trace_file(&self) -> Option<std::path::PathBuf> {
        self.tracer().map(|t| t.path().to_path_buf())
    }

    /// Write the trace's buffered events now (they are written at least every
    /// [`FLUSH_EVERY`](crate::trace::FLUSH_EVERY) anyway, and when the last communicator
    /// using the file is dropped).
    pub fn flush_trace(&self) {
        if let Some(t) = self.tracer() {
            t.flush();
        }
    }

    /// Attach `label` to every operation traced from now on (`args.label` of its slice), or
    /// none; the torch backend labels DDP's buckets this way. Nothing without a trace.
    pub fn set_trace_label(&self, label: Option<&str>) {
        *self.trace_label.lock().unwrap_or_else(|p| p.into_inner()) = label.map(str::to_owned);
    }

    fn trace_label(&self) -> Option<String> {
        self.trace_label
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// An operation issued now: the time and the label set now (an asynchronous one runs
    /// later, when the label may have changed).
    pub(crate) fn trace_issue(&self) -> crate::trace::Issue {
        crate::trace::Issue {
            at: Instant::now(),
            label: self.trace_label(),
        }
    }

    /// The trace this communicator writes to (its sub-communicators write to it too).
    pub(crate) fn tracer(&self) -> Option<Arc<Tracer>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .trace
            .as_ref()
            .map(|t| t.tracer().clone())
    }

    /// The knobs a communicator made from this one starts with: this one's, with the settings
    /// changed since it was built (deterministic mode, accumulation, forced algorithms).
    pub(crate) fn inherited_tuning(&self) -> Tuning {
        let mut tuning = self.tuning.clone();
        tuning.deterministic = self.is_deterministic();
        tuning.accumulate_f32 = self.accumulates_f32();
        tuning.skip_zeros = self.skips_zeros();
        let forced = self.inner.lock().unwrap_or_else(|p| p.into_inner()).algo;
        tuning.algo = Collective::ALL
            .into_iter()
            .filter(|&c| forced[c as usize] != Algo::Auto)
            .map(|c| (c, forced[c as usize]))
            .collect();
        tuning
    }

    // ----- plumbing shared by every operation -----

    /// Start an operation: wait for its turn (operations run in the order they were issued,
    /// see [`crate::engine`]), then take the communicator's state. Fails at once when the
    /// communicator was aborted or poisoned.
    pub(crate) fn lock(&self, op: &'static str) -> Result<(OpGuard<'_>, OpContext)> {
        let issue = self
            .traces()
            .then(|| crate::trace::take_issue().unwrap_or_else(|| self.trace_issue()));
        let turn = self.engine.turns.enter();
        let mut inner = OpGuard {
            inner: self.inner.lock().unwrap_or_else(|p| p.into_inner()),
            _turn: turn,
            traffic: None,
        };
        let ctx = OpContext { op, seq: inner.seq };
        inner.history.begin(&ctx);
        if inner.trace.is_some() {
            let now = Instant::now();
            let (issued, label) = match issue {
                Some(i) => (i.at, i.label),
                // Tracing began while this call waited for its turn.
                None => (now, self.trace_label()),
            };
            let mut span = Span::new(op, ctx.seq, issued, now);
            span.part_of = current_label();
            span.label = label;
            // Peers touched by operations that ran before tracing began are not this one's.
            inner.links.take_touched();
            inner.span = Some(span);
        }
        if self.aborted.load(Ordering::SeqCst) {
            // Fails like an abort seen in flight: the first time, the peers are told (a rank
            // waiting on this one fails now, not at its deadline) and the call is recorded.
            let e = match self.revocation.revoked_by() {
                Some(by) => Error::Revoked { ctx, by },
                None => Error::Aborted { ctx },
            };
            let r: Result<()> = Self::finish(&mut inner, false, Err(e));
            return Err(r.expect_err("an abort is an error"));
        }
        if let Some(first) = &inner.poisoned {
            let e = Error::Poisoned {
                ctx,
                first: first.clone(),
            };
            if let Some(span) = inner.span.as_mut() {
                span.error = Some(e.to_string());
            }
            return Err(e);
        }
        inner.traffic = Some((op, inner.counters()));
        Ok((inner, ctx))
    }

    /// Fail this communicator because an operation built on it failed (the hierarchical
    /// all-reduce of its parent): poison it and tell its peers, as a failure of its own does
    /// (without the grace period: the operation that failed had it). Nothing when it is
    /// poisoned already.
    pub(crate) fn fail_with(&self, e: &Error) {
        self.fail_blaming(e, e.blame());
    }

    /// [`fail_with`](Self::fail_with) for an error of the parent communicator, whose rank
    /// `parent_ranks[i]` is this one's rank `i` (see [`Error::blame_in`]).
    pub(crate) fn fail_with_parents(&self, e: &Error, parent_ranks: &[usize]) {
        self.fail_blaming(e, e.blame_in(parent_ranks));
    }

    fn fail_blaming(
        &self,
        e: &Error,
        (culprit, reason): (Option<usize>, crate::base::error::AbortReason),
    ) {
        let _turn = self.engine.turns.enter();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.poisoned.is_some() {
            return;
        }
        inner.poisoned = Some(e.to_string());
        let seq = inner.seq;
        inner.links.send_abort(seq, culprit, reason as u8);
        if let Some(shm) = inner.shm.as_ref() {
            shm.post_abort(culprit, reason as u8);
        }
    }

    /// [`finish`](Self::finish) for a collective run outside `collective()`.
    pub(crate) fn finish_collective<T>(inner: &mut Inner, r: Result<T>) -> Result<T> {
        Self::finish(inner, true, r)
    }

    /// Account for a finished operation: collectives advance the sequence number (which every
    /// rank must agree on); any fatal error poisons the communicator.
    fn finish<T>(inner: &mut Inner, collective: bool, r: Result<T>) -> Result<T> {
        if collective {
            inner.seq += 1;
        }
        // An abort seen in flight is a revocation when someone revoked; a revocation heard
        // from a peer's links is recorded, so that later calls say so too.
        let r = match r {
            Err(Error::Aborted { ctx }) => match inner.links.revocation().revoked_by() {
                Some(by) => Err(Error::Revoked { ctx, by }),
                None => Err(Error::Aborted { ctx }),
            },
            Err(Error::Revoked { ctx, by }) => {
                inner.links.revocation().revoke(by);
                Err(Error::Revoked { ctx, by })
            }
            r => r,
        };
        if let Some(report) = inner.history.end(r.as_ref().map(|_| ())) {
            tracing::error!("{report}");
        }
        if let (Some(span), Err(e)) = (inner.span.as_mut(), &r) {
            span.error = Some(e.to_string());
        }
        let mut blamed = None;
        if let Err(e) = &r {
            if e.is_fatal() && inner.poisoned.is_none() {
                inner.poisoned = Some(e.to_string());
                // Tell the peers, so that every rank fails now and names the cause.
                let (mut culprit, reason) = e.blame();
                match e {
                    // Whom this rank waited for may itself be waiting: follow the blame along
                    // the waits for a short grace period (see `TcpLinks::settle_blame`).
                    Error::Timeout { after, .. } if inner.links.any_links() => {
                        let grace =
                            (*after / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
                        culprit = inner
                            .links
                            .settle_blame(inner.seq, culprit, reason as u8, grace);
                    }
                    _ => inner.links.send_abort(inner.seq, culprit, reason as u8),
                }
                if let Some(shm) = inner.shm.as_ref() {
                    shm.post_abort(culprit, reason as u8);
                }
                if let (Error::Timeout { peers, .. }, Some(c)) = (e, culprit) {
                    if !peers.contains(&c) {
                        blamed = Some(c);
                    }
                }
            }
        }
        match (r, blamed) {
            (
                Err(Error::Timeout {
                    ctx,
                    peers,
                    after,
                    detail,
                }),
                Some(c),
            ) => Err(Error::Timeout {
                detail: format!(
                    "{detail}; rank(s) {peers:?} were waiting too: the chain of waits ends at rank {c}"
                ),
                ctx,
                peers,
                after,
            }),
            (r, _) => r,
        }
    }

    fn select(&self, coll: Collective, bytes: usize, forced: Algo, canonical: bool) -> Algo {
        let topology = Topology {
            size: self.size,
            shared_memory: self.shm_bytes > 0,
            hierarchical: self.hierarchical_layout().is_some(),
            hosts_contiguous: self.hosts_contiguous,
            deterministic: canonical,
        };
        select(coll, bytes, forced, &topology, &self.thresholds)
    }

    /// The algorithm the selector would use for `coll` on `bytes` bytes per rank (after
    /// `HCOMM_ALGO` and [`set_algorithm`](Self::set_algorithm)), for a dtype other than f16
    /// and bf16 (see [`algorithm_for_dtype`](Self::algorithm_for_dtype)).
    pub fn algorithm_for(&self, coll: Collective, bytes: usize) -> Algo {
        self.algorithm_for_dtype(coll, bytes, DType::F32)
    }

    /// [`algorithm_for`](Self::algorithm_for) for elements of `dtype` (f16 and bf16 run the
    /// canonical schedules when they accumulate in f32).
    pub fn algorithm_for_dtype(&self, coll: Collective, bytes: usize, dtype: DType) -> Algo {
        self.select(
            coll,
            bytes,
            self.forced_algorithm(coll),
            self.canonical_for(Some(dtype)),
        )
    }

    /// The algorithm set for `coll` ([`set_algorithm`](Self::set_algorithm) or
    /// `HCOMM_ALGO`), `Auto` when none is.
    pub(crate) fn forced_algorithm(&self, coll: Collective) -> Algo {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).algo[coll as usize]
    }

    fn choose(&self, inner: &mut Inner, coll: Collective, bytes: usize, canonical: bool) -> Algo {
        let forced = inner.algo[coll as usize];
        let algo = self.select(coll, bytes, forced, canonical);
        let bit = 1u16 << algo.code();
        if inner.logged[coll as usize] & bit == 0 {
            inner.logged[coll as usize] |= bit;
            tracing::info!(
                rank = self.rank,
                "{} of {bytes} bytes on {} ranks: algorithm {algo}{}",
                coll.name(),
                self.size,
                if forced != Algo::Auto {
                    " (forced)"
                } else {
                    ""
                }
            );
        } else {
            tracing::debug!(
                rank = self.rank,
                "{} of {bytes} bytes: algorithm {algo}",
                coll.name()
            );
        }
        algo
    }

    /// Run `body` as collective `coll`: lock, validate nothing else, build the run context,
    /// poison on failure.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn collective<F>(
        &self,
        coll: Collective,
        dtype: Option<DType>,
        op: Option<ReduceOp>,
        root: Option<usize>,
        count: usize,
        bytes: usize,
        body: F,
    ) -> Result<()>
    where
        F: FnOnce(&mut Call, Algo) -> Result<()>,
    {
        let (mut inner, ctx) = self.lock(coll.name())?;
        let canonical = self.canonical_for(dtype);
        let algo = self.choose(&mut inner, coll, bytes, canonical);
        if let Some(span) = inner.span.as_mut() {
            span.algo = Some(algo.name());
            span.dtype = dtype.map(DType::name);
            span.reduce = op.map(ReduceOp::name);
            span.count = Some(count);
            span.bytes = Some(bytes);
            span.root = root;
        }
        let fp = Header {
            algo: algo.code(),
            ..crate::wire::collective::fingerprint(ctx.seq, coll, dtype, op, root, count)
        };
        let timeout = self.timeout();
        inner.links.set_op_timeout(timeout);
        let result = {
            let inner = &mut *inner;
            let mut call = Call {
                run: Run {
                    links: &mut inner.links,
                    rank: self.rank,
                    size: self.size,
                    ctx,
                    fp,
                    deadline: Deadline::lazy(inner.history.start(), timeout),
                },
                shm: inner.shm.as_mut(),
                fp_extra: 0,
                canonical,
                ran: None,
                gather_cache: &mut inner.gather_cache,
            };
            let result = body(&mut call, algo);
            if let (Some(ran), Some(span)) = (call.ran, inner.span.as_mut()) {
                span.algo = Some(ran);
            }
            result
        };
        Self::finish(&mut inner, true, result)
    }

    /// Apply the `HCOMM_FAULT_INJECT` test hook to a collective's output.
    pub(crate) fn inject_fault(&self, out: &mut [u8]) {
        if self.corrupt_results && self.rank + 1 == self.size && !out.is_empty() {
            let mid = out.len() / 2;
            out[mid] ^= 0x10;
        }
    }

    pub(crate) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(Error::invalid(
                op,
                self.peek_seq(),
                format!(
                    "root {root} is out of range for a communicator of {} ranks",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size {
            return Err(Error::invalid(
                op,
                self.peek_seq(),
                format!(
                    "peer rank {peer} is out of range for a communicator of {} ranks",
                    self.size
                ),
            ));
        }
        if peer == self.rank {
            return Err(Error::invalid(
                op,
                self.peek_seq(),
                format!("peer rank {peer} is this rank; point-to-point to self is not supported"),
            ));
        }
        Ok(())
    }

    fn peek_seq(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).seq
    }
}

thread_local! {
    /// Set by [`Communicator::canonically`] while its reductions run on this thread.
    static CANONICAL_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sub-communicators of the hierarchical all-reduce.
pub(crate) struct Hierarchy {
    /// The ranks of this host (shared memory).
    pub within: Communicator,
    /// The parent's ranks of `within`, in its order.
    pub within_ranks: Vec<usize>,
    /// The ranks with this rank's index on every host (TCP).
    pub across: Communicator,
    /// The parent's ranks of `across`, in its order.
    pub across_ranks: Vec<usize>,
}

impl Hierarchy {
    /// `f` on the communicator of this host's ranks, its error as one of the parent's
    /// operation `ctx` (the parent's rank numbers; see [`Error::lifted`]).
    pub fn in_host<T>(
        &self,
        ctx: &OpContext,
        f: impl FnOnce(&Communicator) -> Result<T>,
    ) -> Result<T> {
        f(&self.within).map_err(|e| e.lifted(ctx, &self.within_ranks, "the ranks of this host"))
    }

    /// [`in_host`](Self::in_host) for the communicator of the same-index ranks of every host.
    pub fn across_hosts<T>(
        &self,
        ctx: &OpContext,
        f: impl FnOnce(&Communicator) -> Result<T>,
    ) -> Result<T> {
        f(&self.across).map_err(|e| {
            e.lifted(
                ctx,
                &self.across_ranks,
                "the ranks with this rank's index on each host",
            )
        })
    }

    /// Fail both sub-communicators because the parent's operation failed with `e`, so that
    /// no rank waits for this one in either (blame in each one's numbers).
    pub fn fail_with(&self, e: &Error) {
        self.within.fail_with_parents(e, &self.within_ranks);
        self.across.fail_with_parents(e, &self.across_ranks);
    }
}
