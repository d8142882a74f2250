//! Growing a communicator: [`Communicator::grow`] (collective over its ranks) and
//! [`Communicator::join_grown`] (the new processes), so that a replacement can take the place
//! of a lost rank after a [`shrink`](Communicator::shrink).
//!
//! Rank 0 of the communicator starts a rendezvous store on the address it is given and
//! publishes there what the newcomers need (the new communicator's name and size); the
//! members learn the store's exact address by a broadcast; everyone then goes through
//! [`Communicator::build`]. The members keep their ranks; the newcomers take the next ones,
//! in the order they reached the store. The job token guards the store and the links as
//! always, so only processes that hold it can join.
//!
//! It may use the communicator's collectives, the bootstrap store and [`super::build`].

use super::build::{open_trace, BuildArgs};
use super::join::store_connect_error;
use super::Communicator;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::bootstrap::store::{StoreClient, StoreServer};
use crate::bootstrap::{self};
use crate::config::{BootstrapConfig, Tuning};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// The store key where rank 0 publishes [`GrowInfo`].
const INFO_KEY: &str = "hcomm/grow/info";
/// Room for the store's address in the broadcast to the members.
const ADDR_BYTES: usize = 256;

/// What a newcomer learns from the grow store.
#[derive(Serialize, Deserialize)]
struct GrowInfo {
    comm_id: String,
    old_size: usize,
    size: usize,
}

impl Communicator {
    /// A communicator of this one's ranks (keeping their ranks) and `count` new processes
    /// (ranks `world_size()..world_size() + count`, in the order they arrive), which call
    /// [`join_grown`](Self::join_grown) with `addr`. Collective over this communicator; its
    /// rank 0 hosts the rendezvous on `addr` (`HOST:PORT` of its host, which the newcomers can
    /// reach; port 0 picks one, then only the members know it, which suits tests). Waits up
    /// to the timeout for the newcomers. This communicator stays usable.
    pub fn grow(&self, count: usize, addr: &str) -> Result<Communicator> {
        let seq = self.peek_seq();
        if count == 0 {
            return Err(Error::invalid("grow", seq, "count must be at least 1"));
        }
        let timeout = self.timeout();
        let start = Instant::now();
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| Error::invalid("grow", seq, format!("'{addr}' is not HOST:PORT")))?;
        let n = self.size;
        let grows = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inner.grows += 1;
            inner.grows
        };
        let comm_id = format!("{}/grow{grows}+{count}", self.comm_id);
        let mut server = None;
        let mut addr_buf = [0u8; ADDR_BYTES];
        let mut start_failed = None;
        if self.rank == 0 {
            match bootstrap::resolve(host, port)
                .and_then(|a| StoreServer::start(a, self.token.clone()))
            {
                Ok(s) => {
                    let a = s.addr().to_string();
                    addr_buf[..a.len()].copy_from_slice(a.as_bytes());
                    server = Some(Arc::new(s));
                }
                // Told to the others as an empty address, so that they fail too.
                Err(e) => start_failed = Some(format!("cannot listen on {addr}: {e}")),
            }
        }
        self.broadcast_bytes(&mut addr_buf, DType::U8, 0)?;
        let len = addr_buf.iter().position(|&b| b == 0).unwrap_or(ADDR_BYTES);
        let store_addr = String::from_utf8_lossy(&addr_buf[..len]).into_owned();
        if store_addr.is_empty() {
            return Err(Error::Config(format!(
                "grow: rank 0 {}",
                start_failed.unwrap_or_else(|| format!("cannot listen on {addr}"))
            )));
        }
        let mut store = StoreClient::connect(&store_addr, timeout, self.token.as_ref())
            .map_err(|e| store_connect_error("", e))?;
        if self.rank == 0 {
            let info = GrowInfo {
                comm_id: comm_id.clone(),
                old_size: n,
                size: n + count,
            };
            store
                .set(INFO_KEY, &serde_json::to_vec(&info).expect("serialisable"))
                .map_err(|e| store_connect_error("", e))?;
        }
        let tuning = self.inherited_tuning();
        let mut c = Self::build(BuildArgs {
            comm_id,
            rank: self.rank,
            size: n + count,
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
        })?;
        c.thresholds = self.thresholds;
        tracing::info!(
            rank = self.rank,
            size = n + count,
            "grow: {count} rank(s) joined in {:?}",
            start.elapsed()
        );
        Ok(c)
    }

    /// Join a communicator that is growing ([`grow`](Self::grow) on its ranks) through the
    /// rendezvous at `cfg`'s master address ([`BootstrapConfig::for_joining`] reads the
    /// rest, job token included, from the environment). This process gets the next free rank.
    pub fn join_grown(cfg: &BootstrapConfig) -> Result<Communicator> {
        let tuning = Tuning::from_env()?;
        let token = cfg.token()?;
        let timeout = cfg.timeout.min(BootstrapConfig::MAX_TIMEOUT);
        let store_addr = format!("{}:{}", cfg.master_addr, cfg.master_port);
        let mut store = StoreClient::connect(&store_addr, timeout, token.as_ref())
            .map_err(|e| store_connect_error("", e))?;
        let info = store
            .get(INFO_KEY, timeout)
            .map_err(|e| store_connect_error("", e))?;
        let info: GrowInfo = serde_json::from_slice(&info).map_err(|e| {
            Error::Config(format!(
                "grow: the store at {store_addr} holds no grow: {e}"
            ))
        })?;
        let arrived = store
            .add(&format!("{}/joined", info.comm_id), 1)
            .map_err(|e| store_connect_error("", e))?;
        let rank = info.old_size + arrived as usize - 1;
        if rank >= info.size {
            return Err(Error::Config(format!(
                "grow: the communicator at {store_addr} takes {} new rank(s) and they have all joined",
                info.size - info.old_size
            )));
        }
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
        let c = Self::build(BuildArgs {
            comm_id: info.comm_id,
            rank,
            size: info.size,
            store,
            store_addr,
            server: None,
            ip,
            listener: None,
            host_id,
            timeout,
            local_size_hint: None,
            tracer: open_trace(&tuning, rank)?,
            tuning,
            transport: cfg.transport,
            token,
            nsocks: cfg.nsocks,
        })?;
        tracing::info!(rank, size = info.size, "joined a growing communicator");
        Ok(c)
    }
}
