//! The `hcomm` binary as a user runs it: demo, check and bench under the launcher, each run
//! bounded in time.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run `hcomm ARGS` and return (exit code, stdout, stderr); kill it after `limit`.
fn hcomm(args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
    hcomm_env(args, &[], limit)
}

/// As [`hcomm`], with extra environment (launcher variables are cleared first).
fn hcomm_env(
    args: &[&str],
    env: &[(&str, String)],
    limit: Duration,
) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hcomm"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in [
        "HCOMM_RANK",
        "HCOMM_WORLD_SIZE",
        "RANK",
        "WORLD_SIZE",
        "HCOMM_MASTER_PORT",
        "MASTER_PORT",
        "HCOMM_MASTER_ADDR",
        "MASTER_ADDR",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
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
fn deterministic_check_on_one_host() {
    // The sweep the namespace-cluster test runs on 2 hosts x 2 and 4 hosts x 1, here on one
    // host of 4 (shared memory) and over TCP: each result bitwise the rank-order fold.
    for transport in ["auto", "tcp"] {
        let (code, out, err) = hcomm_env(
            &[
                "check",
                "-np",
                "4",
                "--deterministic",
                "--ops",
                "sum,mean,max",
                "--counts",
                "0,7,1031,600000",
                "--algos",
                "hierarchical,ring,chain",
                "--seed",
                "5",
            ],
            &[("HCOMM_TRANSPORT", transport.into())],
            Duration::from_secs(300),
        );
        assert_eq!(code, Some(0), "{transport}: {out}\n{err}");
        assert!(
            out.contains("hcomm check: 4 ranks, deterministic") && out.contains(" 0 failed"),
            "{transport}: {out}"
        );
    }
}

#[test]
fn deterministic_check_catches_an_injected_wrong_result() {
    let (code, _out, err) = hcomm_env(
        &[
            "check",
            "-np",
            "3",
            "--deterministic",
            "--colls",
            "allreduce",
            "--dtypes",
            "f32",
            "--ops",
            "sum",
            "--counts",
            "100000",
        ],
        &[("HCOMM_FAULT_INJECT", "corrupt-one".into())],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("wrong element")
            && err.contains("reproduce: hcomm check -np 3 --deterministic"),
        "{err}"
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
fn bench_compression_measures_every_compressor() {
    let (code, out, err) = hcomm(
        &[
            "bench",
            "compression",
            "-np",
            "2",
            "--transport",
            "tcp",
            "--size",
            "1M",
            "--steps",
            "2",
            "--compressors",
            "none,int8,topk:1%",
            "--json",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(rows.len(), 3, "{out}");
    let sent = |i: usize| rows[i]["wire_bytes_sent"].as_f64().unwrap();
    // 2 ranks, ring: each rank sends the 1 MiB vector once (plus headers).
    assert!((1048576.0..1060000.0).contains(&sent(0)), "{out}");
    assert!(sent(1) < sent(0) / 3.5 && sent(2) < sent(0) / 10.0, "{out}");
    assert_eq!(rows[0]["rel_l2_error"].as_f64().unwrap(), 0.0, "{out}");
    assert!(rows[1]["rel_l2_error"].as_f64().unwrap() < 0.01, "{out}");
    for r in &rows {
        assert_eq!(r["transport"], "tcp");
        assert!(r["ms_per_call"].as_f64().unwrap() > 0.0);
        // every byte went over TCP
        assert_eq!(r["tcp_bytes_sent"], r["wire_bytes_sent"], "{out}");
    }
    let (code, _, err) = hcomm(
        &[
            "bench",
            "compression",
            "-np",
            "2",
            "--compressors",
            "int8:0",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("block size 0"), "{err}");
    // --algo applies to the all-reduce the compressors are built on (it was ignored)
    let (code, _, err) = hcomm(
        &["bench", "compression", "-np", "2", "--algo", "bogus"],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("--algo: unknown algorithm 'bogus'"), "{err}");
    let (code, out, err) = hcomm(
        &[
            "bench",
            "compression",
            "-np",
            "2",
            "--size",
            "64K",
            "--steps",
            "1",
            "--compressors",
            "none",
            "--algo",
            "rd",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
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
fn run_keep_going_lets_the_others_finish_when_a_rank_is_killed() {
    // Rank 1 is killed by a signal; with --keep-going the others run to their end (and their
    // exit code decides), without it they are stopped and the job fails with 128 + 9.
    let script = "if [ $HCOMM_RANK = 1 ]; then kill -9 $$; fi; sleep 1; echo finished $HCOMM_RANK";
    let (code, out, err) = hcomm(
        &["run", "--keep-going", "-n", "3", "--", "sh", "-c", script],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        err.contains("rank 1 was killed by signal SIGKILL; the others go on"),
        "{err}"
    );
    assert!(
        out.contains("finished 0") && out.contains("finished 2"),
        "{out}"
    );
    let (code, out, _) = hcomm(
        &["run", "-n", "3", "--", "sh", "-c", script],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(137), "{out}");
    assert!(!out.contains("finished"), "{out}");
}

#[test]
fn bench_noise_runs_busy_processes_beside_the_ranks_and_says_so() {
    let (code, out, err) = hcomm(
        &[
            "bench",
            "allreduce",
            "--np",
            "2",
            "-b",
            "1K",
            "-e",
            "64K",
            "-f",
            "8",
            "--noise",
            "2",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("# conditions: 2 busy process(es) beside the ranks (--noise), ")
            && out.contains("just before the run"),
        "{out}"
    );
    // The driver took its busy processes with it.
    let left = std::process::Command::new("pgrep")
        .args(["-f", "hcomm spin"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    assert!(left.is_empty(), "busy processes left: {left}");
    let (code, _, err) = hcomm(
        &["bench", "allreduce", "--noise", "1"],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--noise needs --np"), "{err}");
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
    for (args, want) in [
        (
            &["bench", "allreduce", "-np", "2", "-b", "3", "-e", "3"][..],
            "-b 3: not a whole number of float elements (4 bytes each)",
        ),
        (
            &["bench", "allreduce", "-np", "2", "-b", "64K", "-e", "1K"][..],
            "-e 1024 is below -b 65536",
        ),
        (
            &[
                "bench",
                "allreduce",
                "-np",
                "2",
                "--plot",
                "/nonexistent/p.svg",
            ][..],
            "--plot /nonexistent/p.svg: the folder /nonexistent does not exist",
        ),
        (
            &["demo", "-n", "2", "--size", "3"][..],
            "--size 3: the timed rows move float32 elements",
        ),
        (
            &["bench", "allreduce", "-np", "2", "-n", "0"][..],
            "-n 0: at least one timed iteration",
        ),
        (
            &[
                "bench",
                "allreduce",
                "-np",
                "2",
                "-b",
                "8",
                "-e",
                "64",
                "-f",
                "1",
            ][..],
            "-f 1: the size factor must be at least 2",
        ),
        (
            &["bench", "allreduce", "-np", "2", "--reps", "0"][..],
            "--reps 0: at least one timed repeat",
        ),
        (
            &["bench", "sendrecv", "-np", "1"][..],
            "sendrecv needs at least 2 ranks",
        ),
        (
            &["bench", "allreduce", "-np", "2", "-r", "2"][..],
            "root 2 is out of range for 2 ranks",
        ),
        (
            &["bench", "allreduce", "-np", "2", "-o", "xor"][..],
            "unknown reduce op 'xor'",
        ),
        (
            &["run", "--port", "0", "-n", "1", "true"][..],
            "0 is not in 1..=65535",
        ),
    ] {
        let (code, _, err) = hcomm(args, Duration::from_secs(30));
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        // Said once, by the driver, before any rank started.
        if args[0] == "bench" {
            assert_eq!(err.matches(want).count(), 1, "{args:?}: {err}");
        }
    }
}

#[test]
fn bench_accepts_np_with_an_equals_sign_and_fails_when_an_output_cannot_be_written() {
    // One 8-byte all-reduce, two timed calls, on two ranks (`np`), then `more`.
    let bench = |np: &[&str], more: &[&str]| {
        let base = [
            "bench",
            "allreduce",
            "-b",
            "8",
            "-e",
            "8",
            "-n",
            "2",
            "-w",
            "1",
        ];
        let args: Vec<&str> = base.iter().chain(np).chain(more).copied().collect();
        hcomm(&args, Duration::from_secs(60))
    };
    let (code, out, err) = bench(&["-np=2"], &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("Out of bounds values : 0 OK"), "{out}");
    // The folder exists but the file cannot be made there: the run measures, then fails.
    let (code, _, err) = bench(&["--np", "2"], &["--results", "/proc/hcomm-results.jsonl"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot update /proc/hcomm-results.jsonl"),
        "{err}"
    );
}

#[test]
fn check_catches_an_injected_wrong_result() {
    let (code, out, err) = hcomm_env(
        &[
            "check",
            "-np",
            "2",
            "--colls",
            "allreduce,allgather,broadcast",
            "--dtypes",
            "f32",
            "--counts",
            "1,1031",
        ],
        &[("HCOMM_FAULT_INJECT", "corrupt-one".into())],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        err.contains("FAIL rank 1 of 2")
            && err.contains("wrong element")
            && err.contains("reproduce: hcomm check"),
        "{err}"
    );
    // The same sweep without the fault passes.
    let (code, out, err) = hcomm_env(
        &[
            "check",
            "-np",
            "2",
            "--colls",
            "allreduce,allgather,broadcast",
            "--dtypes",
            "f32",
            "--counts",
            "1,1031",
        ],
        &[],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
}

#[test]
fn bench_check_counts_wrong_elements_under_fault_injection() {
    let (code, out, _) = hcomm_env(
        &[
            "bench",
            "allreduce",
            "-np",
            "2",
            "-b",
            "1K",
            "-e",
            "1K",
            "-n",
            "2",
        ],
        &[("HCOMM_FAULT_INJECT", "corrupt-one".into())],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("FAILED"), "{out}");
}

#[test]
fn bench_writes_a_valid_svg_plot() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("ar.svg");
    let hist = dir.path().join("hist.jsonl");
    let p = plot.to_str().unwrap();
    let h = hist.to_str().unwrap();
    for _ in 0..2 {
        let (code, out, err) = hcomm(
            &[
                "bench",
                "allgather",
                "-np",
                "2",
                "-b",
                "64",
                "-e",
                "64K",
                "-f",
                "16",
                "-n",
                "3",
                "--plot",
                p,
                "--results",
                h,
            ],
            Duration::from_secs(60),
        );
        assert_eq!(code, Some(0), "{out}\n{err}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>") && svg.contains("<polyline"),
        "{svg}"
    );
    // The history has both runs; the second run compared itself with the first.
    assert_eq!(std::fs::read_to_string(&hist).unwrap().lines().count(), 8);
    let (_, out, _) = hcomm(
        &[
            "bench",
            "allgather",
            "-np",
            "2",
            "-b",
            "64",
            "-e",
            "64",
            "-n",
            "3",
            "--results",
            h,
        ],
        Duration::from_secs(60),
    );
    // A comparison, or the reason there is none: the machine changed state (a VM's vCPUs
    // stopped or started sharing a cache) between or during the runs.
    assert!(
        out.contains("last time") || out.contains(": no verdict: "),
        "{out}"
    );
}

#[test]
fn doctor_reports_a_busy_port_with_its_owner() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (code, out, err) = hcomm(
        &["doctor", "--master", &format!("127.0.0.1:{port}")],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        out.contains(&format!(
            "port {port} is in use by pid {}",
            std::process::id()
        )),
        "{out}"
    );
}

#[test]
fn doctor_reports_a_bad_rank_table_by_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hcom_config.json");
    std::fs::write(
        &path,
        r#"{"version": "1.0", "world_size": 2, "master": {"addr": "127.0.0.1", "port": 29500},
            "ranks": [{"rank": 0, "host": "127.0.0.1", "local_rank": 0}, {"rank": 0, "host": "127.0.0.1", "local_rank": 1}]}"#,
    )
    .unwrap();
    let (code, out, err) = hcomm(
        &["doctor", "--rank-table", path.to_str().unwrap()],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        out.contains("ranks[1].rank") && out.contains("duplicate rank 0"),
        "{out}"
    );
}

#[test]
fn doctor_reports_an_unreachable_master() {
    let port = hcomm::bootstrap::free_master_port("127.0.0.1").unwrap();
    let env = [
        ("HCOMM_RANK", "1".to_string()),
        ("HCOMM_WORLD_SIZE", "2".to_string()),
        ("HCOMM_MASTER_ADDR", "127.0.0.1".to_string()),
        ("HCOMM_MASTER_PORT", port.to_string()),
    ];
    let (code, out, err) = hcomm_env(&["doctor"], &env, Duration::from_secs(30));
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        out.contains(&format!("rank 1 cannot reach 127.0.0.1:{port}")),
        "{out}"
    );
}

#[test]
fn doctor_measures_every_pair() {
    let (code, out, err) = hcomm(&["doctor", "-np", "3"], Duration::from_secs(120));
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(
        out.contains("latency, 8 B one way") && out.contains("bandwidth, 4 MiB"),
        "{out}"
    );
    assert!(
        out.contains("bootstrap")
            && out.contains("fd limit")
            && out.contains("/dev/shm")
            && out.contains("cross-core")
            && out.contains("a job token is set"),
        "{out}"
    );
}

#[test]
fn two_jobs_side_by_side_do_not_interfere() {
    let a =
        std::thread::spawn(|| hcomm(&["check", "-np", "2", "--quick"], Duration::from_secs(120)));
    let b = std::thread::spawn(|| {
        hcomm(
            &["check", "-np", "3", "--quick", "--algos", "shm,ring"],
            Duration::from_secs(120),
        )
    });
    for (code, out, err) in [a.join().unwrap(), b.join().unwrap()] {
        assert_eq!(code, Some(0), "{out}\n{err}");
        assert!(out.contains(" 0 failed"), "{out}");
    }
}

#[test]
fn bench_fusion_reports_every_mode() {
    let (code, out, err) = hcomm(
        &[
            "bench", "fusion", "-np", "2", "--scale", "0.01", "--steps", "1", "--caps", "1,25",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("199 tensors"), "{out}");
    for mode in [
        "per-tensor (blocking)",
        "fused, all packed",
        "fused (default)",
        "small only: fused",
        "compute only",
        "serial (compute, then fused)",
        "overlapped",
    ] {
        assert!(out.contains(mode), "missing {mode}: {out}");
    }
    let (code, out, err) = hcomm(
        &[
            "bench", "fusion", "-np", "2", "--scale", "0.01", "--steps", "1", "--caps", "4",
            "--json",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{err}");
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(rows.len(), 8, "{out}");
    assert!(rows
        .iter()
        .all(|r| r["ms_per_step"].as_f64().unwrap() > 0.0 || r["mode"] == "compute only"));
    let (code, _, err) = hcomm(
        &["bench", "fusion", "-np", "1", "--scale", "0"],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--scale"), "{err}");
}

#[test]
fn soak_runs_random_operations_against_the_reference() {
    for (np, transport, seed) in [("2", "auto", "21"), ("3", "tcp", "22"), ("4", "auto", "23")] {
        let (code, out, err) = hcomm_env(
            &[
                "check",
                "-np",
                np,
                "--soak",
                "600",
                "--seconds",
                "25",
                "--seed",
                seed,
            ],
            &[
                ("HCOMM_TIMEOUT", "60".to_string()),
                ("HCOMM_TRANSPORT", transport.to_string()),
            ],
            Duration::from_secs(150),
        );
        assert_eq!(code, Some(0), "{out}{err}");
        assert!(out.contains("0 wrong results"), "{out}");
    }
}

#[test]
fn simulate_predicts_every_algorithm_at_scale() {
    let (code, out, err) = hcomm(
        &[
            "simulate",
            "--hosts",
            "2048",
            "--ranks-per-host",
            "8",
            "--sizes",
            "1M,64M",
            "--json",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{err}");
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 8, "{out}");
    assert!(rows.iter().any(|r| r["algorithm"] == "hierarchical"));
    assert!(rows.iter().all(|r| r["seconds"].as_f64().unwrap() > 0.0));
    let (code, _, err) = hcomm(&["simulate", "--net-gbit", "0"], Duration::from_secs(30));
    assert_eq!(code, Some(2), "{err}");
}

#[test]
fn all_to_all_between_processes_over_shared_memory() {
    // 3 processes, blocks from empty to several staging pieces, against the reference
    let exe = env!("CARGO_BIN_EXE_hcomm");
    let (code, out, err) = hcomm(
        &[
            "run",
            "-n",
            "3",
            "--",
            exe,
            "check",
            "--colls",
            "all_to_all",
            "--dtypes",
            "float,int8",
            "--counts",
            "0,7,24000,300003",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("16 passed, 0 failed"), "{out}");
}

#[test]
fn simulate_calibrates_on_bench_rows() {
    // Rows as `hcomm run … hcomm bench allreduce --json` prints them, from α = 40 µs,
    // β = 10 Gbit/s and the default 8 GB/s reduction, 2 ranks.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ring.jsonl");
    let mut text = String::from("# a comment line\n");
    for bytes in [8u64, 4096, 1 << 20, 64 << 20] {
        let b = bytes as f64;
        let t = 2.0 * (40e-6 + b / (2.0 * 1.25e9)) + b / (2.0 * 8e9);
        text += &format!(
            "[0] {{\"op\":\"allreduce\",\"ranks\":2,\"bytes\":{bytes},\"algo\":\"ring\",\"time_us\":{}}}\n",
            t * 1e6
        );
    }
    std::fs::write(&path, text).unwrap();
    let p = path.to_str().unwrap();
    let (code, out, err) = hcomm(&["simulate", "--calibrate", p], Duration::from_secs(30));
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("alpha = 40.00 us") && out.contains("beta = 10.000 Gbit/s"),
        "{out}"
    );
    assert_eq!(
        out.lines().filter(|l| l.ends_with("0.0%")).count(),
        4,
        "{out}"
    );
    let (code, out, err) = hcomm(
        &["simulate", "--calibrate", p, "--json"],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(
        (v["net_latency_us"].as_f64().unwrap() - 40.0).abs() < 1e-6,
        "{v}"
    );
    assert_eq!(v["rows"].as_array().unwrap().len(), 4);
    // Nothing to fit: a clear error.
    std::fs::write(&path, "not a bench row\n").unwrap();
    let (code, _, err) = hcomm(&["simulate", "--calibrate", p], Duration::from_secs(30));
    assert_eq!(code, Some(2));
    assert!(err.contains("--algo ring"), "{err}");
}

#[test]
fn hcomm_trace_writes_one_file_per_rank_that_merge_and_summary_read() {
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces");
    let t = traces.to_str().unwrap().to_string();
    let (code, out, err) = hcomm_env(
        &[
            "bench",
            "allreduce",
            "-np",
            "2",
            "-b",
            "8",
            "-e",
            "1K",
            "-f",
            "128",
            "-n",
            "3",
            "-w",
            "1",
        ],
        &[("HCOMM_TRACE", t.clone())],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{out}\n{err}");
    let (code, out, err) = hcomm(&["trace", "summary", &t], Duration::from_secs(20));
    assert_eq!(code, Some(0), "{err}");
    for rank in ["0", "1"] {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(rank) && l.contains("all_reduce"))
            .unwrap_or_else(|| panic!("no all_reduce row of rank {rank}: {out}"));
        // Warm-up, timed calls and the check of two sizes: at least 2 × (1 + 3) calls.
        let cells: Vec<&str> = row.split_whitespace().collect();
        let op = cells.iter().position(|c| *c == "all_reduce").unwrap();
        let calls: u64 = cells[op + 1].parse().unwrap();
        assert!(calls >= 8, "{row}");
    }
    let merged = dir.path().join("merged.json");
    let (code, _, err) = hcomm(
        &["trace", "merge", &t, "-o", merged.to_str().unwrap()],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&merged).unwrap()).unwrap();
    let pids: std::collections::BTreeSet<u64> = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(pids.into_iter().collect::<Vec<_>>(), [0, 1]);
    let svg = dir.path().join("timeline.svg");
    let (code, _, err) = hcomm(
        &[
            "trace",
            "timeline",
            &t,
            "-o",
            svg.to_str().unwrap(),
            "--from-ms",
            "0",
        ],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{err}");
    let pic = std::fs::read_to_string(&svg).unwrap();
    assert!(
        pic.starts_with("<svg") && pic.contains("rank 1 · world"),
        "{pic}"
    );
    // A folder without traces is an error that says what was expected.
    let (code, _, err) = hcomm(
        &["trace", "summary", dir.path().to_str().unwrap()],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(2));
    assert!(err.contains("hcomm-trace-rank"), "{err}");
}

#[test]
fn the_bench_guard_compares_each_case_with_its_last_run() {
    // Two small runs of scripts/bench-guard.sh (2 cases: 8 B and 4 KiB, 2 ranks, shared
    // memory, quiet): the first records, the second prints a verdict per case.
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("guard.jsonl");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/bench-guard.sh");
    let run = || {
        let out = Command::new("timeout")
            .args(["120", "bash", script])
            .env("HCOMM_BIN", env!("CARGO_BIN_EXE_hcomm"))
            .env("RESULTS", &results)
            .env("RANKS", "2")
            .env("TRANSPORTS", "shm")
            .env("NOISE", "0")
            .env("SIZES", "8,4k")
            .env("TARGET", "0.002")
            .env("REPS", "3")
            .env_remove("HCOMM_RANK")
            .env_remove("HCOMM_WORLD_SIZE")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let first = run();
    assert_eq!(first.matches("(first run recorded)").count(), 2, "{first}");
    let second = run();
    // One line per case: a comparison with the last run, or (when the VM's vCPUs changed
    // cache state between the runs or during one) the reason it gives no verdict.
    let verdicts = second
        .lines()
        .filter(|l| l.contains(" last time ") || l.contains(": no verdict: "))
        .count();
    assert_eq!(verdicts, 2, "{second}");
    assert!(second.contains("# guard: "), "{second}");
    let rows = std::fs::read_to_string(&results).unwrap();
    assert_eq!(rows.lines().count(), 4);
    assert!(
        rows.lines()
            .all(|l| l.contains("\"noise\":0") && l.contains("time_us_max")),
        "{rows}"
    );
}

/// Command-line and configuration mistakes found by a wrong-input campaign (2026-12-07): each
/// is refused with a message that names it, never run as something else, ignored or a panic.
#[test]
fn launcher_and_tool_mistakes_are_refused_by_name() {
    let t = Duration::from_secs(30);
    for (args, want) in [
        // an option `hcomm run` does not know used to be started as the program
        (
            &["run", "--bogus", "--", "true"][..],
            "unknown option '--bogus'",
        ),
        (
            &[
                "run",
                "-n",
                "1",
                "--port",
                "29500",
                "--master",
                "127.0.0.1:29600",
                "--",
                "true",
            ][..],
            "--port 29500 and --master 127.0.0.1:29600 name different ports",
        ),
        (
            &["run", "--master", ":29500", "--", "true"][..],
            "with a host and a port of 1-65535",
        ),
        (
            &["doctor", "--master", "127.0.0.1:0"][..],
            "with a host and a port of 1-65535",
        ),
        (
            // 2^32 x 2^32 ranks used to overflow, or abort allocating 96 GiB
            &[
                "simulate",
                "--hosts",
                "4294967296",
                "--ranks-per-host",
                "4294967296",
                "--sizes",
                "64M",
            ][..],
            "more than the 1048576 ranks it simulates",
        ),
        // nccl-tests' -c is 0 or 1; 2 used to be taken as "check"
        (
            &["bench", "allreduce", "-c", "2"][..],
            "invalid value '2' for '--check <CHECK>'",
        ),
    ] {
        let (code, out, err) = hcomm(args, t);
        assert_eq!(code, Some(2), "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // MPI's -np is -n for hcomm run (it used to become a program named --np).
    let (code, out, err) = hcomm(&["run", "-np", "2", "--", "true"], t);
    assert_eq!(code, Some(0), "{out}{err}");
    // A rendezvous named in the environment is replaced by the launcher's own, and it says so.
    let (code, out, err) = hcomm_env(
        &["run", "-n", "1", "--", "true"],
        &[("HCOMM_MASTER_PORT", "29999".to_string())],
        t,
    );
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        err.contains("HCOMM_MASTER_PORT=29999 in the environment is not used"),
        "{err}"
    );
    // A timeout past what the clock can count is a configuration error, not a panic.
    let (code, out, err) = hcomm_env(
        &[
            "bench", "barrier", "--np", "1", "-b", "8", "-e", "8", "-n", "2", "-w", "0",
        ],
        &[("HCOMM_TIMEOUT", "18446744073709551615".to_string())],
        t,
    );
    assert_ne!(code, Some(0), "{out}{err}");
    assert!(
        err.contains("too large") && !err.contains("panicked"),
        "{err}"
    );
    // HCOMM_DEBUG: empty is unset; a value that is no level is said, not taken for `info`.
    let bench = [
        "bench",
        "allreduce",
        "--np",
        "1",
        "-b",
        "8",
        "-e",
        "8",
        "-n",
        "2",
        "-w",
        "0",
    ];
    for (value, said) in [("", false), ("loud", true)] {
        let (code, out, err) = hcomm_env(&bench, &[("HCOMM_DEBUG", value.to_string())], t);
        assert_eq!(code, Some(0), "{out}{err}");
        assert!(!err.contains("INFO"), "HCOMM_DEBUG={value:?}: {err}");
        assert_eq!(
            err.contains("is not a log level"),
            said,
            "HCOMM_DEBUG={value:?}: {err}"
        );
    }
}
