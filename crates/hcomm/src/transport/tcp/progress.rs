//! The progress loop: one thread drives every send and receive of an exchange over all links
//! at once, reading whatever arrives, matching collective frames to their receives, handling
//! the point-to-point rendezvous, blocking in `poll` (or the shared-memory doorbell) when
//! nothing moves, and turning a dead, silent or aborting peer into an error that names it.

use super::*;

impl TcpLinks {
    pub(super) fn drive(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
        any: bool,
    ) -> Result<()> {
        let mut r = self.drive_until_done(ctx, sends, recvs, deadline, any);
        if let Err(Error::PeerClosed { peer, .. }) = &r {
            // A peer that failed first tells why before it closes; the notice may still sit
            // unread behind the data (a send error is seen before it), on any of its sockets
            // or its shared-memory pipe.
            let peer = *peer;
            let (a, b) = self.inb.split_at_mut(self.n);
            let notice = a[peer]
                .iter_mut()
                .chain(b[peer].iter_mut())
                .flatten()
                .find_map(next_abort);
            if let Some(h) = notice {
                let (reason, culprit) = abort_notice(&h);
                r = Err(reason.remote_error(ctx.clone(), peer, culprit, self.rank, None));
            }
        }
        if let Err(e) = &r {
            self.complete_partial_sends(ctx, sends, e);
        }
        r
    }

    /// After a failure: finish the frames half sent to healthy peers (for at most 500 ms), so
    /// that their streams stay in step and can carry the abort notice. Only whole frames of
    /// real data are sent; a frame that cannot be finished leaves its socket without a notice.
    pub(super) fn complete_partial_sends(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        e: &Error,
    ) {
        let failed: Vec<usize> = match e {
            Error::Timeout { peers, .. } => peers.clone(),
            _ => e.blame().0.into_iter().collect(),
        };
        let end = Instant::now() + Duration::from_millis(500);
        loop {
            let mut pending = false;
            for s in sends.iter_mut() {
                if failed.contains(&s.peer) {
                    continue;
                }
                for j in 0..s.parts.len() {
                    let p = &s.parts[j];
                    if p.written == 0 || p.is_done() {
                        continue;
                    }
                    let stripe = p.stripe;
                    if self.inb[s.link]
                        .as_ref()
                        .is_none_or(|socks| socks[stripe].eof)
                    {
                        continue;
                    }
                    if self.pump_send(ctx, s, j).is_err() {
                        continue;
                    }
                    pending |= !s.parts[j].is_done();
                }
            }
            if !pending || Instant::now() >= end {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub(super) fn drive_until_done(
        &mut self,
        ctx: &OpContext,
        sends: &mut [SendOp],
        recvs: &mut [RecvOp],
        deadline: Instant,
        any: bool,
    ) -> Result<()> {
        let mut spinner = Spinner::adaptive(self.policy, &self.waits);
        let mut woke = false;
        // With `any`: a send finishing returns too (its operation can complete), and so does
        // a frame stashed while a receive from any source waits (`wake_on_stash`).
        let sends_done = |sends: &[SendOp]| sends.iter().filter(|s| s.is_done()).count();
        let sent_before = sends_done(sends);
        let watch_stash = any && self.wake_on_stash;
        let stashed_before = if watch_stash {
            self.stashed_frames()
        } else {
            0
        };
        loop {
            let mut progress = false;
            let mut missing = false;
            for i in 0..sends.len() {
                let link = sends[i].link;
                for j in 0..sends[i].parts.len() {
                    let stripe = sends[i].parts[j].stripe;
                    // Frames go out on each socket in the order of the sends.
                    if sends[i].parts[j].is_done()
                        || sends[..i].iter().any(|s| {
                            s.link == link
                                && s.parts.iter().any(|p| p.stripe == stripe && !p.is_done())
                        })
                    {
                        continue;
                    }
                    if self.inb[link].is_none() {
                        missing = true;
                        break;
                    }
                    progress |= self.pump_send(ctx, &mut sends[i], j)?;
                }
            }
            for i in 0..recvs.len() {
                if recvs[i].done() {
                    continue;
                }
                let link = recvs[i].link;
                if self.inb[link].is_none() {
                    missing = true;
                    continue;
                }
                for j in 0..recvs[i].parts.len() {
                    let stripe = recvs[i].parts[j].stripe;
                    // Each socket is read once per pass, for the first receive waiting on it.
                    if recvs[i].parts[j].done
                        || recvs[..i]
                            .iter()
                            .any(|r| r.link == link && r.waits_on(stripe))
                    {
                        continue;
                    }
                    progress |= self.pump_recv(ctx, link, stripe, recvs, Mode::Posted)?;
                }
            }
            if progress {
                // (also the spell that ends the operation: for a small message the only one)
                spinner.progressed(&mut self.waits, self.policy);
            }
            let idle_wait = watch_stash && sends.is_empty() && recvs.is_empty();
            if sends.iter().all(|s| s.is_done()) && recvs.iter().all(|r| r.done()) && !idle_wait {
                return Ok(());
            }
            if any
                && (recvs.iter().any(|r| r.done())
                    || sends_done(sends) > sent_before
                    || (watch_stash && self.stashed_frames() > stashed_before)
                    || self.interrupted.swap(false, Ordering::AcqRel))
            {
                return Ok(());
            }
            if missing {
                // Links on their way: asks answered, connections accepted, asks repeated.
                progress |= self.pump_asking(ctx, deadline)?;
                for link in sends
                    .iter()
                    .map(|s| s.link)
                    .chain(recvs.iter().map(|r| r.link))
                {
                    self.ensure_link(ctx, link, deadline)?;
                }
            }
            if missing || woke && self.listener_ready {
                self.listener_ready = false;
                progress |= self.accept_pending();
            }
            if !progress {
                // Idle: drain what other sockets and pipes hold for later operations.
                for link in 0..self.inb.len() {
                    for stripe in 0..self.inb[link].as_ref().map_or(0, Vec::len) {
                        let idle_socket = matches!(&self.inb[link], Some(socks) if !socks[stripe].parked && !socks[stripe].eof)
                            && !recvs.iter().any(|r| r.link == link && r.waits_on(stripe));
                        if idle_socket {
                            progress |=
                                self.pump_recv(ctx, link, stripe, recvs, Mode::Opportunistic)?;
                        }
                    }
                }
            }
            if self.abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted { ctx: ctx.clone() });
            }
            if Instant::now() >= deadline {
                return Err(self.timeout_error(ctx, sends, recvs));
            }
            woke = false;
            if progress {
                spinner.progressed(&mut self.waits, self.policy);
            } else if spinner.idle() {
                self.block(ctx, sends, recvs, deadline)?;
                spinner.woke();
                woke = true;
            }
        }
    }

    pub(super) fn timeout_error(
        &self,
        ctx: &OpContext,
        sends: &[SendOp],
        recvs: &[RecvOp],
    ) -> Error {
        let mut peers = Vec::new();
        let mut detail = Vec::new();
        for r in recvs.iter().filter(|r| !r.done()) {
            peers.push(r.peer);
            let what = match r.expect {
                Expect::Coll(h) => format!("step {}", h.tag),
                Expect::P2pData { tag, .. } | Expect::P2pFirst(tag) => {
                    format!("message tag {tag}")
                }
                Expect::Reply { tag, .. } => format!("the go-ahead for message tag {tag}"),
                Expect::Control(_, tag) => format!("signal/handshake tag {tag}"),
            };
            detail.push(format!(
                "receive {what} from rank {} ({} of {} bytes)",
                r.peer,
                r.received(),
                r.sink.len()
            ));
        }
        for s in sends.iter().filter(|s| !s.is_done()) {
            peers.push(s.peer);
            detail.push(format!(
                "send to rank {} ({} of {} bytes)",
                s.peer,
                s.written(),
                s.total()
            ));
        }
        peers.sort_unstable();
        peers.dedup();
        Error::Timeout {
            ctx: ctx.clone(),
            peers,
            after: self.op_timeout,
            detail: format!("still waiting to {}", detail.join("; ")),
        }
    }

    /// Block in poll(2) until a socket we care about is ready or 100 ms pass.
    pub(super) fn block(
        &mut self,
        ctx: &OpContext,
        sends: &[SendOp],
        recvs: &[RecvOp],
        deadline: Instant,
    ) -> Result<()> {
        let mut fds: Vec<PollFd> = Vec::with_capacity(sends.len() + self.inb.len() + 1);
        // Shared-memory pipes: (link, pipe, wants to read, wants to write, this operation
        // needs the peer).
        let mut pipes: Vec<(usize, &ShmPipe, bool, bool, bool)> = Vec::new();
        for (link, socks) in self.inb.iter().enumerate() {
            let Some(socks) = socks else { continue };
            for (stripe, inb) in socks.iter().enumerate() {
                let wanted = recvs.iter().any(|r| r.link == link && r.waits_on(stripe));
                let read = wanted || !(inb.parked || inb.eof);
                let write = sends.iter().any(|s| {
                    s.link == link && s.parts.iter().any(|p| p.stripe == stripe && !p.is_done())
                });
                match &inb.pipe {
                    Pipe::Tcp(sock) => {
                        let mut flags = PollFlags::empty();
                        if read {
                            flags |= PollFlags::POLLIN;
                        }
                        if write {
                            flags |= PollFlags::POLLOUT;
                        }
                        if !flags.is_empty() {
                            fds.push(PollFd::new(sock.as_fd(), flags));
                        }
                    }
                    Pipe::Shm(p) if read || write => {
                        pipes.push((link, p, read, write, wanted || write))
                    }
                    Pipe::Shm(_) => {}
                }
            }
        }
        for sock in self.asking.iter().flatten() {
            fds.push(PollFd::new(sock.as_fd(), PollFlags::POLLIN));
        }
        fds.push(PollFd::new(self.acceptor.wake.as_fd(), PollFlags::POLLIN));
        // Pipes this operation only drains while idle do not need the doorbell: the sockets'
        // poll below, woken at least every 10 ms to drain them, costs fewer wake-ups than
        // 1 ms naps.
        let drain_only = !pipes.is_empty() && !pipes.iter().any(|p| p.4);
        if !pipes.is_empty() && !drain_only {
            // Shared-memory peers this operation waits for: their processes must still live (a
            // killed one never closes its end), checked every `LIFE_CHECK_EVERY`. A peer that is merely
            // drained while idle may have finished and left: no error until someone needs it
            // (as a closed socket).
            let now = Instant::now();
            if now.duration_since(self.shm_checked) >= crate::shm::LIFE_CHECK_EVERY {
                for (link, p, .., needed) in &pipes {
                    if !needed {
                        continue;
                    }
                    if let Some(detail) = p.peer_gone() {
                        return Err(Error::PeerClosed {
                            ctx: ctx.clone(),
                            peer: link - self.n,
                            detail,
                        });
                    }
                }
                self.shm_checked = now;
            }
            // Sockets that are ready already come first; then sleep on this rank's doorbell,
            // briefly when sockets matter too (they cannot wake a futex).
            let sockets_ready = |fds: &mut [PollFd]| match poll(fds, PollTimeout::ZERO) {
                Ok(n) => n > 0,
                Err(_) => false,
            };
            let mut any = sockets_ready(&mut fds);
            if !any {
                let shm = pipes[0].1.shm();
                let nap = if fds.len() > 1 { 1 } else { 10 };
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(nap));
                shm.sleep(
                    || {
                        pipes
                            .iter()
                            .any(|(_, p, r, w, _)| *r && p.readable() || *w && p.writable())
                    },
                    left,
                );
                any = sockets_ready(&mut fds);
            }
            let listener_ready = any
                && fds
                    .last()
                    .and_then(|f| f.revents())
                    .is_some_and(|r| r.intersects(PollFlags::POLLIN | PollFlags::POLLERR));
            drop(fds);
            drop(pipes);
            self.listener_ready |= listener_ready;
            return Ok(());
        }
        drop(pipes);
        // Wake at least every 100 ms so that deadlines and aborts are honoured promptly (10 ms
        // when idle pipes wait to be drained).
        let left = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(if drain_only { 10 } else { 100 }));
        let ms = left.as_millis().max(1) as u16;
        let listener_ready = match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => fds
                .last()
                .and_then(|f| f.revents())
                .is_some_and(|r| r.intersects(PollFlags::POLLIN | PollFlags::POLLERR)),
            Err(e) => return Err(Error::io(ctx.clone(), None, format!("poll: {e}"))),
        };
        drop(fds);
        self.listener_ready |= listener_ready;
        Ok(())
    }

    /// Write as much of part `j` of `s` as its socket takes now.
    pub(super) fn pump_send(&mut self, ctx: &OpContext, s: &mut SendOp, j: usize) -> Result<bool> {
        let k = self.kind_of(s.link);
        let p = &mut s.parts[j];
        let inb = &mut self.inb[s.link].as_mut().expect("linked")[p.stripe];
        let data = &s.data[p.lo..p.hi];
        let mut progress = false;
        while !p.is_done() {
            match inb.pipe.send_frame(&p.hdr, data, p.written) {
                Ok(0) => break,
                Ok(n) => {
                    p.written += n;
                    self.sent[k] += n as u64;
                    progress = true;
                }
                Err(e) if would_block(&e) => break,
                Err(e) => return Err(peer_io_error(ctx, s.peer, e)),
            }
        }
        inb.out_mid_frame = p.written > 0 && !p.is_done();
        Ok(progress)
    }

    /// After this communicator timed out waiting for `culprit`: announce it, then listen on
    /// every link for up to `grace` for the others' notices and follow the blame to the rank
    /// that is really stuck. A rank that timed out waiting for another names that one, and
    /// each better answer is announced again, so the answers converge along the chain of
    /// waits (ring: 0 waits for 3, 3 for 2, 2 for the stopped 1 → everyone ends at 1). Data
    /// frames read meanwhile are discarded: the communicator has failed. Returns the culprit.
    pub fn settle_blame(
        &mut self,
        seq: u64,
        mut culprit: Option<usize>,
        reason: u8,
        grace: Duration,
    ) -> Option<usize> {
        self.send_abort(seq, culprit, reason);
        let end = Instant::now() + grace;
        while Instant::now() < end {
            let mut better = None;
            for inb in self.inb.iter_mut().flatten().flatten() {
                // Bounded by the grace period even when a peer keeps sending data.
                while Instant::now() < end {
                    let Some(h) = next_abort(inb) else { break };
                    let c = abort_notice(&h).1;
                    if c.is_some() && c != Some(self.rank) && c != culprit {
                        better = c;
                    }
                }
            }
            if better.is_some() {
                culprit = better;
                self.send_abort(seq, culprit, reason);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        culprit
    }

    /// Tell every linked peer that this communicator failed (blaming `culprit` for `reason`),
    /// best effort and without blocking: a peer waiting on this rank then fails at once, with
    /// the cause, instead of at its deadline. The notice goes on every socket of the link that
    /// is at a frame boundary (sockets with a partly sent frame are skipped).
    pub fn send_abort(&mut self, seq: u64, culprit: Option<usize>, reason: u8) {
        let h = Header {
            root: culprit.map_or(u32::MAX, |c| c as u32),
            seq,
            ..Header::new(Kind::Abort, reason as u32, 0)
        };
        let bytes = h.encode();
        for inb in self.inb.iter_mut().flatten().flatten() {
            if inb.out_mid_frame || inb.eof {
                continue;
            }
            // 40 bytes into a socket buffer: all or nothing in practice. After a partial
            // write the stream is out of step: no further notice goes on this socket.
            match inb.pipe.send_whole(&bytes) {
                Ok(n) if n == bytes.len() => {}
                Ok(0) | Err(_) => {}
                Ok(_) => inb.out_mid_frame = true,
            }
        }
    }

    /// Read and dispatch frames from socket `stripe` of `peer` as long as data is available
    /// and (in `Posted` mode) someone wants it, or (in `Opportunistic` mode) the frames can be
    /// stashed. Only socket 0 carries control frames and eager messages (and so has a stash);
    /// the others carry stripes of large payloads only.
    pub(super) fn pump_recv(
        &mut self,
        ctx: &OpContext,
        link: usize,
        stripe: usize,
        recvs: &mut [RecvOp],
        mode: Mode,
    ) -> Result<bool> {
        let peer = link % self.n;
        let k = self.kind_of(link);
        let inb = &mut self.inb[link].as_mut().expect("accepted")[stripe];
        if mode == Mode::Posted {
            inb.parked = false;
        }
        let wanted = |recvs: &[RecvOp]| recvs.iter().any(|r| r.link == link && r.waits_on(stripe));
        let mut progress = false;
        loop {
            // Payload of the current frame.
            if let Some((target, left)) = inb.cur.take() {
                let (i, j) = match &target {
                    Target::Recv(id) | Target::Discard(id) => match find_part(recvs, *id) {
                        Some(ij) => ij,
                        None => {
                            // Only an opportunistic pass can see a frame whose receive is not
                            // part of this exchange; leave it for the exchange that owns it.
                            inb.cur = Some((target, left));
                            if mode == Mode::Opportunistic {
                                inb.parked = true;
                                return Ok(progress);
                            }
                            return Err(Error::io(
                                ctx.clone(),
                                Some(peer),
                                "internal: a partly received message lost its receive",
                            ));
                        }
                    },
                    Target::Stash(..) => (usize::MAX, usize::MAX),
                };
                if left == 0 {
                    match target {
                        Target::Recv(_) | Target::Discard(_) => {
                            let r = &mut recvs[i];
                            let (p, sink) = r.part_mut(j);
                            p.flush_staging(sink);
                            let h = p.pending.expect("a frame is being read");
                            r.finish_part(j, h);
                        }
                        Target::Stash(h, data) => {
                            inb.push_stash(Stashed::Eager(h, data));
                            // A receive posted while this frame was on its way takes it now.
                            for r in recvs.iter_mut().filter(|r| r.link == link) {
                                inb.take_stashed(r);
                            }
                        }
                    }
                    progress = true;
                    if mode == Mode::Posted && !wanted(recvs) {
                        return Ok(progress);
                    }
                    continue;
                }
                let buffered = inb.iend - inb.ipos;
                if buffered > 0 {
                    let n = buffered.min(left);
                    let bytes = &inb.ibuf[inb.ipos..inb.ipos + n];
                    let mut target = target;
                    match &mut target {
                        Target::Recv(_) => {
                            let (p, sink) = recvs[i].part_mut(j);
                            p.deliver(sink, bytes);
                        }
                        Target::Stash(_, v) => v.extend_from_slice(bytes),
                        Target::Discard(_) => {}
                    }
                    inb.ipos += n;
                    self.received[k] += n as u64;
                    inb.cur = Some((target, left - n));
                    progress = true;
                    continue;
                }
                inb.ipos = 0;
                inb.iend = 0;
                if matches!(target, Target::Recv(_)) && left >= DIRECT_READ_MIN && !inb.eof {
                    let (p, sink) = recvs[i].part_mut(j);
                    let buf = p.direct_target(sink, left);
                    match inb.pipe.read(buf) {
                        Ok(0) => return Err(closed(ctx, peer)),
                        Ok(n) => {
                            self.received[k] += n as u64;
                            p.direct_done(sink, n);
                            inb.cur = Some((target, left - n));
                            progress = true;
                            continue;
                        }
                        Err(e) if would_block(&e) => {
                            inb.cur = Some((target, left));
                            return Ok(progress);
                        }
                        Err(e) => return Err(peer_io_error(ctx, peer, e)),
                    }
                }
                inb.cur = Some((target, left));
                if !fill(inb, ctx, peer, mode)? {
                    return Ok(progress);
                }
                continue;
            }
            // Need a header.
            if inb.iend - inb.ipos < HEADER_LEN {
                if inb.ipos > 0 {
                    inb.ibuf.copy_within(inb.ipos..inb.iend, 0);
                    inb.iend -= inb.ipos;
                    inb.ipos = 0;
                }
                if !fill(inb, ctx, peer, mode)? {
                    return Ok(progress);
                }
                continue;
            }
            let protocol = |msg: String| Error::Protocol {
                ctx: ctx.clone(),
                peer,
                msg,
            };
            // Control frames carry no payload and no length exceeds MAX_PAYLOAD (checked by
            // decode); every length is then checked against the receive it is for.
            let hdr = Header::decode_prefix(&inb.ibuf[inb.ipos..inb.iend])
                .map_err(|e| protocol(e.to_string()))?;
            let len = usize::try_from(hdr.len)
                .map_err(|_| protocol(format!("{}-byte payload", hdr.len)))?;
            let is_control = !hdr.kind.has_payload();
            if mode == Mode::Opportunistic {
                // Only socket 0 stashes; on the others every frame waits for its receive
                // (an abort notice is read when someone needs the socket).
                let stashable = stripe == 0
                    && if is_control {
                        inb.room_for(0)
                    } else {
                        hdr.kind == Kind::P2p && len <= EAGER_MAX && inb.room_for(len)
                    };
                if !stashable {
                    inb.parked = true;
                    return Ok(progress);
                }
            }
            inb.ipos += HEADER_LEN;
            self.received[k] += HEADER_LEN as u64;
            progress = true;
            // The first receive that waits for a frame on this socket (and satisfies `pred`).
            let pending_of = |recvs: &[RecvOp], pred: &dyn Fn(&RecvOp) -> bool| {
                recvs.iter().enumerate().find_map(|(i, r)| {
                    if r.link != link || r.done() || !pred(r) {
                        return None;
                    }
                    r.parts
                        .iter()
                        .position(|p| p.stripe == stripe && !p.done && p.pending.is_none())
                        .map(|j| (i, j))
                })
            };
            match hdr.kind {
                Kind::Collective => {
                    let (i, j) = match_collective(ctx, peer, stripe, &hdr, recvs)?;
                    let p = &mut recvs[i].parts[j];
                    p.pending = Some(hdr);
                    inb.cur = Some((Target::Recv(p.id), len));
                }
                Kind::P2p => {
                    // Rendezvous data goes to the receive that agreed on its message id; any
                    // other frame with the tag is the first frame of a message (eager data),
                    // for the first receive posted for the tag.
                    let matched = pending_of(recvs, &|r| {
                        matches!(r.expect, Expect::P2pData { tag, id } if tag == hdr.tag && id == hdr.seq)
                    })
                    .or_else(|| {
                        pending_of(recvs, &|r| matches!(r.expect, Expect::P2pFirst(tag) if tag == hdr.tag))
                    });
                    // The sender puts the message size in `count`, and in `len` too unless the
                    // frame is one stripe of agreed (RTS / Ready) data.
                    let stripe_of_data = matched.is_some_and(|(i, _)| {
                        matches!(recvs[i].expect, Expect::P2pData { .. })
                            && recvs[i].parts.len() > 1
                    });
                    if hdr.count != hdr.len && !stripe_of_data {
                        return Err(protocol(format!(
                            "point-to-point frame with tag {} carries {len} bytes but announces {}",
                            hdr.tag, hdr.count
                        )));
                    }
                    if let Some((i, j)) = matched {
                        let r = &mut recvs[i];
                        let whole = r.sink.len();
                        let p = &mut r.parts[j];
                        let fits = len == p.len();
                        match r.expect {
                            // The size was agreed (RTS / Ready): anything else is not our peer's
                            // program.
                            Expect::P2pData { .. } if !fits || hdr.count != whole as u64 => {
                                return Err(protocol(format!(
                                    "{len}-byte data with tag {} after agreeing on {} bytes",
                                    hdr.tag,
                                    p.len()
                                )));
                            }
                            // Eager data is never larger than EAGER_MAX (larger messages send
                            // an RTS first); a smaller mismatch is discarded and reported.
                            Expect::P2pFirst(_) if len > EAGER_MAX => {
                                return Err(protocol(format!(
                                    "{len}-byte message with tag {} sent without a handshake",
                                    hdr.tag
                                )));
                            }
                            _ => {}
                        }
                        p.pending = Some(hdr);
                        let t = if fits {
                            Target::Recv(p.id)
                        } else {
                            Target::Discard(p.id)
                        };
                        inb.cur = Some((t, len));
                    } else if stripe == 0 && len <= EAGER_MAX && inb.room_for(len) {
                        inb.cur = Some((Target::Stash(hdr, Vec::with_capacity(len)), len));
                    } else if stripe == 0 && len <= EAGER_MAX {
                        return Err(Error::Protocol {
                            ctx: ctx.clone(),
                            peer,
                            msg: format!("more than {MAX_UNEXPECTED_BYTES} bytes of messages that no receive has been posted for"),
                        });
                    } else {
                        return Err(Error::Protocol {
                            ctx: ctx.clone(),
                            peer,
                            msg: format!(
                                "{len}-byte message with tag {} sent without a handshake",
                                hdr.tag
                            ),
                        });
                    }
                }
                Kind::Abort => {
                    let (reason, culprit) = abort_notice(&hdr);
                    // Blamed while waiting for someone else: the blame passes on to the rank
                    // this one waits for (along the chain to the real cause).
                    let waiting_for = recvs
                        .iter()
                        .find(|r| !r.done() && r.peer != peer)
                        .map(|r| r.peer);
                    return Err(reason.remote_error(
                        ctx.clone(),
                        peer,
                        culprit,
                        self.rank,
                        waiting_for,
                    ));
                }
                _ if stripe != 0 => {
                    return Err(protocol(format!(
                        "{:?} frame on data socket {stripe} (control frames use socket 0)",
                        hdr.kind
                    )));
                }
                _ => {
                    match pending_of(recvs, &|r| r.expect.accepts(&hdr, false)) {
                        Some((i, j)) => recvs[i].finish_part(j, hdr),
                        None if inb.room_for(0) => inb.push_stash(Stashed::Control(hdr)),
                        None => {
                            return Err(Error::Protocol {
                                ctx: ctx.clone(),
                                peer,
                                msg: "too many unconsumed signals/control frames".into(),
                            });
                        }
                    }
                    if mode == Mode::Posted && !wanted(recvs) {
                        return Ok(progress);
                    }
                }
            }
        }
    }
}

/// Find the receive part a collective frame on socket `stripe` belongs to: the first pending
/// collective receive of the peer that waits on that socket, with the same fingerprint and the
/// stripe's size. Anything else is a mismatch between the ranks' programs.
pub(super) fn match_collective(
    ctx: &OpContext,
    peer: usize,
    stripe: usize,
    hdr: &Header,
    recvs: &[RecvOp],
) -> Result<(usize, usize)> {
    let (i, j) = recvs
        .iter()
        .enumerate()
        .filter(|(_, r)| r.peer == peer && !r.done() && matches!(r.expect, Expect::Coll(_)))
        .find_map(|(i, r)| {
            r.parts
                .iter()
                .position(|p| p.stripe == stripe && !p.done && p.pending.is_none())
                .map(|j| (i, j))
        })
        .ok_or_else(|| unexpected(ctx, peer, hdr, recvs))?;
    let r = &recvs[i];
    let Expect::Coll(fp) = r.expect else {
        unreachable!()
    };
    if fp.same_fingerprint(hdr) && hdr.tag == fp.tag && hdr.len as usize == r.parts[j].len() {
        Ok((i, j))
    } else {
        Err(unexpected(ctx, peer, hdr, recvs))
    }
}
