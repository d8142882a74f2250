//! All-gathers that keep their outputs between hosts (`HCOMM_GATHER_CACHE_MB`, on by default
//! when the ranks span hosts): a block that is bitwise one its rank sent in a kept all-gather
//! goes as a reference. FSDP2's pattern (every layer gathered in forward, again in backward
//! from the same shards, then new shards after the optimizer step), with some ranks' blocks
//! repeating and others not, uneven blocks, in place and not: every output must be every
//! rank's block in rank order, and the repeated gathers must move almost nothing. Also: the
//! budget bounds what is kept, data that never repeats pauses the keeping, and ranks that
//! disagree fail with errors instead of wrong blocks.

use hcomm::testing::{expect_all, run_threads_on_hosts};
use hcomm::{Communicator, DType, ReduceOp};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const MIB: usize = 1 << 20;

fn sent(c: &Communicator) -> u64 {
    c.traffic().iter().map(|t| t.tcp_sent + t.shm_written).sum()
}

/// Rank `rank`'s shard of `layer` at `version` (random bytes, reproducible on every rank).
fn shard(layer: usize, rank: usize, version: u64, len: usize) -> Vec<u8> {
    hcomm::testing::random_input(
        DType::F32,
        ReduceOp::Sum,
        rank,
        len / 4,
        layer as u64 * 1000 + version,
    )
}

/// Layer `layer`'s per-rank block lengths (bytes) on `n` ranks: even, but for layer 1, whose
/// blocks differ per rank (an all-gather-v), and the blocks of an all-gather of at least 1 MiB.
fn blocks(layer: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|r| {
            if layer == 1 {
                MIB / 2 + 4 * (r * 1001 + 3)
            } else {
                3 * MIB / 4 + 4 * 17 * layer
            }
        })
        .collect()
}

/// All-gather `layer` at the given per-rank versions; checks the output against every rank's
/// shard and returns the bytes this rank sent.
fn gather(c: &Communicator, layer: usize, versions: &[u64], in_place: bool) -> hcomm::Result<u64> {
    let n = c.world_size();
    let lens = blocks(layer, n);
    let want: Vec<u8> = (0..n)
        .flat_map(|r| shard(layer, r, versions[r], lens[r]))
        .collect();
    let me = c.rank();
    let mine = shard(layer, me, versions[me], lens[me]);
    let counts: Vec<usize> = lens.iter().map(|l| l / 4).collect();
    let before = sent(c);
    let mut out = vec![0xA5u8; want.len()];
    if in_place {
        let at: usize = lens[..me].iter().sum();
        out[at..at + mine.len()].copy_from_slice(&mine);
        c.all_gather_v_bytes(None, &mut out, &counts, DType::F32)?;
    } else {
        c.all_gather_v_bytes(Some(&mine), &mut out, &counts, DType::F32)?;
    }
    assert!(
        out == want,
        "rank {me}: layer {layer} at versions {versions:?}: wrong output"
    );
    Ok(sent(c) - before)
}

/// FSDP2's sequence over `hosts`: two steps of forward (layers 0..4), backward (4..0), with new
/// shards after each step but rank 0's shard of layer 2, which its optimizer left alone.
fn fsdp_pattern(hosts: &[&str]) {
    const LAYERS: usize = 4;
    let results = expect_all(run_threads_on_hosts(hosts, T, |c| {
        assert!(c.gather_cache_budget() > 0, "on by default between hosts");
        let n = c.world_size();
        let mut report = Vec::new();
        for step in 0..2u64 {
            let version = |layer: usize, r: usize| if layer == 2 && r == 0 { 0 } else { step };
            let mut forward = 0;
            for layer in 0..LAYERS {
                let v: Vec<u64> = (0..n).map(|r| version(layer, r)).collect();
                forward += gather(&c, layer, &v, layer % 2 == 0)?;
            }
            let mut backward = 0;
            for layer in (0..LAYERS).rev() {
                let v: Vec<u64> = (0..n).map(|r| version(layer, r)).collect();
                backward += gather(&c, layer, &v, layer % 2 == 1)?;
            }
            report.push((forward, backward));
        }
        assert!(c.gather_cache_held() <= c.gather_cache_budget());
        Ok(report)
    }));
    for (rank, report) in results.iter().enumerate() {
        for (step, &(forward, backward)) in report.iter().enumerate() {
            // Backward repeats forward: only the claims (16 bytes per rank and ring step) and
            // frame headers move.
            assert!(
                backward < 64 * 1024,
                "rank {rank}, step {step}: backward sent {backward} bytes (forward {forward})"
            );
            assert!(
                forward > 2 * MIB as u64 || hosts.len() == 2 && forward > MIB as u64,
                "rank {rank}: forward sent only {forward}"
            );
        }
    }
}

#[test]
fn two_hosts_of_one_rank_send_repeated_blocks_as_references() {
    fsdp_pattern(&["h0", "h1"]);
}

#[test]
fn three_ranks_on_two_hosts_send_repeated_blocks_as_references() {
    fsdp_pattern(&["h0", "h1", "h1"]);
}

#[test]
fn four_ranks_on_two_hosts_send_repeated_blocks_as_references() {
    fsdp_pattern(&["h0", "h0", "h1", "h1"]);
}

#[test]
fn the_budget_bounds_what_is_kept_and_the_outputs_stay_right() {
    let results = expect_all(run_threads_on_hosts(&["h0", "h1"], T, |c| {
        // Two layers' outputs fit (1.5 MiB + 1.5 MiB + headroom), not three.
        c.set_gather_cache_budget(3 * MIB + 4096 * 4);
        let mut held = Vec::new();
        for layer in [0, 2, 3] {
            gather(&c, layer, &[0, 0], false)?;
            held.push(c.gather_cache_held());
        }
        // layer 0 left to make room for layer 3: its repeat moves the blocks again
        let repeat_3 = gather(&c, 3, &[0, 0], true)?;
        let repeat_0 = gather(&c, 0, &[0, 0], true)?;
        // off: nothing kept, every block sent
        c.set_gather_cache_budget(0);
        let off = gather(&c, 0, &[0, 0], true)?;
        Ok((held, repeat_3, repeat_0, off, c.gather_cache_held()))
    }));
    for (held, repeat_3, repeat_0, off, held_off) in results {
        assert!(held.iter().all(|&h| h <= 3 * MIB + 4096 * 4), "{held:?}");
        // layer 0 (1.5 MiB) left when layer 3 (1.5 MiB) came
        assert!(
            held[1] > held[0] && held[2] > held[1] && held[2] < held[1] + 4096,
            "{held:?}"
        );
        assert!(repeat_3 < 64 * 1024, "layer 3 was kept: {repeat_3} bytes");
        assert!(
            repeat_0 > MIB as u64 / 2,
            "layer 0 had left: {repeat_0} bytes"
        );
        assert!(off > MIB as u64 / 2 && held_off == 0, "{off} {held_off}");
    }
}

#[test]
fn data_that_never_repeats_pauses_the_keeping() {
    let results = expect_all(run_threads_on_hosts(&["h0", "h1"], T, |c| {
        c.set_gather_cache_budget(2 * MIB);
        let mut held = Vec::new();
        for version in 0..12u64 {
            gather(&c, 0, &[version, version], version % 2 == 0)?;
            held.push(c.gather_cache_held());
        }
        Ok(held)
    }));
    for held in results {
        // 1.5 MiB per call: after more than 4 budgets (8 MiB) kept without a repeat, the kept
        // outputs go and the next 16 budgets' worth of calls keep nothing.
        assert!(held.iter().take(5).all(|&h| h > 0), "{held:?}");
        assert!(held.iter().skip(5).all(|&h| h == 0), "{held:?}");
    }
}

#[test]
fn ranks_that_disagree_fail_and_say_why() {
    // One rank keeps all-gathers, the other does not: a fingerprint mismatch, on both.
    let results = run_threads_on_hosts(&["h0", "h1"], T, |c| {
        if c.rank() == 1 {
            c.set_gather_cache_budget(0);
        }
        gather(&c, 0, &[0, 0], false).map(|_| ())
    });
    // The rank that finds the mismatch says why; the other finds it too, or (when the
    // finder's report arrives first) fails with that report, naming the finder.
    let texts: Vec<String> = results
        .iter()
        .map(|res| {
            res.as_ref()
                .expect_err("a keeping and a plain all-gather cannot meet")
                .to_string()
        })
        .collect();
    assert!(
        texts.iter().any(|t| t.contains("gather-cache")),
        "{texts:?}"
    );
    for (r, t) in texts.iter().enumerate() {
        // The other rank blames one of the two: "rank 0 …" or "this rank (rank 1) …".
        let reported = format!("rank {} reported an error: ", 1 - r);
        assert!(
            t.contains("gather-cache")
                || (t.contains(&reported) && t.contains("called a different collective")),
            "rank {r}: {t}"
        );
    }

    // Rank 1 dropped what it kept (off and on again), rank 0 did not: rank 0's reference to a
    // call rank 1 no longer holds fails rank 1 with an error naming rank 0, and rank 0 too.
    let results = run_threads_on_hosts(&["h0", "h1"], Duration::from_secs(10), |c| {
        gather(&c, 0, &[0, 0], false)?;
        if c.rank() == 1 {
            let budget = c.gather_cache_budget();
            c.set_gather_cache_budget(0);
            c.set_gather_cache_budget(budget);
        }
        gather(&c, 0, &[0, 1], false).map(|_| ())
    });
    let e1 = results[1]
        .as_ref()
        .expect_err("rank 1 cannot fill rank 0's block");
    assert!(
        e1.to_string().contains("rank 0") && e1.to_string().contains("does not keep"),
        "{e1}"
    );
    assert!(results[0].is_err(), "rank 0 must fail too, not hang");
}
