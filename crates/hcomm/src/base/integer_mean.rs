//! The mean of integers without overflow: each element is widened to i64 lanes whose sum over
//! any number of ranks below 2^31 cannot wrap, the lanes are summed by the ordinary collective,
//! and the exact total is divided by the number of ranks (truncating towards zero, as the
//! library's integer mean does) and narrowed back. The mean lies between the smallest and the
//! largest input, so it always fits the element type: the mean of `[255, 255]` as u8 is 255,
//! where summing in u8 first would give 127.
//!
//! Types of up to 32 bits take one lane (the value itself); 64-bit types take two, the value's
//! high and low 32 bits (`x >> 32`, signed for i64, and `x & 0xffff_ffff`), so that the total
//! is `hi_sum * 2^32 + lo_sum`, exact in i128.

use crate::base::dtype::DType;

/// The i64 lanes one element of `dtype` widens to (`None` for floating-point types).
pub fn lanes(dtype: DType) -> Option<usize> {
    match dtype {
        DType::I8 | DType::I16 | DType::I32 | DType::U8 | DType::U32 => Some(1),
        DType::I64 | DType::U64 => Some(2),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => None,
    }
}

fn elements(dtype: DType, data: &[u8]) -> impl Iterator<Item = i128> + '_ {
    data.chunks_exact(dtype.size()).map(move |b| match dtype {
        DType::I8 => i8::from_le_bytes([b[0]]) as i128,
        DType::I16 => i16::from_le_bytes([b[0], b[1]]) as i128,
        DType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as i128,
        DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as i128,
        DType::U8 => b[0] as i128,
        DType::U32 => u32::from_le_bytes(b.try_into().unwrap()) as i128,
        DType::U64 => u64::from_le_bytes(b.try_into().unwrap()) as i128,
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => unreachable!("not an integer"),
    })
}

/// `data` (elements of the integer `dtype`) as i64 lanes, `lanes(dtype)` per element.
pub fn widen(dtype: DType, data: &[u8]) -> Vec<i64> {
    let two = lanes(dtype) == Some(2);
    let mut out = Vec::with_capacity(data.len() / dtype.size() * if two { 2 } else { 1 });
    for x in elements(dtype, data) {
        if two {
            // hi: floor(x / 2^32), within ±2^31 for i64 and [0, 2^32) for u64; lo: [0, 2^32).
            out.push((x >> 32) as i64);
            out.push((x & 0xffff_ffff) as i64);
        } else {
            out.push(x as i64);
        }
    }
    out
}

/// Write into `out` (elements of `dtype`) the means over `n` ranks of the summed lanes `sums`.
pub fn narrow_mean(dtype: DType, sums: &[i64], n: usize, out: &mut [u8]) {
    let per = lanes(dtype).expect("an integer dtype");
    for (lane, o) in sums
        .chunks_exact(per)
        .zip(out.chunks_exact_mut(dtype.size()))
    {
        let total = if per == 2 {
            ((lane[0] as i128) << 32) + lane[1] as i128
        } else {
            lane[0] as i128
        };
        // i128 division truncates towards zero; the mean fits the type (see the module doc).
        let mean = total / n as i128;
        match dtype {
            DType::I8 => o.copy_from_slice(&(mean as i8).to_le_bytes()),
            DType::I16 => o.copy_from_slice(&(mean as i16).to_le_bytes()),
            DType::I32 => o.copy_from_slice(&(mean as i32).to_le_bytes()),
            DType::I64 => o.copy_from_slice(&(mean as i64).to_le_bytes()),
            DType::U8 => o.copy_from_slice(&(mean as u8).to_le_bytes()),
            DType::U32 => o.copy_from_slice(&(mean as u32).to_le_bytes()),
            DType::U64 => o.copy_from_slice(&(mean as u64).to_le_bytes()),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 => unreachable!("not an integer"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mean of `ranks` (each one element's bytes) through widen → sum → narrow.
    fn mean(dtype: DType, ranks: &[Vec<u8>]) -> Vec<u8> {
        let widened: Vec<Vec<i64>> = ranks.iter().map(|r| widen(dtype, r)).collect();
        let sums: Vec<i64> = (0..widened[0].len())
            .map(|i| widened.iter().map(|w| w[i]).sum())
            .collect();
        let mut out = vec![0u8; ranks[0].len()];
        narrow_mean(dtype, &sums, ranks.len(), &mut out);
        out
    }

    #[test]
    fn means_of_values_at_the_ends_of_each_type_do_not_wrap() {
        let u8s = |v: &[u8]| v.to_vec();
        assert_eq!(
            mean(DType::U8, &[u8s(&[255, 200]), u8s(&[255, 200])]),
            [255, 200]
        );
        let i8s = |v: &[i8]| v.iter().map(|x| *x as u8).collect::<Vec<u8>>();
        assert_eq!(
            mean(DType::I8, &[i8s(&[100, 127, -128]), i8s(&[100, 127, -128])]),
            i8s(&[100, 127, -128])
        );
        // Truncation towards zero: (-3 + -2) / 2 = -2.5 -> -2; (127 + 126 + 0) / 3 = 84.33 -> 84.
        assert_eq!(mean(DType::I8, &[i8s(&[-3]), i8s(&[-2])]), i8s(&[-2]));
        assert_eq!(
            mean(DType::I8, &[i8s(&[127]), i8s(&[126]), i8s(&[0])]),
            i8s(&[84])
        );
        let i32s = |v: i32| v.to_le_bytes().to_vec();
        assert_eq!(
            mean(
                DType::I32,
                &[i32s(i32::MAX), i32s(i32::MAX), i32s(i32::MAX)]
            ),
            i32s(i32::MAX)
        );
        let i64s = |v: i64| v.to_le_bytes().to_vec();
        for v in [i64::MAX, i64::MIN, -1, 0, 1 << 40, -(1 << 40) - 7] {
            assert_eq!(
                mean(DType::I64, &[i64s(v), i64s(v), i64s(v)]),
                i64s(v),
                "{v}"
            );
        }
        assert_eq!(
            mean(DType::I64, &[i64s(i64::MAX), i64s(i64::MIN)]),
            i64s(0) // (2^63 - 1 - 2^63) / 2 = -0.5 -> 0
        );
        let u64s = |v: u64| v.to_le_bytes().to_vec();
        assert_eq!(
            mean(DType::U64, &[u64s(u64::MAX), u64s(u64::MAX - 2)]),
            u64s(u64::MAX - 1)
        );
        assert_eq!(
            mean(DType::U32, &vec![u32::MAX.to_le_bytes().to_vec(); 4]),
            u32::MAX.to_le_bytes()
        );
        assert_eq!(lanes(DType::F32), None);
    }
}
