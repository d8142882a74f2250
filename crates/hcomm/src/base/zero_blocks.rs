//! Blocks of a buffer that are all zero bits: the scan behind the all-reduces that skip them
//! ([`crate::algo::skip_zeros`] and `Communicator::all_reduce_skipping_zeros_bytes`).
//!
//! A buffer is cut into blocks of [`ZERO_BLOCK_BYTES`] (rounded down to whole elements; the
//! last block may be short). A block is *zero* when every byte is 0: a `-0.0` is not, so it
//! travels like any other value.

use std::ops::Range;

/// Block size of the zero-skipping all-reduces: 1 KiB (256 f32), so the bitmap of a 25 MiB
/// bucket is 3 KiB and a block of rows costs one bit.
pub const ZERO_BLOCK_BYTES: usize = 1024;

/// Bytes per block for elements of `elem_size` bytes: [`ZERO_BLOCK_BYTES`] rounded down to
/// whole elements (at least one).
pub fn block_bytes(elem_size: usize) -> usize {
    (ZERO_BLOCK_BYTES / elem_size).max(1) * elem_size
}

/// Whether every byte of `bytes` is zero: a look at the first word (a dense block ends there),
/// then the OR of whole 8-byte words without an early exit, which the compiler vectorizes (a
/// byte-wise `any`, with its exit test per byte, does not). 46 MB of 1 KiB blocks here: all
/// zero 25 → 0.5 ms, dense 0.5 → 0.4 ms.
pub fn all_zero_bits(bytes: &[u8]) -> bool {
    if bytes.iter().take(8).any(|&x| x != 0) {
        return false;
    }
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    let ored = words.fold(0u64, |acc, w| {
        acc | u64::from_ne_bytes(w.try_into().expect("8 bytes"))
    });
    ored == 0 && tail.iter().all(|&x| x == 0)
}

/// The bitmap of `buf`'s blocks of `block` bytes that are not zero (bit `b % 8` of byte
/// `b / 8` for block `b`), and how many there are.
pub fn nonzero_map(buf: &[u8], block: usize) -> (Vec<u8>, usize) {
    let blocks = buf.len().div_ceil(block);
    let mut map = vec![0u8; blocks.div_ceil(8)];
    let mut count = 0;
    for (b, chunk) in buf.chunks(block).enumerate() {
        if !all_zero_bits(chunk) {
            map[b / 8] |= 1 << (b % 8);
            count += 1;
        }
    }
    (map, count)
}

/// Whether block `b` is set in `map`.
pub fn is_set(map: &[u8], b: usize) -> bool {
    map[b / 8] & (1 << (b % 8)) != 0
}

/// The byte ranges of a `len`-byte buffer covered by the runs of consecutive blocks set in
/// `map` (blocks of `block` bytes, the last one cut at `len`), in order.
pub fn runs(map: &[u8], block: usize, len: usize) -> Vec<Range<usize>> {
    let blocks = len.div_ceil(block);
    let mut out: Vec<Range<usize>> = Vec::new();
    for b in (0..blocks).filter(|&b| is_set(map, b)) {
        let range = b * block..((b + 1) * block).min(len);
        match out.last_mut() {
            Some(last) if last.end == range.start => last.end = range.end,
            _ => out.push(range),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_and_runs_follow_the_non_zero_blocks_and_the_short_last_one() {
        let block = block_bytes(4);
        assert_eq!(block, 1024);
        assert_eq!(block_bytes(3), 1023);
        let len = 5 * block + 12;
        let mut buf = vec![0u8; len];
        buf[block + 5] = 1; // block 1
        buf[2 * block] = 0x80; // block 2 (a -0.0 f32 would be 00 00 00 80)
        buf[4 * block + 1023] = 7; // block 4
        buf[len - 1] = 9; // the short block 5
        let (map, count) = nonzero_map(&buf, block);
        assert_eq!(count, 4);
        assert_eq!(map, vec![0b0011_0110]);
        assert_eq!(
            runs(&map, block, len),
            vec![block..3 * block, 4 * block..len]
        );
        assert!(all_zero_bits(&buf[..block]));
        assert!(!all_zero_bits(&buf[..block + 6]));
        assert!(runs(&[0], block, 0).is_empty());
        let (empty, none) = nonzero_map(&[], block);
        assert!(empty.is_empty() && none == 0);
    }
}
