//! Reduction kernels on byte buffers tagged with a [`DType`].
//!
//! Every algorithm combines partial results through [`reduce_into`] with an explicit operand
//! order, so the same schedule always performs the same floating-point operations in the same
//! order: results are bitwise reproducible run to run and identical on every rank.

use crate::base::dtype::{DType, ReduceOp};
use crate::base::simd::{self, run_wide, Kernel};
use crate::base::widen::{bf16_bits_to_f32, f32_to_bf16_bits};
use half::f16;

/// Which operand comes first in `acc = a ⊕ b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// `acc = acc ⊕ src` (the accumulator holds the lower ranks' contribution).
    AccFirst,
    /// `acc = src ⊕ acc` (the incoming data holds the lower ranks' contribution).
    SrcFirst,
}

trait Arith: bytemuck::Pod {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn div_n(a: Self, n: usize) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)] fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)] fn mul(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
            #[inline(always)] fn div_n(a: Self, n: usize) -> Self { a / (n as $t) }
        }
    )*};
}
int_arith!(i8, i16, i32, i64, u8, u32, u64);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)] fn add(a: Self, b: Self) -> Self { a + b }
            #[inline(always)] fn mul(a: Self, b: Self) -> Self { a * b }
            #[inline(always)] fn min(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() { a + b } else if b < a { b } else { a }
            }
            #[inline(always)] fn max(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() { a + b } else if b > a { b } else { a }
            }
            #[inline(always)] fn div_n(a: Self, n: usize) -> Self { a / (n as $t) }
        }
    )*};
}
float_arith!(f32, f64);

/// One element-wise loop per (type, operator, order), each monomorphic so that the compiler
/// inlines the operator and vectorises the loop (a function pointer here costs ~10x).
#[inline(always)]
fn zip_apply<T: Copy>(acc: &mut [T], src: &[T], order: Order, f: impl Fn(T, T) -> T + Copy) {
    match order {
        Order::AccFirst => acc.iter_mut().zip(src).for_each(|(a, &b)| *a = f(*a, b)),
        Order::SrcFirst => acc.iter_mut().zip(src).for_each(|(a, &b)| *a = f(b, *a)),
    }
}

fn combine_typed<T: Arith>(op: ReduceOp, acc: &mut [T], src: &[T], order: Order) {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => zip_apply(acc, src, order, T::add),
        ReduceOp::Prod => zip_apply(acc, src, order, T::mul),
        ReduceOp::Min => zip_apply(acc, src, order, T::min),
        ReduceOp::Max => zip_apply(acc, src, order, T::max),
    }
}

/// Apply `f` to `acc` and `src` viewed as `[T]`, copying through aligned scratch when the
/// byte buffers are not aligned for `T`.
fn with_typed<T: bytemuck::Pod>(acc: &mut [u8], src: &[u8], f: &mut dyn FnMut(&mut [T], &[T])) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(acc),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        (Ok(a), Ok(s)) => f(a, s),
        _ => {
            const BLOCK: usize = 256;
            let sz = std::mem::size_of::<T>();
            let mut a_tmp = [T::zeroed(); BLOCK];
            let mut s_tmp = [T::zeroed(); BLOCK];
            for (ac, sc) in acc.chunks_mut(BLOCK * sz).zip(src.chunks(BLOCK * sz)) {
                let n = ac.len() / sz;
                bytemuck::cast_slice_mut::<T, u8>(&mut a_tmp[..n]).copy_from_slice(ac);
                bytemuck::cast_slice_mut::<T, u8>(&mut s_tmp[..n]).copy_from_slice(sc);
                f(&mut a_tmp[..n], &s_tmp[..n]);
                ac.copy_from_slice(bytemuck::cast_slice(&a_tmp[..n]));
            }
        }
    }
}

/// f16: convert blocks to f32 (F16C where the CPU has it), combine, round back (one rounding
/// per step).
fn combine_half<H: bytemuck::Pod>(
    op: ReduceOp,
    acc: &mut [H],
    src: &[H],
    order: Order,
    to_f32: fn(&[H], &mut [f32]),
    from_f32: fn(&mut [H], &[f32]),
) {
    const BLOCK: usize = 512;
    let mut a32 = [0f32; BLOCK];
    let mut s32 = [0f32; BLOCK];
    for (ac, sc) in acc.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let n = ac.len();
        to_f32(ac, &mut a32[..n]);
        to_f32(sc, &mut s32[..n]);
        combine_typed::<f32>(op, &mut a32[..n], &s32[..n], order);
        from_f32(ac, &a32[..n]);
    }
}

/// bf16: widen, combine in f32 and round back, element by element in one vectorised pass
/// (one rounding per step, as [`combine_half`]; the same bits). The loop is about twenty
/// instructions per element, so it runs in 256-bit registers where the CPU has them.
fn combine_bf16(op: ReduceOp, acc: &mut [u16], src: &[u16], order: Order) {
    struct CombineBf16<'a>(ReduceOp, &'a mut [u16], &'a [u16], Order);
    impl Kernel for CombineBf16<'_> {
        #[inline(always)]
        fn run(self) {
            combine_widened(
                self.0,
                self.1,
                self.2,
                self.3,
                bf16_bits_to_f32,
                f32_to_bf16_bits,
            )
        }
    }
    run_wide(CombineBf16(op, acc, src, order))
}

/// `acc ⊕= src` on 16-bit floats: widen both, combine in f32, round back; one pass.
#[inline(always)]
fn combine_widened(
    op: ReduceOp,
    acc: &mut [u16],
    src: &[u16],
    order: Order,
    widen: impl Fn(u16) -> f32 + Copy,
    round: impl Fn(f32) -> u16 + Copy,
) {
    macro_rules! widened {
        ($f:expr) => {
            zip_apply(acc, src, order, |a, b| round($f(widen(a), widen(b))))
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Mean => widened!(<f32 as Arith>::add),
        ReduceOp::Prod => widened!(<f32 as Arith>::mul),
        ReduceOp::Min => widened!(<f32 as Arith>::min),
        ReduceOp::Max => widened!(<f32 as Arith>::max),
    }
}

/// `acc = acc ⊕ src` (or `src ⊕ acc`, see [`Order`]) element-wise. `ReduceOp::Mean`
/// combines as a sum; call [`finalize_mean`] once at the end.
///
/// Both slices must have the same length, a multiple of `dtype.size()`.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], src: &[u8], order: Order) {
    debug_assert_eq!(acc.len(), src.len());
    debug_assert_eq!(acc.len() % dtype.size(), 0);
    macro_rules! go {
        ($t:ty) => {
            with_typed::<$t>(acc, src, &mut |a, s| combine_typed::<$t>(op, a, s, order))
        };
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::I8 => go!(i8),
        DType::I16 => go!(i16),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        DType::U8 => go!(u8),
        DType::U32 => go!(u32),
        DType::U64 => go!(u64),
        DType::F16 => with_typed::<u16>(acc, src, &mut |a, s| {
            combine_half(op, a, s, order, simd::f16_to_f32, |h, f| {
                simd::f32_to_f16(f, h)
            })
        }),
        DType::BF16 => with_typed::<u16>(acc, src, &mut |a, s| combine_bf16(op, a, s, order)),
    }
}

/// `out = a ⊕ b` element-wise in one pass: the same bits as copying `a` into `out` and then
/// [`reduce_into`] `b` with [`Order::AccFirst`], without the second pass over `out` (for
/// large vectors, a third of the memory traffic of the first step of a fold). 16-bit floats,
/// and buffers not aligned for the dtype, take the copy-then-reduce path.
pub fn reduce_pair(dtype: DType, op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    assert!(
        out.len() == a.len() && a.len() == b.len(),
        "reduce_pair: lengths differ"
    );
    fn zip3<T: Arith>(op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) -> bool {
        let (Ok(o), Ok(x), Ok(y)) = (
            bytemuck::try_cast_slice_mut::<u8, T>(out),
            bytemuck::try_cast_slice::<u8, T>(a),
            bytemuck::try_cast_slice::<u8, T>(b),
        ) else {
            return false;
        };
        #[inline(always)]
        fn apply<T: Copy>(o: &mut [T], x: &[T], y: &[T], f: impl Fn(T, T) -> T) {
            o.iter_mut()
                .zip(x.iter().zip(y))
                .for_each(|(o, (&x, &y))| *o = f(x, y));
        }
        match op {
            ReduceOp::Sum | ReduceOp::Mean => apply(o, x, y, T::add),
            ReduceOp::Prod => apply(o, x, y, T::mul),
            ReduceOp::Min => apply(o, x, y, T::min),
            ReduceOp::Max => apply(o, x, y, T::max),
        }
        true
    }
    let fused = match dtype {
        DType::F32 => zip3::<f32>(op, out, a, b),
        DType::F64 => zip3::<f64>(op, out, a, b),
        DType::I8 => zip3::<i8>(op, out, a, b),
        DType::I16 => zip3::<i16>(op, out, a, b),
        DType::I32 => zip3::<i32>(op, out, a, b),
        DType::I64 => zip3::<i64>(op, out, a, b),
        DType::U8 => zip3::<u8>(op, out, a, b),
        DType::U32 => zip3::<u32>(op, out, a, b),
        DType::U64 => zip3::<u64>(op, out, a, b),
        DType::F16 | DType::BF16 => false,
    };
    if !fused {
        out.copy_from_slice(a);
        reduce_into(dtype, op, out, b, Order::AccFirst);
    }
}

/// Divide every element by `n` (the last step of `ReduceOp::Mean`).
pub fn finalize_mean(dtype: DType, buf: &mut [u8], n: usize) {
    fn div<T: Arith>(b: &mut [T], n: usize) {
        b.iter_mut().for_each(|x| *x = T::div_n(*x, n));
    }
    let mut scratch = Vec::new();
    macro_rules! go {
        ($t:ty) => {{
            scratch.resize(buf.len(), 0u8);
            with_typed::<$t>(buf, &scratch, &mut |a, _| div::<$t>(a, n))
        }};
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::I8 => go!(i8),
        DType::I16 => go!(i16),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        DType::U8 => go!(u8),
        DType::U32 => go!(u32),
        DType::U64 => go!(u64),
        DType::F16 => {
            for x in bytemuck::cast_slice_mut::<u8, [u8; 2]>(buf) {
                *x = f16::from_f32(f16::from_le_bytes(*x).to_f32() / n as f32).to_le_bytes();
            }
        }
        DType::BF16 => {
            for x in bytemuck::cast_slice_mut::<u8, [u8; 2]>(buf) {
                let v = bf16_bits_to_f32(u16::from_le_bytes(*x)) / n as f32;
                *x = f32_to_bf16_bits(v).to_le_bytes();
            }
        }
    }
}

/// [`fold_in_order`] of 16-bit floats: block by block (on the stack, whatever the buffers'
/// alignment), every part widened to f32 with the slice conversions (F16C where the CPU has
/// it), folded in f32 in order, and rounded once.
fn fold_widened<H: bytemuck::Pod>(
    op: ReduceOp,
    out: &mut [u8],
    first: &[u8],
    rest: &[&[u8]],
    to_f32: fn(&[H], &mut [f32]),
    from_f32: fn(&mut [H], &[f32]),
) {
    const BLOCK: usize = 1024;
    let mut h = [H::zeroed(); BLOCK];
    let mut acc = [0f32; BLOCK];
    let mut part = [0f32; BLOCK];
    let block_bytes = BLOCK * std::mem::size_of::<H>();
    for (k, o) in out.chunks_mut(block_bytes).enumerate() {
        let at = k * block_bytes..k * block_bytes + o.len();
        let n = o.len() / std::mem::size_of::<H>();
        bytemuck::cast_slice_mut::<H, u8>(&mut h[..n]).copy_from_slice(&first[at.clone()]);
        to_f32(&h[..n], &mut acc[..n]);
        for p in rest {
            bytemuck::cast_slice_mut::<H, u8>(&mut h[..n]).copy_from_slice(&p[at.clone()]);
            to_f32(&h[..n], &mut part[..n]);
            combine_typed::<f32>(op, &mut acc[..n], &part[..n], Order::AccFirst);
        }
        from_f32(&mut h[..n], &acc[..n]);
        o.copy_from_slice(bytemuck::cast_slice(&h[..n]));
    }
}

/// The canonical reduction of `parts` (rank 0's contribution first): element `i` of `out` is
/// `((p0[i] ⊕ p1[i]) ⊕ p2[i]) ⊕ …`, the same expression whatever schedule gathered the parts.
/// f16 and bf16 are accumulated in f32 and rounded once at the end (more exact than rounding
/// at every step, and still one fixed expression). `ReduceOp::Mean` combines as a sum; call
/// [`finalize_mean`] after. Every part and `out` must have the same length.
pub fn fold_in_order(dtype: DType, op: ReduceOp, out: &mut [u8], parts: &[&[u8]]) {
    let Some((first, rest)) = parts.split_first() else {
        return;
    };
    debug_assert!(parts.iter().all(|p| p.len() == out.len()));
    match dtype {
        DType::F16 => fold_widened::<u16>(op, out, first, rest, simd::f16_to_f32, |h, f| {
            simd::f32_to_f16(f, h)
        }),
        DType::BF16 => fold_widened::<u16>(
            op,
            out,
            first,
            rest,
            |h, f| {
                f.iter_mut()
                    .zip(h)
                    .for_each(|(f, &h)| *f = bf16_bits_to_f32(h))
            },
            |h, f| {
                h.iter_mut()
                    .zip(f)
                    .for_each(|(h, &f)| *h = f32_to_bf16_bits(f))
            },
        ),
        _ => match rest.split_first() {
            None => out.copy_from_slice(first),
            Some((second, rest)) => {
                reduce_pair(dtype, op, out, first, second);
                for p in rest {
                    reduce_into(dtype, op, out, p, Order::AccFirst);
                }
            }
        },
    }
}

/// Bytes of one element of the canonical fold's accumulator for `dtype`: f32 for f16 and
/// bf16 (accumulated in f32, rounded once), the element itself for every other dtype.
pub fn accumulator_size(dtype: DType) -> usize {
    match dtype {
        DType::F16 | DType::BF16 => 4,
        d => d.size(),
    }
}

/// [`fold_in_order`] cut at a rank boundary, for schedules that carry a partial fold from
/// one group of ranks to the next: `acc` (elements of [`accumulator_size`]) becomes
/// `acc ⊕ parts[0] ⊕ parts[1] ⊕ …` when `continued`, else `parts[0] ⊕ parts[1] ⊕ …`; folding
/// ranks `0..k` this way, then `k..n` onto the result, and rounding with
/// [`round_accumulator`] gives bitwise what `fold_in_order` gives over `0..n`.
pub fn fold_into_accumulator(
    dtype: DType,
    op: ReduceOp,
    acc: &mut [u8],
    continued: bool,
    parts: &[&[u8]],
) {
    let (first, rest) = match (continued, parts.split_first()) {
        (true, _) => (None, parts),
        (false, Some((f, r))) => (Some(*f), r),
        (false, None) => return,
    };
    let widen: fn(&[u16], &mut [f32]) = match dtype {
        DType::F16 => simd::f16_to_f32,
        DType::BF16 => |h, f| {
            f.iter_mut()
                .zip(h)
                .for_each(|(f, &h)| *f = bf16_bits_to_f32(h))
        },
        _ => {
            if let Some(f) = first {
                acc.copy_from_slice(f);
            }
            for p in rest {
                reduce_into(dtype, op, acc, p, Order::AccFirst);
            }
            return;
        }
    };
    const BLOCK: usize = 1024;
    let mut h = [0u16; BLOCK];
    let mut a = [0f32; BLOCK];
    let mut part = [0f32; BLOCK];
    for (k, acc_block) in acc.chunks_mut(BLOCK * 4).enumerate() {
        let n = acc_block.len() / 4;
        let at = k * BLOCK * 2..k * BLOCK * 2 + n * 2;
        match first {
            Some(f) => {
                bytemuck::cast_slice_mut::<u16, u8>(&mut h[..n]).copy_from_slice(&f[at.clone()]);
                widen(&h[..n], &mut a[..n]);
            }
            None => bytemuck::cast_slice_mut::<f32, u8>(&mut a[..n]).copy_from_slice(acc_block),
        }
        for p in rest {
            bytemuck::cast_slice_mut::<u16, u8>(&mut h[..n]).copy_from_slice(&p[at.clone()]);
            widen(&h[..n], &mut part[..n]);
            combine_typed::<f32>(op, &mut a[..n], &part[..n], Order::AccFirst);
        }
        acc_block.copy_from_slice(bytemuck::cast_slice(&a[..n]));
    }
}

/// The end of a fold made with [`fold_into_accumulator`]: `out` (elements of `dtype`) receives
/// the accumulator rounded once (f16, bf16) or copied (every other dtype).
pub fn round_accumulator(dtype: DType, acc: &[u8], out: &mut [u8]) {
    let narrow: fn(&mut [u16], &[f32]) = match dtype {
        DType::F16 => |h, f| simd::f32_to_f16(f, h),
        DType::BF16 => |h, f| {
            h.iter_mut()
                .zip(f)
                .for_each(|(h, &f)| *h = f32_to_bf16_bits(f))
        },
        _ => {
            out.copy_from_slice(acc);
            return;
        }
    };
    const BLOCK: usize = 1024;
    let mut h = [0u16; BLOCK];
    let mut a = [0f32; BLOCK];
    for (acc_block, o) in acc.chunks(BLOCK * 4).zip(out.chunks_mut(BLOCK * 2)) {
        let n = o.len() / 2;
        bytemuck::cast_slice_mut::<f32, u8>(&mut a[..n]).copy_from_slice(acc_block);
        narrow(&mut h[..n], &a[..n]);
        o.copy_from_slice(bytemuck::cast_slice(&h[..n]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn a_fold_cut_at_any_rank_is_the_whole_fold() {
        // Random non-integer parts of every float dtype (and i32), 5 ranks, 2,500 elements
        // (blocks and a remainder): folding ranks 0..k into the accumulator, then k..5 onto
        // it, then rounding, gives fold_in_order's bits, for every cut k and op.
        let len = 2_500;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 20) as f32 - 8.0
        };
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32] {
            let parts: Vec<Vec<u8>> = (0..5)
                .map(|_| {
                    let v: Vec<f32> = (0..len).map(|_| next()).collect();
                    match dtype {
                        DType::F32 => bytes(&v),
                        DType::F64 => bytes(&v.iter().map(|&x| x as f64).collect::<Vec<_>>()),
                        DType::F16 => {
                            bytes(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>())
                        }
                        DType::BF16 => {
                            bytes(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())
                        }
                        _ => bytes(&v.iter().map(|&x| (x * 100.0) as i32).collect::<Vec<_>>()),
                    }
                })
                .collect();
            let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max] {
                let mut whole = vec![0u8; len * dtype.size()];
                fold_in_order(dtype, op, &mut whole, &refs);
                for cut in 1..5 {
                    let mut acc = vec![0u8; len * accumulator_size(dtype)];
                    fold_into_accumulator(dtype, op, &mut acc, false, &refs[..cut]);
                    fold_into_accumulator(dtype, op, &mut acc, true, &refs[cut..]);
                    let mut out = vec![0u8; whole.len()];
                    round_accumulator(dtype, &acc, &mut out);
                    assert!(out == whole, "{dtype} {op} cut at {cut}");
                }
            }
        }
    }

    #[test]
    fn the_widened_fold_is_the_scalar_one_whatever_the_length_and_alignment() {
        // 2,500 elements (two whole blocks and a part), 3 parts, buffers at odd addresses;
        // against a plain per-element fold in f32 rounded once.
        let len = 2_500;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for dtype in [DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max] {
                let parts: Vec<Vec<f32>> = (0..3)
                    .map(|_| {
                        (0..len)
                            .map(|_| (next() >> 40) as f32 / (1u64 << 20) as f32 - 8.0)
                            .collect()
                    })
                    .collect();
                let encode = |v: &[f32]| -> Vec<u8> {
                    let mut b = vec![0u8]; // one byte first: the data starts at an odd address
                    for &x in v {
                        b.extend_from_slice(&match dtype {
                            DType::F16 => f16::from_f32(x).to_le_bytes(),
                            _ => bf16::from_f32(x).to_le_bytes(),
                        });
                    }
                    b
                };
                let decode = |b: &[u8]| -> f32 {
                    match dtype {
                        DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
                        _ => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                    }
                };
                let enc: Vec<Vec<u8>> = parts.iter().map(|p| encode(p)).collect();
                let views: Vec<&[u8]> = enc.iter().map(|b| &b[1..]).collect();
                let mut out = vec![0u8; 1 + 2 * len];
                fold_in_order(dtype, op, &mut out[1..], &views);
                for i in 0..len {
                    let xs: Vec<f32> = views.iter().map(|v| decode(&v[2 * i..])).collect();
                    let f = xs[1..].iter().fold(xs[0], |a, &x| match op {
                        ReduceOp::Sum => a + x,
                        ReduceOp::Prod => a * x,
                        _ => a.max(x),
                    });
                    let want = encode(&[f]);
                    assert_eq!(
                        &out[1 + 2 * i..3 + 2 * i],
                        &want[1..],
                        "{dtype:?} {op:?} element {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn sum_prod_min_max_f32() {
        let a = [1.0f32, -2.0, 3.5, f32::NAN];
        let b = [4.0f32, 5.0, -1.0, 1.0];
        for (op, want) in [
            (ReduceOp::Sum, [5.0f32, 3.0, 2.5]),
            (ReduceOp::Prod, [4.0, -10.0, -3.5]),
            (ReduceOp::Min, [1.0, -2.0, -1.0]),
            (ReduceOp::Max, [4.0, 5.0, 3.5]),
        ] {
            let mut acc = bytes(&a);
            reduce_into(DType::F32, op, &mut acc, &bytes(&b), Order::AccFirst);
            let got: &[f32] = bytemuck::cast_slice(&acc);
            assert_eq!(&got[..3], &want, "{op}");
            assert!(got[3].is_nan(), "{op} must propagate NaN");
        }
    }

    #[test]
    fn integers_wrap_and_mean_truncates() {
        let mut acc = bytes(&[i8::MAX, -7]);
        reduce_into(
            DType::I8,
            ReduceOp::Sum,
            &mut acc,
            &bytes(&[1i8, 0]),
            Order::AccFirst,
        );
        assert_eq!(bytemuck::cast_slice::<u8, i8>(&acc), &[i8::MIN, -7]);
        finalize_mean(DType::I8, &mut acc, 2);
        assert_eq!(bytemuck::cast_slice::<u8, i8>(&acc), &[-64, -3]);
    }

    /// The vectorised 16-bit kernels against the element-by-element definition with `half`:
    /// every op and order, lengths around the vector widths, unaligned buffers, and values that
    /// include zeros of both signs, subnormals, the largest finite, infinities and NaNs; every
    /// bit equal but NaN payloads.
    #[test]
    fn half_float_kernels_are_the_elementwise_definition_bit_for_bit() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let specials = [
            0x0000u16, 0x8000, 0x0001, 0x8001, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7F80,
        ];
        for dtype in [DType::F16, DType::BF16] {
            let widen = |h: u16| match dtype {
                DType::F16 => f16::from_bits(h).to_f32(),
                _ => bf16::from_bits(h).to_f32(),
            };
            let round = |x: f32| match dtype {
                DType::F16 => f16::from_f32(x).to_bits(),
                _ => bf16::from_f32(x).to_bits(),
            };
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                for order in [Order::AccFirst, Order::SrcFirst] {
                    for len in [0usize, 1, 7, 8, 15, 16, 17, 33, 64, 515, 1100] {
                        let mut value = |_| {
                            let r = next();
                            if r % 8 == 0 {
                                specials[(r >> 8) as usize % specials.len()]
                            } else {
                                // Moderate magnitudes, so sums and products stay in range.
                                let x = ((r >> 16) % 2000) as f32 / 64.0 - 15.0;
                                round(x)
                            }
                        };
                        let a: Vec<u16> = (0..len).map(&mut value).collect();
                        let b: Vec<u16> = (0..len).map(&mut value).collect();
                        let want: Vec<u16> = a
                            .iter()
                            .zip(&b)
                            .map(|(&x, &y)| {
                                let (x, y) = match order {
                                    Order::AccFirst => (widen(x), widen(y)),
                                    Order::SrcFirst => (widen(y), widen(x)),
                                };
                                round(match op {
                                    ReduceOp::Sum => x + y,
                                    ReduceOp::Prod => x * y,
                                    ReduceOp::Min => <f32 as Arith>::min(x, y),
                                    _ => <f32 as Arith>::max(x, y),
                                })
                            })
                            .collect();
                        // One byte in, so that the u16 views are misaligned.
                        let mut acc = vec![0u8; 1 + 2 * len];
                        acc[1..].copy_from_slice(bytemuck::cast_slice(&a));
                        let mut src = vec![0u8; 1 + 2 * len];
                        src[1..].copy_from_slice(bytemuck::cast_slice(&b));
                        for misaligned in [false, true] {
                            let (lo, mut acc_b, src_b) = if misaligned {
                                (1, acc.clone(), src.clone())
                            } else {
                                (0, bytes(&a), bytes(&b))
                            };
                            reduce_into(dtype, op, &mut acc_b[lo..], &src_b[lo..], order);
                            // Which NaN payload survives an operation on two NaNs is not
                            // defined (the compiler may swap the operands of a commutative
                            // operation): any NaN matches any NaN.
                            let nan_as_one = |h: u16| if widen(h).is_nan() { 0x7FFF } else { h };
                            let got: Vec<u16> = acc_b[lo..]
                                .chunks(2)
                                .map(|c| nan_as_one(u16::from_le_bytes([c[0], c[1]])))
                                .collect();
                            let want: Vec<u16> = want.iter().map(|&h| nan_as_one(h)).collect();
                            assert_eq!(got, want, "{dtype:?} {op:?} {order:?} len {len}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn half_types_round_once_per_step() {
        let a: Vec<f16> = [1.0f32, 2.0, 2048.0]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let b: Vec<f16> = [0.5f32, 3.0, 1.0]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let mut acc = bytes(&a);
        reduce_into(
            DType::F16,
            ReduceOp::Sum,
            &mut acc,
            &bytes(&b),
            Order::AccFirst,
        );
        let got: Vec<f32> = bytemuck::cast_slice::<u8, f16>(&acc)
            .iter()
            .map(|x| x.to_f32())
            .collect();
        assert_eq!(got, vec![1.5, 5.0, 2048.0]); // 2049 is not representable in f16
        let a: Vec<bf16> = [3.0f32, 256.0].iter().map(|&x| bf16::from_f32(x)).collect();
        let mut acc = bytes(&a);
        reduce_into(
            DType::BF16,
            ReduceOp::Max,
            &mut acc,
            &bytes(&a),
            Order::SrcFirst,
        );
        finalize_mean(DType::BF16, &mut acc, 2);
        let got: Vec<f32> = bytemuck::cast_slice::<u8, bf16>(&acc)
            .iter()
            .map(|x| x.to_f32())
            .collect();
        assert_eq!(got, vec![1.5, 128.0]);
    }

    #[test]
    fn unaligned_buffers_are_handled() {
        let v: Vec<f64> = (0..300).map(|i| i as f64).collect();
        let raw = bytes(&v);
        let mut acc = vec![0u8; raw.len() + 1];
        acc[1..].copy_from_slice(&raw);
        let mut src = vec![0u8; raw.len() + 3];
        src[3..].copy_from_slice(&raw);
        reduce_into(
            DType::F64,
            ReduceOp::Sum,
            &mut acc[1..],
            &src[3..],
            Order::AccFirst,
        );
        let mut out = vec![0f64; 300];
        bytemuck::cast_slice_mut::<f64, u8>(&mut out).copy_from_slice(&acc[1..]);
        assert!(out.iter().enumerate().all(|(i, &x)| x == 2.0 * i as f64));
    }

    #[test]
    fn fold_in_order_accumulates_half_floats_in_f32_closer_to_the_exact_sum() {
        // 64 parts of 1 + 2^-9 in f16: exact sum 64.125; rounding at every step loses the
        // small part once the sum passes 2 (f16 has 10 fraction bits).
        let x = f16::from_f32(1.0 + 1.0 / 512.0);
        let part = x.to_le_bytes().to_vec();
        let parts: Vec<&[u8]> = (0..64).map(|_| part.as_slice()).collect();
        let mut wide = vec![0u8; 2];
        fold_in_order(DType::F16, ReduceOp::Sum, &mut wide, &parts);
        let mut stepwise = part.clone();
        for p in &parts[1..] {
            reduce_into(DType::F16, ReduceOp::Sum, &mut stepwise, p, Order::AccFirst);
        }
        let exact = 64.0 * x.to_f64();
        let wide = f16::from_le_bytes([wide[0], wide[1]]).to_f64();
        let stepwise = f16::from_le_bytes([stepwise[0], stepwise[1]]).to_f64();
        assert!(
            (wide - exact).abs() < (stepwise - exact).abs(),
            "wide {wide}, stepwise {stepwise}, exact {exact}"
        );
        // bf16 the same way, and other dtypes fold like successive reduce_into.
        let y = bf16::from_f32(1.0 + 1.0 / 64.0);
        let part = y.to_le_bytes().to_vec();
        let parts: Vec<&[u8]> = (0..64).map(|_| part.as_slice()).collect();
        let mut wide = vec![0u8; 2];
        fold_in_order(DType::BF16, ReduceOp::Sum, &mut wide, &parts);
        let wide = bf16::from_le_bytes([wide[0], wide[1]]).to_f64();
        assert_eq!(wide, 65.0, "64 x (1 + 2^-6) = 65 is representable in bf16");
        let a = 0.1f32.to_le_bytes();
        let b = 0.2f32.to_le_bytes();
        let c = 0.3f32.to_le_bytes();
        let mut out = [0u8; 4];
        fold_in_order(DType::F32, ReduceOp::Sum, &mut out, &[&a, &b, &c]);
        assert_eq!(f32::from_le_bytes(out), (0.1f32 + 0.2f32) + 0.3f32);
    }

    #[test]
    fn reduce_pair_is_copy_then_reduce_bit_for_bit() {
        // Every dtype and op, aligned and not (the fallback), with NaNs and signed zeros among
        // the floats: out = a ⊕ b exactly as out = a; out ⊕= b.
        let raw = |seed: u64, len: usize| -> Vec<u8> {
            (0..len as u64)
                .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed).rotate_left(29) as u8)
                .collect()
        };
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                for (offset, elems) in [(0, 0), (0, 1), (0, 37), (1, 37), (0, 1000)] {
                    let len = elems * dtype.size();
                    let a = raw(1, len + offset);
                    let b = raw(2, len + offset);
                    let (a, b) = (&a[offset..], &b[offset..]);
                    let mut want = a.to_vec();
                    reduce_into(dtype, op, &mut want, b, Order::AccFirst);
                    let mut got = vec![0u8; len + offset];
                    reduce_pair(dtype, op, &mut got[offset..], a, b);
                    assert_eq!(
                        &got[offset..],
                        &want[..],
                        "{dtype:?} {op:?} {offset} {elems}"
                    );
                }
            }
        }
        // +0 and -0: min and max keep the first operand when neither is less, so the operand
        // order shows. (Not NaN payloads: the compiler treats + and * as commutative and does
        // not keep them, in either function.)
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let a = 0.0f32.to_le_bytes();
            let b = (-0.0f32).to_le_bytes();
            let mut want = a;
            reduce_into(DType::F32, op, &mut want, &b, Order::AccFirst);
            let mut got = [0u8; 4];
            reduce_pair(DType::F32, op, &mut got, &a, &b);
            assert_eq!(got, want, "{op:?}");
        }
    }
}
