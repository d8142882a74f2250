//! Joining a job: the rendezvous store, address selection, host identity, and the exchange of
//! listening addresses that turns N processes into a communicator.

pub mod store;

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};
use store::StoreClient;

/// What each rank publishes about itself.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PeerInfo {
    /// Data-link listening address.
    pub addr: SocketAddr,
    /// Host identity (ranks with equal ids share a host).
    pub host_id: String,
}

/// This machine's identity: `HCOMM_HOST_ID`, else hostname + boot id.
pub fn default_host_id() -> String {
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into());
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{host}:{}", boot.trim())
}

/// Choose the local address to listen on: the named interface, the configured host, else the
/// address this host uses to reach the master (loopback when the master is loopback).
pub fn select_listen_ip(
    ifname: Option<&str>,
    listen_host: Option<&str>,
    master_addr: &str,
    master_port: u16,
) -> Result<IpAddr> {
    if let Some(name) = ifname {
        let addrs = nix::ifaddrs::getifaddrs()
            .map_err(|e| Error::Config(format!("cannot list network interfaces: {e}")))?;
        let mut seen = Vec::new();
        let mut v6 = None;
        for ifa in addrs {
            if !seen.contains(&ifa.interface_name) {
                seen.push(ifa.interface_name.clone());
            }
            if ifa.interface_name != name {
                continue;
            }
            if let Some(a) = ifa.address {
                if let Some(v4) = a.as_sockaddr_in() {
                    return Ok(IpAddr::V4(v4.ip()));
                }
                if let Some(a6) = a.as_sockaddr_in6() {
                    v6.get_or_insert(IpAddr::V6(a6.ip()));
                }
            }
        }
        return v6.ok_or_else(|| {
            Error::Config(format!(
                "HCOMM_SOCKET_IFNAME={name}: no such interface with an IP address (interfaces: {})",
                seen.join(", ")
            ))
        });
    }
    if let Some(h) = listen_host {
        let ip = resolve(h, 0).map_err(|e| Error::Config(format!("rank table host '{h}': {e}")))?;
        return Ok(ip.ip());
    }
    let master = resolve(master_addr, master_port)
        .map_err(|e| Error::Config(format!("master address '{master_addr}': {e}")))?;
    if master.ip().is_loopback() {
        return Ok(master.ip());
    }
    // Which local address routes to the master? (A UDP connect sends nothing.)
    let probe = UdpSocket::bind(SocketAddr::new(
        if master.is_ipv4() {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        } else {
            IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
        },
        0,
    ))
    .and_then(|s| s.connect(master).map(|_| s))
    .and_then(|s| s.local_addr())
    .map_err(|e| Error::Config(format!("no route to the master {master}: {e}")))?;
    Ok(probe.ip())
}

/// Resolve `host:port`, preferring IPv4.
pub fn resolve(host: &str, port: u16) -> std::io::Result<SocketAddr> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "resolves to no address"))
}

fn store_err(e: store::StoreError) -> Error {
    Error::Config(format!("bootstrap: {e}"))
}

/// Publish this rank's info under `comm_id` and return every rank's (rank 0 gathers them and
/// publishes the list, so each rank makes O(1) requests).
pub fn exchange_peer_info(
    store: &mut StoreClient,
    comm_id: &str,
    rank: usize,
    size: usize,
    me: &PeerInfo,
    timeout: Duration,
) -> Result<Vec<PeerInfo>> {
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let mine = serde_json::to_vec(me).expect("serialisable");
    store
        .set(&format!("{comm_id}/peer/{rank}"), &mine)
        .map_err(store_err)?;
    let all_key = format!("{comm_id}/peers");
    if rank == 0 {
        let mut all = Vec::with_capacity(size);
        for r in 0..size {
            let v = store.get(&format!("{comm_id}/peer/{r}"), left()).map_err(|e| match e {
                store::StoreError::Timeout(..) => Error::Timeout {
                    ctx: crate::error::OpContext { op: "bootstrap", seq: 0 },
                    peers: vec![r],
                    after: timeout,
                    detail: format!("rank {r} never joined communicator '{comm_id}' ({size} ranks expected)"),
                },
                other => store_err(other),
            })?;
            let info: PeerInfo = serde_json::from_slice(&v)
                .map_err(|e| Error::Config(format!("bad peer record of rank {r}: {e}")))?;
            all.push(info);
        }
        store
            .set(&all_key, &serde_json::to_vec(&all).expect("serialisable"))
            .map_err(store_err)?;
        Ok(all)
    } else {
        let v = store.get(&all_key, left()).map_err(|e| match e {
            store::StoreError::Timeout(..) => Error::Timeout {
                ctx: crate::error::OpContext { op: "bootstrap", seq: 0 },
                peers: vec![0],
                after: timeout,
                detail: format!("rank 0 did not publish the peer list of '{comm_id}' (some rank has not joined)"),
            },
            other => store_err(other),
        })?;
        let all: Vec<PeerInfo> =
            serde_json::from_slice(&v).map_err(|e| Error::Config(format!("bad peer list: {e}")))?;
        if all.len() != size {
            return Err(Error::Config(format!(
                "peer list has {} entries, expected {size} (two jobs sharing a master port?)",
                all.len()
            )));
        }
        Ok(all)
    }
}
