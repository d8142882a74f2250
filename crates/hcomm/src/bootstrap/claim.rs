//! Which process holds a rank of the world: two processes started with the same rank (a
//! launcher's `RANK` and a stale `HCOMM_RANK`, a script started twice) used to meet in the
//! store, overwrite each other's record, and fail only at the timeout with a message about the
//! store. Each rank now records who it is under [`claimant_key`]; a second process that finds
//! the rank held by a *live* process of the same machine fails at once, naming it.
//!
//! "The same machine" means the same kernel boot and the same pid namespace, so a pid means
//! the same process to both; the process's start time guards against a reused pid. A
//! claimant on another machine (or in another container) cannot be checked: the rank is then
//! taken over, as before, with a warning.

use super::store::{StoreClient, StoreError};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Who a process is, well enough to tell from another process of the same machine whether it
/// is still running.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessIdentity {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    /// The pid namespace (`/proc/self/ns/pid`, e.g. `pid:[4026531836]`).
    pub pid_ns: String,
    /// The process id in that namespace.
    pub pid: u32,
    /// The process's start time in clock ticks since boot (`/proc/PID/stat`, field 22).
    pub start: u64,
    /// The host name, for messages.
    pub host: String,
}

impl ProcessIdentity {
    /// This process. Its pid is the one `/proc` knows it by (`/proc/self`), which is what
    /// another process looks up; it differs from `getpid()` when `/proc` was mounted for
    /// another pid namespace.
    pub fn current() -> ProcessIdentity {
        let pid = std::fs::read_link("/proc/self")
            .ok()
            .and_then(|p| p.to_str()?.parse().ok())
            .unwrap_or_else(std::process::id);
        ProcessIdentity {
            boot_id: boot_id(),
            pid_ns: pid_namespace(),
            pid,
            start: start_time(pid).unwrap_or(0),
            host: super::default_host_id(),
        }
    }

    /// The same process as `other` (the host name, which can change, aside).
    pub fn same_process(&self, other: &ProcessIdentity) -> bool {
        self.boot_id == other.boot_id
            && self.pid_ns == other.pid_ns
            && self.pid == other.pid
            && self.start == other.start
    }

    /// Whether `self` is a process of this machine (same boot, same pid namespace) that is
    /// running now (a zombie is not). `false` when that cannot be told.
    pub fn is_alive_here(&self) -> bool {
        !self.boot_id.is_empty()
            && self.boot_id == boot_id()
            && self.pid_ns == pid_namespace()
            && self.start != 0
            && start_time(self.pid) == Some(self.start)
    }

    /// The store key that says this process took part in the world whose store it is.
    fn part_key(&self) -> String {
        format!(
            "world/took-part/{}/{}/{}/{}",
            self.boot_id, self.pid_ns, self.pid, self.start
        )
    }

    /// `process PID on HOST`.
    pub fn describe(&self) -> String {
        format!("process {} on {}", self.pid, self.host)
    }
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Field 22 of `/proc/PID/stat` (the process's start time), or `None` when the process is
/// gone or a zombie; the command name, field 2, may hold spaces and parentheses, so the
/// fields are counted after its last `)`.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    // after_name starts with field 3 (state); field 22 is the 20th from there.
    let mut fields = after_name.split_whitespace();
    if matches!(fields.next(), Some("Z" | "X" | "x")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// The store key under which the process holding world rank `rank` records itself.
pub fn claimant_key(rank: usize) -> String {
    format!("world/claimant/{rank}")
}

fn claims_key(rank: usize) -> String {
    format!("world/claims/{rank}")
}

/// Whether `me` claimed a rank of the world whose store this is (then a formed world in it is
/// this process's earlier one: a re-initialisation, whatever rank it has now).
pub fn took_part(store: &mut StoreClient, me: &ProcessIdentity) -> Result<bool, StoreError> {
    store.check(&me.part_key())
}

/// The process recorded as holding world rank `rank`, if any.
pub fn claimant(
    store: &mut StoreClient,
    rank: usize,
) -> Result<Option<ProcessIdentity>, StoreError> {
    let key = claimant_key(rank);
    if !store.check(&key)? {
        return Ok(None);
    }
    let record = store.get(&key, Duration::from_millis(100))?;
    Ok(serde_json::from_slice(&record).ok())
}

/// Why `holder` keeps this process from taking world rank `rank`: `Some` when `holder` is
/// another process of this machine that is running now.
pub fn held_by_another(
    holder: &ProcessIdentity,
    me: &ProcessIdentity,
    rank: usize,
    store_addr: &str,
) -> Option<String> {
    if holder.same_process(me) || !holder.is_alive_here() {
        return None;
    }
    Some(format!(
        "rank {rank} of the job whose rendezvous store is at {store_addr} is already held by \
         {} (this is {}): two processes were started with the same rank (check HCOMM_RANK, \
         RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID), or another job uses this \
         master port",
        holder.describe(),
        me.describe()
    ))
}

/// Record this process as the holder of world rank `rank`. A process that finds the rank held
/// by another live process of this machine gets `Err` with the reason; a holder that has
/// exited, or that cannot be checked, is replaced (with a warning for the latter).
pub fn claim(
    store: &mut StoreClient,
    rank: usize,
    me: &ProcessIdentity,
    store_addr: &str,
) -> Result<Result<(), String>, StoreError> {
    let record = serde_json::to_vec(me).expect("serialisable");
    store.set(&me.part_key(), rank.to_string().as_bytes())?;
    // The counter decides which of two processes claiming at once records itself first; the
    // other then reads that record.
    if store.add(&claims_key(rank), 1)? == 1 {
        store.set(&claimant_key(rank), &record)?;
        return Ok(Ok(()));
    }
    // The first claimant sets its record right after counting: wait a moment for it (a
    // claimant that died in between never will).
    let until = Instant::now() + Duration::from_secs(1);
    let holder = loop {
        match claimant(store, rank)? {
            Some(h) => break Some(h),
            None if Instant::now() >= until => break None,
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    if let Some(holder) = &holder {
        if let Some(why) = held_by_another(holder, me, rank, store_addr) {
            return Ok(Err(why));
        }
        let unknowable = holder.boot_id != me.boot_id || holder.pid_ns != me.pid_ns;
        if !holder.same_process(me) && unknowable {
            tracing::warn!(
                "rank {rank} was held by {}, on another machine or in another container, which \
                 this process cannot check: taking the rank over",
                holder.describe()
            );
        }
    }
    store.set(&claimant_key(rank), &record)?;
    Ok(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::store::StoreServer;

    #[test]
    fn this_process_is_alive_and_a_reused_pid_or_another_boot_is_not() {
        let me = ProcessIdentity::current();
        assert!(me.start > 0, "{me:?}");
        assert!(me.is_alive_here());
        let reused = ProcessIdentity {
            start: me.start + 1,
            ..me.clone()
        };
        assert!(!reused.is_alive_here());
        let elsewhere = ProcessIdentity {
            boot_id: "another-boot".into(),
            ..me.clone()
        };
        assert!(!elsewhere.is_alive_here());
    }

    #[test]
    fn a_rank_held_by_a_live_process_is_refused_and_a_dead_holder_replaced() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let addr = server.addr().to_string();
        let mut store = StoreClient::connect(&addr, Duration::from_secs(5), None).unwrap();
        let me = ProcessIdentity::current();
        // A live process of this machine (the test's own parent stands in for the other
        // process holding rank 1).
        let parent = std::os::unix::process::parent_id();
        let other = ProcessIdentity {
            pid: parent,
            start: start_time(parent).expect("the parent's start time"),
            ..me.clone()
        };
        assert!(other.is_alive_here());
        assert_eq!(claim(&mut store, 1, &other, &addr).unwrap(), Ok(()));
        let why = claim(&mut store, 1, &me, &addr)
            .unwrap()
            .expect_err("rank 1 is held");
        assert!(
            why.contains(&format!(
                "rank 1 of the job whose rendezvous store is at {addr}"
            )) && why.contains(&format!("already held by process {parent}"))
                && why.contains("started with the same rank"),
            "{why}"
        );
        // The holder is unchanged, and the same process may claim again (a retried join).
        assert_eq!(claimant(&mut store, 1).unwrap(), Some(other.clone()));
        assert_eq!(claim(&mut store, 1, &other, &addr).unwrap(), Ok(()));
        // A holder that has exited (its start time no longer matches) is replaced.
        let gone = ProcessIdentity {
            start: other.start + 1,
            ..other.clone()
        };
        assert_eq!(claim(&mut store, 2, &gone, &addr).unwrap(), Ok(()));
        assert_eq!(claim(&mut store, 2, &me, &addr).unwrap(), Ok(()));
        assert_eq!(claimant(&mut store, 2).unwrap(), Some(me));
    }
}
