//! A lock-free single-producer/single-consumer byte ring: the core of point-to-point over
//! shared memory (see "Point-to-point rings" in `README.md` beside this file).
//!
//! The ring is a byte stream, like a socket: the producer appends what fits, the consumer takes
//! what is there. Two monotonically increasing 64-bit byte counters describe it: `head` (bytes
//! ever written, stored only by the producer) and `tail` (bytes ever consumed, stored only by
//! the consumer); byte `i` of the stream lives at `i % capacity`. They never wrap in practice
//! (2^64 bytes).
//!
//! * push: `t = tail.load(Acquire)`; copy at most `capacity - (head - t)` bytes at `head`;
//!   `head.store(head + n, Release)`.
//! * pop: `h = head.load(Acquire)`; copy at most `h - tail` bytes at `tail`;
//!   `tail.store(tail + n, Release)`.
//!
//! Release/Acquire on `head` makes the bytes visible before the consumer reads them; on `tail`
//! it makes the consumer's reads happen before the producer overwrites those bytes.
//!
//! The algorithm is written against two small traits, so that the model check
//! (`tests/shm_model.rs`) runs this very code on loom's atomics and cells.

use std::sync::atomic::Ordering;

/// A 64-bit counter shared between producer and consumer.
pub trait Counter {
    /// Atomic load.
    fn load(&self, order: Ordering) -> u64;
    /// Atomic store.
    fn store(&self, value: u64, order: Ordering);
}

impl Counter for std::sync::atomic::AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        std::sync::atomic::AtomicU64::load(self, order)
    }
    fn store(&self, value: u64, order: Ordering) {
        std::sync::atomic::AtomicU64::store(self, value, order)
    }
}

/// The ring's data bytes.
pub trait Bytes {
    /// Capacity in bytes (at least 1).
    fn capacity(&self) -> usize;
    /// Copy `src` to offset `at` (`at + src.len() <= capacity`).
    ///
    /// # Safety
    /// The range must not be read or written by anybody else meanwhile (the ring protocol
    /// guarantees it for the bytes between `head` and `tail + capacity`).
    unsafe fn copy_in(&self, at: usize, src: &[u8]);
    /// Copy from offset `at` into `dst` (`at + dst.len() <= capacity`).
    ///
    /// # Safety
    /// The range must have been published (release store of `head` observed by an acquire
    /// load) and must not be written until this side stores `tail` past it.
    unsafe fn copy_out(&self, at: usize, dst: &mut [u8]);
}

/// One end's view of a ring: its counters and bytes.
pub struct Ring<'a, C: Counter, B: Bytes> {
    /// Bytes written so far (stored by the producer only).
    pub head: &'a C,
    /// Bytes consumed so far (stored by the consumer only).
    pub tail: &'a C,
    /// The data.
    pub bytes: &'a B,
}

impl<C: Counter, B: Bytes> Ring<'_, C, B> {
    /// Producer: append as much of the concatenation of `parts` as fits; returns the number of
    /// bytes appended (0 when the ring is full).
    pub fn push(&self, parts: &[&[u8]]) -> usize {
        let cap = self.bytes.capacity() as u64;
        let head = self.head.load(Ordering::Relaxed); // our own counter
        let tail = self.tail.load(Ordering::Acquire);
        debug_assert!(head.wrapping_sub(tail) <= cap, "ring counters out of step");
        let mut free = (cap - head.wrapping_sub(tail).min(cap)) as usize;
        let mut at = head;
        for part in parts {
            let mut src = &part[..part.len().min(free)];
            free -= src.len();
            while !src.is_empty() {
                let off = (at % cap) as usize;
                let n = src.len().min(cap as usize - off);
                // SAFETY: bytes [head, tail + cap) of the stream belong to the producer: the
                // consumer finished reading them before its release store of `tail`, which our
                // acquire load saw; nobody reads them before our release store of `head`.
                unsafe { self.bytes.copy_in(off, &src[..n]) };
                src = &src[n..];
                at += n as u64;
            }
            if free == 0 {
                break;
            }
        }
        let n = at - head;
        if n > 0 {
            self.head.store(at, Ordering::Release);
        }
        n as usize
    }

    /// Consumer: take up to `dst.len()` bytes; returns how many (0 when the ring is empty).
    pub fn pop(&self, dst: &mut [u8]) -> usize {
        let cap = self.bytes.capacity() as u64;
        let tail = self.tail.load(Ordering::Relaxed); // our own counter
        let head = self.head.load(Ordering::Acquire);
        let avail = head.wrapping_sub(tail).min(cap) as usize;
        let n = avail.min(dst.len());
        let mut done = 0;
        while done < n {
            let off = ((tail + done as u64) % cap) as usize;
            let k = (n - done).min(cap as usize - off);
            // SAFETY: bytes [tail, head) were published by the producer's release store of
            // `head` (our acquire load saw it) and stay untouched until we store `tail`.
            unsafe { self.bytes.copy_out(off, &mut dst[done..done + k]) };
            done += k;
        }
        if n > 0 {
            self.tail.store(tail + n as u64, Ordering::Release);
        }
        n
    }

    /// Bytes waiting to be consumed (consumer's view).
    pub fn available(&self) -> usize {
        let tail = self.tail.load(Ordering::Relaxed);
        self.head.load(Ordering::Acquire).wrapping_sub(tail) as usize
    }

    /// Bytes that can be appended now (producer's view).
    pub fn free(&self) -> usize {
        let cap = self.bytes.capacity() as u64;
        let head = self.head.load(Ordering::Relaxed);
        (cap - head
            .wrapping_sub(self.tail.load(Ordering::Acquire))
            .min(cap)) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::UnsafeCell;
    use std::sync::atomic::AtomicU64;

    struct Mem(Vec<UnsafeCell<u8>>);
    // SAFETY: test only; the ring protocol keeps producer and consumer on disjoint bytes.
    unsafe impl Sync for Mem {}
    impl Bytes for Mem {
        fn capacity(&self) -> usize {
            self.0.len()
        }
        unsafe fn copy_in(&self, at: usize, src: &[u8]) {
            for (i, &b) in src.iter().enumerate() {
                // SAFETY: exclusive by the caller's contract.
                unsafe { *self.0[at + i].get() = b };
            }
        }
        unsafe fn copy_out(&self, at: usize, dst: &mut [u8]) {
            for (i, d) in dst.iter_mut().enumerate() {
                // SAFETY: published by the caller's contract.
                *d = unsafe { *self.0[at + i].get() };
            }
        }
    }

    /// A producer and a consumer thread stream 1 MB through rings of awkward sizes, in
    /// pieces of varying sizes: every byte arrives once, in order.
    #[test]
    fn a_stream_survives_many_wrap_arounds() {
        for cap in [1usize, 7, 64, 4093] {
            let mem = Mem((0..cap).map(|_| UnsafeCell::new(0)).collect());
            let (head, tail) = (AtomicU64::new(0), AtomicU64::new(0));
            let ring = Ring {
                head: &head,
                tail: &tail,
                bytes: &mem,
            };
            const N: usize = 1 << 20;
            let data: Vec<u8> = (0..N).map(|i| (i * 31 % 251) as u8).collect();
            std::thread::scope(|s| {
                s.spawn(|| {
                    let mut sent = 0;
                    let mut k = 1;
                    while sent < N {
                        let end = (sent + k).min(N);
                        let mid = (sent + end) / 2;
                        sent += ring.push(&[&data[sent..mid], &data[mid..end]]);
                        k = k % 5000 + 13;
                    }
                });
                let mut got = vec![0u8; N];
                let mut n = 0;
                let mut k = 3;
                while n < N {
                    let end = (n + k).min(N);
                    n += ring.pop(&mut got[n..end]);
                    k = k % 7000 + 17;
                }
                assert!(got == data, "capacity {cap}: stream corrupted");
                assert_eq!(ring.available(), 0);
                assert_eq!(ring.free(), cap);
            });
        }
    }
}
