//! `hcomm doctor`: diagnose configuration and connectivity, each problem with its fix.
//!
//! Local checks (any process): the configuration from the environment or a rank table, the
//! master address and port, network interfaces and the one hcomm would use, /dev/shm, the
//! file-descriptor limit. Job checks (under a launcher, or `-np N`): bootstrap, then an
//! all-pairs latency / bandwidth matrix with outliers flagged.

use hcomm::bootstrap::{resolve, select_listen_ip};
use hcomm::config::{BootstrapConfig, RankTable};
use hcomm::{Communicator, ReduceOp};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

/// Outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Fine.
    Ok,
    /// Works, but worth a look.
    Warn,
    /// Will not work.
    Fail,
}

/// A finding: level, what was checked, what was found and how to fix it.
#[derive(Clone, Debug)]
pub struct Finding {
    /// Severity.
    pub level: Level,
    /// Short name of the check.
    pub check: String,
    /// What was found, with the fix when there is a problem.
    pub detail: String,
}

/// The report of one process.
#[derive(Default)]
pub struct Report {
    /// Findings in check order.
    pub findings: Vec<Finding>,
}

impl Report {
    /// Record a finding.
    pub fn add_finding(&mut self, level: Level, check: &str, detail: String) {
        self.add(level, check, detail);
    }

    fn add(&mut self, level: Level, check: &str, detail: impl Into<String>) {
        self.findings.push(Finding {
            level,
            check: check.into(),
            detail: detail.into(),
        });
    }

    /// Worst level seen.
    pub fn worst(&self) -> Level {
        self.findings
            .iter()
            .map(|f| f.level)
            .max()
            .unwrap_or(Level::Ok)
    }

    /// Print on stdout, one line per finding (the report is the command's output, so that
    /// `hcomm doctor > report.txt` keeps it).
    pub fn print(&self, prefix: &str) {
        for f in &self.findings {
            let tag = match f.level {
                Level::Ok => "ok  ",
                Level::Warn => "WARN",
                Level::Fail => "FAIL",
            };
            crate::workers::print_line(&format!("{prefix}[{tag}] {:<16} {}", f.check, f.detail));
        }
    }
}

/// The process listening on local TCP `port`, found through /proc (Linux).
pub fn port_owner(port: u16) -> Option<String> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == "0A" {
                let local_port = f[1]
                    .rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok());
                if local_port == Some(port) {
                    inodes.push(format!("socket:[{}]", f[9]));
                }
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                if inodes.iter().any(|i| target.to_string_lossy() == *i) {
                    let name =
                        std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
                    return Some(format!("pid {pid} ({})", name.trim()));
                }
            }
        }
    }
    Some("another process (no permission to see which)".into())
}

/// Checks that need no other rank.
pub fn local_checks(cfg: Option<&BootstrapConfig>, report: &mut Report) {
    // Master address and port.
    if let Some(cfg) = cfg {
        report.add(
            Level::Ok,
            "config",
            format!(
                "rank {} of {} (from {}), master {}:{}, timeout {:?}",
                cfg.rank, cfg.world_size, cfg.source, cfg.master_addr, cfg.master_port, cfg.timeout
            ),
        );
        match cfg.token() {
            Ok(Some(_)) => report.add(
                Level::Ok,
                "authentication",
                "a job token is set: every connection proves it",
            ),
            Ok(None) if cfg.world_size > 1 => report.add(
                Level::Warn,
                "authentication",
                "no job token (HCOMM_JOB_TOKEN / HCOMM_TOKEN_FILE): whoever reaches the ports can join; `hcomm run` sets one",
            ),
            Ok(None) => {}
            Err(e) => report.add(Level::Fail, "authentication", e.to_string()),
        }
        match resolve(&cfg.master_addr, cfg.master_port) {
            Err(e) => report.add(
                Level::Fail,
                "master address",
                format!(
                    "'{}' does not resolve: {e}; set HCOMM_MASTER_ADDR to rank 0's IP address",
                    cfg.master_addr
                ),
            ),
            Ok(addr) => {
                report.add(
                    Level::Ok,
                    "master address",
                    format!("{} resolves to {}", cfg.master_addr, addr.ip()),
                );
                if cfg.rank == 0 {
                    check_port_free(addr, report);
                } else {
                    check_reachable(
                        cfg.rank,
                        addr,
                        cfg.timeout.min(Duration::from_secs(5)),
                        report,
                    );
                }
            }
        }
    }
    // Interfaces.
    match nix::ifaddrs::getifaddrs() {
        Ok(addrs) => {
            let mut list = Vec::new();
            for ifa in addrs {
                if let Some(a) = ifa.address.as_ref().and_then(|a| {
                    a.as_sockaddr_in()
                        .map(|s| s.ip().to_string())
                        .or_else(|| a.as_sockaddr_in6().map(|s| s.ip().to_string()))
                }) {
                    list.push(format!("{}={a}", ifa.interface_name));
                }
            }
            report.add(Level::Ok, "interfaces", list.join(", "));
        }
        Err(e) => report.add(Level::Warn, "interfaces", format!("cannot list: {e}")),
    }
    if let Some(cfg) = cfg {
        match select_listen_ip(cfg.socket_ifname.as_deref(), cfg.listen_host.as_deref(), &cfg.master_addr, cfg.master_port) {
            Ok(ip) => report.add(
                Level::Ok,
                "data address",
                format!("hcomm would listen on {ip}{}", if cfg.socket_ifname.is_none() { " (the address that routes to the master; set HCOMM_SOCKET_IFNAME to choose)" } else { "" }),
            ),
            Err(e) => report.add(Level::Fail, "data address", format!("{e}")),
        }
    }
    shm_check(report);
    // One rank per job: the probe pins two threads to two CPUs, and ranks probing together
    // would measure one another.
    if cfg.is_none_or(|c| c.rank == 0) {
        cross_core_check(report);
    }
    fd_check(cfg.map_or(1, |c| c.world_size), report);
}

fn check_port_free(addr: SocketAddr, report: &mut Report) {
    match TcpListener::bind(addr) {
        Ok(_) => report.add(Level::Ok, "master port", format!("{addr} is free for rank 0's rendezvous store")),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let who = port_owner(addr.port()).unwrap_or_else(|| "another process".into());
            report.add(Level::Fail, "master port", format!("port {} is in use by {who}: stop it, or choose another HCOMM_MASTER_PORT (hcomm run picks a free one)", addr.port()));
        }
        Err(e) => report.add(Level::Fail, "master port", format!("cannot listen on {addr}: {e}; HCOMM_MASTER_ADDR must be an address of rank 0's host")),
    }
}

fn check_reachable(rank: usize, addr: SocketAddr, wait: Duration, report: &mut Report) {
    // Rank 0 may not have opened the store yet: keep trying for a while, as bootstrap would.
    let t = Instant::now();
    let last = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(3)) {
            Ok(_) => {
                report.add(
                    Level::Ok,
                    "master reachable",
                    format!(
                        "connected to {addr} after {:.0} ms",
                        t.elapsed().as_secs_f64() * 1e3
                    ),
                );
                return;
            }
            Err(e) if t.elapsed() < wait && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => break e,
        }
    };
    if last.kind() == std::io::ErrorKind::ConnectionRefused {
        report.add(
            Level::Fail,
            "master reachable",
            format!("rank {rank} cannot reach {addr}: connection refused for {:.0} s (is rank 0 running, and is the port right?)", wait.as_secs_f64()),
        );
    } else {
        report.add(
            Level::Fail,
            "master reachable",
            format!(
                "rank {rank} cannot reach {addr}: {last} — firewall, or a wrong HCOMM_MASTER_ADDR?"
            ),
        );
    }
}

fn shm_check(report: &mut Report) {
    let dir = Path::new("/dev/shm");
    match nix::sys::statvfs::statvfs(dir) {
        Ok(st) => {
            // The field types differ between platforms (u32 on some 32-bit ones).
            #[allow(clippy::unnecessary_cast)]
            let free = st.blocks_available() as u64 * st.fragment_size() as u64;
            let probe = dir.join(format!("hcomm-doctor-{}", std::process::id()));
            let writable = std::fs::write(&probe, b"x").is_ok();
            let _ = std::fs::remove_file(&probe);
            let level = if !writable {
                Level::Fail
            } else if free < 256 << 20 {
                Level::Warn
            } else {
                Level::Ok
            };
            let fix = if !writable {
                " — cannot create files there: shared memory between local ranks will not work (mount a tmpfs on /dev/shm, or in Docker use --shm-size / --ipc=host)"
            } else if free < 256 << 20 {
                " — little space: raise it (Docker: --shm-size=1g)"
            } else {
                ""
            };
            report.add(
                level,
                "/dev/shm",
                format!(
                    "{} MiB free, {}{fix}",
                    free >> 20,
                    if writable { "writable" } else { "NOT writable" }
                ),
            );
        }
        Err(e) => report.add(
            Level::Warn,
            "/dev/shm",
            format!("not available ({e}): shared memory between local ranks will not work"),
        ),
    }
}

/// How long 256 KiB written on one CPU takes to be read on another ([`crate::cross_core`]),
/// probed a few times: on a VM whose hypervisor sometimes runs the vCPUs where they share no
/// cache, it jumps 3-5x from one moment to the next, and shared-memory speed with it.
fn cross_core_check(report: &mut Report) {
    let mut turns: Vec<f64> = (0..7)
        .filter_map(|i| {
            if i > 0 {
                std::thread::sleep(Duration::from_millis(150));
            }
            crate::cross_core::turn_time().map(|t| t.as_secs_f64() * 1e6)
        })
        .collect();
    if turns.is_empty() {
        report.add(
            Level::Ok,
            "cross-core",
            "not measured (one CPU, or no pinning)",
        );
        return;
    }
    turns.sort_by(f64::total_cmp);
    let (lo, hi) = (turns[0], turns[turns.len() - 1]);
    let what = format!(
        "256 KiB written on one CPU is read on another in {:.1} µs (median of {} probes over 1 s; {lo:.1}-{hi:.1})",
        turns[turns.len() / 2],
        turns.len()
    );
    if crate::cross_core::same_state(lo, hi) {
        report.add(Level::Ok, "cross-core", what);
    } else {
        report.add(
            Level::Warn,
            "cross-core",
            format!("{what}: the CPUs moved between sharing a cache and not while measured (a VM's hypervisor placing its vCPUs); shared-memory collectives will run 2-4x slower at times, the peers' too (hcomm adapts how it writes, HCOMM_SHM_PUBLISH=auto; benchmarks record the state, `hcomm bench`'s header)"),
        );
    }
}

fn fd_check(world: usize, report: &mut Report) {
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => {
            let need = 2 * world as u64 + 64;
            if soft < need {
                report.add(Level::Warn, "fd limit", format!("soft limit {soft} < {need} needed for {world} ranks: raise it with `ulimit -n {}`", need.min(hard)));
            } else {
                report.add(Level::Ok, "fd limit", format!("soft {soft}, hard {hard}"));
            }
        }
        Err(e) => report.add(Level::Warn, "fd limit", format!("cannot read: {e}")),
    }
}

/// Validate a rank table file.
pub fn rank_table_check(path: &Path, report: &mut Report) -> Option<RankTable> {
    match RankTable::load(path) {
        Ok(t) => {
            report.add(
                Level::Ok,
                "rank table",
                format!(
                    "{}: version {}, {} ranks, master {}:{}",
                    path.display(),
                    t.version,
                    t.world_size,
                    t.master.addr,
                    t.master.port
                ),
            );
            Some(t)
        }
        Err(e) => {
            report.add(Level::Fail, "rank table", format!("{e}"));
            None
        }
    }
}

/// All-pairs latency (8 B ping-pong, µs one way) and bandwidth (4 MiB ping-pong, GB/s)
/// matrices, measured one pair at a time; rank 0 gets them.
pub fn pair_matrix(comm: &Communicator) -> hcomm::Result<(Vec<f64>, Vec<f64>)> {
    let n = comm.world_size();
    let me = comm.rank();
    let mut lat = vec![0f64; n * n];
    let mut bw = vec![0f64; n * n];
    let small = [0u8; 8];
    let big = vec![0u8; 4 << 20];
    let mut sbuf = [0u8; 8];
    let mut bbuf = vec![0u8; 4 << 20];
    for i in 0..n {
        for j in i + 1..n {
            comm.barrier()?;
            if me != i && me != j {
                continue;
            }
            let other = if me == i { j } else { i };
            let pingpong = |data: &[u8], buf: &mut [u8], reps: usize| -> hcomm::Result<f64> {
                let t = Instant::now();
                for _ in 0..reps {
                    if me == i {
                        comm.send_bytes(other, 1, data)?;
                        comm.recv_bytes(other, 1, buf)?;
                    } else {
                        comm.recv_bytes(other, 1, buf)?;
                        comm.send_bytes(other, 1, data)?;
                    }
                }
                Ok(t.elapsed().as_secs_f64() / reps as f64 / 2.0)
            };
            pingpong(&small, &mut sbuf, 20)?;
            let l = pingpong(&small, &mut sbuf, 200)?;
            let b = big.len() as f64 / pingpong(&big, &mut bbuf, 5)? / 1e9;
            if me == i {
                lat[i * n + j] = l * 1e6;
                lat[j * n + i] = l * 1e6;
                bw[i * n + j] = b;
                bw[j * n + i] = b;
            }
        }
    }
    comm.all_reduce_in_place(&mut lat, ReduceOp::Max)?;
    comm.all_reduce_in_place(&mut bw, ReduceOp::Max)?;
    Ok((lat, bw))
}

/// Print the matrices and flag pairs far from the median.
pub fn print_matrix(n: usize, lat: &[f64], bw: &[f64], hosts: &[String]) -> Vec<Finding> {
    let mut findings = Vec::new();
    let pairs: Vec<(usize, usize)> = (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .collect();
    if pairs.is_empty() {
        return findings;
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let lat_med = median(pairs.iter().map(|&(i, j)| lat[i * n + j]).collect());
    let bw_med = median(pairs.iter().map(|&(i, j)| bw[i * n + j]).collect());
    for (title, m, fmt) in [
        ("latency, 8 B one way (us)", lat, 1usize),
        ("bandwidth, 4 MiB (GB/s)", bw, 2),
    ] {
        println!("{title}");
        print!("{:>8}", "");
        for j in 0..n {
            print!("{:>9}", format!("r{j}"));
        }
        println!();
        for i in 0..n {
            print!("{:>8}", format!("r{i}"));
            for j in 0..n {
                if i == j {
                    print!("{:>9}", "-");
                } else {
                    print!("{:>9.*}", fmt, m[i * n + j]);
                }
            }
            println!(
                "   {}",
                hosts
                    .get(i)
                    .map(|h| h.split(':').next().unwrap_or(h))
                    .unwrap_or("")
            );
        }
    }
    for (i, j) in pairs {
        let (l, b) = (lat[i * n + j], bw[i * n + j]);
        if l > 3.0 * lat_med && l > lat_med + 20.0 {
            findings.push(Finding { level: Level::Warn, check: "slow pair".into(), detail: format!("ranks {i} and {j}: {l:.1} us vs median {lat_med:.1} us — a congested or remote link, or an oversubscribed host?") });
        }
        if b < bw_med / 3.0 {
            findings.push(Finding { level: Level::Warn, check: "slow pair".into(), detail: format!("ranks {i} and {j}: {b:.2} GB/s vs median {bw_med:.2} GB/s — check the interface hcomm uses (HCOMM_SOCKET_IFNAME)") });
        }
    }
    if findings.is_empty() {
        findings.push(Finding {
            level: Level::Ok,
            check: "pairs".into(),
            detail: format!("no outliers (median {lat_med:.1} us, {bw_med:.2} GB/s)"),
        });
    }
    findings
}
