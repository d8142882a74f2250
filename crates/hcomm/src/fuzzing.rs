//! Entry points for the fuzz targets in `fuzz/` (and their proptest twins in the normal test
//! suite): each feeds arbitrary bytes to the decoders of one protocol and checks what must hold
//! whatever the bytes. None may panic (except on a broken invariant), hang, or allocate more than
//! the input justifies. Not part of the API.
#![doc(hidden)]

use std::io::{self, Read, Write};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use crate::auth::{self, HandshakeIo, Hello, JobToken, Local, Role, FINISH_LEN, HELLO_LEN};
use crate::bootstrap::store::{read_reply, read_request, Table};
use crate::config::RankTable;
use crate::wire::frame::{Header, HEADER_LEN, MAX_PAYLOAD};

/// The frame header decoder: a header that decodes re-encodes to the same bytes, carries a
/// payload only if its kind has one, and never announces more than [`MAX_PAYLOAD`].
pub fn frame(data: &[u8]) {
    let mut rest = data;
    while rest.len() >= HEADER_LEN {
        if let Ok(h) = Header::decode_prefix(rest) {
            assert_eq!(&h.encode()[..], &rest[..HEADER_LEN]);
            assert!(h.kind.has_payload() || h.len == 0);
            assert!(h.len <= MAX_PAYLOAD);
        }
        rest = &rest[HEADER_LEN..];
    }
    assert!(Header::decode_prefix(rest).is_err());
}

/// A scripted peer: reads come from the fuzz input, writes are collected.
struct Scripted<'a> {
    input: &'a [u8],
    output: Vec<u8>,
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl HandshakeIo for Scripted<'_> {
    fn set_io_timeout(&mut self, _: Duration) -> io::Result<()> {
        Ok(())
    }
}

/// Both sides of the handshake (data link and store, with and without a token) against a peer
/// that sends `data`. Whatever it sends, an accepting side with a token that refuses it has
/// written nothing but its hello and, at most, a refusal without a proof; and random bytes are
/// never accepted as a proof.
pub fn handshake(data: &[u8]) {
    let _ = Hello::decode(data);
    let _ = auth::decode_finish(data);
    let token = JobToken::new(b"fuzzing-job-token-0123456789").expect("valid token");
    let hash = auth::comm_hash("world");
    let far = Instant::now() + Duration::from_secs(3600);
    for tok in [None, Some(&token)] {
        for (role, rank) in [(Role::LinkAcceptor, 1u32), (Role::StoreServer, u32::MAX)] {
            let mut s = Scripted {
                input: data,
                output: Vec::new(),
            };
            let me = Local {
                role,
                rank,
                comm_hash: if role == Role::StoreServer { 0 } else { hash },
            };
            let check = |h: &Hello| {
                if role == Role::StoreServer
                    || (h.rank < 4 && h.rank != rank && h.comm_hash == hash)
                {
                    Ok(())
                } else {
                    Err(auth::HandshakeError::WrongPeer("fuzz".into()))
                }
            };
            let r = auth::accept(&mut s, tok, me, check, far);
            if tok.is_some() {
                // Only a correct HMAC of a fresh nonce could pass: random bytes never do.
                assert!(r.is_err(), "a random proof was accepted");
                assert!(s.output.len() <= HELLO_LEN + FINISH_LEN);
                if s.output.len() > HELLO_LEN {
                    assert_eq!(s.output[HELLO_LEN], 1, "refusal status");
                    assert!(s.output[HELLO_LEN + 1..].iter().all(|&b| b == 0));
                }
            }
            assert!(s.output.len() <= HELLO_LEN + FINISH_LEN);
            let mut s = Scripted {
                input: data,
                output: Vec::new(),
            };
            let me = Local {
                role: role.peer(),
                rank: if role == Role::StoreServer {
                    u32::MAX
                } else {
                    2
                },
                comm_hash: me.comm_hash,
            };
            let r = auth::connect(&mut s, tok, me, rank, far);
            if tok.is_some() {
                assert!(r.is_err(), "a random proof was accepted");
            }
        }
    }
}

/// The store protocol: requests decoded from `data` and carried out on a table (without
/// waiting), and `data` read as each kind of reply.
pub fn store_protocol(data: &[u8]) {
    let table = Table::default();
    let stop = AtomicBool::new(false);
    let mut rest = data;
    while let Ok(Some(req)) = read_request(&mut rest) {
        let enc = req.encode();
        assert_eq!(
            read_request(&mut &enc[..]).ok().flatten().as_ref(),
            Some(&req)
        );
        let _ = table.apply(req, &stop, false);
    }
    for op in ["SET", "GET", "ADD", "CHECK", "DEL"] {
        let _ = read_reply(&mut &data[..], op);
    }
}

/// The rank table parser and validator, and the configuration of each (of the first 64) ranks.
pub fn rank_table(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(t) = RankTable::parse(text) {
        for e in t.ranks.iter().take(64) {
            let c = t
                .bootstrap_for(e.rank)
                .expect("a valid table configures its ranks");
            assert!(c.rank < c.world_size);
        }
    }
}

/// The fuzz targets as property tests: random bytes, and valid inputs with a byte changed and
/// a tail cut off, into each decoder.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frame::Kind;
    use proptest::prelude::*;

    fn mutate(mut bytes: Vec<u8>, pos: usize, val: u8, cut: usize) -> Vec<u8> {
        if !bytes.is_empty() {
            let i = pos % bytes.len();
            bytes[i] = val;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        bytes
    }

    /// A valid data-link hello followed by a proof-sized tail.
    fn valid_hello(auth: bool, rank: u32) -> Vec<u8> {
        let mut v = Hello {
            role: Role::LinkDialer,
            auth,
            rank,
            comm_hash: auth::comm_hash("world"),
            nonce: [3; auth::NONCE_LEN],
        }
        .encode()
        .to_vec();
        v.extend_from_slice(&[0x5a; auth::MAC_LEN]);
        v
    }

    const TABLE: &str = r#"{"version":"1.0","world_size":2,"master":{"addr":"127.0.0.1","port":29500},
        "token_file":"t","timeout_s":5,"transport":"tcp",
        "ranks":[{"rank":0,"host":"127.0.0.1","local_rank":0},
                 {"rank":1,"host":"127.0.0.1","local_rank":0,"host_id":"a","ifname":"lo"}]}"#;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn frame_random(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            frame(&bytes);
        }

        #[test]
        fn frame_mutated(kind in 1u8..=8, len: u64, pos: usize, val: u8, cut: usize) {
            let h = Header { len, ..Header::new(Kind::Collective, 1, 0) };
            let mut b = h.encode().to_vec();
            b[2] = kind;
            frame(&mutate(b, pos, val, cut));
        }

        #[test]
        fn handshake_random(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            handshake(&bytes);
        }

        #[test]
        fn handshake_mutated(auth: bool, rank in 0u32..5, pos: usize, val: u8, cut: usize) {
            handshake(&mutate(valid_hello(auth, rank), pos, val, cut));
        }

        #[test]
        fn store_random(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            store_protocol(&bytes);
        }

        #[test]
        fn rank_table_random(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            rank_table(&bytes);
        }

        #[test]
        fn rank_table_mutated(pos: usize, val in 0x20u8..0x7f, cut: usize) {
            rank_table(&mutate(TABLE.as_bytes().to_vec(), pos, val, cut));
        }
    }

    #[test]
    fn valid_inputs_pass() {
        rank_table(TABLE.as_bytes());
        assert!(RankTable::parse(TABLE).is_ok());
        handshake(&valid_hello(false, 0));
        handshake(&valid_hello(true, 0));
        frame(&Header::new(Kind::Signal, 1, 0).encode());
    }
}
