//! Sharing the shared-memory segments of one host while a communicator is built: the
//! store protocol by which one rank creates a segment and the others attach and vote
//! ([`share_segment`]), the collectives' segment ([`setup_shm`]) and the point-to-point rings
//! ([`setup_p2p_shm`]), and the segments' names and records.
//!
//! It may use the shared-memory layer ([`crate::shm`]), the store client and
//! [`super::build`]'s `hash64`; nothing of the communicator.

use crate::base::error::{Error, Result};
use crate::bootstrap::store::StoreClient;
use crate::wait::WaitPolicy;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        crate::auth::comm_hash(comm_id) & 0xffff_ffff,
        std::process::id()
    )
}

/// Create (rank 0) or attach (others) the communicator's shared-memory segment
/// ([`share_segment`]). Any failure means TCP for everyone, unless `strict` (the transport
/// is `shm`, `HCOMM_TRANSPORT=shm`): then it is an error.
#[allow(clippy::too_many_arguments)]
pub(super) fn setup_shm(
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
pub(super) fn setup_p2p_shm(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::store::{StoreError, StoreServer};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn segment_names_are_one_component_and_name_kind_comm_and_pid() {
        let pid = std::process::id();
        for (kind, comm) in [
            ("", "world"),
            ("p2p-", "world/split3/c1"),
            ("", "w/group[0,2]#1"),
        ] {
            let name = segment_name(kind, comm);
            let rest = name
                .strip_prefix(&format!("/hcomm-{kind}"))
                .unwrap_or_else(|| panic!("{name}"));
            let parts: Vec<&str> = rest.split('-').collect();
            assert_eq!(parts.len(), 3, "{name}");
            assert_eq!(
                u64::from_str_radix(parts[0], 16).unwrap(),
                crate::auth::comm_hash(comm) & 0xffff_ffff,
                "{name}"
            );
            assert_eq!(parts[1], pid.to_string(), "{name}");
            assert!(u32::from_str_radix(parts[2], 16).is_ok(), "{name}");
            // shm_open: one leading slash and no other, well under NAME_MAX.
            assert!(!name[1..].contains('/') && name.len() < 64, "{name}");
        }
        assert_ne!(
            segment_name("", "world").split('-').nth(1),
            segment_name("", "world/split1/c0").split('-').nth(1),
            "communicators differ"
        );
    }

    #[test]
    fn record_size_parses_the_part_after_the_name() {
        assert_eq!(record_size("/hcomm-1-2-3", "65536").unwrap(), 65536);
        assert_eq!(record_size("/hcomm-1-2-3", " 4096 ").unwrap(), 4096);
        for bad in ["", "x", "-1", "1 2", "0x10"] {
            match record_size("/n", bad) {
                Err(Error::Config(m)) => {
                    assert_eq!(m, format!("bad shared memory record '/n {bad}'"))
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    /// What each rank of `share_segment` ended with: "ready NAME", "not-created WHY" or
    /// "not-everywhere".
    fn outcome(s: Shared<String>) -> String {
        match s {
            Shared::Ready(seg) => format!("ready {seg}"),
            Shared::NotCreated(why) => format!("not-created {why}"),
            Shared::NotEverywhere => "not-everywhere".into(),
        }
    }

    /// Runs `share_segment` on `ranks` ranks (rank 0 leads) of an in-process store: the leader
    /// creates "seg" unless `create_fails`, rank `r` fails to attach when `attach_fails(r)`.
    /// Returns every rank's outcome and how often the leader unlinked.
    fn share(
        ranks: usize,
        create_fails: bool,
        attach_fails: fn(usize) -> bool,
    ) -> (Vec<String>, usize) {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let addr = server.addr().to_string();
        let unlinked = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..ranks)
            .map(|rank| {
                let (addr, unlinked) = (addr.clone(), unlinked.clone());
                std::thread::spawn(move || {
                    let timeout = Duration::from_secs(5);
                    let mut store = StoreClient::connect(&addr, timeout, None).unwrap();
                    let serr = |e: StoreError| Error::Config(e.to_string());
                    share_segment(
                        &mut store,
                        "c/shm",
                        rank == 0,
                        ranks - 1,
                        Instant::now() + timeout,
                        &serr,
                        || {
                            if create_fails {
                                Err(std::io::Error::other("no room"))
                            } else {
                                Ok(("seg".to_string(), "seg 4096".to_string()))
                            }
                        },
                        |name, rest| {
                            assert_eq!((name, record_size(name, rest)?), ("seg", 4096));
                            Ok((!attach_fails(rank)).then(|| name.to_string()))
                        },
                        |_| {
                            unlinked.fetch_add(1, Ordering::SeqCst);
                        },
                    )
                    .map(outcome)
                })
            })
            .collect();
        let out = threads
            .into_iter()
            .map(|t| t.join().unwrap().unwrap())
            .collect();
        (out, unlinked.load(Ordering::SeqCst))
    }

    #[test]
    fn share_segment_when_every_rank_attaches() {
        let (out, unlinked) = share(3, false, |_| false);
        assert_eq!(out, ["ready seg"; 3]);
        assert_eq!(unlinked, 1, "the leader unlinks the name once all attached");
        let (out, _) = share(1, false, |_| false);
        assert_eq!(out, ["ready seg"], "alone: no voters");
    }

    #[test]
    fn share_segment_when_a_rank_cannot_attach() {
        let (out, unlinked) = share(3, false, |r| r == 2);
        assert_eq!(out, ["not-everywhere"; 3]);
        assert_eq!(unlinked, 1);
    }

    #[test]
    fn share_segment_when_the_leader_cannot_create() {
        let (out, unlinked) = share(3, true, |_| false);
        assert_eq!(out, ["not-created no room"; 3]);
        assert_eq!(unlinked, 0);
    }
}
