//! The communicator: a group of ranks, their links, and the collectives and point-to-point
//! operations over them.

mod asynchronous;
mod collectives;
pub mod traffic;
pub(crate) mod window;

use crate::algo::select::{select, Thresholds, Topology};
use crate::algo::Run;
use crate::auth::{ConnectionStats, JobToken};
use crate::base::dtype::{DType, Element, ReduceOp};
use crate::base::error::{Error, OpContext, Result};
use crate::bootstrap::store::{StoreClient, StoreError, StoreServer};
use crate::bootstrap::{self, PeerInfo};
use crate::config::{BootstrapConfig, TransportKind, Tuning};
use crate::transport::tcp::{RecvOp, SendOp, TcpLinks, EAGER_MAX};
use crate::wait::WaitPolicy;
use crate::wire::collective::Algo;
pub use crate::wire::collective::Collective;
use crate::wire::frame::{Header, Kind};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::comm::traffic::{current_label, Counters, OpTraffic, TrafficTable};
use crate::engine::{Engine, TurnGuard};
use crate::history::{History, OpRecord};
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

impl Call<'_> {
    /// The shared-memory group, the waiting context for its calls and the call's fingerprint.
    pub fn shm_parts(
        &mut self,
    ) -> (
        &mut crate::shm::ShmGroup,
        crate::shm::WaitCtx<'_>,
        crate::wire::collective::ShmFingerprint,
    ) {
        let fp = crate::wire::collective::ShmFingerprint::of(&self.run.fp, self.fp_extra);
        let w = crate::shm::WaitCtx {
            ctx: &self.run.ctx,
            deadline: self.run.deadline,
            timeout: self.run.timeout,
        };
        (self.shm.as_deref_mut().expect("shared memory group"), w, fp)
    }
}

pub(crate) struct Inner {
    links: TcpLinks,
    seq: u64,
    poisoned: Option<String>,
    algo: HashMap<Collective, Algo>,
    /// Which (collective, algorithm) choices were logged at info level already (bit per algorithm).
    logged: [u16; 16],
    splits: u64,
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
}

impl Inner {
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
    /// Sub-communicators of the hierarchical all-reduce (made on first use).
    /// (Also the lock that serialises creating them.)
    hierarchy: Mutex<Option<Arc<Hierarchy>>>,
    /// Test hook `HCOMM_FAULT_INJECT=corrupt-one`: the last rank flips one bit of every
    /// collective result (proves that `hcomm check` and the benchmark's check catch errors).
    corrupt_results: bool,
    /// The tuning knobs this communicator was built with (inherited by sub-communicators).
    tuning: Tuning,
    /// The job token every connection proves (inherited by sub-communicators).
    token: Option<JobToken>,
    /// Where this rank accepts data links, and what became of the connections there.
    listen_addr: SocketAddr,
    link_counters: Arc<crate::auth::Counters>,
    /// Turn-taking and the engine thread of asynchronous operations (see [`crate::engine`]).
    /// Declared last: dropped after everything above, so the engine thread never outlives a
    /// communicator a job still uses (jobs hold the communicator through an `Arc`).
    engine: Engine,
}

/// The communicator's state for one operation, held until the operation finishes; then the
/// turn passes to the next operation (fields drop in order: state first, then the turn).
pub(crate) struct OpGuard<'a> {
    inner: MutexGuard<'a, Inner>,
    _turn: Option<TurnGuard>,
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
        if let Some((op, start)) = self.traffic.take() {
            let moved = self.inner.counters().since(start);
            match current_label() {
                // Part of a compound operation, which counts the call itself.
                Some(label) => self.inner.traffic.add(label, 0, moved),
                None => self.inner.traffic.add(op, 1, moved),
            }
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

fn hash64(s: &str) -> u64 {
    // FNV-1a: stable across processes (std's hasher is randomised).
    crate::auth::comm_hash(s)
}

/// A failure to reach or join the rendezvous store: a refused handshake is an authentication
/// error, anything else a configuration one.
fn store_connect_error(prefix: &str, e: StoreError) -> Error {
    match e {
        StoreError::Handshake { .. } => Error::Auth {
            ctx: OpContext {
                op: "bootstrap",
                seq: 0,
            },
            peer: None,
            msg: format!("{prefix}{e}"),
        },
        other => Error::Config(format!("{prefix}{other}")),
    }
}

impl Communicator {
    /// Join the job described by the environment (`HCOMM_*`, torchrun, Open MPI, MPICH/PMI or
    /// Slurm variables; see `docs/configuration.md`).
    ///
    /// With `HCOMM_RANK_TABLE=path`, the job is described by that rank table and only this
    /// process's rank is read from the environment (`HCOMM_RANK`, `RANK`,
    /// `OMPI_COMM_WORLD_RANK`, `PMI_RANK` or `SLURM_PROCID`).
    pub fn from_env() -> Result<Communicator> {
        if let Some((table, rank)) = crate::config::rank_table_from_env()? {
            return Self::from_rank_table(table, rank);
        }
        Self::from_config(&BootstrapConfig::from_env()?)
    }

    /// Join the job described by a rank table (`hcom_config.json`) as `rank`.
    pub fn from_rank_table(path: impl AsRef<Path>, rank: usize) -> Result<Communicator> {
        Self::from_config(&BootstrapConfig::from_rank_table(path.as_ref(), rank)?)
    }

    /// Join a job: rank 0 hosts the rendezvous store on the master address, every rank
    /// publishes its listening address, and the world communicator is built.
    pub fn from_config(cfg: &BootstrapConfig) -> Result<Communicator> {
        let tuning = Tuning::from_env()?;
        let start = Instant::now();
        let token = cfg.token()?;
        if token.is_none() && cfg.world_size > 1 {
            tracing::info!(
                "no job token (HCOMM_JOB_TOKEN / HCOMM_TOKEN_FILE): connections are not authenticated"
            );
        }
        let master = format!("{}:{}", cfg.master_addr, cfg.master_port);
        let server = if cfg.rank == 0 {
            let addr = bootstrap::resolve(&cfg.master_addr, cfg.master_port)
                .map_err(|e| Error::Config(format!("master address {master}: {e}")))?;
            let srv = StoreServer::start(addr, token.clone()).map_err(|e| {
                Error::Config(format!(
                    "rank 0 cannot listen on the master address {addr}: {e}{}",
                    if e.kind() == std::io::ErrorKind::AddrInUse {
                        " (another job on this port, or a communicator of this job still alive in this process? \
                         drop it first, or choose another HCOMM_MASTER_PORT)"
                    } else {
                        " (HCOMM_MASTER_ADDR must be an address of rank 0's host)"
                    }
                ))
            })?;
            Some(Arc::new(srv))
        } else {
            None
        };
        let store_addr = match &server {
            Some(s) => s.addr().to_string(),
            None => master.clone(),
        };
        let store = join_store(&store_addr, cfg.rank, cfg.timeout, token.as_ref())?;
        let ip = bootstrap::select_listen_ip(
            cfg.socket_ifname.as_deref(),
            cfg.listen_host.as_deref(),
            &cfg.master_addr,
            cfg.master_port,
        )?;
        let host_id = cfg
            .host_id
            .clone()
            .unwrap_or_else(bootstrap::default_host_id);
        let comm = Self::build(BuildArgs {
            comm_id: "world".into(),
            rank: cfg.rank,
            size: cfg.world_size,
            store,
            store_addr,
            server,
            ip,
            host_id,
            timeout: cfg.timeout,
            local_size_hint: cfg.local_world_size,
            tuning,
            transport: cfg.transport,
            token,
            nsocks: cfg.nsocks,
        })?;
        tracing::info!(
            rank = comm.rank,
            size = comm.size,
            local_rank = comm.local_rank,
            local_size = comm.local_size,
            source = %cfg.source,
            "hcomm communicator ready in {:?}",
            start.elapsed()
        );
        Ok(comm)
    }

    fn build(a: BuildArgs) -> Result<Communicator> {
        let BuildArgs {
            comm_id,
            rank,
            size,
            mut store,
            store_addr,
            server,
            ip,
            host_id,
            timeout,
            local_size_hint,
            tuning,
            transport,
            token,
            nsocks,
        } = a;
        if !(1..=BootstrapConfig::MAX_NSOCKS).contains(&nsocks) {
            return Err(Error::Config(format!(
                "HCOMM_NSOCKS={nsocks}: the number of sockets per pair of ranks must be 1 to {}",
                BootstrapConfig::MAX_NSOCKS
            )));
        }
        let listener = TcpLinks::listen(ip)
            .map_err(|e| Error::Config(format!("cannot listen on {ip}: {e}")))?;
        let addr: SocketAddr = listener
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .ok_or_else(|| Error::Config("listener has no address".into()))?;
        let me = PeerInfo {
            addr,
            host_id: host_id.clone(),
            nsocks,
            transport: transport.to_string(),
            world_size: size,
        };
        let peers = bootstrap::exchange_peer_info(&mut store, &comm_id, rank, size, &me, timeout)?;
        // Both ends of a link must cut large frames into the same stripes.
        if let Some((r, p)) = peers.iter().enumerate().find(|(_, p)| p.nsocks != nsocks) {
            return Err(Error::Config(format!(
                "HCOMM_NSOCKS differs between ranks: rank {r} uses {}, this rank ({rank}) {nsocks}; \
                 set the same value for every rank",
                p.nsocks
            )));
        }
        // Ranks that skip shared memory would leave the others waiting in its setup.
        let tcp_only = transport == TransportKind::Tcp;
        if let Some((r, p)) = peers
            .iter()
            .enumerate()
            .find(|(_, p)| (p.transport == "tcp") != tcp_only)
        {
            return Err(Error::Config(format!(
                "HCOMM_TRANSPORT differs between ranks: rank {r} uses {}, this rank ({rank}) {transport}; \
                 set tcp for every rank or for none",
                p.transport
            )));
        }
        let hosts: Vec<String> = peers.iter().map(|p| p.host_id.clone()).collect();
        let local: Vec<usize> = (0..size).filter(|&r| hosts[r] == host_id).collect();
        let local_rank = local.iter().position(|&r| r == rank).unwrap_or(0);
        let local_size = local
            .len()
            .max(local_size_hint.unwrap_or(0).min(size))
            .max(1);
        let policy = WaitPolicy::for_local_ranks(local_size, tuning.spin_us);
        let mut links = TcpLinks::new(
            rank,
            listener,
            peers.iter().map(|p| p.addr).collect(),
            hash64(&comm_id),
            token.clone(),
            policy,
            nsocks,
        )
        .map_err(|e| Error::Config(format!("cannot start accepting data links: {e}")))?;
        let (listen_addr, link_counters) = (links.listen_addr(), links.counters());
        let aborted = Arc::new(AtomicBool::new(false));
        links.set_abort_flag(aborted.clone());
        links.set_socket_buf(tuning.socket_buf);
        let shm = if transport != TransportKind::Tcp && size > 1 && local.len() == size {
            setup_shm(
                &mut store,
                &comm_id,
                rank,
                size,
                tuning.shm_chunk,
                policy,
                aborted.clone(),
                timeout,
                transport == TransportKind::Shm,
            )?
        } else {
            if transport == TransportKind::Shm && size > 1 {
                return Err(Error::Config(format!(
                    "HCOMM_TRANSPORT=shm, but the {size} ranks of '{comm_id}' are on {} hosts",
                    hosts.iter().collect::<HashSet<_>>().len()
                )));
            }
            None
        };
        let shm_bytes = shm.as_ref().map_or(0, |s| s.footprint());
        let p2p_shm = if transport != TransportKind::Tcp && local.len() > 1 {
            setup_p2p_shm(
                &mut store,
                &comm_id,
                rank,
                &local,
                tuning.shm_p2p_bytes,
                timeout,
                transport == TransportKind::Shm,
            )?
        } else {
            None
        };
        let p2p_shm_bytes = p2p_shm.as_ref().map_or(0, |s| s.footprint());
        if let Some(s) = p2p_shm {
            links.attach_shm(Arc::new(s), &local);
        }
        let hier_layout = compute_hierarchical_layout(&hosts, rank);
        if server.is_some() {
            // The store lives as long as this communicator: wait for every rank to be done
            // with it, so that dropping the communicator at once cannot take it away from a
            // rank still setting up (that rank would wait out its timeout).
            wait_until_built(&mut store, &comm_id, size, timeout)?;
        } else {
            mark_built(&mut store, &comm_id, size)?;
        }
        drop(store);
        Ok(Communicator {
            rank,
            size,
            local_rank,
            local_size,
            host_id,
            hosts,
            comm_id,
            store_addr,
            timeout_ns: std::sync::atomic::AtomicU64::new(
                timeout.as_nanos().min(u64::MAX as u128) as u64
            ),
            thresholds: Thresholds::default(),
            aborted,
            inner: Mutex::new(Inner {
                links,
                seq: 0,
                poisoned: None,
                algo: tuning.algo.clone(),
                logged: [0; 16],
                splits: 0,
                groups: HashMap::new(),
                open_conns: HashSet::new(),
                p2p_ids: vec![0; size],
                history: History::new(rank),
                shm,
                traffic: TrafficTable::default(),
            }),
            _server: server,
            transport,
            nsocks,
            shm_bytes,
            p2p_shm_bytes,
            store: Mutex::new(None),
            windows: std::sync::atomic::AtomicU64::new(0),
            hierarchy: Mutex::new(None),
            hier_layout,
            corrupt_results: tuning.corrupt_one,
            tuning,
            token,
            listen_addr,
            link_counters,
            engine: Engine::default(),
        })
    }

    /// Data sockets per pair of ranks (`HCOMM_NSOCKS`): TCP payloads of
    /// [`STRIPE_MIN`](crate::transport::ops::STRIPE_MIN) bytes or more are striped across up
    /// to this many sockets per peer.
    pub fn nsocks(&self) -> usize {
        self.nsocks
    }

    /// The address this rank accepts data links of this communicator on.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// What became of the connections to this rank's data-link listener (of this
    /// communicator) so far: how many were authenticated, and how many turned away and why.
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
    /// [`set_algorithm`](Self::set_algorithm): queued asynchronous operations keep theirs).
    pub fn set_timeout(&self, d: Duration) {
        let _turn = self.engine.turns.enter();
        self.timeout_ns
            .store(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
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
        let (host, local, _) = self
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
        let h = Arc::new(Hierarchy { within, across });
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
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .algo
            .insert(coll, algo);
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

    // ----- plumbing shared by every operation -----

    /// Start an operation: wait for its turn (operations run in the order they were issued,
    /// see [`crate::engine`]), then take the communicator's state. Fails at once when the
    /// communicator was aborted or poisoned.
    pub(crate) fn lock(&self, op: &'static str) -> Result<(OpGuard<'_>, OpContext)> {
        let turn = self.engine.turns.enter();
        let mut inner = OpGuard {
            inner: self.inner.lock().unwrap_or_else(|p| p.into_inner()),
            _turn: turn,
            traffic: None,
        };
        let ctx = OpContext { op, seq: inner.seq };
        inner.history.begin(&ctx);
        if self.aborted.load(Ordering::SeqCst) {
            // Fails like an abort seen in flight: the first time, the peers are told (a rank
            // waiting on this one fails now, not at its deadline) and the call is recorded.
            let r: Result<()> = Self::finish(&mut inner, false, Err(Error::Aborted { ctx }));
            return Err(r.expect_err("an abort is an error"));
        }
        if let Some(first) = &inner.poisoned {
            return Err(Error::Poisoned {
                ctx,
                first: first.clone(),
            });
        }
        inner.traffic = Some((op, inner.counters()));
        Ok((inner, ctx))
    }

    /// Fail this communicator because an operation built on it failed (the hierarchical
    /// all-reduce of its parent): poison it and tell its peers, as a failure of its own does
    /// (without the grace period: the operation that failed had it). Nothing when it is
    /// poisoned already.
    pub(crate) fn fail_with(&self, e: &Error) {
        let _turn = self.engine.turns.enter();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.poisoned.is_some() {
            return;
        }
        inner.poisoned = Some(e.to_string());
        let (culprit, reason) = e.blame();
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
        if let Some(report) = inner.history.end(r.as_ref().map(|_| ())) {
            tracing::error!("{report}");
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

    fn select(&self, coll: Collective, bytes: usize, forced: Algo) -> Algo {
        let topology = Topology {
            size: self.size,
            shared_memory: self.shm_bytes > 0,
            hierarchical: self.hierarchical_layout().is_some(),
        };
        select(coll, bytes, forced, &topology, &self.thresholds)
    }

    /// The algorithm the selector would use for `coll` on `bytes` bytes per rank (after
    /// `HCOMM_ALGO` and [`set_algorithm`](Self::set_algorithm)).
    pub fn algorithm_for(&self, coll: Collective, bytes: usize) -> Algo {
        self.select(coll, bytes, self.forced_algorithm(coll))
    }

    /// The algorithm set for `coll` ([`set_algorithm`](Self::set_algorithm) or
    /// `HCOMM_ALGO`), `Auto` when none is.
    pub(crate) fn forced_algorithm(&self, coll: Collective) -> Algo {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .algo
            .get(&coll)
            .copied()
            .unwrap_or(Algo::Auto)
    }

    fn choose(&self, inner: &mut Inner, coll: Collective, bytes: usize) -> Algo {
        let forced = inner.algo.get(&coll).copied().unwrap_or(Algo::Auto);
        let algo = self.select(coll, bytes, forced);
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
        let algo = self.choose(&mut inner, coll, bytes);
        let fp = Header {
            algo: algo.code(),
            ..crate::wire::collective::fingerprint(ctx.seq, coll, dtype, op, root, count)
        };
        let timeout = self.timeout();
        inner.links.set_op_timeout(timeout);
        let deadline = inner.history.deadline(timeout);
        let result = {
            let inner = &mut *inner;
            let mut call = Call {
                run: Run {
                    links: &mut inner.links,
                    rank: self.rank,
                    size: self.size,
                    ctx,
                    fp,
                    deadline,
                    timeout,
                },
                shm: inner.shm.as_mut(),
                fp_extra: 0,
            };
            body(&mut call, algo)
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

    // ----- point-to-point -----

    /// Send `buf` to `peer` with `tag`.
    ///
    /// Messages up to 64 KiB are eager: `send` returns once the data is handed to the kernel,
    /// and the receiver buffers it until its matching [`recv`](Self::recv). Larger messages are
    /// rendezvous: `send` returns once the receiver has posted the matching receive and the
    /// data is handed over (two ranks that both send a large message to each other before
    /// receiving wait until the timeout; use [`send_recv`](Self::send_recv) to exchange).
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
        recv: Option<(usize, u32, &mut [u8])>,
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
        let (mut inner, ctx) = self.lock(op)?;
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

    // ----- sub-communicators -----

    /// Split into sub-communicators (collective over this communicator): ranks passing the
    /// same `color` form one, ordered by (`key`, rank). `None` as color leaves this rank out
    /// (returns `Ok(None)`).
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        // One turn for the whole split, so that its number is the same on every rank even when
        // several threads split this communicator.
        let _turn = self.engine.turns.enter();
        let mine = [color.map_or(-1i64, |c| c as i64), key];
        let mut all = vec![0i64; 2 * self.size];
        // Internal: never subject to the fault-injection hook.
        let counts = vec![2; self.size];
        self.all_gather_v_inner(
            Some(bytemuck::cast_slice(&mine)),
            bytemuck::cast_slice_mut(&mut all),
            &counts,
            DType::I64,
            false,
        )?;
        let split_no = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inner.splits += 1;
            inner.splits
        };
        let id_of = |c: i64| format!("{}/split{split_no}/c{c}", self.comm_id);
        // The rank holding the store waits until every new communicator is built, its own
        // (see `build`) and the others (it may be in none of them), so that dropping its
        // communicators at once cannot take the store away from ranks still setting up.
        let wait_for_the_others = |own: Option<i64>| -> Result<()> {
            if self._server.is_none() {
                return Ok(());
            }
            let deadline = Instant::now() + self.timeout();
            let colors: std::collections::BTreeSet<i64> = (0..self.size)
                .map(|r| all[2 * r])
                .filter(|&c| c >= 0)
                .collect();
            for c in colors.into_iter().filter(|&c| Some(c) != own) {
                self.store_get(&all_built_key(&id_of(c)), deadline)?;
            }
            Ok(())
        };
        let Some(color) = color else {
            wait_for_the_others(None)?;
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..self.size)
            .filter(|&r| all[2 * r] == color as i64)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort();
        let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        let sub = self.sub_communicator(id_of(color as i64), &ranks)?;
        wait_for_the_others(Some(color as i64))?;
        Ok(Some(sub))
    }

    /// A communicator of `ranks` (in that order: the new rank of `ranks[i]` is `i`). Only the
    /// members call it, each with the same list; calling it again with the same list makes a
    /// new, independent communicator.
    ///
    /// Its setup goes through the job's rendezvous store, which rank 0 of the job holds: rank 0
    /// must keep this communicator (or one made from it) until the group's members have it.
    /// [`split`](Self::split), which every rank calls, waits for that itself.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Communicator> {
        // One turn for the whole call (see `split`).
        let _turn = self.engine.turns.enter();
        let seq = self.peek_seq();
        let mut seen = HashSet::new();
        for &r in ranks {
            if r >= self.size {
                return Err(Error::invalid(
                    "new_group",
                    seq,
                    format!(
                        "rank {r} is out of range for a communicator of {} ranks",
                        self.size
                    ),
                ));
            }
            if !seen.insert(r) {
                return Err(Error::invalid(
                    "new_group",
                    seq,
                    format!("rank {r} is listed twice"),
                ));
            }
        }
        if !seen.contains(&self.rank) {
            return Err(Error::invalid(
                "new_group",
                seq,
                format!("this rank ({}) is not in the group {ranks:?}", self.rank),
            ));
        }
        let n = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let c = inner.groups.entry(ranks.to_vec()).or_insert(0);
            *c += 1;
            *c
        };
        let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let id = format!("{}/group[{}]#{n}", self.comm_id, list.join(","));
        self.sub_communicator(id, ranks)
    }

    fn sub_communicator(&self, comm_id: String, ranks: &[usize]) -> Result<Communicator> {
        let rank = ranks.iter().position(|&r| r == self.rank).expect("member");
        let timeout = self.timeout();
        let store = StoreClient::connect(&self.store_addr, timeout, self.token.as_ref())
            .map_err(|e| store_connect_error("", e))?;
        let ip = {
            let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inner.links.listen_ip()
        };
        // The parent's knobs, with the algorithms it forces now.
        let mut tuning = self.tuning.clone();
        tuning.algo = self
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .algo
            .clone();
        let mut c = Self::build(BuildArgs {
            comm_id,
            rank,
            size: ranks.len(),
            store,
            store_addr: self.store_addr.clone(),
            server: self._server.clone(),
            ip,
            host_id: self.host_id.clone(),
            timeout,
            local_size_hint: None,
            tuning,
            transport: self.transport,
            token: self.token.clone(),
            nsocks: self.nsocks,
        })?;
        c.thresholds = self.thresholds;
        Ok(c)
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
                        recvs.push(RecvOp::p2p_data(peer, h.tag, buf));
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

/// Connect to the store at `addr` as world rank `rank`, skipping a store whose world has
/// already formed: a communicator that was dropped and is being created again on the same
/// master port (`InitHcom` after `DestroyHcom`) can come back while rank 0 still holds the old
/// store, whose peer list is stale. Rank 0 publishes the list only after every rank's record
/// is in, which this (new) rank's is not yet, so a store with a list is never this join's.
/// That store goes away when rank 0 drops its communicator and rank 0's new one takes the
/// port, so this rank keeps trying until `timeout`. A store whose list is rank 0's refusal
/// (the ranks disagree) fails this rank with that reason.
fn join_store(
    addr: &str,
    rank: usize,
    timeout: Duration,
    token: Option<&JobToken>,
) -> Result<StoreClient> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    let list_key = bootstrap::peer_list_key("world");
    let store_error = |e| Error::Config(format!("rank {rank}: rendezvous store at {addr}: {e}"));
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut store = StoreClient::connect(addr, left.max(Duration::from_millis(10)), token)
            .map_err(|e| match e {
                // Say how long this rank tried in all, not in this last attempt.
                StoreError::Unreachable { addr, last, .. } => StoreError::Unreachable {
                    addr,
                    after: timeout,
                    last,
                },
                other => other,
            })
            .map_err(|e| store_connect_error(&format!("rank {rank}: "), e))?;
        if !store.check(&list_key).map_err(store_error)? {
            return Ok(store);
        }
        let list = store
            .get(&list_key, Duration::from_millis(100))
            .map_err(store_error)?;
        if let Some(why) = bootstrap::refusal(&list) {
            return Err(Error::Config(why));
        }
        drop(store);
        if Instant::now() + pause >= deadline {
            return Err(Error::Config(format!(
                "rank {rank}: the rendezvous store at {addr} still served a communicator formed \
                 without this rank after {timeout:?}: rank 0 has not dropped its earlier \
                 communicator on this port (drop it first), or another job uses the port"
            )));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// This rank is done with the store's part of setting up communicator `comm_id`: the last of
/// its `size` ranks to say so publishes that every rank is.
fn mark_built(store: &mut StoreClient, comm_id: &str, size: usize) -> Result<()> {
    let err = |e: crate::bootstrap::store::StoreError| {
        Error::Config(format!("setting up '{comm_id}': {e}"))
    };
    if store.add(&format!("{comm_id}/built"), 1).map_err(err)? == size as i64 {
        store.set(&all_built_key(comm_id), b"1").map_err(err)?;
    }
    Ok(())
}

/// The store key [`mark_built`]'s last rank sets: every rank of `comm_id` is built.
fn all_built_key(comm_id: &str) -> String {
    format!("{comm_id}/built/all")
}

/// [`mark_built`], then wait until every rank of `comm_id` has (for the rank whose
/// communicator holds the store).
fn wait_until_built(
    store: &mut StoreClient,
    comm_id: &str,
    size: usize,
    timeout: Duration,
) -> Result<()> {
    mark_built(store, comm_id, size)?;
    store
        .get(&all_built_key(comm_id), timeout)
        .map(|_| ())
        .map_err(|e| {
            Error::Config(format!(
                "setting up '{comm_id}': not every one of its {size} ranks finished within {timeout:?} ({e})"
            ))
        })
}

/// What came of [`share_segment`].
enum Shared<S> {
    /// Every rank that had to has the segment.
    Ready(S),
    /// The leader could not create it (or chose not to); its reason.
    NotCreated(String),
    /// The leader created it, but a rank could not map it (or the vote ran out of time).
    NotEverywhere,
}

/// The protocol by which ranks of one host share a segment: the leader creates it and
/// publishes `record` ("NAME PARAMETER") under `prefix`; every other rank attaches and votes
/// (1 = attached, 1000 = failed) under `prefix/attached`; once all `voters` voted (or the
/// deadline passed) the leader unlinks the name, whatever happened, so nothing is left in
/// /dev/shm even if a rank crashes later, and publishes the verdict under `prefix/ok`.
#[allow(clippy::too_many_arguments)]
fn share_segment<S>(
    store: &mut StoreClient,
    prefix: &str,
    leader: bool,
    voters: usize,
    deadline: Instant,
    serr: &dyn Fn(crate::bootstrap::store::StoreError) -> Error,
    create: impl FnOnce() -> std::io::Result<(S, String)>,
    attach: impl FnOnce(&str, &str) -> Result<Option<S>>,
    unlink: impl Fn(&S),
) -> Result<Shared<S>> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let votes = format!("{prefix}/attached");
    let verdict_key = format!("{prefix}/ok");
    if leader {
        return match create() {
            Ok((seg, record)) => {
                let votes_in = (|| -> Result<bool> {
                    store.set(prefix, record.as_bytes()).map_err(serr)?;
                    loop {
                        let v = store.add(&votes, 0).map_err(serr)?;
                        if v % 1000 + v / 1000 >= voters as i64 {
                            return Ok(v / 1000 == 0);
                        }
                        if left().is_zero() {
                            return Ok(false);
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                })();
                unlink(&seg);
                let ok = votes_in?;
                store
                    .set(&verdict_key, if ok { b"1" } else { b"0" })
                    .map_err(serr)?;
                Ok(if ok {
                    Shared::Ready(seg)
                } else {
                    Shared::NotEverywhere
                })
            }
            Err(e) => {
                store
                    .set(prefix, format!("none {e}").as_bytes())
                    .map_err(serr)?;
                store.set(&verdict_key, b"0").map_err(serr)?;
                Ok(Shared::NotCreated(e.to_string()))
            }
        };
    }
    let v = store.get(prefix, left()).map_err(serr)?;
    let v = String::from_utf8_lossy(&v).into_owned();
    let (name, rest) = v.split_once(' ').unwrap_or((v.as_str(), ""));
    if name == "none" {
        store.get(&verdict_key, left()).map_err(serr)?;
        return Ok(Shared::NotCreated(rest.to_string()));
    }
    let attached = attach(name, rest)?;
    store
        .add(&votes, if attached.is_some() { 1 } else { 1000 })
        .map_err(serr)?;
    let verdict = store.get(&verdict_key, left()).map_err(serr)?;
    Ok(match attached {
        Some(seg) if verdict == b"1" => Shared::Ready(seg),
        _ => Shared::NotEverywhere,
    })
}

/// A segment name unique to this job and host: `kind`, the communicator, the creator's pid and
/// the time.
fn segment_name(kind: &str, comm_id: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "/hcomm-{kind}{:x}-{}-{nanos:x}",
        hash64(comm_id) & 0xffff_ffff,
        std::process::id()
    )
}

/// Create (rank 0) or attach (others) the communicator's shared-memory segment
/// ([`share_segment`]). Any failure means TCP for everyone, unless `strict` (the transport
/// is `shm`, `HCOMM_TRANSPORT=shm`): then it is an error.
#[allow(clippy::too_many_arguments)]
fn setup_shm(
    store: &mut StoreClient,
    comm_id: &str,
    rank: usize,
    size: usize,
    chunk: usize,
    policy: WaitPolicy,
    abort: Arc<AtomicBool>,
    timeout: Duration,
    strict: bool,
) -> Result<Option<crate::shm::ShmGroup>> {
    use crate::shm::{Layout, ShmGroup};
    let serr =
        |e: crate::bootstrap::store::StoreError| Error::Config(format!("shared memory setup: {e}"));
    let shared = share_segment(
        store,
        &format!("{comm_id}/shm"),
        rank == 0,
        size - 1,
        Instant::now() + timeout,
        &serr,
        || {
            let layout = Layout { size, chunk };
            let name = segment_name("", comm_id);
            match ShmGroup::create(&name, layout, 0, policy, abort.clone()) {
                Ok(g) => Ok((g, format!("{name} {}", layout.chunk))),
                Err(e) => {
                    tracing::warn!(
                        "cannot create shared memory {name} ({} bytes): {e}; using TCP within the host",
                        layout.bytes()
                    );
                    Err(e)
                }
            }
        },
        |name, rest| {
            let chunk = record_size(name, rest)?;
            match ShmGroup::attach(name, Layout { size, chunk }, rank, policy, abort.clone()) {
                Ok(g) => Ok(Some(g)),
                Err(e) => {
                    tracing::warn!(
                        "cannot attach shared memory {name}: {e}; using TCP within the host"
                    );
                    Ok(None)
                }
            }
        },
        |g| {
            let _ = g.unlink();
        },
    )?;
    let group = match shared {
        Shared::Ready(g) => Some(g),
        Shared::NotCreated(e) if strict && rank == 0 => {
            return Err(Error::Config(format!("HCOMM_TRANSPORT=shm: cannot create shared memory: {e} (check /dev/shm with `hcomm doctor`)")));
        }
        _ if strict => {
            return Err(Error::Config(
                "HCOMM_TRANSPORT=shm: a rank could not map the shared memory".into(),
            ));
        }
        _ => None,
    };
    if let Some(g) = &group {
        tracing::info!(
            rank,
            "shared memory ready: {} bytes for {size} ranks",
            g.footprint()
        );
    }
    Ok(group)
}

/// The size in a published segment record (`NAME SIZE`: the part after the name).
fn record_size(name: &str, rest: &str) -> Result<usize> {
    rest.trim()
        .parse()
        .map_err(|_| Error::Config(format!("bad shared memory record '{name} {rest}'")))
}

/// Create (the host's lowest rank) or attach (the others) the segment of this host's
/// point-to-point rings ([`share_segment`]). `local` lists the ranks on this host, in order.
/// Any failure means TCP for point-to-point within the host, unless `strict` (the transport
/// is `shm`): then it is an error.
fn setup_p2p_shm(
    store: &mut StoreClient,
    comm_id: &str,
    rank: usize,
    local: &[usize],
    ring_bytes: Option<usize>,
    timeout: Duration,
    strict: bool,
) -> Result<Option<crate::shm::p2p::P2pShm>> {
    use crate::shm::p2p::{ring_bytes_for, P2pLayout, P2pShm};
    let serr = |e: crate::bootstrap::store::StoreError| {
        Error::Config(format!("shared memory (point-to-point) setup: {e}"))
    };
    let leader = local[0];
    let me = local.iter().position(|&r| r == rank).expect("a local rank");
    let ranks = local.len();
    let ring = ring_bytes_for(ranks, ring_bytes);
    let shared = share_segment(
        store,
        &format!("{comm_id}/p2p/{leader}"),
        rank == leader,
        ranks - 1,
        Instant::now() + timeout,
        &serr,
        || {
            if ring == 0 {
                return Err(std::io::Error::other("HCOMM_SHM_P2P_BYTES=0"));
            }
            let layout = P2pLayout { ranks, ring };
            let name = segment_name("p2p-", comm_id);
            match P2pShm::create(&name, layout, me) {
                Ok(s) => Ok((s, format!("{name} {ring}"))),
                Err(e) => {
                    tracing::warn!(
                        "cannot create shared memory {name} ({} bytes): {e}; point-to-point uses TCP within the host",
                        layout.bytes()
                    );
                    Err(e)
                }
            }
        },
        |name, rest| {
            let ring = record_size(name, rest)?;
            match P2pShm::attach(name, P2pLayout { ranks, ring }, me) {
                Ok(s) => Ok(Some(s)),
                Err(e) => {
                    tracing::warn!(
                        "cannot attach shared memory {name}: {e}; point-to-point uses TCP within the host"
                    );
                    Ok(None)
                }
            }
        },
        |s| {
            let _ = s.unlink();
        },
    )?;
    let shm = match shared {
        Shared::Ready(s) => Some(s),
        // Turned off (HCOMM_SHM_P2P_BYTES=0) is not a failure.
        Shared::NotCreated(e) if strict && rank == leader && ring != 0 => {
            return Err(Error::Config(format!("HCOMM_TRANSPORT=shm: cannot create shared memory for point-to-point: {e} (check /dev/shm with `hcomm doctor`)")));
        }
        Shared::NotEverywhere if strict => {
            return Err(Error::Config(
                "HCOMM_TRANSPORT=shm: a rank could not map the point-to-point shared memory".into(),
            ));
        }
        _ => None,
    };
    if let Some(s) = &shm {
        tracing::info!(
            rank,
            "point-to-point shared memory ready: {} bytes for {ranks} local ranks",
            s.footprint()
        );
    }
    Ok(shm)
}

/// See [`Communicator::hierarchical_layout`].
fn compute_hierarchical_layout(hosts: &[String], rank: usize) -> Option<(usize, usize, usize)> {
    let mut distinct: Vec<&String> = Vec::new();
    for h in hosts {
        if !distinct.contains(&h) {
            distinct.push(h);
        }
    }
    let per = hosts.len() / distinct.len().max(1);
    if distinct.len() < 2
        || per < 2
        || distinct
            .iter()
            .any(|h| hosts.iter().filter(|x| x == h).count() != per)
    {
        return None;
    }
    let host = distinct.iter().position(|h| **h == hosts[rank])?;
    let local = (0..rank).filter(|&r| hosts[r] == hosts[rank]).count();
    Some((host, local, per))
}

/// Sub-communicators of the hierarchical all-reduce.
pub(crate) struct Hierarchy {
    /// The ranks of this host (shared memory).
    pub within: Communicator,
    /// The ranks with this rank's index on every host (TCP).
    pub across: Communicator,
}

struct BuildArgs {
    comm_id: String,
    rank: usize,
    size: usize,
    store: StoreClient,
    store_addr: String,
    server: Option<Arc<StoreServer>>,
    ip: std::net::IpAddr,
    host_id: String,
    timeout: Duration,
    local_size_hint: Option<usize>,
    /// The tuning knobs (read once, when the world communicator is built).
    tuning: Tuning,
    transport: TransportKind,
    token: Option<JobToken>,
    nsocks: usize,
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
