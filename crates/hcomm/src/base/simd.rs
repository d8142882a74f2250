//! Wider vector registers where the CPU has them, for the loops that are bound by instructions
//! rather than by memory.
//!
//! The crate is built for the baseline x86-64 (SSE2, 128-bit registers) so that one binary runs
//! on every machine. Most reduction loops are bound by memory and gain nothing from wider
//! registers; the 16-bit float kernels are not (a widen-combine-round loop is about twenty
//! instructions per element), and run about twice as fast in 256-bit registers. This module is
//! the one place that chooses, once per call, by runtime detection (`is_x86_feature_detected!`
//! caches the CPUID answer).

/// A loop to compile for the widest registers the CPU has: implement `run` as
/// `#[inline(always)]` over `#[inline(always)]` loops, so that all of it is compiled into the
/// wide variant (a closure would not be: the compiler keeps it a separate, baseline function).
pub(crate) trait Kernel {
    /// Run the loop.
    fn run(self);
}

/// Run `kernel` compiled for AVX2 where the CPU has it (and as built otherwise).
#[inline(always)]
pub(crate) fn run_wide<K: Kernel>(kernel: K) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn avx2<K: Kernel>(kernel: K) {
            kernel.run()
        }
        // SAFETY: the CPU has AVX2 (checked just above), the one requirement for calling a
        // `#[target_feature(enable = "avx2")]` function.
        return unsafe { avx2(kernel) };
    }
    kernel.run()
}

/// `dst[i] = src[i]` widened from f16 bits to f32, with the F16C instructions where the CPU has
/// them, 8 at a time (`half`'s conversion otherwise, and for the last few): the same bits as
/// `half::f16::to_f32`, which uses F16C too.
pub(crate) fn f16_to_f32(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32: lengths differ");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has F16C (checked just above; F16C implies AVX), the one requirement
        // of `f16c::widen`.
        done = unsafe { f16c::widen(src, dst) };
    }
    for (d, &s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = half::f16::from_bits(s).to_f32();
    }
}

/// `dst[i]` = the f16 bits nearest to `src[i]` (ties to even), with F16C where the CPU has it:
/// the same bits as `half::f16::from_f32`.
pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16: lengths differ");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: as in `f16_to_f32`.
        done = unsafe { f16c::narrow(src, dst) };
    }
    for (d, &s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = half::f16::from_f32(s).to_bits();
    }
}

/// `dst.copy_from_slice(src)`, with non-temporal (streaming) stores for the bulk: the written
/// lines go to memory without first being read into the cache, and without evicting what the
/// cache holds. For large outputs that nobody reads soon (an all-reduce's result once the
/// outputs of all ranks outgrow the caches): ../shared/limits measured 0.57-0.77× the time of
/// the copy-out design at 64 and 256 MiB with them, and 1.3-2× the time at 1 MiB and below,
/// where the output would have stayed in the cache. SSE2, part of the baseline x86-64: no
/// detection needed.
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let body = (dst.len() - head) / 64 * 64;
        let (d_head, d_rest) = dst.split_at_mut(head);
        let (s_head, s_rest) = src.split_at(head);
        d_head.copy_from_slice(s_head);
        let (d_body, d_tail) = d_rest.split_at_mut(body);
        let (s_body, s_tail) = s_rest.split_at(body);
        stream::copy_lines(d_body, s_body);
        d_tail.copy_from_slice(s_tail);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// `codes[i]` = `floor(x[i] · inv + 128.5)` clamped to `0..=255`, top bit flipped (NaN
/// gives 0, the int8 codec's non-finite code): the int8 codec's quantisation
/// (`compress::codec::Int8Block`). Returns whether any code is that one. Clamped in f32 and
/// converted without Rust's saturating cast, which compiles to one scalar conversion per
/// element with range checks; this loop is vectorised (in AVX2 where the CPU has it). The
/// same value as the saturating `(x · inv + 128.5) as u8` for every input.
pub(crate) fn int8_codes(x: &[f32], inv: f32, codes: &mut [u8]) -> bool {
    assert_eq!(x.len(), codes.len(), "int8_codes: lengths differ");
    struct Codes<'a>(&'a [f32], f32, &'a mut [u8], &'a mut bool);
    impl Kernel for Codes<'_> {
        #[inline(always)]
        fn run(self) {
            let Codes(x, inv, codes, any_zero) = self;
            let mut zero = 0u8;
            for (c, &v) in codes.iter_mut().zip(x) {
                // `max` returns the other operand for a NaN, so `t` is finite, in [0, 255]
                // (`clamp` would keep the NaN); a finite element of the block the scale was
                // taken from gives at least 1, a NaN 0: the code -128, which the int8 codec
                // decodes as NaN.
                #[allow(clippy::manual_clamp)]
                let t = (v * inv + 128.5).max(0.0).min(255.0);
                // SAFETY: `t` is finite and within 0.0..=255.0 (just above), so its integer
                // part fits in an i32: the one requirement of `to_int_unchecked`.
                let q = unsafe { t.to_int_unchecked::<i32>() } as u8;
                zero |= (q == 0) as u8;
                *c = q ^ 0x80;
            }
            *any_zero = zero != 0;
        }
    }
    let mut any_zero = false;
    run_wide(Codes(x, inv, codes, &mut any_zero));
    any_zero
}

#[cfg(target_arch = "x86_64")]
mod stream {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Copy whole 64-byte lines to a 16-byte aligned `dst` with streaming stores, then fence
    /// them (so that they are ordered before this rank's next release store, as plain stores
    /// would be). Panics unless both lengths are the same multiple of 64 and `dst` (if not
    /// empty) is aligned.
    pub(super) fn copy_lines(dst: &mut [u8], src: &[u8]) {
        assert!(
            dst.len() == src.len()
                && dst.len().is_multiple_of(64)
                && (dst.is_empty() || (dst.as_ptr() as usize).is_multiple_of(16)),
            "copy_lines: unaligned or partial lines"
        );
        let (d, s) = (
            dst.as_mut_ptr() as *mut __m128i,
            src.as_ptr() as *const __m128i,
        );
        for i in 0..dst.len() / 16 {
            // SAFETY: i < len/16, so the 16 bytes read at `src + 16 i` (unaligned load) and
            // written at `dst + 16 i` lie inside the slices, which do not overlap (one is
            // borrowed mutably); `dst + 16 i` is 16-byte aligned (checked above), as the
            // streaming store requires. SSE2 is part of the x86-64 baseline.
            unsafe { _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i))) };
        }
        // SAFETY: a fence has no precondition (SSE, part of the baseline).
        unsafe { _mm_sfence() };
    }
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{
        __m128i, __m256, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };

    /// Widen the first `8·⌊len/8⌋` elements; returns how many.
    #[target_feature(enable = "avx,f16c")]
    pub(super) fn widen(src: &[u16], dst: &mut [f32]) -> usize {
        let n = src.len().min(dst.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= both lengths, so the 16 bytes read from `src[i..]` and the
            // 32 bytes written to `dst[i..]` lie inside the slices; the loads and stores are
            // the unaligned forms.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        n
    }

    /// Round the first `8·⌊len/8⌋` elements to nearest, ties to even; returns how many.
    #[target_feature(enable = "avx,f16c")]
    pub(super) fn narrow(src: &[f32], dst: &mut [u16]) -> usize {
        let n = src.len().min(dst.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: as in `widen`: 32 bytes read from `src[i..]`, 16 written to `dst[i..]`,
            // both inside the slices.
            unsafe {
                let f: __m256 = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
                _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn streaming_copy_copies_every_byte_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        for offset in 0..17 {
            for len in [0, 1, 15, 16, 63, 64, 65, 127, 128, 200, 983 - offset] {
                let mut dst = vec![0u8; 1000];
                copy_streaming(&mut dst[offset..offset + len], &src[..len]);
                assert_eq!(&dst[offset..offset + len], &src[..len], "{offset} {len}");
                assert!(dst[..offset].iter().all(|&b| b == 0), "{offset} {len}");
                assert!(
                    dst[offset + len..].iter().all(|&b| b == 0),
                    "{offset} {len}"
                );
            }
        }
    }

    use super::*;

    #[test]
    fn f16_widens_as_half_does_for_every_value_and_any_length() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for len in [0, 1, 7, 8, 9, 17, all.len()] {
            let mut ours = vec![0f32; len];
            f16_to_f32(&all[..len], &mut ours);
            for (h, f) in all[..len].iter().zip(&ours) {
                let theirs = half::f16::from_bits(*h).to_f32();
                assert_eq!(f.to_bits(), theirs.to_bits(), "f16 bits {h:#06x}");
            }
        }
    }

    #[test]
    fn f32_narrows_to_f16_as_half_does_around_every_rounding_position() {
        // Every sign, exponent and top 7 mantissa bits, with low parts around each possible
        // rounding position (f16 keeps 10 mantissa bits, fewer when subnormal): ties, carries
        // into the exponent, overflow to infinity, underflow, infinities and NaNs.
        let mut lows: Vec<u32> = vec![0, 1, 0xFFFF];
        for k in 10..=16 {
            let half = 1u32 << k;
            lows.extend([half - 1, half, half + 1, 2 * half - 1, 3 * half]);
        }
        let xs: Vec<f32> = (0..=u16::MAX as u32)
            .flat_map(|hi| lows.iter().map(move |&lo| f32::from_bits((hi << 16) | lo)))
            .collect();
        for len in [0, 1, 7, 8, 9, 23, xs.len()] {
            let mut ours = vec![0u16; len];
            f32_to_f16(&xs[..len], &mut ours);
            for (x, h) in xs[..len].iter().zip(&ours) {
                let theirs = half::f16::from_f32(*x).to_bits();
                assert_eq!(*h, theirs, "f32 bits {:#010x} ({x:e})", x.to_bits());
            }
        }
    }
}
