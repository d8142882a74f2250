//! Recursive doubling all-reduce, linear gather/scatter, pairwise all-to-all, dissemination
//! barrier.

use super::{Run, ROOT_CHECK_STEP};
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::Result;
use crate::base::reduce::{reduce_into, Order};
use crate::transport::ops::Sink;
use std::ops::Range;

/// Recursive-doubling all-reduce in place. Any world size: with `p2` the largest power of two
/// not above `n` and `rem = n - p2`, ranks `2i` (i < rem) first hand their data to `2i + 1`
/// and get the result back at the end. Memory: one copy of the vector.
pub fn all_reduce_rd(run: &mut Run, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let n = run.size;
    let r = run.rank;
    let p2 = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    let rem = n - p2;
    let mut tmp = vec![0u8; buf.len()];
    let vrank = if r < 2 * rem {
        if r.is_multiple_of(2) {
            run.step(0, Some((r + 1, &*buf)), None)?;
            None
        } else {
            run.step(
                0,
                None,
                Some((
                    r - 1,
                    Sink::Reduce {
                        dst: &mut *buf,
                        acc: None,
                        dtype,
                        op,
                        order: Order::SrcFirst,
                    },
                )),
            )?;
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(v) = vrank {
        let mut mask = 1;
        let mut step = 1;
        while mask < p2 {
            let pv = v ^ mask;
            let partner = if pv < rem { pv * 2 + 1 } else { pv + rem };
            run.exchange(
                vec![(partner, step, &*buf)],
                vec![(partner, step, Sink::Buf(&mut tmp))],
            )?;
            let order = if pv < v {
                Order::SrcFirst
            } else {
                Order::AccFirst
            };
            reduce_into(dtype, op, buf, &tmp, order);
            mask <<= 1;
            step += 1;
        }
    }
    if r < 2 * rem {
        if r % 2 == 1 {
            run.step(u32::MAX, Some((r - 1, &*buf)), None)?;
        } else {
            run.step(u32::MAX, None, Some((r + 1, Sink::Buf(buf))))?;
        }
    }
    Ok(())
}

/// Linear gather: every rank sends `input` to the root, which receives all at once into the
/// `segs` of `output`.
pub fn gather_linear(
    run: &mut Run,
    input: &[u8],
    output: &mut [u8],
    segs: &[Range<usize>],
    root: usize,
) -> Result<()> {
    if run.rank != root {
        return run.step(0, Some((root, input)), None);
    }
    let mut recvs = Vec::new();
    let mut rest: &mut [u8] = output;
    let mut off = 0;
    for (p, seg) in segs.iter().enumerate() {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(seg.end - off);
        let part = &mut head[seg.start - off..];
        off = seg.end;
        rest = tail;
        if p == root {
            part.copy_from_slice(input);
        } else {
            recvs.push((p, 0, Sink::Buf(part)));
        }
    }
    run.exchange(Vec::new(), recvs)
}

/// Linear scatter: the root sends segment `p` of `input` to rank `p`, all at once.
pub fn scatter_linear(
    run: &mut Run,
    input: &[u8],
    output: &mut [u8],
    segs: &[Range<usize>],
    root: usize,
) -> Result<()> {
    // The rank before the root confirms it ([`ROOT_CHECK_STEP`]).
    let confirmer = (root + run.size - 1) % run.size;
    if run.rank != root {
        let check: Vec<(usize, u32, &[u8])> = if run.rank == confirmer {
            vec![(root, ROOT_CHECK_STEP, &[])]
        } else {
            Vec::new()
        };
        return run.exchange(check, vec![(root, 0, Sink::Buf(output))]);
    }
    let mut sends = Vec::new();
    for (p, seg) in segs.iter().enumerate() {
        if p == root {
            output.copy_from_slice(&input[seg.clone()]);
        } else {
            sends.push((p, 0, &input[seg.clone()]));
        }
    }
    let check = if run.size > 1 {
        vec![(confirmer, ROOT_CHECK_STEP, Sink::Buf(&mut []))]
    } else {
        Vec::new()
    };
    run.exchange(sends, check)
}

/// Pairwise all-to-all: every rank sends segment `p` of `input` to rank `p` and receives rank
/// `p`'s into segment `p` of `output`, all transfers at once.
pub fn all_to_all_pairwise(
    run: &mut Run,
    input: &[u8],
    send_segs: &[Range<usize>],
    output: &mut [u8],
    recv_segs: &[Range<usize>],
) -> Result<()> {
    let me = run.rank;
    let n = run.size;
    let mut sends = Vec::new();
    // Post in rotated order so that rank p's first send goes to p+1, spreading load.
    for k in 1..n {
        let p = (me + k) % n;
        sends.push((p, 0, &input[send_segs[p].clone()]));
    }
    let mut recvs = Vec::new();
    let mut rest: &mut [u8] = output;
    let mut off = 0;
    for (p, seg) in recv_segs.iter().enumerate() {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(seg.end - off);
        let part = &mut head[seg.start - off..];
        off = seg.end;
        rest = tail;
        if p == me {
            part.copy_from_slice(&input[send_segs[me].clone()]);
        } else {
            recvs.push((p, 0, Sink::Buf(part)));
        }
    }
    run.exchange(sends, recvs)
}

/// Dissemination barrier: ceil(log2 n) rounds of empty messages.
pub fn barrier_dissemination(run: &mut Run) -> Result<()> {
    let n = run.size;
    let r = run.rank;
    let mut dist = 1;
    let mut step = 0;
    while dist < n {
        let to = (r + dist) % n;
        let from = (r + n - dist) % n;
        run.exchange(
            vec![(to, step, &[][..])],
            vec![(from, step, Sink::Buf(&mut []))],
        )?;
        dist <<= 1;
        step += 1;
    }
    Ok(())
}
