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
}

impl Kind {
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

    /// Decode, rejecting a bad magic or kind.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(format!(
                "bad frame magic {magic:#06x} (stream out of sync or not an hcomm peer)"
            ));
        }
        let kind = Kind::from_u8(b[2]).ok_or_else(|| format!("unknown frame kind {}", b[2]))?;
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Ok(Header {
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
        })
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
            let h = Header { kind: Kind::from_u8(kind).unwrap(), dtype, coll, redop, algo, root, tag, seq, count, len };
            prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let arr: [u8; HEADER_LEN] = bytes.try_into().unwrap();
            let _ = Header::decode(&arr);
        }
    }
}
