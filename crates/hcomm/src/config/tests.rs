//! Tests of the bootstrap configuration ([`super`]): the environment's sources (hcomm's,
//! torchrun's, Open MPI's, MPICH/PMI's, Slurm's variables) and their precedence, the errors
//! and their messages, `parse_duration`, and rank tables.
//!
//! They use the parent module's items only (`use super::*`).

use super::*;

fn from(pairs: &[(&str, &str)]) -> Result<BootstrapConfig, ConfigError> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    BootstrapConfig::from_vars(|k| map.get(k).cloned())
}

fn ok(pairs: &[(&str, &str)]) -> BootstrapConfig {
    from(pairs).unwrap_or_else(|e| panic!("unexpected error: {e}"))
}

fn err(pairs: &[(&str, &str)]) -> String {
    match from(pairs) {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(haystack: &str, needles: &[&str]) {
    for n in needles {
        assert!(haystack.contains(n), "{haystack:?} does not contain {n:?}");
    }
}

// ---- environment sources ----

#[test]
fn rank_for_a_rank_table() {
    let get = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(
        rank_for_table(get(&[("RANK", " 3 "), ("SLURM_PROCID", "1")])).unwrap(),
        3
    );
    assert_eq!(
        rank_for_table(get(&[("HCOMM_RANK", "2"), ("RANK", "3")])).unwrap(),
        2
    );
    assert_eq!(
        rank_for_table(get(&[("PMI_RANK", "x")]))
            .unwrap_err()
            .to_string(),
        "PMI_RANK=x is not a non-negative integer"
    );
    assert_eq!(
        rank_for_table(get(&[])).unwrap_err().to_string(),
        "HCOMM_RANK_TABLE is set but no rank variable (HCOMM_RANK, RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID) is"
    );
}

#[test]
fn hcomm_vars() {
    let c = ok(&[
        ("HCOMM_RANK", "3"),
        ("HCOMM_WORLD_SIZE", "8"),
        ("HCOMM_LOCAL_RANK", "1"),
        ("HCOMM_LOCAL_WORLD_SIZE", "2"),
        ("HCOMM_HOST_ID", "node-b"),
        ("HCOMM_MASTER_ADDR", "10.0.0.1"),
        ("HCOMM_MASTER_PORT", "1234"),
        ("HCOMM_TIMEOUT", "90s"),
        ("HCOMM_TRANSPORT", "tcp"),
        ("HCOMM_SOCKET_IFNAME", "eth1"),
        ("HCOMM_TOKEN_FILE", "/run/token"),
        ("HCOMM_NSOCKS", "8"),
    ]);
    assert_eq!(
        c,
        BootstrapConfig {
            rank: 3,
            world_size: 8,
            local_rank: Some(1),
            local_world_size: Some(2),
            host_id: Some("node-b".into()),
            master_addr: "10.0.0.1".into(),
            master_port: 1234,
            timeout: Duration::from_secs(90),
            transport: TransportKind::Tcp,
            socket_ifname: Some("eth1".into()),
            listen_host: None,
            token_file: Some(PathBuf::from("/run/token")),
            job_token: None,
            source: LaunchSource::Hcomm,
            nsocks: 8,
        }
    );
}

#[test]
fn torchrun_vars() {
    let c = ok(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "master.example.com"),
        ("MASTER_PORT", "29400"),
    ]);
    assert_eq!((c.rank, c.world_size), (5, 8));
    assert_eq!((c.local_rank, c.local_world_size), (Some(1), Some(4)));
    assert_eq!(c.master_addr, "master.example.com");
    assert_eq!(c.master_port, 29400);
    assert_eq!(c.source, LaunchSource::Torchrun);
}

#[test]
fn openmpi_vars() {
    let c = ok(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
    ]);
    assert_eq!((c.rank, c.world_size), (2, 4));
    assert_eq!((c.local_rank, c.local_world_size), (Some(2), Some(4)));
    // All ranks on one host: loopback is assumed.
    assert_eq!(c.master_addr, "127.0.0.1");
    assert_eq!(c.source, LaunchSource::OpenMpi);
}

#[test]
fn pmi_vars_hydra_names() {
    let c = ok(&[
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("MPI_LOCALRANKID", "1"),
        ("MPI_LOCALNRANKS", "2"),
        ("PMI_LOCAL_RANK", "0"),
        ("PMI_LOCAL_SIZE", "1"),
    ]);
    assert_eq!((c.rank, c.world_size), (1, 2));
    assert_eq!((c.local_rank, c.local_world_size), (Some(1), Some(2)));
    assert_eq!(c.source, LaunchSource::Pmi);
}

#[test]
fn pmi_vars_pmi_local_names() {
    let c = ok(&[
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "2"),
        ("PMI_LOCAL_RANK", "0"),
        ("PMI_LOCAL_SIZE", "2"),
    ]);
    assert_eq!((c.local_rank, c.local_world_size), (Some(0), Some(2)));
    assert_eq!(c.source, LaunchSource::Pmi);
}

#[test]
fn slurm_vars() {
    let c = ok(&[
        ("SLURM_PROCID", "6"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NTASKS_PER_NODE", "4"),
        ("SLURM_LAUNCH_NODE_IPADDR", "192.168.1.10"),
    ]);
    assert_eq!((c.rank, c.world_size), (6, 8));
    assert_eq!((c.local_rank, c.local_world_size), (Some(2), Some(4)));
    assert_eq!(c.master_addr, "192.168.1.10");
    assert_eq!(c.source, LaunchSource::Slurm);
}

#[test]
fn slurm_ntasks_per_node_only_when_plain_and_even() {
    let base = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "5"),
        ("SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1"),
    ];
    for v in ["2(x2),1", "2", "abc"] {
        let mut vars = base.to_vec();
        vars.push(("SLURM_NTASKS_PER_NODE", v));
        assert_eq!(
            ok(&vars).local_world_size,
            None,
            "SLURM_NTASKS_PER_NODE={v}"
        );
    }
}

#[test]
fn slurm_launch_node_addr_only_for_slurm() {
    let e = err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("SLURM_LAUNCH_NODE_IPADDR", "10.1.1.1"),
    ]);
    assert_contains(&e, &["HCOMM_MASTER_ADDR"]);
}

// ---- precedence ----

#[test]
fn hcomm_wins_over_launchers() {
    let c = ok(&[
        ("HCOMM_RANK", "1"),
        ("HCOMM_WORLD_SIZE", "2"),
        ("RANK", "7"),
        ("WORLD_SIZE", "9"),
        ("LOCAL_RANK", "7"),
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("HCOMM_MASTER_ADDR", "10.0.0.2"),
        ("MASTER_ADDR", "10.0.0.3"),
        ("HCOMM_MASTER_PORT", "4000"),
        ("MASTER_PORT", "5000"),
    ]);
    assert_eq!(
        (c.rank, c.world_size, c.source),
        (1, 2, LaunchSource::Hcomm)
    );
    // Local values are not mixed in from another launcher.
    assert_eq!(c.local_rank, None);
    assert_eq!(c.master_addr, "10.0.0.2");
    assert_eq!(c.master_port, 4000);
}

#[test]
fn torchrun_before_openmpi_before_pmi_before_slurm() {
    let all = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "3"),
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "4"),
        ("SLURM_PROCID", "4"),
        ("SLURM_NTASKS", "5"),
        ("MASTER_ADDR", "h"),
    ];
    let c = ok(&all);
    assert_eq!((c.rank, c.source), (1, LaunchSource::Torchrun));
    let c = ok(&all[2..]);
    assert_eq!((c.rank, c.source), (2, LaunchSource::OpenMpi));
    let c = ok(&all[4..]);
    assert_eq!((c.rank, c.source), (3, LaunchSource::Pmi));
    let c = ok(&all[6..]);
    assert_eq!((c.rank, c.source), (4, LaunchSource::Slurm));
}

#[test]
fn hcomm_local_overrides_launcher_local() {
    let c = ok(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ("HCOMM_LOCAL_RANK", "1"),
        ("HCOMM_LOCAL_WORLD_SIZE", "2"),
        ("HCOMM_MASTER_ADDR", "a"),
    ]);
    assert_eq!((c.local_rank, c.local_world_size), (Some(1), Some(2)));
}

#[test]
fn empty_values_count_as_unset() {
    let c = ok(&[
        ("HCOMM_RANK", ""),
        ("HCOMM_WORLD_SIZE", " "),
        ("RANK", " 0 "),
        ("WORLD_SIZE", "1"),
        ("HCOMM_MASTER_ADDR", ""),
        ("HCOMM_TIMEOUT", ""),
    ]);
    assert_eq!(c.source, LaunchSource::Torchrun);
    assert_eq!(c.master_addr, "127.0.0.1");
    assert_eq!(c.timeout, BootstrapConfig::DEFAULT_TIMEOUT);
}

// ---- errors ----

#[test]
fn partial_pairs_name_both_variables() {
    for (set, other) in [
        ("HCOMM_RANK", "HCOMM_WORLD_SIZE"),
        ("HCOMM_WORLD_SIZE", "HCOMM_RANK"),
        ("RANK", "WORLD_SIZE"),
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
        ("PMI_RANK", "PMI_SIZE"),
        ("SLURM_NTASKS", "SLURM_PROCID"),
    ] {
        let e = err(&[(set, "1")]);
        assert_contains(&e, &[set, other]);
    }
}

#[test]
fn partial_pair_is_not_completed_from_another_launcher() {
    let e = err(&[
        ("RANK", "0"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ]);
    assert_contains(&e, &["RANK is set but WORLD_SIZE is not", "torchrun"]);
}

#[test]
fn bad_integers() {
    assert_eq!(
        err(&[("HCOMM_RANK", "abc"), ("HCOMM_WORLD_SIZE", "2")]),
        "HCOMM_RANK=abc is not a non-negative integer"
    );
    for (var, v) in [
        ("WORLD_SIZE", "-1"),
        ("WORLD_SIZE", "+2"),
        ("WORLD_SIZE", "2.0"),
        ("LOCAL_RANK", "x"),
        ("LOCAL_WORLD_SIZE", "99999999999999999999999"),
    ] {
        let mut vars = vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
        vars.retain(|(k, _)| *k != var);
        vars.push((var, v));
        assert_eq!(
            err(&vars),
            format!("{var}={v} is not a non-negative integer")
        );
    }
}

#[test]
fn rank_out_of_range() {
    assert_eq!(
        err(&[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")]),
        "rank 4 is out of range for world size 4 (from OMPI_COMM_WORLD_RANK)"
    );
}

#[test]
fn zero_world_size() {
    let e = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "0")]);
    assert_contains(&e, &["SLURM_NTASKS=0", "at least 1"]);
    let e = err(&[
        ("HCOMM_RANK", "0"),
        ("HCOMM_WORLD_SIZE", "1"),
        ("HCOMM_LOCAL_WORLD_SIZE", "0"),
    ]);
    assert_contains(&e, &["HCOMM_LOCAL_WORLD_SIZE=0"]);
}

#[test]
fn local_rank_out_of_range() {
    let e = err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "4"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "h"),
    ]);
    assert_eq!(
        e,
        "LOCAL_RANK=4 is out of range: it must be less than LOCAL_WORLD_SIZE=4"
    );
    // Without a local size, the local rank must still be below the world size.
    let e = err(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_LAUNCH_NODE_IPADDR", "h"),
    ]);
    assert_contains(&e, &["SLURM_LOCALID=2", "SLURM_NTASKS=2"]);
    // The HCOMM_ override is named when it is the culprit.
    let e = err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "0"),
        ("HCOMM_LOCAL_RANK", "5"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "h"),
    ]);
    assert_contains(&e, &["HCOMM_LOCAL_RANK=5", "LOCAL_WORLD_SIZE=4"]);
}

#[test]
fn local_world_size_larger_than_world() {
    let e = err(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_WORLD_SIZE", "4"),
    ]);
    assert_eq!(
        e,
        "LOCAL_WORLD_SIZE=4 is larger than the world size WORLD_SIZE=2"
    );
}

#[test]
fn nothing_set() {
    assert_eq!(
        err(&[("MASTER_ADDR", "h")]),
        "no rank/world size in the environment: set HCOMM_RANK and HCOMM_WORLD_SIZE, \
         or start under hcomm run, torchrun, mpirun or srun"
    );
}

#[test]
fn missing_master_addr_on_multi_host() {
    // Local size unknown.
    let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
    assert_contains(&e, &["HCOMM_MASTER_ADDR", "torchrun"]);
    // Local size known and smaller than the world.
    let e = err(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]);
    assert_contains(&e, &["HCOMM_MASTER_ADDR"]);
}

#[test]
fn loopback_for_single_host() {
    assert_eq!(
        ok(&[("HCOMM_RANK", "0"), ("HCOMM_WORLD_SIZE", "1")]).master_addr,
        "127.0.0.1"
    );
    let c = ok(&[
        ("HCOMM_RANK", "0"),
        ("HCOMM_WORLD_SIZE", "3"),
        ("HCOMM_LOCAL_WORLD_SIZE", "3"),
    ]);
    assert_eq!(c.master_addr, "127.0.0.1");
}

#[test]
fn bad_master_addr_and_port() {
    let base = [("HCOMM_RANK", "0"), ("HCOMM_WORLD_SIZE", "1")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        err(&v)
    };
    assert_contains(
        &with(&[("MASTER_ADDR", "a b")]),
        &["MASTER_ADDR", "'a b'", "whitespace"],
    );
    for p in ["0", "65536", "-1", "http", "+80"] {
        assert_eq!(
            with(&[("HCOMM_MASTER_PORT", p)]),
            format!("HCOMM_MASTER_PORT={p} is not a valid port (expected 1-65535)")
        );
    }
    assert_contains(
        &with(&[("MASTER_PORT", "0")]),
        &["MASTER_PORT=0", "not a valid port"],
    );
}

#[test]
fn defaults() {
    let c = ok(&[("HCOMM_RANK", "0"), ("HCOMM_WORLD_SIZE", "1")]);
    assert_eq!(c.master_port, 29500);
    assert_eq!(c.master_port, BootstrapConfig::DEFAULT_PORT);
    assert_eq!(c.timeout, Duration::from_secs(300));
    assert_eq!(c.transport, TransportKind::Auto);
    assert_eq!(c.nsocks, 1);
    assert_eq!(
        (
            c.local_rank,
            c.local_world_size,
            c.host_id,
            c.socket_ifname,
            c.token_file
        ),
        (None, None, None, None, None)
    );
}

#[test]
fn nsocks_var() {
    let base = [("HCOMM_RANK", "0"), ("HCOMM_WORLD_SIZE", "1")];
    let with = |v: &'static str| {
        let mut vars = base.to_vec();
        vars.push(("HCOMM_NSOCKS", v));
        from(&vars)
    };
    assert_eq!(with("4").unwrap().nsocks, 4);
    assert_eq!(with(" 16 ").unwrap().nsocks, 16);
    assert_eq!(with("1").unwrap().nsocks, 1);
    for bad in ["0", "17", "1000"] {
        let e = with(bad).unwrap_err().to_string();
        assert_contains(&e, &["HCOMM_NSOCKS", &format!("'{bad}'"), "1 to 16"]);
    }
    for bad in ["four", "-1", "+2", "2.0"] {
        let e = with(bad).unwrap_err().to_string();
        assert_contains(
            &e,
            &[&format!("HCOMM_NSOCKS={bad}"), "not a non-negative integer"],
        );
    }
}

#[test]
fn timeout_and_transport_vars() {
    let base = [("HCOMM_RANK", "0"), ("HCOMM_WORLD_SIZE", "1")];
    let with = |k: &'static str, v: &'static str| {
        let mut vars = base.to_vec();
        vars.push((k, v));
        from(&vars)
    };
    assert_eq!(
        with("HCOMM_TIMEOUT", "2.5").unwrap().timeout,
        Duration::from_millis(2500)
    );
    assert_eq!(
        with("HCOMM_TRANSPORT", "SHM").unwrap().transport,
        TransportKind::Shm
    );
    let e = with("HCOMM_TIMEOUT", "soon").unwrap_err().to_string();
    assert_contains(&e, &["HCOMM_TIMEOUT", "'soon'"]);
    let e = with("HCOMM_TIMEOUT", "0").unwrap_err().to_string();
    assert_contains(&e, &["HCOMM_TIMEOUT", "greater than zero"]);
    // Beyond 100 years a deadline could pass the clock's end (2^64 s panicked): refused.
    for v in ["18446744073709551615", "5124095576030431h", "3153600001"] {
        let e = with("HCOMM_TIMEOUT", v).unwrap_err().to_string();
        assert_contains(&e, &["HCOMM_TIMEOUT", v, "too large", "100 years"]);
    }
    assert_eq!(
        with("HCOMM_TIMEOUT", "3153600000").unwrap().timeout,
        BootstrapConfig::MAX_TIMEOUT
    );
    let e = with("HCOMM_TRANSPORT", "rdma").unwrap_err().to_string();
    assert_contains(&e, &["HCOMM_TRANSPORT", "'rdma'", "auto, tcp or shm"]);
}

#[test]
fn transport_kind_text() {
    for k in [TransportKind::Auto, TransportKind::Tcp, TransportKind::Shm] {
        assert_eq!(k.to_string().parse::<TransportKind>(), Ok(k));
    }
    assert_eq!(" Tcp ".parse::<TransportKind>(), Ok(TransportKind::Tcp));
    assert!("".parse::<TransportKind>().is_err());
    assert_eq!(LaunchSource::OpenMpi.to_string(), "Open MPI");
    assert_eq!(LaunchSource::RankTable.to_string(), "rank table");
}

// ---- parse_duration ----

#[test]
fn parse_duration_accepts() {
    let cases = [
        ("30", Duration::from_secs(30)),
        ("2.5", Duration::from_millis(2500)),
        ("30s", Duration::from_secs(30)),
        ("500ms", Duration::from_millis(500)),
        ("1.5ms", Duration::from_micros(1500)),
        ("2m", Duration::from_secs(120)),
        ("1h", Duration::from_secs(3600)),
        ("0.1", Duration::from_millis(100)),
        (".5s", Duration::from_millis(500)),
        ("5.", Duration::from_secs(5)),
        (" 10 s ", Duration::from_secs(10)),
        ("0", Duration::ZERO),
        ("0.000000001", Duration::from_nanos(1)),
    ];
    for (s, want) in cases {
        assert_eq!(parse_duration(s), Ok(want), "{s:?}");
    }
}

#[test]
fn parse_duration_rejects() {
    for s in [
        "", "  ", "-1", "-1s", "+1", "abc", "1x", "1e3", "1.2.3", ".", "s", "ms", "1 2", "inf",
        "NaN", "1S", "5 min", "1d",
    ] {
        let e = parse_duration(s).expect_err(s);
        if !s.trim().is_empty() {
            assert!(e.contains(s.trim()), "{e:?} should quote {s:?}");
        }
    }
    assert!(parse_duration("99999999999999999999999h")
        .unwrap_err()
        .contains("too large"));
    assert_eq!(
        parse_duration("-5").unwrap_err(),
        "'-5' is negative: a duration must be greater than zero"
    );
}

// ---- rank table ----

const GOOD: &str = r#"{
        "version": "1.0",
        "world_size": 4,
        "master": { "addr": "10.0.0.1", "port": 29500 },
        "token_file": "token",
        "timeout_s": 120,
        "transport": "tcp",
        "ranks": [
            { "rank": 0, "host": "10.0.0.1", "local_rank": 0, "host_id": "node-a", "ifname": "eth0" },
            { "rank": 2, "host": "10.0.0.2", "local_rank": 0 },
            { "rank": 1, "host": "10.0.0.1", "local_rank": 1, "host_id": "node-a" },
            { "rank": 3, "host": "10.0.0.2", "local_rank": 1 }
        ]
    }"#;

fn table_err_text(json: &str) -> String {
    match RankTable::parse(json) {
        Ok(t) => panic!("expected an error, got {t:?}"),
        Err(e) => e.to_string(),
    }
}

/// GOOD with `from` replaced by `to` (which must occur exactly once).
fn edit(from: &str, to: &str) -> String {
    assert_eq!(GOOD.matches(from).count(), 1, "{from:?}");
    GOOD.replace(from, to)
}

#[test]
fn rank_table_parses_and_round_trips() {
    let t = RankTable::parse(GOOD).unwrap();
    assert_eq!(t.world_size, 4);
    assert_eq!(t.transport, Some(TransportKind::Tcp));
    assert_eq!(t.ranks[0].host_id.as_deref(), Some("node-a"));
    let json = serde_json::to_string_pretty(&t).unwrap();
    assert_eq!(RankTable::parse(&json).unwrap(), t);
    assert!(!json.contains("null"), "absent options are omitted: {json}");
}

#[test]
fn rank_table_minimal() {
    let t = RankTable::parse(
        r#"{"version":"1.0","world_size":1,"master":{"addr":"localhost","port":1},
                "ranks":[{"rank":0,"host":"::1","local_rank":0}]}"#,
    )
    .unwrap();
    let c = t.bootstrap_for(0).unwrap();
    assert_eq!(c.timeout, BootstrapConfig::DEFAULT_TIMEOUT);
    assert_eq!(c.transport, TransportKind::Auto);
    assert_eq!(c.host_id.as_deref(), Some("::1"));
    assert_eq!((c.token_file, c.socket_ifname), (None, None));
}

#[test]
fn rank_table_bootstrap_for() {
    let t = RankTable::parse(GOOD).unwrap();
    let c = t.bootstrap_for(1).unwrap();
    assert_eq!(
        c,
        BootstrapConfig {
            rank: 1,
            world_size: 4,
            local_rank: Some(1),
            local_world_size: Some(2),
            host_id: Some("node-a".into()),
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            timeout: Duration::from_secs(120),
            transport: TransportKind::Tcp,
            socket_ifname: None,
            listen_host: Some("10.0.0.1".into()),
            token_file: Some(PathBuf::from("token")),
            job_token: None,
            source: LaunchSource::RankTable,
            nsocks: 1,
        }
    );
    let c = t.bootstrap_for(0).unwrap();
    assert_eq!(c.socket_ifname.as_deref(), Some("eth0"));
    // host_id defaults to host.
    let c = t.bootstrap_for(3).unwrap();
    assert_eq!(c.host_id.as_deref(), Some("10.0.0.2"));
    assert_eq!((c.local_rank, c.local_world_size), (Some(1), Some(2)));
}

#[test]
fn rank_table_rank_argument_out_of_range() {
    let t = RankTable::parse(GOOD).unwrap();
    let e = t.bootstrap_for(4).unwrap_err().to_string();
    assert_eq!(
        e,
        "rank table: requested rank 4 is out of range for world size 4"
    );
}

#[test]
fn rank_table_bad_json_has_line_and_column() {
    let json = "{\n  \"version\": \"1.0\",\n  \"world_size\" 4\n}";
    let e = RankTable::parse(json).unwrap_err();
    match &e {
        ConfigError::RankTableJson { line, column, .. } => {
            assert_eq!((*line, *column), (3, 16));
        }
        other => panic!("{other:?}"),
    }
    let text = e.to_string();
    assert!(
        text.starts_with("rank table: JSON error at line 3 column 16: expected `:`"),
        "{text}"
    );
    assert!(
        !text.ends_with("column 16"),
        "location not repeated: {text}"
    );
}

#[test]
fn rank_table_unknown_field() {
    let e = table_err_text(&edit("\"timeout_s\"", "\"timeout\""));
    assert_contains(&e, &["unknown field `timeout`", "line 6"]);
    let e = table_err_text(&edit("\"ifname\"", "\"iface\""));
    assert_contains(&e, &["unknown field `iface`"]);
    let e = table_err_text(&edit("\"port\": 29500 }", "\"port\": 29500, \"x\": 1 }"));
    assert_contains(&e, &["unknown field `x`"]);
}

#[test]
fn rank_table_missing_and_mistyped_fields() {
    let e = table_err_text(&edit("\"world_size\": 4,", ""));
    assert_contains(&e, &["missing field `world_size`"]);
    // A value of the wrong type or range names its field, not only its place in the text.
    let e = table_err_text(&edit("\"port\": 29500", "\"port\": 70000"));
    assert_contains(&e, &["master.port: invalid value", "70000", "u16"]);
    let e = table_err_text(&edit("\"world_size\": 4", "\"world_size\": \"4\""));
    assert_contains(&e, &["world_size: invalid type: string \"4\""]);
    let e = table_err_text(&edit("\"transport\": \"tcp\"", "\"transport\": \"rdma\""));
    assert_contains(&e, &["transport: ", "rdma", "auto"]);
    let e = table_err_text(&edit("{ \"rank\": 2,", "{ \"rank\": -2,"));
    assert_contains(&e, &["ranks[1].rank: invalid value: integer `-2`"]);
}

#[test]
fn rank_table_bad_version() {
    assert_eq!(
        table_err_text(&edit("\"1.0\"", "\"2.0\"")),
        "rank table: unsupported version '2.0' (supported: 1.0)"
    );
    // Reported as a version problem even when the rest does not fit the 1.0 schema.
    assert_eq!(
        table_err_text(r#"{"version": "2.0", "nodes": []}"#),
        "rank table: unsupported version '2.0' (supported: 1.0)"
    );
}

#[test]
fn rank_table_duplicate_rank() {
    assert_eq!(
        table_err_text(&edit("{ \"rank\": 2,", "{ \"rank\": 0,")),
        "rank table: ranks[1].rank: duplicate rank 0 (also at ranks[0])"
    );
}

#[test]
fn rank_table_rank_out_of_range() {
    assert_eq!(
        table_err_text(&edit("{ \"rank\": 3,", "{ \"rank\": 4,")),
        "rank table: ranks[3].rank: rank 4 is out of range for world size 4"
    );
}

#[test]
fn rank_table_missing_rank_and_count_mismatch() {
    let json = edit(
        ",\n            { \"rank\": 3, \"host\": \"10.0.0.2\", \"local_rank\": 1 }",
        "",
    );
    assert_eq!(
        table_err_text(&json),
        "rank table: missing rank 3 (world_size is 4 but 3 ranks are listed)"
    );
    let json = edit("\"world_size\": 4", "\"world_size\": 3");
    assert_eq!(
        table_err_text(&json),
        "rank table: world_size is 3 but 4 ranks are listed"
    );
    let json = edit("\"world_size\": 4", "\"world_size\": 0");
    assert_contains(&table_err_text(&json), &["world_size", "at least 1"]);
}

#[test]
fn rank_table_bad_addresses() {
    assert_eq!(
        table_err_text(&edit(
            "\"host\": \"10.0.0.2\", \"local_rank\": 0",
            "\"host\": \"10.0.0.999\", \"local_rank\": 0"
        )),
        "rank table: ranks[1].host: '10.0.0.999' is not a valid IP address or host name"
    );
    for bad in ["", "-node", "a..b", "node_1", "a b", "1.2.3", "[::1]"] {
        let e = table_err_text(&edit(
            "\"addr\": \"10.0.0.1\"",
            &format!("\"addr\": \"{bad}\""),
        ));
        assert_contains(
            &e,
            &["master.addr", "is not a valid IP address or host name"],
        );
    }
    for good in [
        "node-1.cluster.local",
        "fe80::1",
        "localhost",
        "a1.",
        "10.0.0.255",
    ] {
        assert!(check_host(good).is_ok(), "{good}");
    }
}

#[test]
fn rank_table_bad_port_and_timeout() {
    assert_eq!(
        table_err_text(&edit("\"port\": 29500", "\"port\": 0")),
        "rank table: master.port: 0 is not a valid port"
    );
    for t in ["0", "-1", "1e300"] {
        let e = table_err_text(&edit("\"timeout_s\": 120", &format!("\"timeout_s\": {t}")));
        assert_contains(&e, &["timeout_s", "not a positive number of seconds"]);
    }
    let e = table_err_text(&edit("\"timeout_s\": 120", "\"timeout_s\": 1e19"));
    assert_contains(&e, &["timeout_s", "too large", "100 years"]);
}

#[test]
fn rank_table_duplicate_local_rank() {
    assert_eq!(
        table_err_text(&edit(
            "\"local_rank\": 1, \"host_id\": \"node-a\"",
            "\"local_rank\": 0, \"host_id\": \"node-a\""
        )),
        "rank table: ranks[2].local_rank: duplicate local_rank 0 on host 'node-a' \
         (also at ranks[0])"
    );
}

#[test]
fn rank_table_local_rank_not_dense() {
    let e = table_err_text(&edit(
        "\"host\": \"10.0.0.2\", \"local_rank\": 1",
        "\"host\": \"10.0.0.2\", \"local_rank\": 2",
    ));
    assert_eq!(
        e,
        "rank table: ranks[3].local_rank: local_rank 2 is out of range for host '10.0.0.2', \
         which has 2 ranks (local ranks must be 0..2)"
    );
}

#[test]
fn rank_table_huge_world_size_allocates_nothing() {
    // Checked against the entries, not by allocating world_size slots.
    let huge = usize::MAX.to_string();
    let json = edit("\"world_size\": 4", &format!("\"world_size\": {huge}"));
    assert_eq!(
        table_err_text(&json),
        format!(
            "rank table: missing ranks 4, 5, 6, 7, 8, 9, 10, 11, ... \
             (world_size is {huge} but 4 ranks are listed)"
        )
    );
    let json = edit("{ \"rank\": 2,", &format!("{{ \"rank\": {},", u64::MAX));
    assert_contains(
        &table_err_text(&json),
        &[".rank: rank 18446744073709551615 is out of range"],
    );
}

#[test]
fn rank_table_bad_ifname_and_host_id() {
    let e = table_err_text(&edit("\"ifname\": \"eth0\"", "\"ifname\": \"\""));
    assert_contains(&e, &["ranks[0].ifname"]);
    let e = table_err_text(&edit(
        "\"local_rank\": 0, \"host_id\": \"node-a\"",
        "\"local_rank\": 0, \"host_id\": \" \"",
    ));
    assert_contains(&e, &["ranks[0].host_id", "must not be empty"]);
}

#[test]
fn rank_table_load_names_file_and_resolves_token_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hcom_config.json");
    std::fs::write(&path, GOOD).unwrap();
    let t = RankTable::load(&path).unwrap();
    assert_eq!(t.token_file, Some(dir.path().join("token")));

    let abs = edit("\"token\"", "\"/etc/hcomm/token\"");
    std::fs::write(&path, abs).unwrap();
    let t = RankTable::load(&path).unwrap();
    assert_eq!(t.token_file, Some(PathBuf::from("/etc/hcomm/token")));

    std::fs::write(&path, edit("{ \"rank\": 2,", "{ \"rank\": 1,")).unwrap();
    let e = RankTable::load(&path).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "rank table {}: ranks[2].rank: duplicate rank 1 (also at ranks[1])",
            path.display()
        )
    );

    std::fs::write(&path, "{").unwrap();
    let e = RankTable::load(&path).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "rank table {}: JSON error at line 1",
            path.display()
        )),
        "{e}"
    );

    let missing = dir.path().join("nope.json");
    let e = RankTable::load(&missing).unwrap_err();
    assert!(matches!(e, ConfigError::Io { .. }));
    assert_contains(&e.to_string(), &["nope.json", "cannot read"]);
}

#[test]
fn job_token_from_env() {
    let base = [("HCOMM_RANK", "0"), ("HCOMM_WORLD_SIZE", "1")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        v
    };
    let c = ok(&with(&[("HCOMM_JOB_TOKEN", "  0123456789abcdef0123 ")]));
    let want = JobToken::new(b"0123456789abcdef0123").unwrap();
    assert_eq!(c.token().unwrap(), Some(want));
    assert!(!format!("{c:?}").contains("0123456789abcdef"), "{c:?}");
    let e = err(&with(&[("HCOMM_JOB_TOKEN", "short-secret")]));
    assert_contains(&e, &["HCOMM_JOB_TOKEN", "at least 16"]);
    assert!(!e.contains("short-secret"), "{e}");
    let e = err(&with(&[
        ("HCOMM_JOB_TOKEN", "0123456789abcdef0123"),
        ("HCOMM_TOKEN_FILE", "/x"),
    ]));
    assert_contains(&e, &["HCOMM_JOB_TOKEN", "HCOMM_TOKEN_FILE is set too"]);
    assert_eq!(ok(&base).token().unwrap(), None);
    // A token file that cannot be read is an error naming it.
    let c = ok(&with(&[("HCOMM_TOKEN_FILE", "/nonexistent/hcomm-token")]));
    let e = c.token().unwrap_err().to_string();
    assert_contains(&e, &["/nonexistent/hcomm-token"]);
}

#[test]
fn rank_table_token_file_wins_over_env_token() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hcom_config.json");
    std::fs::write(&path, GOOD).unwrap();
    std::fs::write(dir.path().join("token"), "table-token-0123456789\n").unwrap();
    let get = |k: &str| (k == "HCOMM_JOB_TOKEN").then(|| "env-token-0123456789".to_string());
    let c = BootstrapConfig::from_rank_table_with(&path, 0, get).unwrap();
    assert_eq!(c.job_token, None);
    let want = JobToken::new(b"table-token-0123456789").unwrap();
    assert_eq!(c.token().unwrap(), Some(want));
    // Without a token_file in the table, the environment's token applies.
    std::fs::write(&path, GOOD.replace("\"token_file\": \"token\",", "")).unwrap();
    let c = BootstrapConfig::from_rank_table_with(&path, 0, get).unwrap();
    let want = JobToken::new(b"env-token-0123456789").unwrap();
    assert_eq!(c.token().unwrap(), Some(want));
}

#[test]
fn from_rank_table_env_fills_only_gaps() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hcom_config.json");
    let env: HashMap<&str, &str> = [
        ("HCOMM_TIMEOUT", "7s"),
        ("HCOMM_TRANSPORT", "shm"),
        ("HCOMM_SOCKET_IFNAME", "ib0"),
        ("HCOMM_TOKEN_FILE", "/env/token"),
        ("HCOMM_MASTER_ADDR", "10.9.9.9"),
        ("HCOMM_NSOCKS", "3"),
    ]
    .into_iter()
    .collect();
    let get = |k: &str| env.get(k).map(|v| v.to_string());

    // The table names everything for rank 0: the environment is ignored.
    std::fs::write(&path, GOOD).unwrap();
    let c = BootstrapConfig::from_rank_table_with(&path, 0, get).unwrap();
    assert_eq!(c.timeout, Duration::from_secs(120));
    assert_eq!(c.transport, TransportKind::Tcp);
    assert_eq!(c.socket_ifname.as_deref(), Some("eth0"));
    assert_eq!(c.token_file, Some(dir.path().join("token")));
    assert_eq!(c.master_addr, "10.0.0.1");
    // The table has no nsocks field: the environment's applies.
    assert_eq!(c.nsocks, 3);
    // Rank 2 has no ifname: the environment fills it in.
    let c = BootstrapConfig::from_rank_table_with(&path, 2, get).unwrap();
    assert_eq!(c.socket_ifname.as_deref(), Some("ib0"));

    // A table without the optional settings takes them from the environment.
    let bare = GOOD
        .replace("\"token_file\": \"token\",", "")
        .replace("\"timeout_s\": 120,", "")
        .replace("\"transport\": \"tcp\",", "");
    std::fs::write(&path, bare).unwrap();
    let c = BootstrapConfig::from_rank_table_with(&path, 1, get).unwrap();
    assert_eq!(c.timeout, Duration::from_secs(7));
    assert_eq!(c.transport, TransportKind::Shm);
    assert_eq!(c.socket_ifname.as_deref(), Some("ib0"));
    assert_eq!(c.token_file, Some(PathBuf::from("/env/token")));
    assert_eq!(c.source, LaunchSource::RankTable);

    // ...and a bad value there is still an error.
    let e = BootstrapConfig::from_rank_table_with(&path, 1, |k: &str| {
        (k == "HCOMM_TIMEOUT").then(|| "-3".to_string())
    })
    .unwrap_err();
    assert_contains(&e.to_string(), &["HCOMM_TIMEOUT", "'-3'"]);

    // A launcher that says it started another number of ranks than the table describes is
    // an error naming both (the ranks would wait for each other until the timeout).
    for (rank_var, size_var) in [("HCOMM_RANK", "HCOMM_WORLD_SIZE"), ("RANK", "WORLD_SIZE")] {
        let e = BootstrapConfig::from_rank_table_with(&path, 0, |k: &str| {
            (k == rank_var)
                .then(|| "0".to_string())
                .or_else(|| (k == size_var).then(|| "1".to_string()))
        })
        .unwrap_err();
        assert_contains(&e.to_string(), &[size_var, "1 ranks", "describes 4"]);
    }
    let agreeing = |k: &str| match k {
        "HCOMM_RANK" => Some("1".to_string()),
        "HCOMM_WORLD_SIZE" => Some("4".to_string()),
        _ => None,
    };
    assert!(BootstrapConfig::from_rank_table_with(&path, 1, agreeing).is_ok());

    // The requested rank must exist; the error names the file.
    let e = BootstrapConfig::from_rank_table(&path, 9)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "rank table {}: requested rank 9 is out of range for world size 4",
            path.display()
        )
    );
}

#[test]
fn a_joining_process_takes_the_grow_address_and_its_settings_but_no_launcher_rank() {
    let get = |k: &str| -> Option<String> {
        match k {
            // A launcher's variables are ignored: the rank comes from the communicator.
            "RANK" => Some("5".into()),
            "WORLD_SIZE" => Some("8".into()),
            "HCOMM_RANK" => Some("7".into()),
            "HCOMM_TIMEOUT" => Some("9".into()),
            "HCOMM_TRANSPORT" => Some("tcp".into()),
            "HCOMM_JOB_TOKEN" => Some("sekret-sekret-sekret".into()),
            _ => None,
        }
    };
    let c = BootstrapConfig::for_joining_with("10.1.2.3:29700", get).unwrap();
    assert_eq!((c.master_addr.as_str(), c.master_port), ("10.1.2.3", 29700));
    assert_eq!(c.timeout, Duration::from_secs(9));
    assert_eq!(c.transport, TransportKind::Tcp);
    assert!(c.token().unwrap().is_some());
    assert_eq!((c.local_rank, c.local_world_size), (None, None));
    for bad in ["10.1.2.3", ":29700", "h:0", "h:port"] {
        let e = BootstrapConfig::for_joining_with(bad, get).unwrap_err();
        assert_contains(&e.to_string(), &["grow address", bad]);
    }
}
