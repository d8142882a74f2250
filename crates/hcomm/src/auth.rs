//! Job authentication: every connection (to the rendezvous store, and each data link between
//! two ranks) starts with a mutual HMAC-SHA256 challenge-response over the job's shared token.
//!
//! ```text
//! connecting side (C)                        accepting side (A)
//!   Hello_C  (56 bytes: role, rank, communicator hash, nonce N_C)  ->
//!                                    <-  Hello_A (56 bytes: role, rank, communicator hash, N_A)
//!   proof_C = HMAC(token, "hcomm-auth-v1" | "connecting" | Hello_C | Hello_A)  ->
//!                     A checks proof_C in constant time; on failure: status 1, close
//!                                    <-  status 0 | proof_A = HMAC(token, ... "accepting" ...)
//!   C checks proof_A in constant time
//! ```
//!
//! Both hellos carry a fresh 32-byte nonce from the OS random generator, so a proof is bound to
//! this one connection (no replay), to the direction (a proof cannot be reflected back), to the
//! roles (store or data link) and to the ranks and communicator named in the hellos. The
//! accepting side reveals its own proof only after the connecting side has proved itself, so a
//! stranger learns nothing but a random nonce. The token itself never leaves the process: it is
//! never sent, logged, or printed by `Debug`.
//!
//! Without a token (`HCOMM_JOB_TOKEN` / `HCOMM_TOKEN_FILE` unset and no `token_file` in the
//! rank table), the hellos are still exchanged and checked (role, rank, communicator) but no
//! proofs are: authentication is off. A process with a token never talks to one without.
//!
//! The accepting side gives every connection [`PRE_AUTH_DEADLINE`] to finish the handshake and
//! reads exactly the handshake's bytes before it, so nothing a stranger sends is ever taken as
//! store requests or frames. This is access control, not a secure channel: after the handshake
//! the bytes are neither encrypted nor integrity-protected.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Shortest accepted token, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;
/// Longest accepted token, in bytes.
pub const MAX_TOKEN_LEN: usize = 4096;
/// Bytes of randomness in each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 proof.
pub const MAC_LEN: usize = 32;
/// Bytes of a hello message.
pub const HELLO_LEN: usize = 56;
/// Bytes of the accepting side's last message (status and proof).
pub const FINISH_LEN: usize = 1 + MAC_LEN;
/// An accepted connection that has not completed the handshake within this time is dropped.
pub const PRE_AUTH_DEADLINE: Duration = Duration::from_secs(3);
/// Most connections one listener authenticates at once; more are dropped at once (and counted
/// as [`ConnectionStats::overloaded`]). Real clients retry.
pub const MAX_PENDING: usize = 64;

const MAGIC: [u8; 4] = *b"HCA1";
/// The magic of a [`departed_notice`], sent instead of a hello.
const DEPARTED_MAGIC: [u8; 4] = *b"HCA0";

/// What a listener sends, instead of its hello, to a dialer naming a communicator that existed
/// on it and was destroyed there (the process is still up for its other communicators): the
/// dialer fails at once with [`HandshakeError::Departed`] rather than retrying a refusal it
/// cannot tell from an overloaded listener. It says nothing but that.
pub fn departed_notice() -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&DEPARTED_MAGIC);
    b[4] = VERSION;
    b
}
const VERSION: u8 = 1;
const DOMAIN: &[u8] = b"hcomm-auth-v1\0";
const LABEL_CONNECTING: &[u8] = b"connecting\0";
const LABEL_ACCEPTING: &[u8] = b"accepting\0";
const FINISH_OK: u8 = 0;
const FINISH_REFUSED: u8 = 1;

/// The job's shared secret. `Debug` never shows it, equality is compared in constant time, and
/// nothing in hcomm writes it anywhere.
#[derive(Clone)]
pub struct JobToken(Arc<[u8]>);

impl JobToken {
    /// A token of these bytes (between [`MIN_TOKEN_LEN`] and [`MAX_TOKEN_LEN`] of them).
    pub fn new(bytes: &[u8]) -> Result<JobToken, TokenError> {
        if bytes.len() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort(bytes.len()));
        }
        if bytes.len() > MAX_TOKEN_LEN {
            return Err(TokenError::TooLong(bytes.len()));
        }
        Ok(JobToken(bytes.into()))
    }

    /// Read a token file: its content with surrounding ASCII whitespace (a trailing newline)
    /// removed. A file that others than its owner may read is accepted with a warning.
    pub fn from_file(path: &Path) -> Result<JobToken, TokenError> {
        let io_err = |e: io::Error| TokenError::File {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        if let Ok(meta) = file.metadata() {
            use std::os::unix::fs::PermissionsExt;
            if !meta.is_file() {
                return Err(TokenError::File {
                    path: path.display().to_string(),
                    reason: "not a regular file".into(),
                });
            }
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    path = %path.display(),
                    "the job token file is readable by other users (chmod 600 it)"
                );
            }
        }
        let mut bytes = Vec::new();
        file.take(MAX_TOKEN_LEN as u64 + 64)
            .read_to_end(&mut bytes)
            .map_err(io_err)?;
        let token = JobToken::new(bytes.trim_ascii());
        // Do not leave a copy of the secret behind in freed memory.
        bytes.iter_mut().for_each(|b| *b = 0);
        std::hint::black_box(&bytes);
        token.map_err(|e| TokenError::File {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    }

    /// The HMAC-SHA256 of the handshake transcript under this token.
    fn proof(
        &self,
        label: &[u8],
        client: &[u8; HELLO_LEN],
        server: &[u8; HELLO_LEN],
    ) -> Hmac<Sha256> {
        // HMAC takes keys of any length: this cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
        m.update(DOMAIN);
        m.update(label);
        m.update(client);
        m.update(server);
        m
    }
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

impl PartialEq for JobToken {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len() && bool::from(self.0.ct_eq(&other.0))
    }
}

impl Eq for JobToken {}

/// Why a token is unusable. Never quotes the token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Fewer than [`MIN_TOKEN_LEN`] bytes.
    #[error("the job token is {0} bytes long; at least {MIN_TOKEN_LEN} are required (hcomm run generates 64)")]
    TooShort(usize),
    /// More than [`MAX_TOKEN_LEN`] bytes.
    #[error("the job token is {0} bytes or more; at most {MAX_TOKEN_LEN} are allowed")]
    TooLong(usize),
    /// The token file cannot be used.
    #[error("job token file {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// A fresh random token for one job: 32 bytes from the operating system's random generator,
/// as 64 hexadecimal digits (what `hcomm run` exports as `HCOMM_JOB_TOKEN`). Keep it secret.
pub fn generate_token() -> io::Result<String> {
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| io::Error::other(format!("no OS randomness: {e}")))?;
    let hex = raw.iter().map(|b| format!("{b:02x}")).collect();
    raw.iter_mut().for_each(|b| *b = 0);
    std::hint::black_box(&raw);
    Ok(hex)
}

/// The FNV-1a hash of a communicator id that data-link hellos carry (stable across processes).
#[doc(hidden)]
pub fn comm_hash(comm_id: &str) -> u64 {
    comm_id.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// Who sends a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// A client of the rendezvous store.
    StoreClient = 1,
    /// The rendezvous store.
    StoreServer = 2,
    /// A rank opening a data link.
    LinkDialer = 3,
    /// A rank accepting a data link.
    LinkAcceptor = 4,
}

impl Role {
    fn from_u8(v: u8) -> Option<Role> {
        Some(match v {
            1 => Role::StoreClient,
            2 => Role::StoreServer,
            3 => Role::LinkDialer,
            4 => Role::LinkAcceptor,
            _ => return None,
        })
    }

    /// The role of the other side of a connection.
    pub fn peer(self) -> Role {
        match self {
            Role::StoreClient => Role::StoreServer,
            Role::StoreServer => Role::StoreClient,
            Role::LinkDialer => Role::LinkAcceptor,
            Role::LinkAcceptor => Role::LinkDialer,
        }
    }
}

/// The first message of each side.
///
/// ```text
/// offset size field
///      0    4 magic "HCA1"
///      4    1 version (1)
///      5    1 role (1 store client, 2 store, 3 link dialer, 4 link acceptor)
///      6    1 auth (1 = this side has a token and proofs follow, 0 = no token)
///      7    1 reserved (0)
///      8    4 rank (u32::MAX for the store and its clients)
///     12    4 reserved (0)
///     16    8 communicator hash (0 for the store and its clients)
///     24   32 nonce
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Sender's role.
    pub role: Role,
    /// Whether the sender has a token.
    pub auth: bool,
    /// Sender's rank in the communicator (`u32::MAX` for the store).
    pub rank: u32,
    /// Hash of the communicator's id (0 for the store).
    pub comm_hash: u64,
    /// Fresh randomness.
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    /// Encode into [`HELLO_LEN`] bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.role as u8;
        b[6] = self.auth as u8;
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[16..24].copy_from_slice(&self.comm_hash.to_le_bytes());
        b[24..56].copy_from_slice(&self.nonce);
        b
    }

    /// Decode exactly [`HELLO_LEN`] bytes, rejecting anything but a well-formed hello.
    pub fn decode(b: &[u8]) -> Result<Hello, HandshakeError> {
        let bad = |m: String| Err(HandshakeError::Malformed(m));
        let Ok(b) = <&[u8; HELLO_LEN]>::try_from(b) else {
            return bad(format!("a hello is {HELLO_LEN} bytes, got {}", b.len()));
        };
        if b[0..4] == DEPARTED_MAGIC {
            return Err(HandshakeError::Departed);
        }
        if b[0..4] != MAGIC {
            return bad("not an hcomm handshake (bad magic)".into());
        }
        if b[4] != VERSION {
            return bad(format!(
                "handshake version {} (this is version {VERSION})",
                b[4]
            ));
        }
        let Some(role) = Role::from_u8(b[5]) else {
            return bad(format!("unknown role {}", b[5]));
        };
        let auth = match b[6] {
            0 => false,
            1 => true,
            v => return bad(format!("auth flag {v}")),
        };
        if b[7] != 0 || b[12..16] != [0; 4] {
            return bad("reserved bytes are not 0".into());
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[24..56]);
        Ok(Hello {
            role,
            auth,
            rank: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            comm_hash: u64::from_le_bytes([b[16], b[17], b[18], b[19], b[20], b[21], b[22], b[23]]),
            nonce,
        })
    }
}

/// Decode the accepting side's last message: `Some(proof)` when it accepted us, `None` when it
/// refused our proof.
pub fn decode_finish(b: &[u8]) -> Result<Option<[u8; MAC_LEN]>, HandshakeError> {
    let Ok(b) = <&[u8; FINISH_LEN]>::try_from(b) else {
        return Err(HandshakeError::Malformed(format!(
            "a handshake answer is {FINISH_LEN} bytes, got {}",
            b.len()
        )));
    };
    match b[0] {
        FINISH_OK => {
            let mut mac = [0u8; MAC_LEN];
            mac.copy_from_slice(&b[1..]);
            Ok(Some(mac))
        }
        FINISH_REFUSED => Ok(None),
        s => Err(HandshakeError::Malformed(format!("handshake status {s}"))),
    }
}

/// Why a handshake failed. Never quotes the token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The peer closed the connection before the handshake was complete.
    #[error("the connection was closed during the handshake")]
    Closed,
    /// The handshake did not complete before its deadline.
    #[error("the handshake did not complete within {0:?}")]
    TimedOut(Duration),
    /// The socket failed.
    #[error("I/O error during the handshake: {0}")]
    Io(String),
    /// The peer's bytes are not a valid handshake message.
    #[error("malformed handshake: {0}")]
    Malformed(String),
    /// A valid handshake from the wrong kind of peer (another role, rank or communicator).
    #[error("unexpected peer: {0}")]
    WrongPeer(String),
    /// The peer uses a job token and this process has none.
    #[error("the job uses a job token but this process has none: set HCOMM_JOB_TOKEN or HCOMM_TOKEN_FILE as for the other ranks (hcomm run does)")]
    TokenRequired,
    /// This process has a token and the peer has none.
    #[error("this process has a job token but the peer has none: refusing an unauthenticated connection (give every rank the same HCOMM_JOB_TOKEN or HCOMM_TOKEN_FILE)")]
    PeerUnauthenticated,
    /// The peer checked our proof and refused it: the tokens differ.
    #[error("the peer rejected this process's job token (the ranks' tokens differ)")]
    Rejected,
    /// The peer's proof is wrong: the tokens differ.
    #[error("the peer's proof does not match this process's job token (the ranks' tokens differ)")]
    BadProof,
    /// The peer's process is up but the communicator asked for is gone from it (destroyed
    /// there): see [`departed_notice`].
    #[error("the peer has destroyed this communicator (its process is still up)")]
    Departed,
}

impl HandshakeError {
    /// True for failures worth a new attempt (the connection was lost, not refused on purpose).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            HandshakeError::Closed | HandshakeError::TimedOut(_) | HandshakeError::Io(_)
        )
    }

    fn from_io(e: io::Error) -> HandshakeError {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => HandshakeError::Closed,
            _ => HandshakeError::Io(e.to_string()),
        }
    }
}

/// A byte stream a handshake can run on: it must be able to bound each blocking read and write.
pub trait HandshakeIo: Read + Write {
    /// Bound the next reads and writes by `d`.
    fn set_io_timeout(&mut self, d: Duration) -> io::Result<()>;
}

impl HandshakeIo for TcpStream {
    fn set_io_timeout(&mut self, d: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(d))?;
        self.set_write_timeout(Some(d))
    }
}

fn left(deadline: Instant, total: Duration) -> Result<Duration, HandshakeError> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        Err(HandshakeError::TimedOut(total))
    } else {
        Ok(d)
    }
}

fn is_retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Read exactly `buf.len()` bytes before `deadline` (however slowly they trickle in).
fn read_exact_by<S: HandshakeIo>(
    s: &mut S,
    buf: &mut [u8],
    deadline: Instant,
    total: Duration,
) -> Result<(), HandshakeError> {
    let mut got = 0;
    while got < buf.len() {
        s.set_io_timeout(left(deadline, total)?)
            .map_err(HandshakeError::from_io)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(n) => got += n,
            Err(e) if is_retry(&e) => {}
            Err(e) => return Err(HandshakeError::from_io(e)),
        }
    }
    Ok(())
}

fn write_all_by<S: HandshakeIo>(
    s: &mut S,
    mut buf: &[u8],
    deadline: Instant,
    total: Duration,
) -> Result<(), HandshakeError> {
    while !buf.is_empty() {
        s.set_io_timeout(left(deadline, total)?)
            .map_err(HandshakeError::from_io)?;
        match s.write(buf) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(n) => buf = &buf[n..],
            Err(e) if is_retry(&e) => {}
            Err(e) => return Err(HandshakeError::from_io(e)),
        }
    }
    Ok(())
}

fn nonce() -> Result<[u8; NONCE_LEN], HandshakeError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| HandshakeError::Io(format!("no OS randomness: {e}")))?;
    Ok(n)
}

/// This side of a handshake.
#[derive(Clone, Copy, Debug)]
pub struct Local {
    /// Our role.
    pub role: Role,
    /// Our rank (`u32::MAX` for the store and its clients).
    pub rank: u32,
    /// Our communicator's hash (0 for the store and its clients).
    pub comm_hash: u64,
}

impl Local {
    /// Our hello, with a fresh nonce, encoded.
    fn hello(&self, auth: bool) -> Result<[u8; HELLO_LEN], HandshakeError> {
        Ok(Hello {
            role: self.role,
            auth,
            rank: self.rank,
            comm_hash: self.comm_hash,
            nonce: nonce()?,
        }
        .encode())
    }
}

/// Run the connecting side's handshake on `s`: prove knowledge of `token` (if any) and check the
/// peer's proof; `expect_rank` is the rank the peer must claim, with our communicator hash.
/// Returns once the peer is authenticated (or, without a token, once its hello checks out).
pub fn connect<S: HandshakeIo>(
    s: &mut S,
    token: Option<&JobToken>,
    me: Local,
    expect_rank: u32,
    deadline: Instant,
) -> Result<(), HandshakeError> {
    let total = deadline.saturating_duration_since(Instant::now());
    let mine = me.hello(token.is_some())?;
    write_all_by(s, &mine, deadline, total)?;
    let mut theirs = [0u8; HELLO_LEN];
    read_exact_by(s, &mut theirs, deadline, total)?;
    let hello = Hello::decode(&theirs)?;
    if hello.role != me.role.peer() {
        return Err(HandshakeError::WrongPeer(format!(
            "a {:?} answered, expected a {:?}",
            hello.role,
            me.role.peer()
        )));
    }
    let token = match (token, hello.auth) {
        (None, false) => None,
        (None, true) => return Err(HandshakeError::TokenRequired),
        (Some(_), false) => return Err(HandshakeError::PeerUnauthenticated),
        (Some(t), true) => Some(t),
    };
    if let Some(t) = token {
        let proof = t
            .proof(LABEL_CONNECTING, &mine, &theirs)
            .finalize()
            .into_bytes();
        write_all_by(s, &proof, deadline, total)?;
        let mut fin = [0u8; FINISH_LEN];
        read_exact_by(s, &mut fin, deadline, total)?;
        let Some(mac) = decode_finish(&fin)? else {
            return Err(HandshakeError::Rejected);
        };
        t.proof(LABEL_ACCEPTING, &mine, &theirs)
            .verify_slice(&mac)
            .map_err(|_| HandshakeError::BadProof)?;
    }
    // Only an authenticated peer's claims are worth checking (and reporting).
    if hello.rank != expect_rank || hello.comm_hash != me.comm_hash {
        return Err(HandshakeError::WrongPeer(format!(
            "expected rank {expect_rank} of communicator {:#x}, reached rank {} of {:#x}",
            me.comm_hash, hello.rank, hello.comm_hash
        )));
    }
    Ok(())
}

/// Run the accepting side's handshake on `s`. `check` vets the peer's hello (its rank and
/// communicator) before anything is sent back. Returns the peer's hello once it has proved
/// knowledge of `token` (without a token: once its hello checks out). Before that, nothing but
/// our hello is written, and exactly the handshake's bytes are read.
pub fn accept<S: HandshakeIo>(
    s: &mut S,
    token: Option<&JobToken>,
    me: Local,
    check: impl FnOnce(&Hello) -> Result<(), HandshakeError>,
    deadline: Instant,
) -> Result<Hello, HandshakeError> {
    let resolve = |h: &Hello| {
        check(h)?;
        Ok((me, token.cloned(), ()))
    };
    accept_for(s, me.role, resolve, deadline).map(|(hello, ())| hello)
}

/// [`accept`] for a listener that answers for several communicators (a communicator and its
/// sub-communicators share one): `resolve` reads the peer's hello and says who answers it (our
/// side, with the token to prove, and whatever the caller wants back with the hello), or
/// refuses it, before anything is sent back.
pub fn accept_for<S: HandshakeIo, T>(
    s: &mut S,
    role: Role,
    resolve: impl FnOnce(&Hello) -> Result<(Local, Option<JobToken>, T), HandshakeError>,
    deadline: Instant,
) -> Result<(Hello, T), HandshakeError> {
    let total = deadline.saturating_duration_since(Instant::now());
    let mut theirs = [0u8; HELLO_LEN];
    read_exact_by(s, &mut theirs, deadline, total)?;
    let hello = Hello::decode(&theirs)?;
    if hello.role != role.peer() {
        return Err(HandshakeError::WrongPeer(format!(
            "a {:?} connected, expected a {:?}",
            hello.role,
            role.peer()
        )));
    }
    let (me, token, found) = resolve(&hello)?;
    let token = token.as_ref();
    let mine = me.hello(token.is_some())?;
    write_all_by(s, &mine, deadline, total)?;
    let token = match (token, hello.auth) {
        (None, false) => return Ok((hello, found)),
        // The peer learns from our hello what is wrong, and closes.
        (None, true) => return Err(HandshakeError::PeerUnauthenticated),
        (Some(_), false) => return Err(HandshakeError::TokenRequired),
        (Some(t), true) => t,
    };
    let mut proof = [0u8; MAC_LEN];
    read_exact_by(s, &mut proof, deadline, total)?;
    if token
        .proof(LABEL_CONNECTING, &theirs, &mine)
        .verify_slice(&proof)
        .is_err()
    {
        let mut refuse = [0u8; FINISH_LEN];
        refuse[0] = FINISH_REFUSED;
        let _ = write_all_by(s, &refuse, deadline, total);
        return Err(HandshakeError::BadProof);
    }
    let mut fin = [0u8; FINISH_LEN];
    fin[0] = FINISH_OK;
    fin[1..].copy_from_slice(
        &token
            .proof(LABEL_ACCEPTING, &theirs, &mine)
            .finalize()
            .into_bytes(),
    );
    write_all_by(s, &fin, deadline, total)?;
    Ok((hello, found))
}

/// What became of the connections one listener accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectionStats {
    /// Completed the handshake and were handed on.
    pub accepted: u64,
    /// Closed (or reset) before completing the handshake.
    pub closed: u64,
    /// Did not complete the handshake within [`PRE_AUTH_DEADLINE`].
    pub timed_out: u64,
    /// Sent bytes that are not a handshake message.
    pub malformed: u64,
    /// A well-formed hello from the wrong kind of peer (role, rank or communicator).
    pub wrong_peer: u64,
    /// Presented a wrong token, or none where one is required (or one where none is used).
    pub bad_token: u64,
    /// Dropped unread because [`MAX_PENDING`] others were being authenticated.
    pub overloaded: u64,
}

impl ConnectionStats {
    /// Connections that were turned away, for any reason.
    pub fn rejected(&self) -> u64 {
        self.closed
            + self.timed_out
            + self.malformed
            + self.wrong_peer
            + self.bad_token
            + self.overloaded
    }
}

/// Thread-safe [`ConnectionStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    accepted: AtomicU64,
    closed: AtomicU64,
    timed_out: AtomicU64,
    malformed: AtomicU64,
    wrong_peer: AtomicU64,
    bad_token: AtomicU64,
    overloaded: AtomicU64,
}

impl Counters {
    /// Count the outcome of one accepted connection's handshake.
    pub(crate) fn record<T>(&self, r: &Result<T, HandshakeError>) {
        let c = match r {
            Ok(_) => &self.accepted,
            Err(HandshakeError::Closed | HandshakeError::Io(_)) => &self.closed,
            Err(HandshakeError::TimedOut(_)) => &self.timed_out,
            Err(HandshakeError::Malformed(_)) => &self.malformed,
            Err(HandshakeError::WrongPeer(_) | HandshakeError::Departed) => &self.wrong_peer,
            Err(
                HandshakeError::TokenRequired
                | HandshakeError::PeerUnauthenticated
                | HandshakeError::Rejected
                | HandshakeError::BadProof,
            ) => &self.bad_token,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a connection dropped for lack of room.
    pub(crate) fn overloaded(&self) {
        self.overloaded.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> ConnectionStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ConnectionStats {
            accepted: g(&self.accepted),
            closed: g(&self.closed),
            timed_out: g(&self.timed_out),
            malformed: g(&self.malformed),
            wrong_peer: g(&self.wrong_peer),
            bad_token: g(&self.bad_token),
            overloaded: g(&self.overloaded),
        }
    }
}

/// Counts a connection as being authenticated while alive (see [`MAX_PENDING`]).
pub(crate) struct PendingSlot(Arc<std::sync::atomic::AtomicUsize>);

impl PendingSlot {
    /// Take a slot, or `None` when [`MAX_PENDING`] are taken.
    pub(crate) fn take(pending: &Arc<std::sync::atomic::AtomicUsize>) -> Option<PendingSlot> {
        pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_PENDING).then_some(n + 1)
            })
            .ok()
            .map(|_| PendingSlot(pending.clone()))
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn token(s: &str) -> JobToken {
        JobToken::new(s.as_bytes()).unwrap()
    }

    const STORE_C: Local = Local {
        role: Role::StoreClient,
        rank: u32::MAX,
        comm_hash: 0,
    };
    const STORE_S: Local = Local {
        role: Role::StoreServer,
        rank: u32::MAX,
        comm_hash: 0,
    };

    /// Run both sides over loopback; returns (connecting side, accepting side).
    fn pair(
        ct: Option<&str>,
        at: Option<&str>,
    ) -> (Result<(), HandshakeError>, Result<Hello, HandshakeError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let at = at.map(token);
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            accept(&mut s, at.as_ref(), STORE_S, |_| Ok(()), deadline)
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let ct = ct.map(token);
        let deadline = Instant::now() + Duration::from_secs(10);
        let r = connect(&mut c, ct.as_ref(), STORE_C, u32::MAX, deadline);
        drop(c);
        (r, server.join().unwrap())
    }

    #[test]
    fn same_token_authenticates_both_ways() {
        let (c, a) = pair(Some("0123456789abcdef-one"), Some("0123456789abcdef-one"));
        assert_eq!(c, Ok(()));
        assert_eq!(a.unwrap().role, Role::StoreClient);
    }

    #[test]
    fn different_tokens_fail_on_both_sides() {
        let (c, a) = pair(Some("0123456789abcdef-one"), Some("0123456789abcdef-two"));
        assert_eq!(c, Err(HandshakeError::Rejected));
        assert_eq!(a.unwrap_err(), HandshakeError::BadProof);
    }

    #[test]
    fn token_on_one_side_only_fails_with_clear_errors() {
        let (c, a) = pair(None, Some("0123456789abcdef-one"));
        assert_eq!(c, Err(HandshakeError::TokenRequired));
        assert_eq!(a.unwrap_err(), HandshakeError::TokenRequired);
        let (c, a) = pair(Some("0123456789abcdef-one"), None);
        assert_eq!(c, Err(HandshakeError::PeerUnauthenticated));
        assert_eq!(a.unwrap_err(), HandshakeError::PeerUnauthenticated);
        assert!(c.unwrap_err().to_string().contains("HCOMM_JOB_TOKEN"));
    }

    #[test]
    fn no_token_anywhere_still_checks_hellos() {
        let (c, a) = pair(None, None);
        assert_eq!(c, Ok(()));
        assert!(!a.unwrap().auth);
    }

    #[test]
    fn stalled_peer_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        (&c).write_all(&MAGIC).unwrap();
        let t = Instant::now();
        let r = accept(
            &mut s,
            None,
            STORE_S,
            |_| Ok(()),
            t + Duration::from_millis(300),
        );
        assert!(matches!(r, Err(HandshakeError::TimedOut(_))), "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn token_never_printed() {
        let t = token("very-secret-token-value");
        assert_eq!(format!("{t:?}"), "JobToken(<redacted>)");
        assert!(!JobToken::new(b"short")
            .unwrap_err()
            .to_string()
            .contains("short"));
        assert_eq!(t, token("very-secret-token-value"));
        assert_ne!(t, token("very-secret-token-valuf"));
    }

    #[test]
    fn token_file_is_trimmed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        std::fs::write(&p, "  0123456789abcdef0123\n").unwrap();
        assert_eq!(
            JobToken::from_file(&p).unwrap(),
            token("0123456789abcdef0123")
        );
        std::fs::write(&p, "tiny\n").unwrap();
        let e = JobToken::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("at least 16") && !e.contains("tiny"), "{e}");
        let e = JobToken::from_file(&dir.path().join("missing")).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
    }

    #[test]
    fn generated_tokens_are_fresh_hex() {
        let (a, b) = (generate_token().unwrap(), generate_token().unwrap());
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn hello_roundtrip_and_rejects() {
        let h = Hello {
            role: Role::LinkDialer,
            auth: true,
            rank: 3,
            comm_hash: comm_hash("world"),
            nonce: [7; NONCE_LEN],
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[7] = 1;
        assert!(Hello::decode(&b).is_err());
        assert!(Hello::decode(&h.encode()[..10]).is_err());
        assert!(decode_finish(&[9; FINISH_LEN]).is_err());
        assert_eq!(decode_finish(&[1; FINISH_LEN]), Ok(None));
    }
}
