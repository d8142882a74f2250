//! Skipping zero blocks between hosts (`HCOMM_SKIP_ZEROS`, on by default): the all-reduce of
//! two ranks on different hosts, and the cross-host step of the hierarchical all-reduce on two
//! hosts, send only the blocks that are not all zero bits. The result must be bitwise the
//! dense all-reduce's (the same communicator with `set_skip_zeros(false)`), for every float
//! dtype and integers, sum and mean, in place and not, with the blocks zero on one rank, on
//! both or on none, `-0.0`s facing a zero block, the short last block, few runs (reduced as
//! they arrive) and many (one packed frame); and a sparse input must move fewer bytes. The
//! two-rank reduce-scatter across hosts (FSDP's gradients) likewise, with even and uneven
//! segments.

use hcomm::testing::{expect_all, random_input, run_threads_on_hosts_configured};
use hcomm::{Algo, BootstrapConfig, Collective, Communicator, DType, ReduceOp};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const BLOCK: usize = 1024;

/// How the zero blocks of rank `rank`'s input fall.
#[derive(Clone, Copy, Debug)]
enum Pattern {
    /// No zero block on either rank (the ring runs).
    Dense,
    /// A few runs of non-zero blocks per rank, overlapping between the ranks (reduced in place
    /// as they arrive).
    FewRuns,
    /// Every third block non-zero, shifted per rank: hundreds of runs (one packed frame).
    Scattered,
    /// Rank 1 all zero; rank 0 has `-0.0`s in blocks otherwise zero (the dense sum makes them
    /// `+0.0`).
    OneSideZero,
    /// Both all zero.
    AllZero,
}

const PATTERNS: [Pattern; 5] = [
    Pattern::Dense,
    Pattern::FewRuns,
    Pattern::Scattered,
    Pattern::OneSideZero,
    Pattern::AllZero,
];

/// Whether block `b` of rank `rank` keeps its values under `p` (otherwise it is zeroed).
fn keeps(p: Pattern, rank: usize, b: usize) -> bool {
    match p {
        Pattern::Dense => true,
        Pattern::FewRuns => {
            let start = if rank == 0 { 3 } else { 5 };
            (start..start + 4).contains(&(b % 40))
        }
        Pattern::Scattered => (b + rank).is_multiple_of(3),
        Pattern::OneSideZero => rank == 0 && b % 7 == 1,
        Pattern::AllZero => false,
    }
}

/// Rank `rank`'s input: random values (non-integer floats) with the pattern's zero blocks.
fn input(dtype: DType, rank: usize, count: usize, p: Pattern, seed: u64) -> Vec<u8> {
    let es = dtype.size();
    let mut v = random_input(dtype, ReduceOp::Sum, rank, count, seed);
    let block = (BLOCK / es).max(1) * es;
    for (b, chunk) in v.chunks_mut(block).enumerate() {
        if !keeps(p, rank, b) {
            chunk.fill(0);
        }
        if matches!(p, Pattern::OneSideZero) && rank == 0 && b % 7 == 3 && dtype.is_float() {
            // a block that is zero but for one -0.0 (its sign bit), facing rank 1's zeros
            chunk.fill(0);
            chunk[es - 1] = 0x80;
        }
    }
    v
}

fn tcp_sent(c: &Communicator) -> u64 {
    c.traffic().iter().map(|t| t.tcp_sent).sum()
}

/// Every case on `hosts`: the skipping all-reduce's bits against the dense one's, and its
/// bytes against the dense bytes. Returns the number of cases compared.
fn sweep(hosts: &[&str], nsocks: usize, hierarchical: bool) -> usize {
    let dtypes = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32];
    let results = expect_all(run_threads_on_hosts_configured(
        hosts,
        T,
        |cfg| BootstrapConfig { nsocks, ..cfg },
        |c| {
            assert!(c.skips_zeros(), "on by default");
            if hierarchical {
                c.set_algorithm(Collective::AllReduce, Algo::Hierarchical)?;
            }
            let mut cases = 0;
            for (d, &dtype) in dtypes.iter().enumerate() {
                let es = dtype.size();
                // the smallest size that skips (in a hierarchical run each rank's cross-host
                // slice is half the buffer), an odd one (short last block), a large one
                let min = 64 * BLOCK / es * if hierarchical { 2 } else { 1 };
                let counts = [min, min + 333, 300_001];
                for (k, &count) in counts.iter().enumerate() {
                    for (q, &p) in PATTERNS.iter().enumerate() {
                        for op in [ReduceOp::Sum, ReduceOp::Mean] {
                            if op == ReduceOp::Mean && !dtype.is_float() {
                                continue;
                            }
                            let seed = (d * 100 + k * 10 + q) as u64;
                            // In a hierarchical run the host's ranks sum first: every rank's
                            // input follows the pattern of its host's index.
                            let host_index = usize::from(c.host_id() != hosts[0]);
                            let x = input(dtype, host_index, count, p, seed + c.rank() as u64);
                            let in_place = (k + q) % 2 == 0;
                            let run = |c: &Communicator| -> hcomm::Result<(Vec<u8>, u64)> {
                                let before = tcp_sent(c);
                                let mut out = vec![0u8; x.len()];
                                if in_place {
                                    out.copy_from_slice(&x);
                                    c.all_reduce_bytes(None, &mut out, dtype, op)?;
                                } else {
                                    c.all_reduce_bytes(Some(&x), &mut out, dtype, op)?;
                                }
                                Ok((out, tcp_sent(c) - before))
                            };
                            let (skipped, skip_bytes) = run(&c)?;
                            c.set_skip_zeros(false);
                            let (dense, dense_bytes) = run(&c)?;
                            c.set_skip_zeros(true);
                            assert!(
                                skipped == dense,
                                "rank {}: {dtype} {op} count {count} {p:?}: the skipping all-reduce's bits differ from the dense one's",
                                c.rank()
                            );
                            // Bytes: a sparse input moves less than half of the dense bytes;
                            // a dense one at most the dense bytes and the bitmap (and frame
                            // headers).
                            let slack = (count * es / BLOCK / 8 + 4096) as u64;
                            match p {
                                Pattern::Dense => assert!(
                                    skip_bytes <= dense_bytes + slack,
                                    "{dtype} {count} dense: {skip_bytes} bytes against {dense_bytes}"
                                ),
                                // every third block, shifted per host: the hierarchical
                                // slices do not start on a block boundary, so two in three
                                // of their blocks hold data
                                Pattern::Scattered => assert!(
                                    skip_bytes < dense_bytes,
                                    "rank {}: {dtype} {count} {p:?}: {skip_bytes} bytes against the dense {dense_bytes}",
                                    c.rank()
                                ),
                                _ => assert!(
                                    skip_bytes * 2 < dense_bytes,
                                    "rank {}: {dtype} {count} {p:?}: {skip_bytes} bytes against the dense {dense_bytes}",
                                    c.rank()
                                ),
                            }
                            cases += 1;
                        }
                    }
                }
            }
            Ok(cases)
        },
    ));
    results[0]
}

#[test]
fn two_hosts_of_one_rank_skip_zero_blocks_with_the_dense_bits() {
    assert_eq!(sweep(&["h0", "h1"], 1, false), 135);
}

#[test]
fn striped_links_skip_zero_blocks_with_the_dense_bits() {
    assert_eq!(sweep(&["h0", "h1"], 3, false), 135);
}

#[test]
fn the_hierarchical_cross_host_step_skips_zero_blocks_with_the_dense_bits() {
    assert_eq!(sweep(&["h0", "h0", "h1", "h1"], 1, true), 135);
}

/// The reduce-scatter of two ranks on two hosts: every case's bits against the dense
/// reduce-scatter's, and its bytes. Returns the number of cases compared.
fn sweep_reduce_scatter(nsocks: usize) -> usize {
    let dtypes = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32];
    let results = expect_all(run_threads_on_hosts_configured(
        &["h0", "h1"],
        T,
        |cfg| BootstrapConfig { nsocks, ..cfg },
        |c| {
            let mut cases = 0;
            for (d, &dtype) in dtypes.iter().enumerate() {
                let es = dtype.size();
                // per-rank segments: the smallest that skips (64 KiB in all), odd and uneven
                // (short last blocks), large
                let min = 32 * BLOCK / es;
                let shapes = [[min, min], [min + 333, min + 100], [150_001, 150_001]];
                for (k, counts) in shapes.iter().enumerate() {
                    let total = counts[0] + counts[1];
                    for (q, &p) in PATTERNS.iter().enumerate() {
                        for op in [ReduceOp::Sum, ReduceOp::Mean] {
                            if op == ReduceOp::Mean && !dtype.is_float() {
                                continue;
                            }
                            let seed = (d * 100 + k * 10 + q) as u64;
                            let x = input(dtype, c.rank(), total, p, seed);
                            let in_place = (k + q) % 2 == 1;
                            let me = c.rank();
                            let mine = if me == 0 {
                                0..counts[0] * es
                            } else {
                                counts[0] * es..total * es
                            };
                            let run = |c: &Communicator| -> hcomm::Result<(Vec<u8>, u64)> {
                                let before = tcp_sent(c);
                                let out = if in_place {
                                    let mut buf = x.clone();
                                    c.reduce_scatter_v_bytes(
                                        None,
                                        &mut buf,
                                        &counts[..],
                                        dtype,
                                        op,
                                    )?;
                                    buf[mine.clone()].to_vec()
                                } else {
                                    let mut out = vec![0u8; counts[me] * es];
                                    c.reduce_scatter_v_bytes(
                                        Some(&x),
                                        &mut out,
                                        &counts[..],
                                        dtype,
                                        op,
                                    )?;
                                    out
                                };
                                Ok((out, tcp_sent(c) - before))
                            };
                            let (skipped, skip_bytes) = run(&c)?;
                            c.set_skip_zeros(false);
                            let (dense, dense_bytes) = run(&c)?;
                            c.set_skip_zeros(true);
                            assert!(
                                skipped == dense,
                                "rank {me}: {dtype} {op} counts {counts:?} {p:?} (in place: {in_place}): the skipping reduce-scatter's bits differ from the dense one's"
                            );
                            let slack = (total * es / BLOCK / 8 + 4096) as u64;
                            match p {
                                Pattern::Dense => assert!(
                                    skip_bytes <= dense_bytes + slack,
                                    "{dtype} {counts:?} dense: {skip_bytes} bytes against {dense_bytes}"
                                ),
                                // every third block of the whole input: a segment that does not
                                // start on a block boundary has data in two blocks of three
                                Pattern::Scattered => assert!(
                                    skip_bytes < dense_bytes,
                                    "rank {me}: {dtype} {counts:?} {p:?}: {skip_bytes} bytes against the dense {dense_bytes}"
                                ),
                                _ => assert!(
                                    skip_bytes * 2 < dense_bytes,
                                    "rank {me}: {dtype} {counts:?} {p:?}: {skip_bytes} bytes against the dense {dense_bytes}"
                                ),
                            }
                            cases += 1;
                        }
                    }
                }
            }
            Ok(cases)
        },
    ));
    results[0]
}

#[test]
fn two_hosts_reduce_scatter_skipping_zero_blocks_with_the_dense_bits() {
    assert_eq!(sweep_reduce_scatter(1), 135);
    assert_eq!(sweep_reduce_scatter(3), 135);
}

#[test]
fn ranks_of_one_host_and_three_hosts_stay_dense() {
    // One host (over TCP): the skipping path is for links between hosts. Three hosts: a sum
    // of three can round differently in another order, so the ring runs.
    for hosts in [&["h0", "h0"][..], &["h0", "h1", "h2"][..]] {
        let n = hosts.len();
        let sent = expect_all(run_threads_on_hosts_configured(
            hosts,
            T,
            |cfg| BootstrapConfig {
                transport: hcomm::config::TransportKind::Tcp,
                ..cfg
            },
            |c| {
                let mut x = vec![0f32; 1 << 16];
                x[5] = 1.0;
                let before = tcp_sent(&c);
                c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
                assert_eq!(x[5], n as f32);
                Ok(tcp_sent(&c) - before)
            },
        ));
        // the ring moves 2 (n - 1) / n of the 256 KiB
        let ring = (2 * (n - 1) * (1 << 18) / n) as u64;
        assert!(
            sent.iter().all(|&s| s >= ring),
            "{hosts:?}: {sent:?} bytes, the ring's {ring}"
        );
    }
}

#[test]
fn turned_off_it_moves_the_dense_bytes() {
    let sent = expect_all(run_threads_on_hosts_configured(
        &["h0", "h1"],
        T,
        |cfg| cfg,
        |c| {
            c.set_skip_zeros(false);
            assert!(!c.skips_zeros());
            let mut x = vec![0f32; 1 << 16];
            let before = tcp_sent(&c);
            c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            Ok(tcp_sent(&c) - before)
        },
    ));
    assert!(sent.iter().all(|&s| s >= 1 << 18), "{sent:?}");
}

#[test]
fn ranks_that_disagree_on_skipping_fail_with_a_mismatch() {
    let results = run_threads_on_hosts_configured(
        &["h0", "h1"],
        Duration::from_secs(10),
        |cfg| cfg,
        |c| {
            c.set_skip_zeros(c.rank() == 0);
            let mut x = vec![1f32; 1 << 16];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum)
        },
    );
    let rs = run_threads_on_hosts_configured(
        &["h0", "h1"],
        Duration::from_secs(10),
        |cfg| cfg,
        |c| {
            c.set_skip_zeros(c.rank() == 1);
            let mut x = vec![1f32; 1 << 16];
            c.reduce_scatter_in_place(&mut x, ReduceOp::Sum)
        },
    );
    let results: Vec<_> = results.into_iter().chain(rs).collect();
    // Each rank fails at once (not at the timeout), naming both schedules.
    for (r, res) in results.iter().enumerate() {
        let e = res
            .as_ref()
            .expect_err("a disagreement must fail")
            .to_string();
        assert!(
            e.contains("collective mismatch")
                && e.contains("algo=skip-zeros")
                && e.contains("algo=ring"),
            "rank {r}: {e}"
        );
    }
}
