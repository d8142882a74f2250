//! Real processes: the test binary re-executes itself once per rank (with `HCOMM_TEST_WORKER`
//! set, the test body runs as a rank instead of as the driver). Covers bootstrap from each
//! launcher's variables and from a rank table, and a rank killed mid-job.

mod common;

use common::{assert_all_ok, is_worker, rank_env, spawn, wait_all};
use std::process::Child;
use std::time::{Duration, Instant};

use hcomm::{Communicator, Error, ReduceOp};

fn free_port() -> u16 {
    hcomm::testing::free_port()
}

/// The worker side of the bootstrap tests: join from the environment, check the identity
/// against `EXPECT_*`, run an all-reduce and a split.
fn bootstrap_worker() {
    let comm = Communicator::from_env().unwrap_or_else(|e| panic!("bootstrap failed: {e}"));
    let want = |k: &str| std::env::var(k).ok().map(|v| v.parse::<usize>().unwrap());
    assert_eq!(Some(comm.rank()), want("EXPECT_RANK"));
    assert_eq!(Some(comm.world_size()), want("EXPECT_SIZE"));
    if let Some(l) = want("EXPECT_LOCAL_RANK") {
        assert_eq!(comm.local_rank(), l);
    }
    let n = comm.world_size();
    let mut v = vec![comm.rank() as u64 + 1; 1000];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    assert!(v.iter().all(|&x| x == (n * (n + 1) / 2) as u64));
    println!("WORKER OK rank {} of {n}", comm.rank());
}

fn run_bootstrap(test: &str, n: usize, env: impl Fn(usize, u16) -> Vec<(&'static str, String)>) {
    let port = free_port();
    let kids = spawn(test, n, |r| {
        let mut e: Vec<(String, String)> = env(r, port)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        e.push(("EXPECT_RANK".into(), r.to_string()));
        e.push(("EXPECT_SIZE".into(), n.to_string()));
        e
    });
    assert_all_ok(&wait_all(kids, Duration::from_secs(60)));
}

#[test]
fn bootstrap_from_hcomm_variables() {
    if is_worker() {
        return bootstrap_worker();
    }
    run_bootstrap("bootstrap_from_hcomm_variables", 3, |r, port| {
        vec![
            ("HCOMM_RANK", r.to_string()),
            ("HCOMM_WORLD_SIZE", "3".into()),
            ("HCOMM_MASTER_ADDR", "127.0.0.1".into()),
            ("HCOMM_MASTER_PORT", port.to_string()),
            ("HCOMM_LOCAL_RANK", r.to_string()),
            ("EXPECT_LOCAL_RANK", r.to_string()),
        ]
    });
}

#[test]
fn bootstrap_from_torchrun_variables() {
    if is_worker() {
        return bootstrap_worker();
    }
    run_bootstrap("bootstrap_from_torchrun_variables", 3, |r, port| {
        vec![
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "3".into()),
            ("LOCAL_RANK", r.to_string()),
            ("LOCAL_WORLD_SIZE", "3".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
        ]
    });
}

#[test]
fn bootstrap_from_open_mpi_variables() {
    if is_worker() {
        return bootstrap_worker();
    }
    run_bootstrap("bootstrap_from_open_mpi_variables", 2, |r, port| {
        vec![
            ("OMPI_COMM_WORLD_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "2".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
            ("HCOMM_MASTER_PORT", port.to_string()),
        ]
    });
}

#[test]
fn bootstrap_from_pmi_variables() {
    if is_worker() {
        return bootstrap_worker();
    }
    run_bootstrap("bootstrap_from_pmi_variables", 2, |r, port| {
        vec![
            ("PMI_RANK", r.to_string()),
            ("PMI_SIZE", "2".into()),
            ("MPI_LOCALRANKID", r.to_string()),
            ("MPI_LOCALNRANKS", "2".into()),
            ("MASTER_PORT", port.to_string()),
        ]
    });
}

#[test]
fn bootstrap_from_slurm_variables() {
    if is_worker() {
        return bootstrap_worker();
    }
    run_bootstrap("bootstrap_from_slurm_variables", 3, |r, port| {
        vec![
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", "3".into()),
            ("SLURM_LOCALID", r.to_string()),
            ("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1".into()),
            ("HCOMM_MASTER_PORT", port.to_string()),
        ]
    });
}

#[test]
fn bootstrap_from_a_rank_table() {
    if is_worker() {
        return bootstrap_worker();
    }
    let dir = std::env::temp_dir().join(format!("hcomm-ranktable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("hcom_config.json");
    let port = free_port();
    let table = serde_json::json!({
        "version": "1.0",
        "world_size": 3,
        "master": {"addr": "127.0.0.1", "port": port},
        "timeout_s": 30,
        "ranks": (0..3).map(|r| serde_json::json!({"rank": r, "host": "127.0.0.1", "local_rank": r, "host_id": "node-a"})).collect::<Vec<_>>(),
    });
    std::fs::write(&path, table.to_string()).unwrap();
    let p = path.display().to_string();
    let kids = spawn("bootstrap_from_a_rank_table", 3, |r| {
        vec![
            ("HCOMM_RANK_TABLE".into(), p.clone()),
            ("RANK".into(), r.to_string()),
            ("EXPECT_RANK".into(), r.to_string()),
            ("EXPECT_SIZE".into(), "3".into()),
            ("EXPECT_LOCAL_RANK".into(), r.to_string()),
        ]
    });
    let res = wait_all(kids, Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&dir);
    assert_all_ok(&res);
}

/// The worker of the tests whose ranks must fail to join: prints `ERROR: <why>`.
fn failing_bootstrap_worker() {
    let e = Communicator::from_env().expect_err("bootstrap must fail");
    println!("ERROR: {e}");
}

#[test]
fn bootstrap_errors_name_the_problem() {
    if is_worker() {
        return failing_bootstrap_worker();
    }
    let cases: Vec<(Vec<(&str, String)>, &str)> = vec![
        (vec![], "HCOMM_RANK"),
        (
            vec![("HCOMM_RANK", "x".into()), ("HCOMM_WORLD_SIZE", "2".into())],
            "HCOMM_RANK=x",
        ),
        (
            vec![("HCOMM_RANK", "2".into()), ("HCOMM_WORLD_SIZE", "2".into())],
            "out of range",
        ),
        (vec![("RANK", "0".into())], "WORLD_SIZE"),
        (
            vec![
                ("HCOMM_RANK_TABLE", "/nonexistent/hcom_config.json".into()),
                ("RANK", "0".into()),
            ],
            "/nonexistent/hcom_config.json",
        ),
        // Rank 1 of 2 with nobody at the master: unreachable store within the timeout.
        (
            vec![
                ("HCOMM_RANK", "1".into()),
                ("HCOMM_WORLD_SIZE", "2".into()),
                ("HCOMM_MASTER_ADDR", "127.0.0.1".into()),
                ("HCOMM_MASTER_PORT", free_port().to_string()),
                ("HCOMM_TIMEOUT", "1s".into()),
            ],
            "cannot reach the rendezvous store",
        ),
    ];
    for (env, want) in cases {
        let env2: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let kids = spawn("bootstrap_errors_name_the_problem", 1, |_| env2.clone());
        let (code, out) = wait_all(kids, Duration::from_secs(30)).remove(0);
        assert_eq!(code, Some(0), "{out}");
        let line = out
            .lines()
            .find_map(|l| l.split_once("ERROR:").map(|x| x.1))
            .unwrap_or_else(|| panic!("no error line for {env:?}:\n{out}"));
        assert!(
            line.contains(want),
            "env {env:?}: expected '{want}' in: {line}"
        );
        // Before failing, a rank that cannot reach the store says once (on stderr) that it
        // keeps trying, and what it runs into (here after half of its 1 s timeout).
        if want.contains("rendezvous") {
            let notices = out
                .matches("still cannot reach the rendezvous store at 127.0.0.1:")
                .count();
            assert_eq!(notices, 1, "{out}");
            assert!(
                out.contains("retrying until the timeout (1 s, HCOMM_TIMEOUT)"),
                "{out}"
            );
        }
    }
}

/// A rank whose first attempt to join failed after reaching the store (here: a network
/// interface that does not exist) can try again in the same job, while rank 0 still waits
/// for it.
#[test]
fn a_rank_can_try_joining_again_after_a_failed_attempt() {
    let port = free_port();
    let config = |rank: usize, extra: &[(&str, &str)]| {
        let mut vars: std::collections::HashMap<String, String> =
            rank_env(rank, 2, port).into_iter().collect();
        vars.insert("HCOMM_TIMEOUT".into(), "20s".into());
        for (k, v) in extra {
            vars.insert(k.to_string(), v.to_string());
        }
        hcomm::BootstrapConfig::from_vars(|k| vars.get(k).cloned()).unwrap()
    };
    let (first, second, zero) = std::thread::scope(|s| {
        let zero = s.spawn(|| Communicator::from_config(&config(0, &[])));
        let first = Communicator::from_config(&config(1, &[("HCOMM_SOCKET_IFNAME", "nosuchif0")]));
        let second = Communicator::from_config(&config(1, &[]));
        (first, second, zero.join().unwrap())
    });
    let e = first.expect_err("the first attempt names a missing interface");
    assert!(e.to_string().contains("nosuchif0"), "{e}");
    let (one, zero) = (second.unwrap(), zero.unwrap());
    let mut v = [1u32; 4];
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut w = [2u32; 4];
            zero.all_reduce_in_place(&mut w, ReduceOp::Sum).unwrap();
            assert_eq!(w, [3; 4]);
        });
        one.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    });
    assert_eq!(v, [3; 4]);
}

/// Ranks started with different world sizes (either one larger) all fail with an error that
/// says so, instead of some of them waiting out the timeout.
#[test]
fn ranks_started_with_different_world_sizes_fail_saying_so() {
    const TEST: &str = "ranks_started_with_different_world_sizes_fail_saying_so";
    if is_worker() {
        return failing_bootstrap_worker();
    }
    for sizes in [[2, 3], [3, 2]] {
        let port = free_port();
        let kids = spawn(TEST, 2, |r| {
            let mut e = rank_env(r, sizes[r], port);
            // Long enough that a rank left waiting would name the timeout, not the sizes.
            e.push(("HCOMM_TIMEOUT".into(), "30s".into()));
            e
        });
        let res = wait_all(kids, Duration::from_secs(60));
        for (r, (code, out)) in res.iter().enumerate() {
            assert_eq!(*code, Some(0), "sizes {sizes:?}: rank {r}:\n{out}");
            assert!(
                out.contains("the world size differs between ranks: rank 0 was started with"),
                "sizes {sizes:?}: rank {r}:\n{}",
                every_output(&res)
            );
        }
    }
}

/// Two ranks of four start: rank 0's timeout names both missing ranks.
#[test]
fn a_bootstrap_timeout_names_every_missing_rank() {
    const TEST: &str = "a_bootstrap_timeout_names_every_missing_rank";
    if is_worker() {
        return failing_bootstrap_worker();
    }
    let port = free_port();
    let kids = spawn(TEST, 2, |r| {
        let mut e = rank_env(r, 4, port);
        e.push(("HCOMM_TIMEOUT".into(), "2s".into()));
        e
    });
    let res = wait_all(kids, Duration::from_secs(60));
    assert!(
        res[0].1.contains("waiting for rank(s) [2, 3]")
            && res[0]
                .1
                .contains("ranks 2, 3 never joined communicator 'world' (4 ranks expected)"),
        "{}",
        every_output(&res)
    );
    // Before the timeout, each rank said once (on stderr, after half of its 2 s) whom it waits for.
    let told = |r: usize, what: &str| res[r].1.matches(what).count() == 1;
    assert!(
        told(0, "hcomm: rank 0 has waited ")
            && told(
                0,
                "for rank(s) [2, 3] to join communicator 'world' (4 ranks expected)"
            )
            && told(1, "hcomm: rank 1 has waited ")
            && told(1, "from rank 0, which waits for rank(s) [2, 3] to join"),
        "{}",
        every_output(&res)
    );
}

/// How a survivor's error names the cause: `PeerClosed(p)`, `Timeout([p..])`, or
/// `Remote(r blames c)` when another rank told it.
fn blame(err: &Error) -> String {
    match err {
        Error::PeerClosed { peer, .. } => format!("PeerClosed({peer})"),
        Error::Timeout { peers, .. } => format!("Timeout({peers:?})"),
        Error::Remote { peer, culprit, .. } => format!("Remote({peer} blames {culprit:?})"),
        other => format!("Other({other})"),
    }
}

/// True if the survivor's line names rank `r` as the cause.
/// Each rank's exit status and output, for a failure message.
fn every_output(results: &[(Option<i32>, String)]) -> String {
    results
        .iter()
        .enumerate()
        .map(|(r, (code, out))| format!("--- rank {r} ({code:?}):\n{out}\n"))
        .collect()
}

/// The `SURVIVOR` line of a rank that exited cleanly (`what` names it; the test fails
/// otherwise).
fn survivor_line<'a>(what: &str, code: Option<i32>, out: &'a str) -> &'a str {
    assert_eq!(code, Some(0), "{what}:\n{out}");
    out.lines()
        .find_map(|l| l.split_once("SURVIVOR").map(|x| x.1))
        .unwrap_or_else(|| panic!("{what}:\n{out}"))
}

fn names(line: &str, r: usize) -> bool {
    (r == 0 && line.contains("rank 0, which hosts it, has probably exited"))
        || line.contains(&format!("PeerClosed({r})"))
        || line.contains(&format!("Timeout([{r}])"))
        || line.contains(&format!("blames Some({r}))"))
        || line.contains(&format!("the chain of waits ends at rank {r}"))
}

fn killed_rank_worker() {
    let comm = Communicator::from_env().unwrap();
    let mut v = vec![1f32; 200_000];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    if comm.rank() == 1 {
        // Die hard, without closing anything politely.
        nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL)
            .unwrap();
    }
    let start = Instant::now();
    let err = loop {
        if let Err(e) = comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
            break e;
        }
    };
    let kind = blame(&err);
    println!(
        "\nSURVIVOR {} shm={} failed after {:.1}s: {kind}: {err}",
        comm.rank(),
        comm.has_shared_memory(),
        start.elapsed().as_secs_f64()
    );
}

/// Kill rank 1 of 4 in the middle of all-reduces; every survivor must fail (naming a peer)
/// well within the run's bound, and no shared-memory segment may be left behind.
fn killed_rank(test: &str, transport: &str) -> Vec<String> {
    let port = free_port();
    let n = 4;
    let kids = spawn(test, n, |r| {
        [
            rank_env(r, n, port),
            vec![
                ("HCOMM_TIMEOUT".into(), "5s".into()),
                ("HCOMM_TRANSPORT".into(), transport.into()),
            ],
        ]
        .concat()
    });
    let rank0 = kids[0].id();
    let res = wait_all(kids, Duration::from_secs(60));
    let mut lines = Vec::new();
    for (r, (code, out)) in res.iter().enumerate() {
        if r == 1 {
            assert_eq!(*code, None, "rank 1 should have been killed:\n{out}");
            continue;
        }
        let line = survivor_line(&format!("rank {r}"), *code, out);
        // Every survivor names the dead rank: the ones next to it see it go, and they tell
        // the others (Error::Remote).
        assert!(names(line, 1), "rank {r}: {line}");
        lines.push(line.to_string());
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|f| f.contains(&format!("-{rank0}-")))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
    lines
}

#[test]
fn a_killed_rank_makes_every_survivor_fail_over_tcp() {
    if is_worker() {
        return killed_rank_worker();
    }
    killed_rank("a_killed_rank_makes_every_survivor_fail_over_tcp", "tcp");
}

#[test]
fn a_killed_rank_makes_every_survivor_fail_over_shared_memory() {
    if is_worker() {
        return killed_rank_worker();
    }
    let lines = killed_rank(
        "a_killed_rank_makes_every_survivor_fail_over_shared_memory",
        "shm",
    );
    for l in &lines {
        assert!(l.contains("shm=true"), "{l}");
    }
    // On shared memory the survivors notice by themselves (or are told first).
    assert!(lines.iter().all(|l| names(l, 1)), "{lines:?}");
}

fn stopped_rank_worker() {
    let comm = Communicator::from_env().unwrap();
    let mut v = vec![1f32; 50_000];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    if comm.rank() == 1 {
        // Stop (as a debugger, a swapped-out node or `kill -STOP` would): alive but silent.
        nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGSTOP)
            .unwrap();
    }
    let start = Instant::now();
    let err = loop {
        if let Err(e) = comm.all_reduce_in_place(&mut v, ReduceOp::Sum) {
            break e;
        }
    };
    let later = comm.barrier().unwrap_err();
    let kind = blame(&err);
    println!(
        "\nSURVIVOR {} shm={} failed after {:.1}s: {kind}: {err}; then: {}",
        comm.rank(),
        comm.has_shared_memory(),
        start.elapsed().as_secs_f64(),
        match later {
            Error::Poisoned { .. } => "poisoned",
            _ => "not poisoned",
        }
    );
}

/// Stop rank 1 of 4 with SIGSTOP between all-reduces: every survivor must time out within
/// the deadline (3 s here; the bound allows for an oversubscribed machine), log a hang report,
/// and fail fast afterwards. Rank 1 is killed once the survivors are done.
fn stopped_rank(test: &str, transport: &str) -> Vec<String> {
    let port = free_port();
    let n = 4;
    let mut kids = spawn(test, n, |r| {
        [
            rank_env(r, n, port),
            vec![
                ("HCOMM_TIMEOUT".into(), "3s".into()),
                ("HCOMM_TRANSPORT".into(), transport.into()),
                ("HCOMM_DEBUG".into(), "info".into()),
            ],
        ]
        .concat()
    });
    let mut stopped = kids.remove(1);
    let start = Instant::now();
    let res = wait_all(kids, Duration::from_secs(60));
    let took = start.elapsed();
    let _ = stopped.kill();
    let _ = stopped.wait();
    let mut lines = Vec::new();
    for (i, (code, out)) in res.iter().enumerate() {
        let r = if i == 0 { 0 } else { i + 1 };
        let line = survivor_line(&format!("rank {r}"), *code, out);
        // Every survivor times out (or is told by one that did) and names a rank it waited
        // for; the blame then passes along the chain of waits, and usually reaches rank 1 (the
        // callers check how far).
        assert!(
            line.contains("Timeout(") || line.contains("Remote("),
            "rank {r}: {line}"
        );
        assert!(line.contains("then: poisoned"), "rank {r}: {line}");
        let secs: f64 = line
            .split("failed after ")
            .nth(1)
            .and_then(|x| x.split('s').next())
            .and_then(|x| x.parse().ok())
            .unwrap();
        assert!(secs < 30.0, "rank {r} took {secs} s to fail (deadline 3 s)");
        if line.contains("Timeout") {
            assert!(
                out.contains("hang report from rank"),
                "rank {r}: no hang report:\n{out}"
            );
        }
        lines.push(line.to_string());
    }
    assert!(took < Duration::from_secs(60), "survivors took {took:?}");
    lines
}

#[test]
fn a_stopped_rank_makes_every_survivor_time_out_over_tcp() {
    if is_worker() {
        return stopped_rank_worker();
    }
    let lines = stopped_rank(
        "a_stopped_rank_makes_every_survivor_time_out_over_tcp",
        "tcp",
    );
    // Over TCP a rank waits only for its neighbours: the one waiting for rank 1 names it;
    // the others follow the blame for a grace period and mostly reach rank 1 too (not always:
    // a link with a half-sent frame cannot carry the notice, see `TcpLinks::send_abort`).
    assert!(lines.iter().any(|l| names(l, 1)), "{lines:?}");
}

#[test]
fn a_stopped_rank_makes_every_survivor_time_out_over_shared_memory() {
    if is_worker() {
        return stopped_rank_worker();
    }
    let lines = stopped_rank(
        "a_stopped_rank_makes_every_survivor_time_out_over_shared_memory",
        "shm",
    );
    // On shared memory every rank waits for every rank: all name the stopped one.
    assert!(lines.iter().all(|l| names(l, 1)), "{lines:?}");
}

#[test]
fn shared_memory_between_processes_is_zero_copy_and_outlives_its_owner_in_mappings_only() {
    if is_worker() {
        let comm = Communicator::from_env().unwrap();
        if comm.rank() == 0 {
            let shm = comm.alloc_shared(1 << 20).unwrap();
            shm.write(0, &vec![0x5a; 1 << 20]).unwrap();
            comm.signal(1, 1).unwrap();
            comm.wait_signal(1, 2).unwrap();
            let mut b = [0u8; 2];
            shm.read((1 << 20) - 2, &mut b).unwrap();
            assert_eq!(b, [1, 2]);
            drop(shm); // FreeSharedMemory
            comm.signal(1, 3).unwrap();
        } else {
            comm.wait_signal(0, 1).unwrap();
            let shm = comm.get_shared(0).unwrap();
            assert!(shm.path().starts_with("/proc/"));
            let mut all = vec![0u8; 1 << 20];
            shm.read(0, &mut all).unwrap();
            assert!(all.iter().all(|&x| x == 0x5a));
            // The file at path() holds the data from offset 0 (what torch.from_file maps).
            assert_eq!(shm.data_offset(), 0);
            let file = std::fs::read(shm.path()).unwrap();
            assert!(file.len() >= 1 << 20);
            assert!(file[..1 << 20].iter().all(|&x| x == 0x5a));
            shm.write((1 << 20) - 2, &[1, 2]).unwrap();
            comm.signal(0, 2).unwrap();
            comm.wait_signal(0, 3).unwrap();
            // The owner freed it; our mapping stays valid until we drop it.
            shm.read(0, &mut all[..4]).unwrap();
            assert_eq!(&all[..4], &[0x5a; 4]);
        }
        comm.barrier().unwrap();
        println!("WORKER OK rank {}", comm.rank());
        return;
    }
    let port = free_port();
    let before: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let kids = spawn(
        "shared_memory_between_processes_is_zero_copy_and_outlives_its_owner_in_mappings_only",
        2,
        |r| rank_env(r, 2, port),
    );
    // Segments of this job carry rank 0's pid (other tests running meanwhile make their own).
    let rank0 = format!("-{}-", kids[0].id());
    assert_all_ok(&wait_all(kids, Duration::from_secs(60)));
    let after: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let new: Vec<_> = after
        .iter()
        .filter(|f| !before.contains(f) && f.to_string_lossy().contains(&rank0))
        .collect();
    assert!(new.is_empty(), "left in /dev/shm: {new:?}");
}

/// One job of the kill matrix: every rank runs `HCOMM_TEST_COLL` over and over; rank
/// `HCOMM_TEST_VICTIM` SIGKILLs itself at its 4th call; survivors report how they failed.
fn kill_matrix_worker() {
    use hcomm::testing::{run_case, Case};
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            // The victim ran ahead and died while this rank was still joining.
            println!("\nSURVIVOR failed at bootstrap: {e}");
            return;
        }
    };
    let coll = hcomm::Collective::parse(&std::env::var("HCOMM_TEST_COLL").unwrap()).unwrap();
    let victim: usize = std::env::var("HCOMM_TEST_VICTIM").unwrap().parse().unwrap();
    let case = Case {
        coll,
        dtype: hcomm::DType::F32,
        op: ReduceOp::Sum,
        count: 5000,
        root: (victim + 1) % comm.world_size(),
        in_place: false,
        algo: hcomm::Algo::Auto,
        seed: 3,
        deterministic: false,
    };
    let start = Instant::now();
    let mut calls = 0;
    let err = loop {
        calls += 1;
        if calls == 4 && comm.rank() == victim {
            nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL)
                .unwrap();
        }
        match run_case(&comm, &case) {
            Ok(None) => {}
            Ok(Some(wrong)) => panic!("wrong result before the failure: {wrong}"),
            Err(e) => break e,
        }
    };
    println!(
        "\nSURVIVOR {} failed after {:.1}s: {}: {err}",
        comm.rank(),
        start.elapsed().as_secs_f64(),
        blame(&err)
    );
}

/// Kill each rank in turn during each collective, over TCP and shared memory: every survivor
/// fails (never hangs, never returns a wrong result) within the bound, at least one names the
/// dead rank (the others name a rank that failed because of it); nothing is left in /dev/shm.
#[test]
fn killing_each_rank_during_each_collective_fails_every_survivor_naming_it() {
    const TEST: &str = "killing_each_rank_during_each_collective_fails_every_survivor_naming_it";
    if is_worker() {
        return kill_matrix_worker();
    }
    let n = 3;
    let mut scenarios = 0;
    let mut survivors = 0;
    let mut named = 0;
    for transport in ["tcp", "shm"] {
        for coll in hcomm::Collective::ALL {
            // The three victims of one (transport, collective) run side by side.
            let jobs: Vec<(usize, Vec<Child>, u32)> = (0..n)
                .map(|victim| {
                    let port = free_port();
                    let kids = spawn(TEST, n, |r| {
                        [
                            rank_env(r, n, port),
                            vec![
                                ("HCOMM_TIMEOUT".into(), "5s".into()),
                                ("HCOMM_TRANSPORT".into(), transport.into()),
                                ("HCOMM_TEST_COLL".into(), coll.name().into()),
                                ("HCOMM_TEST_VICTIM".into(), victim.to_string()),
                            ],
                        ]
                        .concat()
                    });
                    let rank0 = kids[0].id();
                    (victim, kids, rank0)
                })
                .collect();
            for (victim, kids, rank0) in jobs {
                scenarios += 1;
                let mut named_here = 0;
                let what = format!("{transport} {} victim {victim}", coll.name());
                let results = wait_all(kids, Duration::from_secs(60));
                for (r, (code, out)) in results.iter().enumerate() {
                    if r == victim {
                        assert_eq!(
                            *code,
                            None,
                            "{what}: the victim should be killed; every rank's output:\n{}",
                            every_output(&results)
                        );
                        continue;
                    }
                    let line = survivor_line(&format!("{what}: rank {r}"), *code, out);
                    survivors += 1;
                    if names(line, victim) {
                        named += 1;
                        named_here += 1;
                    } else {
                        // Possible only when the rank it names had already failed and gone
                        // before this rank could hear why (it never linked to it).
                        assert!(
                            line.contains("PeerClosed(")
                                || line.contains("Remote(")
                                || line.contains("at bootstrap"),
                            "{what}: rank {r}: {line}"
                        );
                    }
                }
                assert!(named_here > 0, "{what}: no survivor named the victim");
                let left: Vec<String> = std::fs::read_dir("/dev/shm")
                    .map(|d| {
                        d.flatten()
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|f| f.contains(&format!("-{rank0}-")))
                            .collect()
                    })
                    .unwrap_or_default();
                assert!(
                    left.is_empty(),
                    "{what}: segments left in /dev/shm: {left:?}"
                );
            }
        }
    }
    println!(
        "kill matrix: {scenarios} scenarios, {survivors} survivors failed, {named} of them naming the victim"
    );
}

fn killed_p2p_peer_worker() {
    let comm = Communicator::from_env().unwrap();
    let me = comm.rank();
    assert!(comm.p2p_over_shared_memory((me + 1) % 3));
    let mut v = vec![1f32; 1000];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    if me == 1 {
        nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL)
            .unwrap();
    }
    let start = Instant::now();
    let err = if me == 0 {
        // Waits for a message from the dead rank.
        let mut buf = vec![0u8; 1 << 20];
        comm.recv(1, 1, &mut buf).unwrap_err()
    } else {
        // Eager messages fill the ring the dead rank no longer drains, then a large one
        // would wait for its go-ahead.
        let small = vec![0u8; 64 << 10];
        let big = vec![0u8; 4 << 20];
        (0..100)
            .map(|_| comm.send(1, 2, &small))
            .chain(std::iter::once_with(|| comm.send(1, 3, &big)))
            .find_map(|r| r.err())
            .expect("sending to a dead rank must fail")
    };
    println!(
        "\nSURVIVOR {me} failed after {:.1}s: {}: {err}",
        start.elapsed().as_secs_f64(),
        blame(&err)
    );
}

/// Kill rank 1 of 3 (all on one host, point-to-point over shared memory) while rank 0 waits
/// to receive from it and rank 2 sends to it: both fail naming rank 1 well within the 20 s
/// deadline (a killed rank never closes its rings: its peers check that its process lives;
/// one may also hear it first from the other), and nothing is left in /dev/shm.
#[test]
fn a_killed_peer_fails_point_to_point_over_shared_memory() {
    if is_worker() {
        return killed_p2p_peer_worker();
    }
    let port = free_port();
    let n = 3;
    let kids = spawn(
        "a_killed_peer_fails_point_to_point_over_shared_memory",
        n,
        |r| rank_env(r, n, port),
    );
    let rank0 = kids[0].id();
    let res = wait_all(kids, Duration::from_secs(60));
    for (r, (code, out)) in res.iter().enumerate() {
        if r == 1 {
            assert_eq!(*code, None, "rank 1 should have been killed:\n{out}");
            continue;
        }
        let line = survivor_line(&format!("rank {r}"), *code, out);
        // It sees rank 1 go, or is told by the other survivor, which did.
        assert!(names(line, 1), "rank {r}: {line}");
        let secs: f64 = line
            .split("failed after ")
            .nth(1)
            .and_then(|x| x.split('s').next())
            .and_then(|x| x.parse().ok())
            .unwrap();
        assert!(
            secs < 10.0,
            "rank {r} took {secs} s (deadline 20 s): {line}"
        );
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|f| f.contains(&format!("-{rank0}-")))
                .collect()
        })
        .unwrap_or_default();
    assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
}

fn small_ring_worker() {
    let comm = Communicator::from_env().unwrap();
    let me = comm.rank();
    let peer = 1 - me;
    assert!(comm.p2p_over_shared_memory(peer));
    let pattern = |seed: usize, len: usize| -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 131) ^ (seed * 7919)) as u8)
            .collect()
    };
    // Eager messages (up to 64 KiB) much larger than the 4 KiB ring, on interleaved tags,
    // received in another order; then rendezvous messages; then both ways at once.
    let len = |i: usize| (i * 4099) % 65_536 + 1;
    if me == 0 {
        for i in 0..60 {
            comm.send(peer, (i % 7) as u32, &pattern(i, len(i)))
                .unwrap();
        }
        comm.send(peer, 100, &pattern(100, (1 << 20) + 13)).unwrap();
    } else {
        for t in (0..7).rev() {
            for i in (t..60).step_by(7) {
                let mut got = vec![0u8; len(i)];
                comm.recv(peer, t as u32, &mut got).unwrap();
                assert!(got == pattern(i, len(i)), "message {i}");
            }
        }
        let mut got = vec![0u8; (1 << 20) + 13];
        comm.recv(peer, 100, &mut got).unwrap();
        assert!(got == pattern(100, got.len()));
    }
    let n = (3 << 20) + 1;
    let mut got = vec![0u8; n];
    comm.send_recv(peer, &pattern(me, n), peer, &mut got, 7)
        .unwrap();
    assert!(got == pattern(peer, n));
    // A size mismatch still fails on both sides.
    let r = if me == 0 {
        comm.send(peer, 8, &vec![0u8; 200_000])
    } else {
        comm.recv(peer, 8, &mut vec![0u8; 100_000])
    };
    assert!(matches!(r, Err(Error::SizeMismatch { .. })), "{r:?}");
    println!("WORKER OK rank {me}");
}

/// With `HCOMM_SHM_P2P_BYTES=4096` every message wraps around its ring many times.
#[test]
fn point_to_point_works_through_a_4_kib_ring() {
    if is_worker() {
        return small_ring_worker();
    }
    let port = free_port();
    let kids = spawn("point_to_point_works_through_a_4_kib_ring", 2, |r| {
        [
            rank_env(r, 2, port),
            vec![("HCOMM_SHM_P2P_BYTES".into(), "4096".into())],
        ]
        .concat()
    });
    assert_all_ok(&wait_all(kids, Duration::from_secs(60)));
}

fn departed_idle_peer_worker() {
    let comm = Communicator::from_env().unwrap();
    let me = comm.rank();
    assert!(comm.p2p_over_shared_memory((me + 1) % 3));
    let mut v = vec![1f32; 1000];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    if me == 2 {
        // Done with its work: leaves without dropping the communicator (as `os._exit`, or a
        // Python global at interpreter exit), so its rings never say "closed".
        println!("WORKER OK rank {me}");
        std::mem::forget(comm);
        std::process::exit(0);
    }
    // Ranks 0 and 1 go on with point-to-point between themselves; rank 0 waits long enough
    // (several liveness checks) for rank 1's messages.
    for i in 0..3u32 {
        let mut buf = vec![0u8; 1000];
        if me == 1 {
            std::thread::sleep(Duration::from_millis(400));
            comm.send(0, i, &vec![i as u8; 1000]).unwrap();
        } else {
            comm.recv(1, i, &mut buf)
                .unwrap_or_else(|e| panic!("recv {i} from rank 1 failed: {e}"));
            assert!(buf.iter().all(|&b| b == i as u8));
        }
    }
    println!("WORKER OK rank {me}");
}

/// A rank that finished and left (without closing its rings) is no error for point-to-point
/// that does not involve it: ranks 0 and 1 keep exchanging messages over their own rings (as
/// over TCP, where a departed peer's closed socket is only remembered until someone needs it).
#[test]
fn a_departed_peer_does_not_fail_point_to_point_between_others() {
    if is_worker() {
        return departed_idle_peer_worker();
    }
    let port = free_port();
    let n = 3;
    let kids = spawn(
        "a_departed_peer_does_not_fail_point_to_point_between_others",
        n,
        |r| rank_env(r, n, port),
    );
    assert_all_ok(&wait_all(kids, Duration::from_secs(60)));
}

/// Each rank creates, uses and drops a communicator on the same master port several times,
/// back to back, with rank `HCOMM_TEST_SLOW` dawdling before each drop (so the others come
/// back to the port while the old store still lives).
fn recreated_worker() {
    let slow: Option<usize> = std::env::var("HCOMM_TEST_SLOW")
        .ok()
        .map(|v| v.parse().unwrap());
    for round in 0..4u64 {
        let comm = Communicator::from_env()
            .unwrap_or_else(|e| panic!("round {round}: creating the communicator: {e}"));
        let n = comm.world_size() as u64;
        let mut v = vec![comm.rank() as u64 + round; 1000];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("round {round}: all-reduce: {e}"));
        assert!(
            v.iter().all(|&x| x == n * (n - 1) / 2 + n * round),
            "round {round}"
        );
        if slow == Some(comm.rank()) {
            std::thread::sleep(Duration::from_millis(300));
        }
        drop(comm);
    }
    println!("WORKER OK");
}

/// A communicator can be created again on the same master port as soon as the last one is
/// dropped (the pattern of `InitHcom` / `DestroyHcom` in a loop): rank 0's new store binds the
/// port its old one held, and a rank that comes back while rank 0 still holds the old store
/// waits for the new one instead of joining the old (whose peer list is stale).
#[test]
fn a_communicator_can_be_created_again_on_the_same_port_at_once() {
    const TEST: &str = "a_communicator_can_be_created_again_on_the_same_port_at_once";
    if is_worker() {
        return recreated_worker();
    }
    for slow in ["none", "0", "1"] {
        let port = free_port();
        let kids = spawn(TEST, 3, |r| {
            let mut e = rank_env(r, 3, port);
            e.push(("HCOMM_TIMEOUT".into(), "20s".into()));
            if slow != "none" {
                e.push(("HCOMM_TEST_SLOW".into(), slow.into()));
            }
            e
        });
        let res = wait_all(kids, Duration::from_secs(90));
        for (r, (code, out)) in res.iter().enumerate() {
            assert!(
                *code == Some(0) && out.contains("WORKER OK"),
                "slow rank {slow}: rank {r} failed:\n{}",
                every_output(&res)
            );
        }
    }
}
