//! End-to-end tests of the launcher library, with `sh` as the program.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use hcomm_launch::{launch, LaunchError, LaunchSpec};

const LIMIT: Duration = Duration::from_secs(30);

const SHOW_ENV: &str = "echo \"rank $HCOMM_RANK of $HCOMM_WORLD_SIZE \
local=$HCOMM_LOCAL_RANK/$HCOMM_LOCAL_WORLD_SIZE addr=$HCOMM_MASTER_ADDR port=$HCOMM_MASTER_PORT \
torch=$RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/$MASTER_ADDR/$MASTER_PORT extra=$FOO\"";

/// Parses the `SHOW_ENV` lines: prefix rank -> (fields by name, rank, world).
fn parse_env_lines(out: &str) -> BTreeMap<usize, BTreeMap<String, String>> {
    let mut ranks = BTreeMap::new();
    for line in out.lines() {
        let (prefix, rest) = line.split_once("] ").expect("prefixed line");
        let prefix_rank: usize = prefix.strip_prefix('[').unwrap().parse().unwrap();
        let words: Vec<&str> = rest.split(' ').collect();
        assert_eq!(words[0], "rank", "{line}");
        let mut fields = BTreeMap::new();
        fields.insert("rank".to_string(), words[1].to_string());
        fields.insert("world".to_string(), words[3].to_string());
        for word in &words[4..] {
            let (k, v) = word.split_once('=').unwrap();
            fields.insert(k.to_string(), v.to_string());
        }
        assert!(
            ranks.insert(prefix_rank, fields).is_none(),
            "rank {prefix_rank} printed twice"
        );
    }
    ranks
}

#[test]
fn three_ranks_get_their_environment() {
    with_timeout(LIMIT, || {
        let mut spec = LaunchSpec::new(3, "sh", ["-c", SHOW_ENV]);
        spec.extra_env.push(("FOO".into(), "bar".into()));
        let run = run_captured(&spec);
        assert_eq!(run.result.unwrap(), 0, "stderr: {}", run.err);
        let ranks = parse_env_lines(&run.out);
        assert_eq!(
            ranks.keys().copied().collect::<Vec<_>>(),
            [0, 1, 2],
            "{}",
            run.out
        );
        let port = &ranks[&0]["port"];
        assert_ne!(port.parse::<u16>().unwrap(), 0);
        // torch.distributed's MASTER_PORT is another port (its store and hcomm's must not
        // both bind one), the same on every rank
        let torch_port = ranks[&0]["torch"].rsplit('/').next().unwrap().to_string();
        assert_ne!(&torch_port, port);
        for (rank, f) in &ranks {
            assert_eq!(f["rank"], rank.to_string());
            assert_eq!(f["world"], "3");
            assert_eq!(f["local"], format!("{rank}/3"));
            assert_eq!(f["addr"], "127.0.0.1");
            assert_eq!(&f["port"], port, "all ranks share the master port");
            assert_eq!(
                f["torch"],
                format!("{rank}/3/{rank}/3/127.0.0.1/{torch_port}")
            );
            assert_eq!(f["extra"], "bar");
        }
        assert_eq!(run.err, "");
    });
}

#[test]
fn node_rank_offsets_global_ranks() {
    with_timeout(LIMIT, || {
        let mut spec = LaunchSpec::new(2, "sh", ["-c", SHOW_ENV]);
        spec.nnodes = 3;
        spec.node_rank = 1;
        spec.master_port = Some(29555);
        spec.master_addr = "10.1.2.3".into();
        let run = run_captured(&spec);
        assert_eq!(run.result.unwrap(), 0, "stderr: {}", run.err);
        let ranks = parse_env_lines(&run.out);
        assert_eq!(
            ranks.keys().copied().collect::<Vec<_>>(),
            [2, 3],
            "{}",
            run.out
        );
        for (local, (rank, f)) in ranks.iter().enumerate() {
            assert_eq!(f["rank"], rank.to_string());
            assert_eq!(f["world"], "6");
            assert_eq!(f["local"], format!("{local}/2"));
            assert_eq!(f["port"], "29555");
            assert_eq!(f["torch"], format!("{rank}/6/{local}/2/10.1.2.3/29556"));
        }
    });
}

#[test]
fn launch_to_stdio_twice_in_one_process() {
    with_timeout(LIMIT, || {
        let spec = LaunchSpec::new(
            3,
            "sh",
            ["-c", "echo rank $HCOMM_RANK of $HCOMM_WORLD_SIZE"],
        );
        assert_eq!(launch(&spec).unwrap(), 0);
        let mut spec = LaunchSpec::new(2, "sh", ["-c", "[ $HCOMM_RANK = 0 ] && exit 4; sleep 30"]);
        spec.prefix_output = false;
        assert_eq!(launch(&spec).unwrap(), 4);
    });
}

#[test]
fn output_is_prefixed_and_not_interleaved() {
    with_timeout(LIMIT, || {
        const LINES: usize = 2000;
        let pad = "x".repeat(200);
        let script = format!(
            "i=0; while [ $i -lt {LINES} ]; do echo \"$HCOMM_RANK:$i:{pad}\"; \
             echo \"e$HCOMM_RANK:$i\" >&2; i=$((i+1)); done"
        );
        let run = run_captured(&LaunchSpec::new(3, "sh", ["-c", &script]));
        assert_eq!(run.result.unwrap(), 0);
        let mut next = [0usize; 3];
        for line in run.out.lines() {
            let (prefix, rest) = line.split_once(' ').unwrap();
            let rank: usize = prefix.trim_matches(['[', ']']).parse().unwrap();
            assert_eq!(
                rest,
                format!("{rank}:{}:{pad}", next[rank]),
                "mangled line {line:?}"
            );
            next[rank] += 1;
        }
        assert_eq!(next, [LINES; 3]);
        let mut next = [0usize; 3];
        for line in run.err.lines() {
            let (prefix, rest) = line.split_once(' ').unwrap();
            let rank: usize = prefix.trim_matches(['[', ']']).parse().unwrap();
            assert_eq!(
                rest,
                format!("e{rank}:{}", next[rank]),
                "mangled line {line:?}"
            );
            next[rank] += 1;
        }
        assert_eq!(next, [LINES; 3]);
    });
}

#[test]
fn partial_last_line_and_no_prefix() {
    with_timeout(LIMIT, || {
        let spec = LaunchSpec::new(
            1,
            "sh",
            ["-c", "echo out; printf 'no newline'; printf 'err' >&2"],
        );
        let run = run_captured(&spec);
        assert_eq!(run.result.unwrap(), 0);
        assert_eq!(run.out, "[0] out\n[0] no newline\n");
        assert_eq!(run.err, "[0] err\n");

        let mut spec = spec.clone();
        spec.prefix_output = false;
        let run = run_captured(&spec);
        assert_eq!(run.result.unwrap(), 0);
        assert_eq!(run.out, "out\nno newline\n");
        assert_eq!(run.err, "err\n");
    });
}

#[test]
fn first_failing_rank_decides_the_exit_code() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "{}; if [ \"$HCOMM_RANK\" = 1 ]; then \
               while [ ! -f \"$T/p0\" ] || [ ! -f \"$T/p2\" ]; do sleep 0.02; done; exit 3; \
             fi; sleep 30",
            write_pid("p$HCOMM_RANK")
        );
        let run = run_captured(&sh_spec(3, &script, dir.path()));
        assert_eq!(run.result.unwrap(), 3, "stderr: {}", run.err);
        assert!(
            run.elapsed < Duration::from_secs(10),
            "took {:?}",
            run.elapsed
        );
        assert!(
            run.err
                .contains("hcomm run: rank 1 exited with code 3; stopping the other ranks"),
            "stderr: {}",
            run.err
        );
        // Only the first failure is reported; ranks stopped afterwards are not.
        assert_eq!(run.err.lines().count(), 1, "stderr: {}", run.err);
        for rank in 0..3 {
            assert_gone(read_pid(dir.path(), &format!("p{rank}")));
        }
    });
}

#[test]
fn rank_killed_by_a_signal_gives_128_plus_signo() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "{}; if [ \"$HCOMM_RANK\" = 0 ]; then kill -9 $$; fi; sleep 30",
            write_pid("p$HCOMM_RANK")
        );
        let run = run_captured(&sh_spec(2, &script, dir.path()));
        assert_eq!(run.result.unwrap(), 137);
        assert!(
            run.elapsed < Duration::from_secs(10),
            "took {:?}",
            run.elapsed
        );
        assert!(
            run.err
                .contains("rank 0 was killed by signal SIGKILL; stopping the other ranks"),
            "stderr: {}",
            run.err
        );
        assert_gone(read_pid(dir.path(), "p0"));
        if dir.path().join("p1").exists() {
            assert_gone(read_pid(dir.path(), "p1"));
        }
    });
}

#[test]
fn rank_ignoring_sigterm_is_killed_after_grace() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "if [ \"$HCOMM_RANK\" = 0 ]; then \
               while [ ! -f \"$T/p1\" ]; do sleep 0.02; done; exit 5; \
             fi; trap '' TERM; {}; sleep 30",
            write_pid("p1")
        );
        let mut spec = sh_spec(2, &script, dir.path());
        spec.grace = Duration::from_millis(700);
        let run = run_captured(&spec);
        assert_eq!(run.result.unwrap(), 5, "stderr: {}", run.err);
        assert!(
            run.elapsed >= spec.grace,
            "SIGKILL came early: {:?}",
            run.elapsed
        );
        assert!(
            run.elapsed < Duration::from_secs(10),
            "took {:?}",
            run.elapsed
        );
        assert_gone(read_pid(dir.path(), "p1"));
    });
}

#[test]
fn grandchildren_are_stopped_too() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        // Rank 1's shell waits on a background sleep; rank 0 fails once the
        // sleep's pid is known.
        let script = "if [ \"$HCOMM_RANK\" = 0 ]; then \
               while [ ! -f \"$T/g\" ]; do sleep 0.02; done; exit 4; \
             fi; sleep 30 & echo $! > \"$T/g.tmp\"; mv \"$T/g.tmp\" \"$T/g\"; wait";
        let run = run_captured(&sh_spec(2, script, dir.path()));
        assert_eq!(run.result.unwrap(), 4, "stderr: {}", run.err);
        assert!(
            run.elapsed < Duration::from_secs(10),
            "took {:?}",
            run.elapsed
        );
        assert_gone(read_pid(dir.path(), "g"));
    });
}

#[test]
fn leftovers_of_a_successful_rank_are_killed() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        // The background sleep keeps the rank's stdout pipe open.
        let script = "sleep 30 & echo $! > \"$T/g.tmp\"; mv \"$T/g.tmp\" \"$T/g\"; echo done";
        let run = run_captured(&sh_spec(1, script, dir.path()));
        assert_eq!(run.result.unwrap(), 0, "stderr: {}", run.err);
        assert_eq!(run.out, "[0] done\n");
        assert!(
            run.elapsed < Duration::from_secs(10),
            "took {:?}",
            run.elapsed
        );
        assert_gone(read_pid(dir.path(), "g"));
    });
}

#[test]
fn nonexistent_program_is_a_spawn_error() {
    with_timeout(LIMIT, || {
        let mut spec = LaunchSpec::new(2, "/nonexistent/hcomm-no-such-program", ["x"]);
        spec.nnodes = 2;
        spec.node_rank = 1;
        spec.master_port = Some(29500);
        let run = run_captured(&spec);
        let err = run.result.unwrap_err();
        match &err {
            LaunchError::Spawn { rank, program, .. } => {
                assert_eq!(*rank, 2);
                assert_eq!(program, "/nonexistent/hcomm-no-such-program");
            }
            other => panic!("expected a Spawn error, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("rank 2") && msg.contains("/nonexistent/hcomm-no-such-program"),
            "{msg}"
        );
        assert_eq!(run.out, "");
    });
}

#[test]
fn invalid_specs_are_rejected_before_anything_runs() {
    with_timeout(LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let marker = "touch \"$T/ran\"";
        let check = |spec: LaunchSpec, needle: &str| match launch(&spec) {
            Err(LaunchError::InvalidSpec(msg)) => assert!(msg.contains(needle), "{msg}"),
            other => panic!("expected InvalidSpec, got {other:?}"),
        };
        check(sh_spec(0, marker, dir.path()), "at least 1");
        let mut spec = sh_spec(1, marker, dir.path());
        spec.nnodes = 2;
        spec.node_rank = 2;
        spec.master_port = Some(1);
        check(spec, "node rank 2");
        let mut spec = sh_spec(1, marker, dir.path());
        spec.program = "".into();
        check(spec, "no program");
        assert!(!dir.path().join("ran").exists());
    });
}

/// The `token=` values the ranks printed, by rank.
fn tokens(spec: &LaunchSpec) -> (Vec<String>, String) {
    let run = run_captured(spec);
    assert_eq!(run.result.unwrap(), 0, "stderr: {}", run.err);
    let mut lines: Vec<&str> = run.out.lines().collect();
    lines.sort();
    let tokens = lines
        .iter()
        .map(|l| l.split_once("token=").expect("a token line").1.to_string())
        .collect();
    (tokens, run.err)
}

#[test]
fn each_job_gets_a_fresh_token_unless_one_is_given() {
    if std::env::var_os("HCOMM_JOB_TOKEN").is_some()
        || std::env::var_os("HCOMM_TOKEN_FILE").is_some()
    {
        return; // the launcher would pass the given one on
    }
    with_timeout(LIMIT, || {
        let spec = LaunchSpec::new(3, "sh", ["-c", "echo \"token=$HCOMM_JOB_TOKEN\""]);
        let (a, err) = tokens(&spec);
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|t| t == &a[0]), "one token per job: {a:?}");
        assert!(
            a[0].len() == 64 && a[0].bytes().all(|b| b.is_ascii_hexdigit()),
            "{a:?}"
        );
        assert!(!err.contains(&a[0]));
        let (b, _) = tokens(&spec);
        assert_ne!(a[0], b[0], "a fresh token per job");

        let mut given = spec.clone();
        given
            .extra_env
            .push(("HCOMM_JOB_TOKEN".into(), "my-own-token-0123456789".into()));
        assert_eq!(tokens(&given).0, vec!["my-own-token-0123456789"; 3]);
        let mut file = spec.clone();
        file.extra_env
            .push(("HCOMM_TOKEN_FILE".into(), "/etc/hcomm/token".into()));
        assert_eq!(tokens(&file).0, vec![""; 3]);

        // Launchers on several nodes cannot agree on a token they make: none, and a warning.
        let mut nodes = spec.clone();
        nodes.nnodes = 2;
        nodes.master_port = Some(29555);
        let (t, err) = tokens(&nodes);
        assert_eq!(t, vec![""; 3]);
        assert!(err.contains("not authenticated"), "{err}");
    });
}

/// This process's CPUs, as `/proc/self/status` lists them (`0-1`, `0,2-3`).
fn cpus_of(list: &str) -> Vec<usize> {
    list.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

#[test]
fn ranks_are_bound_to_their_own_share_of_the_cpus() {
    const SHOW: &str =
        "echo \"$(grep Cpus_allowed_list /proc/self/status | cut -f2) ${HCOMM_CPUS:-unset}\"";
    with_timeout(LIMIT, || {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let mine = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(|l| cpus_of(l.trim()))
            .unwrap();
        let seen = |nprocs: usize, bind: hcomm_launch::Bind| {
            let mut spec = LaunchSpec::new(nprocs, "sh", ["-c", SHOW]);
            spec.bind = bind;
            let run = run_captured(&spec);
            assert_eq!(run.result.unwrap(), 0, "stderr: {}", run.err);
            let mut lines: Vec<(usize, Vec<usize>, String)> = run
                .out
                .lines()
                .map(|l| {
                    let (prefix, rest) = l.split_once("] ").unwrap();
                    let (cpus, var) = rest.split_once(' ').unwrap();
                    (prefix[1..].parse().unwrap(), cpus_of(cpus), var.to_string())
                })
                .collect();
            lines.sort();
            lines
        };
        let n = mine.len().min(4);
        if n >= 2 {
            // Spread: disjoint shares that together cover the launcher's CPUs in order, and
            // every rank told how many CPUs the ranks share.
            let got = seen(n, hcomm_launch::Bind::Spread);
            let all: Vec<usize> = got.iter().flat_map(|(_, c, _)| c.clone()).collect();
            assert_eq!(all, mine[..all.len()].to_vec(), "{got:?}");
            assert_eq!(all.len(), mine.len(), "{got:?}");
            assert!(got
                .iter()
                .all(|(_, c, v)| !c.is_empty() && *v == mine.len().to_string()));
        }
        // More ranks than CPUs, or no binding: every rank keeps the launcher's CPUs.
        for (nprocs, bind) in [
            (mine.len() + 1, hcomm_launch::Bind::Spread),
            (2, hcomm_launch::Bind::None),
        ] {
            for (_, cpus, var) in seen(nprocs, bind) {
                assert_eq!(cpus, mine);
                assert_eq!(var, "unset");
            }
        }
    });
}
