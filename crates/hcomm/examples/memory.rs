//! Resident memory of a rank doing large all-reduces: the library's own share is what the rank
//! holds beyond the two user buffers.
//!
//! ```sh
//! cargo build --release --examples -p hcomm
//! target/release/hcomm run -n 4 -- target/release/examples/memory 256
//! ```

use hcomm::{Communicator, ReduceOp};

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(field)).map(|l| {
                l.split_whitespace()
                    .nth(1)
                    .unwrap_or("0")
                    .parse()
                    .unwrap_or(0)
            })
        })
        .unwrap_or(0)
}

fn main() -> hcomm::Result<()> {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let comm = Communicator::from_env()?;
    let n = mib << 20 >> 2;
    let send: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut recv = vec![0f32; n];
    recv.iter_mut().for_each(|x| *x = 1.0); // touch every page
    let before = status_kib("VmRSS:");
    let t = std::time::Instant::now();
    for _ in 0..3 {
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
    }
    let secs = t.elapsed().as_secs_f64() / 3.0;
    assert!(recv
        .iter()
        .enumerate()
        .all(|(i, &x)| x == (i % 7) as f32 * comm.world_size() as f32));
    let after = status_kib("VmRSS:");
    let peak = status_kib("VmHWM:");
    let buffers = 2 * (mib << 10) as u64;
    println!(
        "rank {}: all_reduce {mib} MiB x{} ranks in {:.1} ms; RSS before {} MiB, after {} MiB, peak {} MiB; user buffers {} MiB; library + runtime above buffers: {} MiB; open links {}; shared memory segment {} KiB",
        comm.rank(),
        comm.world_size(),
        secs * 1e3,
        before >> 10,
        after >> 10,
        peak >> 10,
        buffers >> 10,
        (peak.saturating_sub(buffers)) >> 10,
        comm.open_links(),
        comm.shared_memory_bytes() >> 10
    );
    Ok(())
}
