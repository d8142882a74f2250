//! Times the int8 codec on 32 MiB of f32: its error-feedback encode and its decode, five
//! rounds after two warm-up rounds (`cargo run --release -p hcomm --example codec_speed`).
//! Used to check that a change to the codec costs nothing (alternate it with the old build).
use hcomm::compress::{Codec, Int8Block};
use std::time::Instant;

fn main() {
    let n = 8 << 20;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
        .collect();
    let mut codec = Int8Block::new(256).unwrap();
    let mut r = vec![0f32; n];
    let mut enc = vec![0u8; codec.encoded_len(n)];
    let mut dec = vec![0f32; n];
    for round in 0..7 {
        let t = Instant::now();
        codec.encode_keeping_error(&x, &mut r, &mut enc).unwrap();
        let e = t.elapsed();
        let t = Instant::now();
        codec.decode_add(&enc, &mut dec).unwrap();
        let d = t.elapsed();
        if round > 1 {
            println!(
                "encode {:.2} ms  decode {:.2} ms",
                e.as_secs_f64() * 1e3,
                d.as_secs_f64() * 1e3
            );
        }
    }
}
