//! The operations every transport carries out for an algorithm: frames to send
//! ([`SendOp`]), frames to receive ([`RecvOp`]) and where their payload goes ([`Sink`]),
//! with the cut of large payloads into stripes that both ends compute alike.
//!
//! A reducing receive is the algorithm's, not the transport's: a transport hands the bytes
//! it reads to the receive's [`Sink`], which copies them or combines them with the
//! accumulator ([`Sink::absorb`]) in the order the algorithm chose.

use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::{Error, OpContext};
use crate::base::reduce::{reduce_into, reduce_pair, Order};
use crate::wire::frame::{Header, Kind, HEADER_LEN};

/// Smallest stripe: a payload of `len` bytes travels over `min(nsocks, len / STRIPE_MIN)`
/// sockets (at least one), so only payloads of `2 × STRIPE_MIN` = 256 KiB or more are ever
/// striped, and every stripe carries at least ~68 KiB (see [`stripe_bounds`]).
pub const STRIPE_MIN: usize = 128 << 10;
/// Stripe boundaries fall on multiples of this (a multiple of every element size, so each
/// stripe of a reduction holds whole elements).
pub(super) const STRIPE_ALIGN: usize = 4096;

/// How many sockets a payload of `len` bytes is striped across with `nsocks` sockets per peer.
pub fn stripes(len: usize, nsocks: usize) -> usize {
    (len / STRIPE_MIN).clamp(1, nsocks.max(1))
}

/// Byte range `[lo, hi)` of stripe `i` of `n` of a `len`-byte payload: contiguous slices of
/// `⌈len / n⌉` rounded up to `STRIPE_ALIGN`, the last one taking the rest. Both ends of a
/// link compute the same cut from the length alone.
pub fn stripe_bounds(len: usize, n: usize, i: usize) -> (usize, usize) {
    if n <= 1 {
        return (0, len);
    }
    let chunk = len.div_ceil(n).next_multiple_of(STRIPE_ALIGN);
    (
        i.saturating_mul(chunk).min(len),
        (i + 1).saturating_mul(chunk).min(len),
    )
}

/// Where received payload goes.
pub enum Sink<'a> {
    /// Copy into this buffer.
    Buf(&'a mut [u8]),
    /// Reduce into this buffer.
    Reduce {
        /// Accumulator: where the result goes.
        dst: &'a mut [u8],
        /// The accumulator's value, when it is not `dst`'s own (an out-of-place reduction
        /// reads its input here and writes `dst` in the same pass, so `dst` need not be
        /// filled first); `dst`'s length.
        acc: Option<&'a [u8]>,
        /// Element type.
        dtype: DType,
        /// Operator.
        op: ReduceOp,
        /// Operand order.
        order: Order,
    },
}

impl Sink<'_> {
    /// Payload bytes this sink takes.
    pub fn len(&self) -> usize {
        match self {
            Sink::Buf(b) => b.len(),
            Sink::Reduce { dst, .. } => dst.len(),
        }
    }

    /// True for a sink of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Take payload `bytes` that belong at byte offset `at`: copied there, or combined with
    /// the accumulator there (`bytes` must then hold whole elements).
    pub fn absorb(&mut self, at: usize, bytes: &[u8]) {
        match self {
            Sink::Buf(b) => b[at..at + bytes.len()].copy_from_slice(bytes),
            Sink::Reduce {
                dst,
                acc,
                dtype,
                op,
                order,
            } => {
                let out = &mut dst[at..at + bytes.len()];
                match (acc, *order) {
                    (None, _) => reduce_into(*dtype, *op, out, bytes, *order),
                    (Some(a), Order::AccFirst) => {
                        reduce_pair(*dtype, *op, out, &a[at..at + bytes.len()], bytes)
                    }
                    (Some(a), Order::SrcFirst) => {
                        reduce_pair(*dtype, *op, out, bytes, &a[at..at + bytes.len()])
                    }
                }
            }
        }
    }
}

/// A frame to send.
pub struct SendOp<'a> {
    pub(super) peer: usize,
    /// The link it goes on (see [`TcpLinks::route`]); set when an exchange starts.
    pub(super) link: usize,
    pub(super) hdr: Header,
    pub(super) data: &'a [u8],
    /// One frame per stripe (cut by the links when the send starts).
    pub(super) parts: Vec<SendPart>,
}

/// The part of a send that travels on one of the peer's sockets: a frame of its own.
pub(super) struct SendPart {
    pub(super) stripe: usize,
    pub(super) hdr: [u8; HEADER_LEN],
    pub(super) lo: usize,
    pub(super) hi: usize,
    pub(super) written: usize,
}

impl SendPart {
    pub(super) fn total(&self) -> usize {
        HEADER_LEN + self.hi - self.lo
    }

    pub(super) fn is_done(&self) -> bool {
        self.written == self.total()
    }
}

impl<'a> SendOp<'a> {
    /// Send `hdr` followed by `data` (`hdr.len` must equal `data.len()`).
    pub fn new(peer: usize, hdr: Header, data: &'a [u8]) -> SendOp<'a> {
        debug_assert_eq!(hdr.len as usize, data.len());
        SendOp {
            peer,
            link: peer,
            hdr,
            data,
            parts: Vec::new(),
        }
    }

    /// Cut into one frame per stripe (payloads of [`STRIPE_MIN`] × 2 bytes or more with several
    /// sockets per peer; everything else is one frame on socket 0).
    pub(super) fn split(&mut self, nsocks: usize) {
        if !self.parts.is_empty() {
            return;
        }
        let n = if self.hdr.kind.has_payload() {
            stripes(self.data.len(), nsocks)
        } else {
            1
        };
        self.parts = (0..n)
            .map(|i| {
                let (lo, hi) = stripe_bounds(self.data.len(), n, i);
                SendPart {
                    stripe: i,
                    hdr: Header {
                        len: (hi - lo) as u64,
                        ..self.hdr
                    }
                    .encode(),
                    lo,
                    hi,
                    written: 0,
                }
            })
            .collect();
    }

    pub(super) fn total(&self) -> usize {
        HEADER_LEN * self.parts.len().max(1) + self.data.len()
    }

    pub(super) fn written(&self) -> usize {
        self.parts.iter().map(|p| p.written).sum()
    }

    /// True once every byte is handed to the kernel.
    pub fn is_done(&self) -> bool {
        !self.parts.is_empty() && self.parts.iter().all(SendPart::is_done)
    }
}

/// A set of control-frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KindSet(u16);

impl KindSet {
    /// The set of `kinds`.
    pub fn of(kinds: &[Kind]) -> KindSet {
        KindSet(kinds.iter().fold(0, |m, k| m | (1 << *k as u8)))
    }

    pub(super) fn has(self, k: Kind) -> bool {
        self.0 & (1 << k as u8) != 0
    }
}

/// What a receive waits for.
#[derive(Clone, Copy, Debug)]
pub enum Expect {
    /// A collective frame with this fingerprint (and `len` equal to the sink's size).
    Coll(Header),
    /// A control frame (no payload) of one of these kinds with this tag.
    Control(KindSet, u32),
    /// The receiver's answer (Ready or Nack) to our message `id` with `tag`.
    Reply {
        /// User tag.
        tag: u32,
        /// Message id (the RTS's `seq`).
        id: u64,
    },
    /// Point-to-point data of message `id` (the sender's RTS `seq`) with `tag`, after the
    /// RTS/Ready handshake.
    P2pData {
        /// User tag.
        tag: u32,
        /// Message id.
        id: u64,
    },
    /// The first frame of a point-to-point message with this tag: eager data, or an RTS.
    P2pFirst(u32),
}

impl Expect {
    /// Does a control frame `h` (or a stashed eager message, `eager`) satisfy this?
    pub(super) fn accepts(&self, h: &Header, eager: bool) -> bool {
        match *self {
            Expect::Control(set, tag) => !eager && set.has(h.kind) && h.tag == tag,
            Expect::Reply { tag, id } => {
                !eager && matches!(h.kind, Kind::Ready | Kind::Nack) && h.tag == tag && h.seq == id
            }
            Expect::P2pFirst(tag) => h.tag == tag && (eager || h.kind == Kind::Rts),
            Expect::Coll(_) | Expect::P2pData { .. } => false,
        }
    }

    /// Can the frame this waits for be striped? (Only data whose size both sides know:
    /// collective frames and agreed point-to-point data.)
    pub(super) fn striped(&self) -> bool {
        matches!(self, Expect::Coll(_) | Expect::P2pData { .. })
    }
}

/// A frame to receive.
pub struct RecvOp<'a> {
    pub(super) peer: usize,
    /// The link it reads (see [`TcpLinks::route`]); set when an exchange starts.
    pub(super) link: usize,
    pub(super) expect: Expect,
    pub(super) sink: Sink<'a>,
    /// Set when every part is complete; for control frames, the received header.
    pub(super) got: Option<Header>,
    /// One part per stripe (cut by the links when the receive starts).
    pub(super) parts: Vec<RecvPart>,
}

/// The part of a receive that arrives on one of the peer's sockets: `sink[lo..hi]`.
pub(super) struct RecvPart {
    pub(super) stripe: usize,
    pub(super) lo: usize,
    pub(super) hi: usize,
    /// Header of the data frame being received into this part.
    pub(super) pending: Option<Header>,
    /// Identity while a frame is read into it across calls.
    pub(super) id: u64,
    /// Payload bytes delivered so far (from `lo`).
    pub(super) delivered: usize,
    pub(super) staging: Vec<u64>,
    pub(super) staged: usize,
    pub(super) done: bool,
}

impl RecvPart {
    pub(super) fn len(&self) -> usize {
        self.hi - self.lo
    }

    /// Deliver payload bytes (never more than the frame holds).
    pub(super) fn deliver(&mut self, sink: &mut Sink, bytes: &[u8]) {
        match sink {
            Sink::Buf(_) => {
                sink.absorb(self.lo + self.delivered, bytes);
                self.delivered += bytes.len();
            }
            Sink::Reduce { .. } => {
                let mut rest = bytes;
                while !rest.is_empty() {
                    let stg = bytemuck::cast_slice_mut::<u64, u8>(&mut self.staging);
                    let n = rest.len().min(stg.len() - self.staged);
                    stg[self.staged..self.staged + n].copy_from_slice(&rest[..n]);
                    self.staged += n;
                    rest = &rest[n..];
                    self.flush_staging_if_full(sink);
                }
            }
        }
    }

    pub(super) fn flush_staging_if_full(&mut self, sink: &mut Sink) {
        let cap = self.staging.len() * 8;
        if self.staged == cap || self.delivered + self.staged == self.len() {
            self.flush_staging(sink);
        }
    }

    pub(super) fn flush_staging(&mut self, sink: &mut Sink) {
        if let Sink::Reduce { .. } = sink {
            let stg = bytemuck::cast_slice::<u64, u8>(&self.staging);
            let n = self.staged;
            sink.absorb(self.lo + self.delivered, &stg[..n]);
            self.delivered += n;
            self.staged = 0;
        }
    }

    /// A buffer to read payload into directly (no copy through the link's input buffer).
    pub(super) fn direct_target<'s>(
        &'s mut self,
        sink: &'s mut Sink,
        frame_left: usize,
    ) -> &'s mut [u8] {
        match sink {
            Sink::Buf(b) => {
                let at = self.lo + self.delivered;
                &mut b[at..at + frame_left]
            }
            Sink::Reduce { .. } => {
                let stg = bytemuck::cast_slice_mut::<u64, u8>(&mut self.staging);
                let end = stg.len().min(self.staged + frame_left);
                &mut stg[self.staged..end]
            }
        }
    }

    pub(super) fn direct_done(&mut self, sink: &mut Sink, n: usize) {
        match sink {
            Sink::Buf(_) => self.delivered += n,
            Sink::Reduce { .. } => {
                self.staged += n;
                self.flush_staging_if_full(sink);
            }
        }
    }
}

impl<'a> RecvOp<'a> {
    /// Receive a collective frame.
    pub fn coll(peer: usize, fp: Header, sink: Sink<'a>) -> RecvOp<'a> {
        Self::make(peer, Expect::Coll(fp), sink)
    }

    /// Receive the first frame of a point-to-point message with `tag`: eager data into `buf`
    /// (when its size matches; else the data is dropped and [`header`](Self::header) tells the
    /// sender's size), or an RTS header.
    pub fn p2p_first(peer: usize, tag: u32, buf: &'a mut [u8]) -> RecvOp<'a> {
        Self::make(peer, Expect::P2pFirst(tag), Sink::Buf(buf))
    }

    /// Receive the rendezvous data of message `id` with `tag` into `buf`.
    pub fn p2p_data(peer: usize, tag: u32, id: u64, buf: &'a mut [u8]) -> RecvOp<'a> {
        Self::make(peer, Expect::P2pData { tag, id }, Sink::Buf(buf))
    }

    /// Receive a control frame of one of `kinds`.
    pub fn control(peer: usize, kinds: &[Kind], tag: u32) -> RecvOp<'a> {
        Self::make(
            peer,
            Expect::Control(KindSet::of(kinds), tag),
            Sink::Buf(&mut []),
        )
    }

    /// Receive the answer (Ready or Nack) to our message `id` with `tag`.
    pub fn reply(peer: usize, tag: u32, id: u64) -> RecvOp<'a> {
        Self::make(peer, Expect::Reply { tag, id }, Sink::Buf(&mut []))
    }

    pub(super) fn make(peer: usize, expect: Expect, sink: Sink<'a>) -> RecvOp<'a> {
        RecvOp {
            peer,
            link: peer,
            expect,
            sink,
            got: None,
            parts: Vec::new(),
        }
    }

    /// Cut into one part per stripe (the same cut as the sender's, from the size alone), each
    /// with a fresh id from `next_id`.
    pub(super) fn split(&mut self, nsocks: usize, next_id: &mut u64) {
        if !self.parts.is_empty() {
            return;
        }
        let len = self.sink.len();
        let n = if self.expect.striped() {
            stripes(len, nsocks)
        } else {
            1
        };
        self.parts = (0..n)
            .map(|i| {
                let (lo, hi) = stripe_bounds(len, n, i);
                *next_id += 1;
                RecvPart {
                    stripe: i,
                    lo,
                    hi,
                    pending: None,
                    id: *next_id,
                    delivered: 0,
                    staging: Vec::new(),
                    staged: 0,
                    done: false,
                }
            })
            .collect();
    }

    /// The header received (once complete).
    pub fn header(&self) -> Option<Header> {
        self.got
    }

    /// The peer.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// True once the frame is complete.
    pub fn is_done(&self) -> bool {
        self.got.is_some()
    }

    pub(super) fn done(&self) -> bool {
        self.got.is_some()
    }

    /// Does this receive still wait for a frame on socket `stripe`?
    pub(super) fn waits_on(&self, stripe: usize) -> bool {
        !self.done() && self.parts.iter().any(|p| p.stripe == stripe && !p.done)
    }

    /// Part `j` and the sink (borrowed together).
    pub(super) fn part_mut(&mut self, j: usize) -> (&mut RecvPart, &mut Sink<'a>) {
        (&mut self.parts[j], &mut self.sink)
    }

    /// Part `j` received `hdr` completely; the receive is complete with its last part (its
    /// header then says the total payload length).
    pub(super) fn finish_part(&mut self, j: usize, hdr: Header) {
        let p = &mut self.parts[j];
        p.pending = Some(hdr);
        p.done = true;
        if self.parts.iter().all(|p| p.done) {
            let len = self
                .parts
                .iter()
                .filter_map(|p| p.pending)
                .map(|h| h.len)
                .sum();
            self.got = Some(Header { len, ..hdr });
        }
    }

    /// Payload bytes received so far (for timeout reports).
    pub(super) fn received(&self) -> usize {
        self.parts.iter().map(|p| p.delivered + p.staged).sum()
    }

    /// Complete this receive with a whole frame `hdr` whose payload is `payload` (for
    /// transports that move a frame at once; `payload` must be the sink's size).
    pub(super) fn complete_whole(&mut self, hdr: Header, payload: &[u8]) {
        debug_assert_eq!(payload.len(), self.sink.len());
        self.sink.absorb(0, payload);
        self.got = Some(hdr);
    }

    /// What this receive waits for.
    pub(super) fn expects(&self) -> Expect {
        self.expect
    }

    /// Give back the receive buffer (for a follow-up receive into the same memory).
    pub fn into_buf(self) -> &'a mut [u8] {
        match self.sink {
            Sink::Buf(b) => b,
            Sink::Reduce { dst, .. } => dst,
        }
    }
}

/// The mismatch error for a frame `hdr` from `peer` that none of `recvs` waits for: names
/// both calls.
pub(super) fn unexpected(ctx: &OpContext, peer: usize, hdr: &Header, recvs: &[RecvOp]) -> Error {
    let describe = crate::wire::collective::describe_frame;
    let mine = recvs
        .iter()
        .find(|r| r.peer == peer && !r.done())
        .map(|r| match r.expect {
            Expect::Coll(fp) => describe(&Header {
                len: r.sink.len() as u64,
                ..fp
            }),
            Expect::P2pData { tag: t, .. } | Expect::P2pFirst(t) => {
                format!("recv(tag={t}, {} bytes)", r.sink.len())
            }
            Expect::Reply { tag, .. } => format!("the go-ahead for its send(tag={tag})"),
            Expect::Control(_, t) => format!("a signal/handshake with tag {t}"),
        })
        .unwrap_or_else(|| "nothing from it".into());
    let theirs = describe(hdr);
    // Calls that read the same differ in what the descriptions leave out: the sizes of the
    // blocks (all-to-all-v, gather-v, ...) or the step of the schedule.
    let detail = match recvs.iter().find(|r| r.peer == peer && !r.done()) {
        Some(RecvOp {
            expect: Expect::Coll(fp),
            sink,
            ..
        }) if theirs == mine => format!(
            " (it sent {} bytes at step {} where this rank expects {} bytes at step {}: the \
             ranks disagree on the per-rank counts or sizes)",
            hdr.len,
            hdr.tag,
            sink.len(),
            fp.tag
        ),
        _ => String::new(),
    };
    Error::Mismatch {
        ctx: ctx.clone(),
        peer,
        msg: format!("rank {peer} called {theirs} while this rank waits for {mine}{detail}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(len: usize) -> Header {
        Header {
            kind: Kind::Collective,
            dtype: DType::F32 as u8,
            coll: 1,
            redop: 1,
            algo: 1,
            root: u32::MAX,
            tag: 0,
            seq: 1,
            count: (len / 4) as u64,
            len: len as u64,
        }
    }

    #[test]
    fn stripes_cover_the_payload_in_aligned_contiguous_slices() {
        for len in [
            0,
            1,
            STRIPE_MIN,
            2 * STRIPE_MIN - 1,
            2 * STRIPE_MIN,
            5 << 20,
            (5 << 20) + 3,
        ] {
            for nsocks in 1..=5 {
                let n = stripes(len, nsocks);
                assert!(n >= 1 && n <= nsocks);
                if len < 2 * STRIPE_MIN {
                    assert_eq!(n, 1, "only payloads of 2 x STRIPE_MIN are striped");
                }
                let mut at = 0;
                for i in 0..n {
                    let (lo, hi) = stripe_bounds(len, n, i);
                    assert_eq!(lo, at, "len {len}, {n} stripes: gap before stripe {i}");
                    assert!(hi >= lo);
                    if i + 1 < n {
                        assert_eq!(hi % STRIPE_ALIGN, 0);
                    }
                    at = hi;
                }
                assert_eq!(at, len);
            }
        }
    }

    #[test]
    fn sender_and_receiver_cut_a_frame_alike() {
        let data = vec![0u8; (3 << 20) + 4];
        let mut s = SendOp::new(1, fp(data.len()), &data);
        s.split(4);
        let mut dst = vec![0u8; data.len()];
        let mut r = RecvOp::coll(0, fp(data.len()), Sink::Buf(&mut dst));
        let mut id = 0;
        r.split(4, &mut id);
        let send: Vec<_> = s.parts.iter().map(|p| (p.stripe, p.lo, p.hi)).collect();
        let recv: Vec<_> = r.parts.iter().map(|p| (p.stripe, p.lo, p.hi)).collect();
        assert_eq!(send.len(), 4);
        assert_eq!(send, recv);
        assert_eq!(id, 4, "each part gets its own id");
    }

    #[test]
    fn a_reducing_sink_combines_in_the_algorithms_order() {
        let f = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
        let mut acc = f(&[1.0, 2.0, 3.0]);
        let mut sink = Sink::Reduce {
            dst: &mut acc,
            acc: None,
            dtype: DType::F32,
            op: ReduceOp::Max,
            order: Order::SrcFirst,
        };
        sink.absorb(4, &f(&[5.0, 0.0]));
        assert_eq!(sink.len(), 12);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&acc), &[1.0, 5.0, 3.0]);
        let mut buf = vec![0u8; 4];
        let mut copy = Sink::Buf(&mut buf);
        copy.absorb(1, &[7, 8]);
        assert_eq!(buf, [0, 7, 8, 0]);
    }

    #[test]
    fn staged_delivery_reduces_every_byte_once() {
        // Deliver 600 KiB in odd pieces through a 256 KiB staging buffer.
        let n = 600 << 10;
        let src: Vec<u8> = (0..n).map(|i| (i % 7) as u8).collect();
        let mut acc = vec![1u8; n];
        let mut sink = Sink::Reduce {
            dst: &mut acc,
            acc: None,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            order: Order::AccFirst,
        };
        let mut r = RecvPart {
            stripe: 0,
            lo: 0,
            hi: n,
            pending: None,
            id: 1,
            delivered: 0,
            staging: vec![0u64; (256 << 10) / 8],
            staged: 0,
            done: false,
        };
        for piece in src.chunks(70_001) {
            r.deliver(&mut sink, piece);
        }
        assert_eq!(r.delivered, n);
        assert!(acc.iter().zip(&src).all(|(a, s)| *a == s + 1));
    }

    #[test]
    fn staged_delivery_with_an_accumulator_writes_incoming_then_acc_into_dst() {
        // Odd pieces through a staging buffer, into a destination of garbage: every byte must
        // come out as `incoming ⊕ acc`, each at its own offset.
        let n = 600 << 10;
        let src: Vec<u8> = (0..n).map(|i| (i % 7) as u8).collect();
        let acc: Vec<u8> = (0..n).map(|i| (i % 11) as u8).collect();
        for order in [Order::SrcFirst, Order::AccFirst] {
            let mut dst = vec![0xA5u8; n];
            let mut sink = Sink::Reduce {
                dst: &mut dst,
                acc: Some(&acc),
                dtype: DType::I8,
                op: ReduceOp::Sum,
                order,
            };
            let mut r = RecvPart {
                stripe: 0,
                lo: 0,
                hi: n,
                pending: None,
                id: 1,
                delivered: 0,
                staging: vec![0u64; (256 << 10) / 8],
                staged: 0,
                done: false,
            };
            for piece in src.chunks(70_001) {
                r.deliver(&mut sink, piece);
            }
            assert_eq!(r.delivered, n);
            assert!(dst
                .iter()
                .zip(src.iter().zip(&acc))
                .all(|(d, (s, a))| *d == s + a));
        }
        // The operand order reaches the operator: max of 0.0 and -0.0 (equal) keeps its first
        // operand, so the sign bits tell which came first.
        let f = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
        let (inc, a) = (f(&[0.0, -0.0]), f(&[-0.0, 0.0]));
        for (order, want) in [
            (Order::SrcFirst, [0.0f32, -0.0]),
            (Order::AccFirst, [-0.0, 0.0]),
        ] {
            let mut dst = vec![0u8; 8];
            let mut sink = Sink::Reduce {
                dst: &mut dst,
                acc: Some(&a),
                dtype: DType::F32,
                op: ReduceOp::Max,
                order,
            };
            sink.absorb(0, &inc);
            let got = bytemuck::cast_slice::<u8, f32>(&dst);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(got), bits(&want), "{order:?}");
        }
    }
}
