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

    /// The parity of this rank's next arrival (its arrival line).
    fn next_parity(&self) -> usize {
        (self.counter.wrapping_add(1) % 2) as usize
    }

    /// The parities of a one-shot call: of its number (the small slots) and of its barrier
    /// (the arrival line that carries inline data). Taken before the call's barrier.
    fn one_shot_parities(&mut self) -> (usize, usize) {
        let par = (self.calls % 2) as usize;
        self.calls += 1;
        (par, self.next_parity())
    }

    /// Publish the next arrival (in the arrival line of its parity).
    fn arrive(&mut self) -> u32 {
        self.counter = self.counter.wrapping_add(1);
        let line = self
            .layout
            .arrival_line(self.rank, (self.counter % 2) as usize);
        let ctr = self.seg.atomic_u32(line + CTR);
        ctr.store(self.counter, Ordering::Release);
        // Dekker with the waiter's `waiters += 1; fence; load(counter)` (README.md).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.seg.atomic_u32(line + WAITERS).load(Ordering::Relaxed) != 0 {
            futex::wake_all(ctr);
        }
        self.counter
    }

    /// Tell the other local ranks that this communicator failed (blaming `culprit` for
    /// `reason`): a rank waiting on shared memory then fails at once with the cause. The first
    /// report stays; every waiter is woken.
    pub fn post_abort(&self, culprit: Option<usize>, reason: u8) {
        let word = 1u64 << 63
            | (self.rank as u64 & 0x7f_ffff) << 40
            | (reason as u64) << 32
            | culprit.map_or(0, |c| c as u64 + 1) & 0xffff_ffff;
        let _ = self.seg.atomic_u64(ABORT_WORD).compare_exchange(
            0,
            word,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        for p in 0..self.size() {
            for q in 0..2 {
                futex::wake_all(self.seg.atomic_u32(self.layout.arrival_line(p, q) + CTR));
            }
        }
    }

    /// The failure another local rank reported, as this rank's error. Blame that lands on
    /// this rank while it waits for rank `waiting_for` passes on to that rank (this rank is
    /// not the cause: it is waiting too).
    fn posted_abort(&self, w: &WaitCtx, waiting_for: usize) -> Option<Error> {
        let word = self.seg.atomic_u64(ABORT_WORD).load(Ordering::Acquire);
        if word == 0 {
            return None;
        }
        let reporter = ((word >> 40) & 0x7f_ffff) as usize;
        let reason = crate::base::error::AbortReason::from_u8((word >> 32) as u8);
        let culprit = match word & 0xffff_ffff {
            0 => None,
            // A revocation names who revoked, even when that is this rank.
            c if c as usize - 1 == self.rank
                && reason != crate::base::error::AbortReason::Revoked =>
            {
                Some(waiting_for)
            }
            c => Some(c as usize - 1),
        };
        Some(reason.remote_error(w.ctx.clone(), reporter, culprit))
    }

    /// Publish the CPU this rank runs on (it is about to wait) and return it (plus one), or
    /// `None` when this rank has no slot or the CPU is unknown.
    fn publish_my_cpu(&self) -> Option<u32> {
        if self.rank >= CPU_SLOTS {
            return None;
        }
        let mine = nix::sched::sched_getcpu().ok()? as u32 + 1;
        let slot = self.seg.atomic_u32(CPU_AT + 4 * self.rank);
        if slot.load(Ordering::Relaxed) != mine {
            slot.store(mine, Ordering::Relaxed);
        }
        Some(mine)
    }

    /// The CPU rank `p` last waited on (plus one), if known.
    fn cpu_of(&self, p: usize) -> Option<u32> {
        if p >= CPU_SLOTS {
            return None;
        }
        Some(self.seg.atomic_u32(CPU_AT + 4 * p).load(Ordering::Relaxed)).filter(|&c| c != 0)
    }

    /// Publish the CPU this rank runs on (it is about to wait), and say whether rank `p`
    /// last waited on the same one.
    fn publish_cpu(&self, p: usize) -> bool {
        if p >= CPU_SLOTS {
            return false;
        }
        let Some(mine) = self.publish_my_cpu() else {
            return false;
        };
        self.cpu_of(p) == Some(mine)
    }

    /// Wait until rank `p` has arrived `target` times. `elsewhere`: ranks outnumber the cores,
    /// and `p` last waited on another CPU than this rank's (see
    /// [`wait_all_oversubscribed`](Self::wait_all_oversubscribed)): poll without yielding
    /// for the first half of the window.
    fn wait_rank(&self, p: usize, target: u32, w: &WaitCtx, elsewhere: bool) -> Result<()> {
        // Arrival `target` is written to the line of its parity, which holds `target - 2`
        // until then (p cannot arrive at `target + 2` before this rank arrived at
        // `target + 1`).
        let line = self.layout.arrival_line(p, (target % 2) as usize);
        let ctr = self.seg.atomic_u32(line + CTR);
        if reached(ctr.load(Ordering::Acquire), target) {
            return Ok(());
        }
        // Busy phase: spin (or yield when oversubscribed) for the configured time; the clock
        // is read only every 64 polls, from the 64th on, so that it does not slow down
        // noticing the peer (a wait that ends within 64 polls reads no clock at all). Not
        // when the peer last waited on this very CPU: it can only arrive once this rank gives
        // the CPU up, so spinning would only delay it (by the whole spin, every call: the
        // "slow mode" of a pair the scheduler put on one core), and sleeping at once lets it
        // run here and its wake-up move this rank to an idle CPU.
        // (Yielding ranks, outnumbering the cores, let the peer run anyway: no need to know.)
        // The spin window is learned (`LearnedSpin`): a wait that slept and was answered soon
        // after widens it, so that a pair does not stay in the sleep-and-wake "slow mode".
        let skip = !self.policy.yield_cpu && self.publish_cpu(p);
        let window = if self.policy.yield_cpu {
            self.policy.spin
        } else {
            self.spin.get().window()
        };
        if skip {
            self.spins_skipped.set(self.spins_skipped.get() + 1);
        }
        if elsewhere && self.policy.yield_cpu {
            self.polled_elsewhere.set(self.polled_elsewhere.get() + 1);
        }
        let mut start = None;
        let mut yielding = self.policy.yield_cpu && !elsewhere;
        'busy: loop {
            if skip {
                break 'busy;
            }
            for _ in 0..64 {
                if yielding {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                if reached(ctr.load(Ordering::Acquire), target) {
                    return Ok(());
                }
            }
            let now = Instant::now();
            let waited = now.duration_since(*start.get_or_insert(now));
            if waited >= window {
                break 'busy;
            }
            // A peer believed to run on another CPU that has not arrived within half the
            // window may be waiting for this one (the belief is stale): yield from now on.
            yielding |= self.policy.yield_cpu && waited >= window / 2;
        }
        // Sleep on the peer's counter, checking the deadline, abort and the peer's life. The
        // operation's deadline counts from its first sleep if nothing read it before.
        let waiters = self.seg.atomic_u32(line + WAITERS);
        let mut last_check = Instant::now();
        let deadline = w.deadline.at_from(|| last_check);
        self.sleeps.set(self.sleeps.get() + 1);
        let slept_at = last_check;
        // The peer answered: learn from how long after the wait began (spinning waits only).
        let answered = || {
            if !skip && !self.policy.yield_cpu {
                let began = start.unwrap_or(slept_at);
                let mut spin = self.spin.get();
                spin.slept(began.elapsed());
                self.spin.set(spin);
            }
            Ok(())
        };
        loop {
            waiters.fetch_add(1, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::SeqCst);
            let v = ctr.load(Ordering::Acquire);
            if reached(v, target) {
                waiters.fetch_sub(1, Ordering::Relaxed);
                return answered();
            }
            futex::wait(ctr, v, Duration::from_millis(10));
            waiters.fetch_sub(1, Ordering::Relaxed);
            if reached(ctr.load(Ordering::Acquire), target) {
                return answered();
            }
            if self.abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted { ctx: w.ctx.clone() });
            }
            if let Some(e) = self.posted_abort(w, p) {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    ctx: w.ctx.clone(),
                    peers: vec![p],
                    after: w.deadline.timeout(),
                    detail: format!(
                        "shared memory: rank {p} did not arrive (at {} of {target})",
                        ctr.load(Ordering::Relaxed)
                    ),
                });
            }
            if now.duration_since(last_check) >= LIFE_CHECK_EVERY {
                last_check = now;
                let block = self.layout.ctrl(p);
                let pid = self.seg.atomic_u32(block + PID).load(Ordering::Acquire);
                let ns = self.seg.atomic_u32(block + PIDNS).load(Ordering::Relaxed);
                if let Some(detail) = process_gone(pid, ns, self.pidns) {
                    return Err(Error::PeerClosed {
                        ctx: w.ctx.clone(),
                        peer: p,
                        detail,
                    });
                }
            }
        }
    }

    fn arrive_and_wait_all(&mut self, w: &WaitCtx) -> Result<()> {
        let t = self.arrive();
        if self.policy.yield_cpu {
            return self.wait_all_oversubscribed(t, w);
        }
        for p in 0..self.size() {
            if p != self.rank {
                self.wait_rank(p, t, w, false)?;
            }
        }
        Ok(())
    }

    /// Wait for every peer's arrival `t` when ranks outnumber the cores. Yielding to a peer
    /// that runs on another CPU only hands this CPU to a rank that is itself waiting, and
    /// every hand-off is a context switch (1-2 µs on a VM); so this rank first waits for the
    /// peers that last waited on its own CPU (or on an unknown one), yielding to them, and
    /// then for the others, polling without yielding for the first half of the window. Once
    /// the peers of its CPU have arrived, the others' progress no longer needs this CPU; a
    /// belief gone stale (the scheduler moved a peer here) costs half a window, then it
    /// yields. Measured on 4 ranks on 2 cores: fewer switches per call (design.md).
    fn wait_all_oversubscribed(&self, t: u32, w: &WaitCtx) -> Result<()> {
        let n = self.size();
        let mine = self.publish_my_cpu();
        // Peers believed elsewhere, decided once (a bit per rank below `CPU_SLOTS`).
        let mut elsewhere = 0u32;
        if let Some(mine) = mine {
            for p in (0..n.min(CPU_SLOTS)).filter(|&p| p != self.rank) {
                if self.cpu_of(p).is_some_and(|c| c != mine) {
                    elsewhere |= 1 << p;
                }
            }
        }
        let away = |p: usize| p < CPU_SLOTS && elsewhere & (1 << p) != 0;
        for p in (0..n).filter(|&p| p != self.rank && !away(p)) {
            self.wait_rank(p, t, w, false)?;
        }
        for p in (0..n).filter(|&p| away(p)) {
            self.wait_rank(p, t, w, true)?;
        }
        Ok(())
    }

    /// Publish this call's fingerprint (before its first arrival) in the arrival line of that
    /// arrival (parity `q`, returned): a peer checks it after awaiting the arrival, and this
    /// rank rewrites it two arrivals on, after that peer arrived once more.
    fn publish(&mut self, fp: ShmFingerprint) -> usize {
        let q = self.next_parity();
        let at = self.layout.arrival_line(self.rank, q) + FP;
        // Published by the Release store of this rank's next arrival.
        self.seg.atomic_u64(at).store(fp.seq, Ordering::Relaxed);
        self.seg
            .atomic_u64(at + 8)
            .store(fp.word, Ordering::Relaxed);
        self.seg
            .atomic_u64(at + 16)
            .store(fp.detail, Ordering::Relaxed);
        q
    }

    /// After the first barrier of a call: every peer published this very call (same sequence
    /// number, else the ranks are out of step) with the same fingerprint. The fingerprints
    /// share the counter's cache line, which the wait brought here. (A peer whose arrival was
    /// not the first barrier of a call left an older fingerprint there: a mismatch too.)
    fn verify(&self, fp: ShmFingerprint, q: usize, w: &WaitCtx) -> Result<()> {
        for p in 0..self.size() {
            if p == self.rank {
                continue;
            }
            let at = self.layout.arrival_line(p, q) + FP;
            // Acquire: the arrival awaited published it already.
            let seq = self.seg.atomic_u64(at).load(Ordering::Acquire);
            let word = self.seg.atomic_u64(at + 8).load(Ordering::Relaxed);
            let detail = self.seg.atomic_u64(at + 16).load(Ordering::Relaxed);
            if seq == fp.seq && word == fp.word && detail == fp.detail {
                continue;
            }
            let theirs = if seq != fp.seq {
                format!("its collective number {seq}")
            } else {
                crate::wire::collective::describe_shm_word(word)
            };
            let extra = if seq == fp.seq && word == fp.word {
                " (per-rank counts or algorithm differ)"
            } else {
                ""
            };
            return Err(Error::Mismatch {
                ctx: w.ctx.clone(),
                peer: p,
                msg: format!(
                    "rank {p} called {theirs} while this rank called {} at seq {}{extra}",
                    crate::wire::collective::describe_shm_word(fp.word),
                    fp.seq
                ),
            });
        }
        Ok(())
    }

    /// The first barrier of a call, with the fingerprint check.
    fn first_barrier(&mut self, fp: ShmFingerprint, w: &WaitCtx) -> Result<()> {
        let published = self.publish(fp);
        self.arrive_and_wait_all(w)?;
        self.verify(fp, published, w)
    }

    /// The barrier of a pipelined step (one per step): the first step of a call also checks
    /// fingerprints.
    fn step_barrier(&mut self, first: &mut bool, fp: ShmFingerprint, w: &WaitCtx) -> Result<()> {
        if std::mem::take(first) {
            self.first_barrier(fp, w)
        } else {
            self.arrive_and_wait_all(w)
        }
    }

    /// `acc = contribution(0) ⊕ contribution(1) ⊕ …` in rank order (bitwise identical results
    /// on every rank, run after run).
    fn reduce_in_rank_order<'c>(
        n: usize,
        acc: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        widen_halves: bool,
        contribution: impl Fn(usize) -> &'c [u8],
    ) {
        if widen_halves && matches!(dtype, DType::F16 | DType::BF16) {
            // The canonical expression of deterministic mode: the same fold, in f32.
            let parts: Vec<&[u8]> = (0..n).map(contribution).collect();
            fold_in_order(dtype, op, acc, &parts);
            return;
        }
        if n == 1 {
            acc.copy_from_slice(contribution(0));
            return;
        }
        // The first two in one pass (the copy of the first and the first step, fused).
        reduce_pair(dtype, op, acc, contribution(0), contribution(1));
        for p in 2..n {
            reduce_into(dtype, op, acc, contribution(p), Order::AccFirst);
        }
    }

    /// Reductions on this group combine the ranks in rank order always; with `on` they also
    /// accumulate f16 and bf16 in f32, which makes every element the canonical expression of
    /// deterministic mode ([`fold_in_order`]), the same bits as the canonical schedules over
    /// the links.
    pub fn set_canonical(&mut self, on: bool) {
        self.widen_halves = on;
    }

    /// Barrier.
    pub fn barrier(&mut self, fp: ShmFingerprint, w: &WaitCtx) -> Result<()> {
        self.first_barrier(fp, w)
    }

    /// All-reduce (`input = None`: in place on `out`); with `root = Some(r)` it is a reduce and
    /// only rank `r` writes `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: Option<usize>,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let len = input.map_or(out.len(), |i| i.len());
        let writes_out = root.is_none_or(|r| r == me);
        if len <= SMALL {
            // One shot: everyone publishes its vector; everyone sums all in rank order.
            let par = self.one_shot_parities();
            let src: &[u8] = match input {
                Some(i) => i,
                None => &*out,
            };
            // Protocol: slot (me, par) is this rank's: peers last read it in the call before the
            // previous one, and every peer arrived at the previous call after finishing that.
            // (An inline slot lives in the arrival line of this call's barrier: peers last read
            // it after the arrival before the previous one, and arrived once more since.)
            self.put(self.layout.slot(me, par, len), src);
            self.first_barrier(fp, w)?;
            if writes_out {
                // Protocol: slot (p, par) was published by p's arrival, which we awaited; p does
                // not write it again before we arrive at the next call.
                let slot = |p: usize| self.seg.view(self.layout.slot(p, par, len), len);
                Self::reduce_in_rank_order(n, &mut out[..len], dtype, op, self.widen_halves, slot);
                self.read += (n * len) as u64;
                if op == ReduceOp::Mean {
                    finalize_mean(dtype, out, n);
                }
            }
            return Ok(());
        }
        let call = self.publish_start(Kind::AllReduce, len);
        self.all_reduce_pipelined(input, out, dtype, op, writes_out, fp, w, call.2)?;
        self.published(call);
        Ok(())
    }

    /// The all-reduce (or reduce) of more than [`SMALL`] bytes, publishing `way`.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_pipelined(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        writes_out: bool,
        fp: ShmFingerprint,
        w: &WaitCtx,
        way: Publish,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let es = dtype.size();
        let len = input.map_or(out.len(), |i| i.len());
        // Software-pipelined, one barrier per step: step j stages chunk j, reduces chunk j-1
        // (staged in step j-1) and copies chunk j-2 out (reduced in step j-1), then arrives
        // and waits for all. Two phases per chunk, each followed by a barrier, made every rank
        // wait for the slowest at twice as many points; this way a rank's work between
        // barriers is three pieces, and a late peer costs less.
        let chunk = (self.layout.chunk / (n * es) * (n * es)).max(n * es);
        let chunks = len.div_ceil(chunk);
        let base = self.steps;
        self.steps += chunks as u64;
        let at = |c: usize| {
            let o = c * chunk;
            let l = chunk.min(len - o);
            let par = ((base + c as u64) % 2) as usize;
            (o, l, par, even_segments(l / es, n, es))
        };
        // The outputs of all ranks outgrow the caches: write ours with streaming stores.
        let stream_out = n * len >= STREAM_OUTPUTS_FROM;
        let mut first = true;
        for j in 0..chunks + 2 {
            if j < chunks {
                // Stage the slices of chunk j that the peers reduce.
                let (o, l, par, segs) = at(j);
                let inp: &[u8] = match input {
                    Some(i) => &i[o..o + l],
                    None => &out[o..o + l],
                };
                for (p, s) in segs.iter().enumerate() {
                    if p != me {
                        // Protocol: staging (me, par) was last read in the reduction of chunk
                        // j-2, in step j-1, before the readers arrived at step j-1's barrier,
                        // which this rank awaited.
                        self.put_way(self.layout.staging(me, par) + s.start, &inp[s.clone()], way);
                    }
                }
            }
            if (1..=chunks).contains(&j) {
                // Reduce our slice of chunk j-1, in rank order, into the shared result.
                let (o, _, par, segs) = at(j - 1);
                let mine = segs[me].clone();
                let r_off = self.layout.result(par) + mine.start;
                // Protocol: our slice of result[par] was last read when chunk j-3 was copied
                // out, in step j-1, before its readers arrived at that step's barrier.
                let acc = self.seg.view_mut(r_off, mine.len());
                let (seg, layout) = (&self.seg, &self.layout);
                // Protocol: published by p's arrival at step j-1's barrier; p rewrites it only
                // in step j+1, after our arrival at step j.
                let staged = |p: usize| seg.view(layout.staging(p, par) + mine.start, mine.len());
                let ours = o + mine.start..o + mine.end;
                match (way, input) {
                    (Publish::Memory, Some(i)) if writes_out && !stream_out => {
                        // Reduce straight into our output, then stream the slice to the
                        // result for the peers.
                        let own = &i[ours.clone()];
                        let to = &mut out[ours.clone()];
                        let contribution = |p: usize| if p == me { own } else { staged(p) };
                        Self::reduce_in_rank_order(
                            n,
                            to,
                            dtype,
                            op,
                            self.widen_halves,
                            contribution,
                        );
                        crate::base::simd::copy_streaming(acc, to);
                    }
                    (Publish::Memory, _) => {
                        // In place (our slice of the output is our contribution), or our
                        // output too is written with streaming stores, or we write none.
                        if self.reduced.len() < mine.len() {
                            self.reduced.resize(mine.len(), 0);
                        }
                        let tmp = &mut self.reduced[..mine.len()];
                        let own: &[u8] = match input {
                            Some(i) => &i[ours.clone()],
                            None => &out[ours.clone()],
                        };
                        let contribution = |p: usize| if p == me { own } else { staged(p) };
                        Self::reduce_in_rank_order(
                            n,
                            tmp,
                            dtype,
                            op,
                            self.widen_halves,
                            contribution,
                        );
                        crate::base::simd::copy_streaming(acc, tmp);
                        if writes_out {
                            if stream_out {
                                crate::base::simd::copy_streaming(&mut out[ours.clone()], tmp);
                            } else {
                                out[ours.clone()].copy_from_slice(tmp);
                            }
                        }
                    }
                    (Publish::Cache, _) => {
                        let own: &[u8] = match input {
                            Some(i) => &i[ours.clone()],
                            None => &out[ours.clone()],
                        };
                        let contribution = |p: usize| if p == me { own } else { staged(p) };
                        Self::reduce_in_rank_order(
                            n,
                            acc,
                            dtype,
                            op,
                            self.widen_halves,
                            contribution,
                        );
                        if writes_out {
                            // Our own slice of the result is in the cache now: copy it out at
                            // once (the copy-out below takes only the peers' slices). The
                            // input's slice there was consumed by the reduction just above.
                            let to = &mut out[ours.clone()];
                            let from = self.seg.view(r_off, mine.len());
                            if stream_out {
                                crate::base::simd::copy_streaming(to, from);
                            } else {
                                to.copy_from_slice(from);
                            }
                            self.read += mine.len() as u64;
                        }
                    }
                }
                self.read += ((n - 1) * mine.len()) as u64;
                self.written += mine.len() as u64;
            }
            if j >= 2 && writes_out {
                // Every slice of chunk j-2 is reduced: copy the peers' out.
                let (o, _, par, segs) = at(j - 2);
                for (p, s) in segs.iter().enumerate() {
                    if p == me {
                        continue; // copied right after its reduction
                    }
                    // Protocol: reduced in step j-1, published by that step's barrier; the
                    // owners rewrite result[par] only in step j+1, after our arrival at step j
                    // (or, after the last step, in a later collective, after our arrival
                    // there).
                    let (from, to) = (
                        self.layout.result(par) + s.start,
                        &mut out[o + s.start..o + s.end],
                    );
                    if stream_out {
                        self.get_streaming(from, to);
                    } else {
                        self.get(from, to);
                    }
                }
            }
            if j <= chunks {
                self.step_barrier(&mut first, fp, w)?;
            }
        }
        if writes_out && op == ReduceOp::Mean {
            finalize_mean(dtype, out, n);
        }
        Ok(())
    }

    /// Broadcast `buf` from `root`.
    pub fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: usize,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let me = self.rank;
        if buf.len() <= SMALL {
            // One shot: the root publishes its slot, everyone copies it after one barrier.
            let par = self.one_shot_parities();
            let len = buf.len();
            if me == root {
                // Protocol: slot (root, par) is ours (see all_reduce's one-shot path).
                self.put(self.layout.slot(root, par, len), buf);
            }
            self.first_barrier(fp, w)?;
            if me != root {
                // Protocol: published by the root's arrival; rewritten two calls later at the
                // earliest.
                self.get(self.layout.slot(root, par, len), buf);
            }
            return Ok(());
        }
        let call = self.publish_start(Kind::Broadcast, buf.len());
        let mut first = true;
        let mut o = 0;
        loop {
            let l = self.layout.chunk.min(buf.len() - o);
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            if me == root {
                // Protocol: staging (root, par) is ours (readers finished two steps ago).
                self.put_way(self.layout.staging(root, par), &buf[o..o + l], call.2);
            }
            self.step_barrier(&mut first, fp, w)?;
            if me != root {
                // Protocol: published by the root's arrival; rewritten only after our next one
                // (at the next step's barrier).
                self.get(self.layout.staging(root, par), &mut buf[o..o + l]);
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += l;
            if o >= buf.len() {
                self.published(call);
                return Ok(());
            }
        }
    }

    /// All-gather with per-rank block sizes (bytes `blocks[p]`, placed consecutively in `out`);
    /// `input = None`: this rank's block is already in place in `out`. With `root = Some(r)` it
    /// is a gather and only rank `r` writes `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_gather(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        blocks: &[usize],
        root: Option<usize>,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let me = self.rank;
        let offs: Vec<usize> = blocks
            .iter()
            .scan(0, |acc, &b| {
                let o = *acc;
                *acc += b;
                Some(o)
            })
            .collect();
        let longest = blocks.iter().copied().max().unwrap_or(0);
        let writes_out = root.is_none_or(|r| r == me);
        if longest <= SMALL {
            // One shot: every rank publishes its block in its slot; one barrier; read them all.
            let par = self.one_shot_parities();
            let src: &[u8] = match input {
                Some(i) => i,
                None => &out[offs[me]..offs[me] + blocks[me]],
            };
            // Protocol: slot (me, par) is ours (see all_reduce's one-shot path).
            self.put(self.layout.slot(me, par, longest), src);
            self.first_barrier(fp, w)?;
            if writes_out {
                for (p, &b) in blocks.iter().enumerate() {
                    if p == me && input.is_none() {
                        continue;
                    }
                    // Protocol: published by p's arrival; rewritten two calls later at the
                    // earliest.
                    self.get(
                        self.layout.slot(p, par, longest),
                        &mut out[offs[p]..offs[p] + b],
                    );
                }
            }
            return Ok(());
        }
        let chunk = self.layout.chunk;
        let call = self.publish_start(Kind::AllGather, longest);
        let mut first = true;
        let mut o = 0;
        loop {
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            let mine_l = blocks[me].saturating_sub(o).min(chunk);
            let src: &[u8] = match input {
                Some(i) => &i[o.min(i.len())..o.min(i.len()) + mine_l],
                None => &out[offs[me] + o.min(blocks[me])..offs[me] + o.min(blocks[me]) + mine_l],
            };
            // Protocol: staging (me, par) is ours (readers finished two steps ago).
            self.put_way(self.layout.staging(me, par), src, call.2);
            self.step_barrier(&mut first, fp, w)?;
            if writes_out {
                for (p, &b) in blocks.iter().enumerate() {
                    let l = b.saturating_sub(o).min(chunk);
                    if l == 0 || (p == me && input.is_none()) {
                        continue;
                    }
                    let dst = &mut out[offs[p] + o..offs[p] + o + l];
                    // Protocol: published by p's arrival; rewritten only after our next arrival
                    // (at the next step's barrier).
                    self.get(self.layout.staging(p, par), dst);
                }
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += chunk;
            if o >= longest {
                self.published(call);
                return Ok(());
            }
        }
    }

    /// Reduce-scatter with per-rank block sizes (bytes); `input = None`: in place, the result
    /// lands in block `rank` of `out` (other blocks unchanged), else `out` is this rank's block.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        blocks: &[usize],
        dtype: DType,
        op: ReduceOp,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let es = dtype.size();
        let offs: Vec<usize> = blocks
            .iter()
            .scan(0, |acc, &b| {
                let o = *acc;
                *acc += b;
                Some(o)
            })
            .collect();
        let longest = blocks.iter().copied().max().unwrap_or(0);
        // Each step handles a piece of every block; staging holds one piece per block.
        let piece = (self.layout.chunk / n / es * es).max(es);
        let call = self.publish_start(Kind::ReduceScatter, longest);
        let mut first = true;
        let mut o = 0;
        loop {
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            let full: &[u8] = match input {
                Some(i) => i,
                None => &*out,
            };
            for (p, &b) in blocks.iter().enumerate() {
                let l = b.saturating_sub(o).min(piece);
                if p != me && l > 0 {
                    // Protocol: staging (me, par) is ours (readers finished two steps ago).
                    self.put_way(
                        self.layout.staging(me, par) + p * piece,
                        &full[offs[p] + o..offs[p] + o + l],
                        call.2,
                    );
                }
            }
            self.step_barrier(&mut first, fp, w)?;
            let l = blocks[me].saturating_sub(o).min(piece);
            if let (true, Some(input)) = (l > 0, input) {
                // Out of place: reduce straight into our block of `out` (only this rank ever
                // reads its piece, so it need not pass through the result area).
                let own = &input[offs[me] + o..offs[me] + o + l];
                let contribution = |p: usize| -> &[u8] {
                    if p == me {
                        own
                    } else {
                        // Protocol: published by p's arrival.
                        self.seg.view(self.layout.staging(p, par) + me * piece, l)
                    }
                };
                Self::reduce_in_rank_order(
                    n,
                    &mut out[o..o + l],
                    dtype,
                    op,
                    self.widen_halves,
                    contribution,
                );
                self.read += ((n - 1) * l) as u64;
            } else if l > 0 {
                let r_off = self.layout.result(par) + me * piece;
                // Protocol: our piece of the result area, nobody else reads or writes it.
                let acc = self.seg.view_mut(r_off, l);
                let own: &[u8] = match input {
                    Some(i) => &i[offs[me] + o..offs[me] + o + l],
                    None => &out[offs[me] + o..offs[me] + o + l],
                };
                let contribution = |p: usize| -> &[u8] {
                    if p == me {
                        own
                    } else {
                        // Protocol: published by p's arrival.
                        self.seg.view(self.layout.staging(p, par) + me * piece, l)
                    }
                };
                Self::reduce_in_rank_order(n, acc, dtype, op, self.widen_halves, contribution);
                let dst = match input {
                    Some(_) => &mut out[o..o + l],
                    None => &mut out[offs[me] + o..offs[me] + o + l],
                };
                dst.copy_from_slice(acc);
                // Peers' pieces reduced in place, our result written, then copied out.
                self.read += (n * l) as u64;
                self.written += l as u64;
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += piece;
            if o >= longest {
                break;
            }
        }
        self.published(call);
        if op == ReduceOp::Mean {
            match input {
                Some(_) => finalize_mean(dtype, out, n),
                None => finalize_mean(dtype, &mut out[offs[me]..offs[me] + blocks[me]], n),
            }
        }
        Ok(())
    }

    /// Scatter (`root = Some(r)`: only `r` sends) or all-to-all (`root = None`): block `p` of
    /// `input` (byte range `send[p]`) goes to rank `p`, and the block from rank `q` lands in
    /// byte range `recv[q]` of `out`. Every block length must be known to every
    /// rank (equal blocks, or the scatter's counts), so that all ranks run the same steps.
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_all(
        &mut self,
        input: &[u8],
        send: &[Range<usize>],
        out: &mut [u8],
        recv: &[Range<usize>],
        root: Option<usize>,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        // The same on every rank: the caller guarantees all block lengths are known to all.
        let longest = send.iter().chain(recv).map(|r| r.len()).max().unwrap_or(0);
        self.all_to_all_staged(input, send, out, recv, root, longest, fp, w)
    }

    /// [`all_to_all`](Self::all_to_all) through the staging buffers, in pieces, until
    /// `longest` (the longest block of any rank, the same on every rank) has moved.
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_staged(
        &mut self,
        input: &[u8],
        send: &[Range<usize>],
        out: &mut [u8],
        recv: &[Range<usize>],
        root: Option<usize>,
        longest: usize,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let piece = (self.layout.chunk / n).max(1);
        let call = self.publish_start(Kind::AllToAll, longest);
        let mut first = true;
        let mut o = 0;
        loop {
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            if root.is_none_or(|r| r == me) {
                for (p, b) in send.iter().enumerate() {
                    let (off, l) = (b.start, b.len().saturating_sub(o).min(piece));
                    if l > 0 {
                        // Protocol: staging (me, par) is ours (readers finished two steps ago).
                        self.put_way(
                            self.layout.staging(me, par) + p * piece,
                            &input[off + o..off + o + l],
                            call.2,
                        );
                    }
                }
            }
            self.step_barrier(&mut first, fp, w)?;
            for (q, b) in recv.iter().enumerate() {
                let (off, l) = (b.start, b.len().saturating_sub(o).min(piece));
                let src = root.unwrap_or(q);
                if l > 0 && root.is_none_or(|r| q == r) {
                    // Protocol: published by the sender's arrival; rewritten only after our next
                    // arrival (at the next step's barrier).
                    self.get(
                        self.layout.staging(src, par) + me * piece,
                        &mut out[off + o..off + o + l],
                    );
                }
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += piece;
            if o >= longest {
                self.published(call);
                return Ok(());
            }
        }
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
