//! The rendezvous key-value store that rank 0 hosts during a job.
//!
//! Wire protocol (all integers little-endian), one request and one reply at a time per
//! connection:
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
//! Keys are at most [`MAX_KEY`] bytes and values at most [`MAX_VALUE`]; a request over either is
//! rejected and its connection dropped, so a stray client cannot make the server allocate.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Longest key accepted.
pub const MAX_KEY: usize = 4096;
/// Largest value accepted.
pub const MAX_VALUE: usize = 64 << 20;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_DEL: u8 = 5;
const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

/// The store server. Runs on background threads until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    table: Arc<Table>,
}

impl StoreServer {
    /// Listen on `addr` (exactly that address: nothing binds all interfaces unless `addr` is
    /// the unspecified address).
    pub fn start(addr: SocketAddr) -> io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let (s, t) = (stop.clone(), table.clone());
        thread::Builder::new()
            .name("hcomm-store".into())
            .spawn(move || accept_loop(listener, s, t))?;
        Ok(StoreServer { addr, stop, table })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.table.changed.notify_all();
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

fn accept_loop(listener: TcpListener, stop: Arc<AtomicBool>, table: Arc<Table>) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(conn) = conn else { continue };
        let (s, t) = (stop.clone(), table.clone());
        let _ = thread::Builder::new()
            .name("hcomm-store-conn".into())
            .spawn(move || {
                let _ = serve(conn, &s, &t);
            });
    }
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

fn reply(w: &mut impl Write, status: u8, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.push(status);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

fn serve(mut c: TcpStream, stop: &AtomicBool, table: &Table) -> io::Result<()> {
    c.set_nodelay(true)?;
    loop {
        let mut op = [0u8; 1];
        if c.read(&mut op)? == 0 {
            return Ok(());
        }
        let klen = read_u32(&mut c)? as usize;
        if klen > MAX_KEY {
            return Err(bad("key too long"));
        }
        let mut key = vec![0u8; klen];
        c.read_exact(&mut key)?;
        let alen = read_u32(&mut c)? as usize;
        if alen > MAX_VALUE {
            return Err(bad("value too large"));
        }
        let mut arg = vec![0u8; alen];
        c.read_exact(&mut arg)?;
        match op[0] {
            OP_SET => {
                table.map.lock().unwrap().insert(key, arg);
                table.changed.notify_all();
                reply(&mut c, ST_OK, &[])?;
            }
            OP_GET => {
                let ms = u64::from_le_bytes(
                    arg.get(..8)
                        .ok_or_else(|| bad("GET arg"))?
                        .try_into()
                        .unwrap(),
                );
                let deadline = Instant::now()
                    .checked_add(Duration::from_millis(ms))
                    .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86400));
                let mut map = table.map.lock().unwrap();
                let value = loop {
                    if let Some(v) = map.get(&key) {
                        break Some(v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline || stop.load(Ordering::SeqCst) {
                        break None;
                    }
                    map = table.changed.wait_timeout(map, deadline - now).unwrap().0;
                };
                drop(map);
                match value {
                    Some(v) => reply(&mut c, ST_OK, &v)?,
                    None => reply(&mut c, ST_TIMEOUT, &[])?,
                }
            }
            OP_ADD => {
                let delta = i64::from_le_bytes(
                    arg.get(..8)
                        .ok_or_else(|| bad("ADD arg"))?
                        .try_into()
                        .unwrap(),
                );
                let mut map = table.map.lock().unwrap();
                let cur = match map.get(&key) {
                    Some(v) if v.len() == 8 => i64::from_le_bytes(v[..8].try_into().unwrap()),
                    Some(_) => {
                        drop(map);
                        reply(&mut c, ST_ERROR, b"ADD on a key that is not a counter")?;
                        continue;
                    }
                    None => 0,
                };
                let new = cur.wrapping_add(delta);
                map.insert(key, new.to_le_bytes().to_vec());
                drop(map);
                table.changed.notify_all();
                reply(&mut c, ST_OK, &new.to_le_bytes())?;
            }
            OP_CHECK => {
                let has = table.map.lock().unwrap().contains_key(&key);
                reply(&mut c, ST_OK, &[has as u8])?;
            }
            OP_DEL => {
                table.map.lock().unwrap().remove(&key);
                reply(&mut c, ST_OK, &[])?;
            }
            _ => {
                let _ = c.shutdown(Shutdown::Both);
                return Err(bad("unknown store op"));
            }
        }
    }
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
    /// The server answered with an error.
    #[error("store error: {0}")]
    Server(String),
    /// I/O on the store connection failed.
    #[error("store connection failed: {0}")]
    Io(#[from] io::Error),
}

/// A connection to the store.
pub struct StoreClient {
    conn: TcpStream,
    addr: SocketAddr,
}

impl StoreClient {
    /// Connect to `addr` (host:port), retrying with backoff until `timeout` has passed.
    pub fn connect(addr: &str, timeout: Duration) -> Result<StoreClient, StoreError> {
        let start = Instant::now();
        let mut backoff = Duration::from_millis(5);
        let mut last = String::from("no address");
        loop {
            let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => {
                    last = format!("cannot resolve: {e}");
                    Vec::new()
                }
            };
            for a in &addrs {
                match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                    Ok(conn) => {
                        conn.set_nodelay(true)?;
                        return Ok(StoreClient { conn, addr: *a });
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
        op: u8,
        key: &str,
        arg: &[u8],
        read_timeout: Option<Duration>,
    ) -> Result<(u8, Vec<u8>), StoreError> {
        if key.len() > MAX_KEY || arg.len() > MAX_VALUE {
            return Err(StoreError::Server("key or value too large".into()));
        }
        let mut buf = Vec::with_capacity(9 + key.len() + arg.len());
        buf.push(op);
        buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
        buf.extend_from_slice(key.as_bytes());
        buf.extend_from_slice(&(arg.len() as u32).to_le_bytes());
        buf.extend_from_slice(arg);
        self.conn.set_read_timeout(read_timeout)?;
        self.conn.write_all(&buf)?;
        let mut st = [0u8; 1];
        self.conn.read_exact(&mut st)?;
        let len = read_u32(&mut self.conn)? as usize;
        if len > MAX_VALUE {
            return Err(StoreError::Server("reply too large".into()));
        }
        let mut payload = vec![0u8; len];
        self.conn.read_exact(&mut payload)?;
        if st[0] == ST_ERROR {
            return Err(StoreError::Server(
                String::from_utf8_lossy(&payload).into_owned(),
            ));
        }
        Ok((st[0], payload))
    }

    /// Set `key` to `value`, waking waiters.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.request(OP_SET, key, value, Some(Duration::from_secs(60)))
            .map(|_| ())
    }

    /// Wait up to `timeout` for `key` to exist and return its value.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        let (st, v) = self.request(
            OP_GET,
            key,
            &ms.to_le_bytes(),
            Some(timeout + Duration::from_secs(10)),
        )?;
        if st == ST_TIMEOUT {
            return Err(StoreError::Timeout(timeout, key.to_string()));
        }
        Ok(v)
    }

    /// Atomically add `delta` to the counter at `key` (missing = 0) and return the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let (_, v) = self.request(
            OP_ADD,
            key,
            &delta.to_le_bytes(),
            Some(Duration::from_secs(60)),
        )?;
        let b: [u8; 8] = v
            .get(..8)
            .and_then(|s| s.try_into().ok())
            .ok_or_else(|| StoreError::Server("bad ADD reply".into()))?;
        Ok(i64::from_le_bytes(b))
    }

    /// Whether `key` exists now.
    pub fn check(&mut self, key: &str) -> Result<bool, StoreError> {
        let (_, v) = self.request(OP_CHECK, key, &[], Some(Duration::from_secs(60)))?;
        Ok(v.first() == Some(&1))
    }

    /// Remove `key`.
    pub fn delete(&mut self, key: &str) -> Result<(), StoreError> {
        self.request(OP_DEL, key, &[], Some(Duration::from_secs(60)))
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_add_wait() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = server.addr().to_string();
        let mut a = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
        let addr2 = addr.clone();
        let waiter = thread::spawn(move || {
            let mut b = StoreClient::connect(&addr2, Duration::from_secs(5)).unwrap();
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
        let r = StoreClient::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(300));
        assert!(matches!(r, Err(StoreError::Unreachable { .. })));
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn oversized_request_drops_connection_not_server() {
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut raw = TcpStream::connect(server.addr()).unwrap();
        let mut msg = vec![OP_SET];
        msg.extend_from_slice(&(u32::MAX).to_le_bytes());
        raw.write_all(&msg).unwrap();
        let mut b = [0u8; 1];
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(raw.read(&mut b).unwrap_or(0), 0);
        let mut ok =
            StoreClient::connect(&server.addr().to_string(), Duration::from_secs(5)).unwrap();
        ok.set("k", b"v").unwrap();
        assert_eq!(ok.get("k", Duration::from_secs(1)).unwrap(), b"v");
    }
}
