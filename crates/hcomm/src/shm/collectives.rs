//! The collectives a shared-memory group runs directly on its segment: one-shot (every rank
//! publishes its whole vector in its slot or arrival line) up to [`SMALL`] bytes, pipelined in
//! chunk-sized steps through the staging slots above that. Every phase is an arrival and a wait
//! for all peers ([`arrival`](super::arrival)); the buffers a phase writes are provably no
//! longer read by anyone.

use super::*;

impl ShmGroup {
    /// `acc = contribution(0) ⊕ contribution(1) ⊕ …` in rank order (bitwise identical results
    /// on every rank, run after run).
    pub(super) fn reduce_in_rank_order<'c>(
        n: usize,
        acc: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        widen_halves: bool,
        contribution: impl Fn(usize) -> &'c [u8],
    ) {
        if widen_halves && matches!(dtype, DType::F16 | DType::BF16) {
            // The canonical expression of deterministic mode: the same fold, in f32.
            let parts: Vec<&[u8]> = (0..n).map(contribution).collect();
            fold_in_order(dtype, op, acc, &parts);
            return;
        }
        if n == 1 {
            acc.copy_from_slice(contribution(0));
            return;
        }
        // The first two in one pass (the copy of the first and the first step, fused).
        reduce_pair(dtype, op, acc, contribution(0), contribution(1));
        for p in 2..n {
            reduce_into(dtype, op, acc, contribution(p), Order::AccFirst);
        }
    }

    /// Reductions on this group combine the ranks in rank order always; with `on` they also
    /// accumulate f16 and bf16 in f32, which makes every element the canonical expression of
    /// deterministic mode ([`fold_in_order`]), the same bits as the canonical schedules over
    /// the links.
    pub fn set_canonical(&mut self, on: bool) {
        self.widen_halves = on;
    }

    /// Barrier.
    pub fn barrier(&mut self, fp: ShmFingerprint, w: &WaitCtx) -> Result<()> {
        self.first_barrier(fp, w)
    }

    /// All-reduce (`input = None`: in place on `out`); with `root = Some(r)` it is a reduce and
    /// only rank `r` writes `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: Option<usize>,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let len = input.map_or(out.len(), |i| i.len());
        let writes_out = root.is_none_or(|r| r == me);
        if len <= SMALL {
            // One shot: everyone publishes its vector; everyone sums all in rank order.
            let par = self.one_shot_parities();
            let src: &[u8] = match input {
                Some(i) => i,
                None => &*out,
            };
            // Protocol: slot (me, par) is this rank's: peers last read it in the call before the
            // previous one, and every peer arrived at the previous call after finishing that.
            // (An inline slot lives in the arrival line of this call's barrier: peers last read
            // it after the arrival before the previous one, and arrived once more since.)
            self.put(self.layout.slot(me, par, len), src);
            // This rank's own contribution is read from its own memory, not from its slot:
            // reading the slot back after the peers read it measured as one more transfer
            // between the cores (as if the readers had taken the line away, which a
            // migratory-sharing protocol does), the dearest part of the call when they share
            // no cache (2 ranks, 8 B, 2026-12-07: 0.68-0.81 µs -> 0.56-0.65 in that state,
            // ~0.35 unchanged otherwise; README.md).
            if input.is_none() {
                self.own_copy.clear();
                self.own_copy.extend_from_slice(&out[..len]);
            }
            self.first_barrier(fp, w)?;
            let own: &[u8] = input.unwrap_or(&self.own_copy);
            if writes_out {
                // Protocol: slot (p, par) was published by p's arrival, which we awaited; p does
                // not write it again before we arrive at the next call.
                let slot = |p: usize| {
                    if p == me {
                        own
                    } else {
                        self.seg.view(self.layout.slot(p, par, len), len)
                    }
                };
                Self::reduce_in_rank_order(n, &mut out[..len], dtype, op, self.widen_halves, slot);
                self.read += (n * len) as u64;
                if op == ReduceOp::Mean {
                    finalize_mean(dtype, out, n);
                }
            }
            return Ok(());
        }
        let call = self.publish_start(Kind::AllReduce, len);
        self.all_reduce_pipelined(input, out, dtype, op, writes_out, fp, w, call.2)?;
        self.published(call);
        Ok(())
    }

    /// The all-reduce (or reduce) of more than [`SMALL`] bytes, publishing `way`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn all_reduce_pipelined(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        writes_out: bool,
        fp: ShmFingerprint,
        w: &WaitCtx,
        way: Publish,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let es = dtype.size();
        let len = input.map_or(out.len(), |i| i.len());
        // Software-pipelined, one barrier per step: step j stages chunk j, reduces chunk j-1
        // (staged in step j-1) and copies chunk j-2 out (reduced in step j-1), then arrives
        // and waits for all. Two phases per chunk, each followed by a barrier, made every rank
        // wait for the slowest at twice as many points; this way a rank's work between
        // barriers is three pieces, and a late peer costs less.
        let chunk = (self.layout.chunk / (n * es) * (n * es)).max(n * es);
        let chunks = len.div_ceil(chunk);
        let base = self.steps;
        self.steps += chunks as u64;
        let at = |c: usize| {
            let o = c * chunk;
            let l = chunk.min(len - o);
            let par = ((base + c as u64) % 2) as usize;
            (o, l, par, even_segments(l / es, n, es))
        };
        // The outputs of all ranks outgrow the caches: write ours with streaming stores.
        let stream_out = n * len >= STREAM_OUTPUTS_FROM;
        let mut first = true;
        for j in 0..chunks + 2 {
            if j < chunks {
                // Stage the slices of chunk j that the peers reduce.
                let (o, l, par, segs) = at(j);
                let inp: &[u8] = match input {
                    Some(i) => &i[o..o + l],
                    None => &out[o..o + l],
                };
                for (p, s) in segs.iter().enumerate() {
                    if p != me {
                        // Protocol: staging (me, par) was last read in the reduction of chunk
                        // j-2, in step j-1, before the readers arrived at step j-1's barrier,
                        // which this rank awaited.
                        self.put_way(self.layout.staging(me, par) + s.start, &inp[s.clone()], way);
                    }
                }
            }
            if (1..=chunks).contains(&j) {
                // Reduce our slice of chunk j-1, in rank order, into the shared result.
                let (o, _, par, segs) = at(j - 1);
                let mine = segs[me].clone();
                let r_off = self.layout.result(par) + mine.start;
                // Protocol: our slice of result[par] was last read when chunk j-3 was copied
                // out, in step j-1, before its readers arrived at that step's barrier.
                let acc = self.seg.view_mut(r_off, mine.len());
                let (seg, layout) = (&self.seg, &self.layout);
                // Protocol: published by p's arrival at step j-1's barrier; p rewrites it only
                // in step j+1, after our arrival at step j.
                let staged = |p: usize| seg.view(layout.staging(p, par) + mine.start, mine.len());
                let ours = o + mine.start..o + mine.end;
                match (way, input) {
                    (Publish::Memory, Some(i)) if writes_out && !stream_out => {
                        // Reduce straight into our output, then stream the slice to the
                        // result for the peers.
                        let own = &i[ours.clone()];
                        let to = &mut out[ours.clone()];
                        let contribution = |p: usize| if p == me { own } else { staged(p) };
                        Self::reduce_in_rank_order(
                            n,
                            to,
                            dtype,
                            op,
                            self.widen_halves,
                            contribution,
                        );
                        crate::base::simd::copy_streaming(acc, to);
                    }
                    (Publish::Memory, _) => {
                        // In place (our slice of the output is our contribution), or our
                        // output too is written with streaming stores, or we write none.
                        if self.reduced.len() < mine.len() {
                            self.reduced.resize(mine.len(), 0);
                        }
                        let tmp = &mut self.reduced[..mine.len()];
                        let own: &[u8] = match input {
                            Some(i) => &i[ours.clone()],
                            None => &out[ours.clone()],
                        };
                        let contribution = |p: usize| if p == me { own } else { staged(p) };
                        Self::reduce_in_rank_order(
                            n,
                            tmp,
                            dtype,
                            op,
                            self.widen_halves,
                            contribution,
                        );
                        crate::base::simd::copy_streaming(acc, tmp);
                        if writes_out {
                            if stream_out {
                                crate::base::simd::copy_streaming(&mut out[ours.clone()], tmp);
                            } else {
                                out[ours.clone()].copy_from_slice(tmp);
                            }
                        }
                    }
                    (Publish::Cache, _) => {
                        let own: &[u8] = match input {
                            Some(i) => &i[ours.clone()],
                            None => &out[ours.clone()],
                        };
                        let contribution = |p: usize| if p == me { own } else { staged(p) };
                        Self::reduce_in_rank_order(
                            n,
                            acc,
                            dtype,
                            op,
                            self.widen_halves,
                            contribution,
                        );
                        if writes_out {
                            // Our own slice of the result is in the cache now: copy it out at
                            // once (the copy-out below takes only the peers' slices). The
                            // input's slice there was consumed by the reduction just above.
                            let to = &mut out[ours.clone()];
                            let from = self.seg.view(r_off, mine.len());
                            if stream_out {
                                crate::base::simd::copy_streaming(to, from);
                            } else {
                                to.copy_from_slice(from);
                            }
                            self.read += mine.len() as u64;
                        }
                    }
                }
                self.read += ((n - 1) * mine.len()) as u64;
                self.written += mine.len() as u64;
            }
            if j >= 2 && writes_out {
                // Every slice of chunk j-2 is reduced: copy the peers' out.
                let (o, _, par, segs) = at(j - 2);
                for (p, s) in segs.iter().enumerate() {
                    if p == me {
                        continue; // copied right after its reduction
                    }
                    // Protocol: reduced in step j-1, published by that step's barrier; the
                    // owners rewrite result[par] only in step j+1, after our arrival at step j
                    // (or, after the last step, in a later collective, after our arrival
                    // there).
                    let (from, to) = (
                        self.layout.result(par) + s.start,
                        &mut out[o + s.start..o + s.end],
                    );
                    if stream_out {
                        self.get_streaming(from, to);
                    } else {
                        self.get(from, to);
                    }
                }
            }
            if j <= chunks {
                self.step_barrier(&mut first, fp, w)?;
            }
        }
        if writes_out && op == ReduceOp::Mean {
            finalize_mean(dtype, out, n);
        }
        Ok(())
    }

    /// Broadcast `buf` from `root`.
    pub fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: usize,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let me = self.rank;
        if buf.len() <= SMALL {
            // One shot: the root publishes its slot, everyone copies it after one barrier.
            let par = self.one_shot_parities();
            let len = buf.len();
            if me == root {
                // Protocol: slot (root, par) is ours (see all_reduce's one-shot path).
                self.put(self.layout.slot(root, par, len), buf);
            }
            self.first_barrier(fp, w)?;
            if me != root {
                // Protocol: published by the root's arrival; rewritten two calls later at the
                // earliest.
                self.get(self.layout.slot(root, par, len), buf);
            }
            return Ok(());
        }
        let call = self.publish_start(Kind::Broadcast, buf.len());
        let mut first = true;
        let mut o = 0;
        loop {
            let l = self.layout.chunk.min(buf.len() - o);
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            if me == root {
                // Protocol: staging (root, par) is ours (readers finished two steps ago).
                self.put_way(self.layout.staging(root, par), &buf[o..o + l], call.2);
            }
            self.step_barrier(&mut first, fp, w)?;
            if me != root {
                // Protocol: published by the root's arrival; rewritten only after our next one
                // (at the next step's barrier).
                self.get(self.layout.staging(root, par), &mut buf[o..o + l]);
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += l;
            if o >= buf.len() {
                self.published(call);
                return Ok(());
            }
        }
    }

    /// All-gather with per-rank block sizes (bytes `blocks[p]`, placed consecutively in `out`);
    /// `input = None`: this rank's block is already in place in `out`. With `root = Some(r)` it
    /// is a gather and only rank `r` writes `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_gather(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        blocks: &[usize],
        root: Option<usize>,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let me = self.rank;
        let offs: Vec<usize> = blocks
            .iter()
            .scan(0, |acc, &b| {
                let o = *acc;
                *acc += b;
                Some(o)
            })
            .collect();
        let longest = blocks.iter().copied().max().unwrap_or(0);
        let writes_out = root.is_none_or(|r| r == me);
        if longest <= SMALL {
            // One shot: every rank publishes its block in its slot; one barrier; read them all.
            let par = self.one_shot_parities();
            let src: &[u8] = match input {
                Some(i) => i,
                None => &out[offs[me]..offs[me] + blocks[me]],
            };
            // Protocol: slot (me, par) is ours (see all_reduce's one-shot path).
            self.put(self.layout.slot(me, par, longest), src);
            self.first_barrier(fp, w)?;
            if writes_out {
                for (p, &b) in blocks.iter().enumerate() {
                    if p == me {
                        // From this rank's own memory, not its slot (see all_reduce).
                        if let Some(i) = input {
                            out[offs[p]..offs[p] + b].copy_from_slice(i);
                        }
                        continue;
                    }
                    // Protocol: published by p's arrival; rewritten two calls later at the
                    // earliest.
                    self.get(
                        self.layout.slot(p, par, longest),
                        &mut out[offs[p]..offs[p] + b],
                    );
                }
            }
            return Ok(());
        }
        let chunk = self.layout.chunk;
        let call = self.publish_start(Kind::AllGather, longest);
        let mut first = true;
        let mut o = 0;
        loop {
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            let mine_l = blocks[me].saturating_sub(o).min(chunk);
            let src: &[u8] = match input {
                Some(i) => &i[o.min(i.len())..o.min(i.len()) + mine_l],
                None => &out[offs[me] + o.min(blocks[me])..offs[me] + o.min(blocks[me]) + mine_l],
            };
            // Protocol: staging (me, par) is ours (readers finished two steps ago).
            self.put_way(self.layout.staging(me, par), src, call.2);
            self.step_barrier(&mut first, fp, w)?;
            if writes_out {
                for (p, &b) in blocks.iter().enumerate() {
                    let l = b.saturating_sub(o).min(chunk);
                    if l == 0 || (p == me && input.is_none()) {
                        continue;
                    }
                    let dst = &mut out[offs[p] + o..offs[p] + o + l];
                    // Protocol: published by p's arrival; rewritten only after our next arrival
                    // (at the next step's barrier).
                    self.get(self.layout.staging(p, par), dst);
                }
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += chunk;
            if o >= longest {
                self.published(call);
                return Ok(());
            }
        }
    }

    /// Reduce-scatter with per-rank block sizes (bytes); `input = None`: in place, the result
    /// lands in block `rank` of `out` (other blocks unchanged), else `out` is this rank's block.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter(
        &mut self,
        input: Option<&[u8]>,
        out: &mut [u8],
        blocks: &[usize],
        dtype: DType,
        op: ReduceOp,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let es = dtype.size();
        let offs: Vec<usize> = blocks
            .iter()
            .scan(0, |acc, &b| {
                let o = *acc;
                *acc += b;
                Some(o)
            })
            .collect();
        let longest = blocks.iter().copied().max().unwrap_or(0);
        // Each step handles a piece of every block; staging holds one piece per block.
        let piece = (self.layout.chunk / n / es * es).max(es);
        let call = self.publish_start(Kind::ReduceScatter, longest);
        let mut first = true;
        let mut o = 0;
        loop {
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            let full: &[u8] = match input {
                Some(i) => i,
                None => &*out,
            };
            for (p, &b) in blocks.iter().enumerate() {
                let l = b.saturating_sub(o).min(piece);
                if p != me && l > 0 {
                    // Protocol: staging (me, par) is ours (readers finished two steps ago).
                    self.put_way(
                        self.layout.staging(me, par) + p * piece,
                        &full[offs[p] + o..offs[p] + o + l],
                        call.2,
                    );
                }
            }
            self.step_barrier(&mut first, fp, w)?;
            let l = blocks[me].saturating_sub(o).min(piece);
            if let (true, Some(input)) = (l > 0, input) {
                // Out of place: reduce straight into our block of `out` (only this rank ever
                // reads its piece, so it need not pass through the result area).
                let own = &input[offs[me] + o..offs[me] + o + l];
                let contribution = |p: usize| -> &[u8] {
                    if p == me {
                        own
                    } else {
                        // Protocol: published by p's arrival.
                        self.seg.view(self.layout.staging(p, par) + me * piece, l)
                    }
                };
                Self::reduce_in_rank_order(
                    n,
                    &mut out[o..o + l],
                    dtype,
                    op,
                    self.widen_halves,
                    contribution,
                );
                self.read += ((n - 1) * l) as u64;
            } else if l > 0 {
                let r_off = self.layout.result(par) + me * piece;
                // Protocol: our piece of the result area, nobody else reads or writes it.
                let acc = self.seg.view_mut(r_off, l);
                let own: &[u8] = match input {
                    Some(i) => &i[offs[me] + o..offs[me] + o + l],
                    None => &out[offs[me] + o..offs[me] + o + l],
                };
                let contribution = |p: usize| -> &[u8] {
                    if p == me {
                        own
                    } else {
                        // Protocol: published by p's arrival.
                        self.seg.view(self.layout.staging(p, par) + me * piece, l)
                    }
                };
                Self::reduce_in_rank_order(n, acc, dtype, op, self.widen_halves, contribution);
                let dst = match input {
                    Some(_) => &mut out[o..o + l],
                    None => &mut out[offs[me] + o..offs[me] + o + l],
                };
                dst.copy_from_slice(acc);
                // Peers' pieces reduced in place, our result written, then copied out.
                self.read += (n * l) as u64;
                self.written += l as u64;
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += piece;
            if o >= longest {
                break;
            }
        }
        self.published(call);
        if op == ReduceOp::Mean {
            match input {
                Some(_) => finalize_mean(dtype, out, n),
                None => finalize_mean(dtype, &mut out[offs[me]..offs[me] + blocks[me]], n),
            }
        }
        Ok(())
    }

    /// Scatter (`root = Some(r)`: only `r` sends) or all-to-all (`root = None`): block `p` of
    /// `input` (byte range `send[p]`) goes to rank `p`, and the block from rank `q` lands in
    /// byte range `recv[q]` of `out`. Every block length must be known to every
    /// rank (equal blocks, or the scatter's counts), so that all ranks run the same steps.
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_all(
        &mut self,
        input: &[u8],
        send: &[Range<usize>],
        out: &mut [u8],
        recv: &[Range<usize>],
        root: Option<usize>,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        // The same on every rank: the caller guarantees all block lengths are known to all.
        let longest = send.iter().chain(recv).map(|r| r.len()).max().unwrap_or(0);
        self.all_to_all_staged(input, send, out, recv, root, longest, fp, w)
    }

    /// [`all_to_all`](Self::all_to_all) through the staging buffers, in pieces, until
    /// `longest` (the longest block of any rank, the same on every rank) has moved.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn all_to_all_staged(
        &mut self,
        input: &[u8],
        send: &[Range<usize>],
        out: &mut [u8],
        recv: &[Range<usize>],
        root: Option<usize>,
        longest: usize,
        fp: ShmFingerprint,
        w: &WaitCtx,
    ) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let piece = (self.layout.chunk / n).max(1);
        let call = self.publish_start(Kind::AllToAll, longest);
        let mut first = true;
        let mut o = 0;
        loop {
            let par = (self.steps % 2) as usize;
            self.steps += 1;
            if root.is_none_or(|r| r == me) {
                for (p, b) in send.iter().enumerate() {
                    let (off, l) = (b.start, b.len().saturating_sub(o).min(piece));
                    if l > 0 {
                        // Protocol: staging (me, par) is ours (readers finished two steps ago).
                        self.put_way(
                            self.layout.staging(me, par) + p * piece,
                            &input[off + o..off + o + l],
                            call.2,
                        );
                    }
                }
            }
            self.step_barrier(&mut first, fp, w)?;
            for (q, b) in recv.iter().enumerate() {
                let (off, l) = (b.start, b.len().saturating_sub(o).min(piece));
                let src = root.unwrap_or(q);
                if l > 0 && root.is_none_or(|r| q == r) {
                    // Protocol: published by the sender's arrival; rewritten only after our next
                    // arrival (at the next step's barrier).
                    self.get(
                        self.layout.staging(src, par) + me * piece,
                        &mut out[off + o..off + o + l],
                    );
                }
            }
            // No second barrier: what this step read is rewritten only two steps on, after
            // the next step's barrier, which every reader reaches only once it has read.
            o += piece;
            if o >= longest {
                self.published(call);
                return Ok(());
            }
        }
    }
}
