//! Buffers an operation reuses from one call to the next.
//!
//! A buffer of a gradient bucket's size allocated afresh per call comes from `mmap` (glibc
//! serves large allocations there and unmaps them on free), so every call pays a page fault
//! and a zeroed page per 4 KiB touched: a quarter of a 2-rank int8 compressed all-reduce of
//! 32 MiB, measured. A communicator keeps one [`Scratch`] and lends it to its operations in
//! turn; it holds what the largest call needed.

/// Reusable buffers: three of bytes and one of `f32`. Their contents between calls are
/// whatever the last call left: a user must write every element it reads.
#[derive(Debug, Default)]
pub struct Scratch {
    bytes: [Vec<u8>; 3],
    floats: Vec<f32>,
}

impl Scratch {
    /// Byte buffers of `a`, `b` and `c` bytes and one of `f` floats, grown as needed; their
    /// contents are unspecified.
    pub fn take(
        &mut self,
        a: usize,
        b: usize,
        c: usize,
        f: usize,
    ) -> (&mut [u8], &mut [u8], &mut [u8], &mut [f32]) {
        fn at_least<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
            if v.len() < n {
                v.resize(n, T::default());
            }
            &mut v[..n]
        }
        let [x, y, z] = &mut self.bytes;
        (
            at_least(x, a),
            at_least(y, b),
            at_least(z, c),
            at_least(&mut self.floats, f),
        )
    }
}
