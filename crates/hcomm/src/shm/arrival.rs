//! How the ranks of a shared-memory group wait for each other: arrivals (a counter per rank in
//! its own cache line), waits that spin for a learned window and then sleep on the futex (or
//! yield at once when ranks outnumber the cores), the fingerprint check of every call's first
//! barrier, and the abort word that wakes every waiter when one rank fails. The protocol is in
//! `README.md` beside this file.

use super::*;

impl ShmGroup {
    /// The parity of this rank's next arrival (its arrival line).
    pub(super) fn next_parity(&self) -> usize {
        (self.counter.wrapping_add(1) % 2) as usize
    }

    /// The parities of a one-shot call: of its number (the small slots) and of its barrier
    /// (the arrival line that carries inline data). Taken before the call's barrier.
    pub(super) fn one_shot_parities(&mut self) -> (usize, usize) {
        let par = (self.calls % 2) as usize;
        self.calls += 1;
        (par, self.next_parity())
    }

    /// Publish the next arrival (in the arrival line of its parity).
    pub(super) fn arrive(&mut self) -> u32 {
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
    /// not the cause: it is waiting too, or came after the reporter gave up), and the message
    /// says so.
    pub(super) fn posted_abort(&self, w: &WaitCtx, waiting_for: usize) -> Option<Error> {
        let word = self.seg.atomic_u64(ABORT_WORD).load(Ordering::Acquire);
        if word == 0 {
            return None;
        }
        let reporter = ((word >> 40) & 0x7f_ffff) as usize;
        let reason = crate::base::error::AbortReason::from_u8((word >> 32) as u8);
        let culprit = match word & 0xffff_ffff {
            0 => None,
            c => Some(c as usize - 1),
        };
        Some(reason.remote_error(
            w.ctx.clone(),
            reporter,
            culprit,
            self.rank,
            Some(waiting_for),
        ))
    }

    /// Publish the CPU this rank runs on (it is about to wait) and return it (plus one), or
    /// `None` when this rank has no slot or the CPU is unknown.
    pub(super) fn publish_my_cpu(&self) -> Option<u32> {
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
    pub(super) fn cpu_of(&self, p: usize) -> Option<u32> {
        if p >= CPU_SLOTS {
            return None;
        }
        Some(self.seg.atomic_u32(CPU_AT + 4 * p).load(Ordering::Relaxed)).filter(|&c| c != 0)
    }

    /// Publish the CPU this rank runs on (it is about to wait), and say whether rank `p`
    /// last waited on the same one.
    pub(super) fn publish_cpu(&self, p: usize) -> bool {
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
    pub(super) fn wait_rank(
        &self,
        p: usize,
        target: u32,
        w: &WaitCtx,
        elsewhere: bool,
    ) -> Result<()> {
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

    pub(super) fn arrive_and_wait_all(&mut self, w: &WaitCtx) -> Result<()> {
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
    pub(super) fn wait_all_oversubscribed(&self, t: u32, w: &WaitCtx) -> Result<()> {
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
    pub(super) fn publish(&mut self, fp: ShmFingerprint) -> usize {
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
    pub(super) fn verify(&self, fp: ShmFingerprint, q: usize, w: &WaitCtx) -> Result<()> {
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
    pub(super) fn first_barrier(&mut self, fp: ShmFingerprint, w: &WaitCtx) -> Result<()> {
        let published = self.publish(fp);
        self.arrive_and_wait_all(w)?;
        self.verify(fp, published, w)
    }

    /// The barrier of a pipelined step (one per step): the first step of a call also checks
    /// fingerprints.
    pub(super) fn step_barrier(
        &mut self,
        first: &mut bool,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        if std::mem::take(first) {
            self.first_barrier(fp, w)
        } else {
            self.arrive_and_wait_all(w)
        }
    }
}
