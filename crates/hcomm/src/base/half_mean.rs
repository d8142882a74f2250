//! The mean of f16 and bf16 where they accumulate in f32 (`HCOMM_ACCUMULATE=f32`, deterministic
//! mode): each element is widened to f32, the f32 values are summed by the ordinary collective
//! on the canonical schedules, and the f32 total is divided by the number of ranks and rounded
//! to the element type once. Rounding the sum to f16 first and dividing after rounded twice
//! (the last bit off) and overflowed where the mean fits: the mean of `[60000] * 3` is 60000,
//! where the f16 sum, 180000, is infinity. The f32 values double the bytes on the wire, as the
//! integer mean's lanes do ([`crate::base::integer_mean`]).

use crate::base::dtype::DType;
use crate::base::simd;
use crate::base::widen::{bf16_bits_to_f32, f32_to_bf16_bits};

/// True for the 16-bit floating-point types this applies to.
pub fn applies(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// `data` (elements of `dtype`, f16 or bf16) widened to f32.
pub fn widen(dtype: DType, data: &[u8]) -> Vec<f32> {
    let halves: Vec<u16> = data
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let mut out = vec![0f32; halves.len()];
    match dtype {
        DType::F16 => simd::f16_to_f32(&halves, &mut out),
        DType::BF16 => out
            .iter_mut()
            .zip(&halves)
            .for_each(|(o, &h)| *o = bf16_bits_to_f32(h)),
        _ => unreachable!("not a 16-bit float"),
    }
    out
}

/// Write into `out` (elements of `dtype`) the means over `n` ranks of the f32 totals `sums`,
/// each divided in f32 and rounded once.
pub fn narrow_mean(dtype: DType, sums: &[f32], n: usize, out: &mut [u8]) {
    let means: Vec<f32> = sums.iter().map(|&s| s / n as f32).collect();
    let mut halves = vec![0u16; means.len()];
    match dtype {
        DType::F16 => simd::f32_to_f16(&means, &mut halves),
        DType::BF16 => halves
            .iter_mut()
            .zip(&means)
            .for_each(|(h, &m)| *h = f32_to_bf16_bits(m)),
        _ => unreachable!("not a 16-bit float"),
    }
    for (o, h) in out.chunks_exact_mut(2).zip(&halves) {
        o.copy_from_slice(&h.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn f16s(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect()
    }

    #[test]
    fn a_mean_is_divided_in_f32_and_rounded_once() {
        // 3 ranks of 60000 each: the f16 sum overflows, the mean does not.
        let sums: Vec<f32> = widen(DType::F16, &f16s(&[60000.0]))
            .iter()
            .map(|x| x * 3.0)
            .collect();
        let mut out = [0u8; 2];
        narrow_mean(DType::F16, &sums, 3, &mut out);
        assert_eq!(f16::from_le_bytes(out).to_f32(), 60000.0);
        // [2104, 821, 66]: 2991 / 3 = 997 exactly; rounding 2991 to f16 first (2992) gave 997.5.
        let mut out = [0u8; 2];
        narrow_mean(DType::F16, &[2991.0], 3, &mut out);
        assert_eq!(f16::from_le_bytes(out).to_f32(), 997.0);
        let b: Vec<u8> = [1.5f32, -3.0]
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        let sums = widen(DType::BF16, &b);
        assert_eq!(sums, vec![1.5, -3.0]);
        let mut out = [0u8; 4];
        narrow_mean(DType::BF16, &sums, 2, &mut out);
        assert_eq!(bf16::from_le_bytes([out[0], out[1]]).to_f32(), 0.75);
        assert_eq!(bf16::from_le_bytes([out[2], out[3]]).to_f32(), -1.5);
    }
}
