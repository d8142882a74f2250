//! Helpers shared by the tests that run real processes: the test binary re-executes itself
//! once per rank (with `HCOMM_TEST_WORKER` set, the test body runs as a rank instead of as the
//! driver).
#![allow(dead_code)] // each test file uses its own subset

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Launch variables a test's parent environment might hold; every rank starts without them.
pub const LAUNCH_VARS: &[&str] = &[
    "HCOMM_RANK",
    "HCOMM_WORLD_SIZE",
    "HCOMM_LOCAL_RANK",
    "HCOMM_LOCAL_WORLD_SIZE",
    "HCOMM_MASTER_ADDR",
    "HCOMM_MASTER_PORT",
    "HCOMM_RANK_TABLE",
    "HCOMM_JOB_TOKEN",
    "HCOMM_TOKEN_FILE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_LAUNCH_NODE_IPADDR",
];

/// True in a rank (a copy the driver started); a rank then logs as `HCOMM_DEBUG` says, as the
/// `hcomm` tools would have it (the library installs no subscriber itself).
pub fn is_worker() -> bool {
    let worker = std::env::var_os("HCOMM_TEST_WORKER").is_some();
    if worker {
        init_logging();
    }
    worker
}

/// `HCOMM_DEBUG`'s subscriber, as `hcomm_launch::init_logging` installs it, without colours
/// (the driver greps the output). hcomm-launch depends on this crate, so these tests cannot
/// call it.
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(level) = std::env::var("HCOMM_DEBUG") {
            let filter = tracing_subscriber::EnvFilter::try_new(format!("hcomm={level}"))
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("hcomm=info"));
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .try_init();
        }
    });
}

/// The environment of rank `r` of an `n`-rank job on this host whose store is on `port`.
pub fn rank_env(r: usize, n: usize, port: u16) -> Vec<(String, String)> {
    vec![
        ("HCOMM_RANK".into(), r.to_string()),
        ("HCOMM_WORLD_SIZE".into(), n.to_string()),
        ("HCOMM_MASTER_ADDR".into(), "127.0.0.1".into()),
        ("HCOMM_MASTER_PORT".into(), port.to_string()),
    ]
}

/// Start `n` copies of this test binary running only `test`, rank `r` with `env(r)`.
pub fn spawn(test: &str, n: usize, env: impl Fn(usize) -> Vec<(String, String)>) -> Vec<Child> {
    (0..n)
        .map(|r| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args([test, "--exact", "--nocapture", "--test-threads=1"]);
            for v in LAUNCH_VARS {
                cmd.env_remove(v);
            }
            cmd.env("HCOMM_TEST_WORKER", "1")
                .env("HCOMM_TIMEOUT", "20s");
            for (k, v) in env(r) {
                cmd.env(k, v);
            }
            cmd.stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Wait for every child (killing all of them after `limit`); returns (exit code, output).
pub fn wait_all(mut kids: Vec<Child>, limit: Duration) -> Vec<(Option<i32>, String)> {
    let start = Instant::now();
    let mut codes: Vec<Option<Option<i32>>> = vec![None; kids.len()];
    while codes.iter().any(|c| c.is_none()) {
        for (i, k) in kids.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Some(st) = k.try_wait().unwrap() {
                    codes[i] = Some(st.code());
                }
            }
        }
        if start.elapsed() > limit {
            for (i, k) in kids.iter_mut().enumerate() {
                if codes[i].is_none() {
                    let _ = k.kill();
                    codes[i] = Some(k.wait().unwrap().code());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    kids.iter_mut()
        .zip(codes)
        .map(|(k, c)| {
            let mut out = String::new();
            k.stdout.take().unwrap().read_to_string(&mut out).unwrap();
            k.stderr.take().unwrap().read_to_string(&mut out).unwrap();
            (c.unwrap(), out)
        })
        .collect()
}

pub fn assert_all_ok(results: &[(Option<i32>, String)]) {
    for (r, (code, out)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r} failed:\n{out}");
        assert!(out.contains("WORKER OK"), "rank {r} did not finish:\n{out}");
    }
}
