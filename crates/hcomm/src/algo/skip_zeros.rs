//! The all-reduce and the reduce-scatter of two ranks that move only the blocks that are not
//! all zero bits (`HCOMM_SKIP_ZEROS`, on by default between hosts: `Communicator::all_reduce_bytes`
//! runs [`all_reduce_pair`] for a flat two-rank all-reduce across hosts and for the cross-host
//! step of the hierarchical all-reduce on two hosts; `reduce_scatter_v_bytes` runs
//! [`reduce_scatter_pair`] for a two-rank reduce-scatter across hosts, FSDP's gradients).
//!
//! 1. Each rank scans its buffer in blocks of [`ZERO_BLOCK_BYTES`] and the two exchange the
//!    bitmaps of their non-zero blocks (`⌈blocks / 8⌉` bytes: 3 KiB for 25 MiB of f32).
//! 2. When both buffers are dense, the ring runs as it would have (no copy).
//! 3. Otherwise each rank packs its non-zero blocks and sends them; each rank reduces what it
//!    receives into its own blocks (in place on receipt for up to [`DIRECT_RUNS`] runs of
//!    consecutive blocks, else from a packed copy), and a non-zero block of its own that the
//!    other rank did not send is reduced with zeros.
//!
//! **Bitwise the dense all-reduce.** With two ranks every element the dense ring computes is
//! `x0 + x1` (one addition, which IEEE-754 makes commutative). Here every element the two
//! ranks computes is that same addition: where both sent, the same operands; where one rank's
//! block is zero, the other's value plus that rank's `+0.0`s, which is still computed (so a
//! `-0.0` becomes `+0.0` and f16/bf16 round exactly as in the dense kernel); where both are
//! zero, `+0.0` (what `0 + 0` gives). Integers skip the addition of zeros (`x + 0 = x`). The
//! one difference left: when both operands are NaNs with different payloads, x86 keeps the
//! first operand's payload, and the ring's operand order per segment is not this one's.
//!
//! **Cost.** Bytes per rank: its non-zero blocks plus the bitmap (the ring moves the whole
//! buffer), so never more than the ring plus `1/8192` of it. Time: a scan of the buffer and,
//! unless both are dense, a copy of the non-zero blocks, both memory-bound (a few ms for 25
//! MiB here): worth it across hosts (a 1 Gbit/s link carries 25 MiB in 210 ms), not over
//! shared memory or loopback, which is why `auto` keeps it to links between hosts.

use super::{canonical, even_segments, ring, Run};
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::Result;
use crate::base::reduce::{reduce_into, Order};
use crate::base::zero_blocks::{block_bytes, is_set, nonzero_map, runs, ZERO_BLOCK_BYTES};
use crate::transport::ops::Sink;
use std::ops::Range;

/// A sender with at most this many runs of non-zero blocks sends each as a frame of its own,
/// which its peer reduces in place as it arrives; with more, one frame of the packed blocks,
/// which the peer reduces after it has arrived (so that the receive's bookkeeping stays small).
pub const DIRECT_RUNS: usize = 64;

/// All-reduces of fewer bytes run dense: the bitmap exchange costs a round trip.
pub const MIN_BYTES: usize = 64 * ZERO_BLOCK_BYTES;

thread_local! {
    /// This rank's packed non-zero blocks, kept between calls (like the canonical scratch).
    static PACKED_OUT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The peer's packed blocks, when they arrive as one frame.
    static PACKED_IN: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// All-reduce of `buf` in place between the two ranks of `run` with `op` (`Sum`, or `Mean`,
/// which is summed here and divided by the caller), skipping the blocks that are all zero
/// bits. Returns the bytes this rank sent (bitmap, then blocks or the ring's share).
pub fn all_reduce_pair(run: &mut Run, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<usize> {
    assert_eq!(run.size, 2, "the zero-skipping exchange is for two ranks");
    let op = match op {
        ReduceOp::Mean => ReduceOp::Sum,
        other => other,
    };
    debug_assert_eq!(op, ReduceOp::Sum, "zero is the identity of sums only");
    let other = 1 - run.rank;
    let es = dtype.size();
    let block = block_bytes(es);
    let blocks = buf.len().div_ceil(block);
    let (mine, my_count) = nonzero_map(buf, block);
    let mut theirs = vec![0u8; mine.len()];
    run.step(
        0,
        Some((other, &mine)),
        Some((other, Sink::Buf(&mut theirs))),
    )?;
    let their_count: usize = (0..blocks).filter(|&b| is_set(&theirs, b)).count();
    if my_count == blocks && their_count == blocks {
        let count = buf.len() / es;
        ring::all_reduce(run, None, buf, &even_segments(count, 2, es), dtype, op)?;
        return Ok(mine.len() + buf.len());
    }
    // x0 ⊕ x1 on both ranks: rank 0 holds x0, rank 1 receives it.
    let order = if run.rank == 0 {
        Order::AccFirst
    } else {
        Order::SrcFirst
    };
    let my_runs = runs(&mine, block, buf.len());
    let their_runs = runs(&theirs, block, buf.len());
    let my_len: usize = my_runs.iter().map(Range::len).sum();
    let their_len: usize = their_runs.iter().map(Range::len).sum();
    canonical::with_kept(&PACKED_OUT, my_len, |packed| -> Result<()> {
        let mut at = 0;
        for r in &my_runs {
            packed[at..at + r.len()].copy_from_slice(&buf[r.clone()]);
            at += r.len();
        }
        let sends: Vec<(usize, u32, &[u8])> = if my_runs.len() <= DIRECT_RUNS {
            let mut at = 0;
            (0..my_runs.len())
                .map(|i| {
                    let part = &packed[at..at + my_runs[i].len()];
                    at += part.len();
                    (other, 1 + i as u32, part)
                })
                .collect()
        } else {
            vec![(other, 1, &packed[..])]
        };
        if their_runs.len() <= DIRECT_RUNS {
            let recvs = disjoint_mut(buf, &their_runs)
                .into_iter()
                .enumerate()
                .map(|(i, dst)| {
                    let sink = Sink::Reduce {
                        dst,
                        acc: None,
                        dtype,
                        op,
                        order,
                    };
                    (other, 1 + i as u32, sink)
                })
                .collect();
            run.exchange(sends, recvs)
        } else {
            canonical::with_kept(&PACKED_IN, their_len, |arrived| -> Result<()> {
                run.exchange(sends, vec![(other, 1, Sink::Buf(arrived))])?;
                let mut at = 0;
                for r in &their_runs {
                    reduce_into(
                        dtype,
                        op,
                        &mut buf[r.clone()],
                        &arrived[at..at + r.len()],
                        order,
                    );
                    at += r.len();
                }
                Ok(())
            })
        }
    })?;
    if dtype.is_float() {
        // My non-zero blocks the other rank did not send: plus its zeros, as the dense sum.
        let zeros = vec![0u8; block];
        let len = buf.len();
        for b in (0..blocks).filter(|&b| is_set(&mine, b) && !is_set(&theirs, b)) {
            let dst = &mut buf[b * block..((b + 1) * block).min(len)];
            let len = dst.len();
            reduce_into(dtype, op, dst, &zeros[..len], order);
        }
    }
    Ok(mine.len() + my_len)
}

/// Reduce-scatter between the two ranks of `run` with `op` (`Sum`, or `Mean`, summed here and
/// divided by the caller), skipping the blocks that are all zero bits: `send` is this rank's
/// input for the other rank's segment, `out` this rank's segment, holding its own input for
/// it on entry and the sum on return. Each rank sends the bitmap of `send`'s non-zero blocks,
/// then those blocks (one frame per run up to [`DIRECT_RUNS`] runs, reduced in place as they
/// arrive; one packed frame beyond), and adds `+0.0`s to its own non-zero float blocks the
/// other did not send, so the result is bitwise the dense reduce-scatter's (`x_other + x_own`,
/// one addition, in the ring's operand order). Returns the bytes this rank sent.
pub fn reduce_scatter_pair(
    run: &mut Run,
    send: &[u8],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<usize> {
    assert_eq!(run.size, 2, "the zero-skipping exchange is for two ranks");
    let op = match op {
        ReduceOp::Mean => ReduceOp::Sum,
        other => other,
    };
    debug_assert_eq!(op, ReduceOp::Sum, "zero is the identity of sums only");
    let other = 1 - run.rank;
    let block = block_bytes(dtype.size());
    let (mine, _) = nonzero_map(send, block);
    let mut theirs = vec![0u8; out.len().div_ceil(block).div_ceil(8)];
    run.step(
        0,
        Some((other, &mine)),
        Some((other, Sink::Buf(&mut theirs))),
    )?;
    // the ring's operand order for two ranks: what arrives first, then the own value
    let order = Order::SrcFirst;
    let own = dtype.is_float().then(|| nonzero_map(out, block).0);
    let my_runs = runs(&mine, block, send.len());
    let their_runs = runs(&theirs, block, out.len());
    let my_len: usize = my_runs.iter().map(Range::len).sum();
    if my_runs.len() <= DIRECT_RUNS {
        // `send` is not written here: its runs go out as they are, no copy
        let sends = my_runs
            .iter()
            .enumerate()
            .map(|(i, r)| (other, 1 + i as u32, &send[r.clone()]))
            .collect();
        receive_runs(run, sends, out, &their_runs, dtype, order)?;
    } else {
        canonical::with_kept(&PACKED_OUT, my_len, |packed| -> Result<()> {
            let mut at = 0;
            for r in &my_runs {
                packed[at..at + r.len()].copy_from_slice(&send[r.clone()]);
                at += r.len();
            }
            receive_runs(
                run,
                vec![(other, 1, &packed[..])],
                out,
                &their_runs,
                dtype,
                order,
            )
        })?;
    }
    if let Some(own) = own {
        // My non-zero blocks the other rank did not send: its zeros plus mine, as the dense sum.
        let zeros = vec![0u8; block];
        let len = out.len();
        for b in (0..len.div_ceil(block)).filter(|&b| is_set(&own, b) && !is_set(&theirs, b)) {
            let dst = &mut out[b * block..((b + 1) * block).min(len)];
            let n = dst.len();
            reduce_into(dtype, op, dst, &zeros[..n], order);
        }
    }
    Ok(mine.len() + my_len)
}

/// Send `sends` to the other rank of `run` while receiving its runs `their_runs` of `out`
/// (frames `1..`, or one packed frame beyond [`DIRECT_RUNS`] runs) and summing them into `out`.
fn receive_runs(
    run: &mut Run,
    sends: Vec<(usize, u32, &[u8])>,
    out: &mut [u8],
    their_runs: &[Range<usize>],
    dtype: DType,
    order: Order,
) -> Result<()> {
    let other = 1 - run.rank;
    let op = ReduceOp::Sum;
    if their_runs.len() <= DIRECT_RUNS {
        let recvs = disjoint_mut(out, their_runs)
            .into_iter()
            .enumerate()
            .map(|(i, dst)| {
                let sink = Sink::Reduce {
                    dst,
                    acc: None,
                    dtype,
                    op,
                    order,
                };
                (other, 1 + i as u32, sink)
            })
            .collect();
        return run.exchange(sends, recvs);
    }
    let their_len: usize = their_runs.iter().map(Range::len).sum();
    canonical::with_kept(&PACKED_IN, their_len, |arrived| -> Result<()> {
        run.exchange(sends, vec![(other, 1, Sink::Buf(arrived))])?;
        let mut at = 0;
        for r in their_runs {
            reduce_into(
                dtype,
                op,
                &mut out[r.clone()],
                &arrived[at..at + r.len()],
                order,
            );
            at += r.len();
        }
        Ok(())
    })
}

/// Mutable slices of `buf` at `ranges` (ascending, disjoint).
fn disjoint_mut<'a>(buf: &'a mut [u8], ranges: &[Range<usize>]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut rest = buf;
    let mut base = 0;
    for r in ranges {
        let (_, tail) = rest.split_at_mut(r.start - base);
        let (part, tail) = tail.split_at_mut(r.len());
        out.push(part);
        rest = tail;
        base = r.end;
    }
    out
}
