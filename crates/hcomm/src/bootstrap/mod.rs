//! Joining a job: the rendezvous store, address selection, host identity, and the exchange of
//! listening addresses that turns N processes into a communicator.

pub mod claim;
pub mod port;
pub mod store;

pub use port::free_master_port;

use crate::base::error::{Error, Result};
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
    /// Data sockets per pair of ranks (`HCOMM_NSOCKS`); must be the same on every rank.
    #[serde(default = "one")]
    pub nsocks: usize,
    /// `HCOMM_TRANSPORT` (`auto`, `tcp`, `shm`): ranks that skip shared memory (`tcp`) and
    /// ranks that set it up must not meet in one job (the latter would wait for the former).
    #[serde(default = "auto")]
    pub transport: String,
    /// The number of ranks this rank was told the communicator has (0: not said), so that
    /// ranks started with different world sizes fail at once, saying so.
    #[serde(default)]
    pub world_size: usize,
}

fn one() -> usize {
    1
}

fn auto() -> String {
    "auto".into()
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
    if let Some(subnet) = ifname.filter(|n| n.contains('/')) {
        return listen_ip_in_subnet(subnet);
    }
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

/// Parse `ADDR/LEN` (IPv4 or IPv6).
pub fn parse_subnet(s: &str) -> Result<(IpAddr, u8)> {
    let bad = |why: &str| {
        Error::Config(format!(
            "HCOMM_SOCKET_IFNAME={s}: {why} (expected an interface name or a subnet such as 10.0.0.0/24)"
        ))
    };
    let (addr, len) = s.split_once('/').ok_or_else(|| bad("no '/'"))?;
    let ip: IpAddr = addr.trim().parse().map_err(|_| bad("not an IP address"))?;
    let len: u8 = len.trim().parse().map_err(|_| bad("bad prefix length"))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err(bad("prefix length too long"));
    }
    Ok((ip, len))
}

/// True if `ip` lies in `net/len`.
pub fn in_subnet(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    let (a, b, bits) = match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u32::from(a) as u128, u32::from(b) as u128, 32u32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let len = u32::from(len);
    if len == 0 {
        return true;
    }
    let shift = bits - len;
    (a >> shift) == (b >> shift)
}

/// The first local address inside `subnet` (`HCOMM_SOCKET_IFNAME=10.0.0.0/24`): choosing the
/// network by subnet works on hosts whose interface names differ.
fn listen_ip_in_subnet(subnet: &str) -> Result<IpAddr> {
    let (net, len) = parse_subnet(subnet)?;
    let addrs = nix::ifaddrs::getifaddrs()
        .map_err(|e| Error::Config(format!("cannot list network interfaces: {e}")))?;
    let mut seen = Vec::new();
    for ifa in addrs {
        let ip = ifa.address.and_then(|a| {
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        });
        if let Some(ip) = ip {
            if in_subnet(ip, net, len) {
                return Ok(ip);
            }
            seen.push(format!("{}={ip}", ifa.interface_name));
        }
    }
    Err(Error::Config(format!(
        "HCOMM_SOCKET_IFNAME={subnet}: no local address in that subnet (addresses: {})",
        seen.join(", ")
    )))
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
    let started = Instant::now();
    let deadline = started + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    // A job that cannot form is otherwise silent until the timeout (300 s by default): after
    // 10 s (or half the timeout) of waiting, this rank says once on stderr whom it waits for.
    let notice_at = started + store::STILL_TRYING_NOTICE.min(timeout / 2);
    let mut told = false;
    let mut get_telling = |store: &mut StoreClient,
                           key: &str,
                           tell: &dyn Fn(&mut StoreClient) -> String|
     -> std::result::Result<Vec<u8>, store::StoreError> {
        if !told && notice_at < deadline {
            match store.get(key, notice_at.saturating_duration_since(Instant::now())) {
                Err(store::StoreError::Timeout(..)) => {
                    told = true;
                    let notice = format!(
                        "hcomm: rank {rank} has waited {:.1} s {}; waiting until the timeout \
                         ({:.0} s, HCOMM_TIMEOUT)",
                        started.elapsed().as_secs_f64(),
                        tell(store),
                        timeout.as_secs_f64()
                    );
                    tracing::warn!("{notice}");
                    eprintln!("{notice}");
                }
                done => return done,
            }
        }
        store.get(key, left())
    };
    let mine = serde_json::to_vec(&PeerInfo {
        world_size: size,
        ..me.clone()
    })
    .expect("serialisable");
    store
        .set(&peer_key(comm_id, rank), &mine)
        .map_err(store_err)?;
    let all_key = peer_list_key(comm_id);
    // The ranks whose records are not in the store yet (for a timeout's message).
    let missing = |store: &mut StoreClient| -> Vec<usize> {
        (0..size)
            .filter(|&r| !store.check(&peer_key(comm_id, r)).unwrap_or(false))
            .collect()
    };
    let never_joined = |missing: Vec<usize>, who: &str| {
        let list: Vec<String> = missing.iter().map(|m| m.to_string()).collect();
        Error::Timeout {
            ctx: crate::base::error::OpContext {
                op: "bootstrap",
                seq: 0,
            },
            detail: format!(
                "{who}rank{} {} never joined communicator '{comm_id}' ({size} ranks expected)",
                if missing.len() > 1 { "s" } else { "" },
                list.join(", ")
            ),
            peers: missing,
            after: timeout,
        }
    };
    if rank == 0 {
        let mut all = Vec::with_capacity(size);
        // What rank 0 publishes instead of the list when the ranks cannot form one, so that
        // every rank fails at once with the same reason.
        let refuse = |store: &mut StoreClient, why: String| -> Result<Vec<PeerInfo>> {
            let record = serde_json::json!({ "error": why });
            store
                .set(&all_key, record.to_string().as_bytes())
                .map_err(store_err)?;
            // This rank's store goes with its failure: give the ranks waiting for the list a
            // moment to read the reason (each counts itself as it does).
            let readers = (size - missing(store).len()).saturating_sub(1) as i64;
            let until = Instant::now() + left().min(Duration::from_secs(2));
            while store.add(&refusal_read_key(comm_id), 0).unwrap_or(readers) < readers
                && Instant::now() < until
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(Error::Config(why))
        };
        let waiting_for = |store: &mut StoreClient| {
            let list: Vec<String> = missing(store).iter().map(|m| m.to_string()).collect();
            format!(
                "for rank(s) [{}] to join communicator '{comm_id}' ({size} ranks expected)",
                list.join(", ")
            )
        };
        for r in 0..size {
            let v = match get_telling(store, &peer_key(comm_id, r), &waiting_for) {
                Ok(v) => v,
                Err(store::StoreError::Timeout(..)) => {
                    return Err(never_joined(missing(store), ""));
                }
                Err(other) => return Err(store_err(other)),
            };
            let info: PeerInfo = serde_json::from_slice(&v)
                .map_err(|e| Error::Config(format!("bad peer record of rank {r}: {e}")))?;
            if info.world_size != 0 && info.world_size != size {
                return refuse(
                    store,
                    format!(
                        "the world size differs between ranks: rank 0 was started with {size} \
                         ranks, rank {r} with {}; start every rank with the same world size",
                        info.world_size
                    ),
                );
            }
            all.push(info);
        }
        store
            .set(&all_key, &serde_json::to_vec(&all).expect("serialisable"))
            .map_err(store_err)?;
        Ok(all)
    } else {
        let waiting_for = |store: &mut StoreClient| {
            let list: Vec<String> = missing(store)
                .iter()
                .filter(|&&r| r != 0)
                .map(|m| m.to_string())
                .collect();
            format!(
                "for the peer list of communicator '{comm_id}' from rank 0, which waits for \
                 rank(s) [{}] to join ({size} ranks expected)",
                list.join(", ")
            )
        };
        let v = match get_telling(store, &all_key, &waiting_for) {
            Ok(v) => v,
            Err(store::StoreError::Timeout(..)) => {
                // Rank 0 publishes the list once every rank's record is in.
                let mut missing = missing(store);
                missing.retain(|&r| r != 0);
                return Err(if missing.is_empty() {
                    Error::Timeout {
                        ctx: crate::base::error::OpContext {
                            op: "bootstrap",
                            seq: 0,
                        },
                        peers: vec![0],
                        after: timeout,
                        detail: format!(
                            "rank 0 did not publish the peer list of '{comm_id}' though every rank joined"
                        ),
                    }
                } else {
                    never_joined(missing, "rank 0 is waiting: ")
                });
            }
            Err(other) => return Err(store_err(other)),
        };
        let all: Vec<PeerInfo> = match serde_json::from_slice(&v) {
            Ok(all) => all,
            Err(e) => {
                let why = refusal(&v);
                if why.is_some() {
                    // Rank 0 waits (briefly) for its readers before dropping the store.
                    let _ = store.add(&refusal_read_key(comm_id), 1);
                }
                return Err(Error::Config(
                    why.unwrap_or_else(|| format!("bad peer list: {e}")),
                ));
            }
        };
        if all.len() != size {
            return Err(Error::Config(format!(
                "the world size differs between ranks: rank 0 was started with {} ranks, \
                 this rank ({rank}) with {size} (or two jobs share a master port)",
                all.len()
            )));
        }
        Ok(all)
    }
}

/// The store key of rank `rank`'s record in communicator `comm_id`.
fn peer_key(comm_id: &str, rank: usize) -> String {
    format!("{comm_id}/peer/{rank}")
}

/// The store key under which rank 0 publishes communicator `comm_id`'s peer list (or why the
/// ranks could not form it): once it exists, the communicator's exchange is over.
pub fn peer_list_key(comm_id: &str) -> String {
    format!("{comm_id}/peers")
}

/// The counter of the ranks that read rank 0's refusal to form communicator `comm_id`.
fn refusal_read_key(comm_id: &str) -> String {
    format!("{comm_id}/peers/refusal-read")
}

/// The reason rank 0 published instead of a peer list, if `record` is one.
pub fn refusal(record: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Refusal {
        error: String,
    }
    serde_json::from_slice::<Refusal>(record)
        .ok()
        .map(|r| r.error)
}

#[cfg(test)]
mod subnet_tests {
    use super::*;

    #[test]
    fn subnets_parse_match_and_select() {
        let (net, len) = parse_subnet("10.77.0.0/24").unwrap();
        assert!(in_subnet("10.77.0.11".parse().unwrap(), net, len));
        assert!(!in_subnet("10.77.1.11".parse().unwrap(), net, len));
        assert!(!in_subnet("::1".parse().unwrap(), net, len));
        let (net6, len6) = parse_subnet("fd00::/8").unwrap();
        assert!(in_subnet("fd12::1".parse().unwrap(), net6, len6));
        for bad in ["10.0.0.0/33", "nope/8", "10.0.0.0/x"] {
            let e = parse_subnet(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
        let ip = select_listen_ip(Some("127.0.0.0/8"), None, "127.0.0.1", 1).unwrap();
        assert!(ip.is_loopback());
        // A documentation subnet no local address is in (this machine has one in 192.0.2/24).
        let absent = ["203.0.113.0/24", "198.51.100.0/24", "192.0.2.0/24"]
            .into_iter()
            .find(|n| select_listen_ip(Some(n), None, "127.0.0.1", 1).is_err())
            .expect("some test subnet is not configured here");
        let e = select_listen_ip(Some(absent), None, "127.0.0.1", 1).unwrap_err();
        assert!(
            e.to_string().contains("no local address in that subnet"),
            "{e}"
        );
    }
}
