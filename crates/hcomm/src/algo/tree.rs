//! Rooted collectives: binomial trees for small messages, pipelined chains for large ones.
//!
//! Ranks are renumbered into virtual ranks `v = (rank - root) mod n` so the root is 0.

use super::{Run, ROOT_CHECK_STEP};
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::Result;
use crate::base::reduce::Order;
use crate::transport::ops::Sink;

/// Chunk size of the pipelined chain.
pub const CHAIN_CHUNK: usize = 512 << 10;

fn real(v: usize, root: usize, n: usize) -> usize {
    (v + root) % n
}

/// Binomial-tree broadcast of `buf` from `root`.
/// The last virtual rank confirms the root ([`ROOT_CHECK_STEP`]).
pub fn broadcast_tree(run: &mut Run, buf: &mut [u8], root: usize) -> Result<()> {
    let n = run.size;
    let v = (run.rank + n - root) % n;
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            let parent = real(v - mask, root, n);
            // The last virtual rank (a leaf) confirms the root.
            let check: Vec<(usize, u32, &[u8])> = if v == n - 1 {
                vec![(root, ROOT_CHECK_STEP, &[])]
            } else {
                Vec::new()
            };
            run.exchange(check, vec![(parent, 0, Sink::Buf(buf))])?;
            break;
        }
        mask <<= 1;
    }
    let mut sends = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if v + mask < n {
            sends.push((real(v + mask, root, n), 0u32, &*buf));
        }
        mask >>= 1;
    }
    let check = if v == 0 && n > 1 {
        vec![(real(n - 1, root, n), ROOT_CHECK_STEP, Sink::Buf(&mut []))]
    } else {
        Vec::new()
    };
    if !sends.is_empty() || !check.is_empty() {
        run.exchange(sends, check)?;
    }
    Ok(())
}

/// Pipelined chain broadcast: the root streams chunks to v=1, which forwards each to v=2
/// while receiving the next, and so on.
pub fn broadcast_chain(run: &mut Run, buf: &mut [u8], root: usize) -> Result<()> {
    let n = run.size;
    let v = (run.rank + n - root) % n;
    let parent = (v > 0).then(|| real(v - 1, root, n));
    let child = (v + 1 < n).then(|| real(v + 1, root, n));
    let chunks: Vec<_> = chunk_ranges(buf.len());
    let nc = chunks.len();
    for k in 0..=nc {
        // Receive chunk k from the parent while forwarding chunk k-1 (the root sends chunk k).
        let recv_idx = (k < nc && parent.is_some()).then_some(k);
        let send_idx = match (parent, child) {
            (_, None) => None,
            (None, Some(_)) => (k < nc).then_some(k),
            (Some(_), Some(_)) => k.checked_sub(1),
        };
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        // The root check ([`ROOT_CHECK_STEP`]) rides on the first chunk's step.
        if k == 0 && v == n - 1 {
            sends.push((root, ROOT_CHECK_STEP, &[][..]));
        }
        if k == 0 && v == 0 {
            recvs.push((real(n - 1, root, n), ROOT_CHECK_STEP, Sink::Buf(&mut [])));
        }
        match (send_idx, recv_idx) {
            (Some(s), Some(r)) => {
                let (sb, rb) =
                    crate::base::segments::split_two(buf, chunks[s].clone(), chunks[r].clone());
                sends.push((child.unwrap(), s as u32, sb));
                recvs.push((parent.unwrap(), r as u32, Sink::Buf(rb)));
                run.exchange(sends, recvs)?;
            }
            (Some(s), None) => run.exchange(
                vec![(child.unwrap(), s as u32, &buf[chunks[s].clone()])],
                recvs,
            )?,
            (None, Some(r)) => run.exchange(
                sends,
                vec![(
                    parent.unwrap(),
                    r as u32,
                    Sink::Buf(&mut buf[chunks[r].clone()]),
                )],
            )?,
            (None, None) => {}
        }
    }
    Ok(())
}

fn chunk_ranges(len: usize) -> Vec<std::ops::Range<usize>> {
    if len == 0 {
        // One empty chunk, so that an empty message is still one (empty) frame.
        return std::iter::once(0..0).collect();
    }
    (0..len)
        .step_by(CHAIN_CHUNK)
        .map(|s| s..(s + CHAIN_CHUNK).min(len))
        .collect()
}

/// Binomial-tree reduce into `acc` (which holds this rank's contribution on entry; on the
/// root it holds the result on return, elsewhere it is scratch).
pub fn reduce_tree(
    run: &mut Run,
    acc: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = run.size;
    let v = (run.rank + n - root) % n;
    let mut mask = 1;
    while mask < n {
        if v & mask == 0 {
            let child = v | mask;
            if child < n {
                let sink = Sink::Reduce {
                    dst: &mut *acc,
                    acc: None,
                    dtype,
                    op,
                    order: Order::AccFirst,
                };
                run.step(mask as u32, None, Some((real(child, root, n), sink)))?;
            }
        } else {
            run.step(mask as u32, Some((real(v & !mask, root, n), &*acc)), None)?;
            break;
        }
        mask <<= 1;
    }
    Ok(())
}

/// Pipelined chain reduce toward the root: v = n-1 streams its chunks to v = n-2, which adds
/// its own and forwards, …, to the root. `input` is this rank's contribution; on the root
/// `output` receives the result (ignored elsewhere). Memory: two chunks.
pub fn reduce_chain(
    run: &mut Run,
    input: &[u8],
    output: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = run.size;
    let v = (run.rank + n - root) % n;
    let parent = (v > 0).then(|| real(v - 1, root, n));
    let child = (v + 1 < n).then(|| real(v + 1, root, n));
    let chunks = chunk_ranges(input.len());
    let nc = chunks.len();
    let mut bufs = if parent.is_some() && child.is_some() {
        vec![0u8; 2 * CHAIN_CHUNK.min(input.len())]
    } else {
        Vec::new()
    };
    let half = bufs.len() / 2;
    for k in 0..=nc {
        let step = k as u32;
        match (parent, child) {
            (None, None) => {
                output.copy_from_slice(input);
                break;
            }
            // Tail: stream own chunks.
            (Some(p), None) => {
                if k < nc {
                    run.step(step, Some((p, &input[chunks[k].clone()])), None)?;
                }
            }
            // Root: reduce each arriving chunk into the output.
            (None, Some(c)) => {
                if k < nc {
                    let out = &mut output[chunks[k].clone()];
                    out.copy_from_slice(&input[chunks[k].clone()]);
                    run.step(
                        step,
                        None,
                        Some((
                            c,
                            Sink::Reduce {
                                dst: out,
                                acc: None,
                                dtype,
                                op,
                                order: Order::AccFirst,
                            },
                        )),
                    )?;
                }
            }
            // Middle: receive+reduce chunk k into one buffer while sending chunk k-1 from the other.
            (Some(p), Some(c)) => {
                let (b0, b1) = bufs.split_at_mut(half);
                let (cur, prev) = if k % 2 == 0 { (b0, &*b1) } else { (b1, &*b0) };
                let mut sends = Vec::new();
                let mut recvs = Vec::new();
                if k >= 1 {
                    sends.push((p, (k - 1) as u32, &prev[..chunks[k - 1].len()]));
                }
                if k < nc {
                    let dst = &mut cur[..chunks[k].len()];
                    dst.copy_from_slice(&input[chunks[k].clone()]);
                    recvs.push((
                        c,
                        step,
                        Sink::Reduce {
                            dst,
                            acc: None,
                            dtype,
                            op,
                            order: Order::AccFirst,
                        },
                    ));
                }
                run.exchange(sends, recvs)?;
            }
        }
    }
    Ok(())
}
