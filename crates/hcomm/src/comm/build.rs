//! Building a communicator: joining the job (from the environment, a rank table or a
//! [`BootstrapConfig`]), and [`Communicator::build`], which every communicator (the world and
//! its sub-communicators) goes through: exchange of the ranks' addresses through the
//! rendezvous store, the data links, the shared-memory segments, the hierarchical layout.
//!
//! It may use the store steps of [`super::join`], the segment sharing of [`super::shm_setup`],
//! the bootstrap, config and transport layers, and the communicator's fields (it makes them).

use super::join::{compute_hierarchical_layout, join_store, mark_built, wait_until_built};
use super::shm_setup::{setup_p2p_shm, setup_shm};
use super::{Communicator, Inner};
use crate::algo::select::Thresholds;
use crate::algo::Algo;
use crate::auth::JobToken;
use crate::base::error::{Error, Result};
use crate::bootstrap::store::{StoreClient, StoreServer};
use crate::bootstrap::{self, PeerInfo};
use crate::comm::traffic::TrafficTable;
use crate::config::{BootstrapConfig, TransportKind, Tuning};
use crate::engine::Engine;
use crate::history::History;
use crate::trace::Tracer;
use crate::transport::tcp::{SharedListener, TcpLinks};
use crate::wait::WaitPolicy;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
        let cfg = &BootstrapConfig {
            timeout: cfg.timeout.min(BootstrapConfig::MAX_TIMEOUT),
            ..cfg.clone()
        };
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
            listener: None,
            host_id,
            timeout: cfg.timeout,
            local_size_hint: cfg.local_world_size,
            tracer: open_trace(&tuning, cfg.rank)?,
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

    pub(super) fn build(a: BuildArgs) -> Result<Communicator> {
        let BuildArgs {
            comm_id,
            rank,
            size,
            mut store,
            store_addr,
            server,
            ip,
            listener,
            host_id,
            timeout,
            local_size_hint,
            tuning,
            transport,
            token,
            nsocks,
            tracer,
        } = a;
        if !(1..=BootstrapConfig::MAX_NSOCKS).contains(&nsocks) {
            return Err(Error::Config(format!(
                "HCOMM_NSOCKS={nsocks}: the number of sockets per pair of ranks must be 1 to {}",
                BootstrapConfig::MAX_NSOCKS
            )));
        }
        let listener = match listener {
            Some(shared) => shared,
            None => SharedListener::bind(ip)
                .map_err(|e| Error::Config(format!("cannot listen on {ip}: {e}")))?,
        };
        let addr = listener.addr();
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
        let policy = WaitPolicy::for_local_ranks(local_size, tuning.spin_us, tuning.cpus);
        let mut links = TcpLinks::new(
            rank,
            listener,
            peers.iter().map(|p| p.addr).collect(),
            crate::auth::comm_hash(&comm_id),
            token.clone(),
            policy,
            nsocks,
        )
        .map_err(|e| Error::Config(format!("cannot start accepting data links: {e}")))?;
        let (listen_addr, link_counters) = (links.listen_addr(), links.counters());
        let aborted = links.abort_flag();
        let (revocation, notifier) = (links.revocation(), links.notifier());
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
            .map(|mut group| {
                group.set_publishing(tuning.shm_publish);
                group
            })
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
        let hosts_contiguous = hier_layout
            .is_some_and(|(_, _, per)| (0..size).all(|r| hosts[r] == hosts[r - r % per]));
        if server.is_some() {
            // The store lives as long as this communicator: wait for every rank to be done
            // with it, so that dropping the communicator at once cannot take it away from a
            // rank still setting up (that rank would wait out its timeout).
            wait_until_built(&mut store, &comm_id, size, timeout)?;
        } else {
            mark_built(&mut store, &comm_id, size)?;
        }
        drop(store);
        let trace = tracer.map(|t| t.track(&track_name(&comm_id, rank, size)));
        let tracing = AtomicBool::new(trace.is_some());
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
            revocation,
            notifier,
            listen_ip: ip,
            inner: Mutex::new(Inner {
                links,
                seq: 0,
                poisoned: None,
                algo: {
                    let mut forced = [Algo::Auto; 16];
                    for (&c, &a) in &tuning.algo {
                        forced[c as usize] = a;
                    }
                    forced
                },
                logged: [0; 16],
                splits: 0,
                grows: 0,
                groups: HashMap::new(),
                open_conns: HashSet::new(),
                p2p_ids: vec![0; size],
                history: History::new(rank),
                shm,
                traffic: TrafficTable::default(),
                trace,
                span: None,
                gather_cache: Default::default(),
            }),
            tracing,
            trace_label: Mutex::new(None),
            _server: server,
            transport,
            nsocks,
            shm_bytes,
            p2p_shm_bytes,
            store: Mutex::new(None),
            windows: std::sync::atomic::AtomicU64::new(0),
            hierarchy: Mutex::new(None),
            hier_layout,
            hosts_contiguous,
            corrupt_results: tuning.corrupt_one,
            deterministic: AtomicBool::new(tuning.deterministic),
            accumulate_f32: AtomicBool::new(tuning.accumulate_f32),
            skip_zeros: AtomicBool::new(tuning.skip_zeros),
            gather_cache_budget: std::sync::atomic::AtomicUsize::new(
                tuning
                    .gather_cache_mb
                    .map_or_else(|| default_gather_cache_bytes(local_size), |mb| mb << 20),
            ),
            scratch: Mutex::new(Default::default()),
            tuning,
            token,
            listen_addr,
            link_counters,
            posted: Default::default(),
            engine: Engine::default(),
        })
    }
}

/// What [`Communicator::build`] needs: the new communicator's place in the job, its store
/// connection (and rank 0's store itself), where to listen, and the settings it inherits.
pub(super) struct BuildArgs {
    pub(super) comm_id: String,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) store: StoreClient,
    pub(super) store_addr: String,
    pub(super) server: Option<Arc<StoreServer>>,
    pub(super) ip: std::net::IpAddr,
    /// The listener to accept this communicator's links on: its parent's (a sub-communicator
    /// shares it), or `None` to bind a new one on `ip`.
    pub(super) listener: Option<SharedListener>,
    pub(super) host_id: String,
    pub(super) timeout: Duration,
    pub(super) local_size_hint: Option<usize>,
    /// The tuning knobs (read once, when the world communicator is built).
    pub(super) tuning: Tuning,
    pub(super) transport: TransportKind,
    pub(super) token: Option<JobToken>,
    pub(super) nsocks: usize,
    /// The trace this communicator writes to (its parent's, or the one `HCOMM_TRACE` opened).
    pub(super) tracer: Option<Arc<Tracer>>,
}

/// The trace `HCOMM_TRACE` names for `rank` (of a communicator that is not derived from
/// another), opened; the error names the variable and the file.
pub(super) fn open_trace(tuning: &Tuning, rank: usize) -> Result<Option<Arc<Tracer>>> {
    let Some(setting) = &tuning.trace else {
        return Ok(None);
    };
    Tracer::open(setting, rank).map(Some).map_err(|e| {
        Error::Config(format!(
            "HCOMM_TRACE={setting}: cannot create {}: {e}",
            crate::trace::trace_file(setting, rank).display()
        ))
    })
}

/// The name of a communicator's track in a trace.
pub(super) fn track_name(comm_id: &str, rank: usize, size: usize) -> String {
    format!("{comm_id} (rank {rank} of {size})")
}

/// The default of `HCOMM_GATHER_CACHE_MB`: 1/64 of the host's memory shared among its
/// `local_size` ranks, at most 256 MiB (64 MiB when the memory is unknown). Per communicator:
/// a training job's own memory comes first (a 1 GiB default took a 24 GiB host with two
/// 10 GB ranks of the training report's 21 modes over the edge).
fn default_gather_cache_bytes(local_size: usize) -> usize {
    use nix::unistd::{sysconf, SysconfVar};
    let pages = sysconf(SysconfVar::_PHYS_PAGES).ok().flatten();
    let page = sysconf(SysconfVar::PAGE_SIZE).ok().flatten();
    let memory = match (pages, page) {
        (Some(n), Some(p)) if n > 0 && p > 0 => (n as u64).saturating_mul(p as u64),
        _ => return 64 << 20,
    };
    let share = memory / 64 / local_size.max(1) as u64;
    usize::try_from(share.min(256 << 20)).unwrap_or(256 << 20)
}
