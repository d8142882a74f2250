//! bf16 ⇄ f32 element conversions written so that the compiler vectorises the loops that use
//! them, bit for bit the conversions of the `half` crate (`bf16::to_f32`, `bf16::from_f32`:
//! round to nearest, ties to even; a NaN stays a NaN with its quiet bit set).
//!
//! Why not `half`'s slice conversions: for bf16 they run one element at a time through a
//! branchy conversion, and the reduction kernel spent nearly all of its time there: a bf16 sum
//! ran at 2.7 GB/s against 46 GB/s for f32 on the same buffers (`examples/reduce_speed.rs`,
//! 256 KiB, this machine). The functions below are branch-free, so a loop of widen → combine →
//! round runs in vector registers in one pass. (f16 has instructions for this, F16C: see
//! `simd::f16_to_f32` and `simd::f32_to_f16`.)

/// The f32 value of the bf16 with bits `h` (`half::bf16::from_bits(h).to_f32()`).
#[inline(always)]
pub(crate) fn bf16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let nan = (h & 0x7FFF) > 0x7F80;
    f32::from_bits(if nan { (h | 0x0040) << 16 } else { h << 16 })
}

/// The bits of the bf16 nearest to `v`, ties to even (`half::bf16::from_f32(v).to_bits()`).
#[inline(always)]
pub(crate) fn f32_to_bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let nan = (x & 0x7FFF_FFFF) > 0x7F80_0000;
    // Adding 0x7FFF plus the lowest kept bit carries into bit 16 exactly when the dropped half
    // is above one half, or is one half and the kept value is odd. (Never overflows for a
    // non-NaN: the largest is -inf, 0xFF80_0000.)
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let quiet = (x >> 16) | 0x0040;
    (if nan { quiet } else { rounded }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn every_bf16_widens_as_half_does() {
        for h in 0..=u16::MAX {
            let ours = bf16_bits_to_f32(h).to_bits();
            let theirs = bf16::from_bits(h).to_f32().to_bits();
            assert_eq!(ours, theirs, "bf16 bits {h:#06x}");
        }
    }

    #[test]
    fn f32_rounds_to_bf16_as_half_does_at_every_exponent_and_at_the_ties() {
        // Every upper half (sign, exponent, 7 mantissa bits) with the lower halves that decide
        // the rounding: zero, just below / at / just above one half, the extremes, and a few
        // others; NaNs, infinities and subnormals are among the upper halves.
        let lows = [
            0x0000u32, 0x0001, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFE, 0xFFFF, 0x1234,
        ];
        for hi in 0..=u16::MAX as u32 {
            for lo in lows {
                let x = f32::from_bits((hi << 16) | lo);
                let ours = f32_to_bf16_bits(x);
                let theirs = bf16::from_f32(x).to_bits();
                assert_eq!(ours, theirs, "f32 bits {:#010x}", x.to_bits());
            }
        }
    }
}
