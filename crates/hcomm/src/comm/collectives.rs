//! Public collective operations: argument checks, in-place/out-of-place handling, and the
//! dispatch to an algorithm.
//!
//! Conventions (NCCL's): counts are in elements; out-of-place forms never modify the input;
//! on non-root ranks the root-only buffers of rooted operations may be empty.

use crate::algo::{basic, canonical, gather_cache, ring, skip_zeros, tree};
use crate::base::dtype::{DType, Element, ReduceOp};
use crate::base::error::{Error, OpContext, Result};
use crate::base::reduce::finalize_mean;
use crate::base::segments::{count_segments, even_segments};
use crate::base::{half_mean, integer_mean};
use crate::comm::{Communicator, Hierarchy};
use crate::wire::collective::{Algo, Collective};

/// Hash of per-rank block sizes: part of the shared-memory fingerprint of the v-variants.
fn counts_hash(blocks: &[usize]) -> u64 {
    crate::base::ids::fold_hash(blocks.iter().map(|&b| b as u64))
}

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    fn bad(&self, op: &'static str, msg: String) -> Error {
        Error::invalid(op, 0, msg)
    }

    /// The sum of the per-rank element counts `what`, refused when it (or its size in bytes)
    /// overflows: a wrapped sum would pass the buffer checks (`[1 << 63, 1 << 63]` sums to 0).
    fn counts_total(
        &self,
        op: &'static str,
        what: &str,
        counts: &[usize],
        dtype: DType,
    ) -> Result<usize> {
        counts
            .iter()
            .try_fold(0usize, |t, &c| t.checked_add(c))
            .filter(|t| t.checked_mul(dtype.size()).is_some())
            .ok_or_else(|| {
                self.bad(
                    op,
                    format!("the {what} sum to more elements than any buffer can hold"),
                )
            })
    }

    pub(crate) fn check_len(
        &self,
        op: &'static str,
        what: &str,
        buf: &[u8],
        dtype: DType,
    ) -> Result<usize> {
        if !buf.len().is_multiple_of(dtype.size()) {
            return Err(self.bad(
                op,
                format!(
                    "{what} is {} bytes, not a whole number of {dtype} elements ({} bytes each)",
                    buf.len(),
                    dtype.size()
                ),
            ));
        }
        Ok(buf.len() / dtype.size())
    }

    // ===== all-reduce =====

    /// All-reduce `send` into `recv` (same length) with `op`.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(Some(bytes(send)), bytes_mut(recv), T::DTYPE, op)
    }

    /// All-reduce `buf` in place.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(None, bytes_mut(buf), T::DTYPE, op)
    }

    /// Byte-level all-reduce: `send = None` means in place on `recv`.
    pub fn all_reduce_bytes(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        let count = self.check_len(OP, "recv buffer", recv, dtype)?;
        if let Some(s) = send {
            if s.len() != recv.len() {
                return Err(self.bad(
                    OP,
                    format!(
                        "send buffer has {} elements but recv buffer has {count}",
                        s.len() / dtype.size()
                    ),
                ));
            }
        }
        let n = self.world_size();
        if op == ReduceOp::Mean && n > 1 && integer_mean::lanes(dtype).is_some() {
            // Summed in the element type, a mean of integers would wrap before dividing.
            let mut lanes = integer_mean::widen(dtype, send.unwrap_or(recv));
            self.all_reduce_in_place(&mut lanes, ReduceOp::Sum)?;
            integer_mean::narrow_mean(dtype, &lanes, n, recv);
            return Ok(());
        }
        if op == ReduceOp::Mean && n > 1 && self.means_in_f32(dtype) {
            // f16/bf16 accumulated in f32: summed in f32, divided and rounded once.
            let mut sums = half_mean::widen(dtype, send.unwrap_or(recv));
            Self::canonically(|| self.all_reduce_in_place(&mut sums, ReduceOp::Sum))?;
            half_mean::narrow_mean(dtype, &sums, n, recv);
            return Ok(());
        }
        // The algorithm is read in this operation's turn, after every operation issued before
        // it (a job may have changed it with `set_algorithm`): read before, ranks where that
        // job had not run yet would choose another algorithm than the others.
        let _turn = self.engine().turns.enter();
        if self.hierarchical_layout().is_some()
            && self.algorithm_for_dtype(Collective::AllReduce, recv.len(), dtype)
                == Algo::Hierarchical
        {
            if let Some(s) = send {
                recv.copy_from_slice(s);
            }
            if self.canonical_for(Some(dtype)) {
                // Deterministic mode (or f16/bf16 accumulated in f32): the canonical form.
                self.all_reduce_canonical_hierarchical(recv, dtype, op)?;
            } else {
                // The cross-host step skips zero blocks as this communicator now says (its
                // sub-communicators were made with the setting of that time).
                let skip_zeros = self.skips_zeros();
                self.hierarchically(OP, recv, dtype, op, |across, slice, inner_op| {
                    across
                        .skip_zeros
                        .store(skip_zeros, std::sync::atomic::Ordering::Relaxed);
                    across.all_reduce_bytes(None, slice, dtype, inner_op)
                })?;
            }
            self.inject_fault(recv);
            return Ok(());
        }
        let skip_zeros = self.skips_zeros_for(recv.len(), op);
        self.collective(
            Collective::AllReduce,
            Some(dtype),
            Some(op),
            None,
            count,
            recv.len(),
            |run, algo| {
                if algo == Algo::Shm {
                    let (g, w, fp) = run.shm_parts();
                    return g.all_reduce(send, recv, dtype, op, None, fp, &w);
                }
                // The ring reads an out-of-place input itself (reducing it with what arrives,
                // one pass); the other schedules work in place on a copy.
                let ring = !skip_zeros
                    && n > 1
                    && !matches!(algo, Algo::RecursiveDoubling | Algo::Canonical);
                if let Some(s) = send.filter(|_| !ring) {
                    recv.copy_from_slice(s);
                }
                if skip_zeros {
                    // Two ranks on different hosts: bitwise what any dense schedule gives.
                    run.run.fp.algo = crate::wire::collective::SKIP_ZEROS_CODE;
                    skip_zeros::all_reduce_pair(run, recv, dtype, op)?;
                    run.ran = Some("skip-zeros");
                } else if n > 1 {
                    match algo {
                        Algo::RecursiveDoubling => basic::all_reduce_rd(run, recv, dtype, op)?,
                        Algo::Canonical => canonical::all_reduce(run, recv, dtype, op)?,
                        _ => ring::all_reduce(
                            run,
                            send,
                            recv,
                            &even_segments(count, n, dtype.size()),
                            dtype,
                            op,
                        )?,
                    }
                }
                if op == ReduceOp::Mean {
                    finalize_mean(dtype, recv, n);
                }
                Ok(())
            },
        )?;
        self.inject_fault(recv);
        Ok(())
    }

    /// The canonical hierarchical all-reduce of `buf` in place (deterministic mode, hosts of
    /// consecutive ranks): within the host an all-to-all gives local rank `l` segment `l` of
    /// every local rank's vector; the same-index ranks of the hosts fold it in rank order
    /// along the chain of hosts ([`canonical::host_chain`]); an all-gather within the host
    /// gives every rank every segment. Bitwise the flat canonical all-reduce, with the
    /// cross-host bytes of the hierarchical one.
    fn all_reduce_canonical_hierarchical(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.on_hierarchy("all_reduce", buf, dtype, op, |h, ctx, buf, inner_op| {
            let es = dtype.size();
            let (l, me) = (h.within.world_size(), h.within.rank());
            let segs = even_segments(buf.len() / es, l, es);
            let counts: Vec<usize> = segs.iter().map(|s| s.len() / es).collect();
            let mine = segs[me].clone();
            canonical::with_host_parts(mine.len() * l, |gathered| {
                h.in_host(ctx, |c| {
                    c.all_to_all_v_bytes(buf, &counts, gathered, &vec![counts[me]; l], dtype)
                })?;
                let parts: Vec<&[u8]> = (0..l)
                    .map(|r| &gathered[r * mine.len()..(r + 1) * mine.len()])
                    .collect();
                h.across_hosts(ctx, |c| {
                    c.host_chain_bytes(&parts, &mut buf[mine.clone()], dtype, inner_op)
                })
            })?;
            h.in_host(ctx, |c| c.all_gather_v_bytes(None, buf, &counts, dtype))
        })
    }

    /// [`canonical::host_chain`] on this communicator (one rank per host, in host order):
    /// `out` receives the canonical fold of every rank's `parts`.
    fn host_chain_bytes(
        &self,
        parts: &[&[u8]],
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.collective(
            Collective::AllReduce,
            Some(dtype),
            Some(op),
            None,
            out.len() / dtype.size(),
            out.len(),
            |call, _| canonical::host_chain(&mut call.run, parts, out, dtype, op),
        )
    }

    /// The hierarchical schedule of an all-reduce of `buf` in place: reduce-scatter (with
    /// `op`, `Sum` for `Mean`) within the host over shared memory, `across` on this rank's
    /// slice (its bytes, and that same reduction) with the same-index ranks of the other
    /// hosts, all-gather within the host; `Mean` divides at the end. Slices are
    /// [`hierarchical_slice`](Self::hierarchical_slice)'s.
    pub(crate) fn hierarchically(
        &self,
        op_name: &'static str,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        across: impl FnOnce(&Communicator, &mut [u8], ReduceOp) -> Result<()>,
    ) -> Result<()> {
        self.on_hierarchy(op_name, buf, dtype, op, |h, ctx, buf, inner_op| {
            let l = h.within.world_size();
            let count = buf.len() / dtype.size();
            let segs = even_segments(count, l, dtype.size());
            let counts: Vec<usize> = segs.iter().map(|s| s.len() / dtype.size()).collect();
            let mine = segs[h.within.rank()].clone();
            h.in_host(ctx, |c| {
                c.reduce_scatter_v_bytes(None, buf, &counts, dtype, inner_op)
            })?;
            h.across_hosts(ctx, |c| across(c, &mut buf[mine], inner_op))?;
            h.in_host(ctx, |c| c.all_gather_v_bytes(None, buf, &counts, dtype))
        })
    }

    /// Run `body` on the hierarchy's sub-communicators as one operation of this communicator
    /// (its turn, lock, poisoning and timeout; a failure told to the peers of both
    /// sub-communicators), with `op`'s inner reduction (`Sum` for `Mean`, which divides after).
    fn on_hierarchy(
        &self,
        op_name: &'static str,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        body: impl FnOnce(&Hierarchy, &OpContext, &mut [u8], ReduceOp) -> Result<()>,
    ) -> Result<()> {
        // Called in this operation's turn (see `all_reduce_bytes`): the sub-communicators are
        // made (collective splits of this communicator) inside it, so they happen at the same
        // point of the issue order on every rank, and the hierarchy lock is only ever taken by
        // the holder of the turn (taking it before the turn deadlocks against an asynchronous
        // hierarchical all-reduce that holds the turn and waits for the lock).
        let h = self.hierarchy()?;
        // The sub-communicators' bytes count as this operation's (declared before the lock,
        // so it ends after it).
        let _traffic = crate::comm::traffic::TrafficScope::enter(self, op_name);
        // The parent's lock: abort and poisoning apply, calls stay serialised, a failure poisons.
        // A failure, here or in either sub-communicator, is told to the peers of both: a rank
        // waits for this one in a sub-communicator, whichever failed.
        let tell = |e: &Error| {
            if e.is_fatal() {
                h.fail_with(e);
            }
        };
        let (mut inner, ctx) = self.lock(op_name).inspect_err(tell)?;
        let result = (|| {
            for c in [&h.within, &h.across] {
                c.set_timeout(self.timeout());
            }
            let inner_op = if op == ReduceOp::Mean {
                ReduceOp::Sum
            } else {
                op
            };
            body(&h, &ctx, buf, inner_op)?;
            if op == ReduceOp::Mean {
                finalize_mean(dtype, buf, self.world_size());
            }
            Ok(())
        })();
        if let Err(e) = &result {
            tell(e);
        }
        Self::finish_collective(&mut inner, result)
    }

    /// The elements of `count` whose host sum this rank reduces across hosts in the
    /// hierarchical schedule ([`hierarchically`](Self::hierarchically)), when the ranks form
    /// a hierarchy (`None` otherwise).
    pub(crate) fn hierarchical_slice(&self, count: usize) -> Option<std::ops::Range<usize>> {
        let (_, local, per_host) = self.hierarchical_layout()?;
        Some(even_segments(count, per_host, 1)[local].clone())
    }

    // ===== all-gather =====

    /// All-gather: `recv` (length `world_size * send.len()`) receives every rank's `send` in rank
    /// order.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let counts = vec![send.len(); self.world_size()];
        self.all_gather_v_bytes(Some(bytes(send)), bytes_mut(recv), &counts, T::DTYPE)
    }

    /// All-gather in place: this rank's contribution is already at
    /// `buf[rank * n .. (rank + 1) * n]` where `n = buf.len() / world_size`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let w = self.world_size();
        if !buf.len().is_multiple_of(w) {
            return Err(self.bad(
                "all_gather",
                format!(
                    "buffer of {} elements does not divide into {w} equal parts",
                    buf.len()
                ),
            ));
        }
        let counts = vec![buf.len() / w; w];
        self.all_gather_v_bytes(None, bytes_mut(buf), &counts, T::DTYPE)
    }

    /// All-gather with per-rank counts: rank `p` contributes `counts[p]` elements, placed
    /// consecutively in rank order in `recv`.
    pub fn all_gather_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.all_gather_v_bytes(Some(bytes(send)), bytes_mut(recv), counts, T::DTYPE)
    }

    /// Byte-level all-gather(v): `send = None` means in place (own part already in `recv`).
    pub fn all_gather_v_bytes(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        self.all_gather_v_inner(send, recv, counts, dtype, true, true)
    }

    /// [`all_gather_v_bytes`](Self::all_gather_v_bytes) for hcomm's own exchanges of data that
    /// does not repeat (compressed codes, sparse rows): never kept
    /// ([`crate::algo::gather_cache`]).
    pub(crate) fn all_gather_v_unkept(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        self.all_gather_v_inner(send, recv, counts, dtype, true, false)
    }

    /// The all-gather(v): `inject` applies the fault-injection test hook to the output;
    /// `keepable` lets it keep outputs between hosts ([`crate::algo::gather_cache`]).
    pub(crate) fn all_gather_v_inner(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        inject: bool,
        keepable: bool,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        let n = self.world_size();
        if counts.len() != n {
            return Err(self.bad(
                OP,
                format!(
                    "counts has {} entries, expected one per rank ({n})",
                    counts.len()
                ),
            ));
        }
        let total = self.counts_total(OP, "counts", counts, dtype)?;
        let rcount = self.check_len(OP, "recv buffer", recv, dtype)?;
        if rcount != total {
            return Err(self.bad(
                OP,
                format!("recv buffer has {rcount} elements, expected the sum of counts ({total})"),
            ));
        }
        let me = self.rank();
        if let Some(s) = send {
            let sc = self.check_len(OP, "send buffer", s, dtype)?;
            if sc != counts[me] {
                return Err(self.bad(
                    OP,
                    format!(
                        "send buffer has {sc} elements but counts[{me}] is {}",
                        counts[me]
                    ),
                ));
            }
        }
        let uniform = counts.iter().all(|&c| c == counts[0]);
        let fp_count = if uniform { counts[0] } else { total };
        let segs = count_segments(counts, dtype.size());
        let cached = keepable && self.caches_gathers_for(recv.len());
        let budget = self.gather_cache_budget();
        self.collective(
            Collective::AllGather,
            Some(dtype),
            None,
            None,
            fp_count,
            recv.len(),
            |run, algo| {
                if algo == Algo::Shm {
                    let blocks: Vec<usize> = segs.iter().map(|s| s.len()).collect();
                    run.fp_extra = counts_hash(&blocks);
                    let (g, w, fp) = run.shm_parts();
                    return g.all_gather(send, recv, &blocks, None, fp, &w);
                }
                if let Some(s) = send {
                    recv[segs[me].clone()].copy_from_slice(s);
                }
                if cached && run.gather_cache.active() {
                    // Across hosts: blocks repeated from a kept all-gather go as references.
                    run.run.fp.algo = crate::wire::collective::GATHER_CACHE_CODE;
                    gather_cache::all_gather(
                        &mut run.run,
                        &mut *run.gather_cache,
                        budget,
                        recv,
                        &segs,
                    )?;
                    run.ran = Some("gather-cache");
                } else if n > 1 {
                    if cached {
                        run.gather_cache.passed(recv.len());
                    }
                    ring::all_gather_in_place(run, recv, &segs, 0)?;
                }
                Ok(())
            },
        )?;
        if inject {
            self.inject_fault(recv);
        }
        Ok(())
    }

    // ===== reduce-scatter =====

    /// Reduce-scatter: `send` holds `world_size` equal blocks; `recv` (one block) receives the
    /// reduction of block `rank` over all ranks. `send.len()` must be `world_size * recv.len()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let counts = vec![recv.len(); self.world_size()];
        if send.len() != recv.len() * self.world_size() {
            return Err(self.bad(
                "reduce_scatter",
                format!(
                    "send buffer has {} elements, expected world_size ({}) x recv count ({}) = {}; use reduce_scatter_v for uneven blocks",
                    send.len(),
                    self.world_size(),
                    recv.len(),
                    recv.len() * self.world_size()
                ),
            ));
        }
        self.reduce_scatter_v_bytes(Some(bytes(send)), bytes_mut(recv), &counts, T::DTYPE, op)
    }

    /// Reduce-scatter in place: the result lands in `buf[rank * n .. (rank + 1) * n]`
    /// (`n = buf.len() / world_size`); the other blocks are left unchanged.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let w = self.world_size();
        if !buf.len().is_multiple_of(w) {
            return Err(self.bad(
                "reduce_scatter",
                format!(
                    "buffer of {} elements does not divide into {w} equal blocks",
                    buf.len()
                ),
            ));
        }
        let counts = vec![buf.len() / w; w];
        self.reduce_scatter_v_bytes(None, bytes_mut(buf), &counts, T::DTYPE, op)
    }

    /// Reduce-scatter with per-rank block sizes: rank `p` receives the `counts[p]` elements
    /// starting at `sum(counts[..p])`.
    pub fn reduce_scatter_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_v_bytes(Some(bytes(send)), bytes_mut(recv), counts, T::DTYPE, op)
    }

    /// Byte-level reduce-scatter(v). With `send = None`, `recv` is the whole buffer and the
    /// result lands in block `rank` of it.
    pub fn reduce_scatter_v_bytes(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let n = self.world_size();
        let me = self.rank();
        if counts.len() != n {
            return Err(self.bad(
                OP,
                format!(
                    "counts has {} entries, expected one per rank ({n})",
                    counts.len()
                ),
            ));
        }
        let total = self.counts_total(OP, "counts", counts, dtype)?;
        match send {
            Some(s) => {
                let sc = self.check_len(OP, "send buffer", s, dtype)?;
                if sc != total {
                    return Err(self.bad(
                        OP,
                        format!(
                            "send buffer has {sc} elements, expected the sum of counts ({total})"
                        ),
                    ));
                }
                let rc = self.check_len(OP, "recv buffer", recv, dtype)?;
                if rc != counts[me] {
                    return Err(self.bad(
                        OP,
                        format!(
                            "recv buffer has {rc} elements but counts[{me}] is {}",
                            counts[me]
                        ),
                    ));
                }
            }
            None => {
                let rc = self.check_len(OP, "buffer", recv, dtype)?;
                if rc != total {
                    return Err(self.bad(
                        OP,
                        format!("buffer has {rc} elements, expected the sum of counts ({total})"),
                    ));
                }
            }
        }
        if op == ReduceOp::Mean && n > 1 {
            if let Some(per) = integer_mean::lanes(dtype) {
                // As in `all_reduce_bytes`: integers are summed widened, then divided.
                let lanes = integer_mean::widen(dtype, send.unwrap_or(recv));
                let wide_counts: Vec<usize> = counts.iter().map(|c| c * per).collect();
                let mut mine = vec![0i64; counts[me] * per];
                self.reduce_scatter_v(&lanes, &mut mine, &wide_counts, ReduceOp::Sum)?;
                let size = dtype.size();
                let out = match send {
                    Some(_) => &mut recv[..],
                    None => {
                        let start = counts[..me].iter().sum::<usize>() * size;
                        &mut recv[start..start + counts[me] * size]
                    }
                };
                integer_mean::narrow_mean(dtype, &mine, n, out);
                return Ok(());
            }
            if self.means_in_f32(dtype) {
                // As in `all_reduce_bytes`: f16/bf16 summed in f32, divided, rounded once.
                let sums = half_mean::widen(dtype, send.unwrap_or(recv));
                let mut mine = vec![0f32; counts[me]];
                Self::canonically(|| {
                    self.reduce_scatter_v(&sums, &mut mine, counts, ReduceOp::Sum)
                })?;
                let size = dtype.size();
                let out = match send {
                    Some(_) => &mut recv[..],
                    None => {
                        let start = counts[..me].iter().sum::<usize>() * size;
                        &mut recv[start..start + counts[me] * size]
                    }
                };
                half_mean::narrow_mean(dtype, &mine, n, out);
                return Ok(());
            }
        }
        let uniform = counts.iter().all(|&c| c == counts[0]);
        let fp_count = if uniform { counts[0] } else { total };
        let segs = count_segments(counts, dtype.size());
        let nbytes = total * dtype.size();
        let skip_zeros = self.skips_zeros_for(nbytes, op);
        self.collective(
            Collective::ReduceScatter,
            Some(dtype),
            Some(op),
            None,
            fp_count,
            nbytes,
            |run, algo| {
                if algo == Algo::Shm {
                    let blocks: Vec<usize> = segs.iter().map(|s| s.len()).collect();
                    run.fp_extra = counts_hash(&blocks);
                    let (g, w, fp) = run.shm_parts();
                    return g.reduce_scatter(send, recv, &blocks, dtype, op, fp, &w);
                }
                let my_seg = segs[me].clone();
                if skip_zeros {
                    // Two ranks on different hosts: bitwise what the dense schedules give.
                    run.run.fp.algo = crate::wire::collective::SKIP_ZEROS_CODE;
                    let out = match send {
                        Some(s) => {
                            recv.copy_from_slice(&s[my_seg]);
                            skip_zeros::reduce_scatter_pair(
                                run,
                                &s[segs[1 - me].clone()],
                                recv,
                                dtype,
                                op,
                            )?;
                            &mut *recv
                        }
                        None => {
                            let (first, second) = recv.split_at_mut(segs[0].end);
                            let (out, theirs) = if me == 0 {
                                (first, &*second)
                            } else {
                                (second, &*first)
                            };
                            skip_zeros::reduce_scatter_pair(run, theirs, out, dtype, op)?;
                            out
                        }
                    };
                    if op == ReduceOp::Mean {
                        finalize_mean(dtype, out, n);
                    }
                    run.ran = Some("skip-zeros");
                    return Ok(());
                }
                if algo == Algo::Canonical {
                    match send {
                        Some(s) => canonical::reduce_scatter(run, s, recv, &segs, dtype, op)?,
                        None => {
                            let input = recv.to_vec();
                            let out = &mut recv[my_seg.clone()];
                            canonical::reduce_scatter(run, &input, out, &segs, dtype, op)?;
                        }
                    }
                    if op == ReduceOp::Mean {
                        let out = if send.is_some() {
                            &mut *recv
                        } else {
                            &mut recv[my_seg]
                        };
                        finalize_mean(dtype, out, n);
                    }
                    return Ok(());
                }
                match send {
                    Some(s) => {
                        if n == 1 {
                            recv.copy_from_slice(s);
                        } else {
                            ring::reduce_scatter(
                                run,
                                ring::RsIo::Out {
                                    input: s,
                                    output: &mut *recv,
                                },
                                &segs,
                                dtype,
                                op,
                            )?;
                        }
                        if op == ReduceOp::Mean {
                            finalize_mean(dtype, recv, n);
                        }
                    }
                    None => {
                        if n > 1 {
                            ring::reduce_scatter(
                                run,
                                ring::RsIo::InPlace(&mut *recv),
                                &segs,
                                dtype,
                                op,
                            )?;
                        }
                        if op == ReduceOp::Mean {
                            finalize_mean(dtype, &mut recv[my_seg], n);
                        }
                    }
                }
                Ok(())
            },
        )?;
        self.inject_fault(recv);
        Ok(())
    }

    // ===== broadcast / reduce =====

    /// Broadcast `buf` from `root` to every rank, in place.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(bytes_mut(buf), T::DTYPE, root)
    }

    /// Byte-level broadcast.
    pub fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        let count = self.check_len("broadcast", "buffer", buf, dtype)?;
        let n = self.world_size();
        self.collective(
            Collective::Broadcast,
            Some(dtype),
            None,
            Some(root),
            count,
            buf.len(),
            |run, algo| {
                if n == 1 {
                    return Ok(());
                }
                match algo {
                    Algo::Shm => {
                        let (g, w, fp) = run.shm_parts();
                        g.broadcast(buf, root, fp, &w)
                    }
                    Algo::Chain => tree::broadcast_chain(run, buf, root),
                    _ => tree::broadcast_tree(run, buf, root),
                }
            },
        )?;
        self.inject_fault(buf);
        Ok(())
    }

    /// Reduce `send` over all ranks into `recv` on `root` (`recv` is ignored elsewhere and may
    /// be empty there).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.reduce_bytes(Some(bytes(send)), bytes_mut(recv), T::DTYPE, op, root)
    }

    /// Reduce in place: on `root`, `buf` receives the result; elsewhere it is the input and is
    /// not modified.
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.reduce_bytes(None, bytes_mut(buf), T::DTYPE, op, root)
    }

    /// Byte-level reduce. `send = None` means in place on `recv`.
    pub fn reduce_bytes(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "reduce";
        self.check_root(OP, root)?;
        let me = self.rank();
        let input_len = send.map_or(recv.len(), |s| s.len());
        let count = input_len / dtype.size();
        if let Some(s) = send {
            self.check_len(OP, "send buffer", s, dtype)?;
            if me == root && recv.len() != s.len() {
                return Err(self.bad(
                    OP,
                    format!(
                        "root's recv buffer has {} elements, send buffer has {count}",
                        recv.len() / dtype.size()
                    ),
                ));
            }
        } else {
            self.check_len(OP, "buffer", recv, dtype)?;
        }
        let n = self.world_size();
        if op == ReduceOp::Mean && n > 1 && integer_mean::lanes(dtype).is_some() {
            // As in `all_reduce_bytes`: integers are summed widened, then divided.
            let mut lanes = integer_mean::widen(dtype, send.unwrap_or(recv));
            self.reduce_in_place(&mut lanes, ReduceOp::Sum, root)?;
            if me == root {
                integer_mean::narrow_mean(dtype, &lanes, n, recv);
            }
            return Ok(());
        }
        if op == ReduceOp::Mean && n > 1 && self.means_in_f32(dtype) {
            // As in `all_reduce_bytes`: f16/bf16 summed in f32, divided, rounded once.
            let mut sums = half_mean::widen(dtype, send.unwrap_or(recv));
            Self::canonically(|| self.reduce_in_place(&mut sums, ReduceOp::Sum, root))?;
            if me == root {
                half_mean::narrow_mean(dtype, &sums, n, recv);
            }
            return Ok(());
        }
        self.collective(
            Collective::Reduce,
            Some(dtype),
            Some(op),
            Some(root),
            count,
            input_len,
            |run, algo| {
                match algo {
                    Algo::Shm => {
                        let (g, w, fp) = run.shm_parts();
                        return g.all_reduce(send, recv, dtype, op, Some(root), fp, &w);
                    }
                    Algo::Canonical => {
                        let copy: Vec<u8>;
                        let input: &[u8] = match send {
                            Some(s) => s,
                            None => {
                                copy = recv.to_vec();
                                &copy
                            }
                        };
                        let out: &mut [u8] = if me == root { recv } else { &mut [] };
                        canonical::reduce(run, input, out, dtype, op, root)?;
                    }
                    Algo::Chain => {
                        // The chain never writes its input; in place on a non-root the output is unused.
                        let input: Vec<u8>;
                        let (inp, out): (&[u8], &mut [u8]) = match send {
                            Some(s) => (s, if me == root { recv } else { &mut [] }),
                            None if me == root => {
                                input = recv.to_vec();
                                (&input, recv)
                            }
                            None => (&*recv, &mut []),
                        };
                        if me == root {
                            tree::reduce_chain(run, inp, out, dtype, op, root)?;
                        } else {
                            tree::reduce_chain(run, inp, &mut [], dtype, op, root)?;
                        }
                    }
                    _ => {
                        // Binomial tree: accumulate in the root's output, or in scratch elsewhere.
                        if me == root {
                            if let Some(s) = send {
                                recv.copy_from_slice(s);
                            }
                            if n > 1 {
                                tree::reduce_tree(run, recv, dtype, op, root)?;
                            }
                        } else {
                            let mut acc = send.unwrap_or(recv).to_vec();
                            tree::reduce_tree(run, &mut acc, dtype, op, root)?;
                        }
                    }
                }
                if me == root && op == ReduceOp::Mean {
                    finalize_mean(dtype, recv, n);
                }
                Ok(())
            },
        )?;
        if me == root {
            self.inject_fault(recv);
        }
        Ok(())
    }

    // ===== gather / scatter =====

    /// Gather every rank's `send` into `recv` on `root` (length `world_size * send.len()`;
    /// ignored elsewhere).
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let counts = vec![send.len(); self.world_size()];
        self.gather_v_bytes(bytes(send), bytes_mut(recv), &counts, T::DTYPE, root)
    }

    /// Gather with per-rank counts.
    pub fn gather_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        self.gather_v_bytes(bytes(send), bytes_mut(recv), counts, T::DTYPE, root)
    }

    /// Byte-level gather(v).
    pub fn gather_v_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "gather";
        self.check_root(OP, root)?;
        let n = self.world_size();
        let me = self.rank();
        if counts.len() != n {
            return Err(self.bad(
                OP,
                format!(
                    "counts has {} entries, expected one per rank ({n})",
                    counts.len()
                ),
            ));
        }
        let sc = self.check_len(OP, "send buffer", send, dtype)?;
        if sc != counts[me] {
            return Err(self.bad(
                OP,
                format!(
                    "send buffer has {sc} elements but counts[{me}] is {}",
                    counts[me]
                ),
            ));
        }
        let total = self.counts_total(OP, "counts", counts, dtype)?;
        if me == root && recv.len() != total * dtype.size() {
            return Err(self.bad(
                OP,
                format!(
                    "root's recv buffer has {} elements, expected the sum of counts ({total})",
                    recv.len() / dtype.size()
                ),
            ));
        }
        let uniform = counts.iter().all(|&c| c == counts[0]);
        let segs = count_segments(counts, dtype.size());
        self.collective(
            Collective::Gather,
            Some(dtype),
            None,
            Some(root),
            if uniform { sc } else { total },
            send.len(),
            |run, algo| {
                if algo == Algo::Shm {
                    let blocks: Vec<usize> = segs.iter().map(|s| s.len()).collect();
                    run.fp_extra = counts_hash(&blocks);
                    let (g, w, fp) = run.shm_parts();
                    return g.all_gather(Some(send), recv, &blocks, Some(root), fp, &w);
                }
                basic::gather_linear(run, send, recv, &segs, root)
            },
        )?;
        self.inject_fault(recv);
        Ok(())
    }

    /// Scatter: the root's `send` (length `world_size * recv.len()`) is split in rank order;
    /// every rank receives its block in `recv`. `send` is ignored on other ranks.
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let counts = vec![recv.len(); self.world_size()];
        self.scatter_v_bytes(bytes(send), bytes_mut(recv), &counts, T::DTYPE, root)
    }

    /// Scatter with per-rank counts.
    pub fn scatter_v<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        self.scatter_v_bytes(bytes(send), bytes_mut(recv), counts, T::DTYPE, root)
    }

    /// Byte-level scatter(v).
    pub fn scatter_v_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "scatter";
        self.check_root(OP, root)?;
        let n = self.world_size();
        let me = self.rank();
        if counts.len() != n {
            return Err(self.bad(
                OP,
                format!(
                    "counts has {} entries, expected one per rank ({n})",
                    counts.len()
                ),
            ));
        }
        let rc = self.check_len(OP, "recv buffer", recv, dtype)?;
        if rc != counts[me] {
            return Err(self.bad(
                OP,
                format!(
                    "recv buffer has {rc} elements but counts[{me}] is {}",
                    counts[me]
                ),
            ));
        }
        let total = self.counts_total(OP, "counts", counts, dtype)?;
        if me == root && send.len() != total * dtype.size() {
            return Err(self.bad(
                OP,
                format!(
                    "root's send buffer has {} elements, expected the sum of counts ({total})",
                    send.len() / dtype.size()
                ),
            ));
        }
        let uniform = counts.iter().all(|&c| c == counts[0]);
        let segs = count_segments(counts, dtype.size());
        self.collective(
            Collective::Scatter,
            Some(dtype),
            None,
            Some(root),
            if uniform { rc } else { total },
            recv.len(),
            |run, algo| {
                if algo == Algo::Shm {
                    run.fp_extra = counts_hash(counts);
                    let mut from = vec![0..0; n];
                    from[root] = 0..recv.len();
                    let (g, w, fp) = run.shm_parts();
                    return g.all_to_all(send, &segs, recv, &from, Some(root), fp, &w);
                }
                basic::scatter_linear(run, send, recv, &segs, root)
            },
        )?;
        self.inject_fault(recv);
        Ok(())
    }

    // ===== all-to-all =====

    /// All-to-all: `send` and `recv` hold `world_size` equal blocks; block `p` of `send` goes
    /// to rank `p`, and block `p` of `recv` comes from rank `p`.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let w = self.world_size();
        if !send.len().is_multiple_of(w) || recv.len() != send.len() {
            return Err(self.bad(
                "all_to_all",
                format!(
                    "send ({}) and recv ({}) must have the same number of elements, divisible by world_size ({w}); use all_to_all_v for uneven blocks",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        let counts = vec![send.len() / w; w];
        self.all_to_all_impl(
            bytes(send),
            &counts,
            bytes_mut(recv),
            &counts,
            T::DTYPE,
            send.len(),
        )
    }

    /// All-to-all with per-peer counts: `send_counts[p]` elements go to rank `p`,
    /// `recv_counts[p]` elements come from rank `p` (which must match what `p` sends).
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_v_bytes(
            bytes(send),
            send_counts,
            bytes_mut(recv),
            recv_counts,
            T::DTYPE,
        )
    }

    /// Byte-level all-to-all(v).
    pub fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        // Counts legitimately differ between ranks, so the fingerprint carries none.
        self.all_to_all_impl(send, send_counts, recv, recv_counts, dtype, 0)
    }

    fn all_to_all_impl(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
        fp_count: usize,
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        let n = self.world_size();
        let me = self.rank();
        if send_counts.len() != n || recv_counts.len() != n {
            return Err(self.bad(
                OP,
                format!(
                    "send_counts ({}) and recv_counts ({}) need one entry per rank ({n})",
                    send_counts.len(),
                    recv_counts.len()
                ),
            ));
        }
        let sc = self.check_len(OP, "send buffer", send, dtype)?;
        let rc = self.check_len(OP, "recv buffer", recv, dtype)?;
        if sc != self.counts_total(OP, "send_counts", send_counts, dtype)?
            || rc != self.counts_total(OP, "recv_counts", recv_counts, dtype)?
        {
            return Err(self.bad(OP, format!("send buffer ({sc}) / recv buffer ({rc}) do not match the sums of send_counts / recv_counts")));
        }
        if send_counts[me] != recv_counts[me] {
            return Err(self.bad(
                OP,
                format!(
                    "send_counts[{me}] = {} but recv_counts[{me}] = {} (the block to self)",
                    send_counts[me], recv_counts[me]
                ),
            ));
        }
        let ss = count_segments(send_counts, dtype.size());
        let rs = count_segments(recv_counts, dtype.size());
        self.collective(
            Collective::AllToAll,
            Some(dtype),
            None,
            None,
            fp_count,
            send.len(),
            |run, algo| {
                if algo == Algo::Shm && fp_count != 0 {
                    let (g, w, fp) = run.shm_parts();
                    return g.all_to_all(send, &ss, recv, &rs, None, fp, &w);
                }
                // Per-rank counts: the tables of `shm/all_to_all_v.rs` first.
                if algo == Algo::Shm && n <= crate::shm::ALL_TO_ALL_V_MAX_RANKS {
                    let (g, w, fp) = run.shm_parts();
                    return g.all_to_all_v(send, &ss, recv, &rs, fp, &w);
                }
                basic::all_to_all_pairwise(run, send, &ss, recv, &rs)
            },
        )?;
        self.inject_fault(recv);
        Ok(())
    }

    // ===== barrier =====

    /// Block until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        let n = self.world_size();
        self.collective(
            Collective::Barrier,
            None,
            None,
            None,
            0,
            0,
            |run, algo| match algo {
                Algo::Shm => {
                    let (g, w, fp) = run.shm_parts();
                    g.barrier(fp, &w)
                }
                _ if n > 1 => basic::barrier_dissemination(run),
                _ => Ok(()),
            },
        )
    }
}
