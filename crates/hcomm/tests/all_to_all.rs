//! All-to-all(v) against a reference over TCP and shared memory (per-rank counts exchange
//! tables first, then go through the staging area like equal blocks): 1–4 ranks, equal blocks of every size class, counts that differ per rank and pair
//! (including empty blocks), and a block length the sender and receiver disagree on, which
//! must fail on every rank naming the pair.

use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::Error;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Element `i` of the block rank `from` sends to rank `to`.
fn value(from: usize, to: usize, i: usize) -> u32 {
    (from as u32) << 28 | (to as u32) << 24 | (i as u32 & 0xff_ffff)
}

fn check(transport: TransportKind, n: usize, count: impl Fn(usize, usize) -> usize + Sync) {
    expect_all(run_threads_with(n, transport, T, |c| {
        let me = c.rank();
        let sc: Vec<usize> = (0..n).map(|p| count(me, p)).collect();
        let rc: Vec<usize> = (0..n).map(|p| count(p, me)).collect();
        let send: Vec<u32> = (0..n)
            .flat_map(|p| (0..sc[p]).map(move |i| value(me, p, i)))
            .collect();
        let want: Vec<u32> = (0..n)
            .flat_map(|p| (0..rc[p]).map(move |i| value(p, me, i)))
            .collect();
        for _ in 0..2 {
            // twice: the second call reuses the other parity's slots
            let mut recv = vec![0u32; want.len()];
            if sc.iter().all(|&k| k == sc[0]) && rc.iter().all(|&k| k == sc[0]) {
                c.all_to_all(&send, &mut recv)?;
                assert_eq!(recv, want, "rank {me}: all_to_all");
                recv.fill(0);
            }
            c.all_to_all_v(&send, &sc, &mut recv, &rc)?;
            assert_eq!(recv, want, "rank {me}: all_to_all_v");
        }
        Ok(())
    }));
}

#[test]
fn equal_blocks_of_every_size_class() {
    // 0, 1, odd, around the staging piece (chunk / n), large
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for n in 1..=4 {
            for k in [0usize, 1, 1001, 8191, 8192, 8193, 300_001] {
                check(transport, n, |_, _| k);
            }
        }
    }
}

#[test]
fn counts_that_differ_per_pair() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        for n in 2..=4 {
            // small (one piece) and large (many), with empty blocks on the diagonal and off it
            check(transport, n, |from, to| (from * 3 + to * 5) % 7);
            check(transport, n, |from, to| {
                if (from + to) % 3 == 0 {
                    0
                } else {
                    20_000 * (from + 1) + 777 * to
                }
            });
        }
    }
}

#[test]
fn a_block_length_the_ranks_disagree_on_fails_everywhere() {
    for transport in [TransportKind::Tcp, TransportKind::Auto] {
        let results = run_threads_with(3, transport, T, |c| {
            let me = c.rank();
            // rank 0 sends 9,000 elements to rank 2, which expects 8,000
            let sc: Vec<usize> = (0..3)
                .map(|p| if me == 0 && p == 2 { 9000 } else { 8000 })
                .collect();
            let rc = vec![8000usize; 3];
            let send = vec![1u32; sc.iter().sum()];
            let mut recv = vec![0u32; rc.iter().sum()];
            c.all_to_all_v(&send, &sc, &mut recv, &rc)
        });
        if transport == TransportKind::Auto {
            // shared memory: every rank sees the same tables and fails the same way
            for (r, res) in results.into_iter().enumerate() {
                let e = res.unwrap_err();
                let s = e.to_string();
                assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {s}");
                assert!(
                    s.contains("rank 0 sends 36000 bytes to rank 2, which expects 32000"),
                    "rank {r}: {s}"
                );
            }
        } else {
            // TCP: at least the receiver fails (the others may finish their own blocks)
            // Both calls read all_to_all(count=0, ...): the message says what differs.
            let e = results[2].as_ref().unwrap_err().to_string();
            assert!(
                e.contains("mismatch with rank 0")
                    && e.contains("it sent 36000 bytes")
                    && e.contains("expects 32000 bytes")
                    && e.contains("disagree on the per-rank counts"),
                "{e}"
            );
        }
    }
}

#[test]
fn per_rank_counts_travel_over_shared_memory() {
    // all_to_all_v among ranks of one host no longer falls back to TCP
    let counters = expect_all(run_threads_with(3, TransportKind::Auto, T, |c| {
        let me = c.rank();
        let sc: Vec<usize> = (0..3).map(|p| 1000 * (me + 1) + p).collect();
        let rc: Vec<usize> = (0..3).map(|p| 1000 * (p + 1) + me).collect();
        let send = vec![me as u32; sc.iter().sum()];
        let mut recv = vec![0u32; rc.iter().sum()];
        c.reset_traffic();
        c.all_to_all_v(&send, &sc, &mut recv, &rc)?;
        let t = c
            .traffic()
            .into_iter()
            .find(|t| t.op == "all_to_all")
            .unwrap();
        Ok((t.tcp_sent, t.shm_written))
    }));
    for (r, (tcp, shm)) in counters.into_iter().enumerate() {
        assert_eq!(tcp, 0, "rank {r}");
        assert!(shm > 0, "rank {r}");
    }
}

#[test]
fn tables_never_overwrite_a_one_shot_slot_a_peer_still_reads() {
    // Regression (found by `hcomm check --soak`): the v-variant's tables share the one-shot
    // slots with small all-reduces, which have a single barrier, so a rank can start the next
    // call while a peer still reads its slot. Alternate both, back to back, and check each.
    expect_all(run_threads_with(4, TransportKind::Auto, T, |c| {
        let me = c.rank();
        for round in 0..300u32 {
            let mut v: Vec<u32> = (0..417)
                .map(|i| (i as u32 * 7 + me as u32 + round) % 97)
                .collect();
            c.all_reduce_in_place(&mut v, hcomm::ReduceOp::Max)?;
            for (i, &x) in v.iter().enumerate() {
                let want = (0..4)
                    .map(|r| (i as u32 * 7 + r + round) % 97)
                    .max()
                    .unwrap();
                assert_eq!(x, want, "round {round}, element {i}");
            }
            let sc: Vec<usize> = (0..4).map(|p| 1 + (me + p + round as usize) % 3).collect();
            let rc: Vec<usize> = (0..4).map(|p| 1 + (p + me + round as usize) % 3).collect();
            let send: Vec<u32> = (0..4)
                .flat_map(|p| (0..sc[p]).map(move |i| value(me, p, i)))
                .collect();
            let mut recv = vec![0u32; rc.iter().sum()];
            c.all_to_all_v(&send, &sc, &mut recv, &rc)?;
            let want: Vec<u32> = (0..4)
                .flat_map(|p| (0..rc[p]).map(move |i| value(p, me, i)))
                .collect();
            assert_eq!(recv, want, "round {round}");
        }
        Ok(())
    }));
}
