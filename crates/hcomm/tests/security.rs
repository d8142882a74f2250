//! Authentication and stray connections, with real processes: the test binary re-executes
//! itself once per rank (with `HCOMM_TEST_WORKER` set, the test body runs as a rank). Ranks
//! with the same job token work together; a rank with another token, or none, cannot join; and
//! while a job runs collectives, strangers connecting to the store and to the data ports (closing
//! at once, sending garbage, a huge length, no token or a wrong one, or starting the handshake
//! and stalling) are each turned away and counted, and the job's results stay right.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;

mod common;

use common::{assert_all_ok, is_worker, wait_all};
use std::time::{Duration, Instant};

use hcomm::auth::{self, HandshakeError, Hello, JobToken, Local, Role, HELLO_LEN};
use hcomm::{Communicator, Error, ReduceOp};

const TOKEN: &str = "0123456789abcdef-security-test-token";
const OTHER_TOKEN: &str = "0123456789abcdef-not-the-job-token";

/// Start `n` copies of this test binary running only `test` as ranks of one job on this
/// host (rendezvous on 127.0.0.1, 30 s deadline), rank `r` with `env(r)` added.
fn spawn(test: &str, n: usize, env: impl Fn(usize) -> Vec<(String, String)>) -> Vec<Child> {
    common::spawn(test, n, |r| {
        let mut v = vec![
            ("HCOMM_TIMEOUT".to_string(), "30s".to_string()),
            ("HCOMM_RANK".to_string(), r.to_string()),
            ("HCOMM_WORLD_SIZE".to_string(), n.to_string()),
            ("HCOMM_MASTER_ADDR".to_string(), "127.0.0.1".to_string()),
        ];
        v.extend(env(r));
        v
    })
}

/// All-reduce (small and large), a point-to-point ring and a split, checking every result.
fn exercise(comm: &Communicator, round: u64) {
    let (r, n) = (comm.rank() as u64, comm.world_size() as u64);
    for len in [7usize, 100_000] {
        let mut v = vec![r + round; len];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        let want = n * (n - 1) / 2 + n * round;
        assert!(
            v.iter().all(|&x| x == want),
            "round {round}: {} != {want}",
            v[0]
        );
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let mut got = [0u64; 3];
    comm.send_recv(right as usize, &[r, round, 77], left as usize, &mut got, 9)
        .unwrap();
    assert_eq!(got, [left, round, 77]);
}

#[test]
fn ranks_with_the_same_token_work_together_and_token_stays_secret() {
    if is_worker() {
        let comm = Communicator::from_env().unwrap();
        assert!(comm.is_authenticated());
        exercise(&comm, 1);
        let sub = comm.split(Some(0), -(comm.rank() as i64)).unwrap().unwrap();
        assert!(sub.is_authenticated());
        exercise(&sub, 2);
        let stats = comm.connection_stats();
        assert_eq!(stats.rejected(), 0, "{stats:?}");
        println!("WORKER OK rank {} links {stats:?}", comm.rank());
        return;
    }
    let port = hcomm::testing::free_port();
    let kids = spawn(
        "ranks_with_the_same_token_work_together_and_token_stays_secret",
        3,
        |_| {
            vec![
                ("HCOMM_MASTER_PORT".into(), port.to_string()),
                ("HCOMM_JOB_TOKEN".into(), TOKEN.into()),
                ("HCOMM_TRANSPORT".into(), "tcp".into()),
                ("HCOMM_DEBUG".into(), "trace".into()),
            ]
        },
    );
    let res = wait_all(kids, Duration::from_secs(90));
    assert_all_ok(&res);
    for (r, (_, out)) in res.iter().enumerate() {
        assert!(!out.contains(TOKEN), "rank {r} printed the token:\n{out}");
    }
}

#[test]
fn a_token_file_named_by_the_rank_table_authenticates() {
    if is_worker() {
        let comm = Communicator::from_env().unwrap();
        assert!(comm.is_authenticated());
        exercise(&comm, 3);
        println!("WORKER OK rank {}", comm.rank());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("job.token"), format!("{TOKEN}\n")).unwrap();
    let port = hcomm::testing::free_port();
    let table = serde_json::json!({
        "version": "1.0",
        "world_size": 2,
        "master": {"addr": "127.0.0.1", "port": port},
        "token_file": "job.token",
        "transport": "tcp",
        "ranks": (0..2).map(|r| serde_json::json!({"rank": r, "host": "127.0.0.1", "local_rank": r})).collect::<Vec<_>>(),
    });
    let path = dir.path().join("hcom_config.json");
    std::fs::write(&path, table.to_string()).unwrap();
    let p = path.display().to_string();
    let kids = spawn(
        "a_token_file_named_by_the_rank_table_authenticates",
        2,
        |_| vec![("HCOMM_RANK_TABLE".into(), p.clone())],
    );
    assert_all_ok(&wait_all(kids, Duration::from_secs(60)));
}

#[test]
fn a_rank_with_a_wrong_token_or_none_cannot_join() {
    if is_worker() {
        let e = Communicator::from_env()
            .expect_err("bootstrap must fail: a rank with a wrong token or none is in the job");
        let kind = match &e {
            Error::Auth { .. } => "Auth",
            Error::Timeout { .. } => "Timeout",
            _ => "Other",
        };
        println!("ERROR {kind}: {e}");
        return;
    }
    let port = hcomm::testing::free_port();
    let kids = spawn("a_rank_with_a_wrong_token_or_none_cannot_join", 4, |r| {
        let mut env = vec![
            ("HCOMM_MASTER_PORT".into(), port.to_string()),
            ("HCOMM_TIMEOUT".into(), "4s".into()),
            ("HCOMM_DEBUG".into(), "debug".into()),
        ];
        match r {
            2 => env.push(("HCOMM_JOB_TOKEN".into(), OTHER_TOKEN.into())),
            3 => {}
            _ => env.push(("HCOMM_JOB_TOKEN".into(), TOKEN.into())),
        }
        env
    });
    let res = wait_all(kids, Duration::from_secs(60));
    let line = |r: usize| {
        let (code, out) = &res[r];
        assert_eq!(*code, Some(0), "rank {r}:\n{out}");
        assert!(
            !out.contains(TOKEN) && !out.contains(OTHER_TOKEN),
            "rank {r} printed a token:\n{out}"
        );
        out.lines()
            .find_map(|l| l.split_once("ERROR ").map(|x| x.1.to_string()))
            .unwrap_or_else(|| panic!("rank {r}:\n{out}"))
    };
    let wrong = line(2);
    assert!(
        wrong.starts_with("Auth:") && wrong.contains("rejected this process's job token"),
        "{wrong}"
    );
    let none = line(3);
    assert!(
        none.starts_with("Auth:") && none.contains("HCOMM_JOB_TOKEN"),
        "{none}"
    );
    // The others wait for ranks 2 and 3 in vain.
    let r0 = line(0);
    assert!(
        r0.starts_with("Timeout:") && r0.contains("never joined"),
        "{r0}"
    );
    // (Rank 1 times out too, or sees the store go when rank 0 gives up first.)
    assert!(!line(1).starts_with("Auth:"), "{}", line(1));
}

// ---- strays ----

fn stray_worker() {
    let dir = PathBuf::from(std::env::var("STRAY_DIR").unwrap());
    let comm = Communicator::from_env().unwrap();
    let rank = comm.rank();
    let tmp = dir.join(format!("rank{rank}.tmp"));
    std::fs::write(&tmp, comm.listen_addr().to_string()).unwrap();
    std::fs::rename(&tmp, dir.join(format!("rank{rank}.addr"))).unwrap();
    let start = Instant::now();
    let mut round = 0u64;
    loop {
        // Rank 0 decides for everyone whether to go on.
        let stop = dir.join("stop").exists() || start.elapsed() > Duration::from_secs(90);
        let mut go = [u8::from(!stop)];
        comm.broadcast(&mut go, 0).unwrap();
        if go[0] == 0 {
            break;
        }
        exercise(&comm, round);
        if round.is_multiple_of(25) {
            // New communicators need the store and new links while the strays are about.
            let sub = comm.split(Some(0), rank as i64).unwrap().unwrap();
            exercise(&sub, round);
        }
        round += 1;
    }
    let s = comm.connection_stats();
    println!(
        "LINKS accepted={} closed={} timed_out={} malformed={} wrong_peer={} bad_token={} overloaded={}",
        s.accepted, s.closed, s.timed_out, s.malformed, s.wrong_peer, s.bad_token, s.overloaded
    );
    if let Some(s) = comm.store_connection_stats() {
        println!(
            "STORE accepted={} closed={} timed_out={} malformed={} wrong_peer={} bad_token={} overloaded={}",
            s.accepted, s.closed, s.timed_out, s.malformed, s.wrong_peer, s.bad_token, s.overloaded
        );
    }
    println!("WORKER OK rank {rank} rounds={round}");
}

/// A stray's target: the store, or rank `rank`'s data port.
#[derive(Clone, Copy, Debug)]
enum Target {
    Store(SocketAddr),
    Link(SocketAddr, usize),
}

impl Target {
    fn addr(self) -> SocketAddr {
        match self {
            Target::Store(a) | Target::Link(a, _) => a,
        }
    }

    /// Who a client of this target claims to be (a link dialer claims the next rank).
    fn client(self) -> (Local, u32) {
        match self {
            Target::Store(_) => (
                Local {
                    role: Role::StoreClient,
                    rank: u32::MAX,
                    comm_hash: 0,
                },
                u32::MAX,
            ),
            Target::Link(_, r) => (
                Local {
                    role: Role::LinkDialer,
                    rank: ((r + 1) % 3) as u32,
                    comm_hash: auth::comm_hash("world"),
                },
                r as u32,
            ),
        }
    }

    fn hello(self) -> [u8; HELLO_LEN] {
        let (me, _) = self.client();
        Hello {
            role: me.role,
            auth: true,
            rank: me.rank,
            comm_hash: me.comm_hash,
            nonce: [1; 32],
        }
        .encode()
    }
}

fn connect(t: Target) -> TcpStream {
    let c = TcpStream::connect_timeout(&t.addr(), Duration::from_secs(5)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c
}

/// Send `bytes`, then read until the other side closes: it must send nothing at all.
fn expect_dropped_silently(t: Target, bytes: &[u8]) {
    let mut c = connect(t);
    let _ = c.write_all(bytes);
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    assert!(
        got.is_empty(),
        "{t:?} answered {} bytes to {bytes:02x?}",
        got.len()
    );
}

fn handshake(t: Target, token: Option<&str>) -> Result<(), HandshakeError> {
    let mut c = connect(t);
    let token = token.map(|s| JobToken::new(s.as_bytes()).unwrap());
    let (me, expect) = t.client();
    auth::connect(
        &mut c,
        token.as_ref(),
        me,
        expect,
        Instant::now() + Duration::from_secs(20),
    )
}

/// Every kind of stray against `t`; returns the rejections each kind should have caused.
fn strays(t: Target) -> [(&'static str, u64); 5] {
    // Start the handshake and stall: several at once, held while the others run.
    let stalled: Vec<TcpStream> = (0..5)
        .map(|_| {
            let mut c = connect(t);
            c.write_all(&t.hello()[..10]).unwrap();
            c
        })
        .collect();
    let held = Instant::now();
    // Connect and close.
    drop(connect(t));
    // Garbage, and a huge length prefix (store request / frame header) instead of a hello.
    expect_dropped_silently(t, &[0xab; 200]);
    let huge: Vec<u8> = match t {
        Target::Store(_) => [&[1u8, 0xff, 0xff, 0xff, 0xff][..], &[0xff; 60]].concat(),
        Target::Link(..) => {
            let mut h = vec![0x43, 0x48, 2, 0, 0, 0, 0, 0];
            h.extend_from_slice(&[0xff; 56]);
            h
        }
    };
    expect_dropped_silently(t, &huge);
    // No token, then a wrong one (twice: the acceptor answers while the stalled ones wait).
    assert_eq!(
        handshake(t, None),
        Err(HandshakeError::TokenRequired),
        "{t:?}"
    );
    assert_eq!(
        handshake(t, Some(OTHER_TOKEN)),
        Err(HandshakeError::Rejected),
        "{t:?}"
    );
    assert_eq!(
        handshake(t, Some(OTHER_TOKEN)),
        Err(HandshakeError::Rejected),
        "{t:?}"
    );
    let mut wrong_peer = 0;
    match t {
        Target::Link(_, r) => {
            // The right token but another communicator, or the target's own rank.
            let mut c = connect(t);
            let me = Local {
                role: Role::LinkDialer,
                rank: ((r + 1) % 3) as u32,
                comm_hash: auth::comm_hash("another communicator"),
            };
            let token = JobToken::new(TOKEN.as_bytes()).unwrap();
            let far = Instant::now() + Duration::from_secs(20);
            assert_eq!(
                auth::connect(&mut c, Some(&token), me, r as u32, far),
                Err(HandshakeError::Closed)
            );
            wrong_peer += 1;
        }
        Target::Store(_) => {
            // Authenticated, then a request with a 4 GiB key: dropped, nothing allocated.
            let mut c = connect(t);
            let token = JobToken::new(TOKEN.as_bytes()).unwrap();
            let (me, expect) = t.client();
            let far = Instant::now() + Duration::from_secs(20);
            auth::connect(&mut c, Some(&token), me, expect, far).unwrap();
            c.write_all(&[1, 0xff, 0xff, 0xff, 0xff, 0, 0]).unwrap();
            let mut got = Vec::new();
            let _ = c.read_to_end(&mut got);
            assert!(got.is_empty());
        }
    }
    // The stalled ones are dropped by the deadline (generous bound: the read timeout).
    for mut c in stalled {
        let mut got = Vec::new();
        let r = c.read_to_end(&mut got);
        assert!(
            r.is_ok() && got.is_empty(),
            "{t:?}: stalled connection got {r:?} {got:?}"
        );
    }
    assert!(held.elapsed() < Duration::from_secs(20), "{t:?}");
    [
        ("closed", 1),
        ("malformed", 2),
        ("bad_token", 3),
        ("timed_out", 5),
        ("wrong_peer", wrong_peer),
    ]
}

fn read_addr(dir: &Path, rank: usize, kids: &mut [Child]) -> SocketAddr {
    let t = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join(format!("rank{rank}.addr"))) {
            return s.parse().unwrap();
        }
        for k in kids.iter_mut() {
            assert!(k.try_wait().unwrap().is_none(), "a rank exited early");
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "rank {rank} never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `key=value` of the line starting with `prefix`.
fn stat(out: &str, prefix: &str, key: &str) -> u64 {
    // (The test harness may print its own words before ours on the same line.)
    let line = out
        .lines()
        .find_map(|l| l.find(prefix).map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("no {prefix} line:\n{out}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[test]
fn strays_are_rejected_and_counted_while_a_job_runs() {
    if is_worker() {
        return stray_worker();
    }
    let dir = tempfile::tempdir().unwrap();
    let port = hcomm::testing::free_port();
    let d = dir.path().display().to_string();
    let mut kids = spawn(
        "strays_are_rejected_and_counted_while_a_job_runs",
        3,
        |_| {
            vec![
                ("HCOMM_MASTER_PORT".into(), port.to_string()),
                ("HCOMM_JOB_TOKEN".into(), TOKEN.into()),
                ("HCOMM_TRANSPORT".into(), "tcp".into()),
                ("STRAY_DIR".into(), d.clone()),
            ]
        },
    );
    let links: Vec<SocketAddr> = (0..3)
        .map(|r| read_addr(dir.path(), r, &mut kids))
        .collect();
    let store = Target::Store(format!("127.0.0.1:{port}").parse().unwrap());
    // All targets at once.
    let expected: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = std::iter::once(store)
            .chain(links.iter().enumerate().map(|(r, a)| Target::Link(*a, r)))
            .map(|t| s.spawn(move || strays(t)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::fs::write(dir.path().join("stop"), "").unwrap();
    let res = wait_all(kids, Duration::from_secs(120));
    assert_all_ok(&res);
    for (r, (_, out)) in res.iter().enumerate() {
        assert!(stat(out, "WORKER OK", "rounds") > 0, "{out}");
        assert!(!out.contains(TOKEN), "rank {r} printed the token:\n{out}");
        for (key, want) in expected[r + 1] {
            assert_eq!(
                stat(out, "LINKS", key),
                want,
                "rank {r} links {key}:\n{out}"
            );
        }
        assert_eq!(stat(out, "LINKS", "overloaded"), 0, "{out}");
    }
    for (key, want) in expected[0] {
        assert_eq!(
            stat(&res[0].1, "STORE", key),
            want,
            "store {key}:\n{}",
            res[0].1
        );
    }
}
