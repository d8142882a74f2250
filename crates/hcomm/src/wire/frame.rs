//! The frame header every message on a data link starts with.
//!
//! ```text
//! offset size field
//!      0    2 magic 0x4843 ("HC")
//!      2    1 kind  (Collective, P2p, Ready, Signal, Connect, Close, Rts, Nack)
//!      3    1 dtype code (0 = bytes)
//!      4    1 collective code (fingerprint; 0 for point-to-point)
//!      5    1 reduce-op code (0 = none)
//!      6    1 algorithm code (fingerprint; 0 for point-to-point)
//!      7    1 reserved (0)
//!      8    4 root (u32::MAX = none)
//!     12    4 tag (user tag for point-to-point, step for collectives)
//!     16    8 seq (collective sequence number; point-to-point message id)
//!     24    8 count (elements the caller passed; fingerprint)
//!     32    8 len (payload bytes that follow)
//! ```
//!
//! A collective's frames carry its fingerprint (collective, dtype, reduce op, root, count, seq),
//! so a rank that called a different collective, or the same one with different arguments, is
//! reported as a mismatch naming both calls instead of corrupting data or hanging.

/// Header size in bytes.
pub const HEADER_LEN: usize = 40;
const MAGIC: u16 = 0x4843;
/// Largest payload length a header may announce (no receive buffer can be larger than
/// `isize::MAX` bytes; every length is further checked against the receive it is for).
pub const MAX_PAYLOAD: u64 = isize::MAX as u64;

/// Why 40 bytes are not a valid frame header.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first two bytes are not the frame magic.
    #[error("bad frame magic {0:#06x} (stream out of sync or not an hcomm peer)")]
    BadMagic(u16),
    /// The kind byte names no frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The reserved byte is not 0.
    #[error("reserved header byte is {0}, not 0")]
    Reserved(u8),
    /// A control frame (no payload allowed) announces one.
    #[error("{kind:?} frame with a {len}-byte payload (control frames have none)")]
    ControlPayload {
        /// The frame's kind.
        kind: Kind,
        /// The announced payload length.
        len: u64,
    },
    /// The payload length is larger than any buffer.
    #[error("frame announces a {0}-byte payload, more than any buffer can hold")]
    TooLong(u64),
    /// Fewer than [`HEADER_LEN`] bytes.
    #[error("a frame header is {HEADER_LEN} bytes, got {0}")]
    Short(usize),
}

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Part of a collective's schedule.
    Collective = 1,
    /// A point-to-point message's data.
    P2p = 2,
    /// Receiver → sender: a matching receive is posted (carries its size in `len`-less `count`).
    Ready = 3,
    /// A signal (no payload).
    Signal = 4,
    /// Connection-object handshake.
    Connect = 5,
    /// Connection-object close.
    Close = 6,
    /// Sender → receiver: a large message of `count` bytes waits for a `Ready`.
    Rts = 7,
    /// Receiver → sender: the message with this tag did not fit (`count` = receive size).
    Nack = 8,
    /// The sender's communicator failed: `root` = the rank it blames (`u32::MAX`: none),
    /// `tag` = the reason code, `seq` = its operation's sequence number.
    Abort = 9,
}

impl Kind {
    /// True for the kinds that carry a payload (collective and point-to-point data); every
    /// other kind is a control frame whose `len` must be 0.
    pub fn has_payload(self) -> bool {
        matches!(self, Kind::Collective | Kind::P2p)
    }

    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Collective,
            2 => Kind::P2p,
            3 => Kind::Ready,
            4 => Kind::Signal,
            5 => Kind::Connect,
            6 => Kind::Close,
            7 => Kind::Rts,
            8 => Kind::Nack,
            9 => Kind::Abort,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Dtype code.
    pub dtype: u8,
    /// Collective code.
    pub coll: u8,
    /// Reduce-op code.
    pub redop: u8,
    /// Algorithm code (collectives): ranks running different schedules fail at once.
    pub algo: u8,
    /// Root rank or `u32::MAX`.
    pub root: u32,
    /// Tag / step.
    pub tag: u32,
    /// Sequence number.
    pub seq: u64,
    /// Element count (fingerprint) or, for `Ready`, the receive buffer's size.
    pub count: u64,
    /// Payload length.
    pub len: u64,
}

impl Header {
    /// A header with every fingerprint field empty.
    pub fn new(kind: Kind, tag: u32, len: u64) -> Header {
        Header {
            kind,
            dtype: 0,
            coll: 0,
            redop: 0,
            algo: 0,
            root: u32::MAX,
            tag,
            seq: 0,
            count: 0,
            len,
        }
    }

    /// Encode into 40 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.kind as u8;
        b[3] = self.dtype;
        b[4] = self.coll;
        b[5] = self.redop;
        b[6] = self.algo;
        b[8..12].copy_from_slice(&self.root.to_le_bytes());
        b[12..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decode, rejecting a bad magic, an unknown kind, a non-zero reserved byte, a control
    /// frame with a payload and a payload length no buffer could hold. Every field is read from
    /// exactly [`HEADER_LEN`] bytes; nothing is allocated.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let kind = Kind::from_u8(b[2]).ok_or(FrameError::UnknownKind(b[2]))?;
        if b[7] != 0 {
            return Err(FrameError::Reserved(b[7]));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | u64::from(u32_at(i + 4)) << 32;
        let h = Header {
            kind,
            dtype: b[3],
            coll: b[4],
            redop: b[5],
            algo: b[6],
            root: u32_at(8),
            tag: u32_at(12),
            seq: u64_at(16),
            count: u64_at(24),
            len: u64_at(32),
        };
        if !kind.has_payload() && h.len != 0 {
            return Err(FrameError::ControlPayload { kind, len: h.len });
        }
        if h.len > MAX_PAYLOAD {
            return Err(FrameError::TooLong(h.len));
        }
        Ok(h)
    }

    /// Decode from the start of `bytes` (at least [`HEADER_LEN`] of them).
    pub fn decode_prefix(bytes: &[u8]) -> Result<Header, FrameError> {
        let raw: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|b| b.try_into().ok())
            .ok_or(FrameError::Short(bytes.len()))?;
        Header::decode(raw)
    }

    /// True if `self` and `other` carry the same collective fingerprint.
    pub fn same_fingerprint(&self, other: &Header) -> bool {
        self.kind == other.kind
            && self.coll == other.coll
            && self.dtype == other.dtype
            && self.redop == other.redop
            && self.algo == other.algo
            && self.root == other.root
            && self.seq == other.seq
            && self.count == other.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(kind in 1u8..=8, dtype: u8, coll: u8, redop: u8, algo: u8, root: u32, tag: u32, seq: u64, count: u64, len: u64) {
            let kind = Kind::from_u8(kind).unwrap();
            let len = if kind.has_payload() { len % (MAX_PAYLOAD + 1) } else { 0 };
            let h = Header { kind, dtype, coll, redop, algo, root, tag, seq, count, len };
            prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2 * HEADER_LEN)) {
            match Header::decode_prefix(&bytes) {
                Ok(h) => {
                    prop_assert!(bytes.len() >= HEADER_LEN);
                    prop_assert!(h.kind.has_payload() || h.len == 0);
                    prop_assert!(h.len <= MAX_PAYLOAD);
                    // A header that decodes is re-encoded to the same bytes.
                    prop_assert_eq!(&h.encode()[..], &bytes[..HEADER_LEN]);
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }

        #[test]
        fn mutated_valid_headers(kind in 1u8..=8, len in 0u64..1 << 20, pos in 0usize..HEADER_LEN, val: u8) {
            let k = Kind::from_u8(kind).unwrap();
            let h = Header { len: if k.has_payload() { len } else { 0 }, ..Header::new(k, 7, 0) };
            let mut b = h.encode();
            b[pos] = val;
            if let Ok(d) = Header::decode(&b) {
                prop_assert_eq!(d.encode(), b);
            }
        }
    }
}
