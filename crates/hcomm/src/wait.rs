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
    /// Choose a policy from the number of ranks on this host. `spin_us` (`HCOMM_SPIN_US`,
    /// [`Tuning::spin_us`](crate::config::Tuning::spin_us)) overrides the spin time; ranks
    /// outnumbering the cores yield instead of spinning. The cores are `cpus` (`HCOMM_CPUS`,
    /// [`Tuning::cpus`](crate::config::Tuning::cpus): the CPUs the host's ranks share, which a
    /// launcher that binds every rank to its own CPUs sets), else this process's CPUs. A
    /// rank bound to one core must not count one core for the job: it would yield its core
    /// to whatever else runs there, for a whole time slice per wait (2 ms per 8-byte
    /// all-reduce, measured beside one busy process).
    pub fn for_local_ranks(
        local_ranks: usize,
        spin_us: Option<u64>,
        cpus: Option<usize>,
    ) -> WaitPolicy {
        let cores = cpus.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        let oversubscribed = local_ranks > cores;
        let default_us = if oversubscribed { 20 } else { 50 };
        let spin_us = spin_us.unwrap_or(default_us);
        WaitPolicy {
            spin: Duration::from_micros(spin_us),
            yield_cpu: oversubscribed,
        }
    }
}

/// How long a transport's recent waits lasted, so that it spins only while spinning pays:
/// when data has been arriving long after the spin window ran out (a stream over a slow
/// link, where every chunk is hundreds of microseconds apart), each spin is wasted CPU, and
/// on a host whose cores also compute, that CPU is taken from the computation. A moving
/// average of the idle spells (from the first idle poll to the next progress) decides: spin
/// while it is under [`SPIN_PAYS_FACTOR`] times the spin window, else block at once. Blocked
/// waits keep being measured, so quick replies bring spinning back within a few waits.
#[derive(Clone, Copy, Debug, Default)]
pub struct WaitHistory {
    /// Exponentially weighted mean of the idle spells, in microseconds (weight 1/8).
    mean_us: u64,
}

/// Spinning stops while the mean idle spell exceeds this many spin windows.
pub const SPIN_PAYS_FACTOR: u64 = 4;

impl WaitHistory {
    /// Record one idle spell of a wait under `policy`. A spell counts at most four times the
    /// limit of [`spinning_pays`](Self::spinning_pays), so that one long wait (for a peer
    /// still starting, say) stops spinning for about ten waits, not for thousands.
    pub fn record(&mut self, idle: Duration, policy: WaitPolicy) {
        let cap = Self::limit_us(policy).saturating_mul(4);
        let us = u64::try_from(idle.as_micros()).unwrap_or(u64::MAX).min(cap);
        self.mean_us = (self.mean_us * 7 + us) / 8;
    }

    /// Whether a wait under `policy` should spin first.
    pub fn spinning_pays(&self, policy: WaitPolicy) -> bool {
        self.mean_us <= Self::limit_us(policy)
    }

    fn limit_us(policy: WaitPolicy) -> u64 {
        u64::try_from(policy.spin.as_micros())
            .unwrap_or(u64::MAX)
            .saturating_mul(SPIN_PAYS_FACTOR)
    }
}

/// The longest spin window [`LearnedSpin`] grows to (unless the configured window is longer).
pub const LEARNED_SPIN_CAP: Duration = Duration::from_millis(1);

/// A spin window learned from the waits that slept: the escape from the "slow mode" of a pair
/// of ranks whose wake-up from the kernel takes longer than the spin window. There, rank A
/// sleeps; B arrives and wakes it, then waits for A's next arrival, which comes only after A's
/// wake-up latency: B's spin runs out first and B sleeps too, and so on at every call, each
/// paying a sleep and a wake-up (58-66 µs per 8-byte all-reduce instead of 1 µs, measured on
/// a VM with steal time). So a wait that slept and was answered within [`LEARNED_SPIN_CAP`]
/// doubles the window, to at least twice that wait: the next wait spins past the peer's
/// wake-up, and once both ranks do, neither sleeps. A wait answered later than the cap (a
/// peer that computes between collectives) halves the window back towards the configured
/// one, so waiting for slow peers still blocks soon. A configured window of zero stays zero
/// (`HCOMM_SPIN_US=0`: never spin).
#[derive(Clone, Copy, Debug)]
pub struct LearnedSpin {
    configured: Duration,
    window: Duration,
}

impl LearnedSpin {
    /// Start from the configured window.
    pub fn new(configured: Duration) -> LearnedSpin {
        LearnedSpin {
            configured,
            window: configured,
        }
    }

    /// How long the next wait spins.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// A wait spun out its window, slept, and its peer answered `idle` after the wait began.
    pub fn slept(&mut self, idle: Duration) {
        if self.configured.is_zero() {
            return;
        }
        let cap = LEARNED_SPIN_CAP.max(self.configured);
        self.window = if idle < cap {
            (self.window * 2).max(idle * 2).min(cap)
        } else {
            (self.window / 2).max(self.configured)
        };
    }
}

/// A spin-then-block helper for one wait.
pub struct Spinner {
    policy: WaitPolicy,
    /// The first idle poll of the current idle spell, and the latest clock reading in it.
    idle_since: Option<(Instant, Instant)>,
}

impl Spinner {
    /// Start waiting.
    pub fn new(policy: WaitPolicy) -> Spinner {
        Spinner {
            policy,
            idle_since: None,
        }
    }

    /// Start waiting, spinning only if `recent` waits say it pays (see [`WaitHistory`]).
    pub fn adaptive(policy: WaitPolicy, recent: &WaitHistory) -> Spinner {
        let spin = if recent.spinning_pays(policy) {
            policy.spin
        } else {
            Duration::ZERO
        };
        Spinner::new(WaitPolicy { spin, ..policy })
    }

    /// Progress was made: restart the spin window. Returns how long the wait had been idle, to
    /// the last idle poll or wake-up (None if it had not been idle); reads no clock, so that
    /// a quick exchange pays nothing for the bookkeeping.
    pub fn reset(&mut self) -> Option<Duration> {
        self.idle_since
            .take()
            .map(|(since, seen)| seen.duration_since(since))
    }

    /// Progress was made: restart the spin window and record the idle spell it ended (if
    /// any) in `history` (spells of waits under `policy`, the transport's own).
    pub fn progressed(&mut self, history: &mut WaitHistory, policy: WaitPolicy) {
        if let Some(idle) = self.reset() {
            history.record(idle, policy);
        }
    }

    /// The caller blocked in the kernel and woke up (the idle spell goes on).
    pub fn woke(&mut self) {
        if let Some((_, seen)) = &mut self.idle_since {
            *seen = Instant::now();
        }
    }

    /// No progress. Returns `true` if the caller should block in the kernel now, `false` if it
    /// has spun or yielded and should poll again.
    pub fn idle(&mut self) -> bool {
        let now = Instant::now();
        let (since, seen) = self.idle_since.get_or_insert((now, now));
        *seen = now;
        if now.duration_since(*since) >= self.policy.spin {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(us: u64) -> WaitPolicy {
        WaitPolicy {
            spin: Duration::from_micros(us),
            yield_cpu: false,
        }
    }

    #[test]
    fn ranks_count_against_the_cpus_they_share_when_told() {
        // Bound to one CPU each, two ranks of a 2-CPU host spin; on one shared CPU they yield.
        assert!(!WaitPolicy::for_local_ranks(2, None, Some(2)).yield_cpu);
        assert!(WaitPolicy::for_local_ranks(2, None, Some(1)).yield_cpu);
        assert_eq!(
            WaitPolicy::for_local_ranks(2, Some(7), Some(4)).spin,
            Duration::from_micros(7)
        );
    }

    #[test]
    fn spinning_stops_after_long_waits_and_comes_back_after_short_ones() {
        let p = policy(50);
        let mut h = WaitHistory::default();
        assert!(h.spinning_pays(p), "a fresh transport spins");
        for _ in 0..20 {
            h.record(Duration::from_micros(500), p); // a stream over a slow link
        }
        assert!(!h.spinning_pays(p));
        let mut s = Spinner::adaptive(p, &h);
        assert!(s.idle(), "blocks at the first idle poll");
        for _ in 0..20 {
            h.record(Duration::from_micros(20), p); // quick replies again
        }
        assert!(h.spinning_pays(p));
        // one very long wait (a peer starting up) among quick ones does not stop spinning,
        // and after a run of them spinning comes back within a dozen quick waits
        h.record(Duration::from_secs(5), p);
        assert!(h.spinning_pays(p));
        for _ in 0..10 {
            h.record(Duration::from_secs(5), p);
        }
        assert!(!h.spinning_pays(p));
        for _ in 0..12 {
            h.record(Duration::from_micros(20), p);
        }
        assert!(h.spinning_pays(p));
        let mut s = Spinner::adaptive(p, &h);
        assert!(!s.idle(), "spins at the first idle poll");
        assert!(s.reset().is_some() && s.reset().is_none());
        // a blocked spell counts to the wake-up
        let mut s = Spinner::adaptive(policy(0), &WaitHistory::default());
        assert!(s.idle());
        std::thread::sleep(Duration::from_millis(2));
        s.woke();
        assert!(s.reset().unwrap() >= Duration::from_millis(2));
        // a spin window of zero never spins, whatever the history
        assert!(Spinner::adaptive(policy(0), &WaitHistory::default()).idle());
    }

    #[test]
    fn a_window_that_a_wake_up_outlasts_grows_past_it_and_shrinks_for_slow_peers() {
        let us = Duration::from_micros;
        let mut w = LearnedSpin::new(us(50));
        // A wait that slept and was answered after 80 µs: the next spins past that.
        w.slept(us(80));
        assert_eq!(w.window(), us(160));
        // Further quick answers keep doubling it, never past the cap.
        for _ in 0..10 {
            w.slept(us(100));
        }
        assert_eq!(w.window(), LEARNED_SPIN_CAP);
        // Peers that answer after the cap: back to the configured window within a few waits.
        for _ in 0..5 {
            w.slept(us(5_000));
        }
        assert_eq!(w.window(), us(50));
        w.slept(us(5_000));
        assert_eq!(w.window(), us(50), "never below the configured window");
        // Never spinning stays never spinning; a configured window above the cap is kept.
        let mut zero = LearnedSpin::new(Duration::ZERO);
        zero.slept(us(10));
        assert_eq!(zero.window(), Duration::ZERO);
        let mut long = LearnedSpin::new(us(5_000));
        long.slept(us(10));
        assert_eq!(long.window(), us(5_000));
    }
}
