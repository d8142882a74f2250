//! Ring algorithms: reduce-scatter, all-gather, and all-reduce as their composition.
//!
//! With `n` ranks and `S` bytes each rank sends and receives `S (n-1)/n` bytes per phase, the
//! bandwidth optimum; each step's receive is reduced through a fixed-size staging buffer while
//! the next bytes arrive, so reduction overlaps transfer.

use super::Run;
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::Result;
use crate::base::reduce::Order;
use crate::base::segments::split_two;
use crate::transport::ops::Sink;
use std::ops::Range;

fn neighbours(run: &Run) -> (usize, usize) {
    let n = run.size;
    ((run.rank + 1) % n, (run.rank + n - 1) % n)
}

/// Ring reduce-scatter into `buf` split into `segs`: afterwards segment `rank` holds the
/// reduction of every rank's segment `rank`; other segments hold partial sums. Uses steps
/// `step0 .. step0 + n - 1`.
///
/// With `input`, this rank's contribution is read from it, and `buf` need not be filled first:
/// each received segment is reduced with `input`'s in one pass into `buf` (bitwise what
/// copying `input` into `buf` first gives); segment `rank - 1` of `buf`, which this rank
/// only sends, is left unwritten.
pub fn reduce_scatter_in_place(
    run: &mut Run,
    input: Option<&[u8]>,
    buf: &mut [u8],
    segs: &[Range<usize>],
    dtype: DType,
    op: ReduceOp,
    step0: u32,
) -> Result<()> {
    let n = run.size;
    let r = run.rank;
    let (right, left) = neighbours(run);
    for t in 0..n - 1 {
        let s_idx = (r + 2 * n - t - 1) % n;
        let r_idx = (r + 2 * n - t - 2) % n;
        let (send, recv) = split_two(buf, segs[s_idx].clone(), segs[r_idx].clone());
        // Step 0 sends this rank's own contribution; later steps forward partial sums.
        let send = match input {
            Some(i) if t == 0 => &i[segs[s_idx].clone()],
            _ => send,
        };
        run.step(
            step0 + t as u32,
            Some((right, send)),
            Some((
                left,
                Sink::Reduce {
                    dst: recv,
                    acc: input.map(|i| &i[segs[r_idx].clone()]),
                    dtype,
                    op,
                    order: Order::SrcFirst,
                },
            )),
        )?;
    }
    Ok(())
}

/// In-place ring all-gather: segment `rank` of `buf` is this rank's contribution; afterwards
/// every segment holds its owner's. Uses steps `step0 .. step0 + n - 1`.
pub fn all_gather_in_place(
    run: &mut Run,
    buf: &mut [u8],
    segs: &[Range<usize>],
    step0: u32,
) -> Result<()> {
    let n = run.size;
    let r = run.rank;
    let (right, left) = neighbours(run);
    for t in 0..n - 1 {
        let s_idx = (r + n - t) % n;
        let r_idx = (r + 2 * n - t - 1) % n;
        let (send, recv) = split_two(buf, segs[s_idx].clone(), segs[r_idx].clone());
        run.step(
            step0 + t as u32,
            Some((right, send)),
            Some((left, Sink::Buf(recv))),
        )?;
    }
    Ok(())
}

/// Ring all-reduce: reduce-scatter then all-gather, into `buf` — in place, or from `input`
/// when given (no copy of `input` into `buf` first: every byte of `buf` is written by a
/// reduction or by the all-gather).
pub fn all_reduce(
    run: &mut Run,
    input: Option<&[u8]>,
    buf: &mut [u8],
    segs: &[Range<usize>],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    if run.size == 1 {
        if let Some(i) = input {
            buf.copy_from_slice(i);
        }
        return Ok(());
    }
    if run.size == 2 && buf.len() >= 2 * PAIR_CHUNK {
        return all_reduce_pair_pipelined(run, input, buf, segs, dtype, op);
    }
    reduce_scatter_in_place(run, input, buf, segs, dtype, op, 0)?;
    all_gather_in_place(run, buf, segs, run.size as u32)
}

/// Chunk of `all_reduce_pair_pipelined`, a multiple of every element size. 2 ranks over
/// loopback TCP, 64 MiB (2026-12-06): 256 KiB to 1 MiB all about 1.3x the two-phase ring,
/// 64–128 KiB less; vectors under two chunks keep the two-phase ring.
pub const PAIR_CHUNK: usize = 512 << 10;

/// The 2-rank ring all-reduce, its two phases pipelined by chunks. Exchange `j` sends the
/// peer this rank's contribution to chunk `j` of the peer's segment, and chunk `j - 1` of this
/// rank's own segment, reduced in exchange `j - 1` and still in cache; it receives the peer's
/// contribution to chunk `j` of this rank's segment (reduced with this rank's as it arrives,
/// the peer's first, as the ring's order has it) and the peer's reduced chunk `j - 1`. The
/// same operations in the same order as the two-phase ring (bitwise its result), with the
/// all-gather's sends read from cache instead of memory and no phase boundary.
fn all_reduce_pair_pipelined(
    run: &mut Run,
    input: Option<&[u8]>,
    buf: &mut [u8],
    segs: &[Range<usize>],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (me, peer) = (run.rank, 1 - run.rank);
    let c = PAIR_CHUNK;
    let chunks = segs[0].len().max(segs[1].len()).div_ceil(c);
    // Byte range of chunk `j` of segment `s`, within `buf`.
    let chunk = |s: usize, j: usize| {
        let seg = &segs[s];
        let lo = (seg.start + j * c).min(seg.end);
        lo..(lo + c).min(seg.end)
    };
    for j in 0..=chunks {
        let step = 2 * j as u32;
        // Split `buf` into the four disjoint pieces this exchange touches.
        let (mine, theirs) = {
            let (lo, hi) = buf.split_at_mut(segs[1].start);
            if me == 0 {
                (lo, hi)
            } else {
                (hi, lo)
            }
        };
        let rel = |s: usize, j: usize| {
            let r = chunk(s, j);
            r.start - segs[s].start..r.end - segs[s].start
        };
        let at = |s: usize| (j * c).min(segs[s].len());
        let (mine_done, mine_next) = mine.split_at_mut(at(me));
        let (theirs_done, theirs_next) = theirs.split_at_mut(at(peer));
        let mut sends: Vec<(usize, u32, &[u8])> = Vec::with_capacity(2);
        let mut recvs: Vec<(usize, u32, Sink)> = Vec::with_capacity(2);
        // The reduced chunk first, while it is in cache.
        if j > 0 {
            let done = rel(me, j - 1);
            sends.push((peer, step - 1, &mine_done[done]));
            let got = rel(peer, j - 1);
            recvs.push((peer, step - 1, Sink::Buf(&mut theirs_done[got])));
        }
        if j < chunks {
            let n_peer = rel(peer, j).len();
            let n_me = rel(me, j).len();
            let own: &[u8] = match input {
                Some(i) => &i[chunk(peer, j)],
                None => &theirs_next[..n_peer],
            };
            sends.push((peer, step, own));
            recvs.push((
                peer,
                step,
                Sink::Reduce {
                    dst: &mut mine_next[..n_me],
                    acc: input.map(|i| &i[chunk(me, j)]),
                    dtype,
                    op,
                    order: Order::SrcFirst,
                },
            ));
        }
        run.exchange(sends, recvs)?;
    }
    Ok(())
}

/// Out-of-place ring reduce-scatter that never writes `input`: `output` receives the
/// reduction of segment `rank`. Memory: two buffers of the largest segment.
///
/// When `input` is `None` the operation is in place on `output_full` (NCCL convention: the
/// result lands in segment `rank` of the same buffer; the other segments are not modified).
pub fn reduce_scatter(
    run: &mut Run,
    io: RsIo,
    segs: &[Range<usize>],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let n = run.size;
    let r = run.rank;
    let (right, left) = neighbours(run);
    let max = segs.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut tmp = vec![0u8; if n > 2 { 2 * max } else { 0 }];
    let (mut io_in, mut io_out): (Option<&[u8]>, Option<&mut [u8]>) = (None, None);
    let mut inplace: Option<&mut [u8]> = None;
    match io {
        RsIo::Out { input, output } => {
            io_in = Some(input);
            io_out = Some(output);
        }
        RsIo::InPlace(buf) => inplace = Some(buf),
    }
    for t in 0..n - 1 {
        let s_idx = (r + 2 * n - t - 1) % n;
        let r_idx = (r + 2 * n - t - 2) % n;
        let last = t == n - 2;
        let half = max.min(tmp.len());
        let (t0, t1) = tmp.split_at_mut(half);
        let (cur, prev) = if t % 2 == 0 { (t0, &*t1) } else { (t1, &*t0) };
        let step = t as u32;
        // Source of this step's send; target of its receive, which the reduction writes from
        // this rank's input and what arrives (nothing is copied into it first).
        match (&mut inplace, &mut io_out) {
            (Some(buf), _) => {
                if t == 0 && last {
                    // n == 2: send input segment r-1, receive into segment r of the same buffer.
                    let (send, recv) = split_two(buf, segs[s_idx].clone(), segs[r_idx].clone());
                    run.step(
                        step,
                        Some((right, send)),
                        Some((left, reduce_sink(recv, dtype, op))),
                    )?;
                } else if last {
                    let send = &prev[..segs[s_idx].len()];
                    let recv = &mut buf[segs[r_idx].clone()];
                    run.step(
                        step,
                        Some((right, send)),
                        Some((left, reduce_sink(recv, dtype, op))),
                    )?;
                } else {
                    let recv = &mut cur[..segs[r_idx].len()];
                    let send: &[u8] = if t == 0 {
                        &buf[segs[s_idx].clone()]
                    } else {
                        &prev[..segs[s_idx].len()]
                    };
                    let acc = &buf[segs[r_idx].clone()];
                    run.step(
                        step,
                        Some((right, send)),
                        Some((left, reduce_sink_from(recv, acc, dtype, op))),
                    )?;
                }
            }
            (None, Some(out)) => {
                let input = io_in.expect("out-of-place input");
                let send: &[u8] = if t == 0 {
                    &input[segs[s_idx].clone()]
                } else {
                    &prev[..segs[s_idx].len()]
                };
                let recv: &mut [u8] = if last {
                    out
                } else {
                    &mut cur[..segs[r_idx].len()]
                };
                let acc = &input[segs[r_idx].clone()];
                run.step(
                    step,
                    Some((right, send)),
                    Some((left, reduce_sink_from(recv, acc, dtype, op))),
                )?;
            }
            (None, None) => unreachable!(),
        }
    }
    if n == 1 {
        if let (Some(input), Some(out)) = (io_in, io_out) {
            out.copy_from_slice(&input[segs[0].clone()]);
        }
    }
    Ok(())
}

fn reduce_sink(dst: &mut [u8], dtype: DType, op: ReduceOp) -> Sink<'_> {
    Sink::Reduce {
        dst,
        acc: None,
        dtype,
        op,
        order: Order::SrcFirst,
    }
}

/// A sink writing `incoming ⊕ acc` into `dst` in one pass (`dst` need not be filled).
fn reduce_sink_from<'a>(dst: &'a mut [u8], acc: &'a [u8], dtype: DType, op: ReduceOp) -> Sink<'a> {
    Sink::Reduce {
        dst,
        acc: Some(acc),
        dtype,
        op,
        order: Order::SrcFirst,
    }
}

/// Buffers of a reduce-scatter.
pub enum RsIo<'a> {
    /// Separate input (all segments) and output (this rank's segment).
    Out {
        /// Every rank's contribution, `segs`-shaped.
        input: &'a [u8],
        /// This rank's result.
        output: &'a mut [u8],
    },
    /// One buffer; the result lands in segment `rank`.
    InPlace(&'a mut [u8]),
}
