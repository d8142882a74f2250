//! What arrives on a link before anyone asks for it: the pipe a link reads (a TCP socket or
//! the shared-memory rings of a peer on this host), its input buffer, the stash of eager
//! messages and control frames nobody waits for yet (bounded by [`MAX_UNEXPECTED_BYTES`]),
//! and the abort notices a peer sends.

use super::*;

/// A frame that arrived before anyone waited for it.
pub(super) enum Stashed {
    /// A control frame (signal, connect, RTS, Nack, …).
    Control(Header),
    /// An eager point-to-point message.
    Eager(Header, Vec<u8>),
}

/// Where the payload of the frame being read goes.
pub(super) enum Target {
    /// Into the sink of the receive with this id.
    Recv(u64),
    /// Into a buffer for the stash (eager message nobody waits for yet).
    Stash(Header, Vec<u8>),
    /// Nowhere: the receive with this id gets the header only (size mismatch).
    Discard(u64),
}

/// What carries a link's bytes.
pub(super) enum Pipe {
    /// A TCP socket (non-blocking).
    Tcp(Socket),
    /// The shared-memory rings with a peer on this host (point-to-point only).
    Shm(ShmPipe),
}

impl Pipe {
    pub(super) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Pipe::Tcp(s) => (&*s).read(buf),
            Pipe::Shm(p) => p.read(buf),
        }
    }

    /// Write the unsent part of a frame: `hdr[from..]` then `data` when `from` is inside the
    /// header, else `data[from - HEADER_LEN..]`.
    pub(super) fn send_frame(&self, hdr: &[u8], data: &[u8], from: usize) -> io::Result<usize> {
        match self {
            Pipe::Tcp(sock) if from < HEADER_LEN => {
                let bufs = [IoSlice::new(&hdr[from..]), IoSlice::new(data)];
                sock.send_vectored_with_flags(&bufs, nosignal())
            }
            Pipe::Tcp(sock) => sock.send_with_flags(&data[from - HEADER_LEN..], nosignal()),
            Pipe::Shm(p) if from < HEADER_LEN => p.write(&[&hdr[from..], data]),
            Pipe::Shm(p) => p.write(&[&data[from - HEADER_LEN..]]),
        }
    }

    /// Send a short notice whole or not at all, without blocking.
    pub(super) fn send_whole(&self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            Pipe::Tcp(sock) => sock.send_with_flags(bytes, nosignal() | dontwait()),
            Pipe::Shm(p) => p.write_whole(bytes),
        }
    }
}

/// Incoming side of a link: a socket (or shared-memory pipe) plus its input buffer and frame
/// state.
pub(super) struct Inbound {
    pub(super) pipe: Pipe,
    pub(super) ibuf: Vec<u8>,
    pub(super) ipos: usize,
    pub(super) iend: usize,
    /// The frame being read and its payload bytes left.
    pub(super) cur: Option<(Target, usize)>,
    /// Frames that arrived before anyone waited for them, in arrival order.
    pub(super) stash: VecDeque<Stashed>,
    /// Accounting of the stash (payload + per-entry cost).
    pub(super) stash_bytes: usize,
    /// The next frame belongs to a later operation: do not read until someone asks.
    pub(super) parked: bool,
    /// The peer closed this link (seen while nobody needed it).
    pub(super) eof: bool,
    /// A frame was partly sent on this link (an operation failed mid-send): the stream is out
    /// of step, so no abort notice can be sent on it.
    pub(super) out_mid_frame: bool,
    /// Payload bytes still to skip while looking for abort notices after a failure.
    pub(super) discard: usize,
}

impl Inbound {
    /// A link's socket, with send and receive buffers of `b` bytes (`HCOMM_SOCKET_BUF`; 0
    /// keeps the kernel's autotuning).
    pub(super) fn new(sock: Socket, b: usize) -> Inbound {
        if b > 0 {
            let _ = sock.set_send_buffer_size(b);
            let _ = sock.set_recv_buffer_size(b);
        }
        Self::with_pipe(Pipe::Tcp(sock))
    }

    pub(super) fn with_pipe(pipe: Pipe) -> Inbound {
        Inbound {
            pipe,
            ibuf: vec![0u8; IBUF],
            ipos: 0,
            iend: 0,
            cur: None,
            stash: VecDeque::new(),
            stash_bytes: 0,
            parked: false,
            eof: false,
            out_mid_frame: false,
            discard: 0,
        }
    }

    /// Can `len` more payload bytes be stashed?
    pub(super) fn room_for(&self, len: usize) -> bool {
        self.stash_bytes + len + STASH_ENTRY_COST <= MAX_UNEXPECTED_BYTES
    }

    pub(super) fn push_stash(&mut self, s: Stashed) {
        self.stash_bytes += STASH_ENTRY_COST
            + match &s {
                Stashed::Eager(_, d) => d.len(),
                Stashed::Control(_) => 0,
            };
        self.stash.push_back(s);
    }

    /// Complete `r` from the stash if a matching frame is there (first in arrival order). Only
    /// unstriped receives (control frames, the first frame of a point-to-point message) can be
    /// satisfied from the stash.
    pub(super) fn take_stashed(&mut self, r: &mut RecvOp) {
        if r.done() || r.parts.len() != 1 || r.parts[0].pending.is_some() {
            return;
        }
        let pos = self.stash.iter().position(|s| match s {
            Stashed::Control(h) => r.expect.accepts(h, false),
            Stashed::Eager(h, _) => r.expect.accepts(h, true),
        });
        let Some(pos) = pos else { return };
        match self.stash.remove(pos).expect("present") {
            Stashed::Control(h) => {
                self.stash_bytes -= STASH_ENTRY_COST;
                r.finish_part(0, h);
            }
            Stashed::Eager(h, data) => {
                self.stash_bytes -= STASH_ENTRY_COST + data.len();
                if data.len() == r.sink.len() {
                    let (p, sink) = r.part_mut(0);
                    p.deliver(sink, &data);
                }
                r.finish_part(0, h);
            }
        }
    }

    /// Take a stashed `Nack` (the answer to an earlier eager message), if any.
    pub(super) fn take_nack(&mut self) -> Option<Header> {
        let pos = self
            .stash
            .iter()
            .position(|s| matches!(s, Stashed::Control(h) if h.kind == Kind::Nack))?;
        self.stash_bytes -= STASH_ENTRY_COST;
        match self.stash.remove(pos) {
            Some(Stashed::Control(h)) => Some(h),
            _ => None,
        }
    }
}

/// Read more into the link's input buffer: `Ok(true)` if bytes came. End of stream is an
/// error when someone waits for this peer (`Posted`), and is only remembered otherwise (a peer
/// that finished and left is no error until somebody needs it).
pub(super) fn fill(inb: &mut Inbound, ctx: &OpContext, peer: usize, mode: Mode) -> Result<bool> {
    if inb.eof {
        return if mode == Mode::Posted {
            Err(closed(ctx, peer))
        } else {
            Ok(false)
        };
    }
    match inb.pipe.read(&mut inb.ibuf[inb.iend..]) {
        Ok(0) => {
            inb.eof = true;
            if mode == Mode::Posted {
                Err(closed(ctx, peer))
            } else {
                Ok(false)
            }
        }
        Ok(n) => {
            inb.iend += n;
            Ok(true)
        }
        Err(e) if would_block(&e) => Ok(false),
        Err(e) if mode == Mode::Opportunistic => {
            tracing::debug!(peer, "link closed: {e}");
            inb.eof = true;
            Ok(false)
        }
        Err(e) => Err(peer_io_error(ctx, peer, e)),
    }
}

/// The reason and the blamed rank an abort notice carries (see [`Kind::Abort`]).
pub(super) fn abort_notice(h: &Header) -> (crate::base::error::AbortReason, Option<usize>) {
    (
        crate::base::error::AbortReason::from_u8(h.tag as u8),
        (h.root != u32::MAX).then_some(h.root as usize),
    )
}

/// The next abort notice readable on a failed link without blocking, discarding every other
/// frame (and the rest of a partly read one). `None` when nothing more can be read now.
pub(super) fn next_abort(inb: &mut Inbound) -> Option<Header> {
    if let Some((_, left)) = inb.cur.take() {
        inb.discard += left;
    }
    // At most 64 reads (4 MiB) per call, so a peer that keeps sending cannot hold us here.
    let mut reads = 0;
    loop {
        if inb.discard > 0 && inb.iend > inb.ipos {
            let n = (inb.iend - inb.ipos).min(inb.discard);
            inb.ipos += n;
            inb.discard -= n;
            continue;
        }
        if inb.discard == 0 && inb.iend - inb.ipos >= HEADER_LEN {
            let Ok(h) = Header::decode_prefix(&inb.ibuf[inb.ipos..inb.iend]) else {
                inb.eof = true; // out of step: nothing more to learn from this link
                return None;
            };
            inb.ipos += HEADER_LEN;
            if h.kind == Kind::Abort {
                return Some(h);
            }
            inb.discard = usize::try_from(h.len).unwrap_or(usize::MAX);
            continue;
        }
        if inb.eof {
            return None;
        }
        if inb.ipos > 0 {
            inb.ibuf.copy_within(inb.ipos..inb.iend, 0);
            inb.iend -= inb.ipos;
            inb.ipos = 0;
        }
        if reads == 64 {
            return None;
        }
        reads += 1;
        match inb.pipe.read(&mut inb.ibuf[inb.iend..]) {
            Ok(0) => {
                inb.eof = true;
                return None;
            }
            Ok(n) => inb.iend += n,
            Err(e) if would_block(&e) => return None,
            Err(_) => {
                inb.eof = true;
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::error::AbortReason;

    fn inbound() -> Inbound {
        let (a, _b) = Socket::pair(Domain::UNIX, Type::STREAM, None).unwrap();
        Inbound::new(a, 0)
    }

    fn header(kind: Kind, tag: u32, len: usize) -> Header {
        Header {
            kind,
            dtype: 0,
            coll: 0,
            redop: 0,
            algo: 0,
            root: u32::MAX,
            tag,
            seq: 0,
            count: len as u64,
            len: len as u64,
        }
    }

    #[test]
    fn the_stash_accounts_every_byte_and_matches_by_tag_in_arrival_order() {
        let mut inb = inbound();
        inb.push_stash(Stashed::Eager(header(Kind::P2p, 7, 3), vec![1, 2, 3]));
        inb.push_stash(Stashed::Eager(header(Kind::P2p, 7, 3), vec![4, 5, 6]));
        inb.push_stash(Stashed::Control(header(Kind::Nack, 9, 0)));
        assert_eq!(inb.stash_bytes, 3 * STASH_ENTRY_COST + 6);
        // Another tag is not taken.
        let mut other = [0u8; 3];
        let mut r = RecvOp::p2p_first(1, 8, &mut other);
        r.split(1, &mut 0);
        inb.take_stashed(&mut r);
        assert!(!r.is_done());
        // The first message with the tag is, then the second.
        for want in [[1u8, 2, 3], [4, 5, 6]] {
            let mut buf = [0u8; 3];
            let mut r = RecvOp::p2p_first(1, 7, &mut buf);
            r.split(1, &mut 0);
            inb.take_stashed(&mut r);
            assert!(r.is_done());
            assert_eq!(r.into_buf(), &want);
        }
        assert_eq!(inb.take_nack().map(|h| h.tag), Some(9));
        assert_eq!(inb.take_nack(), None);
        assert_eq!(inb.stash_bytes, 0);
    }

    #[test]
    fn an_eager_message_of_another_size_completes_with_its_header_only() {
        let mut inb = inbound();
        inb.push_stash(Stashed::Eager(header(Kind::P2p, 1, 4), vec![9; 4]));
        let mut buf = [0u8; 2];
        let mut r = RecvOp::p2p_first(0, 1, &mut buf);
        r.split(1, &mut 0);
        inb.take_stashed(&mut r);
        assert_eq!(
            r.header().map(|h| h.len),
            Some(4),
            "the sender's size is told"
        );
        assert_eq!(r.into_buf(), &[0, 0], "nothing is written");
    }

    #[test]
    fn the_stash_is_bounded() {
        let inb = inbound();
        assert!(inb.room_for(MAX_UNEXPECTED_BYTES - STASH_ENTRY_COST));
        assert!(!inb.room_for(MAX_UNEXPECTED_BYTES - STASH_ENTRY_COST + 1));
    }

    #[test]
    fn after_a_failure_only_abort_notices_are_read() {
        let mut inb = inbound();
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&header(Kind::P2p, 1, 5).encode());
        bytes.extend_from_slice(&[0xAB; 5]);
        let abort = Header {
            root: 2,
            ..header(Kind::Abort, AbortReason::PeerGone as u32, 0)
        };
        bytes.extend_from_slice(&abort.encode());
        assert!(bytes.len() > 2 * HEADER_LEN);
        inb.ibuf[..bytes.len()].copy_from_slice(&bytes);
        inb.iend = bytes.len();
        let got = next_abort(&mut inb).expect("the abort notice");
        assert_eq!(abort_notice(&got), (AbortReason::PeerGone, Some(2)));
    }
}
