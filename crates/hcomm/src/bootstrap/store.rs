//! The rendezvous key-value store that rank 0 hosts during a job.
//!
//! Every connection starts with the handshake of [`crate::auth`] (a mutual HMAC proof of the
//! job token when there is one); the server reads no request before it is complete, and drops
//! connections that do not complete it within [`PRE_AUTH_DEADLINE`]. Each connection is
//! authenticated on a thread of its own, at most [`crate::auth::MAX_PENDING`] at once, so a
//! slow or silent stranger never holds up the accept loop or another client.
//!
//! Wire protocol after the handshake (all integers little-endian), one request and one reply at
//! a time per connection:
//!
//! ```text
//! request:  op u8 | key_len u32 | key | arg_len u32 | arg
//!   SET  arg = value            -> OK
//!   GET  arg = timeout_ms u64   -> VALUE(value) | TIMEOUT      (blocks until the key exists)
//!   ADD  arg = delta i64        -> VALUE(new value as i64)
//!   CHECK arg = (none)          -> VALUE(1 byte: 0|1)
//!   DEL  arg = (none)           -> OK
//! reply:    status u8 (0 OK/VALUE, 1 TIMEOUT, 2 ERROR) | len u32 | payload
//! ```
//!
//! Keys are at most [`MAX_KEY`] bytes and values at most [`MAX_VALUE`]; GET and ADD take exactly
//! 8 argument bytes, CHECK and DEL none. A request that breaks a rule (or names an unknown op)
//! is rejected before its key or value is read, and its connection dropped. Buffers grow with
//! the bytes that actually arrive, never to a length a header merely announces. The table holds
//! at most [`MAX_TABLE_BYTES`].

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use crate::auth::{
    self, ConnectionStats, Counters, HandshakeError, JobToken, Local, PendingSlot, Role,
    PRE_AUTH_DEADLINE,
};

/// Longest key accepted.
pub const MAX_KEY: usize = 4096;
/// Largest value accepted.
pub const MAX_VALUE: usize = 64 << 20;
/// Most bytes (keys and values) the table holds; a SET beyond is refused with an error.
pub const MAX_TABLE_BYTES: usize = 1 << 30;
/// Longest error message a reply may carry.
const MAX_ERROR: usize = 4096;
/// Buffers for keys, values and replies start at most this large and grow as bytes arrive.
const READ_CHUNK: usize = 64 << 10;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_DEL: u8 = 5;
const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;

/// The identity both sides of a store connection claim in their hellos.
const STORE_CLIENT: Local = Local {
    role: Role::StoreClient,
    rank: u32::MAX,
    comm_hash: 0,
};
const STORE_SERVER: Local = Local {
    role: Role::StoreServer,
    rank: u32::MAX,
    comm_hash: 0,
};

/// A decoded store request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Set `key` to `value`.
    Set {
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
    },
    /// Wait up to `timeout_ms` for `key`.
    Get {
        /// Key.
        key: Vec<u8>,
        /// How long to wait, in milliseconds.
        timeout_ms: u64,
    },
    /// Add `delta` to the counter at `key`.
    Add {
        /// Key.
        key: Vec<u8>,
        /// Amount.
        delta: i64,
    },
    /// Does `key` exist?
    Check {
        /// Key.
        key: Vec<u8>,
    },
    /// Remove `key`.
    Delete {
        /// Key.
        key: Vec<u8>,
    },
}

/// Why bytes on a store connection are not a valid request or reply.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The op byte names no operation.
    #[error("unknown store op {0}")]
    UnknownOp(u8),
    /// A key longer than [`MAX_KEY`].
    #[error("key of {0} bytes (at most {MAX_KEY})")]
    KeyTooLong(u32),
    /// An argument of the wrong size for its op.
    #[error("{op} with a {len}-byte argument (expected {expected})")]
    BadArgument {
        /// The op.
        op: &'static str,
        /// Its argument's length.
        len: u32,
        /// What the op takes.
        expected: &'static str,
    },
    /// A reply with an unknown status byte.
    #[error("unknown reply status {0}")]
    BadStatus(u8),
    /// A reply of the wrong size for its request.
    #[error("{op} reply of {len} bytes (expected {expected})")]
    BadReply {
        /// The op replied to.
        op: &'static str,
        /// The reply's length.
        len: u32,
        /// What it should be.
        expected: &'static str,
    },
    /// The connection failed or ended mid-message.
    #[error("{0}")]
    Io(#[from] io::Error),
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Read exactly `len` bytes into a buffer that grows as they arrive (a peer announcing a large
/// length and sending nothing costs nothing).
fn read_bytes(r: &mut impl Read, len: u32) -> io::Result<Vec<u8>> {
    let len = len as usize;
    let mut v = Vec::with_capacity(len.min(READ_CHUNK));
    r.take(len as u64).read_to_end(&mut v)?;
    if v.len() != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("connection ended after {} of {len} bytes", v.len()),
        ));
    }
    Ok(v)
}

fn read_u64_arg(r: &mut impl Read, op: &'static str) -> Result<[u8; 8], ProtocolError> {
    let len = read_u32(r)?;
    if len != 8 {
        return Err(ProtocolError::BadArgument {
            op,
            len,
            expected: "8 bytes",
        });
    }
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_no_arg(r: &mut impl Read, op: &'static str) -> Result<(), ProtocolError> {
    match read_u32(r)? {
        0 => Ok(()),
        len => Err(ProtocolError::BadArgument {
            op,
            len,
            expected: "none",
        }),
    }
}

/// Read one request: `Ok(None)` at a clean end of stream (between requests). Each length is
/// checked against its op's limit before a byte of what it announces is read.
pub fn read_request(r: &mut impl Read) -> Result<Option<Request>, ProtocolError> {
    let mut op = [0u8; 1];
    loop {
        match r.read(&mut op) {
            Ok(0) => return Ok(None),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let op = op[0];
    if !(OP_SET..=OP_DEL).contains(&op) {
        return Err(ProtocolError::UnknownOp(op));
    }
    let klen = read_u32(r)?;
    if klen as usize > MAX_KEY {
        return Err(ProtocolError::KeyTooLong(klen));
    }
    let key = read_bytes(r, klen)?;
    Ok(Some(match op {
        OP_SET => {
            let len = read_u32(r)?;
            if len as usize > MAX_VALUE {
                return Err(ProtocolError::BadArgument {
                    op: "SET",
                    len,
                    expected: "at most 64 MiB",
                });
            }
            Request::Set {
                key,
                value: read_bytes(r, len)?,
            }
        }
        OP_GET => Request::Get {
            key,
            timeout_ms: u64::from_le_bytes(read_u64_arg(r, "GET")?),
        },
        OP_ADD => Request::Add {
            key,
            delta: i64::from_le_bytes(read_u64_arg(r, "ADD")?),
        },
        OP_CHECK => {
            read_no_arg(r, "CHECK")?;
            Request::Check { key }
        }
        _ => {
            read_no_arg(r, "DEL")?;
            Request::Delete { key }
        }
    }))
}

impl Request {
    /// Encode for the wire (the inverse of [`read_request`]).
    pub fn encode(&self) -> Vec<u8> {
        let word;
        let (op, key, arg): (u8, &[u8], &[u8]) = match self {
            Request::Set { key, value } => (OP_SET, key, value),
            Request::Get { key, timeout_ms } => {
                word = timeout_ms.to_le_bytes();
                (OP_GET, key, &word)
            }
            Request::Add { key, delta } => {
                word = delta.to_le_bytes();
                (OP_ADD, key, &word)
            }
            Request::Check { key } => (OP_CHECK, key, &[]),
            Request::Delete { key } => (OP_DEL, key, &[]),
        };
        let mut buf = Vec::with_capacity(9 + key.len() + arg.len());
        buf.push(op);
        buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
        buf.extend_from_slice(key);
        buf.extend_from_slice(&(arg.len() as u32).to_le_bytes());
        buf.extend_from_slice(arg);
        buf
    }

    fn name(&self) -> &'static str {
        match self {
            Request::Set { .. } => "SET",
            Request::Get { .. } => "GET",
            Request::Add { .. } => "ADD",
            Request::Check { .. } => "CHECK",
            Request::Delete { .. } => "DEL",
        }
    }
}

/// Read one reply to a request of kind `op` (`"SET"`, `"GET"`, …): its status and payload,
/// each checked against what that request can be answered with.
pub fn read_reply(r: &mut impl Read, op: &'static str) -> Result<(u8, Vec<u8>), ProtocolError> {
    let mut st = [0u8; 1];
    r.read_exact(&mut st)?;
    let len = read_u32(r)?;
    let bad = |expected| ProtocolError::BadReply { op, len, expected };
    let ok = match (st[0], op) {
        (ST_OK, "SET" | "DEL") => len == 0,
        (ST_OK, "GET") => len as usize <= MAX_VALUE,
        (ST_OK, "ADD") => len == 8,
        (ST_OK, "CHECK") => len == 1,
        (ST_TIMEOUT, "GET") => len == 0,
        (ST_ERROR, _) => len as usize <= MAX_ERROR,
        (ST_OK | ST_TIMEOUT, _) => false,
        (s, _) => return Err(ProtocolError::BadStatus(s)),
    };
    if !ok {
        return Err(bad(match (st[0], op) {
            (ST_OK, "SET" | "DEL") | (ST_TIMEOUT, _) => "0 bytes",
            (ST_OK, "GET") => "at most 64 MiB",
            (ST_OK, "ADD") => "8 bytes",
            (ST_OK, "CHECK") => "1 byte",
            (ST_ERROR, _) => "at most 4 KiB of error text",
            _ => "no such reply",
        }));
    }
    let payload = read_bytes(r, len)?;
    if st[0] == ST_OK && op == "CHECK" && payload.first().is_some_and(|&b| b > 1) {
        return Err(bad("0 or 1"));
    }
    Ok((st[0], payload))
}

#[derive(Default)]
struct State {
    map: HashMap<Vec<u8>, Vec<u8>>,
    /// Bytes of keys and values in `map`.
    bytes: usize,
}

impl State {
    fn insert(&mut self, key: Vec<u8>, value: Vec<u8>) -> Result<(), &'static [u8]> {
        let old = self.map.get(&key).map_or(0, |v| key.len() + v.len());
        let new = self.bytes - old + key.len() + value.len();
        if new > MAX_TABLE_BYTES {
            return Err(b"the rendezvous store is full");
        }
        self.bytes = new;
        self.map.insert(key, value);
        Ok(())
    }

    fn remove(&mut self, key: &[u8]) {
        if let Some(v) = self.map.remove(key) {
            self.bytes -= key.len() + v.len();
        }
    }
}

/// The store's table, shared by the connection threads.
#[derive(Default)]
#[doc(hidden)]
pub struct Table {
    state: Mutex<State>,
    changed: Condvar,
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Carry out `req` and return the reply (status, payload). A GET waits for its key until
    /// its timeout, or until `stop`; with `wait` false it does not wait at all.
    #[doc(hidden)]
    pub fn apply(&self, req: Request, stop: &AtomicBool, wait: bool) -> (u8, Vec<u8>) {
        match req {
            Request::Set { key, value } => {
                let r = self.lock().insert(key, value);
                self.changed.notify_all();
                match r {
                    Ok(()) => (ST_OK, Vec::new()),
                    Err(msg) => (ST_ERROR, msg.to_vec()),
                }
            }
            Request::Get { key, timeout_ms } => {
                let deadline = Instant::now()
                    .checked_add(Duration::from_millis(timeout_ms))
                    .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86400));
                let mut state = self.lock();
                loop {
                    if let Some(v) = state.map.get(&key) {
                        return (ST_OK, v.clone());
                    }
                    let now = Instant::now();
                    if !wait || now >= deadline || stop.load(Ordering::SeqCst) {
                        return (ST_TIMEOUT, Vec::new());
                    }
                    state = self
                        .changed
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            Request::Add { key, delta } => {
                let mut state = self.lock();
                let cur = match state.map.get(&key) {
                    Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                        Ok(b) => i64::from_le_bytes(b),
                        Err(_) => {
                            return (ST_ERROR, b"ADD on a key that is not a counter".to_vec())
                        }
                    },
                    None => 0,
                };
                let new = cur.wrapping_add(delta);
                let r = state.insert(key, new.to_le_bytes().to_vec());
                drop(state);
                self.changed.notify_all();
                match r {
                    Ok(()) => (ST_OK, new.to_le_bytes().to_vec()),
                    Err(msg) => (ST_ERROR, msg.to_vec()),
                }
            }
            Request::Check { key } => (ST_OK, vec![self.lock().map.contains_key(&key) as u8]),
            Request::Delete { key } => {
                self.lock().remove(&key);
                (ST_OK, Vec::new())
            }
        }
    }
}

/// The store server. Runs on background threads until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    table: Arc<Table>,
    counters: Arc<Counters>,
    /// The listening socket (shared with the accept loop), shut down on drop to end it.
    listener: TcpListener,
    accept_loop: Option<thread::JoinHandle<()>>,
    /// The process that started the server: a forked child shares the listening socket (and
    /// has no accept thread), so its copy must not shut the socket down on drop.
    owner_pid: u32,
}

impl StoreServer {
    /// Listen on `addr` (exactly that address: nothing binds all interfaces unless `addr` is
    /// the unspecified address). With a `token`, only clients that prove they know it are
    /// served.
    pub fn start(addr: SocketAddr, token: Option<JobToken>) -> io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let mut server = StoreServer {
            addr,
            stop: Arc::new(AtomicBool::new(false)),
            table: Arc::new(Table::default()),
            counters: Arc::new(Counters::default()),
            listener: listener.try_clone()?,
            accept_loop: None,
            owner_pid: std::process::id(),
        };
        let shared = Shared {
            stop: server.stop.clone(),
            table: server.table.clone(),
            counters: server.counters.clone(),
            token,
            pending: Arc::new(AtomicUsize::new(0)),
        };
        server.accept_loop = Some(
            thread::Builder::new()
                .name("hcomm-store".into())
                .spawn(move || accept_loop(listener, shared))?,
        );
        Ok(server)
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What became of the connections accepted so far.
    pub fn stats(&self) -> ConnectionStats {
        self.counters.snapshot()
    }
}

impl Drop for StoreServer {
    /// Stops serving and closes the port before returning, so that a new server (a
    /// communicator created again at once) can listen on it.
    fn drop(&mut self) {
        if std::process::id() != self.owner_pid {
            // A forked child's copy: closing its descriptor (below, by the field's drop) is
            // all; the socket and its accept loop are the parent's, and the thread handle
            // names a thread this process does not have.
            std::mem::forget(self.accept_loop.take());
            return;
        }
        self.stop.store(true, Ordering::SeqCst);
        self.table.changed.notify_all();
        // Wake the accept loop: shutting a listening socket down fails its accept() (Linux);
        // a connection does too, where that does not.
        if socket2::SockRef::from(&self.listener)
            .shutdown(Shutdown::Both)
            .is_err()
        {
            let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
        }
        if let Some(t) = self.accept_loop.take() {
            let _ = t.join();
        }
    }
}

#[derive(Clone)]
struct Shared {
    stop: Arc<AtomicBool>,
    table: Arc<Table>,
    counters: Arc<Counters>,
    token: Option<JobToken>,
    /// Connections being authenticated now.
    pending: Arc<AtomicUsize>,
}

fn accept_loop(listener: TcpListener, shared: Shared) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors or similar: do not spin on a connection we cannot take.
                if !matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::Interrupted
                ) {
                    thread::sleep(Duration::from_millis(20));
                }
                continue;
            }
        };
        let Some(slot) = PendingSlot::take(&shared.pending) else {
            shared.counters.overloaded();
            tracing::warn!(from = ?conn.peer_addr().ok(), "store: too many unauthenticated connections; dropping one");
            continue;
        };
        let sh = shared.clone();
        let _ = thread::Builder::new()
            .name("hcomm-store-conn".into())
            .spawn(move || connection(conn, slot, &sh));
    }
}

fn connection(mut c: TcpStream, slot: PendingSlot, sh: &Shared) {
    let from = c.peer_addr().ok();
    let _ = c.set_nodelay(true);
    let deadline = Instant::now() + PRE_AUTH_DEADLINE;
    let r = auth::accept(
        &mut c,
        sh.token.as_ref(),
        STORE_SERVER,
        |_| Ok(()),
        deadline,
    );
    drop(slot);
    sh.counters.record(&r);
    if let Err(e) = r {
        tracing::warn!(?from, "store: rejected a connection: {e}");
        return;
    }
    if c.set_read_timeout(None).is_err() || c.set_write_timeout(None).is_err() {
        return;
    }
    if let Err(e) = serve(&mut c, &sh.stop, &sh.table) {
        tracing::warn!(?from, "store: dropped a client after a bad request: {e}");
        let _ = c.shutdown(Shutdown::Both);
    }
}

fn reply(w: &mut impl Write, status: u8, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.push(status);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

fn serve(c: &mut TcpStream, stop: &AtomicBool, table: &Table) -> Result<(), ProtocolError> {
    while let Some(req) = read_request(c)? {
        let (st, payload) = table.apply(req, stop, true);
        reply(c, st, &payload)?;
    }
    Ok(())
}

/// Why a store request failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The key did not appear before the deadline.
    #[error("timed out after {0:?} waiting for key '{1}'")]
    Timeout(Duration, String),
    /// Could not reach the store before the deadline.
    #[error("cannot reach the rendezvous store at {addr} within {after:?}: {last} (is rank 0 running, and is the master address/port right?)")]
    Unreachable {
        /// Store address.
        addr: String,
        /// How long we tried.
        after: Duration,
        /// The last connect error.
        last: String,
    },
    /// The store (or whatever listens at its address) failed the authentication handshake.
    #[error("rendezvous store at {addr}: {source}")]
    Handshake {
        /// Store address.
        addr: String,
        /// What went wrong.
        #[source]
        source: HandshakeError,
    },
    /// The server answered with an error.
    #[error("store error: {0}")]
    Server(String),
    /// The server's reply breaks the protocol.
    #[error("bad reply from the rendezvous store: {0}")]
    Protocol(ProtocolError),
    /// I/O on the store connection failed (a closed connection usually means rank 0, which
    /// hosts the store, is gone).
    #[error("store connection failed: {source}{hint}", source = .0, hint = gone_hint(.0))]
    Io(#[from] io::Error),
}

fn gone_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionRefused => {
            " (the store closed the connection: rank 0, which hosts it, has probably exited)"
        }
        _ => "",
    }
}

impl From<ProtocolError> for StoreError {
    fn from(e: ProtocolError) -> Self {
        match e {
            ProtocolError::Io(e) => StoreError::Io(e),
            other => StoreError::Protocol(other),
        }
    }
}

/// How long [`StoreClient::connect`] fails quietly before it says, once, that it keeps trying
/// (or half its timeout, when that is shorter).
pub const STILL_TRYING_NOTICE: Duration = Duration::from_secs(10);

/// The line [`StoreClient::connect`] prints after [`STILL_TRYING_NOTICE`] of failed attempts.
fn still_trying(addr: &str, after: Duration, last: &str, timeout: Duration) -> String {
    format!(
        "hcomm: still cannot reach the rendezvous store at {addr} after {:.1} s ({last}); \
         retrying until the timeout ({:.0} s, HCOMM_TIMEOUT). Is rank 0 running, and is the \
         master address/port right?",
        after.as_secs_f64(),
        timeout.as_secs_f64()
    )
}

/// A connection to the store.
pub struct StoreClient {
    conn: TcpStream,
    addr: SocketAddr,
}

impl StoreClient {
    /// Connect to `addr` (host:port) and authenticate with `token` (if any), retrying with
    /// backoff until `timeout` has passed. A refused token (or a token on one side only) fails
    /// at once with [`StoreError::Handshake`].
    pub fn connect(
        addr: &str,
        timeout: Duration,
        token: Option<&JobToken>,
    ) -> Result<StoreClient, StoreError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(5);
        let mut last = String::from("no address");
        let mut told = false;
        loop {
            let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => {
                    last = format!("cannot resolve: {e}");
                    Vec::new()
                }
            };
            for a in &addrs {
                // At most 2 s an attempt, and none past the notice or the deadline (a dropped
                // SYN would otherwise hold either up by a whole attempt).
                let next = if told {
                    timeout
                } else {
                    STILL_TRYING_NOTICE.min(timeout / 2)
                };
                let attempt = next
                    .saturating_sub(start.elapsed())
                    .clamp(Duration::from_millis(10), Duration::from_secs(2));
                match TcpStream::connect_timeout(a, attempt) {
                    Ok(mut conn) => {
                        conn.set_nodelay(true)?;
                        let left = timeout.saturating_sub(start.elapsed());
                        let deadline = Instant::now()
                            + left.clamp(Duration::from_millis(100), 2 * PRE_AUTH_DEADLINE);
                        match auth::connect(&mut conn, token, STORE_CLIENT, u32::MAX, deadline) {
                            Ok(()) => {
                                conn.set_read_timeout(None)?;
                                conn.set_write_timeout(None)?;
                                return Ok(StoreClient { conn, addr: *a });
                            }
                            // Dropped (an overloaded or restarting server): try again.
                            Err(e) if e.is_transient() => last = e.to_string(),
                            Err(source) => {
                                return Err(StoreError::Handshake {
                                    addr: a.to_string(),
                                    source,
                                })
                            }
                        }
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if start.elapsed() >= timeout {
                return Err(StoreError::Unreachable {
                    addr: addr.to_string(),
                    after: timeout,
                    last,
                });
            }
            if !told && start.elapsed() >= STILL_TRYING_NOTICE.min(timeout / 2) {
                // A job that cannot form is otherwise silent until the timeout (300 s by
                // default): say once, on stderr, what this rank keeps running into.
                told = true;
                let notice = still_trying(addr, start.elapsed(), &last, timeout);
                tracing::warn!("{notice}");
                eprintln!("{notice}");
            }
            thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// The store's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn request(
        &mut self,
        req: Request,
        read_timeout: Option<Duration>,
    ) -> Result<(u8, Vec<u8>), StoreError> {
        let (key_len, arg_len) = match &req {
            Request::Set { key, value } => (key.len(), value.len()),
            Request::Get { key, .. }
            | Request::Add { key, .. }
            | Request::Check { key }
            | Request::Delete { key } => (key.len(), 0),
        };
        if key_len > MAX_KEY || arg_len > MAX_VALUE {
            return Err(StoreError::Server(format!(
                "key of {key_len} bytes or value of {arg_len} bytes is too large (at most {MAX_KEY} and {MAX_VALUE})"
            )));
        }
        let op = req.name();
        self.conn.set_read_timeout(read_timeout)?;
        self.conn.write_all(&req.encode())?;
        let (st, payload) = read_reply(&mut self.conn, op)?;
        if st == ST_ERROR {
            return Err(StoreError::Server(
                String::from_utf8_lossy(&payload).into_owned(),
            ));
        }
        Ok((st, payload))
    }

    /// Set `key` to `value`, waking waiters.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let req = Request::Set {
            key: key.as_bytes().to_vec(),
            value: value.to_vec(),
        };
        self.request(req, Some(Duration::from_secs(60))).map(|_| ())
    }

    /// Wait up to `timeout` for `key` to exist and return its value.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let timeout_ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        let req = Request::Get {
            key: key.as_bytes().to_vec(),
            timeout_ms,
        };
        let (st, v) = self.request(req, Some(timeout.saturating_add(Duration::from_secs(10))))?;
        if st == ST_TIMEOUT {
            return Err(StoreError::Timeout(timeout, key.to_string()));
        }
        Ok(v)
    }

    /// Atomically add `delta` to the counter at `key` (missing = 0) and return the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let req = Request::Add {
            key: key.as_bytes().to_vec(),
            delta,
        };
        let (_, v) = self.request(req, Some(Duration::from_secs(60)))?;
        // read_reply checked the length.
        let b: [u8; 8] = v
            .as_slice()
            .try_into()
            .map_err(|_| StoreError::Server("bad ADD reply".into()))?;
        Ok(i64::from_le_bytes(b))
    }

    /// Whether `key` exists now.
    pub fn check(&mut self, key: &str) -> Result<bool, StoreError> {
        let req = Request::Check {
            key: key.as_bytes().to_vec(),
        };
        let (_, v) = self.request(req, Some(Duration::from_secs(60)))?;
        Ok(v.first() == Some(&1))
    }

    /// Remove `key`.
    pub fn delete(&mut self, key: &str) -> Result<(), StoreError> {
        let req = Request::Delete {
            key: key.as_bytes().to_vec(),
        };
        self.request(req, Some(Duration::from_secs(60))).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECS5: Duration = Duration::from_secs(5);

    /// A forked child (a DataLoader worker, a subprocess) that drops its copy of rank 0's
    /// server must leave the parent's server serving: the listening socket is shared.
    #[test]
    // Test only: `fork` and `_exit` are `unsafe`; the crate otherwise denies `unsafe_code`.
    #[allow(unsafe_code)]
    fn a_forked_child_dropping_its_copy_leaves_the_server_serving() {
        use nix::sys::wait::{waitpid, WaitStatus};
        use nix::unistd::{fork, ForkResult};
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let addr = server.addr().to_string();
        // SAFETY: the child only drops its copy of the server (a getpid and a close; no lock
        // another thread could hold) and leaves with _exit, whatever happens.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                let ok =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(server))).is_ok();
                // SAFETY: _exit ends the child at once, running nothing of the parent's.
                unsafe { nix::libc::_exit(if ok { 0 } else { 1 }) }
            }
            ForkResult::Parent { child } => {
                assert_eq!(waitpid(child, None).unwrap(), WaitStatus::Exited(child, 0));
                let mut c = StoreClient::connect(&addr, SECS5, None).unwrap();
                c.set("k", b"v").unwrap();
                assert_eq!(c.get("k", SECS5).unwrap(), b"v");
            }
        }
    }

    fn token(s: &str) -> JobToken {
        JobToken::new(s.as_bytes()).unwrap()
    }

    #[test]
    fn set_get_add_wait() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let addr = server.addr().to_string();
        let mut a = StoreClient::connect(&addr, SECS5, None).unwrap();
        let addr2 = addr.clone();
        let waiter = thread::spawn(move || {
            let mut b = StoreClient::connect(&addr2, SECS5, None).unwrap();
            b.get("late", Duration::from_secs(10)).unwrap()
        });
        thread::sleep(Duration::from_millis(50));
        a.set("late", b"hello").unwrap();
        assert_eq!(waiter.join().unwrap(), b"hello");
        assert_eq!(a.add("ctr", 2).unwrap(), 2);
        assert_eq!(a.add("ctr", -5).unwrap(), -3);
        assert!(a.check("ctr").unwrap());
        a.delete("ctr").unwrap();
        assert!(!a.check("ctr").unwrap());
        assert!(matches!(
            a.get("never", Duration::from_millis(50)),
            Err(StoreError::Timeout(..))
        ));
        assert!(matches!(a.add("late", 1), Err(StoreError::Server(_))));
    }

    #[test]
    fn unreachable_store_fails_by_deadline() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t = Instant::now();
        let r = StoreClient::connect(
            &format!("127.0.0.1:{port}"),
            Duration::from_millis(300),
            None,
        );
        assert!(matches!(r, Err(StoreError::Unreachable { .. })));
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    /// An authenticated raw connection to `server` (for sending hand-made requests).
    fn raw(server: &StoreServer, t: Option<&JobToken>) -> TcpStream {
        let mut c = TcpStream::connect(server.addr()).unwrap();
        auth::connect(&mut c, t, STORE_CLIENT, u32::MAX, Instant::now() + SECS5).unwrap();
        c.set_read_timeout(Some(SECS5)).unwrap();
        c
    }

    #[test]
    fn oversized_request_drops_connection_not_server() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let bad: [&[u8]; 4] = [
            &[OP_SET, 0xff, 0xff, 0xff, 0xff],                   // key of 4 GiB
            &[OP_SET, 1, 0, 0, 0, b'k', 0xff, 0xff, 0xff, 0xff], // value of 4 GiB
            &[OP_GET, 1, 0, 0, 0, b'k', 0xff, 0xff, 0xff, 0x7f], // GET argument of 2 GiB
            &[99, 0, 0, 0, 0],                                   // unknown op
        ];
        for msg in bad {
            let mut c = raw(&server, None);
            c.write_all(msg).unwrap();
            let mut b = [0u8; 1];
            assert_eq!(c.read(&mut b).unwrap_or(0), 0, "{msg:?}");
        }
        let mut ok = StoreClient::connect(&server.addr().to_string(), SECS5, None).unwrap();
        ok.set("k", b"v").unwrap();
        assert_eq!(ok.get("k", Duration::from_secs(1)).unwrap(), b"v");
    }

    #[test]
    fn token_required_and_checked() {
        let t = token("store-test-token-0001");
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), Some(t.clone())).unwrap();
        let addr = server.addr().to_string();
        let mut good = StoreClient::connect(&addr, SECS5, Some(&t)).unwrap();
        good.set("secret", b"data").unwrap();
        let wrong = token("store-test-token-0002");
        match StoreClient::connect(&addr, SECS5, Some(&wrong)) {
            Err(StoreError::Handshake { source, .. }) => {
                assert_eq!(source, HandshakeError::Rejected)
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        match StoreClient::connect(&addr, SECS5, None) {
            Err(StoreError::Handshake { source, .. }) => {
                assert_eq!(source, HandshakeError::TokenRequired)
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        // A stranger's request bytes are never served.
        let mut c = TcpStream::connect(server.addr()).unwrap();
        let mut req = Request::Get {
            key: b"secret".to_vec(),
            timeout_ms: 0,
        }
        .encode();
        req.resize(auth::HELLO_LEN, 0);
        c.write_all(&req).unwrap();
        c.set_read_timeout(Some(SECS5)).unwrap();
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        assert!(got.is_empty(), "a stranger got {got:?}");
        // Each connection's thread counts it; give them time.
        let t = Instant::now();
        let mut s = server.stats();
        while (s.bad_token, s.malformed) != (2, 1) && t.elapsed() < SECS5 {
            thread::sleep(Duration::from_millis(10));
            s = server.stats();
        }
        assert_eq!((s.bad_token, s.malformed), (2, 1), "{s:?}");
        assert_eq!(good.get("secret", SECS5).unwrap(), b"data");
    }

    #[test]
    fn table_is_bounded() {
        let table = Table::default();
        let stop = AtomicBool::new(false);
        let big = vec![0u8; MAX_VALUE];
        let mut refused = false;
        for i in 0..=(MAX_TABLE_BYTES / MAX_VALUE) {
            let (st, _) = table.apply(
                Request::Set {
                    key: i.to_le_bytes().to_vec(),
                    value: big.clone(),
                },
                &stop,
                false,
            );
            refused |= st == ST_ERROR;
        }
        assert!(refused);
        assert!(table.lock().bytes <= MAX_TABLE_BYTES);
    }

    fn request() -> impl Strategy<Value = Request> {
        let key = proptest::collection::vec(any::<u8>(), 0..64);
        prop_oneof![
            (key.clone(), proptest::collection::vec(any::<u8>(), 0..64))
                .prop_map(|(key, value)| Request::Set { key, value }),
            (key.clone(), any::<u64>())
                .prop_map(|(key, timeout_ms)| Request::Get { key, timeout_ms }),
            (key.clone(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
            key.clone().prop_map(|key| Request::Check { key }),
            key.prop_map(|key| Request::Delete { key }),
        ]
    }

    proptest! {
        #[test]
        fn requests_roundtrip(reqs in proptest::collection::vec(request(), 0..8)) {
            let bytes: Vec<u8> = reqs.iter().flat_map(|r| r.encode()).collect();
            let mut r = &bytes[..];
            for want in &reqs {
                let got = read_request(&mut r).unwrap();
                prop_assert_eq!(got.as_ref(), Some(want));
            }
            prop_assert!(read_request(&mut r).unwrap().is_none());
        }

        #[test]
        fn mutated_requests_never_panic(req in request(), pos: usize, val: u8, cut: usize) {
            let mut bytes = req.encode();
            let i = pos % bytes.len();
            bytes[i] = val;
            bytes.truncate(cut % (bytes.len() + 1));
            crate::fuzzing::store_protocol(&bytes);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            crate::fuzzing::store_protocol(&bytes);
        }
    }
}
