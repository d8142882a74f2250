//! Segment arithmetic: how a buffer of elements is cut into per-rank or per-step byte ranges.
//! Every schedule and the shared-memory collectives cut buffers the same way through these.

use std::ops::Range;

/// Split `total` elements into `n` contiguous segments (the first `total % n` one longer),
/// as byte ranges.
pub fn even_segments(total: usize, n: usize, esize: usize) -> Vec<Range<usize>> {
    let base = total / n;
    let extra = total % n;
    let mut off = 0;
    (0..n)
        .map(|i| {
            let len = (base + usize::from(i < extra)) * esize;
            let r = off..off + len;
            off += len;
            r
        })
        .collect()
}

/// Segments from explicit per-rank element counts, as byte ranges.
pub fn count_segments(counts: &[usize], esize: usize) -> Vec<Range<usize>> {
    let mut off = 0;
    counts
        .iter()
        .map(|&c| {
            let r = off..off + c * esize;
            off += c * esize;
            r
        })
        .collect()
}

/// Borrow two disjoint ranges of `buf`, one shared and one mutable.
pub fn split_two(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty());
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}
