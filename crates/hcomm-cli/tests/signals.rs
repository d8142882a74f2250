//! Signals sent to the launcher, through the `hcomm run` binary (a separate
//! process, so that the signals do not reach other tests' launches).

#[path = "../../hcomm-launch/tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const LIMIT: Duration = Duration::from_secs(30);

/// Starts the launcher on `nprocs` ranks of `sh -c SCRIPT` with `$T` = `dir`.
fn start(nprocs: usize, grace_ms: u64, script: &str, dir: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_hcomm"))
        .args([
            "run",
            "-n",
            &nprocs.to_string(),
            "--grace-ms",
            &grace_ms.to_string(),
            "--",
            "sh",
            "-c",
            script,
        ])
        .env("T", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits (bounded) for the launcher to exit; returns its exit code and stderr.
fn finish(mut child: Child, within: Duration) -> (i32, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > within {
            let _ = child.kill();
            panic!("launcher did not exit within {within:?}");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    (status.code().expect("launcher exited normally"), err)
}

fn signal_launcher(signal: Signal, expected: i32) {
    with_timeout(LIMIT, move || {
        let dir = tempfile::tempdir().unwrap();
        let script = format!("{}; sleep 30", write_pid("p$HCOMM_RANK"));
        let child = start(2, 3000, &script, dir.path());
        for rank in 0..2 {
            wait_for_file(dir.path(), &format!("p{rank}"), Duration::from_secs(10));
        }
        let started = Instant::now();
        kill(Pid::from_raw(child.id() as i32), signal).unwrap();
        let (code, err) = finish(child, Duration::from_secs(10));
        assert_eq!(code, expected, "stderr: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "SIGTERM was not forwarded"
        );
        assert!(
            err.contains(&format!("received {}; stopping all ranks", signal.as_str())),
            "stderr: {err}"
        );
        for rank in 0..2 {
            assert_gone(read_pid(dir.path(), &format!("p{rank}")));
        }
    });
}

#[test]
fn sigint_gives_130() {
    signal_launcher(Signal::SIGINT, 130);
}

#[test]
fn sigterm_gives_143() {
    signal_launcher(Signal::SIGTERM, 143);
}

#[test]
fn sighup_gives_129() {
    signal_launcher(Signal::SIGHUP, 129);
}

#[test]
fn sigint_kills_ranks_that_ignore_sigterm_after_grace() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "trap '' TERM; {}; sleep 30 & echo $! > \"$T/g$HCOMM_RANK.tmp\"; \
             mv \"$T/g$HCOMM_RANK.tmp\" \"$T/g$HCOMM_RANK\"; wait",
            write_pid("p$HCOMM_RANK")
        );
        let child = start(2, 800, &script, dir.path());
        for rank in 0..2 {
            wait_for_file(dir.path(), &format!("g{rank}"), Duration::from_secs(10));
        }
        let started = Instant::now();
        kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
        let (code, err) = finish(child, Duration::from_secs(10));
        let took = started.elapsed();
        assert_eq!(code, 130, "stderr: {err}");
        assert!(
            took >= Duration::from_millis(800),
            "SIGKILL came early: {took:?}"
        );
        for rank in 0..2 {
            assert_gone(read_pid(dir.path(), &format!("p{rank}")));
            assert_gone(read_pid(dir.path(), &format!("g{rank}")));
        }
    });
}

#[test]
fn a_second_signal_kills_at_once() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let script = format!("trap '' TERM; {}; sleep 30", write_pid("p$HCOMM_RANK"));
        let child = start(1, 20_000, &script, dir.path());
        wait_for_file(dir.path(), "p0", Duration::from_secs(10));
        let launcher = Pid::from_raw(child.id() as i32);
        kill(launcher, Signal::SIGINT).unwrap();
        thread::sleep(Duration::from_millis(200));
        kill(launcher, Signal::SIGINT).unwrap();
        let (code, err) = finish(child, Duration::from_secs(10));
        assert_eq!(code, 130, "stderr: {err}");
        assert!(err.contains("killing all ranks"), "stderr: {err}");
        assert_gone(read_pid(dir.path(), "p0"));
    });
}
