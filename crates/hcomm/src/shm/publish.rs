//! How a rank writes the bytes its peers read next (staging, reduced result slices): through
//! the cache with plain stores, or to memory with streaming stores. Which is faster depends on
//! where the two CPUs sit, and on a VM that changes while the job runs.
//!
//! Measured on the 2-vCPU AMD EPYC VM (2026-12-07): two threads pinned to the two vCPUs that
//! take turns reading 512 KiB the other just wrote move it in 28-32 µs most of the time, but
//! for stretches of seconds (up to half the samples of a minute) in 126-215 µs: the hypervisor
//! has put the vCPUs where they share no cache, and a line written by one reaches the other
//! about five times slower than usual. With the writer's streaming stores the same turn takes
//! 62-94 µs in either state (the lines come from memory). A 2-rank 1 MiB all-reduce moves in
//! step: 74-97 µs with plain stores against 187-276 µs with streaming ones in the first state,
//! 333-435 µs against 199-261 µs in the second; Open MPI's went from 150-200 to 480-580 µs.
//!
//! So the group learns it, per collective and size class (powers of two): each call is timed,
//! an estimate of time per byte is kept for each way, the cheaper way is used, and every
//! [`TRIAL_EVERY`]th call of a class tries the other. A move into the slow state shows at once
//! (the way in use gets slower); a move out of it at the next trial. The result bits do not
//! depend on the way (both store the same bytes).
//!
//! The ranks must try together. A call is as slow as its slowest reader, so with one rank
//! publishing to memory every rank's call costs what memory costs: a rank trying the cache
//! alone would see no gain, and a pair that once chose memory would stay there. So the trials
//! (and the first calls of a class, which measure each way twice) fall on the same calls of
//! every rank: the calls of a class are counted, and every rank makes the same calls. The
//! choices between trials are each rank's own, from its own clock; ranks that disagree pay
//! memory's price until the next trial, which shows both the way they would share.

use std::time::Duration;

pub use crate::config::knobs::{Publish, PublishSetting};

/// The pipelined collectives the policy keeps apart (their access patterns differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// All-reduce and reduce.
    AllReduce = 0,
    /// Broadcast.
    Broadcast = 1,
    /// All-gather (and gather).
    AllGather = 2,
    /// Reduce-scatter.
    ReduceScatter = 3,
    /// All-to-all.
    AllToAll = 4,
}

const KINDS: usize = 5;
/// Size classes: `len` in `[2^(c-1), 2^c)` is class `c`, up to 2^47 bytes.
const CLASSES: usize = 48;
/// Every this many calls of a class, all ranks try the way not in use. At 1 MiB on the
/// 2-vCPU VM a trial of memory costs about 1.5 calls' time more than the cache, so trials add
/// about 1 % where the cache wins; a return to it takes up to this many calls.
pub const TRIAL_EVERY: u64 = 128;
/// The calls that measure each way first: one not counted, then two of each.
const FIRST_CALLS: u64 = 5;

#[derive(Debug, Clone, Copy)]
struct Class {
    /// Estimated nanoseconds per byte, per way ([`Publish`] as index); NaN: not seen yet.
    cost: [f64; 2],
    /// Calls of this class so far, the one being made included (the same on every rank).
    calls: u64,
}

impl Default for Class {
    fn default() -> Self {
        Class {
            cost: [f64::NAN; 2],
            calls: 0,
        }
    }
}

impl Class {
    fn preferred(&self) -> Publish {
        if self.cost[Publish::Memory as usize] < self.cost[Publish::Cache as usize] {
            Publish::Memory
        } else {
            Publish::Cache
        }
    }
}

/// The way each collective and size class publishes, learned from the calls' times.
#[derive(Debug, Clone)]
pub struct PublishPolicy {
    setting: PublishSetting,
    classes: Vec<Class>,
}

impl Default for PublishPolicy {
    fn default() -> Self {
        Self::new(PublishSetting::Auto)
    }
}

fn class_of(len: usize) -> usize {
    (usize::BITS - len.leading_zeros()).min(CLASSES as u32 - 1) as usize
}

impl PublishPolicy {
    /// A policy that knows nothing yet (or always answers the forced way).
    pub fn new(setting: PublishSetting) -> Self {
        PublishPolicy {
            setting,
            classes: vec![Class::default(); KINDS * CLASSES],
        }
    }

    fn class(&mut self, kind: Kind, len: usize) -> &mut Class {
        &mut self.classes[kind as usize * CLASSES + class_of(len)]
    }

    /// The way for the next call of `kind` on `len` bytes (the same on every rank: the
    /// vector of an all-reduce, a rank's block of an all-gather, ...).
    pub fn choose(&mut self, kind: Kind, len: usize) -> Publish {
        let c = match self.setting {
            PublishSetting::Always(way) => return way,
            PublishSetting::Auto => self.class(kind, len),
        };
        c.calls += 1;
        match c.calls {
            // The first call of a class pays for first touches: not counted. Then each way
            // twice, alternating (a caller's own first touches may fall in the second call).
            1 | 2 | 4 => Publish::Cache,
            3 | 5 => Publish::Memory,
            n if n.is_multiple_of(TRIAL_EVERY) => other(c.preferred()),
            _ => c.preferred(),
        }
    }

    /// What the call that [`choose`](Self::choose) answered `way` for took.
    pub fn record(&mut self, kind: Kind, len: usize, way: Publish, took: Duration) {
        if self.setting != PublishSetting::Auto || len == 0 {
            return;
        }
        let sample = took.as_nanos() as f64 / len as f64;
        let c = self.class(kind, len);
        if c.calls <= 1 {
            return;
        }
        let before = c.preferred();
        let i = way as usize;
        if c.calls <= FIRST_CALLS {
            // The first measures: the faster of each way's two (delays only add time).
            c.cost[i] = c.cost[i].min(sample);
            if c.calls == FIRST_CALLS {
                tracing::debug!(
                    ?kind,
                    bytes_from = 1usize << (class_of(len) - 1),
                    cache_ns_per_byte = c.cost[Publish::Cache as usize],
                    memory_ns_per_byte = c.cost[Publish::Memory as usize],
                    "shared memory: publishing to {:?}",
                    c.preferred()
                );
            }
            return;
        }
        if way != before {
            // A first measure, or a trial: the latest word on the way not in use.
            c.cost[i] = sample;
        } else {
            // The way in use: a quarter weight (calls are noisy; there are many of them).
            c.cost[i] += (sample - c.cost[i]) / 4.0;
        }
        if c.preferred() != before {
            tracing::debug!(
                ?kind,
                bytes_from = 1usize << (class_of(len) - 1),
                cache_ns_per_byte = c.cost[Publish::Cache as usize],
                memory_ns_per_byte = c.cost[Publish::Memory as usize],
                "shared memory: now publishing to {:?}",
                c.preferred()
            );
        }
    }

    /// The way the next call of `kind` on `len` bytes would use, without counting a call
    /// (for tests and reports).
    pub fn current(&self, kind: Kind, len: usize) -> Publish {
        match self.setting {
            PublishSetting::Always(way) => way,
            PublishSetting::Auto => {
                self.classes[kind as usize * CLASSES + class_of(len)].preferred()
            }
        }
    }
}

fn other(way: Publish) -> Publish {
    match way {
        Publish::Cache => Publish::Memory,
        Publish::Memory => Publish::Cache,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEN: usize = 1 << 20;

    /// Two ranks' policies driven together for `calls` calls; a call costs (µs) what `cost`
    /// gives for the two ways in use, and both ranks see that. Returns each call's ways.
    fn drive(
        ranks: &mut [PublishPolicy; 2],
        calls: usize,
        mut cost: impl FnMut(Publish, Publish) -> u64,
    ) -> Vec<(Publish, Publish)> {
        (0..calls)
            .map(|_| {
                let a = ranks[0].choose(Kind::AllReduce, LEN);
                let b = ranks[1].choose(Kind::AllReduce, LEN);
                let took = Duration::from_micros(cost(a, b));
                ranks[0].record(Kind::AllReduce, LEN, a, took);
                ranks[1].record(Kind::AllReduce, LEN, b, took);
                (a, b)
            })
            .collect()
    }

    /// Whether call `i` of `ways`, which `drive` made after `before` calls, was a trial.
    fn trial(before: usize, i: usize) -> bool {
        ((before + i + 1) as u64).is_multiple_of(TRIAL_EVERY)
    }

    use Publish::{Cache, Memory};

    /// The VM's two states (µs per 1 MiB all-reduce of 2 ranks, as measured): the vCPUs share
    /// a cache, and they do not. A rank publishing to memory makes both read from it.
    fn shared(a: Publish, b: Publish) -> u64 {
        if (a, b) == (Cache, Cache) {
            85
        } else {
            210
        }
    }
    fn apart(a: Publish, b: Publish) -> u64 {
        match (a, b) {
            (Memory, Memory) => 220,
            (Cache, Cache) => 390,
            _ => 300,
        }
    }

    /// Calls in `ways` on which both ranks used `way`.
    fn both(ways: &[(Publish, Publish)], way: Publish) -> usize {
        ways.iter().filter(|&&w| w == (way, way)).count()
    }

    /// The first call from which both ranks keep using `way`, trials aside (`ways` made
    /// after `before` calls).
    fn settled(ways: &[(Publish, Publish)], way: Publish, before: usize) -> usize {
        (0..ways.len())
            .rev()
            .find(|&i| !trial(before, i) && ways[i] != (way, way))
            .map_or(0, |i| i + 1)
    }

    fn pair() -> [PublishPolicy; 2] {
        [PublishPolicy::default(), PublishPolicy::default()]
    }

    #[test]
    fn a_pair_settles_on_the_cheaper_way_and_tries_the_other_on_the_same_calls() {
        let mut ranks = pair();
        let ways = drive(&mut ranks, 2000, shared);
        assert!(
            settled(&ways, Cache, 0) <= 5,
            "settled at {}",
            settled(&ways, Cache, 0)
        );
        let trials = ways
            .iter()
            .filter(|w| w.0 == Memory || w.1 == Memory)
            .count();
        assert_eq!(
            trials,
            2 + 2000 / TRIAL_EVERY as usize,
            "calls 3 and 5, then trials"
        );
        assert_eq!(
            both(&ways, Memory),
            trials,
            "both ranks try on the same calls"
        );
    }

    #[test]
    fn a_slow_first_measure_does_not_decide() {
        // The caller's first touch of a 64 MiB output in the second call (the first counted).
        let mut ranks = pair();
        let mut call = 0;
        let ways = drive(&mut ranks, 100, |a, b| {
            call += 1;
            shared(a, b) * if call == 2 { 3 } else { 1 }
        });
        assert!(
            settled(&ways, Cache, 0) <= 5,
            "settled at {}",
            settled(&ways, Cache, 0)
        );
    }

    #[test]
    fn a_pair_stuck_publishing_to_memory_returns_to_the_cache_at_the_next_trial() {
        // Both learned memory in the slow state; the vCPUs then share a cache again. Each
        // rank's calls cost memory's price as long as the other publishes there.
        let mut ranks = pair();
        drive(&mut ranks, 1000, apart);
        assert_eq!(ranks[0].current(Kind::AllReduce, LEN), Memory);
        let ways = drive(&mut ranks, 1000, shared);
        let back = settled(&ways, Cache, 1000);
        assert!(back <= TRIAL_EVERY as usize, "back in {back} calls");
        // A rank that disagrees (its own noise) is brought back as well.
        let mut ranks = pair();
        drive(&mut ranks, 1000, shared);
        ranks[1].class(Kind::AllReduce, LEN).cost = [1.0, 0.5];
        let ways = drive(&mut ranks, 1000, shared);
        assert!(settled(&ways, Cache, 1000) <= TRIAL_EVERY as usize);
    }

    #[test]
    fn a_move_into_the_slow_state_switches_at_once() {
        let mut ranks = pair();
        drive(&mut ranks, 1000, shared);
        let ways = drive(&mut ranks, 1000, apart);
        // The cache's estimate has had few slow samples: it may win once more before it
        // settles.
        let to_cache = ways[..40]
            .iter()
            .filter(|w| **w != (Memory, Memory))
            .count();
        assert!(
            to_cache <= 6,
            "{to_cache} of the first 40 calls published to the cache"
        );
        assert!(settled(&ways, Memory, 1000) <= 40);
    }

    #[test]
    fn classes_and_collectives_learn_apart_and_a_forced_way_is_kept() {
        let mut ranks = pair();
        drive(&mut ranks, 100, apart);
        let p = &ranks[0];
        assert_eq!(p.current(Kind::AllReduce, LEN), Memory);
        assert_eq!(p.current(Kind::AllReduce, 1 << 10), Cache, "another size");
        assert_eq!(p.current(Kind::AllGather, LEN), Cache, "another collective");
        let forced = PublishPolicy::new(PublishSetting::Always(Cache));
        let mut ranks = [forced.clone(), forced];
        assert!(drive(&mut ranks, 100, apart)
            .iter()
            .all(|&w| w == (Cache, Cache)));
        assert_eq!("memory".parse(), Ok(PublishSetting::Always(Memory)));
        assert_eq!("cache".parse(), Ok(PublishSetting::Always(Cache)));
        assert_eq!("auto".parse(), Ok(PublishSetting::Auto));
        assert!("fast"
            .parse::<PublishSetting>()
            .unwrap_err()
            .contains("'fast'"));
    }

    #[test]
    fn size_classes_are_powers_of_two() {
        assert_eq!(class_of(0), 0);
        assert_eq!(class_of(1), 1);
        assert_eq!(class_of(4096), 13);
        assert_eq!(class_of(8191), 13);
        assert_eq!(class_of(usize::MAX), CLASSES - 1);
    }
}
