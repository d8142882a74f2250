//! Shared memory within a host: one segment per communicator whose ranks all share a host, and
//! collectives that work directly on it (no sockets, no syscalls on the fast path).
//!
//! The synchronisation protocol and the segment layout are in `README.md` beside this file.
//! In short: each rank owns a monotonically increasing 32-bit arrival counter in its own cache
//! line; "arrive" is a store with release (SeqCst) ordering, "wait for rank p to reach t" is an
//! acquire load loop that spins briefly, then sleeps on a futex on p's counter (or yields at
//! once when ranks outnumber cores). Every phase of every collective is an arrive followed by
//! a wait for all peers, and the buffers a phase writes are provably no longer read by anyone.

mod all_to_all_v;
mod arrival;
mod collectives;
pub mod futex;
pub mod p2p;
pub mod publish;
// The ring's `Bytes` trait has `unsafe` methods: the caller (the ring's own push/pop) promises
// that the range is the producer's alone (copy in) or published and not yet consumed (copy
// out), which the single-producer/single-consumer counters with release/acquire guarantee.
#[allow(unsafe_code)]
pub mod ring;
// The mapping itself (mmap/munmap), atomics over its words, raw copies and views of its
// bytes, all bounds-checked. Invariant (stated in the module header): a range is copied into
// or viewed mutably only while the owning protocol gives this rank it alone, and copied out
// or viewed only while nobody writes it; the collectives, rings and windows that call the
// safe crate-internal accessors keep that protocol.
#[allow(unsafe_code)]
pub mod segment;

pub use all_to_all_v::MAX_RANKS as ALL_TO_ALL_V_MAX_RANKS;

use crate::base::deadline::Deadline;
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::{Error, OpContext, Result};
use crate::base::reduce::{finalize_mean, fold_in_order, reduce_into, reduce_pair, Order};
use crate::base::segments::even_segments;
use crate::wait::{LearnedSpin, WaitPolicy};
pub use crate::wire::collective::ShmFingerprint;
use publish::{Kind, Publish, PublishPolicy, PublishSetting};
use segment::Segment;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a rank sleeping on a shared-memory peer checks that the peer's process still
/// lives (a killed process never posts its failure; one `kill(pid, 0)` per check).
pub const LIFE_CHECK_EVERY: Duration = Duration::from_millis(20);

const MAGIC: u64 = 0x6863_6f6d_6d73_686d; // "hcommshm"
const HEADER: usize = 128;
/// Offset in the header of the abort word: 0, or `1 << 63 | reporter << 40 | reason << 32 |
/// (culprit + 1)` once a rank's communicator failed (first writer wins).
const ABORT_WORD: usize = 16;
/// In the header: the CPU each rank last waited on, plus one (0: not known yet), a `u32` per
/// rank for the first [`CPU_SLOTS`] ranks (see `wait_rank`). Written only when it changes.
const CPU_AT: usize = 32;
const CPU_SLOTS: usize = (HEADER - CPU_AT) / 4;
// `wait_all_oversubscribed` keeps a bit per slot in a `u32`.
const _: () = assert!(CPU_SLOTS <= 32);
const LINE: usize = 256;
/// Messages up to this size use the one-shot slot path.
pub const SMALL: usize = 4096;
/// The pipelined all-reduce copies its result out with streaming (non-temporal) stores once
/// the outputs of all ranks together reach this many bytes: they no longer fit the caches, and
/// a plain store would first read each line it writes. Measured on this 2-vCPU VM
/// (2026-12-06, 2 ranks, default chunk, busbw in GB/s, plain → streaming, two runs each):
/// 256 KiB 6.1-6.2 → 4.7-5.2 (slower: that output would have stayed in the cache), 1 MiB
/// 3.8-4.3 → 4.5-5.4 (but 4.7 → 3.7 in another pair of runs), 4 MiB 3.7-4.1 → 4.8-5.0,
/// 16 MiB 3.4-3.6 → 4.5-4.8, 64 MiB 2.7-2.8 → 2.6-4.1 (the noisiest size here). The turn is
/// set past the doubtful 1 MiB, where `../shared/limits` also found streaming 1.3-2× slower.
pub const STREAM_OUTPUTS_FROM: usize = 16 << 20;
/// Default bytes of the vector handled per pipeline step (`HCOMM_SHM_CHUNK` overrides).
pub use crate::config::knobs::DEFAULT_SHM_CHUNK as DEFAULT_CHUNK;

// A rank's control block: four cache lines of 64 B. The lines at 0 and 128 are the arrival
// lines of the two parities of the barrier count: arrival `t` writes line `t % 2`, which holds
// everything a peer reads on the fast path of a one-shot collective (the counter, the
// fingerprint and up to `INLINE` bytes of data), so that one line moves per peer and call (a
// second line of data cost ~0.1 µs per call here, ../shared/limits: 8-16 B in 0.18 µs, 32 B
// in 0.31). Two lines, not one: a peer that saw this rank arrive runs ahead into its next
// call and writes its own next arrival, which goes to the other line, so this rank's read of
// the peer's data does not collide with the peer's writes. Each arrival line starts a 128-byte
// pair of lines (CPUs fetch such pairs together); the other lines of the block hold only what
// never changes after attach (the pid). 2 ranks, against one line holding both parities: 8 B
// 0.40-0.44 -> 0.38-0.42 µs, 32 B (inline now) 0.50-0.54 -> 0.39-0.41 µs (see the README).
/// Offset of the arrival line of parity `q` in a control block is `q * PARITY_LINE`.
const PARITY_LINE: usize = 128;
/// In an arrival line: the barrier count of this rank's last arrival of that parity (a `u32`,
/// the futex word).
const CTR: usize = 0;
/// In an arrival line: how many peers sleep on its counter.
const WAITERS: usize = 4;
/// In an arrival line: the fingerprint {seq, word, detail} published with that arrival, when
/// it was a call's first barrier.
const FP: usize = 8;
/// Up to this many bytes of a one-shot call travel inside its arrival line, so a peer gets
/// counter, fingerprint and data in one cache-line transfer.
const INLINE: usize = 32;
const INLINE_AT: usize = 32;
/// In the line after the first arrival line: the rank's pid and the inode of its pid
/// namespace (pids are only comparable within one).
const PID: usize = 64;
const PIDNS: usize = PID + 4;
// The fast path's fields fill an arrival line without overlapping.
const _: () = assert!(
    WAITERS + 4 <= FP
        && FP + 24 <= INLINE_AT
        && INLINE_AT + INLINE <= 64
        && LINE == 2 * PARITY_LINE
);

/// Layout of a segment for `size` ranks and `chunk`-byte steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ranks.
    pub size: usize,
    /// Bytes per pipeline step.
    pub chunk: usize,
}

impl Layout {
    fn ctrl(&self, r: usize) -> usize {
        HEADER + r * LINE
    }
    fn small(&self, r: usize, par: usize) -> usize {
        HEADER + self.size * LINE + (2 * r + par) * SMALL
    }
    /// The arrival line of parity `q` of rank `r`.
    fn arrival_line(&self, r: usize, q: usize) -> usize {
        self.ctrl(r) + q * PARITY_LINE
    }
    /// Where a `len`-byte one-shot message of rank `r` goes: in the arrival line of the call's
    /// barrier (parity `q`) when it fits, else in the small slot of the call's parity `par`.
    fn slot(&self, r: usize, (par, q): (usize, usize), len: usize) -> usize {
        if len <= INLINE {
            self.arrival_line(r, q) + INLINE_AT
        } else {
            self.small(r, par)
        }
    }
    fn staging(&self, r: usize, par: usize) -> usize {
        HEADER + self.size * LINE + 2 * self.size * SMALL + (2 * r + par) * self.chunk
    }
    fn result(&self, par: usize) -> usize {
        HEADER
            + self.size * LINE
            + 2 * self.size * SMALL
            + 2 * self.size * self.chunk
            + par * self.chunk
    }
    /// Total bytes of the segment.
    pub fn bytes(&self) -> usize {
        self.result(2)
    }
}

pub use crate::config::SHM_CHUNK_RANGE as CHUNK_RANGE;

fn reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Inode of this process's pid namespace (0 if unknown).
pub(crate) fn pid_namespace() -> u32 {
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m) as u32)
        .unwrap_or(0)
}

/// The shared-memory state of one rank of a communicator whose ranks share a host.
pub struct ShmGroup {
    seg: Segment,
    layout: Layout,
    rank: usize,
    counter: u32,
    calls: u64,
    steps: u64,
    pidns: u32,
    policy: WaitPolicy,
    /// Accumulate f16 and bf16 in f32 (deterministic mode; see [`ShmGroup::set_canonical`]).
    widen_halves: bool,
    abort: Arc<AtomicBool>,
    /// Payload bytes this rank copied into the segment (see [`ShmGroup::bytes_moved`]).
    written: u64,
    /// Payload bytes this rank copied or reduced out of the segment.
    read: u64,
    /// Waits that skipped the spin because the peer shared this rank's CPU (see `wait_rank`).
    spins_skipped: std::cell::Cell<u64>,
    /// Waits (ranks outnumbering cores) that began polling without yielding because the peer
    /// last waited on another CPU (see `wait_all_oversubscribed`).
    polled_elsewhere: std::cell::Cell<u64>,
    /// Waits that slept (after their spin, or skipping it).
    sleeps: std::cell::Cell<u64>,
    /// The spin window, learned from the waits that slept (not when yielding).
    spin: std::cell::Cell<LearnedSpin>,
    /// How this rank writes what its peers read next, learned per collective and size.
    publishing: PublishPolicy,
    /// Where a rank that publishes to memory reduces its slice first (reused).
    reduced: Vec<u8>,
    /// This rank's vector of an in-place one-shot all-reduce, which the reduction overwrites
    /// (reused; see `all_reduce`).
    own_copy: Vec<u8>,
}

/// What a rank needs to time out and name peers while it waits.
pub struct WaitCtx<'a> {
    /// Operation, for errors.
    pub ctx: &'a OpContext,
    /// When to give up (from the first blocking wait of the operation on), and the timeout
    /// for the message.
    pub deadline: Deadline<'a>,
}

impl ShmGroup {
    /// Create the segment (the local leader does this) and initialise it.
    pub fn create(
        name: &str,
        layout: Layout,
        rank: usize,
        policy: WaitPolicy,
        abort: Arc<AtomicBool>,
    ) -> std::io::Result<ShmGroup> {
        let seg = Segment::create(name, layout.bytes())?;
        seg.atomic_u64(0).store(MAGIC, Ordering::Relaxed);
        seg.atomic_u32(8)
            .store(layout.size as u32, Ordering::Relaxed);
        seg.atomic_u32(12)
            .store(layout.chunk as u32, Ordering::Relaxed);
        Ok(Self::new(seg, layout, rank, policy, abort))
    }

    /// Attach to the segment the leader created.
    pub fn attach(
        name: &str,
        layout: Layout,
        rank: usize,
        policy: WaitPolicy,
        abort: Arc<AtomicBool>,
    ) -> std::io::Result<ShmGroup> {
        let seg = Segment::open(name, layout.bytes())?;
        if seg.atomic_u64(0).load(Ordering::Acquire) != MAGIC
            || seg.atomic_u32(8).load(Ordering::Relaxed) as usize != layout.size
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("shared memory {name} has another layout"),
            ));
        }
        Ok(Self::new(seg, layout, rank, policy, abort))
    }

    fn new(
        seg: Segment,
        layout: Layout,
        rank: usize,
        policy: WaitPolicy,
        abort: Arc<AtomicBool>,
    ) -> ShmGroup {
        let pidns = pid_namespace();
        seg.atomic_u32(layout.ctrl(rank) + PIDNS)
            .store(pidns, Ordering::Relaxed);
        seg.atomic_u32(layout.ctrl(rank) + PID)
            .store(std::process::id(), Ordering::Release);
        ShmGroup {
            seg,
            layout,
            rank,
            counter: 0,
            calls: 0,
            steps: 0,
            pidns,
            policy,
            widen_halves: false,
            abort,
            written: 0,
            read: 0,
            spins_skipped: std::cell::Cell::new(0),
            polled_elsewhere: std::cell::Cell::new(0),
            sleeps: std::cell::Cell::new(0),
            spin: std::cell::Cell::new(LearnedSpin::new(policy.spin)),
            publishing: PublishPolicy::default(),
            reduced: Vec::new(),
            own_copy: Vec::new(),
        }
    }

    /// Learn how to publish (the default) or always publish one way (`HCOMM_SHM_PUBLISH`).
    pub fn set_publishing(&mut self, setting: PublishSetting) {
        self.publishing = PublishPolicy::new(setting);
    }

    /// What this rank has learned about publishing (see [`publish`]).
    pub fn publishing(&self) -> &PublishPolicy {
        &self.publishing
    }

    /// The way the pipelined collective of `kind` about to run on `len` bytes (the same on
    /// every rank) publishes, and when it started; [`published`](Self::published) reports it.
    fn publish_start(&mut self, kind: Kind, len: usize) -> (Kind, usize, Publish, Instant) {
        (kind, len, self.publishing.choose(kind, len), Instant::now())
    }

    /// Tells the policy how long the call that [`publish_start`](Self::publish_start) began
    /// took (only calls that succeeded are reported).
    fn published(&mut self, (kind, len, way, started): (Kind, usize, Publish, Instant)) {
        self.publishing.record(kind, len, way, started.elapsed());
    }

    /// Waits so far that went to sleep at once, without spinning, because the peer waited on
    /// this rank's CPU (the pair shares a core: spinning would only delay it).
    pub fn spins_skipped(&self) -> u64 {
        self.spins_skipped.get()
    }

    /// Waits that polled without yielding first because ranks outnumber the cores and the
    /// peer last waited on another CPU.
    pub fn polled_elsewhere(&self) -> u64 {
        self.polled_elsewhere.get()
    }

    /// Waits so far that slept in the kernel (after spinning, or skipping the spin).
    pub fn sleeps(&self) -> u64 {
        self.sleeps.get()
    }

    /// How long the next wait spins before it sleeps (see [`LearnedSpin`]).
    pub fn spin_window(&self) -> Duration {
        self.spin.get().window()
    }

    /// Payload bytes this rank moved through the segment since it was mapped:
    /// `(written, read)`. Written: bytes copied into the segment, plus the bytes of a reduced
    /// slice a rank computes in place in the segment (counted once, however many inputs it
    /// combines). Read: bytes copied out of the segment, plus every peer's contribution a
    /// reduction reads in place. A rank's own block counts when the algorithm routes it
    /// through the segment. Control words (arrival counters, fingerprints) do not count.
    pub fn bytes_moved(&self) -> (u64, u64) {
        (self.written, self.read)
    }

    /// Copy `src` into the segment at `off`, counted. The protocol must give this rank the
    /// range (see [`Segment::put`]); each call site says which step does.
    fn put(&mut self, off: usize, src: &[u8]) {
        self.written += src.len() as u64;
        self.seg.put(off, src)
    }

    /// Copy bytes at `off` out of the segment into `dst`, counted. The protocol must have
    /// published them (see [`Segment::get`]); each call site says which step did.
    fn get(&mut self, off: usize, dst: &mut [u8]) {
        self.read += dst.len() as u64;
        self.seg.get(off, dst)
    }

    /// [`put`](Self::put) the way `way` says: with streaming stores for [`Publish::Memory`].
    fn put_way(&mut self, off: usize, src: &[u8], way: Publish) {
        match way {
            Publish::Cache => self.put(off, src),
            Publish::Memory => {
                self.written += src.len() as u64;
                crate::base::simd::copy_streaming(self.seg.view_mut(off, src.len()), src);
            }
        }
    }

    /// [`get`](Self::get) with streaming stores (`simd::copy_streaming`): for outputs that
    /// outgrow the caches.
    fn get_streaming(&mut self, off: usize, dst: &mut [u8]) {
        self.read += dst.len() as u64;
        crate::base::simd::copy_streaming(dst, self.seg.view(off, dst.len()))
    }

    /// Remove the segment's name (after every local rank attached).
    pub fn unlink(&self) -> std::io::Result<()> {
        self.seg.unlink()
    }

    /// Bytes of shared memory this communicator uses on this host.
    pub fn footprint(&self) -> usize {
        self.layout.bytes()
    }

    fn size(&self) -> usize {
        self.layout.size
    }
}

/// If process `pid` (of pid namespace `ns`; ours is `my_ns`) is gone, or a zombie its parent
/// (a launcher) has not reaped yet: why, for an error message. A pid only means something in
/// our own pid namespace; our own pid (ranks as threads) is never gone.
pub(crate) fn process_gone(pid: u32, ns: u32, my_ns: u32) -> Option<String> {
    if ns != my_ns || my_ns == 0 || pid == 0 || pid == std::process::id() {
        return None;
    }
    let p = rustix::process::Pid::from_raw(pid as i32)?;
    (rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH) || is_zombie(pid as i32))
        .then(|| format!("its process {pid} is gone (shared memory)"))
}

/// True if process `pid` has exited but was not reaped (state `Z` in `/proc/PID/stat`).
fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|st| {
            // "pid (comm) S ...": the state follows the last ')' (comm may contain ')').
            st.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
        })
        == Some('Z')
}

#[cfg(test)]
mod zombie_tests {
    #[test]
    fn an_unreaped_child_is_a_zombie_and_a_live_process_is_not() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let start = std::time::Instant::now();
        while !super::is_zombie(pid) && start.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(super::is_zombie(pid));
        child.wait().unwrap();
        assert!(!super::is_zombie(std::process::id() as i32));
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::*;
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;

    /// The CPUs this thread may run on.
    fn allowed() -> Vec<usize> {
        let cpus = sched_getaffinity(Pid::from_raw(0)).unwrap();
        (0..CpuSet::count())
            .filter(|&c| cpus.is_set(c).unwrap_or(false))
            .collect()
    }

    /// Run `f` with this thread pinned to `cpu`, then restore its affinity.
    fn on_cpu<R>(cpu: usize, f: impl FnOnce() -> R) -> R {
        let before = sched_getaffinity(Pid::from_raw(0)).unwrap();
        let mut one = CpuSet::new();
        one.set(cpu).unwrap();
        sched_setaffinity(Pid::from_raw(0), &one).unwrap();
        let r = f();
        sched_setaffinity(Pid::from_raw(0), &before).unwrap();
        r
    }

    #[test]
    fn a_waiter_knows_when_its_peer_last_waited_on_the_same_cpu() {
        let name = format!("/hcomm-cpu-test-{}", std::process::id());
        let layout = Layout {
            size: 2,
            chunk: 1 << 16,
        };
        let policy = WaitPolicy::for_local_ranks(2, None, None);
        let abort = Arc::new(AtomicBool::new(false));
        let g0 = ShmGroup::create(&name, layout, 0, policy, abort.clone()).unwrap();
        let g1 = ShmGroup::attach(&name, layout, 1, policy, abort).unwrap();
        g0.unlink().unwrap(); // both mapped: the name is no longer needed
        let cpus = allowed();
        let first = cpus[0];
        // Nothing published yet: not known to share.
        assert!(!on_cpu(first, || g0.publish_cpu(1)));
        // Rank 0 waited on `first`; rank 1 waiting there too shares it, and then rank 0 does.
        assert!(on_cpu(first, || g1.publish_cpu(0)));
        assert!(on_cpu(first, || g0.publish_cpu(1)));
        if let Some(&other) = cpus.get(1) {
            // Rank 1 last waited on `first`; from another CPU, rank 0 does not share it.
            assert!(!on_cpu(other, || g0.publish_cpu(1)));
        }
    }

    /// Two ranks (threads) pinned to `cpus` arrive and wait for each other `calls` times,
    /// with a configured spin of `spin_us`; rank 0 sleeps 2 ms before each of its first
    /// `push` arrivals (pushing rank 1 into sleeping), and a rank whose wait slept takes
    /// `wake_cost` longer to arrive next (a machine whose wake-ups are slow). Returns, per
    /// rank, its waits that skipped the spin and, per call, whether that wait slept.
    fn ping_pong(
        tag: &str,
        cpus: [usize; 2],
        spin_us: u64,
        calls: usize,
        push: usize,
        wake_cost: Duration,
    ) -> [(u64, Vec<bool>); 2] {
        let name = format!("/hcomm-cpu-pp-{tag}-{}", std::process::id());
        let layout = Layout {
            size: 2,
            chunk: 1 << 16,
        };
        let policy = WaitPolicy::for_local_ranks(2, Some(spin_us), Some(2));
        let abort = Arc::new(AtomicBool::new(false));
        let g0 = ShmGroup::create(&name, layout, 0, policy, abort.clone()).unwrap();
        let g1 = ShmGroup::attach(&name, layout, 1, policy, abort).unwrap();
        g0.unlink().unwrap();
        let run = move |mut g: ShmGroup, cpu: usize| {
            on_cpu(cpu, move || {
                let ctx = OpContext::default();
                let w = WaitCtx {
                    ctx: &ctx,
                    deadline: Deadline::fixed(Instant::now(), Duration::from_secs(60)),
                };
                let peer = 1 - g.rank;
                let mut slept = Vec::with_capacity(calls);
                for call in 0..calls {
                    if g.rank == 0 && call < push {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    if slept.last() == Some(&true) && !wake_cost.is_zero() {
                        std::thread::sleep(wake_cost);
                    }
                    let before = g.sleeps();
                    let t = g.arrive();
                    g.wait_rank(peer, t, &w, false).unwrap();
                    slept.push(g.sleeps() > before);
                }
                (g.spins_skipped(), slept)
            })
        };
        let a = std::thread::spawn(move || run(g0, cpus[0]));
        let b = std::thread::spawn(move || run(g1, cpus[1]));
        [a.join().unwrap(), b.join().unwrap()]
    }

    #[test]
    fn a_pair_pushed_into_sleeping_returns_to_spinning_within_bounded_calls() {
        // A wake-up that costs 300 µs outlasts the default 50 µs spin: without a learned
        // window, once rank 1 sleeps, each rank's wake-up outlasts the other's spin and the
        // pair sleeps at every call for good (the "slow mode" of issue #22, which a VM's slow
        // wake-ups caused). The window learned from the first sleeps must end it. (Counts of
        // calls, not times: the sleeps only set the scene.)
        let cpus = allowed();
        let Some(&other) = cpus.get(1) else {
            eprintln!("one CPU only: a pair cannot spin apart here");
            return;
        };
        const CALLS: usize = 400;
        const PUSH: usize = 5;
        const STREAK: usize = 20;
        let ranks = ping_pong(
            "learn",
            [cpus[0], other],
            50,
            CALLS,
            PUSH,
            Duration::from_micros(300),
        );
        for (rank, (_, slept)) in ranks.iter().enumerate() {
            if rank == 1 {
                assert!(
                    slept[..PUSH].iter().any(|&s| s),
                    "rank 1 was not pushed into sleeping: {slept:?}"
                );
            }
            let back = (PUSH..=CALLS - STREAK)
                .find(|&i| slept[i..i + STREAK].iter().all(|&s| !s))
                .unwrap_or_else(|| {
                    panic!(
                        "rank {rank} never waited {STREAK} times in a row without sleeping \
                         in {CALLS} calls: {slept:?}"
                    )
                });
            eprintln!("rank {rank}: spinning again from call {back} on");
        }
    }

    #[test]
    fn a_pair_on_one_cpu_stops_spinning_and_a_pair_on_two_spins() {
        // On one CPU, a spinning waiter would hold off its peer for the whole spin on every
        // call; the pair must see that and sleep instead. (Counts, not times.)
        let cpus = allowed();
        let same = ping_pong("same", [cpus[0], cpus[0]], 200, 200, 0, Duration::ZERO)
            .map(|(skipped, _)| skipped);
        assert!(
            same.iter().sum::<u64>() > 0,
            "a pair pinned to one CPU never skipped the spin: {same:?}"
        );
        if let Some(&other) = cpus.get(1) {
            let apart = ping_pong("apart", [cpus[0], other], 200, 200, 0, Duration::ZERO)
                .map(|(skipped, _)| skipped);
            assert_eq!(apart, [0, 0], "a pair on two CPUs must keep spinning");
        }
    }

    /// Four ranks (threads) of a group that outnumbers 2 cores, rank `r` pinned to
    /// `cpus[r]`, arrive and wait for all `calls` times; with `stale`, each rank then writes
    /// a CPU that does not exist into its slot, so that peers believe it runs elsewhere when
    /// it does not. Returns per rank the waits that polled without yielding first.
    fn four_on_two(tag: &str, cpus: [usize; 4], calls: usize, stale: bool) -> Vec<u64> {
        let name = format!("/hcomm-cpu-4-{tag}-{}", std::process::id());
        let layout = Layout {
            size: 4,
            chunk: 1 << 16,
        };
        let policy = WaitPolicy::for_local_ranks(4, None, Some(2));
        assert!(policy.yield_cpu);
        let abort = Arc::new(AtomicBool::new(false));
        let mut groups = vec![ShmGroup::create(&name, layout, 0, policy, abort.clone()).unwrap()];
        for r in 1..4 {
            groups.push(ShmGroup::attach(&name, layout, r, policy, abort.clone()).unwrap());
        }
        groups[0].unlink().unwrap();
        let threads: Vec<_> = groups
            .into_iter()
            .zip(cpus)
            .map(|(mut g, cpu)| {
                std::thread::spawn(move || {
                    on_cpu(cpu, move || {
                        let ctx = OpContext::default();
                        let w = WaitCtx {
                            ctx: &ctx,
                            deadline: Deadline::fixed(Instant::now(), Duration::from_secs(60)),
                        };
                        for call in 0..calls {
                            if call % 50 == g.rank {
                                // a late rank now and then: every wait path is taken
                                std::thread::sleep(Duration::from_micros(300));
                            }
                            let t = g.arrive();
                            g.wait_all_oversubscribed(t, &w).unwrap();
                            if stale {
                                g.seg
                                    .atomic_u32(CPU_AT + 4 * g.rank)
                                    .store(100_000 + g.rank as u32, Ordering::Relaxed);
                            }
                        }
                        g.polled_elsewhere()
                    })
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn oversubscribed_ranks_yield_to_their_own_cpus_peers_and_poll_for_the_others() {
        // Every run must finish every call (the deadline is 60 s); what is checked is which
        // waits polled without yielding, never how long anything took.
        let cpus = allowed();
        let c0 = cpus[0];
        // All four on one CPU: every peer waited here, none is polled for.
        let one = four_on_two("one", [c0; 4], 300, false);
        assert_eq!(one, [0; 4], "peers on this very CPU must be yielded to");
        // Peers that claim another CPU while they share this one (a stale belief): the waits
        // poll for them, then yield after half the window, and every call still completes.
        let stale = four_on_two("stale", [c0; 4], 300, true);
        assert!(
            stale.iter().all(|&p| p > 0),
            "stale beliefs were never acted on: {stale:?}"
        );
        if let Some(&c1) = cpus.get(1) {
            // Two per CPU: each rank polls for the two peers of the other CPU.
            let apart = four_on_two("apart", [c0, c1, c0, c1], 300, false);
            assert!(
                apart.iter().all(|&p| p > 0),
                "peers on the other CPU were never polled for: {apart:?}"
            );
        }
    }
}
