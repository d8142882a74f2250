//! The all-gather that does not send a block its receivers already hold (`HCOMM_GATHER_CACHE_MB`,
//! on between hosts: `Communicator::all_gather_v_inner` runs [`all_gather`] for a ring
//! all-gather whose ranks span more than one host).
//!
//! FSDP2 gathers every layer's parameters twice per step: in forward, and again in backward
//! (it frees the gathered copy after forward, `reshard_after_forward`), from shards that the
//! optimizer has not touched in between. Every rank ends an all-gather with the same output, so
//! every rank can keep the same copy of it; when a rank's block is then bitwise one it sent in an
//! all-gather still kept, it sends that call's sequence number instead of the block.
//!
//! 1. Each rank looks for its block among the kept calls (same length, then the bytes, which
//!    `memcmp` rejects at the first difference), and the ranks all-gather their claims (16 bytes
//!    each: the kept call's sequence number or none, and the rank's budget).
//! 2. The ring all-gather runs with the claimed blocks empty; each rank copies them from its copy
//!    of the claimed call.
//! 3. Unless every block was claimed, the output is kept (when it fits in the smallest budget of
//!    the ranks), the oldest kept calls making room first.
//!
//! **Every rank keeps the same calls.** What is kept, and what leaves, depends only on the
//! sequence of all-gathers, their lengths and the claims and budgets all ranks exchanged, so the
//! copies agree on every rank; a claim of a call this rank does not hold (its copies were
//! dropped after a failed call) is an error that names the claiming rank, never a wrong block.
//! Calls are named by their sequence number on the communicator, which every rank's fingerprint
//! checks.
//!
//! **Bitwise the ring's output.** A claimed block is, byte for byte, what its rank would have
//! sent: the claim is made only after comparing the bytes, not a hash.
//!
//! **Cost.** A round trip for the claims; a copy of the output into the kept calls (memory
//! bound, a few ms for 25 MiB) unless all blocks repeat; the comparisons. Worth it across hosts
//! (1 Gbit/s carries 25 MiB in 210 ms), not over shared memory, which never uses it. Memory: the
//! budget, at most (`Communicator::gather_cache_budget`).

use super::{ring, Run};
use crate::base::error::{Error, Result};
use std::collections::VecDeque;
use std::ops::Range;

/// All-gathers of fewer bytes run the plain ring: the claims cost a round trip (~0.1 ms, what
/// 1 MiB takes at 10 Gbit/s is 0.8 ms).
pub const MIN_BYTES: usize = 1 << 20;

/// After this many budgets' worth of kept outputs without a repeated block, keeping pauses...
const FRUITLESS_BUDGETS: usize = 4;
/// ...for this many budgets' worth of all-gathers (the plain ring, no copy, no claims).
const PAUSE_BUDGETS: usize = 16;

/// "No claim" on the wire.
const NONE: u64 = u64::MAX;

/// Bytes per rank of the claims' exchange: the claimed sequence number, then the rank's budget.
const CLAIM_BYTES: usize = 16;

/// One kept all-gather: its sequence number, its blocks' places and its whole output.
struct Kept {
    seq: u64,
    segs: Vec<Range<usize>>,
    data: Vec<u8>,
}

/// The all-gathers a communicator keeps (the same ones on every rank).
///
/// Keeping pauses when it does not pay: once `FRUITLESS_BUDGETS` budgets' worth of outputs were
/// kept without a single repeated block (all-gathers of data that never repeats), the kept
/// outputs are dropped and the next `PAUSE_BUDGETS` budgets' worth of all-gathers run the
/// plain ring; then keeping starts again. Every rank counts the same calls and claims, so all
/// pause together.
#[derive(Default)]
pub struct GatherCache {
    kept: VecDeque<Kept>,
    /// The memory of the kept outputs (their buffers' capacities).
    held: usize,
    /// The buffer of the call that left last, reused for the next one kept if it has exactly
    /// the size that one needs.
    spare: Option<Vec<u8>>,
    /// Bytes kept since the last call with a repeated block.
    fruitless: usize,
    /// Bytes of all-gathers still to run plainly before keeping starts again.
    paused_for: usize,
}

impl GatherCache {
    /// Bytes of memory the kept outputs hold (their buffers' capacities).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Drop everything kept (after a failed call, whose copies may differ between ranks).
    pub fn clear(&mut self) {
        self.kept.clear();
        self.held = 0;
        self.spare = None;
        self.fruitless = 0;
        self.paused_for = 0;
    }

    /// Whether the next eligible all-gather runs [`all_gather`] (`false`: keeping is paused; run
    /// the plain ring and report it with [`passed`](Self::passed)).
    pub fn active(&self) -> bool {
        self.paused_for == 0
    }

    /// An eligible all-gather of `bytes` ran the plain ring during a pause.
    pub fn passed(&mut self, bytes: usize) {
        self.paused_for = self.paused_for.saturating_sub(bytes.max(1));
    }

    /// The kept call whose block `rank` (at `seg` there) equals `block`, newest first.
    fn find(&self, rank: usize, block: &[u8]) -> Option<u64> {
        self.kept
            .iter()
            .rev()
            .find(|k| {
                let seg = &k.segs[rank];
                seg.len() == block.len() && k.data[seg.clone()] == *block
            })
            .map(|k| k.seq)
    }

    fn get(&self, seq: u64) -> Option<&Kept> {
        self.kept.iter().find(|k| k.seq == seq)
    }

    /// Make the kept outputs fit in `budget` bytes, the oldest leaving first.
    fn shrink_to(&mut self, budget: usize) {
        while self.held > budget {
            let Some(old) = self.kept.pop_front() else {
                break;
            };
            self.held -= old.data.capacity();
            self.spare = Some(old.data);
        }
    }

    /// Keep `buf` (the output of call `seq`, blocks at `segs`) within `budget` bytes of memory.
    fn keep(&mut self, seq: u64, segs: &[Range<usize>], buf: &[u8], budget: usize) {
        if buf.len() > budget || buf.is_empty() {
            self.shrink_to(budget);
            return;
        }
        self.shrink_to(budget - buf.len());
        // The buffer of the call that left last, if it is the size of this one (FSDP2's layers
        // repeat their sizes); otherwise a new one of exactly this size, so that what is held
        // is what the budget counts.
        let mut data = match self.spare.take() {
            Some(s) if s.capacity() == buf.len() => s,
            _ => Vec::with_capacity(buf.len()),
        };
        data.clear();
        data.extend_from_slice(buf);
        self.held += data.capacity();
        self.kept.push_back(Kept {
            seq,
            segs: segs.to_vec(),
            data,
        });
    }
}

/// In-place all-gather of `buf` (this rank's block already at `segs[rank]`) over `run`, sending
/// no block that `cache` (this communicator's kept calls) holds, and keeping the output within
/// `budget` bytes (the smallest of all ranks' budgets is used). Returns the bytes of the blocks
/// that were not sent. On an error the cache is cleared.
pub fn all_gather(
    run: &mut Run,
    cache: &mut GatherCache,
    budget: usize,
    buf: &mut [u8],
    segs: &[Range<usize>],
) -> Result<usize> {
    let r = exchange(run, cache, budget, buf, segs);
    if r.is_err() {
        cache.clear();
    }
    r
}

fn exchange(
    run: &mut Run,
    cache: &mut GatherCache,
    budget: usize,
    buf: &mut [u8],
    segs: &[Range<usize>],
) -> Result<usize> {
    let (n, me) = (run.size, run.rank);
    let mine = if segs[me].is_empty() {
        NONE
    } else {
        cache.find(me, &buf[segs[me].clone()]).unwrap_or(NONE)
    };
    let mut claims = vec![0u8; n * CLAIM_BYTES];
    let at = me * CLAIM_BYTES;
    claims[at..at + 8].copy_from_slice(&mine.to_le_bytes());
    claims[at + 8..at + 16].copy_from_slice(&(budget as u64).to_le_bytes());
    let claim_segs: Vec<Range<usize>> = (0..n)
        .map(|p| p * CLAIM_BYTES..(p + 1) * CLAIM_BYTES)
        .collect();
    ring::all_gather_in_place(run, &mut claims, &claim_segs, 0)?;
    let word = |p: usize, i: usize| {
        let at = p * CLAIM_BYTES + i * 8;
        u64::from_le_bytes(claims[at..at + 8].try_into().expect("8 bytes"))
    };
    let budget = (0..n).map(|p| word(p, 1)).min().unwrap_or(0);
    let budget = usize::try_from(budget).unwrap_or(usize::MAX);
    let claimed: Vec<Option<u64>> = (0..n)
        .map(|p| Some(word(p, 0)).filter(|&s| s != NONE))
        .collect();
    for (p, c) in claimed.iter().enumerate() {
        let Some(seq) = *c else { continue };
        let ok = cache
            .get(seq)
            .is_some_and(|k| k.segs[p].len() == segs[p].len());
        if !ok {
            return Err(Error::Mismatch {
                ctx: run.ctx.clone(),
                peer: p,
                msg: format!(
                    "rank {p} sends its block as a repeat of all-gather seq {seq}, which this rank \
                     does not keep (its kept all-gathers were dropped after a failed call)"
                ),
            });
        }
    }
    // The ring moves only the blocks not claimed (a claimed block is an empty segment).
    let moved: Vec<Range<usize>> = segs
        .iter()
        .zip(&claimed)
        .map(|(s, c)| {
            if c.is_some() {
                s.start..s.start
            } else {
                s.clone()
            }
        })
        .collect();
    ring::all_gather_in_place(run, buf, &moved, (n - 1) as u32)?;
    let mut skipped = 0;
    for (p, c) in claimed.iter().enumerate() {
        let Some(seq) = *c else { continue };
        skipped += segs[p].len();
        if p != me {
            let k = cache.get(seq).expect("checked above");
            buf[segs[p].clone()].copy_from_slice(&k.data[k.segs[p].clone()]);
        }
    }
    if claimed.iter().any(Option::is_some) {
        cache.fruitless = 0;
    }
    if claimed.iter().all(Option::is_some) {
        cache.shrink_to(budget);
    } else {
        cache.keep(run.ctx.seq, segs, buf, budget);
        cache.fruitless += buf.len();
        if cache.fruitless > FRUITLESS_BUDGETS.saturating_mul(budget) {
            cache.clear();
            cache.paused_for = PAUSE_BUDGETS.saturating_mul(budget).max(1);
        }
    }
    Ok(skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segs(n: usize, len: usize) -> Vec<Range<usize>> {
        (0..n).map(|p| p * len..(p + 1) * len).collect()
    }

    #[test]
    fn finds_the_newest_equal_block_of_the_same_length() {
        let mut c = GatherCache::default();
        c.keep(1, &segs(2, 4), &[1, 2, 3, 4, 5, 6, 7, 8], 100);
        c.keep(2, &segs(2, 4), &[1, 2, 3, 4, 9, 9, 9, 9], 100);
        c.keep(3, &segs(2, 2), &[1, 2, 3, 4], 100);
        assert_eq!(c.find(0, &[1, 2, 3, 4]), Some(2));
        assert_eq!(c.find(1, &[5, 6, 7, 8]), Some(1));
        assert_eq!(c.find(1, &[3, 4]), Some(3));
        assert_eq!(c.find(1, &[5, 6, 7, 9]), None);
        assert_eq!(c.held(), 20);
    }

    #[test]
    fn the_oldest_leave_first_and_nothing_larger_than_the_budget_is_kept() {
        let mut c = GatherCache::default();
        for seq in 0..5 {
            c.keep(seq, &segs(2, 5), &[seq as u8; 10], 25);
        }
        assert_eq!(c.held(), 20);
        assert!(c.get(2).is_none() && c.get(3).is_some() && c.get(4).is_some());
        c.keep(9, &segs(2, 15), &[7; 30], 25);
        assert!(c.get(9).is_none(), "larger than the budget");
        assert_eq!(c.held(), 20, "a call that is not kept leaves the others");
        c.shrink_to(10);
        assert!(c.get(3).is_none() && c.get(4).is_some());
        c.clear();
        assert_eq!((c.held(), c.find(0, &[4; 5])), (0, None));
    }

    #[test]
    fn what_is_held_is_the_memory_and_a_small_output_takes_no_large_buffer() {
        let mut c = GatherCache::default();
        c.keep(1, &segs(2, 50), &[1; 100], 100);
        c.keep(2, &segs(2, 2), &[2; 4], 100);
        // call 1 left to make room, its 100-byte buffer is not reused for 4 bytes
        assert_eq!(c.held(), 4);
        c.keep(3, &segs(2, 48), &[3; 96], 100);
        assert_eq!(c.held(), 100);
        assert!(c.kept.iter().all(|k| k.data.capacity() == k.data.len()));
    }

    #[test]
    fn a_pause_lasts_until_its_bytes_have_passed() {
        let mut c = GatherCache {
            paused_for: 10,
            ..Default::default()
        };
        assert!(!c.active());
        c.passed(6);
        assert!(!c.active());
        c.passed(0);
        c.passed(3);
        assert!(
            c.active(),
            "6 + 1 (an empty call counts one) + 3 bytes passed"
        );
    }
}
