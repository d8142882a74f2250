//! Deterministic mode (`set_deterministic(true)`, `HCOMM_DETERMINISTIC=1`) on real
//! communicators: all-reduce, reduce-scatter and reduce give bitwise the rank-order fold of
//! the inputs (random, non-integer floats), whatever the transport (shared memory, TCP, TCP
//! with 2 sockets per peer), the message size (both canonical schedules), the host layout
//! (one host, or two simulated hosts where the default would be hierarchical), and the bucket
//! caps of a fused all-reduce.

use half::bf16;
use hcomm::config::TransportKind;
use hcomm::fusion::{Fusion, FusionOptions};
use hcomm::testing::{expect_all, run_threads_configured, run_threads_on_hosts};
use hcomm::{Algo, BootstrapConfig, Collective, Communicator, ReduceOp};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn random(rank: usize, count: usize, seed: u64) -> Vec<f32> {
    let mut rng =
        hcomm::compress::SplitMix64::new(seed ^ ((rank as u64 + 1) * 0x9e37_79b9_7f4a_7c15));
    (0..count)
        .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1000.0)
        .collect()
}

/// The canonical expression: rank 0's element, plus rank 1's, plus …, in f32.
fn rank_order_sum(n: usize, count: usize, seed: u64) -> Vec<f32> {
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| random(r, count, seed)).collect();
    (0..count)
        .map(|i| inputs[1..].iter().fold(inputs[0][i], |acc, x| acc + x[i]))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What every deterministic reduction gives on `c`, for the sizes of both schedules.
fn reductions(c: &Communicator, seed: u64) -> hcomm::Result<Vec<Vec<u32>>> {
    c.set_deterministic(true);
    let (n, r) = (c.world_size(), c.rank());
    let mut out = Vec::new();
    for count in [1, 1000, 300_001] {
        let want = if c.has_shared_memory() {
            Algo::Shm
        } else {
            Algo::Canonical
        };
        assert_eq!(c.algorithm_for(Collective::AllReduce, count * 4), want);
        let mut buf = random(r, count, seed);
        c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
        out.push(bits(&buf));
    }
    let per = 777;
    let send = random(r, per * n, seed + 1);
    let mut mine = vec![0f32; per];
    c.reduce_scatter(&send, &mut mine, ReduceOp::Sum)?;
    out.push(bits(&mine));
    let send = random(r, 5000, seed + 2);
    let mut root_out = vec![0f32; if r == n - 1 { 5000 } else { 0 }];
    c.reduce(&send, &mut root_out, ReduceOp::Sum, n - 1)?;
    out.push(bits(&root_out));
    Ok(out)
}

fn expected(n: usize, r: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut want: Vec<Vec<u32>> = [1, 1000, 300_001]
        .iter()
        .map(|&count| bits(&rank_order_sum(n, count, seed)))
        .collect();
    let per = 777;
    want.push(bits(
        &rank_order_sum(n, per * n, seed + 1)[r * per..(r + 1) * per],
    ));
    want.push(if r == n - 1 {
        bits(&rank_order_sum(n, 5000, seed + 2))
    } else {
        Vec::new()
    });
    want
}

#[test]
fn every_transport_gives_the_rank_order_bits() {
    for n in [2, 3, 4] {
        for (name, transport, nsocks) in [
            ("shared memory", TransportKind::Auto, 1),
            ("tcp", TransportKind::Tcp, 1),
            ("tcp, 2 sockets", TransportKind::Tcp, 2),
        ] {
            let got = expect_all(run_threads_configured(
                n,
                T,
                |cfg| BootstrapConfig {
                    transport,
                    nsocks,
                    ..cfg
                },
                |c| reductions(&c, 7),
            ));
            for (r, g) in got.iter().enumerate() {
                assert!(
                    *g == expected(n, r, 7),
                    "{name}, {n} ranks: rank {r} differs from the rank-order fold"
                );
            }
        }
    }
}

#[test]
fn the_default_mode_differs_where_the_deterministic_one_does_not() {
    // Shows the test above can fail: without the mode, shared memory and TCP (different
    // schedules) disagree on some bits of a large non-integer sum on 3 ranks.
    let run = |transport| {
        expect_all(run_threads_configured(
            3,
            T,
            |cfg| BootstrapConfig { transport, ..cfg },
            |c| {
                let mut buf = random(c.rank(), 300_001, 7);
                c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
                Ok(bits(&buf))
            },
        ))
        .swap_remove(0)
    };
    let want = bits(&rank_order_sum(3, 300_001, 7));
    let (shm, tcp) = (run(TransportKind::Auto), run(TransportKind::Tcp));
    assert!(
        shm != want || tcp != want,
        "both default schedules happened to fold in rank order"
    );
}

#[test]
fn two_hosts_of_two_give_the_bits_of_one_host_of_four() {
    // 3 MiB: the default would be hierarchical on this layout.
    let count = 3 << 18;
    let got = expect_all(run_threads_on_hosts(&["a", "a", "b", "b"], T, |c| {
        assert_eq!(
            c.algorithm_for(Collective::AllReduce, count * 4),
            Algo::Hierarchical
        );
        c.set_deterministic(true);
        let mut buf = random(c.rank(), count, 11);
        c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
        Ok(bits(&buf))
    }));
    let want = bits(&rank_order_sum(4, count, 11));
    assert!(
        got.iter().all(|g| *g == want),
        "hierarchical layout changed bits"
    );
}

#[test]
fn bucket_caps_change_no_bit() {
    // 40 tensors of odd sizes fused with caps of 64 KiB, 1 MiB and 25 MiB: every tensor comes
    // out with the same bits, equal to its own rank-order fold.
    let sizes: Vec<usize> = (0..40).map(|k| 1000 + k * 997).collect();
    let per_cap = |cap: usize| {
        expect_all(run_threads_configured(
            3,
            T,
            |cfg| cfg,
            |c| {
                c.set_deterministic(true);
                let c = Arc::new(c);
                let fusion = Fusion::new(
                    &c,
                    ReduceOp::Sum,
                    FusionOptions {
                        cap_bytes: cap,
                        first_bucket_bytes: cap,
                        ..FusionOptions::default()
                    },
                );
                let mut tensors: Vec<Vec<f32>> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, &s)| random(c.rank(), s, 100 + k as u64))
                    .collect();
                fusion.step(|b| {
                    for t in tensors.iter_mut().rev() {
                        b.push(t)?;
                    }
                    b.flush();
                    Ok(())
                })?;
                Ok(tensors.iter().map(|t| bits(t)).collect::<Vec<_>>())
            },
        ))
        .swap_remove(0)
    };
    let want: Vec<Vec<u32>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &s)| bits(&rank_order_sum(3, s, 100 + k as u64)))
        .collect();
    for cap in [64 << 10, 1 << 20, 25 << 20] {
        assert!(per_cap(cap) == want, "bucket cap {cap} changed bits");
    }
}

/// Rank 0 contributes 2^11 (f16, whose step there is 2) or 2^8 (bf16, the same), the others
/// 1: on 4 ranks the exact sum 2^k + 3 rounds (to even) to 2^k + 4 when rounded once, while
/// a fold that rounds after each addition starting from rank 0 stays at 2^k (2^k + 1 rounds
/// down to 2^k each time), and recursive doubling gives 2^k + 2.
fn f16_value(rank: usize) -> f32 {
    if rank == 0 {
        2048.0
    } else {
        1.0
    }
}

fn bf16_value(rank: usize) -> f32 {
    if rank == 0 {
        256.0
    } else {
        1.0
    }
}

#[test]
fn half_floats_are_accumulated_in_f32() {
    use half::f16;
    for transport in [TransportKind::Auto, TransportKind::Tcp] {
        // 10 elements (one-shot schedules) and 100,000 (the chunked and reduce-scatter ones).
        for count in [10, 100_000] {
            let got = expect_all(run_threads_configured(
                4,
                T,
                |cfg| BootstrapConfig { transport, ..cfg },
                |c| {
                    c.set_deterministic(true);
                    let mut h = vec![f16::from_f32(f16_value(c.rank())); count];
                    c.all_reduce_in_place(&mut h, ReduceOp::Sum)?;
                    let mut b = vec![bf16::from_f32(bf16_value(c.rank())); count];
                    c.all_reduce_in_place(&mut b, ReduceOp::Sum)?;
                    Ok((h, b))
                },
            ));
            for (h, b) in got {
                assert!(
                    h.iter().all(|x| x.to_f32() == 2052.0),
                    "f16, {transport:?}, {count}: {:?}",
                    &h[..4]
                );
                assert!(
                    b.iter().all(|x| x.to_f32() == 260.0),
                    "bf16, {transport:?}, {count}: {:?}",
                    &b[..4]
                );
            }
        }
    }
}

/// The mean of f16/bf16 accumulated in f32 is the f32 sum divided in f32 and rounded once:
/// rounding the sum first overflowed (`[60000] * 3` gave infinity) and rounded twice
/// (`[2104, 821, 66]` gave 997.5 for 997), found by a randomized campaign (2026-12-08). All
/// three reductions, both settings that accumulate in f32, shared memory and TCP, one host and
/// three hosts (the hierarchical and skip-zero paths need more than one).
#[test]
fn a_mean_of_halves_accumulated_in_f32_is_rounded_once() {
    use half::f16;
    for hosts in [&["a", "a", "a"][..], &["a", "b", "c"]] {
        for transport in [TransportKind::Auto, TransportKind::Tcp] {
            for deterministic in [false, true] {
                let got = expect_all(hcomm::testing::run_threads_on_hosts_configured(
                    hosts,
                    T,
                    |cfg| BootstrapConfig { transport, ..cfg },
                    |c| {
                        if deterministic {
                            c.set_deterministic(true);
                        } else {
                            c.set_accumulate_f32(true);
                        }
                        let r = c.rank();
                        let big = f16::from_f32(60000.0);
                        let odd = f16::from_f32([2104.0, 821.0, 66.0][r]);
                        // 100,000 elements: the chunked schedules, and skip-zero's blocks.
                        let mut h = vec![big; 100_000];
                        h[1] = odd;
                        c.all_reduce_in_place(&mut h, ReduceOp::Mean)?;
                        let mut z = vec![f16::ZERO; 100_000];
                        z[7] = odd;
                        c.all_reduce_skipping_zeros(&mut z, ReduceOp::Mean)?;
                        let send = vec![odd; 6];
                        let mut rs = vec![f16::ZERO; 2];
                        c.reduce_scatter(&send, &mut rs, ReduceOp::Mean)?;
                        let mut red = vec![f16::ZERO; 6];
                        c.reduce(&send, &mut red, ReduceOp::Mean, 0)?;
                        let b = [256.0f32, 1.0, 1.0][r];
                        let mut bv = vec![bf16::from_f32(b); 3];
                        c.all_reduce_in_place(&mut bv, ReduceOp::Mean)?;
                        Ok((h, z[7], rs, (r == 0).then_some(red), bv))
                    },
                ));
                let ctx = format!("{hosts:?}, {transport:?}, deterministic {deterministic}");
                for (h, z, rs, red, bv) in got {
                    assert_eq!(h[0].to_f32(), 60000.0, "{ctx}: mean of 60000s");
                    assert_eq!(h[1].to_f32(), 997.0, "{ctx}: all_reduce");
                    assert_eq!(z.to_f32(), 997.0, "{ctx}: skipping zeros");
                    assert!(rs.iter().all(|x| x.to_f32() == 997.0), "{ctx}: {rs:?}");
                    if let Some(red) = red {
                        assert!(red.iter().all(|x| x.to_f32() == 997.0), "{ctx}: {red:?}");
                    }
                    // 258 / 3 = 86 exactly; bf16's 258 rounds to 258 (step 2), so this one
                    // only checks bf16 takes the path at all.
                    assert!(bv.iter().all(|x| x.to_f32() == 86.0), "{ctx}: {bv:?}");
                }
            }
        }
    }
}

/// One all-reduce of `count` halves (every rank contributes `rank_value(rank)`) with `algo`
/// forced and f32 accumulation `on` or off; rank 0's result as f32.
fn half_sum<H: hcomm::Element + Copy>(
    transport: TransportKind,
    algo: Algo,
    on: bool,
    count: usize,
    to_half: fn(f32) -> H,
    rank_value: fn(usize) -> f32,
) -> Vec<H> {
    expect_all(run_threads_configured(
        4,
        T,
        |cfg| BootstrapConfig { transport, ..cfg },
        |c| {
            c.set_accumulate_f32(on);
            assert_eq!(c.accumulates_f32(), on);
            if c.has_shared_memory() || algo != Algo::Shm {
                c.set_algorithm(Collective::AllReduce, algo)?;
            }
            let mut buf = vec![to_half(rank_value(c.rank())); count];
            c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            Ok(buf)
        },
    ))
    .swap_remove(0)
}

#[test]
fn accumulate_f32_rounds_half_sums_once_whatever_the_algorithm() {
    use half::f16;
    for (transport, algos) in [
        (TransportKind::Auto, &[Algo::Shm][..]),
        (
            TransportKind::Tcp,
            &[Algo::Ring, Algo::RecursiveDoubling, Algo::Auto][..],
        ),
    ] {
        for &algo in algos {
            for count in [1, 7, 100_000] {
                let got = half_sum(transport, algo, true, count, f16::from_f32, f16_value);
                assert!(
                    got.iter().all(|x| x.to_f32() == 2052.0),
                    "f16, {transport:?}, {algo:?}, {count}: {:?}",
                    &got[..1]
                );
                let got = half_sum(transport, algo, true, count, bf16::from_f32, bf16_value);
                assert!(
                    got.iter().all(|x| x.to_f32() == 260.0),
                    "bf16, {transport:?}, {algo:?}, {count}: {:?}",
                    &got[..1]
                );
            }
        }
    }
    // Without it the ring and recursive doubling round at every step (so the checks above
    // can fail): some elements, or all, come out otherwise.
    for algo in [Algo::Ring, Algo::RecursiveDoubling] {
        let h = half_sum(TransportKind::Tcp, algo, false, 7, f16::from_f32, f16_value);
        assert!(
            h.iter().any(|x| x.to_f32() != 2052.0),
            "f16 {algo:?}: {h:?}"
        );
        let b = half_sum(
            TransportKind::Tcp,
            algo,
            false,
            7,
            bf16::from_f32,
            bf16_value,
        );
        assert!(
            b.iter().any(|x| x.to_f32() != 260.0),
            "bf16 {algo:?}: {b:?}"
        );
    }
}

#[test]
fn accumulate_f32_changes_the_algorithm_of_halves_only() {
    expect_all(run_threads_configured(
        2,
        T,
        |cfg| BootstrapConfig {
            transport: TransportKind::Tcp,
            ..cfg
        },
        |c| {
            let ar = Collective::AllReduce;
            assert_eq!(
                c.algorithm_for_dtype(ar, 64, hcomm::DType::BF16),
                Algo::RecursiveDoubling
            );
            c.set_accumulate_f32(true);
            for d in [hcomm::DType::F16, hcomm::DType::BF16] {
                assert_eq!(c.algorithm_for_dtype(ar, 64, d), Algo::Canonical);
                assert_eq!(c.algorithm_for_dtype(ar, 64 << 20, d), Algo::Canonical);
            }
            for d in [hcomm::DType::F32, hcomm::DType::F64, hcomm::DType::I32] {
                assert_eq!(c.algorithm_for_dtype(ar, 64, d), Algo::RecursiveDoubling);
                assert_eq!(c.algorithm_for_dtype(ar, 64 << 20, d), Algo::Ring);
            }
            // f32 data still takes the fast path, and a sub-communicator inherits the setting
            let mut v = vec![1.5f32; 9];
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            assert!(v.iter().all(|&x| x == 3.0));
            let sub = c.new_group(&[1, 0])?;
            assert!(sub.accumulates_f32());
            Ok(())
        },
    ));
}

#[test]
fn ranks_that_disagree_on_accumulate_f32_fail_as_a_mismatch() {
    use half::f16;
    for transport in [TransportKind::Auto, TransportKind::Tcp] {
        let res = run_threads_configured(
            2,
            Duration::from_secs(10),
            |cfg| BootstrapConfig { transport, ..cfg },
            |c| {
                c.set_accumulate_f32(c.rank() == 0);
                let mut buf = vec![f16::from_f32(1.0); 5];
                c.all_reduce_in_place(&mut buf, ReduceOp::Sum)
            },
        );
        for (r, res) in res.into_iter().enumerate() {
            match res {
                Err(hcomm::Error::Mismatch { .. }) => {}
                other => panic!("{transport:?}: rank {r}: {other:?}, expected a mismatch"),
            }
        }
    }
}

#[test]
fn sparse_all_reduce_gives_the_bits_of_the_deterministic_dense_one() {
    // The sparse all-reduce sums the gathered rows in rank order (each rank's repeats in the
    // order it gave them), so every row it returns is the canonical rank-order fold of the
    // ranks' dense rows: bitwise what the deterministic dense all-reduce of the tables gives.
    const ROWS: usize = 40;
    const LEN: usize = 6;
    for n in [2, 3, 4] {
        for transport in [TransportKind::Auto, TransportKind::Tcp] {
            expect_all(run_threads_configured(
                n,
                T,
                |cfg| BootstrapConfig { transport, ..cfg },
                |c| {
                    let r = c.rank();
                    // rank-dependent rows with repeats (rank 1 has none at 3 ranks and more)
                    let idx: Vec<i64> = if r == 1 && n >= 3 {
                        vec![]
                    } else {
                        (0..(9 + 4 * r))
                            .map(|k| ((k * (r + 2) + 3 * r) % ROWS) as i64)
                            .collect()
                    };
                    let vals = random(r, idx.len() * LEN, 41);
                    let rows = c.sparse_all_reduce(&idx, &vals, LEN, ReduceOp::Sum)?;
                    let mut table = vec![0f32; ROWS * LEN];
                    for (k, &i) in idx.iter().enumerate() {
                        for j in 0..LEN {
                            table[i as usize * LEN + j] += vals[k * LEN + j];
                        }
                    }
                    c.set_deterministic(true);
                    c.all_reduce_in_place(&mut table, ReduceOp::Sum)?;
                    assert!(!rows.indices.is_empty());
                    for (k, &i) in rows.indices.iter().enumerate() {
                        let want = &table[i as usize * LEN..][..LEN];
                        let got = &rows.values[k * LEN..][..LEN];
                        assert_eq!(
                            bits(got),
                            bits(want),
                            "{n} ranks, {transport:?}, rank {r}: row {i}"
                        );
                    }
                    Ok(())
                },
            ));
        }
    }
}

/// A rank's tensor for the skip-zero test: `blocks` blocks of 1 KiB worth of `H`, the last
/// one 3 elements short, non-zero (random, non-integer) only in the blocks `pick(rank, block)`
/// chooses; rank 1's first chosen block holds only `-0.0`s (not zero bits, so it travels).
fn blocky<H: Copy>(
    rank: usize,
    blocks: usize,
    pick: fn(usize, usize) -> bool,
    to: fn(f32) -> H,
) -> Vec<H> {
    let per = 1024 / std::mem::size_of::<H>();
    let noise = random(rank, blocks * per, 61);
    let negative_zeros = (0..blocks).find(|&b| pick(1, b)).filter(|_| rank == 1);
    (0..blocks * per - 3)
        .map(|i| match i / per {
            b if !pick(rank, b) => to(0.0),
            b if Some(b) == negative_zeros => to(-0.0),
            _ => to(noise[i] / 7.0),
        })
        .collect()
}

/// The canonical fold of every rank's `blocky` tensor, computed sequentially: rank 0's element
/// widened to f32, plus rank 1's, … (f32 throughout), rounded to `H` once.
fn blocky_reference<H: Copy>(
    n: usize,
    blocks: usize,
    pick: fn(usize, usize) -> bool,
    to: fn(f32) -> H,
    from: fn(H) -> f32,
) -> Vec<H> {
    let inputs: Vec<Vec<H>> = (0..n).map(|r| blocky(r, blocks, pick, to)).collect();
    (0..inputs[0].len())
        .map(|i| {
            to(inputs[1..]
                .iter()
                .fold(from(inputs[0][i]), |acc, x| acc + from(x[i])))
        })
        .collect()
}

/// Bytes of a typed slice, for bitwise comparisons.
fn raw<H: bytemuck::Pod>(v: &[H]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// What one rank saw in [`skip_zero_case`]: whether the sparse path ran, its sum's bytes, the
/// Mean of the same tensors through skip-zero, the Mean through the dense all-reduce.
type SkipZeroSeen = (bool, Vec<u8>, Vec<u8>, Vec<u8>);

/// Skip-zero all-reduce of `blocky` tensors of `H` in deterministic mode, on every rank.
fn skip_zero_case<H: hcomm::Element + bytemuck::Pod>(
    n: usize,
    transport: TransportKind,
    blocks: usize,
    pick: fn(usize, usize) -> bool,
    to: fn(f32) -> H,
) -> Vec<SkipZeroSeen> {
    expect_all(run_threads_configured(
        n,
        T,
        |cfg| BootstrapConfig { transport, ..cfg },
        |c| {
            c.set_deterministic(true);
            let mut sum = blocky(c.rank(), blocks, pick, to);
            let sparse = c.all_reduce_skipping_zeros(&mut sum, ReduceOp::Sum)?;
            let mut mean = blocky(c.rank(), blocks, pick, to);
            c.all_reduce_skipping_zeros(&mut mean, ReduceOp::Mean)?;
            let mut dense_mean = blocky(c.rank(), blocks, pick, to);
            c.all_reduce_in_place(&mut dense_mean, ReduceOp::Mean)?;
            Ok((sparse, raw(&sum), raw(&mean), raw(&dense_mean)))
        },
    ))
}

#[test]
fn skipping_zeros_gives_the_rank_order_bits_on_either_path() {
    // 100 blocks (the last one short); "few": each rank fills 11 blocks, overlapping with its
    // neighbour's, so the sparse path runs; "all": every block is
    // non-zero on every rank, so the dense (canonical) all-reduce runs. Both must give the
    // sequential rank-order fold, f16/bf16 widened to f32 and rounded once.
    fn few(rank: usize, b: usize) -> bool {
        b % 20 == rank || b % 20 == rank + 1 || b == 99
    }
    fn all(_: usize, _: usize) -> bool {
        true
    }
    use half::f16;
    for n in [2, 3, 4] {
        for transport in [TransportKind::Auto, TransportKind::Tcp] {
            for (name, pick, want_sparse) in [
                ("few", few as fn(usize, usize) -> bool, true),
                ("all", all, false),
            ] {
                let ctx = format!("{n} ranks, {transport:?}, {name} non-zero blocks");
                let check = |got: Vec<SkipZeroSeen>, want: Vec<u8>, ty| {
                    for (r, (sparse, sum, mean, dense_mean)) in got.into_iter().enumerate() {
                        assert_eq!(sparse, want_sparse, "{ctx}, {ty}: path");
                        assert!(
                            sum == want,
                            "{ctx}, {ty}, rank {r}: sum differs from the fold"
                        );
                        assert!(mean == dense_mean, "{ctx}, {ty}, rank {r}: mean differs");
                    }
                };
                check(
                    skip_zero_case(n, transport, 100, pick, |x| x),
                    raw(&blocky_reference(n, 100, pick, |x| x, |x| x)),
                    "f32",
                );
                check(
                    skip_zero_case(n, transport, 100, pick, f16::from_f32),
                    raw(&blocky_reference(n, 100, pick, f16::from_f32, f16::to_f32)),
                    "f16",
                );
                check(
                    skip_zero_case(n, transport, 100, pick, bf16::from_f32),
                    raw(&blocky_reference(
                        n,
                        100,
                        pick,
                        bf16::from_f32,
                        bf16::to_f32,
                    )),
                    "bf16",
                );
            }
        }
    }
}

#[test]
fn sparse_half_rows_are_accumulated_in_f32() {
    // 4 ranks, every rank has rows 0..8; row values f16_value(rank) (2048 on rank 0, 1
    // elsewhere): the widened fold gives 2052, a step-wise f16 fold 2048; and random rows give
    // bitwise the deterministic dense all-reduce of the tables.
    use half::f16;
    const ROWS: usize = 8;
    const LEN: usize = 5;
    for transport in [TransportKind::Auto, TransportKind::Tcp] {
        expect_all(run_threads_configured(
            4,
            T,
            |cfg| BootstrapConfig { transport, ..cfg },
            |c| {
                let idx: Vec<i64> = (0..ROWS as i64).collect();
                let vals = vec![f16::from_f32(f16_value(c.rank())); ROWS * LEN];
                let rows = c.sparse_all_reduce(&idx, &vals, LEN, ReduceOp::Sum)?;
                assert!(
                    rows.values.iter().all(|x| x.to_f32() == 2052.0),
                    "{transport:?}"
                );
                // Rank 2 lacks the odd rows.
                let idx: Vec<i64> = (0..ROWS as i64)
                    .filter(|i| c.rank() != 2 || i % 2 == 0)
                    .collect();
                let vals: Vec<f16> = random(c.rank(), idx.len() * LEN, 43)
                    .into_iter()
                    .map(f16::from_f32)
                    .collect();
                let rows = c.sparse_all_reduce(&idx, &vals, LEN, ReduceOp::Sum)?;
                let mut table = vec![f16::from_f32(0.0); ROWS * LEN];
                for (k, &i) in idx.iter().enumerate() {
                    table[i as usize * LEN..][..LEN].copy_from_slice(&vals[k * LEN..][..LEN]);
                }
                c.set_deterministic(true);
                c.all_reduce_in_place(&mut table, ReduceOp::Sum)?;
                assert_eq!(rows.indices, (0..ROWS as i64).collect::<Vec<_>>());
                assert_eq!(
                    raw(&rows.values),
                    raw(&table),
                    "{transport:?}, rank {}",
                    c.rank()
                );
                Ok(())
            },
        ));
    }
}

/// Every compressor's results over 3 steps (error feedback on) of random f32 gradients on 4
/// ranks laid out by `run`: rank 0's bits, per compressor and step.
fn compressed_bits(
    deterministic: bool,
    run: impl Fn(&(dyn Fn(Communicator) -> hcomm::Result<Vec<Vec<u32>>> + Sync)) -> Vec<Vec<Vec<u32>>>,
) -> Vec<Vec<u32>> {
    run(&|c: Communicator| {
        c.set_deterministic(deterministic);
        let mut out = Vec::new();
        for spec in COMPRESSORS {
            let mut state = hcomm::CompressionState::new(spec.parse().expect("a compressor"))?;
            for step in 0..3 {
                let mut grad = random(c.rank(), 10_001, 71 + step);
                c.all_reduce_compressed(&mut grad, ReduceOp::Sum, &mut state)?;
                out.push(bits(&grad));
            }
        }
        Ok(out)
    })
    .swap_remove(0)
}

const COMPRESSORS: [&str; 7] = [
    "fp16",
    "bf16",
    "int8:256",
    "int8sr:256",
    "sign:256",
    "topk:1%",
    "randk:2%:7",
];

#[test]
fn compressed_all_reduce_gives_the_same_bits_on_every_layout() {
    let flat = |transport| {
        move |f: &(dyn Fn(Communicator) -> hcomm::Result<Vec<Vec<u32>>> + Sync)| {
            expect_all(run_threads_configured(
                4,
                T,
                |cfg| BootstrapConfig { transport, ..cfg },
                f,
            ))
        }
    };
    let two_hosts = |f: &(dyn Fn(Communicator) -> hcomm::Result<Vec<Vec<u32>>> + Sync)| {
        expect_all(run_threads_on_hosts(&["a", "a", "b", "b"], T, f))
    };
    let shm = compressed_bits(true, flat(TransportKind::Auto));
    let tcp = compressed_bits(true, flat(TransportKind::Tcp));
    let hosts = compressed_bits(true, two_hosts);
    for (k, spec) in COMPRESSORS.iter().enumerate() {
        for step in 0..3 {
            let i = 3 * k + step;
            assert!(
                shm[i] == tcp[i],
                "{spec}, step {step}: shared memory and TCP differ"
            );
            assert!(
                shm[i] == hosts[i],
                "{spec}, step {step}: 2 hosts of 2 differ from 1 host"
            );
        }
    }
    // Without the mode, int8 and sign run hierarchically on 2 hosts of 2 (an exact host sum,
    // then compressed across hosts) and their bits differ: the check above can fail.
    let default_hosts = compressed_bits(false, two_hosts);
    let default_flat = compressed_bits(false, flat(TransportKind::Auto));
    assert!(
        default_hosts[6..9] != default_flat[6..9],
        "int8 gave the same bits hierarchically and flat"
    );
}

/// Where the property test's ranks run: `hosts` names each rank's host (ranks of one host
/// share memory unless `transport` is TCP), with `nsocks` sockets per TCP peer.
#[derive(Clone, Copy, Debug)]
struct Layout {
    hosts: &'static [&'static str],
    transport: TransportKind,
    nsocks: usize,
}

const LAYOUTS: &[Layout] = &[
    Layout {
        hosts: &["a"],
        transport: TransportKind::Auto,
        nsocks: 1,
    },
    Layout {
        hosts: &["a", "a"],
        transport: TransportKind::Auto,
        nsocks: 1,
    },
    Layout {
        hosts: &["a", "a", "a"],
        transport: TransportKind::Auto,
        nsocks: 1,
    },
    Layout {
        hosts: &["a", "a", "a", "a"],
        transport: TransportKind::Auto,
        nsocks: 1,
    },
    Layout {
        hosts: &["a", "a"],
        transport: TransportKind::Tcp,
        nsocks: 1,
    },
    Layout {
        hosts: &["a", "a", "a"],
        transport: TransportKind::Tcp,
        nsocks: 2,
    },
    Layout {
        hosts: &["a", "a", "a", "a"],
        transport: TransportKind::Tcp,
        nsocks: 1,
    },
    Layout {
        hosts: &["a", "a", "a", "a", "a"],
        transport: TransportKind::Tcp,
        nsocks: 3,
    },
    // Two hosts of two: the hierarchical layout (shared memory within, TCP across).
    Layout {
        hosts: &["a", "a", "b", "b"],
        transport: TransportKind::Auto,
        nsocks: 1,
    },
    // Hosts interleaved, and uneven hosts: no hierarchy, a mix of shared-memory and TCP links.
    Layout {
        hosts: &["a", "b", "a", "b"],
        transport: TransportKind::Auto,
        nsocks: 1,
    },
    Layout {
        hosts: &["a", "b", "b"],
        transport: TransportKind::Auto,
        nsocks: 2,
    },
];

const REDUCING: [Collective; 3] = [
    Collective::AllReduce,
    Collective::ReduceScatter,
    Collective::Reduce,
];
const FLOATS: [hcomm::DType; 4] = [
    hcomm::DType::F32,
    hcomm::DType::F64,
    hcomm::DType::F16,
    hcomm::DType::BF16,
];

/// One operation of the property test, as drawn: which collective, dtype and op, how many
/// elements, where the slice starts inside the generated vectors (`offset`: the same element
/// travels in another segment, chunk or stripe), which algorithm is forced (an index into the
/// collective's algorithms plus `Auto`), in place or not, and the root.
#[derive(Clone, Debug)]
struct Drawn {
    coll: usize,
    dtype: usize,
    op: usize,
    count: usize,
    offset: usize,
    algo: usize,
    in_place: bool,
    root: usize,
}

fn drawn() -> impl proptest::strategy::Strategy<Value = Drawn> {
    use proptest::prelude::*;
    // Mostly below the small schedule's limit (64 KiB), some across it, a few large
    // (several segments per rank, striped over the sockets).
    let count = prop_oneof![
        6 => 0usize..3000,
        3 => 3000usize..40_000,
        1 => 40_000usize..400_000,
    ];
    (
        0..3usize,
        0..4usize,
        0..5usize,
        count,
        0..9usize,
        0..8usize,
        any::<bool>(),
        0..8usize,
    )
        .prop_map(
            |(coll, dtype, op, count, offset, algo, in_place, root)| Drawn {
                coll,
                dtype,
                op,
                count,
                offset,
                algo,
                in_place,
                root,
            },
        )
}

/// Run `d` in deterministic mode on `c`; the first difference from the canonical reference
/// (computed here, sequentially, from every rank's regenerated input), or `None`.
fn run_drawn(c: &Communicator, d: &Drawn, seed: u64) -> hcomm::Result<Option<String>> {
    use hcomm::testing::{canonical_reference, random_input};
    let (n, me) = (c.world_size(), c.rank());
    let coll = REDUCING[d.coll];
    let (dt, op) = (FLOATS[d.dtype], ReduceOp::ALL[d.op]);
    let es = dt.size();
    let algos: Vec<Algo> = std::iter::once(Algo::Auto)
        .chain(coll.algorithms().iter().copied())
        .collect();
    let algo = algos[d.algo % algos.len()];
    c.set_algorithm(coll, if c.supports(algo) { algo } else { Algo::Auto })?;
    // `whole` elements per rank are generated; the operation takes `count` of them from
    // `offset` on (all-reduce and reduce), or `count` per rank from `offset * n` on
    // (reduce-scatter).
    let per = if coll == Collective::ReduceScatter {
        n
    } else {
        1
    };
    let (from, len) = (d.offset * per, d.count * per);
    let whole = from + len + 3;
    let mine = &random_input(dt, op, me, whole, seed)[from * es..(from + len) * es];
    let want_all = &canonical_reference(dt, op, n, whole, seed)[from * es..(from + len) * es];
    let (got, want) = match coll {
        Collective::AllReduce => {
            let mut out = mine.to_vec();
            if d.in_place {
                c.all_reduce_bytes(None, &mut out, dt, op)?;
            } else {
                c.all_reduce_bytes(Some(mine), &mut out, dt, op)?;
            }
            (out, want_all.to_vec())
        }
        Collective::ReduceScatter => {
            let block = d.count * es;
            let want = want_all[me * block..(me + 1) * block].to_vec();
            let counts = vec![d.count; n];
            if d.in_place {
                let mut buf = mine.to_vec();
                c.reduce_scatter_v_bytes(None, &mut buf, &counts, dt, op)?;
                (buf[me * block..(me + 1) * block].to_vec(), want)
            } else {
                let mut out = vec![0u8; block];
                c.reduce_scatter_v_bytes(Some(mine), &mut out, &counts, dt, op)?;
                (out, want)
            }
        }
        _ => {
            let root = d.root % n;
            let mut out = if d.in_place {
                mine.to_vec()
            } else {
                vec![0u8; if me == root { mine.len() } else { 0 }]
            };
            if d.in_place {
                c.reduce_bytes(None, &mut out, dt, op, root)?;
            } else {
                c.reduce_bytes(Some(mine), &mut out, dt, op, root)?;
            }
            if me != root {
                return Ok(None);
            }
            (out, want_all.to_vec())
        }
    };
    let wrong = (0..got.len() / es.max(1))
        .filter(|&i| got[i * es..(i + 1) * es] != want[i * es..(i + 1) * es])
        .count();
    Ok((wrong > 0 || got.len() != want.len()).then(|| {
        format!(
            "{} {dt} {op} count {} offset {} algo {algo} in_place {}: {wrong} of {} elements differ from the rank-order fold",
            coll.name(),
            d.count,
            d.offset,
            d.in_place,
            want.len() / es.max(1)
        )
    }))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 16, ..Default::default() })]

    /// The property: random non-integer floats (f32, f64, f16, bf16), every reducing
    /// collective and op, any forced algorithm, sizes on both sides of the schedules' limits,
    /// offsets into the vectors, in place or not, on one host (shared memory), over TCP with
    /// 1-3 sockets per peer, on two hosts of two (hierarchical) and on mixed layouts: every
    /// result is bitwise the plain sequential rank-order fold.
    #[test]
    fn any_layout_algorithm_size_and_offset_gives_the_rank_order_fold(
        layout in 0..LAYOUTS.len(),
        ops in proptest::collection::vec(drawn(), 1..6),
        seed in 0u64..1_000_000,
    ) {
        let l = LAYOUTS[layout];
        let results = hcomm::testing::run_threads_on_hosts_configured(
            l.hosts,
            T,
            |cfg| BootstrapConfig { transport: l.transport, nsocks: l.nsocks, ..cfg },
            |c| {
                c.set_deterministic(true);
                let mut wrong = Vec::new();
                for (k, d) in ops.iter().enumerate() {
                    if let Some(m) = run_drawn(&c, d, seed + k as u64)? {
                        wrong.push(m);
                    }
                }
                Ok(wrong)
            },
        );
        for (r, w) in expect_all(results).into_iter().enumerate() {
            proptest::prop_assert!(w.is_empty(), "{l:?}, rank {r}: {w:?}");
        }
    }
}

#[test]
fn f32_accumulation_of_halves_is_closer_to_the_exact_sum() {
    // Random non-integer f16 and bf16 on 4 ranks over TCP (ring and recursive doubling round
    // at every step): with HCOMM_ACCUMULATE=f32 every element is the half nearest to the f32
    // fold (so within half an ulp of the exact sum, up to the f32 fold's own error), and the
    // total error over the vector is smaller than the step-wise rounding's.
    use hcomm::testing::random_input;
    let n = 4;
    for dt in [hcomm::DType::F16, hcomm::DType::BF16] {
        let count = 20_000;
        let to_f64 = |b: &[u8]| -> Vec<f64> {
            b.chunks(2)
                .map(|h| {
                    let h = [h[0], h[1]];
                    if dt == hcomm::DType::F16 {
                        half::f16::from_le_bytes(h).to_f64()
                    } else {
                        bf16::from_le_bytes(h).to_f64()
                    }
                })
                .collect()
        };
        let inputs: Vec<Vec<f64>> = (0..n)
            .map(|r| to_f64(&random_input(dt, ReduceOp::Sum, r, count, 5)))
            .collect();
        let exact: Vec<f64> = (0..count)
            .map(|i| inputs.iter().map(|x| x[i]).sum())
            .collect();
        let error = |algo: Algo, widened: bool| -> f64 {
            let got = expect_all(run_threads_configured(
                n,
                T,
                |cfg| BootstrapConfig {
                    transport: TransportKind::Tcp,
                    ..cfg
                },
                |c| {
                    c.set_accumulate_f32(widened);
                    c.set_algorithm(Collective::AllReduce, algo)?;
                    let mut buf = random_input(dt, ReduceOp::Sum, c.rank(), count, 5);
                    c.all_reduce_bytes(None, &mut buf, dt, ReduceOp::Sum)?;
                    Ok(to_f64(&buf))
                },
            ))
            .swap_remove(0);
            got.iter().zip(&exact).map(|(g, e)| (g - e).abs()).sum()
        };
        let widened = error(Algo::Auto, true);
        for algo in [Algo::Ring, Algo::RecursiveDoubling] {
            let stepwise = error(algo, false);
            assert!(
                widened < stepwise,
                "{dt}: f32 accumulation's total error {widened} is not below {algo}'s {stepwise}"
            );
        }
    }
}

/// Deterministic all-reduces of `cases` (dtype, op, elements) of random non-integer floats on
/// ranks laid out on `hosts`, with f16/bf16 accumulated in f32 instead of the whole mode when
/// `accumulate_only`: what differs from the rank-order fold, and the algorithm each ran.
fn on_hosts(
    hosts: &[&str],
    accumulate_only: bool,
    cases: &[(hcomm::DType, ReduceOp, usize)],
) -> Vec<(Vec<String>, Vec<Algo>)> {
    use hcomm::testing::{canonical_reference, random_input};
    let n = hosts.len();
    expect_all(run_threads_on_hosts(hosts, T, |c| {
        if accumulate_only {
            c.set_accumulate_f32(true);
        } else {
            c.set_deterministic(true);
        }
        let (mut wrong, mut algos) = (Vec::new(), Vec::new());
        for (k, &(dt, op, count)) in cases.iter().enumerate() {
            algos.push(c.algorithm_for_dtype(Collective::AllReduce, count * dt.size(), dt));
            let seed = 40 + k as u64;
            let mut buf = random_input(dt, op, c.rank(), count, seed);
            c.all_reduce_bytes(None, &mut buf, dt, op)?;
            if buf != canonical_reference(dt, op, n, count, seed) {
                wrong.push(format!("{dt} {op} {count}"));
            }
        }
        Ok((wrong, algos))
    }))
}

#[test]
fn the_canonical_hierarchical_all_reduce_gives_the_rank_order_fold() {
    // Hosts of consecutive ranks, from 2 MiB on: the chain of hosts (2 hosts, 3 hosts: a
    // middle one that passes both ways, 3 ranks per host), uneven segments, a short last
    // chunk of the chain, f16/bf16 carried forward in f32; and interleaved hosts, which keep
    // the flat schedule.
    use hcomm::DType::{BF16, F16, F32, F64};
    let cases = [
        (F32, ReduceOp::Sum, 600_001),
        (F64, ReduceOp::Mean, 300_007),
        (F16, ReduceOp::Sum, 1_100_003),
        (BF16, ReduceOp::Max, 1_048_583),
        (F32, ReduceOp::Prod, 524_288),
    ];
    for (hosts, want) in [
        (&["a", "a", "b", "b"][..], Algo::Hierarchical),
        (&["a", "a", "b", "b", "c", "c"][..], Algo::Hierarchical),
        (&["a", "a", "a", "b", "b", "b"][..], Algo::Hierarchical),
        (&["a", "b", "a", "b"][..], Algo::Canonical),
    ] {
        for (r, (wrong, algos)) in on_hosts(hosts, false, &cases).into_iter().enumerate() {
            assert!(wrong.is_empty(), "{hosts:?} rank {r}: {wrong:?}");
            assert!(algos.iter().all(|&a| a == want), "{hosts:?}: {algos:?}");
        }
    }
}

#[test]
fn accumulating_halves_in_f32_on_hosts_rounds_once() {
    // HCOMM_ACCUMULATE=f32 alone on 2 hosts x 2, 3 MiB of f16 and bf16: the canonical
    // hierarchical schedule. The hierarchical all-reduce used to be chosen here by the f32
    // rule and rounded each host's sum before adding the hosts (found 2026-12-05).
    use hcomm::DType::{BF16, F16};
    let cases = [
        (F16, ReduceOp::Sum, 1_572_864),
        (BF16, ReduceOp::Sum, 1_572_867),
    ];
    for (r, (wrong, algos)) in on_hosts(&["a", "a", "b", "b"], true, &cases)
        .into_iter()
        .enumerate()
    {
        assert!(wrong.is_empty(), "rank {r}: {wrong:?}");
        assert_eq!(algos, [Algo::Hierarchical; 2]);
    }
}
