//! How a rank waits for a peer: spin briefly, then block; when ranks outnumber cores, yield at
//! once instead of spinning (a spinning rank would starve the rank it waits for).

use std::time::{Duration, Instant};

/// Waiting policy of one rank.
#[derive(Clone, Copy, Debug)]
pub struct WaitPolicy {
    /// How long to busy-poll before blocking in the kernel.
    pub spin: Duration,
    /// Yield the core (`sched_yield`) between polls instead of spinning.
    pub yield_cpu: bool,
}

impl WaitPolicy {
    /// Choose a policy from the number of ranks on this host. `HCOMM_SPIN_US` overrides the spin
    /// time; ranks outnumbering the cores yield instead of spinning.
    pub fn for_local_ranks(local_ranks: usize) -> WaitPolicy {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let oversubscribed = local_ranks > cores;
        let default_us = if oversubscribed { 20 } else { 50 };
        let spin_us = std::env::var("HCOMM_SPIN_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(default_us);
        WaitPolicy {
            spin: Duration::from_micros(spin_us),
            yield_cpu: oversubscribed,
        }
    }
}

/// A spin-then-block helper for one wait.
pub struct Spinner {
    policy: WaitPolicy,
    idle_since: Option<Instant>,
}

impl Spinner {
    /// Start waiting.
    pub fn new(policy: WaitPolicy) -> Spinner {
        Spinner {
            policy,
            idle_since: None,
        }
    }

    /// Progress was made: restart the spin window.
    pub fn reset(&mut self) {
        self.idle_since = None;
    }

    /// No progress. Returns `true` if the caller should block in the kernel now, `false` if it
    /// has spun or yielded and should poll again.
    pub fn idle(&mut self) -> bool {
        let now = Instant::now();
        let since = *self.idle_since.get_or_insert(now);
        if now.duration_since(since) >= self.policy.spin {
            return true;
        }
        if self.policy.yield_cpu {
            std::thread::yield_now();
        } else {
            // A few pauses only: `pause` costs ~140 cycles on recent Xeons, and every
            // microsecond spent here is added to the latency of noticing the peer.
            for _ in 0..4 {
                std::hint::spin_loop();
            }
        }
        false
    }
}
