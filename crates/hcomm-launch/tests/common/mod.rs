//! Helpers shared by the launcher's tests (here, and `crates/hcomm-cli/tests/signals.rs`, which
//! includes this file).
#![allow(dead_code)]

use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use hcomm_launch::{launch_with_output, LaunchError, LaunchSpec};
use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;

/// Runs `f` on a thread and fails the test if it takes longer than `limit`.
pub fn with_timeout<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("test did not finish within {limit:?}"),
    }
}

/// The result of a launch whose output was captured.
pub struct Captured {
    pub result: Result<i32, LaunchError>,
    pub out: String,
    pub err: String,
    pub elapsed: Duration,
}

pub fn run_captured(spec: &LaunchSpec) -> Captured {
    let out = Arc::new(Mutex::new(Vec::<u8>::new()));
    let err = Arc::new(Mutex::new(Vec::<u8>::new()));
    let start = Instant::now();
    let result = launch_with_output(spec, out.clone(), err.clone());
    let elapsed = start.elapsed();
    let text = |buf: &Arc<Mutex<Vec<u8>>>| String::from_utf8(buf.lock().unwrap().clone()).unwrap();
    Captured {
        result,
        out: text(&out),
        err: text(&err),
        elapsed,
    }
}

/// `nprocs` ranks of `sh -c SCRIPT`, with `$T` set to `dir`.
pub fn sh_spec(nprocs: usize, script: &str, dir: &Path) -> LaunchSpec {
    let mut spec = LaunchSpec::new(nprocs, "sh", ["-c", script]);
    spec.extra_env
        .push(("T".into(), dir.to_str().unwrap().into()));
    spec
}

/// Shell snippet: write this shell's pid to `$T/NAME` atomically.
pub fn write_pid(name: &str) -> String {
    format!("echo $$ > \"$T/{name}.tmp\" && mv \"$T/{name}.tmp\" \"$T/{name}\"")
}

/// Reads a pid file written with [`write_pid`].
pub fn read_pid(dir: &Path, name: &str) -> Pid {
    let text =
        std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("pid file {name}: {e}"));
    Pid::from_raw(text.trim().parse().unwrap())
}

/// Waits (bounded) until the file `dir/name` exists.
pub fn wait_for_file(dir: &Path, name: &str, within: Duration) {
    let start = Instant::now();
    while !dir.join(name).exists() {
        assert!(
            start.elapsed() < within,
            "{name} did not appear within {within:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

fn is_zombie(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// True once `pid` no longer runs (gone, or a zombie waiting for its reaper).
pub fn is_gone(pid: Pid) -> bool {
    match kill(pid, None) {
        Err(Errno::ESRCH) => true,
        Ok(()) => is_zombie(pid),
        Err(_) => false,
    }
}

/// Asserts that `pid` stops running within a short time (an orphaned
/// grandchild may need a moment to be reaped by init).
pub fn assert_gone(pid: Pid) {
    let start = Instant::now();
    while !is_gone(pid) {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "process {pid} is still running"
        );
        thread::sleep(Duration::from_millis(10));
    }
}
