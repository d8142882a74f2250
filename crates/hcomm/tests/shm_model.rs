//! Model check (loom) of the shared-memory protocol in `src/shm/README.md`, for two ranks:
//! every interleaving allowed by the C++/Rust memory model is explored.

use loom::cell::UnsafeCell;
use loom::sync::atomic::{fence, AtomicU32, Ordering};
use loom::sync::Arc;

/// The arrive / sleep handshake never loses a wake-up: if the waiter decides to sleep on the
/// old counter value, the arriver sees it waiting and wakes it.
#[test]
fn arrive_and_wait_never_lose_a_wakeup() {
    loom::model(|| {
        let counter = Arc::new(AtomicU32::new(0));
        let waiters = Arc::new(AtomicU32::new(0));
        let (c, w) = (counter.clone(), waiters.clone());
        let arriver = loom::thread::spawn(move || {
            c.store(1, Ordering::Release);
            fence(Ordering::SeqCst);
            w.load(Ordering::Relaxed) != 0
        });
        waiters.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let sleeps = counter.load(Ordering::Acquire) < 1;
        let wakes = arriver.join().unwrap();
        assert!(
            !sleeps || wakes,
            "the waiter sleeps on a counter nobody will signal"
        );
    });
}

/// Double-buffered one-shot slots: a rank rewrites slot parity q only after its peer read it,
/// and always reads the peer's data of the same call (loom also checks the slot accesses for
/// data races through `UnsafeCell`).
#[test]
fn double_buffered_slots_are_never_overwritten_while_read() {
    const CALLS: u32 = 3;
    let mut model = loom::model::Builder::new();
    // Bounded preemptions keep the spin loops' state space small enough for CI.
    model.preemption_bound = Some(2);
    model.check(|| {
        let counters = Arc::new([AtomicU32::new(0), AtomicU32::new(0)]);
        let slots = Arc::new([
            [UnsafeCell::new(0u32), UnsafeCell::new(0u32)],
            [UnsafeCell::new(0u32), UnsafeCell::new(0u32)],
        ]);
        let rank =
            |me: usize, counters: Arc<[AtomicU32; 2]>, slots: Arc<[[UnsafeCell<u32>; 2]; 2]>| {
                let peer = 1 - me;
                for call in 0..CALLS {
                    let q = (call % 2) as usize;
                    slots[me][q].with_mut(|p| {
                        // SAFETY: `p` points at the cell's value for the closure's duration.
                        // Only this rank writes slots[me]; the peer's last read of this slot
                        // (two calls ago) came before its counter store that this rank waited
                        // for in the previous call. loom checks that ordering before running
                        // the closure and fails the model instead of racing.
                        unsafe { *p = 100 * me as u32 + call }
                    });
                    counters[me].store(call + 1, Ordering::Release);
                    while counters[peer].load(Ordering::Acquire) < call + 1 {
                        loom::thread::yield_now();
                    }
                    let got = slots[peer][q].with(|p| {
                        // SAFETY: `p` points at the cell's value for the closure's duration.
                        // The peer wrote it before its Release store of the counter this
                        // rank's Acquire load saw, and rewrites it only after this rank's next
                        // counter store; loom checks both orderings before the read.
                        unsafe { *p }
                    });
                    assert_eq!(
                        got,
                        100 * peer as u32 + call,
                        "rank {me} read a stale or newer slot"
                    );
                }
            };
        let (c, s) = (counters.clone(), slots.clone());
        let other = loom::thread::spawn(move || rank(1, c, s));
        rank(0, counters, slots);
        other.join().unwrap();
    });
}

/// Arrival lines by parity (`src/shm/README.md`, "Control block"): arrival `t` stores its
/// counter, and the one-shot data it publishes, in the line of parity `t % 2`; a waiter for
/// `t` polls that line, which holds `t - 2` until then. The data a rank reads is always that
/// arrival's, never the next one of that parity (loom checks the accesses for races too).
#[test]
fn arrival_lines_by_parity_carry_each_arrivals_data() {
    const CALLS: u32 = 3;
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(2);
    model.check(|| {
        type Lines = [[(AtomicU32, UnsafeCell<u32>); 2]; 2];
        let line = || (AtomicU32::new(0), UnsafeCell::new(0u32));
        let lines: Arc<Lines> = Arc::new([[line(), line()], [line(), line()]]);
        let rank = |me: usize, lines: Arc<Lines>| {
            let peer = 1 - me;
            for t in 1..=CALLS {
                let q = (t % 2) as usize;
                lines[me][q].1.with_mut(|p| {
                    // SAFETY: `p` points at the cell's value for the closure's duration. Only
                    // this rank writes its lines; the peer read this one after arrival t - 2
                    // and before its own arrival t - 1, which this rank awaited. loom checks
                    // that ordering before running the closure.
                    unsafe { *p = 100 * me as u32 + t }
                });
                lines[me][q].0.store(t, Ordering::Release);
                while lines[peer][q].0.load(Ordering::Acquire) < t {
                    loom::thread::yield_now();
                }
                let got = lines[peer][q].1.with(|p| {
                    // SAFETY: `p` points at the cell's value for the closure's duration. The
                    // peer wrote it before the Release store this Acquire load saw, and
                    // rewrites it only after this rank's next arrival.
                    unsafe { *p }
                });
                assert_eq!(
                    got,
                    100 * peer as u32 + t,
                    "rank {me} read another arrival's data"
                );
            }
        };
        let l = lines.clone();
        let other = loom::thread::spawn(move || rank(1, l));
        rank(0, lines);
        other.join().unwrap();
    });
}

// ----- point-to-point rings (`src/shm/ring.rs`, README "Point-to-point rings") -----

use hcomm::shm::ring::{Bytes, Counter, Ring};

/// The ring's counter on loom's atomics.
struct LoomCounter(loom::sync::atomic::AtomicU64);

impl Counter for LoomCounter {
    fn load(&self, order: Ordering) -> u64 {
        self.0.load(order)
    }
    fn store(&self, value: u64, order: Ordering) {
        self.0.store(value, order)
    }
}

/// The ring's bytes in loom cells: loom reports any access that races with another.
struct LoomBytes(Vec<UnsafeCell<u8>>);

impl Bytes for LoomBytes {
    fn capacity(&self) -> usize {
        self.0.len()
    }
    unsafe fn copy_in(&self, at: usize, src: &[u8]) {
        for (i, &b) in src.iter().enumerate() {
            self.0[at + i].with_mut(|p| {
                // SAFETY: `p` points at the cell's value for the closure's duration; the
                // caller (the ring's push) owns these bytes by the ring protocol, and loom
                // checks that no unordered access to the cell exists before running this.
                unsafe { *p = b }
            });
        }
    }
    unsafe fn copy_out(&self, at: usize, dst: &mut [u8]) {
        for (i, d) in dst.iter_mut().enumerate() {
            *d = self.0[at + i].with(|p| {
                // SAFETY: as in copy_in; the caller (the ring's pop) reads only published
                // bytes, which loom checks are ordered after their write.
                unsafe { *p }
            });
        }
    }
}

struct SharedRing {
    head: LoomCounter,
    tail: LoomCounter,
    bytes: LoomBytes,
}

impl SharedRing {
    fn new(cap: usize) -> Arc<SharedRing> {
        Arc::new(SharedRing {
            head: LoomCounter(loom::sync::atomic::AtomicU64::new(0)),
            tail: LoomCounter(loom::sync::atomic::AtomicU64::new(0)),
            bytes: LoomBytes((0..cap).map(|_| UnsafeCell::new(0)).collect()),
        })
    }
    fn ring(&self) -> Ring<'_, LoomCounter, LoomBytes> {
        Ring {
            head: &self.head,
            tail: &self.tail,
            bytes: &self.bytes,
        }
    }
}

/// The real ring code (`Ring::push` / `Ring::pop`) on a 3-byte ring: a producer streams 7 bytes
/// in pieces of 2 and 3 (split across two slices, so pushes wrap around inside a piece), a
/// consumer takes them 2 at a time. In every interleaving every byte arrives exactly once, in
/// order, and no byte is read while it is written (loom's cells would report the race).
#[test]
fn ring_wrap_around_loses_and_duplicates_no_byte() {
    const DATA: [u8; 7] = [1, 2, 3, 4, 5, 6, 7];
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model.check(|| {
        let shared = SharedRing::new(3);
        let s = shared.clone();
        let producer = loom::thread::spawn(move || {
            let ring = s.ring();
            let mut sent = 0;
            let mut piece = 2;
            while sent < DATA.len() {
                let end = (sent + piece).min(DATA.len());
                let mid = sent + 1;
                let n = ring.push(&[&DATA[sent..mid], &DATA[mid..end]]);
                if n == 0 {
                    loom::thread::yield_now();
                }
                sent += n;
                piece = 5 - piece;
            }
        });
        let ring = shared.ring();
        let mut got = Vec::new();
        while got.len() < DATA.len() {
            let mut buf = [0u8; 2];
            let n = ring.pop(&mut buf);
            if n == 0 {
                loom::thread::yield_now();
            }
            got.extend_from_slice(&buf[..n]);
        }
        producer.join().unwrap();
        assert_eq!(got, DATA, "bytes lost, doubled or reordered");
        assert_eq!(ring.available(), 0);
    });
}

/// The doorbell handshake of `src/shm/p2p.rs`: a consumer with nothing to read registers as a
/// sleeper, fences, reads its doorbell, looks at the ring once more and only then sleeps (on
/// the doorbell value it read); the producer pushes (the real `Ring::push`), fences and rings
/// the doorbell when it sees a sleeper. Either the consumer sees the byte and does not sleep,
/// or the producer sees the sleeper and bumps the doorbell (so the futex compare fails or the
/// wake finds the sleeper): no interleaving loses the wake-up.
#[test]
fn ring_doorbell_never_loses_a_wakeup() {
    loom::model(|| {
        let shared = SharedRing::new(4);
        let bell = Arc::new(AtomicU32::new(0));
        let sleepers = Arc::new(AtomicU32::new(0));
        let (s, b, z) = (shared.clone(), bell.clone(), sleepers.clone());
        let producer = loom::thread::spawn(move || {
            assert_eq!(s.ring().push(&[&[42u8]]), 1);
            // ShmPipe::write → P2pShm::notify
            fence(Ordering::SeqCst);
            if z.load(Ordering::Relaxed) != 0 {
                b.fetch_add(1, Ordering::Release);
                true
            } else {
                false
            }
        });
        // P2pShm::sleep with ready() = "the ring has a byte"
        sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let seen = bell.load(Ordering::Acquire);
        let ready = shared.ring().available() > 0;
        let rang = producer.join().unwrap();
        // The kernel sleeps only while the doorbell still holds `seen`; it then needs a wake.
        let sleeps = !ready && bell.load(Ordering::Relaxed) == seen;
        assert!(
            !sleeps || rang,
            "the consumer sleeps and the producer does not ring"
        );
        sleepers.fetch_sub(1, Ordering::Relaxed);
    });
}

/// The progress engine's turns (`src/engine.rs`): a finishing turn notifies only when a thread
/// counts itself as waiting. With the waiter counting itself under the lock and both sides
/// fenced, the next turn's thread is never left asleep.
#[test]
fn a_finished_turn_never_leaves_the_next_one_asleep() {
    use loom::sync::atomic::{AtomicU64, AtomicUsize};
    use loom::sync::{Condvar, Mutex};
    loom::model(|| {
        let serving = Arc::new(AtomicU64::new(0));
        let waiters = Arc::new(AtomicUsize::new(0));
        let lock = Arc::new(Mutex::new(()));
        let changed = Arc::new(Condvar::new());
        let (s, w, l, c) = (
            serving.clone(),
            waiters.clone(),
            lock.clone(),
            changed.clone(),
        );
        let finisher = loom::thread::spawn(move || {
            s.store(1, Ordering::Release);
            fence(Ordering::SeqCst);
            if w.load(Ordering::Relaxed) > 0 {
                let _g = l.lock().unwrap();
                c.notify_all();
            }
        });
        // The thread holding ticket 1 waits for its turn (loom reports a deadlock if it is
        // never woken).
        if serving.load(Ordering::Acquire) != 1 {
            let mut g = lock.lock().unwrap();
            waiters.fetch_add(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            while serving.load(Ordering::Acquire) != 1 {
                g = changed.wait(g).unwrap();
            }
            waiters.fetch_sub(1, Ordering::Relaxed);
        }
        finisher.join().unwrap();
    });
}
