//! The canonical schedules of `HCOMM_DETERMINISTIC`: every element of a reduction is computed
//! as one fixed expression, the ranks' contributions folded in rank order
//! (`((x0 ⊕ x1) ⊕ x2) ⊕ … ⊕ x(n-1)`, f16 and bf16 accumulated in f32 and rounded once:
//! [`fold_in_order`]), so the bits do not depend on which schedule ran, the message size, an
//! element's offset within a fused bucket, chunking, striping or transport.
//!
//! * **all-reduce, small** (up to [`GATHER_MAX`] bytes): every rank sends its vector to every
//!   other rank and folds all `n` locally: one round, `(n-1) S` bytes per rank.
//! * **all-reduce, large**: a reduce-scatter in which each segment's owner gathers that
//!   segment from every rank and folds it, then the ring all-gather: `2 S (n-1)/n` bytes per
//!   rank, as the ring, with `(n-1)/n S` of scratch.
//! * **reduce-scatter**: the first half of the above.
//! * **reduce**: the root gathers every vector and folds (`(n-1) S` into the root).
//! * **all-reduce across hosts of consecutive ranks** (the communicator's part is
//!   `Communicator::all_reduce_canonical_hierarchical`): within each host, rank `l` gathers
//!   segment `l` from the host's ranks; along the chain of hosts ([`host_chain`]) the
//!   same-index ranks fold that segment in host order, passing the partial fold (the
//!   accumulator: f32 for f16/bf16) forward and the result back; within each host, an
//!   all-gather. A host sends `S` forward and `S` back (the hierarchical all-reduce's bytes),
//!   where the flat schedule would send `S (2 - 2/n + …)` from each host.
//!
//! The gathered contributions land in a per-thread buffer kept between calls (the largest
//! gather so far, up to [`KEPT_SCRATCH_MAX`]: `(n-1)/n S` for an all-reduce, `(n-1) S` on a
//! reduce's root); the large all-reduce folds its own segment into a second kept buffer
//! (`S/n`) before copying it into place.
//!
//! Both all-reduce forms fold the same parts in the same order, so switching between them by
//! size changes no bit.

use super::{ring, Run};
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::Result;
use crate::base::reduce::{
    accumulator_size, fold_in_order, fold_into_accumulator, round_accumulator, Order,
};
use crate::base::segments::even_segments;
use crate::transport::ops::Sink;
use std::ops::Range;

/// All-reduces of up to this many bytes gather every vector on every rank.
pub const GATHER_MAX: usize = 64 << 10;

/// Gathers larger than this use a buffer of their own, freed after the call.
pub const KEPT_SCRATCH_MAX: usize = 256 << 20;

thread_local! {
    /// The gathered contributions, kept between calls on this thread: a fresh `(n-1)/n S` of
    /// zeroed pages per call cost more than the transfer at 64 MiB (page faults: 210 ms
    /// against 86 ms per call, 2 ranks over TCP). It holds the largest gather this thread ran,
    /// up to [`KEPT_SCRATCH_MAX`].
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The large all-reduce's folded segment, kept for the same reason (a fresh `S/n` per call
    /// was a tenth of a 64 MiB TCP call's profile in page faults and zeroing).
    static FOLDED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The host's contributions to this rank's segment in the canonical hierarchical
    /// all-reduce (`S` bytes), kept for the same reason.
    static HOST_PARTS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Run `f` with this thread's buffer for the host's contributions (the canonical hierarchical
/// all-reduce's within-host gather) grown to at least `len` bytes; kept between calls.
pub fn with_host_parts<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    with_kept(&HOST_PARTS, len, f)
}

/// Run `f` with this thread's scratch buffer grown to at least `len` bytes.
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    with_kept(&SCRATCH, len, f)
}

/// Run `f` with `kept` (a buffer of this thread's, kept between calls) grown to at least `len`
/// bytes; above [`KEPT_SCRATCH_MAX`] with a buffer of its own.
pub(super) fn with_kept<R>(
    kept: &'static std::thread::LocalKey<std::cell::RefCell<Vec<u8>>>,
    len: usize,
    f: impl FnOnce(&mut [u8]) -> R,
) -> R {
    if len > KEPT_SCRATCH_MAX {
        return f(&mut vec![0u8; len]);
    }
    kept.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0);
        }
        f(&mut s[..len])
    })
}

/// `parts` consecutive slices of `len` bytes of `buf` (empty ones too, so that a message of no
/// bytes is still received).
fn split_equal(buf: &mut [u8], parts: usize, len: usize) -> Vec<&mut [u8]> {
    let mut out = Vec::with_capacity(parts);
    let mut rest = buf;
    for _ in 0..parts {
        let (part, tail) = rest.split_at_mut(len);
        out.push(part);
        rest = tail;
    }
    out
}

/// Gather segment `segs[me]` of every rank's `input` and fold it into `out` (rank order).
fn gather_and_fold(
    run: &mut Run,
    input: &[u8],
    segs: &[Range<usize>],
    dtype: DType,
    op: ReduceOp,
    out: &mut [u8],
    step: u32,
) -> Result<()> {
    let (n, me) = (run.size, run.rank);
    let mine = segs[me].clone();
    with_scratch(mine.len() * (n - 1), |scratch| {
        {
            let sends = (0..n)
                .filter(|&p| p != me)
                .map(|p| (p, step, &input[segs[p].clone()]))
                .collect();
            let recvs = split_equal(scratch, n - 1, mine.len())
                .into_iter()
                .zip((0..n).filter(|&p| p != me))
                .map(|(buf, p)| (p, step, Sink::Buf(buf)))
                .collect();
            run.exchange(sends, recvs)?;
        }
        let parts: Vec<&[u8]> = (0..n)
            .map(|r| match r.cmp(&me) {
                std::cmp::Ordering::Equal => &input[mine.clone()],
                std::cmp::Ordering::Less => &scratch[r * mine.len()..(r + 1) * mine.len()],
                std::cmp::Ordering::Greater => &scratch[(r - 1) * mine.len()..r * mine.len()],
            })
            .collect();
        fold_in_order(dtype, op, out, &parts);
        Ok(())
    })
}

/// The reduce-scatter of two ranks in the canonical order, in place: rank `me` sends segment
/// `segs[other]` of `buf` and reduces the other's segment `segs[me]` into its own on receipt,
/// as `x0 ⊕ x1` (rank 0's operand first whichever rank owns the segment).
fn fold_pair_on_receipt(
    run: &mut Run,
    buf: &mut [u8],
    segs: &[Range<usize>],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (lo, hi) = buf.split_at_mut(segs[1].start);
    let (send, dst) = if run.rank == 0 {
        (&hi[..segs[1].len()], &mut lo[segs[0].clone()])
    } else {
        (&lo[segs[0].clone()], &mut hi[..segs[1].len()])
    };
    fold_pair(run, send, dst, dtype, op)
}

/// Two ranks: send `send` to the other rank and reduce what it sends into `dst` (which holds
/// this rank's own contribution) as `x0 ⊕ x1`.
fn fold_pair(run: &mut Run, send: &[u8], dst: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let other = 1 - run.rank;
    let order = if run.rank == 0 {
        Order::AccFirst
    } else {
        Order::SrcFirst
    };
    run.exchange(
        vec![(other, 0, send)],
        vec![(
            other,
            0,
            Sink::Reduce {
                dst,
                acc: None,
                dtype,
                op,
                order,
            },
        )],
    )
}

/// The small all-reduce: every rank gathers every rank's `buf` with Bruck's all-gather (in
/// round `k` a rank sends the `min(2^k, n - 2^k)` vectors it holds to rank `me - 2^k` and
/// receives as many from `me + 2^k`, so after `ceil(log2 n)` rounds it holds the vectors of
/// ranks `me, me + 1, …` (mod n); a message per round instead of one per peer) and folds them
/// in rank order into `buf`.
fn gather_all_and_fold(run: &mut Run, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (n, me, len) = (run.size, run.rank, buf.len());
    with_scratch(len * n, |held| {
        held[..len].copy_from_slice(buf);
        let mut have = 1;
        let mut round = 0u32;
        while have < n {
            let count = have.min(n - have);
            let (mine, rest) = held.split_at_mut(have * len);
            run.step(
                round,
                Some(((me + n - have) % n, &mine[..count * len])),
                Some(((me + have) % n, Sink::Buf(&mut rest[..count * len]))),
            )?;
            have += count;
            round += 1;
        }
        let parts: Vec<&[u8]> = (0..n)
            .map(|r| {
                let at = (r + n - me) % n;
                &held[at * len..(at + 1) * len]
            })
            .collect();
        fold_in_order(dtype, op, buf, &parts);
        Ok(())
    })
}

/// Canonical all-reduce of `buf` in place.
pub fn all_reduce(run: &mut Run, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let n = run.size;
    let count = buf.len() / dtype.size();
    if n == 1 {
        let copy = buf.to_vec();
        fold_in_order(dtype, op, buf, &[&copy]);
        return Ok(());
    }
    if buf.len() <= GATHER_MAX {
        // Every rank gathers every vector (Bruck's all-gather: ceil(log2 n) rounds) and folds.
        return gather_all_and_fold(run, buf, dtype, op);
    }
    let segs = even_segments(count, n, dtype.size());
    if n == 2 && accumulator_size(dtype) == dtype.size() {
        // Two ranks fold in one operation, `x0 ⊕ x1`: each owner reduces the other's part
        // of its segment into its own as it arrives, rank 0's operand first (no gather
        // buffer, no separate fold pass). f16/bf16 keep the gather: they fold in f32.
        fold_pair_on_receipt(run, buf, &segs, dtype, op)?;
        return ring::all_gather_in_place(run, buf, &segs, 1);
    }
    with_kept(&FOLDED, segs[run.rank].len(), |mine| {
        gather_and_fold(run, buf, &segs, dtype, op, mine, 0)?;
        buf[segs[run.rank].clone()].copy_from_slice(mine);
        Ok::<(), crate::base::error::Error>(())
    })?;
    ring::all_gather_in_place(run, buf, &segs, 1)
}

/// Accumulator bytes per message of [`host_chain`]: the chain is pipelined in chunks of this
/// size, so a host passes a chunk on while the next arrives.
pub const CHAIN_CHUNK: usize = 256 << 10;

/// The hosts' part of the canonical hierarchical all-reduce, on the communicator of one rank
/// per host (its rank order is the hosts' order, each host holding consecutive ranks of the
/// whole): this rank's `parts` are its host's contributions to one segment, in rank order, and
/// `out` (elements of `dtype`, as long as each part) receives the fold of every host's parts
/// in host order, which is the canonical fold over every rank of the whole.
///
/// Host 0 folds its parts into the accumulator and sends it to host 1, which folds its own
/// parts onto it ([`fold_into_accumulator`]) and passes it on; the last host rounds
/// ([`round_accumulator`]) and sends the result back down the chain, each host keeping a copy.
/// Both directions run at once, in chunks of [`CHAIN_CHUNK`]: at tick `t` host `h` folds chunk
/// `t - h` (received at tick `t - 1`) and sends it forward while chunk `t - h + 1` arrives; the
/// result of chunk `b` leaves the last host at tick `b + H - 1` and reaches host `g` at tick
/// `b + 2(H - 1) - g - 1`. `chunks + 2(H - 1) - 1` ticks in all.
pub fn host_chain(
    run: &mut Run,
    parts: &[&[u8]],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (hosts, h) = (run.size, run.rank);
    let (es, ws) = (dtype.size(), accumulator_size(dtype));
    let count = out.len() / es;
    if hosts == 1 {
        fold_in_order(dtype, op, out, parts);
        return Ok(());
    }
    if count == 0 {
        return Ok(());
    }
    let per_chunk = (CHAIN_CHUNK / ws).max(1);
    let chunks = count.div_ceil(per_chunk);
    let range = |k: usize| k * per_chunk..((k + 1) * per_chunk).min(count);
    let last = hosts - 1;
    // The chunk index `t - shift` at tick `t`, when it is one.
    let chunk = |t: usize, shift: isize| -> Option<usize> {
        let k = t as isize - shift;
        (k >= 0 && (k as usize) < chunks).then_some(k as usize)
    };
    // Two accumulators: the chunk folded this tick (`k % 2`) and the one arriving for the next.
    let mut acc = [
        vec![0u8; per_chunk.min(count) * ws],
        vec![0u8; per_chunk.min(count) * ws],
    ];
    for t in 0..chunks + 2 * last - 1 {
        let fold = chunk(t, h as isize);
        let arriving = if h > 0 {
            chunk(t, h as isize - 1)
        } else {
            None
        };
        let (back_in, back_out) = if h < last {
            let from = 2 * last as isize - h as isize;
            (
                chunk(t, from - 1),
                if h > 0 { chunk(t, from) } else { None },
            )
        } else {
            (None, fold)
        };
        if let Some(k) = fold {
            let r = range(k);
            let bytes = r.start * es..r.end * es;
            let mine: Vec<&[u8]> = parts.iter().map(|p| &p[bytes.clone()]).collect();
            let a = &mut acc[k % 2][..r.len() * ws];
            fold_into_accumulator(dtype, op, a, h > 0, &mine);
            if h == last {
                round_accumulator(dtype, a, &mut out[bytes]);
            }
        }
        let mut sends: Vec<(usize, u32, &[u8])> = Vec::new();
        let mut recvs: Vec<(usize, u32, Sink)> = Vec::new();
        let [even, odd] = &mut acc;
        let (folded, incoming) = match fold.or(arriving.map(|k| k + 1)) {
            Some(k) if k % 2 == 1 => (&*odd, even),
            _ => (&*even, odd),
        };
        if let (Some(k), true) = (fold, h < last) {
            sends.push((h + 1, 2 * t as u32, &folded[..range(k).len() * ws]));
        }
        if let Some(k) = arriving {
            recvs.push((
                h - 1,
                2 * t as u32,
                Sink::Buf(&mut incoming[..range(k).len() * ws]),
            ));
        }
        // The result travels back in `out`: chunk `back_out` (received at the last tick, or
        // folded at this one on the last host) goes down while chunk `back_in` comes up.
        let split = back_in.map_or(out.len(), |k| range(k).start * es);
        let (below, above) = out.split_at_mut(split);
        if let (Some(k), true) = (back_out, h > 0) {
            let r = range(k);
            sends.push((h - 1, 2 * t as u32 + 1, &below[r.start * es..r.end * es]));
        }
        if let Some(k) = back_in {
            recvs.push((
                h + 1,
                2 * t as u32 + 1,
                Sink::Buf(&mut above[..range(k).len() * es]),
            ));
        }
        if !sends.is_empty() || !recvs.is_empty() {
            run.exchange(sends, recvs)?;
        }
    }
    Ok(())
}

/// Canonical reduce-scatter: `out` receives the fold of segment `segs[rank]` of every rank's
/// `input` (which holds every segment).
pub fn reduce_scatter(
    run: &mut Run,
    input: &[u8],
    out: &mut [u8],
    segs: &[Range<usize>],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    if run.size == 1 {
        fold_in_order(dtype, op, out, &[&input[segs[0].clone()]]);
        return Ok(());
    }
    if run.size == 2 && accumulator_size(dtype) == dtype.size() {
        let me = run.rank;
        out.copy_from_slice(&input[segs[me].clone()]);
        return fold_pair(run, &input[segs[1 - me].clone()], out, dtype, op);
    }
    gather_and_fold(run, input, segs, dtype, op, out, 0)
}

/// Canonical reduce to `root`: `out` (the root's; empty elsewhere) receives the fold of every
/// rank's `input`.
pub fn reduce(
    run: &mut Run,
    input: &[u8],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (n, me) = (run.size, run.rank);
    if me != root {
        return run.step(0, Some((root, input)), None);
    }
    let len = input.len();
    with_scratch(len * (n - 1), |scratch| {
        {
            let recvs = split_equal(scratch, n - 1, len)
                .into_iter()
                .zip((0..n).filter(|&p| p != me))
                .map(|(buf, p)| (p, 0, Sink::Buf(buf)))
                .collect();
            run.exchange(Vec::new(), recvs)?;
        }
        let parts: Vec<&[u8]> = (0..n)
            .map(|r| match r.cmp(&me) {
                std::cmp::Ordering::Equal => input,
                std::cmp::Ordering::Less => &scratch[r * len..(r + 1) * len],
                std::cmp::Ordering::Greater => &scratch[(r - 1) * len..r * len],
            })
            .collect();
        fold_in_order(dtype, op, out, &parts);
        Ok(())
    })
}
