use hcomm::reduce::{reduce_into, Order};
use hcomm::{DType, ReduceOp};
use std::time::Instant;
fn main() {
    for &kib in &[16usize, 128, 256, 1024] {
        let n = kib * 1024;
        // Little-endian 0x3C00 per 16 bits: 1.0 in f16, 2⁻⁷ in bf16, normal numbers in every type.
        let pattern = |k: usize| if k.is_multiple_of(2) { 0x00u8 } else { 0x3C };
        let mut acc: Vec<u8> = (0..n).map(pattern).collect();
        let src = acc.clone();
        let iters = (512 * 1024 * 1024 / n).max(10);
        for dt in [DType::F32, DType::F64, DType::I32, DType::BF16, DType::F16] {
            let t = Instant::now();
            for _ in 0..iters {
                reduce_into(dt, ReduceOp::Sum, &mut acc, &src, Order::AccFirst);
                std::hint::black_box(&mut acc);
            }
            let s = t.elapsed().as_secs_f64();
            println!(
                "{kib:5} KiB {dt:?}: {:.1} GB/s (acc bytes per second)",
                (n * iters) as f64 / s / 1e9
            );
        }
    }
}
