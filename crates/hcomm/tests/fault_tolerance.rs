//! Surviving a lost rank, with real processes: `revoke` stops every rank promptly with
//! `Revoked`, and after a SIGKILL (rank 0, a middle rank, the last one, two at once; during a
//! collective, point-to-point, while idle, during the agreement, during the new
//! communicator's setup; over TCP, shared memory and two claimed hosts) every survivor gets a
//! working communicator of the same members from `shrink`, with correct results on it.
//!
//! A replacement process can then join (`grow`, `join_grown`) and get rank 0's state.
//!
//! Each case is bounded (`wait_all` kills everything after its limit). The driver prints, per
//! case, the time from the kill to each survivor's first correct all-reduce on the shrunk
//! communicator.

mod common;

use common::*;
use hcomm::fusion::{FusionOptions, TensorMut};
use hcomm::{Communicator, CompressionState, Compressor, Error, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

fn env_list(name: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect()
}

fn die() -> ! {
    println!("KILLED_AT {}", now_us());
    nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL).unwrap();
    unreachable!()
}

/// Every survivor contributes `old rank + 1`; the sum is known from the survivors' list.
fn check_all_reduce(c: &Communicator, survivors: &[usize], len: usize) -> Result<(), Error> {
    let me = survivors[c.rank()];
    let mut v = vec![(me + 1) as f64; len];
    c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    let want: f64 = survivors.iter().map(|&r| (r + 1) as f64).sum();
    assert!(
        v.iter().all(|&x| x == want),
        "rank {me}: all-reduce on the shrunk communicator gave {} not {want}",
        v[0]
    );
    Ok(())
}

/// One rank of a case. `FT_VICTIMS` die in phase `FT_WHEN`; `FT_LATE` (with `FT_LATE_MS`)
/// dies that long after it entered `shrink`.
fn worker() {
    if let Ok(addr) = std::env::var("FT_JOIN") {
        return joiner(&addr);
    }
    let comm = Communicator::from_env().unwrap();
    let (me, n) = (comm.rank(), comm.world_size());
    let victims = env_list("FT_VICTIMS");
    let late = env_list("FT_LATE");
    let when = std::env::var("FT_WHEN").unwrap();
    let len = 1 << 16; // 512 KiB of f64
    let everyone: Vec<usize> = (0..n).collect();
    check_all_reduce(&comm, &everyone, len).unwrap();
    let victim = victims.contains(&me);
    let err = match when.as_str() {
        "collective" => (0..)
            .find_map(|i| {
                if victim && i == 3 {
                    die();
                }
                check_all_reduce(&comm, &everyone, len).err()
            })
            .unwrap(),
        "p2p" => (0..)
            .find_map(|i| {
                if victim && i == 3 {
                    die();
                }
                let send = vec![me as u8; 100_000];
                let mut recv = vec![0u8; 100_000];
                comm.send_recv((me + 1) % n, &send, (me + n - 1) % n, &mut recv, 7)
                    .err()
            })
            .unwrap(),
        "idle" => {
            if victim {
                die();
            }
            std::thread::sleep(Duration::from_millis(300));
            check_all_reduce(&comm, &everyone, len).unwrap_err()
        }
        "revoke" => {
            // No death: rank 1 revokes while the others wait for it in an all-reduce; rank 2
            // (if any) has no operation in flight and starts one late.
            if me == 1 {
                std::thread::sleep(Duration::from_millis(300));
                println!("REVOKE_AT {}", now_us());
                comm.revoke();
                Error::Revoked {
                    ctx: Default::default(),
                    by: 1,
                }
            } else {
                if me == 2 {
                    std::thread::sleep(Duration::from_millis(600));
                }
                let start = Instant::now();
                let e = check_all_reduce(&comm, &everyone, len).unwrap_err();
                assert!(
                    matches!(e, Error::Revoked { by: 1, .. }),
                    "rank {me}: expected Revoked by rank 1, got {e}"
                );
                println!(
                    "REVOKED_AT {} CALL_MS {:.1}",
                    now_us(),
                    start.elapsed().as_secs_f64() * 1000.0
                );
                // Later calls say so too.
                let e = comm.barrier().unwrap_err();
                assert!(e.is_revoked(), "rank {me}: {e}");
                e
            }
        }
        other => panic!("FT_WHEN={other}"),
    };
    println!("FAILED_AT {} {err}", now_us());
    if late.contains(&me) {
        let ms: u64 = std::env::var("FT_LATE_MS").unwrap().parse().unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            die();
        });
    }
    let shrunk = comm
        .shrink()
        .unwrap_or_else(|e| panic!("rank {me}: shrink failed: {e}"));
    // Which old ranks are in it: gather them (a collective on the new communicator, too).
    let mut olds = vec![0u64; shrunk.world_size()];
    shrunk
        .all_gather(&[me as u64], &mut olds)
        .unwrap_or_else(|e| panic!("rank {me}: all-gather on the shrunk communicator: {e}"));
    let survivors: Vec<usize> = olds.iter().map(|&r| r as usize).collect();
    assert_eq!(survivors[shrunk.rank()], me, "ranks keep their order");
    assert!(survivors.windows(2).all(|w| w[0] < w[1]), "{survivors:?}");
    check_all_reduce(&shrunk, &survivors, len)
        .unwrap_or_else(|e| panic!("rank {me}: all-reduce on the shrunk communicator: {e}"));
    println!("OK_AT {}", now_us());
    // Point-to-point and a broadcast from the new rank 0 work too.
    let k = shrunk.world_size();
    if k > 1 {
        let r = shrunk.rank();
        let send = vec![r as u32; 1000];
        let mut recv = vec![0u32; 1000];
        shrunk
            .send_recv((r + 1) % k, &send, (r + k - 1) % k, &mut recv, 3)
            .unwrap();
        assert!(recv.iter().all(|&x| x as usize == (r + k - 1) % k));
    }
    let mut b = vec![shrunk.rank() as u32 + 10; 333];
    shrunk.broadcast(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 10));
    let shrunk = Arc::new(shrunk);
    more_checks(&shrunk, &survivors);
    println!(
        "SHRUNK old={me} new={} size={} members={survivors:?}",
        shrunk.rank(),
        shrunk.world_size()
    );
    if let Ok(addr) = std::env::var("FT_GROW") {
        // A replacement joins: the survivors keep their ranks, it takes the next one.
        let grown = shrunk
            .grow(1, &addr)
            .unwrap_or_else(|e| panic!("rank {me}: grow failed: {e}"));
        assert_eq!(grown.rank(), shrunk.rank());
        assert_eq!(grown.world_size(), shrunk.world_size() + 1);
        grown_checks(&grown, me);
        println!(
            "GROWN old={me} new={} size={}",
            grown.rank(),
            grown.world_size()
        );
    }
    shrunk.barrier().unwrap();
    drop(shrunk);
    drop(comm);
}

/// Fusion, a compressed all-reduce and (on one host) a shared window on the shrunk communicator.
fn more_checks(c: &Arc<Communicator>, survivors: &[usize]) {
    let me = survivors[c.rank()];
    let want: f32 = survivors.iter().map(|&r| (r + 1) as f32).sum();
    let mut a = vec![(me + 1) as f32; 3000];
    let mut b = vec![(me + 1) as f64; 17];
    c.all_reduce_coalesced(
        vec![TensorMut::new(&mut a), TensorMut::new(&mut b)],
        ReduceOp::Sum,
        FusionOptions::default(),
    )
    .unwrap_or_else(|e| panic!("rank {me}: fusion on the shrunk communicator: {e}"));
    assert!(a.iter().all(|&x| x == want) && b.iter().all(|&x| x == want as f64));
    let mut state = CompressionState::new(Compressor::Fp16).unwrap();
    let mut v = vec![(me + 1) as f32; 4096];
    c.all_reduce_compressed(&mut v, ReduceOp::Sum, &mut state)
        .unwrap_or_else(|e| {
            panic!("rank {me}: compressed all-reduce on the shrunk communicator: {e}")
        });
    assert!(v.iter().all(|&x| (x - want).abs() < 0.1), "{}", v[0]);
    if c.has_shared_memory() {
        let w = c
            .alloc_window(4096)
            .unwrap_or_else(|e| panic!("rank {me}: window on the shrunk communicator: {e}"));
        drop(w);
    }
}

/// On a grown communicator: every rank names itself (survivors their old rank, the newcomer
/// 100), the all-gather shows them all, and the newcomer gets rank 0's state by broadcast.
fn grown_checks(grown: &Communicator, name: usize) {
    let mut names = vec![0u64; grown.world_size()];
    grown.all_gather(&[name as u64], &mut names).unwrap();
    assert_eq!(names[grown.rank()], name as u64);
    assert_eq!(
        *names.last().unwrap(),
        100,
        "the newcomer takes the last rank: {names:?}"
    );
    let mut state = vec![if grown.rank() == 0 { 7.5f32 } else { 0.0 }; 10_000];
    grown.broadcast(&mut state, 0).unwrap();
    assert!(state.iter().all(|&x| x == 7.5));
    let mut v = vec![(name + 1) as f64; 1000];
    grown.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    let want: f64 = names.iter().map(|&r| (r + 1) as f64).sum();
    assert!(v.iter().all(|&x| x == want));
    grown.barrier().unwrap();
}

/// A replacement process: joins the communicator the survivors grow.
fn joiner(addr: &str) {
    let cfg = hcomm::BootstrapConfig::for_joining(addr).unwrap();
    let grown = Communicator::join_grown(&cfg).unwrap_or_else(|e| panic!("joiner: {e}"));
    grown_checks(&grown, 100);
    println!(
        "GROWN joiner new={} size={}",
        grown.rank(),
        grown.world_size()
    );
}

struct Case {
    n: usize,
    transport: &'static str,
    /// Claimed host of each rank (None: all on this host, as they are).
    hosts: Option<&'static [&'static str]>,
    when: &'static str,
    victims: &'static [usize],
    late: &'static [usize],
    late_ms: u64,
    /// Ranks that kill themselves while the shrunk communicator is set up.
    in_setup: &'static [usize],
    /// `HCOMM_TIMEOUT`.
    timeout: &'static str,
    /// After the shrink, one replacement process joins (`grow`).
    grow: bool,
}

fn field(out: &str, key: &str) -> Option<u128> {
    out.lines()
        .find_map(|l| l.find(key).map(|i| &l[i + key.len()..]))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Run one case; returns a line for the report.
fn run_case(test: &str, case: &Case) -> String {
    let port = hcomm::testing::free_port();
    let grow_addr = format!("127.0.0.1:{}", hcomm::testing::free_port());
    let procs = case.n + usize::from(case.grow);
    let kids = spawn(test, procs, |r| {
        if r == case.n {
            // The replacement: no launch variables, only where to join (and the settings).
            return vec![
                ("FT_JOIN".to_string(), grow_addr.clone()),
                ("HCOMM_TIMEOUT".into(), case.timeout.into()),
                ("HCOMM_TRANSPORT".into(), case.transport.into()),
            ];
        }
        let mut env = rank_env(r, case.n, port);
        if case.grow {
            env.push(("FT_GROW".into(), grow_addr.clone()));
        }
        env.extend([
            ("HCOMM_TIMEOUT".to_string(), case.timeout.to_string()),
            ("HCOMM_TRANSPORT".into(), case.transport.into()),
            ("FT_WHEN".into(), case.when.into()),
            ("FT_VICTIMS".into(), list(case.victims)),
            ("FT_LATE".into(), list(case.late)),
            ("FT_LATE_MS".into(), case.late_ms.to_string()),
        ]);
        if case.in_setup.contains(&r) {
            env.push(("HCOMM_FAULT_INJECT".into(), "die-in-shrink-setup".into()));
        }
        if let Some(h) = case.hosts {
            env.push(("HCOMM_HOST_ID".into(), h[r].into()));
        }
        env
    });
    let res = wait_all(kids, Duration::from_secs(75));
    let what = format!(
        "n={} {} {}{} victims {:?}{}{}",
        case.n,
        case.transport,
        case.when,
        if case.hosts.is_some() { " 2 hosts" } else { "" },
        case.victims,
        if case.late.is_empty() {
            String::new()
        } else {
            format!(", {:?} {} ms into the shrink", case.late, case.late_ms)
        },
        if case.in_setup.is_empty() {
            String::new()
        } else {
            format!(", {:?} in the shrunk communicator's setup", case.in_setup)
        }
    );
    let all = res
        .iter()
        .enumerate()
        .map(|(r, (c, o))| format!("--- rank {r} ({c:?}):\n{o}"))
        .collect::<Vec<_>>()
        .join("\n");
    if std::env::var_os("FT_DEBUG").is_some() {
        println!("{all}");
    }
    let killed_at = res.iter().filter_map(|(_, o)| field(o, "KILLED_AT ")).min();
    let mut sizes = Vec::new();
    let mut recovery_ms = Vec::new();
    for (r, (code, out)) in res.iter().enumerate() {
        if r == case.n {
            assert_eq!(
                *code,
                Some(0),
                "{what}: the replacement did not join:\n{all}"
            );
            assert!(out.contains("GROWN joiner"), "{what}:\n{all}");
            continue;
        }
        if case.victims.contains(&r) {
            assert_eq!(
                *code, None,
                "{what}: rank {r} should have been killed:\n{all}"
            );
            continue;
        }
        if (case.late.contains(&r) || case.in_setup.contains(&r)) && *code != Some(0) {
            // Died during the shrink, as planned (or finished it first, also fine).
            assert_eq!(*code, None, "{what}: rank {r}:\n{all}");
            continue;
        }
        assert_eq!(
            *code,
            Some(0),
            "{what}: survivor {r} did not finish:\n{all}"
        );
        if case.grow {
            assert!(
                out.contains("GROWN old="),
                "{what}: rank {r} did not grow:\n{all}"
            );
        }
        let line = out
            .lines()
            .find_map(|l| l.find("SHRUNK").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("{what}: rank {r} has no SHRUNK line:\n{all}"));
        let members = line.split("members=").nth(1).unwrap().to_string();
        sizes.push(members);
        if let (Some(k), Some(ok)) = (killed_at, field(out, "OK_AT ")) {
            recovery_ms.push((ok.saturating_sub(k)) as f64 / 1000.0);
        }
    }
    assert!(!sizes.is_empty(), "{what}: no survivor:\n{all}");
    assert!(
        sizes.iter().all(|s| *s == sizes[0]),
        "{what}: survivors disagree on the membership: {sizes:?}\n{all}"
    );
    let grown = if case.grow {
        ", then a replacement joined (grow)"
    } else {
        ""
    };
    let worst = recovery_ms.iter().cloned().fold(0.0, f64::max);
    // Rank 0 waits in an all-reduce when rank 1 revokes; rank 2 starts one afterwards.
    let revoked = field(&res[1.min(res.len() - 1)].1, "REVOKE_AT ").and_then(|at| {
        let seen = field(&res[0].1, "REVOKED_AT ")?;
        let late_call = res.get(2).and_then(|(_, o)| {
            o.lines()
                .find_map(|l| l.split("CALL_MS ").nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        });
        Some((seen.saturating_sub(at) as f64 / 1000.0, late_call))
    });
    match (killed_at, revoked) {
        (Some(_), _) => format!(
            "{what}: members {}; kill to first correct all-reduce on the shrunk communicator: max {worst:.1} ms{grown}",
            sizes[0]
        ),
        (None, Some((ms, late))) => format!(
            "{what}: members {}; the rank waiting in an all-reduce had Revoked {ms:.1} ms after the revoke; \
             the idle rank's next call failed in {} ms",
            sizes[0],
            late.map_or("?".into(), |l| format!("{l:.1}"))
        ),
        _ => format!("{what}: members {}", sizes[0]),
    }
}

fn list(v: &[usize]) -> String {
    v.iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn run_cases(test: &str, cases: &[Case]) {
    let start = Instant::now();
    for c in cases {
        let line = run_case(test, c);
        println!("fault case {line}");
    }
    println!(
        "{} cases in {:.1}s",
        cases.len(),
        start.elapsed().as_secs_f64()
    );
}

const fn case(
    n: usize,
    transport: &'static str,
    when: &'static str,
    victims: &'static [usize],
) -> Case {
    Case {
        n,
        transport,
        hosts: None,
        when,
        victims,
        late: &[],
        late_ms: 0,
        in_setup: &[],
        timeout: "10s",
        grow: false,
    }
}

#[test]
fn revoke_stops_every_rank_with_revoked_and_shrink_keeps_everyone() {
    const TEST: &str = "revoke_stops_every_rank_with_revoked_and_shrink_keeps_everyone";
    if is_worker() {
        return worker();
    }
    run_cases(
        TEST,
        &[case(3, "tcp", "revoke", &[]), case(3, "shm", "revoke", &[])],
    );
}

#[test]
fn a_killed_rank_is_dropped_by_shrink_over_tcp() {
    const TEST: &str = "a_killed_rank_is_dropped_by_shrink_over_tcp";
    if is_worker() {
        return worker();
    }
    run_cases(
        TEST,
        &[
            case(4, "tcp", "collective", &[0]),
            case(4, "tcp", "collective", &[1]),
            case(4, "tcp", "collective", &[3]),
            case(4, "tcp", "collective", &[1, 2]),
            case(4, "tcp", "p2p", &[2]),
            case(3, "tcp", "idle", &[0]),
            case(2, "tcp", "collective", &[1]),
        ],
    );
}

#[test]
fn a_killed_rank_is_dropped_by_shrink_over_shared_memory() {
    const TEST: &str = "a_killed_rank_is_dropped_by_shrink_over_shared_memory";
    if is_worker() {
        return worker();
    }
    run_cases(
        TEST,
        &[
            case(4, "shm", "collective", &[0]),
            case(4, "shm", "collective", &[2]),
            case(4, "shm", "p2p", &[1]),
            case(3, "shm", "collective", &[2]),
        ],
    );
}

#[test]
fn shrink_survives_deaths_on_two_hosts_and_during_the_shrink_itself() {
    const TEST: &str = "shrink_survives_deaths_on_two_hosts_and_during_the_shrink_itself";
    if is_worker() {
        return worker();
    }
    const HOSTS: &[&str] = &["node-a", "node-a", "node-b", "node-b"];
    run_cases(
        TEST,
        &[
            Case {
                hosts: Some(HOSTS),
                ..case(4, "auto", "collective", &[0])
            },
            Case {
                hosts: Some(HOSTS),
                ..case(4, "auto", "collective", &[3])
            },
            // Every rank of one host at once (its segment goes with them).
            Case {
                hosts: Some(HOSTS),
                ..case(4, "auto", "collective", &[2, 3])
            },
            // A second rank (the coordinator-to-be, rank 0, in the second case) dies as the
            // agreement starts. (A timer cannot aim at the shrunk communicator's setup, which
            // takes a few ms: the fault-injection cases below do.)
            Case {
                late: &[1],
                late_ms: 0,
                ..case(4, "tcp", "collective", &[3])
            },
            Case {
                late: &[0],
                late_ms: 0,
                ..case(4, "tcp", "collective", &[3])
            },
            Case {
                late: &[2],
                late_ms: 0,
                ..case(4, "shm", "collective", &[3])
            },
            // Dies once it joined the shrunk communicator's store: the others' setup times
            // out (3 s here), they agree again without it and finish.
            Case {
                in_setup: &[2],
                timeout: "3s",
                ..case(4, "tcp", "collective", &[3])
            },
            Case {
                in_setup: &[0],
                timeout: "3s",
                ..case(4, "shm", "collective", &[3])
            },
            // A replacement takes the lost rank's place (grow), over TCP and shared memory.
            Case {
                grow: true,
                ..case(4, "tcp", "collective", &[1])
            },
            Case {
                grow: true,
                ..case(3, "auto", "collective", &[0])
            },
        ],
    );
}
