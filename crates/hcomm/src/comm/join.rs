//! The rendezvous-store steps of joining a communicator, and where the ranks sit on hosts.
//!
//! * [`join_store`]: reach the job's store, skipping a stale one still serving an earlier
//!   world on the same port;
//! * [`mark_built`] / [`wait_until_built`] / [`all_built_key`]: "every rank of this
//!   communicator is done with the store", so that rank 0 never takes the store away from a
//!   rank still setting up;
//! * [`compute_hierarchical_layout`]: a pure function of the ranks' host ids.
//!
//! It may use the store client and the bootstrap layer only (and `store_connect_error` of
//! [`super::build`]); nothing of the communicator.

use crate::auth::JobToken;
use crate::base::error::{Error, OpContext, Result};
use crate::bootstrap;
use crate::bootstrap::claim::{self, ProcessIdentity};
use crate::bootstrap::store::{StoreClient, StoreError};
use std::time::{Duration, Instant};

/// How long a formed world's record of this rank may name another live process of this
/// machine before [`join_store`] gives up on it: long enough for a process of an earlier job on
/// the same port to finish exiting, short next to any timeout.
const HELD_RANK_GRACE: Duration = Duration::from_secs(3);

/// Connect to the store at `addr` as world rank `rank`, skipping a store whose world has
/// already formed: a communicator that was dropped and is being created again on the same
/// master port (`InitHcom` after `DestroyHcom`) can come back while rank 0 still holds the old
/// store, whose peer list is stale. Rank 0 publishes the list only after every rank's record
/// is in, which this (new) rank's is not yet, so a store with a list is never this join's.
/// That store goes away when rank 0 drops its communicator and rank 0's new one takes the
/// port, so this rank keeps trying until `timeout`. A store whose list is rank 0's refusal
/// (the ranks disagree) fails this rank with that reason.
///
/// This process records itself as the holder of `rank` ([`claim`]): a second process started
/// with the same rank while the first runs on this machine fails at once (or, when the world
/// has formed, after [`HELD_RANK_GRACE`]), naming the first.
pub(super) fn join_store(
    addr: &str,
    rank: usize,
    timeout: Duration,
    token: Option<&JobToken>,
) -> Result<StoreClient> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    let list_key = bootstrap::peer_list_key("world");
    let store_error = |e| Error::Config(format!("rank {rank}: rendezvous store at {addr}: {e}"));
    let me = ProcessIdentity::current();
    // Since when a formed world's record of this rank has named another live process of this
    // machine (a process of an earlier job that is still exiting gets a moment).
    let mut held_since: Option<Instant> = None;
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
            return match claim::claim(&mut store, rank, &me, addr).map_err(store_error)? {
                Ok(()) => Ok(store),
                Err(why) => Err(Error::Config(why)),
            };
        }
        let list = store
            .get(&list_key, Duration::from_millis(100))
            .map_err(store_error)?;
        if let Some(why) = bootstrap::refusal(&list) {
            return Err(Error::Config(why));
        }
        // Who the formed world's record of this rank names.
        let holder = claim::claimant(&mut store, rank).map_err(store_error)?;
        // (A process that took part in that world is re-initialising: it waits, as before.)
        let rejoining = claim::took_part(&mut store, &me).map_err(store_error)?;
        let held = holder
            .as_ref()
            .filter(|_| !rejoining)
            .and_then(|h| claim::held_by_another(h, &me, rank, addr));
        match (held, held_since) {
            (Some(why), Some(since)) if since.elapsed() >= HELD_RANK_GRACE => {
                return Err(Error::Config(why));
            }
            (Some(_), None) => held_since = Some(Instant::now()),
            (Some(_), Some(_)) => {}
            (None, _) => held_since = None,
        }
        drop(store);
        if Instant::now() + pause >= deadline {
            return Err(Error::Config(format!(
                "rank {rank}: the rendezvous store at {addr} still served a communicator formed \
                 without this rank after {timeout:?}: rank 0 has not dropped its earlier \
                 communicator on this port (drop it first), or another job uses the port{}",
                match &holder {
                    Some(h) if !h.same_process(&me) => format!(
                        " (its rank {rank} is {}, not this process: two processes started \
                         with the same rank?)",
                        h.describe()
                    ),
                    _ => String::new(),
                }
            )));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// This rank is done with the store's part of setting up communicator `comm_id`: the last of
/// its `size` ranks to say so publishes that every rank is.
pub(super) fn mark_built(store: &mut StoreClient, comm_id: &str, size: usize) -> Result<()> {
    let err = |e: crate::bootstrap::store::StoreError| {
        Error::Config(format!("setting up '{comm_id}': {e}"))
    };
    if store.add(&format!("{comm_id}/built"), 1).map_err(err)? == size as i64 {
        store.set(&all_built_key(comm_id), b"1").map_err(err)?;
    }
    Ok(())
}

/// The store key [`mark_built`]'s last rank sets: every rank of `comm_id` is built.
pub(super) fn all_built_key(comm_id: &str) -> String {
    format!("{comm_id}/built/all")
}

/// [`mark_built`], then wait until every rank of `comm_id` has (for the rank whose
/// communicator holds the store).
pub(super) fn wait_until_built(
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

/// (host index, index within the host, ranks per host) of `rank`, when the ranks of `hosts`
/// (the host id of every rank) form at least 2 hosts of L >= 2 ranks each, hosts numbered in
/// the order of their lowest rank; `None` otherwise. See
/// [`Communicator::hierarchical_layout`](crate::comm::Communicator::hierarchical_layout).
pub(super) fn compute_hierarchical_layout(
    hosts: &[String],
    rank: usize,
) -> Option<(usize, usize, usize)> {
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

/// A failure to reach or join the rendezvous store: a refused handshake is an authentication
/// error, anything else a configuration one.
pub(super) fn store_connect_error(prefix: &str, e: StoreError) -> Error {
    match e {
        // A timeout waiting for rank 0, which hosts the store (a network outage as much as a
        // wrong address): `TimeoutError` to a program that retries, not a configuration error.
        StoreError::Unreachable { after, .. } => Error::Timeout {
            ctx: OpContext {
                op: "bootstrap",
                seq: 0,
            },
            peers: vec![0],
            after,
            detail: format!("{prefix}{e}"),
        },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::store::StoreServer;

    fn layout(hosts: &[&str], rank: usize) -> Option<(usize, usize, usize)> {
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        compute_hierarchical_layout(&hosts, rank)
    }

    fn all(hosts: &[&str]) -> Vec<Option<(usize, usize, usize)>> {
        (0..hosts.len()).map(|r| layout(hosts, r)).collect()
    }

    #[test]
    fn an_unreachable_store_is_a_timeout_waiting_for_rank_0() {
        let e = store_connect_error(
            "rank 1: ",
            StoreError::Unreachable {
                addr: "10.0.0.1:29500".into(),
                after: Duration::from_secs(6),
                last: "connection timed out".into(),
            },
        );
        assert!(e.is_timeout(), "{e}");
        assert!(crate::testing::names_rank(&e, 0), "{e}");
        assert!(
            e.to_string().contains(
                "rank 1: cannot reach the rendezvous store at 10.0.0.1:29500 within 6s: \
                 connection timed out"
            ),
            "{e}"
        );
    }

    #[test]
    fn layout_of_hosts_in_blocks() {
        assert_eq!(
            all(&["a", "a", "b", "b"]),
            [
                Some((0, 0, 2)),
                Some((0, 1, 2)),
                Some((1, 0, 2)),
                Some((1, 1, 2))
            ]
        );
    }

    #[test]
    fn layout_of_interleaved_hosts_numbers_hosts_by_lowest_rank() {
        // Host "b" holds rank 0, so it is host 0.
        assert_eq!(
            all(&["b", "a", "b", "a"]),
            [
                Some((0, 0, 2)),
                Some((1, 0, 2)),
                Some((0, 1, 2)),
                Some((1, 1, 2))
            ]
        );
    }

    #[test]
    fn layout_of_an_odd_number_of_hosts() {
        let hosts = ["a", "a", "a", "b", "b", "b", "c", "c", "c"];
        assert_eq!(layout(&hosts, 0), Some((0, 0, 3)));
        assert_eq!(layout(&hosts, 5), Some((1, 2, 3)));
        assert_eq!(layout(&hosts, 7), Some((2, 1, 3)));
        assert_eq!(
            all(&["x", "y", "z", "x", "y", "z"])[4],
            Some((1, 1, 2)),
            "3 hosts of 2, interleaved"
        );
    }

    #[test]
    fn no_layout_on_one_host_or_one_rank_per_host() {
        assert!(all(&["a"]).iter().all(Option::is_none));
        assert!(all(&["a", "a", "a", "a"]).iter().all(Option::is_none));
        assert!(all(&["a", "b"]).iter().all(Option::is_none));
        assert!(all(&["a", "b", "c"]).iter().all(Option::is_none));
    }

    #[test]
    fn no_layout_with_unequal_ranks_per_host() {
        assert!(all(&["a", "a", "a", "b", "b"]).iter().all(Option::is_none));
        assert!(all(&["a", "a", "b", "b", "c"]).iter().all(Option::is_none));
        // As many ranks as 3 hosts of 2 would have, unevenly spread.
        assert!(all(&["a", "a", "a", "b", "c", "c"])
            .iter()
            .all(Option::is_none));
        assert!(all(&["a", "b", "b", "b"]).iter().all(Option::is_none));
    }

    const SECS5: Duration = Duration::from_secs(5);

    fn store() -> (StoreServer, String) {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let addr = server.addr().to_string();
        (server, addr)
    }

    #[test]
    fn the_last_rank_to_mark_built_publishes_that_all_are() {
        let (_server, addr) = store();
        let mut c: Vec<StoreClient> = (0..3)
            .map(|_| StoreClient::connect(&addr, SECS5, None).unwrap())
            .collect();
        let key = all_built_key("world/split1/c0");
        mark_built(&mut c[2], "world/split1/c0", 3).unwrap();
        mark_built(&mut c[0], "world/split1/c0", 3).unwrap();
        assert!(!c[1].check(&key).unwrap());
        // Another communicator's count is its own.
        mark_built(&mut c[1], "world", 1).unwrap();
        assert!(c[1].check(&all_built_key("world")).unwrap());
        assert!(!c[1].check(&key).unwrap());
        mark_built(&mut c[1], "world/split1/c0", 3).unwrap();
        assert_eq!(c[0].get(&key, SECS5).unwrap(), b"1");
    }

    #[test]
    fn wait_until_built_waits_for_every_rank() {
        let (_server, addr) = store();
        let mut c0 = StoreClient::connect(&addr, SECS5, None).unwrap();
        let waiter = std::thread::spawn(move || wait_until_built(&mut c0, "g", 2, SECS5));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished());
        let mut c1 = StoreClient::connect(&addr, SECS5, None).unwrap();
        mark_built(&mut c1, "g", 2).unwrap();
        waiter.join().unwrap().unwrap();

        let mut alone = StoreClient::connect(&addr, SECS5, None).unwrap();
        let e = wait_until_built(&mut alone, "h", 2, Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("setting up 'h': not every one of its 2 ranks finished within"),
            "{e}"
        );
    }

    #[test]
    fn join_store_takes_a_fresh_store() {
        let (_server, addr) = store();
        let mut s = join_store(&addr, 1, SECS5, None).unwrap();
        s.set("k", b"v").unwrap();
    }

    #[test]
    fn join_store_skips_a_store_whose_world_formed_until_the_timeout() {
        let (_server, addr) = store();
        let mut c = StoreClient::connect(&addr, SECS5, None).unwrap();
        c.set(&bootstrap::peer_list_key("world"), b"[]").unwrap();
        let e = join_store(&addr, 3, Duration::from_millis(100), None)
            .err()
            .expect("an error")
            .to_string();
        assert!(
            e.contains("rank 3: the rendezvous store at")
                && e.contains("still served a communicator formed without this rank"),
            "{e}"
        );
    }

    /// A live process of this machine other than this one: the test's parent.
    fn another_live_process() -> ProcessIdentity {
        let parent = std::os::unix::process::parent_id();
        let other = ProcessIdentity {
            pid: parent,
            start: claim::start_time(parent).expect("the parent's start time"),
            ..ProcessIdentity::current()
        };
        assert!(other.is_alive_here());
        other
    }

    #[test]
    fn a_second_process_with_the_same_rank_is_refused_naming_the_first() {
        // Before the world forms: at once. (No upper bound on the time is asserted: had this
        // rank waited out the timeout instead, its error would be the stale-store one.)
        let (_server, addr) = store();
        let mut c = StoreClient::connect(&addr, SECS5, None).unwrap();
        let other = another_live_process();
        assert_eq!(claim::claim(&mut c, 1, &other, &addr).unwrap(), Ok(()));
        let e = join_store(&addr, 1, Duration::from_secs(30), None)
            .err()
            .expect("an error")
            .to_string();
        assert!(
            e.contains(&format!("rank 1 of the job whose rendezvous store is at {addr} is already held by process {}", other.pid))
                && e.contains("two processes were started with the same rank"),
            "{e}"
        );
        // Rank 2 is free (and this process takes part in that world).
        join_store(&addr, 2, SECS5, None).unwrap();
        // After a world formed that this process had no part in: once the first has held the
        // rank for the grace period.
        let (_server2, addr2) = store();
        let mut c2 = StoreClient::connect(&addr2, SECS5, None).unwrap();
        assert_eq!(claim::claim(&mut c2, 1, &other, &addr2).unwrap(), Ok(()));
        c2.set(&bootstrap::peer_list_key("world"), b"[]").unwrap();
        let started = Instant::now();
        let e = join_store(&addr2, 1, Duration::from_secs(30), None)
            .err()
            .expect("an error")
            .to_string();
        assert!(started.elapsed() >= HELD_RANK_GRACE, "{e}");
        assert!(e.contains("is already held by process"), "{e}");
        // A process that took part in the formed world (here as rank 2) is re-initialising,
        // whatever rank it asks for now (rank 1, still held by the live other process): it
        // waits for that store to go away, as before, and its timeout names the holder.
        c.set(&bootstrap::peer_list_key("world"), b"[]").unwrap();
        let e = join_store(&addr, 1, Duration::from_millis(300), None)
            .err()
            .expect("an error")
            .to_string();
        assert!(
            e.contains("still served a communicator formed without this rank")
                && e.contains(&format!("its rank 1 is process {}", other.pid)),
            "{e}"
        );
    }

    #[test]
    fn join_store_fails_with_rank_0s_refusal() {
        let (_server, addr) = store();
        let mut c = StoreClient::connect(&addr, SECS5, None).unwrap();
        c.set(
            &bootstrap::peer_list_key("world"),
            br#"{"error":"the ranks disagree"}"#,
        )
        .unwrap();
        let e = join_store(&addr, 1, SECS5, None).err().expect("an error");
        assert!(
            matches!(&e, Error::Config(m) if m == "the ranks disagree"),
            "{e:?}"
        );
    }
}
