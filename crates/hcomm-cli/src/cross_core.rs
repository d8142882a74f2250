//! How fast a cache line written on one CPU reaches another: the benchmark's header and footer
//! report it, because on a VM it changes while a job runs and shared-memory figures change with
//! it.
//!
//! On the 2-vCPU AMD EPYC VM (2026-12-07) two threads pinned to the two vCPUs that take turns
//! reading what the other just wrote moved 512 KiB in 28-32 µs most of the time, and in
//! 126-215 µs for stretches of seconds, while a one-CPU `memcpy` kept its speed and `vmstat`
//! showed no steal: the hypervisor had placed the vCPUs where they share no cache. A 2-rank
//! 1 MiB all-reduce over shared memory (hcomm's or Open MPI's) took 3-4× as long then. Steal
//! time does not show this; this probe does.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes each thread writes per turn (and the other reads): less than a core's L2 here.
pub const BYTES: usize = 256 << 10;
/// Two runs whose turn times differ by more than this factor ran in different states of the
/// machine (on the VM above: 17-36 µs against 72-118).
pub const SAME_STATE: f64 = 2.0;

/// Whether turn times `a` and `b` (µs) say the same state of the machine.
pub fn same_state(a: f64, b: f64) -> bool {
    a > 0.0 && b > 0.0 && a.max(b) <= SAME_STATE * a.min(b)
}

/// Turns timed (after a few untimed ones).
const TURNS: usize = 40;

/// The median time of one turn: one thread reads [`BYTES`] the other wrote in its last turn,
/// then writes its own; the two threads are pinned to the first two CPUs this process may use.
/// `None` with fewer than two CPUs or where pinning fails.
pub fn turn_time() -> Option<Duration> {
    let cpus = allowed_cpus();
    if cpus.len() < 2 {
        return None;
    }
    let words = BYTES / 8;
    let bufs: Arc<[Vec<AtomicU64>; 2]> = Arc::new([
        (0..words).map(|_| AtomicU64::new(0)).collect(),
        (0..words).map(|_| AtomicU64::new(0)).collect(),
    ]);
    // Whose turn it is: even for thread 0, odd for thread 1; usize::MAX if one gave up.
    let turn = Arc::new(AtomicUsize::new(0));
    let total = TURNS + 4;
    let spawn = |me: usize, cpu: usize| {
        let (bufs, turn) = (bufs.clone(), turn.clone());
        std::thread::spawn(move || -> Option<Vec<Duration>> {
            if !pin_to(cpu) {
                turn.store(usize::MAX, Ordering::Release);
                return None;
            }
            let mut times = Vec::with_capacity(total);
            let deadline = Instant::now() + Duration::from_secs(2);
            for t in 0..total {
                for spins in 1u32.. {
                    if spins % 1024 == 0 {
                        // The other thread may be waiting for this CPU (a busy machine).
                        std::thread::yield_now();
                    }
                    let now = turn.load(Ordering::Acquire);
                    if now == usize::MAX || Instant::now() > deadline {
                        turn.store(usize::MAX, Ordering::Release);
                        return None;
                    }
                    if now == 2 * t + me {
                        break;
                    }
                    std::hint::spin_loop();
                }
                let start = Instant::now();
                let mut sum = 0u64;
                for w in bufs[1 - me].iter() {
                    sum = sum.wrapping_add(w.load(Ordering::Relaxed));
                }
                for w in bufs[me].iter() {
                    w.store(sum ^ t as u64, Ordering::Relaxed);
                }
                times.push(start.elapsed());
                turn.fetch_add(1, Ordering::Release);
            }
            Some(times)
        })
    };
    let a = spawn(0, cpus[0]);
    let b = spawn(1, cpus[1]);
    let (a, b) = (a.join().ok()??, b.join().ok()??);
    let mut turns: Vec<Duration> = a.into_iter().skip(2).chain(b.into_iter().skip(2)).collect();
    turns.sort();
    turns.get(turns.len() / 2).copied()
}

/// The header or footer line for a turn time `turn` ([`turn_time`]).
pub fn line(turn: Option<Duration>, when: &str) -> String {
    match turn {
        Some(t) => format!(
            "# cross-core: {} KiB written on one CPU and read on another in {:.1} µs (median of {TURNS} turns, {when}; a VM whose vCPUs share no cache at the moment takes several times longer, and shared-memory figures with it)",
            BYTES >> 10,
            t.as_secs_f64() * 1e6
        ),
        None => format!("# cross-core: not measured ({when}: fewer than two CPUs, or they cannot be pinned)"),
    }
}

fn allowed_cpus() -> Vec<usize> {
    use nix::sched::{sched_getaffinity, CpuSet};
    use nix::unistd::Pid;
    // The launcher binds each rank to its own CPUs: ask what the machine has, not the rank.
    let online = match nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN) {
        Ok(Some(n)) if n > 0 => n as usize,
        _ => 0,
    };
    let mine: Vec<usize> = match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => Vec::new(),
    };
    if mine.len() >= 2 {
        mine
    } else {
        (0..online).collect()
    }
}

fn pin_to(cpu: usize) -> bool {
    use nix::sched::{sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let mut set = CpuSet::new();
    set.set(cpu).is_ok() && sched_setaffinity(Pid::from_raw(0), &set).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_differ_past_twice_the_turn() {
        assert!(same_state(20.0, 36.0));
        assert!(!same_state(30.0, 90.0));
        assert!(!same_state(90.0, 30.0));
        assert!(same_state(80.0, 118.0));
        assert!(!same_state(0.0, 30.0));
    }

    #[test]
    fn the_probe_measures_a_turn_or_says_why_not() {
        let l = line(turn_time(), "test");
        assert!(l.starts_with("# cross-core: "), "{l}");
        if let Some(t) = turn_time() {
            assert!(t > Duration::ZERO && t < Duration::from_secs(1), "{t:?}");
        }
    }
}
