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
                    slots[me][q].with_mut(|p| unsafe { *p = 100 * me as u32 + call });
                    counters[me].store(call + 1, Ordering::Release);
                    while counters[peer].load(Ordering::Acquire) < call + 1 {
                        loom::thread::yield_now();
                    }
                    let got = slots[peer][q].with(|p| unsafe { *p });
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
