//! Choosing a master port for a job that is about to start.
//!
//! A launcher (or a test) picks the port, then rank 0 binds it a moment later. A port the
//! system handed out for `bind(…:0)` lies in its ephemeral range, where the system also
//! numbers every other socket that does not ask for a port (a connection's local end, another
//! job's listener on port 0): in that moment one of those can take it, and rank 0 then fails
//! to listen while the other ranks find nobody there. Ports outside the ephemeral range are
//! only ever taken by a program that names them, so the port is picked there.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::{TcpListener, ToSocketAddrs};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The lowest port considered (below it are registered services).
const LOWEST: u16 = 10000;

/// The system's ephemeral port range (`/proc/sys/net/ipv4/ip_local_port_range`; Linux's
/// default when it cannot be read).
fn ephemeral_range() -> RangeInclusive<u16> {
    let text =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut bounds = text
        .split_whitespace()
        .filter_map(|w| w.parse::<u16>().ok());
    match (bounds.next(), bounds.next()) {
        (Some(lo), Some(hi)) if lo <= hi => lo..=hi,
        _ => 32768..=60999,
    }
}

/// The ports from [`LOWEST`] up that lie outside `ephemeral`, in order.
fn candidates(ephemeral: &RangeInclusive<u16>) -> Vec<u16> {
    (LOWEST..=u16::MAX)
        .filter(|p| !ephemeral.contains(p))
        .collect()
}

/// A TCP port free on `host` right now, outside the system's ephemeral range (see the module
/// comment) and never the same twice in one process, so that jobs started side by side (tests
/// do) get different ports. Falls back to a port the system picks when every candidate is
/// taken or the ephemeral range leaves none.
pub fn free_master_port(host: &str) -> io::Result<u16> {
    /// How many candidates this process has looked at: each call starts past the last.
    static TRIED: AtomicUsize = AtomicUsize::new(0);
    // Resolve once (a host name would otherwise be looked up for every candidate).
    let mut addr = (host, 0)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address")))?;
    let pool = candidates(&ephemeral_range());
    if !pool.is_empty() {
        // A different starting point in every process (the same for all its calls), so that
        // processes started together (several launchers, several test binaries) seldom try
        // the same ports.
        static START: OnceLock<usize> = OnceLock::new();
        let start = *START.get_or_init(|| {
            let mut h = RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish() as usize
        });
        for _ in 0..pool.len().min(512) {
            let i = TRIED.fetch_add(1, Ordering::Relaxed);
            addr.set_port(pool[start.wrapping_add(i) % pool.len()]);
            match TcpListener::bind(addr) {
                Ok(_) => return Ok(addr.port()),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => continue,
                // Not an address of this host, no permission, ...: no port would do.
                Err(e) => return Err(e),
            }
        }
    }
    addr.set_port(0);
    Ok(TcpListener::bind(addr)?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_skip_the_ephemeral_range() {
        let pool = candidates(&(32768..=60999));
        assert_eq!(pool.first(), Some(&LOWEST));
        assert_eq!(pool.last(), Some(&u16::MAX));
        assert!(pool.iter().all(|p| !(32768..=60999).contains(p)));
        assert_eq!(pool.len(), (32768 - 10000) + (65535 - 60999));
        assert!(candidates(&(1..=65535)).is_empty());
    }

    #[test]
    fn ports_are_free_outside_the_ephemeral_range_and_distinct() {
        let ephemeral = ephemeral_range();
        let ports: Vec<u16> = (0..50)
            .map(|_| free_master_port("127.0.0.1").unwrap())
            .collect();
        for &p in &ports {
            assert!(
                p >= LOWEST && !ephemeral.contains(&p),
                "port {p} in {ephemeral:?}"
            );
            TcpListener::bind(("127.0.0.1", p)).expect("the port is free");
        }
        // One quick answer for an address that is not this host's (TEST-NET-1).
        assert_eq!(
            free_master_port("192.0.2.1").unwrap_err().kind(),
            io::ErrorKind::AddrNotAvailable
        );
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
    }
}
