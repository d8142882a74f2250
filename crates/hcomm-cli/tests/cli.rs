//! The `hcomm` binary as a user runs it: demo, check and bench under the launcher, each run
//! bounded in time.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run `hcomm ARGS` and return (exit code, stdout, stderr); kill it after `limit`.
fn hcomm(args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hcomm"))
        .args(args)
        .env_remove("HCOMM_RANK")
        .env_remove("RANK")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        out.read_to_string(&mut s).unwrap();
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        err.read_to_string(&mut s).unwrap();
        s
    });
    let start = Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("hcomm {args:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (code, t_out.join().unwrap(), t_err.join().unwrap())
}

#[test]
fn demo_shows_every_primitive_correct_at_4_ranks() {
    let (code, out, err) = hcomm(
        &["demo", "-n", "4", "--size", "1048576"],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("13 of 13 primitives correct"), "{out}");
    for name in [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all_to_all",
        "barrier",
        "send/recv",
        "signal/wait",
    ] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(name) && l.trim_end().ends_with("yes")),
            "{name} missing or wrong:\n{out}"
        );
    }
}

#[test]
fn check_under_the_launcher_with_3_ranks() {
    let exe = env!("CARGO_BIN_EXE_hcomm");
    let (code, out, err) = hcomm(
        &["run", "-n", "3", "--", exe, "check", "--quick"],
        Duration::from_secs(300),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("0 failed"), "{out}");
}

#[test]
fn check_with_np_starts_its_own_ranks() {
    let (code, out, err) = hcomm(
        &[
            "check",
            "-np",
            "2",
            "--colls",
            "allreduce,broadcast",
            "--dtypes",
            "f16,u8",
            "--counts",
            "0,5,4099",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("hcomm check: 2 ranks") && out.contains("0 failed"),
        "{out}"
    );
}

#[test]
fn bench_prints_the_nccl_tests_columns_and_json() {
    let (code, out, err) = hcomm(
        &[
            "bench",
            "allreduce",
            "-np",
            "2",
            "-b",
            "8",
            "-e",
            "1M",
            "-f",
            "8",
            "-n",
            "5",
            "-w",
            "1",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("time")
            && out.contains("algbw")
            && out.contains("busbw")
            && out.contains("#wrong"),
        "{out}"
    );
    assert!(out.contains("Avg bus bandwidth"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 7, "sizes 8, 64, 512, 4K, 32K, 256K, 1M: {out}");
    let (code, out, err) = hcomm(
        &[
            "bench", "sendrecv", "-np", "2", "-b", "1K", "-e", "128K", "-f", "4", "-n", "5",
            "--json",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    for line in out.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        for key in [
            "op",
            "ranks",
            "bytes",
            "count",
            "dtype",
            "redop",
            "algo",
            "transport",
            "time_us",
            "algbw",
            "busbw",
            "wrong",
        ] {
            assert!(v.get(key).is_some(), "{key} missing in {line}");
        }
        assert_eq!(v["wrong"], 0, "{line}");
    }
}

#[test]
fn run_propagates_the_exit_code_of_a_failing_rank() {
    let (code, _, err) = hcomm(
        &[
            "run",
            "-n",
            "3",
            "--",
            "sh",
            "-c",
            "if [ $HCOMM_RANK = 1 ]; then exit 7; fi; sleep 30",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(7), "{err}");
    assert!(err.contains("rank 1 exited with code 7"), "{err}");
}

#[test]
fn bad_input_is_rejected_with_a_message() {
    let (code, _, err) = hcomm(
        &["bench", "allreduce", "-np", "2", "-d", "complex"],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("unknown dtype 'complex'"), "{err}");
    let (code, _, err) = hcomm(&["bench", "allrdc", "-np", "2"], Duration::from_secs(30));
    assert_eq!(code, Some(2));
    assert!(err.contains("unknown operation"), "{err}");
}
