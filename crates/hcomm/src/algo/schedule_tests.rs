//! The schedule tier: every algorithm's schedule run on the in-memory transport
//! ([`crate::transport::mem`]), one thread per rank, for world sizes 1 to 17, against a plain
//! CPU reference. No socket, segment or communicator is involved, so a failure here is the
//! schedule's own (a wrong segment, step or peer), and a schedule that deadlocks fails at its
//! deadline instead of hanging the suite.
//!
//! Inputs are the small integers of [`crate::testing::input`], so every reduction order gives
//! the same exact result and the reference can be computed in f64.

use super::{basic, ring, tree, Algo, Run};
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::{OpContext, Result};
use crate::base::segments::{count_segments, even_segments};
use crate::testing::{input, reference};
use crate::transport::mem::MemFabric;
use crate::wire::collective::{fingerprint, Collective};
use crate::wire::frame::Header;
use proptest::prelude::*;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(10);
const DTYPES: [DType; 11] = DType::ALL;
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

/// The run context of `rank` of `size` over `links`, giving up after `within`.
fn run_on(
    links: &mut crate::transport::mem::MemLinks,
    rank: usize,
    size: usize,
    fp: Header,
    within: Duration,
) -> Run<'_> {
    Run {
        links,
        rank,
        size,
        ctx: OpContext {
            op: "schedule",
            seq: fp.seq,
        },
        fp,
        deadline: crate::base::deadline::Deadline::fixed(Instant::now(), within),
    }
}

/// Run `body` on `n` ranks of a fresh fabric, each with a [`Run`] whose fingerprint is the
/// same on every rank, and return every rank's output. Panics naming the rank that failed,
/// and if any frame was left unreceived.
fn world<F>(n: usize, fp: Header, body: F) -> Vec<Vec<u8>>
where
    F: Fn(&mut Run, usize) -> Result<Vec<u8>> + Sync,
{
    let fabric = MemFabric::new(n);
    let outs: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (fabric, body) = (&fabric, &body);
                s.spawn(move || {
                    let mut links = fabric.links(rank);
                    let mut run = run_on(&mut links, rank, n, fp, DEADLINE);
                    body(&mut run, rank)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let outs: Vec<Vec<u8>> = outs
        .into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r} of {n}: {e}")))
        .collect();
    assert_eq!(
        fabric.frames_in_flight(),
        0,
        "{n} ranks left frames unreceived"
    );
    outs
}

fn fp(
    coll: Collective,
    algo: Algo,
    dtype: DType,
    op: Option<ReduceOp>,
    root: Option<usize>,
    count: usize,
) -> Header {
    Header {
        algo: algo.code(),
        ..fingerprint(1, coll, Some(dtype), op, root, count)
    }
}

/// Per-rank element counts of a v-variant: uneven, some zero.
fn uneven(n: usize, seed: u64) -> Vec<usize> {
    (0..n)
        .map(|r| ((r as u64 * 7 + seed * 3) % 5) as usize)
        .collect()
}

fn all_reduce(n: usize, algo: Algo, dtype: DType, op: ReduceOp, count: usize, seed: u64) {
    let want = reference(dtype, op, n, count, seed);
    let outs = world(
        n,
        fp(Collective::AllReduce, algo, dtype, Some(op), None, count),
        |run, r| {
            let mut buf = input(dtype, op, r, count, seed);
            match algo {
                Algo::Ring => ring::all_reduce(
                    run,
                    None,
                    &mut buf,
                    &even_segments(count, n, dtype.size()),
                    dtype,
                    op,
                )?,
                Algo::RecursiveDoubling => basic::all_reduce_rd(run, &mut buf, dtype, op)?,
                a => unreachable!("{a}"),
            }
            Ok(buf)
        },
    );
    for (r, got) in outs.iter().enumerate() {
        assert!(
            got == &want,
            "all_reduce {algo} {dtype} {op} count {count} on {n} ranks: rank {r} differs"
        );
    }
}

fn reduce_scatter(
    n: usize,
    dtype: DType,
    op: ReduceOp,
    per_rank: usize,
    in_place: bool,
    seed: u64,
) {
    let count = per_rank * n;
    let want = reference(dtype, op, n, count, seed);
    let segs = even_segments(count, n, dtype.size());
    let outs = world(
        n,
        fp(
            Collective::ReduceScatter,
            Algo::Ring,
            dtype,
            Some(op),
            None,
            count,
        ),
        |run, r| {
            let mut full = input(dtype, op, r, count, seed);
            if in_place {
                ring::reduce_scatter(run, ring::RsIo::InPlace(&mut full), &segs, dtype, op)?;
                Ok(full[segs[r].clone()].to_vec())
            } else {
                let mut out = vec![0u8; segs[r].len()];
                let before = full.clone();
                ring::reduce_scatter(
                    run,
                    ring::RsIo::Out {
                        input: &full,
                        output: &mut out,
                    },
                    &segs,
                    dtype,
                    op,
                )?;
                assert_eq!(full, before, "reduce_scatter wrote its input");
                full.clear();
                Ok(out)
            }
        },
    );
    for (r, got) in outs.iter().enumerate() {
        assert!(got[..] == want[segs[r].clone()], "reduce_scatter {dtype} {op} {per_rank}/rank in_place={in_place} on {n} ranks: rank {r} differs");
    }
}

/// Rank `r`'s block of a gather/scatter/all-gather: `counts[r]` elements, distinct per rank.
fn block(dtype: DType, r: usize, count: usize, seed: u64) -> Vec<u8> {
    input(dtype, ReduceOp::Max, r, count, seed)
}

fn all_gather(n: usize, dtype: DType, counts: &[usize], seed: u64) {
    let segs = count_segments(counts, dtype.size());
    let want: Vec<u8> = (0..n)
        .flat_map(|r| block(dtype, r, counts[r], seed))
        .collect();
    let total = counts.iter().sum();
    let outs = world(
        n,
        fp(Collective::AllGather, Algo::Ring, dtype, None, None, total),
        |run, r| {
            let mut buf = vec![0u8; want.len()];
            buf[segs[r].clone()].copy_from_slice(&block(dtype, r, counts[r], seed));
            ring::all_gather_in_place(run, &mut buf, &segs, 0)?;
            Ok(buf)
        },
    );
    for (r, got) in outs.iter().enumerate() {
        assert!(
            got == &want,
            "all_gather {dtype} counts {counts:?}: rank {r} differs"
        );
    }
}

fn broadcast(n: usize, algo: Algo, dtype: DType, count: usize, root: usize, seed: u64) {
    let want = block(dtype, root, count, seed);
    let outs = world(
        n,
        fp(Collective::Broadcast, algo, dtype, None, Some(root), count),
        |run, r| {
            let mut buf = if r == root {
                want.clone()
            } else {
                vec![0u8; want.len()]
            };
            match algo {
                Algo::Tree => tree::broadcast_tree(run, &mut buf, root)?,
                Algo::Chain => tree::broadcast_chain(run, &mut buf, root)?,
                a => unreachable!("{a}"),
            }
            Ok(buf)
        },
    );
    for (r, got) in outs.iter().enumerate() {
        assert!(
            got == &want,
            "broadcast {algo} {dtype} count {count} root {root} on {n} ranks: rank {r} differs"
        );
    }
}

fn reduce(n: usize, algo: Algo, dtype: DType, op: ReduceOp, count: usize, root: usize, seed: u64) {
    let want = reference(dtype, op, n, count, seed);
    let outs = world(
        n,
        fp(Collective::Reduce, algo, dtype, Some(op), Some(root), count),
        |run, r| {
            let mine = input(dtype, op, r, count, seed);
            match algo {
                Algo::Tree => {
                    let mut acc = mine;
                    if n > 1 {
                        tree::reduce_tree(run, &mut acc, dtype, op, root)?;
                    }
                    Ok(if r == root { acc } else { Vec::new() })
                }
                Algo::Chain => {
                    let mut out = vec![0u8; if r == root { mine.len() } else { 0 }];
                    tree::reduce_chain(run, &mine, &mut out, dtype, op, root)?;
                    Ok(out)
                }
                a => unreachable!("{a}"),
            }
        },
    );
    assert!(
        outs[root] == want,
        "reduce {algo} {dtype} {op} count {count} root {root} on {n} ranks: root differs"
    );
}

fn gather_scatter(n: usize, dtype: DType, counts: &[usize], root: usize, seed: u64) {
    let segs = count_segments(counts, dtype.size());
    let all: Vec<u8> = (0..n)
        .flat_map(|r| block(dtype, r, counts[r], seed))
        .collect();
    let total = counts.iter().sum();
    let gathered = world(
        n,
        fp(
            Collective::Gather,
            Algo::Linear,
            dtype,
            None,
            Some(root),
            total,
        ),
        |run, r| {
            let mine = block(dtype, r, counts[r], seed);
            let mut out = vec![0u8; if r == root { all.len() } else { 0 }];
            basic::gather_linear(run, &mine, &mut out, &segs, root)?;
            Ok(out)
        },
    );
    assert!(
        gathered[root] == all,
        "gather {dtype} counts {counts:?} root {root}: root differs"
    );
    let scattered = world(
        n,
        fp(
            Collective::Scatter,
            Algo::Linear,
            dtype,
            None,
            Some(root),
            total,
        ),
        |run, r| {
            let input = if r == root { all.clone() } else { Vec::new() };
            let mut out = vec![0u8; segs[r].len()];
            basic::scatter_linear(run, &input, &mut out, &segs, root)?;
            Ok(out)
        },
    );
    for (r, got) in scattered.iter().enumerate() {
        assert!(
            got[..] == all[segs[r].clone()],
            "scatter {dtype} counts {counts:?} root {root}: rank {r} differs"
        );
    }
}

fn all_to_all(n: usize, dtype: DType, seed: u64) {
    // counts[i][j]: elements rank i sends to rank j.
    let counts: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            (0..n)
                .map(|j| (i * 3 + j * 5 + seed as usize) % 4)
                .collect()
        })
        .collect();
    let piece = |i: usize, j: usize| input(dtype, ReduceOp::Max, i * n + j, counts[i][j], seed);
    let outs = world(
        n,
        fp(Collective::AllToAll, Algo::Pairwise, dtype, None, None, 0),
        |run, r| {
            let send: Vec<u8> = (0..n).flat_map(|j| piece(r, j)).collect();
            let ss = count_segments(&counts[r], dtype.size());
            let from: Vec<usize> = (0..n).map(|i| counts[i][r]).collect();
            let rs = count_segments(&from, dtype.size());
            let mut recv = vec![0u8; rs.last().map_or(0, |s| s.end)];
            basic::all_to_all_pairwise(run, &send, &ss, &mut recv, &rs)?;
            Ok(recv)
        },
    );
    for (r, got) in outs.iter().enumerate() {
        let want: Vec<u8> = (0..n).flat_map(|i| piece(i, r)).collect();
        assert!(
            got == &want,
            "all_to_all {dtype} on {n} ranks: rank {r} differs"
        );
    }
}

#[test]
fn every_schedule_on_1_to_17_ranks() {
    for n in 1..=17 {
        let seed = n as u64;
        for count in [0, 1, 2, 7, 4099] {
            for algo in [Algo::Ring, Algo::RecursiveDoubling] {
                all_reduce(n, algo, DType::F32, ReduceOp::Sum, count, seed);
            }
            for algo in [Algo::Tree, Algo::Chain] {
                broadcast(n, algo, DType::I32, count, (n - 1) / 2, seed);
                reduce(n, algo, DType::I64, ReduceOp::Sum, count, n - 1, seed);
            }
        }
        for per_rank in [0, 1, 3] {
            reduce_scatter(n, DType::F64, ReduceOp::Sum, per_rank, true, seed);
            reduce_scatter(n, DType::F64, ReduceOp::Sum, per_rank, false, seed);
        }
        all_gather(n, DType::F16, &uneven(n, seed), seed);
        all_gather(n, DType::U8, &vec![3; n], seed);
        gather_scatter(n, DType::I16, &uneven(n, seed), n / 2, seed);
        all_to_all(n, DType::U32, seed);
        let _ = world(
            n,
            fp(
                Collective::Barrier,
                Algo::Dissemination,
                DType::U8,
                None,
                None,
                0,
            ),
            |run, _| {
                if n > 1 {
                    basic::barrier_dissemination(run)?;
                }
                Ok(Vec::new())
            },
        );
    }
}

/// The out-of-place ring all-reduce of `inputs` (one per rank), into outputs filled with
/// `0xA5` first: every rank's output, and a check that no rank's input changed.
fn ring_all_reduce_from(inputs: &[Vec<u8>], dtype: DType, op: ReduceOp) -> Vec<Vec<u8>> {
    let n = inputs.len();
    let count = inputs[0].len() / dtype.size();
    world(
        n,
        fp(
            Collective::AllReduce,
            Algo::Ring,
            dtype,
            Some(op),
            None,
            count,
        ),
        |run, r| {
            let mut out = vec![0xA5u8; inputs[r].len()];
            let segs = even_segments(count, n, dtype.size());
            let before = inputs[r].clone();
            ring::all_reduce(run, Some(&inputs[r]), &mut out, &segs, dtype, op)?;
            assert_eq!(
                inputs[r], before,
                "rank {r} of {n}: the ring wrote its input"
            );
            Ok(out)
        },
    )
}

#[test]
fn out_of_place_ring_all_reduce_writes_every_byte_of_its_output() {
    // The output starts as 0xA5 garbage, never as a copy of the input: a byte the schedule
    // leaves unwritten, or a reduction that reads the output instead of the input, shows.
    for n in 1..=7 {
        for (d, dtype) in DTYPES.iter().enumerate() {
            for count in [0, 1, 2, 7, 4099] {
                let op = OPS[(n + d) % OPS.len()];
                let seed = (n * 31 + d) as u64;
                let inputs: Vec<Vec<u8>> =
                    (0..n).map(|r| input(*dtype, op, r, count, seed)).collect();
                let want = reference(*dtype, op, n, count, seed);
                for (r, got) in ring_all_reduce_from(&inputs, *dtype, op).iter().enumerate() {
                    assert!(
                        got == &want,
                        "out-of-place ring {dtype} {op} count {count} on {n} ranks: rank {r} differs"
                    );
                }
            }
        }
    }
}

#[test]
fn out_of_place_ring_all_reduce_is_bitwise_the_in_place_one() {
    // Random floats, where the order of every addition shows in the bits: reducing the
    // received segment with the input in one pass must be the same operation, in the same
    // operand order, as copying the input first and reducing into the copy.
    for n in [2, 3, 4, 5] {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let count = 4099;
            let inputs: Vec<Vec<u8>> = (0..n).map(|r| random_floats(dtype, r, count, 5)).collect();
            let in_place = world(
                n,
                fp(
                    Collective::AllReduce,
                    Algo::Ring,
                    dtype,
                    Some(ReduceOp::Sum),
                    None,
                    count,
                ),
                |run, r| {
                    let mut buf = inputs[r].clone();
                    let segs = even_segments(count, n, dtype.size());
                    ring::all_reduce(run, None, &mut buf, &segs, dtype, ReduceOp::Sum)?;
                    Ok(buf)
                },
            );
            let from = ring_all_reduce_from(&inputs, dtype, ReduceOp::Sum);
            assert!(
                in_place == from,
                "{dtype} on {n} ranks: out of place differs from in place"
            );
        }
    }
}

#[test]
fn the_pipelined_pair_all_reduce_is_bitwise_the_two_phase_ring() {
    // Two ranks and at least two chunks take the pipelined schedule: sizes at the threshold,
    // one element past it (segments of unequal length, a last chunk of one element) and with
    // a partial last chunk; in place and out of place, against the two phases run directly.
    let two_phase = |inputs: &[Vec<u8>], dtype: DType, op: ReduceOp| {
        let count = inputs[0].len() / dtype.size();
        world(
            2,
            fp(
                Collective::AllReduce,
                Algo::Ring,
                dtype,
                Some(op),
                None,
                count,
            ),
            |run, r| {
                let mut buf = inputs[r].clone();
                let segs = even_segments(count, 2, dtype.size());
                ring::reduce_scatter_in_place(run, None, &mut buf, &segs, dtype, op, 0)?;
                ring::all_gather_in_place(run, &mut buf, &segs, 2)?;
                Ok(buf)
            },
        )
    };
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::I8] {
        let es = dtype.size();
        let at = 2 * ring::PAIR_CHUNK / es;
        for count in [
            at,
            at + 1,
            at + 2 * 1000 + 1,
            7 * ring::PAIR_CHUNK / es / 2 + 3,
        ] {
            let op = if dtype == DType::I8 {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            };
            let inputs: Vec<Vec<u8>> = (0..2).map(|r| random_floats(dtype, r, count, 9)).collect();
            let want = two_phase(&inputs, dtype, op);
            let from = ring_all_reduce_from(&inputs, dtype, op);
            assert!(from == want, "{dtype} count {count}: out of place differs");
            let in_place = world(
                2,
                fp(
                    Collective::AllReduce,
                    Algo::Ring,
                    dtype,
                    Some(op),
                    None,
                    count,
                ),
                |run, r| {
                    let mut buf = inputs[r].clone();
                    let segs = even_segments(count, 2, es);
                    ring::all_reduce(run, None, &mut buf, &segs, dtype, op)?;
                    Ok(buf)
                },
            );
            assert!(in_place == want, "{dtype} count {count}: in place differs");
        }
    }
}

#[test]
fn chain_schedules_with_several_chunks() {
    // Larger than two chain chunks, so the pipeline forwards and receives at once.
    let count = 2 * tree::CHAIN_CHUNK / 4 + 1001;
    for n in [2, 3, 5] {
        broadcast(n, Algo::Chain, DType::F32, count, 1, 7);
        reduce(n, Algo::Chain, DType::F32, ReduceOp::Sum, count, n - 1, 7);
        all_reduce(n, Algo::Ring, DType::BF16, ReduceOp::Max, count, 7);
    }
}

#[test]
fn a_mismatched_call_is_named_not_hung() {
    // Rank 1 expects a broadcast of 5 elements, rank 0 sends 4: the fabric refuses the frame
    // and names both calls, as the TCP links do.
    let fabric = MemFabric::new(2);
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let fabric = &fabric;
                s.spawn(move || {
                    let mut links = fabric.links(rank);
                    let count = 4 + rank;
                    let mut run = run_on(
                        &mut links,
                        rank,
                        2,
                        fp(
                            Collective::Broadcast,
                            Algo::Tree,
                            DType::U8,
                            None,
                            Some(0),
                            count,
                        ),
                        Duration::from_secs(5),
                    );
                    tree::broadcast_tree(&mut run, &mut vec![0u8; count], 0)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The root learns it too, from rank 1's root check (`ROOT_CHECK_STEP`).
    for (me, peer) in [(1, 0), (0, 1)] {
        let e = results[me].as_ref().unwrap_err().to_string();
        assert!(
            e.contains(&format!("mismatch with rank {peer}"))
                && e.contains("count=4")
                && e.contains("count=5"),
            "rank {me}: {e}"
        );
    }
}

/// Ranks that disagree about the root, each believing it is the root, must not all send,
/// receive nothing and return their own buffers as the result: every rank names the
/// disagreement. 2 and 3 ranks, broadcast (tree and chain) and scatter.
#[test]
fn ranks_that_disagree_about_the_root_are_told_not_left_with_their_own_data() {
    for n in [2usize, 3] {
        for algo in [Algo::Tree, Algo::Chain, Algo::Linear] {
            let fabric = MemFabric::new(n);
            let results: Vec<Result<()>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..n)
                    .map(|rank| {
                        let fabric = &fabric;
                        s.spawn(move || {
                            let mut links = fabric.links(rank);
                            // Every rank names itself the root.
                            let root = rank;
                            let coll = if algo == Algo::Linear {
                                Collective::Scatter
                            } else {
                                Collective::Broadcast
                            };
                            let mut run = run_on(
                                &mut links,
                                rank,
                                n,
                                fp(coll, algo, DType::U8, None, Some(root), 4),
                                Duration::from_secs(5),
                            );
                            let mut buf = vec![rank as u8; 4];
                            match algo {
                                Algo::Tree => tree::broadcast_tree(&mut run, &mut buf, root),
                                Algo::Chain => tree::broadcast_chain(&mut run, &mut buf, root),
                                _ => {
                                    let input = vec![rank as u8; 4 * n];
                                    let segs: Vec<_> = (0..n).map(|p| p * 4..(p + 1) * 4).collect();
                                    basic::scatter_linear(&mut run, &input, &mut buf, &segs, root)
                                }
                            }
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (rank, r) in results.iter().enumerate() {
                match r {
                    Err(crate::base::error::Error::Mismatch { msg, .. }) => {
                        assert!(
                            msg.contains("root="),
                            "{n} ranks, {algo:?}, rank {rank}: {msg}"
                        )
                    }
                    other => panic!("{n} ranks, {algo:?}, rank {rank}: {other:?}"),
                }
            }
        }
    }
}

#[test]
fn a_missing_peer_fails_at_the_deadline() {
    let fabric = MemFabric::new(2);
    let mut links = fabric.links(1);
    let mut run = run_on(
        &mut links,
        1,
        2,
        fp(
            Collective::Broadcast,
            Algo::Tree,
            DType::U8,
            None,
            Some(0),
            4,
        ),
        Duration::from_millis(200),
    );
    let e = tree::broadcast_tree(&mut run, &mut [0u8; 4], 0).unwrap_err();
    assert!(e.is_timeout() && e.to_string().contains("[0]"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn all_reduce_any_world_count_dtype_op(n in 1usize..=17, count in 0usize..=4099, d in 0..DTYPES.len(), o in 0..OPS.len(), rd in any::<bool>(), seed in 0u64..1000) {
        let algo = if rd { Algo::RecursiveDoubling } else { Algo::Ring };
        all_reduce(n, algo, DTYPES[d], OPS[o], count, seed);
    }

    #[test]
    fn rooted_any_world_count_dtype_root(n in 1usize..=17, count in 0usize..=4099, d in 0..DTYPES.len(), o in 0..OPS.len(), root in 0usize..17, chain in any::<bool>(), seed in 0u64..1000) {
        let root = root % n;
        let algo = if chain { Algo::Chain } else { Algo::Tree };
        broadcast(n, algo, DTYPES[d], count, root, seed);
        reduce(n, algo, DTYPES[d], OPS[o], count, root, seed);
        let counts: Vec<usize> = (0..n).map(|r| (count / n + r) % 9).collect();
        gather_scatter(n, DTYPES[d], &counts, root, seed);
    }

    #[test]
    fn ring_phases_any_world(n in 1usize..=17, per_rank in 0usize..=300, d in 0..DTYPES.len(), o in 0..OPS.len(), in_place in any::<bool>(), seed in 0u64..1000) {
        reduce_scatter(n, DTYPES[d], OPS[o], per_rank, in_place, seed);
        let counts: Vec<usize> = (0..n).map(|r| (per_rank + r * 7) % 301).collect();
        all_gather(n, DTYPES[d], &counts, seed);
        all_to_all(n, DTYPES[d], seed);
    }
}

/// Rank `r`'s input of random, non-integer floats (as `dtype` bytes): sums of these depend on
/// the order they are added in, so equal bits mean the same expression.
fn random_floats(dtype: DType, r: usize, count: usize, seed: u64) -> Vec<u8> {
    let mut rng = crate::compress::SplitMix64::new(seed ^ (r as u64).wrapping_mul(0x9e37_79b9));
    let vals: Vec<f64> = (0..count)
        .map(|_| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)
        .map(|v| v * 1000.0)
        .collect();
    match dtype {
        DType::F32 => vals
            .iter()
            .flat_map(|&v| (v as f32).to_le_bytes())
            .collect(),
        DType::F64 => vals.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|&v| half::f16::from_f64(v).to_le_bytes())
            .collect(),
        DType::BF16 => vals
            .iter()
            .flat_map(|&v| half::bf16::from_f64(v).to_le_bytes())
            .collect(),
        d => input(d, ReduceOp::Sum, r, count, seed),
    }
}

/// The canonical expression, computed plainly: rank 0's vector, then each rank's in turn.
fn canonical_reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = vec![0u8; inputs[0].len()];
    let parts: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    crate::base::reduce::fold_in_order(dtype, op, &mut out, &parts);
    out
}

fn canonical_all_reduce(n: usize, dtype: DType, op: ReduceOp, count: usize, seed: u64) {
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| random_floats(dtype, r, count, seed))
        .collect();
    let want = canonical_reference(dtype, op, &inputs);
    let outs = world(
        n,
        fp(
            Collective::AllReduce,
            Algo::Canonical,
            dtype,
            Some(op),
            None,
            count,
        ),
        |run, r| {
            let mut buf = inputs[r].clone();
            super::canonical::all_reduce(run, &mut buf, dtype, op)?;
            Ok(buf)
        },
    );
    for (r, got) in outs.iter().enumerate() {
        assert!(
            got == &want,
            "canonical all_reduce {dtype} {op} count {count} on {n} ranks: rank {r} differs"
        );
    }
    // Any part of the vector reduced on its own (a bucket, a chunk) gives the same bits.
    if count > 2 {
        let (lo, hi) = (count / 3, count - count / 5);
        let es = dtype.size();
        let part = world(
            n,
            fp(
                Collective::AllReduce,
                Algo::Canonical,
                dtype,
                Some(op),
                None,
                hi - lo,
            ),
            |run, r| {
                let mut buf = inputs[r][lo * es..hi * es].to_vec();
                super::canonical::all_reduce(run, &mut buf, dtype, op)?;
                Ok(buf)
            },
        );
        assert!(
            part[0][..] == want[lo * es..hi * es],
            "a sub-range of {count} reduced alone differs"
        );
    }
}

#[test]
fn canonical_schedules_give_the_rank_order_expression() {
    let big = super::canonical::GATHER_MAX / 4 + 333; // the reduce-scatter form
    for n in 1..=9 {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for count in [0, 1, 7, 1000, big] {
                canonical_all_reduce(n, dtype, ReduceOp::Sum, count, n as u64);
            }
        }
        canonical_all_reduce(n, DType::F32, ReduceOp::Prod, 50, 3);
        canonical_all_reduce(n, DType::BF16, ReduceOp::Max, 50, 3);
        canonical_all_reduce(n, DType::I32, ReduceOp::Sum, 4099, 3);
        // reduce-scatter and reduce fold the same parts.
        let count = 5 * n + 3;
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|r| random_floats(DType::F32, r, count, 9))
            .collect();
        let want = canonical_reference(DType::F32, ReduceOp::Sum, &inputs);
        let segs = even_segments(count, n, 4);
        let outs = world(
            n,
            fp(
                Collective::ReduceScatter,
                Algo::Canonical,
                DType::F32,
                Some(ReduceOp::Sum),
                None,
                count,
            ),
            |run, r| {
                let mut out = vec![0u8; segs[r].len()];
                super::canonical::reduce_scatter(
                    run,
                    &inputs[r],
                    &mut out,
                    &segs,
                    DType::F32,
                    ReduceOp::Sum,
                )?;
                Ok(out)
            },
        );
        for (r, got) in outs.iter().enumerate() {
            assert!(
                got[..] == want[segs[r].clone()],
                "canonical reduce_scatter on {n} ranks: rank {r}"
            );
        }
        let root = n / 2;
        let outs = world(
            n,
            fp(
                Collective::Reduce,
                Algo::Canonical,
                DType::F32,
                Some(ReduceOp::Sum),
                Some(root),
                count,
            ),
            |run, r| {
                let mut out = vec![0u8; if r == root { want.len() } else { 0 }];
                super::canonical::reduce(
                    run,
                    &inputs[r],
                    &mut out,
                    DType::F32,
                    ReduceOp::Sum,
                    root,
                )?;
                Ok(out)
            },
        );
        assert!(outs[root] == want, "canonical reduce on {n} ranks");
    }
}

#[test]
fn the_default_schedules_do_depend_on_the_order() {
    // The reason for the canonical mode: ring and recursive doubling, both correct, round
    // differently on non-integer floats (if this ever stops failing to differ, the
    // canonical tests above prove less).
    let (n, count) = (5, 4099);
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| random_floats(DType::F32, r, count, 1))
        .collect();
    let run_with = |algo: Algo| {
        world(
            n,
            fp(
                Collective::AllReduce,
                algo,
                DType::F32,
                Some(ReduceOp::Sum),
                None,
                count,
            ),
            |run, r| {
                let mut buf = inputs[r].clone();
                match algo {
                    Algo::Ring => ring::all_reduce(
                        run,
                        None,
                        &mut buf,
                        &even_segments(count, n, 4),
                        DType::F32,
                        ReduceOp::Sum,
                    )?,
                    _ => basic::all_reduce_rd(run, &mut buf, DType::F32, ReduceOp::Sum)?,
                }
                Ok(buf)
            },
        )
        .swap_remove(0)
    };
    assert_ne!(run_with(Algo::Ring), run_with(Algo::RecursiveDoubling));
}

/// The hosts' chain of the canonical hierarchical all-reduce on `hosts` hosts of `local`
/// ranks each: host `h`'s parts are ranks `h·local..(h+1)·local`'s vectors; every host must
/// end with the rank-order fold of all of them.
fn host_chain(hosts: usize, local: usize, dtype: DType, op: ReduceOp, count: usize, seed: u64) {
    let n = hosts * local;
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| random_floats(dtype, r, count, seed))
        .collect();
    let want = canonical_reference(dtype, op, &inputs);
    let outs = world(
        hosts,
        fp(
            Collective::AllReduce,
            Algo::Hierarchical,
            dtype,
            Some(op),
            None,
            count,
        ),
        |run, h| {
            let parts: Vec<&[u8]> = inputs[h * local..(h + 1) * local]
                .iter()
                .map(Vec::as_slice)
                .collect();
            let mut out = vec![0u8; count * dtype.size()];
            super::canonical::host_chain(run, &parts, &mut out, dtype, op)?;
            Ok(out)
        },
    );
    for (h, got) in outs.iter().enumerate() {
        assert!(
            got == &want,
            "host chain {dtype} {op} count {count}, {hosts} hosts x {local}: host {h} differs"
        );
    }
}

#[test]
fn the_hosts_chain_gives_the_rank_order_expression() {
    // 1 to 6 hosts of 1 to 3 ranks; counts from none to several chunks of the chain (a short
    // last one), so that forward and backward chunks cross in the middle hosts.
    let per_chunk = super::canonical::CHAIN_CHUNK / 4;
    for hosts in 1..=6 {
        for local in 1..=3 {
            for count in [0, 1, 999, 2 * per_chunk + 17] {
                host_chain(hosts, local, DType::F32, ReduceOp::Sum, count, hosts as u64);
            }
        }
        host_chain(hosts, 2, DType::BF16, ReduceOp::Sum, per_chunk + 5, 2);
        host_chain(hosts, 2, DType::F16, ReduceOp::Max, 3 * per_chunk, 3);
        host_chain(hosts, 3, DType::F64, ReduceOp::Prod, 300, 4);
    }
}
