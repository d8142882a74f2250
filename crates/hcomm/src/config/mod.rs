//! Bootstrap configuration: who am I, how many of us are there, and where is
//! the master.
//!
//! A process learns its place in the job from one of two places:
//!
//! * the **environment** ([`BootstrapConfig::from_env`]): hcomm's own
//!   `HCOMM_*` variables, or, when those are absent, the variables set by
//!   torchrun, Open MPI, MPICH/PMI or Slurm;
//! * a **rank table** ([`BootstrapConfig::from_rank_table`]): a JSON file
//!   (`hcom_config.json`, see [`RankTable`]) that lists every rank of the job.
//!
//! The tuning knobs (`HCOMM_SPIN_US`, `HCOMM_SHM_CHUNK`, ...) are declared in [`knobs`] and
//! read into a [`Tuning`]; the variables of the bootstrap are [`BOOTSTRAP_VARIABLES`].
//!
//! Every problem is reported as a [`ConfigError`] whose message names the
//! variable or field at fault. `docs/configuration.md` is the user-facing
//! reference for all of this.

pub mod knobs;

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::auth::JobToken;
pub use knobs::{Publish, PublishSetting, Tuning, SHM_CHUNK_RANGE, SHM_P2P_BYTES_RANGE};

/// Which transport hcomm uses between ranks (`HCOMM_TRANSPORT`, or the rank
/// table's `transport` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Let hcomm choose the transport for each pair of ranks (the default).
    #[default]
    Auto,
    /// TCP sockets.
    Tcp,
    /// Shared memory; only possible between ranks on the same host.
    Shm,
}

impl TransportKind {
    fn as_str(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = String;

    /// Parses `auto`, `tcp` or `shm` (ASCII case-insensitive, surrounding
    /// whitespace ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        [TransportKind::Auto, TransportKind::Tcp, TransportKind::Shm]
            .into_iter()
            .find(|k| t.eq_ignore_ascii_case(k.as_str()))
            .ok_or_else(|| format!("'{t}' is not a transport (expected auto, tcp or shm)"))
    }
}

/// Where a process's rank and world size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LaunchSource {
    /// hcomm's own `HCOMM_RANK` / `HCOMM_WORLD_SIZE` (set by `hcomm run` or by hand).
    Hcomm,
    /// torchrun / `torch.distributed` (`RANK` / `WORLD_SIZE`).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`).
    OpenMpi,
    /// MPICH, Intel MPI or another PMI launcher (`PMI_RANK` / `PMI_SIZE`).
    Pmi,
    /// Slurm's `srun` (`SLURM_PROCID` / `SLURM_NTASKS`).
    Slurm,
    /// A rank table file (`hcom_config.json`).
    RankTable,
}

impl fmt::Display for LaunchSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchSource::Hcomm => "hcomm",
            LaunchSource::Torchrun => "torchrun",
            LaunchSource::OpenMpi => "Open MPI",
            LaunchSource::Pmi => "MPICH/PMI",
            LaunchSource::Slurm => "Slurm",
            LaunchSource::RankTable => "rank table",
        })
    }
}

/// Everything a process needs to join an hcomm job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapConfig {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job (at least 1).
    pub world_size: usize,
    /// This process's rank among the ranks on its host, when known.
    pub local_rank: Option<usize>,
    /// Number of ranks on this process's host, when known.
    pub local_world_size: Option<usize>,
    /// Identifies this process's host; ranks with equal ids share a host.
    pub host_id: Option<String>,
    /// Address (IP or host name) of the master (rank 0's rendezvous server).
    pub master_addr: String,
    /// TCP port of the master.
    pub master_port: u16,
    /// How long bootstrap may take before giving up.
    pub timeout: Duration,
    /// Requested transport.
    pub transport: TransportKind,
    /// Network interface to use for sockets, if one was named.
    pub socket_ifname: Option<String>,
    /// Address this rank listens on for data links (the rank table's `host`); `None` lets
    /// hcomm choose (`socket_ifname`, else the address that routes to the master).
    pub listen_host: Option<String>,
    /// File holding the job's shared authentication token, if any (`HCOMM_TOKEN_FILE` or the
    /// rank table's `token_file`).
    pub token_file: Option<PathBuf>,
    /// The job's shared authentication token itself (`HCOMM_JOB_TOKEN`), if given. At most one
    /// of `job_token` and `token_file` is set; see [`BootstrapConfig::token`].
    pub job_token: Option<JobToken>,
    /// Where `rank` and `world_size` came from.
    pub source: LaunchSource,
    /// Data sockets per pair of ranks (`HCOMM_NSOCKS`, `1..=`[`BootstrapConfig::MAX_NSOCKS`]):
    /// large TCP payloads are striped across them (see `docs/multi-host.md`). Every rank of a
    /// job must use the same value.
    pub nsocks: usize,
}

/// Errors found while reading the configuration. Each message names the
/// environment variable or rank-table field at fault.
#[derive(thiserror::Error, Debug)]
pub enum ConfigError {
    /// A variable that must hold a non-negative integer does not.
    #[error("{var}={value} is not a non-negative integer")]
    InvalidInteger {
        /// The variable's name.
        var: String,
        /// Its value.
        value: String,
    },
    /// A port variable is not an integer in 1..=65535.
    #[error("{var}={value} is not a valid port (expected 1-65535)")]
    InvalidPort {
        /// The variable's name.
        var: String,
        /// Its value.
        value: String,
    },
    /// A variable has a value that cannot be used.
    #[error("invalid {var}: {reason}")]
    InvalidValue {
        /// The variable's name.
        var: String,
        /// What is wrong with it (quotes the value).
        reason: String,
    },
    /// Only one of a launcher's rank / world-size pair is set.
    #[error(
        "{present} is set but {missing} is not: rank and world size are taken together \
         from one launcher ({launcher}), so set both or neither"
    )]
    IncompletePair {
        /// The variable that is set.
        present: String,
        /// The variable that is missing.
        missing: String,
        /// The launcher the pair belongs to.
        launcher: LaunchSource,
    },
    /// A world size (global or local) of zero.
    #[error("{var}=0: a world size must be at least 1")]
    ZeroWorldSize {
        /// The variable's name.
        var: String,
    },
    /// The rank is not below the world size.
    #[error("rank {rank} is out of range for world size {world_size} (from {origin})")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
        /// The variable the rank came from.
        origin: String,
    },
    /// A local rank is not below the local world size (or, when that is
    /// unknown, the world size).
    #[error("{var}={value} is out of range: it must be less than {limit_var}={limit}")]
    LocalOutOfRange {
        /// The variable holding the local rank.
        var: String,
        /// Its value.
        value: usize,
        /// The variable holding the limit.
        limit_var: String,
        /// The limit's value.
        limit: usize,
    },
    /// The local world size exceeds the world size.
    #[error("{var}={value} is larger than the world size {size_var}={world_size}")]
    LocalWorldSizeTooLarge {
        /// The variable holding the local world size.
        var: String,
        /// Its value.
        value: usize,
        /// The variable holding the world size.
        size_var: String,
        /// The world size.
        world_size: usize,
    },
    /// No launcher variables were found at all.
    #[error(
        "no rank/world size in the environment: set HCOMM_RANK and HCOMM_WORLD_SIZE, \
         or start under hcomm run, torchrun, mpirun or srun"
    )]
    NoLauncher,
    /// No master address is set and the job may span several hosts.
    #[error(
        "no master address: set HCOMM_MASTER_ADDR (or MASTER_ADDR) to the address of \
         rank 0's host; 127.0.0.1 is only assumed when all {world_size} ranks are evidently \
         on one host (rank and world size from {launcher})"
    )]
    MissingMasterAddr {
        /// The world size.
        world_size: usize,
        /// Where rank and world size came from.
        launcher: LaunchSource,
    },
    /// The job token (`HCOMM_JOB_TOKEN`, or a token file) is unusable. Never quotes the token.
    #[error("{origin}: {reason}")]
    Token {
        /// Where the token came from (the variable, or the file).
        origin: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The rank table file could not be read.
    #[error("rank table {}: cannot read: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The rank table is not valid JSON or does not match the schema.
    #[error("rank table{}: JSON error at line {line} column {column}: {message}", path_suffix(.path))]
    RankTableJson {
        /// The file, when the table was loaded from one.
        path: Option<PathBuf>,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// What the JSON parser reported.
        message: String,
    },
    /// A tuning knob's value is bad ([`knobs`]); the message names the variable, its value
    /// and what it accepts.
    #[error("{message}")]
    Tuning {
        /// What is wrong.
        message: String,
    },
    /// `HCOMM_RANK_TABLE` is set, but none of the variables that give this process's rank.
    #[error(
        "HCOMM_RANK_TABLE is set but no rank variable ({}) is",
        rank_variables().collect::<Vec<_>>().join(", ")
    )]
    NoRankForTable,
    /// The rank table parsed but is inconsistent; the message starts with
    /// the field at fault (such as `ranks[2].rank`) where there is one.
    #[error("rank table{}: {message}", path_suffix(.path))]
    RankTable {
        /// The file, when the table was loaded from one.
        path: Option<PathBuf>,
        /// What is wrong.
        message: String,
    },
}

fn path_suffix(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!(" {}", p.display()))
        .unwrap_or_default()
}

impl ConfigError {
    /// Attaches the rank table's path to rank-table errors that lack one.
    fn with_path(mut self, file: &Path) -> Self {
        if let ConfigError::RankTableJson { path, .. } | ConfigError::RankTable { path, .. } =
            &mut self
        {
            if path.is_none() {
                *path = Some(file.to_path_buf());
            }
        }
        self
    }
}

fn table_err(message: String) -> ConfigError {
    ConfigError::RankTable {
        path: None,
        message,
    }
}

/// The rank and world-size variables of one launcher, plus its local ones.
struct Launcher {
    source: LaunchSource,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static [&'static str],
    local_size: &'static [&'static str],
}

/// Launchers in order of precedence.
const LAUNCHERS: [Launcher; 5] = [
    Launcher {
        source: LaunchSource::Hcomm,
        rank: "HCOMM_RANK",
        size: "HCOMM_WORLD_SIZE",
        local_rank: &[],
        local_size: &[],
    },
    Launcher {
        source: LaunchSource::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: &["LOCAL_RANK"],
        local_size: &["LOCAL_WORLD_SIZE"],
    },
    Launcher {
        source: LaunchSource::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: &["OMPI_COMM_WORLD_LOCAL_RANK"],
        local_size: &["OMPI_COMM_WORLD_LOCAL_SIZE"],
    },
    Launcher {
        source: LaunchSource::Pmi,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
        local_size: &["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"],
    },
    Launcher {
        source: LaunchSource::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: &["SLURM_LOCALID"],
        // SLURM_NTASKS_PER_NODE is handled specially: it is not always a plain integer.
        local_size: &[],
    },
];

/// Every `HCOMM_*` variable of the bootstrap (where the job is and how to reach it), besides
/// the tuning knobs of [`knobs::KNOBS`].
pub const BOOTSTRAP_VARIABLES: [&str; 14] = [
    "HCOMM_RANK",
    "HCOMM_WORLD_SIZE",
    "HCOMM_LOCAL_RANK",
    "HCOMM_LOCAL_WORLD_SIZE",
    "HCOMM_HOST_ID",
    "HCOMM_MASTER_ADDR",
    "HCOMM_MASTER_PORT",
    "HCOMM_TIMEOUT",
    "HCOMM_TRANSPORT",
    "HCOMM_SOCKET_IFNAME",
    "HCOMM_JOB_TOKEN",
    "HCOMM_TOKEN_FILE",
    "HCOMM_NSOCKS",
    "HCOMM_RANK_TABLE",
];

/// `HCOMM_*` variables that hcomm reads outside this module: `HCOMM_DEBUG`, the log level.
pub const OTHER_VARIABLES: [&str; 1] = ["HCOMM_DEBUG"];

/// The variables that may give this process's rank, in order of precedence.
fn rank_variables() -> impl Iterator<Item = &'static str> {
    LAUNCHERS.iter().map(|l| l.rank)
}

/// This process's rank in a job described by a rank table (`HCOMM_RANK_TABLE`): the first of
/// `HCOMM_RANK`, `RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK` and `SLURM_PROCID` that is set, in
/// the variables `get` supplies.
pub fn rank_for_table(get: impl Fn(&str) -> Option<String>) -> Result<usize, ConfigError> {
    let (var, value) = rank_variables()
        .find_map(|v| get(v).map(|value| (v, value)))
        .ok_or(ConfigError::NoRankForTable)?;
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| ConfigError::InvalidInteger {
            var: var.into(),
            value,
        })
}

/// With `HCOMM_RANK_TABLE=path` in the environment, the table's path and this process's rank
/// ([`rank_for_table`]), as [`Communicator::from_env`](crate::Communicator::from_env) joins
/// a job; `None` without it.
pub fn rank_table_from_env() -> Result<Option<(PathBuf, usize)>, ConfigError> {
    match std::env::var_os("HCOMM_RANK_TABLE") {
        Some(table) => Ok(Some((PathBuf::from(table), rank_for_table(env_var)?))),
        None => Ok(None),
    }
}

/// Variable lookup; values are trimmed and empty values count as unset.
struct Vars<F>(F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    fn get(&self, name: &str) -> Option<String> {
        debug_assert!(
            !name.starts_with("HCOMM_")
                || BOOTSTRAP_VARIABLES.contains(&name)
                || knobs::knob(name).is_some(),
            "{name} is neither in BOOTSTRAP_VARIABLES nor a knob"
        );
        (self.0)(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    /// The first of `names` that is set, parsed as a non-negative integer.
    fn first_uint(
        &self,
        names: impl IntoIterator<Item = &'static str>,
    ) -> Result<Option<(usize, &'static str)>, ConfigError> {
        for name in names {
            if let Some(v) = self.get(name) {
                return parse_uint(name, &v).map(|n| Some((n, name)));
            }
        }
        Ok(None)
    }

    fn timeout(&self) -> Result<Option<Duration>, ConfigError> {
        const VAR: &str = "HCOMM_TIMEOUT";
        let Some(v) = self.get(VAR) else {
            return Ok(None);
        };
        let invalid = |reason: String| ConfigError::InvalidValue {
            var: VAR.into(),
            reason,
        };
        let d = parse_duration(&v).map_err(invalid)?;
        if d.is_zero() {
            return Err(invalid(format!(
                "'{v}': the timeout must be greater than zero"
            )));
        }
        if d > BootstrapConfig::MAX_TIMEOUT {
            return Err(invalid(format!(
                "'{v}' is too large: the longest timeout is 100 years ({} s)",
                BootstrapConfig::MAX_TIMEOUT.as_secs()
            )));
        }
        Ok(Some(d))
    }

    fn nsocks(&self) -> Result<Option<usize>, ConfigError> {
        const VAR: &str = "HCOMM_NSOCKS";
        let Some(v) = self.get(VAR) else {
            return Ok(None);
        };
        let n = parse_uint(VAR, &v)?;
        if !(1..=BootstrapConfig::MAX_NSOCKS).contains(&n) {
            return Err(ConfigError::InvalidValue {
                var: VAR.into(),
                reason: format!(
                    "'{v}': the number of sockets per pair of ranks must be 1 to {}",
                    BootstrapConfig::MAX_NSOCKS
                ),
            });
        }
        Ok(Some(n))
    }

    fn transport(&self) -> Result<Option<TransportKind>, ConfigError> {
        const VAR: &str = "HCOMM_TRANSPORT";
        self.get(VAR)
            .map(|v| {
                v.parse().map_err(|reason| ConfigError::InvalidValue {
                    var: VAR.into(),
                    reason,
                })
            })
            .transpose()
    }
}

fn parse_uint(var: &str, value: &str) -> Result<usize, ConfigError> {
    // `usize::from_str` accepts a leading '+'; a launcher never writes one.
    if value.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(n) = value.parse() {
            return Ok(n);
        }
    }
    Err(ConfigError::InvalidInteger {
        var: var.into(),
        value: value.into(),
    })
}

fn parse_port(var: &str, value: &str) -> Result<u16, ConfigError> {
    match value.parse::<u16>() {
        Ok(p) if p != 0 && !value.starts_with('+') => Ok(p),
        _ => Err(ConfigError::InvalidPort {
            var: var.into(),
            value: value.into(),
        }),
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

impl BootstrapConfig {
    /// Master port used when none is configured.
    pub const DEFAULT_PORT: u16 = 29500;
    /// Bootstrap timeout used when none is configured.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

    /// The longest timeout hcomm takes: 100 years. Deadlines are instants, and an instant
    /// further out than the clock can count panics (a timeout of 2^64 seconds did); the
    /// environment and rank tables are refused above it, a configuration built in code is
    /// held to it.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(100 * 365 * 86_400);
    /// Most data sockets per pair of ranks (`HCOMM_NSOCKS`).
    pub const MAX_NSOCKS: usize = 16;

    /// Reads the configuration from the process environment; see
    /// [`BootstrapConfig::from_vars`] for the rules.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(env_var)
    }

    /// The configuration of a process joining a communicator that grows
    /// (`Communicator::join_grown`): the environment's settings (job token, timeout,
    /// transport, interface, host id, sockets per peer) with the grow rendezvous `addr`
    /// (`HOST:PORT`, what the communicator's `grow` was given) as the master. Its rank and
    /// world size come from the communicator it joins; launcher variables are ignored.
    pub fn for_joining(addr: &str) -> Result<Self, ConfigError> {
        Self::for_joining_with(addr, env_var)
    }

    /// [`for_joining`](Self::for_joining) with the variables supplied by `get`.
    pub fn for_joining_with(
        addr: &str,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let bad = |reason: String| ConfigError::InvalidValue {
            var: "the grow address".into(),
            reason,
        };
        let (host, port) = addr
            .rsplit_once(':')
            .ok_or_else(|| bad(format!("'{addr}' is not HOST:PORT")))?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(bad(format!("'{addr}' is not HOST:PORT")));
        }
        let mut cfg = Self::from_vars(|k| match k {
            "HCOMM_RANK" => Some("0".into()),
            "HCOMM_WORLD_SIZE" => Some("1".into()),
            "HCOMM_MASTER_ADDR" => Some(host.into()),
            "HCOMM_MASTER_PORT" => Some(port.into()),
            "HCOMM_RANK_TABLE" | "HCOMM_LOCAL_RANK" | "HCOMM_LOCAL_WORLD_SIZE" => None,
            _ => get(k),
        })?;
        cfg.local_rank = None;
        cfg.local_world_size = None;
        Ok(cfg)
    }

    /// Reads the configuration from variables supplied by `get` (a name to
    /// value lookup, such as `std::env::var`).
    ///
    /// Values are trimmed, and an empty value counts as unset. Rank and world
    /// size come, together, from the first launcher whose variables are set:
    /// `HCOMM_RANK`/`HCOMM_WORLD_SIZE`, then torchrun, Open MPI, MPICH/PMI and
    /// Slurm. `HCOMM_LOCAL_RANK`, `HCOMM_LOCAL_WORLD_SIZE` and the other
    /// `HCOMM_*` variables override what the launcher provides.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let vars = Vars(get);

        let mut found = None;
        for l in &LAUNCHERS {
            match (vars.get(l.rank), vars.get(l.size)) {
                (None, None) => continue,
                (Some(r), Some(s)) => {
                    found = Some((l, r, s));
                    break;
                }
                (r, _) => {
                    let (present, missing) = if r.is_some() {
                        (l.rank, l.size)
                    } else {
                        (l.size, l.rank)
                    };
                    return Err(ConfigError::IncompletePair {
                        present: present.into(),
                        missing: missing.into(),
                        launcher: l.source,
                    });
                }
            }
        }
        let (launcher, rank, world_size) = found.ok_or(ConfigError::NoLauncher)?;
        let rank = parse_uint(launcher.rank, &rank)?;
        let world_size = parse_uint(launcher.size, &world_size)?;
        if world_size == 0 {
            return Err(ConfigError::ZeroWorldSize {
                var: launcher.size.into(),
            });
        }
        if rank >= world_size {
            return Err(ConfigError::RankOutOfRange {
                rank,
                world_size,
                origin: launcher.rank.into(),
            });
        }

        let local_rank = vars.first_uint(
            std::iter::once("HCOMM_LOCAL_RANK").chain(launcher.local_rank.iter().copied()),
        )?;
        let mut local_size = vars.first_uint(
            std::iter::once("HCOMM_LOCAL_WORLD_SIZE").chain(launcher.local_size.iter().copied()),
        )?;
        if local_size.is_none() && launcher.source == LaunchSource::Slurm {
            // Only a plain integer that divides the task count describes every node;
            // forms like "2(x3),1" or uneven splits are ignored.
            const VAR: &str = "SLURM_NTASKS_PER_NODE";
            if let Some(Ok(n)) = vars.get(VAR).map(|v| parse_uint(VAR, &v)) {
                if n >= 1 && world_size % n == 0 {
                    local_size = Some((n, VAR));
                }
            }
        }
        if let Some((n, var)) = local_size {
            if n == 0 {
                return Err(ConfigError::ZeroWorldSize { var: var.into() });
            }
            if n > world_size {
                return Err(ConfigError::LocalWorldSizeTooLarge {
                    var: var.into(),
                    value: n,
                    size_var: launcher.size.into(),
                    world_size,
                });
            }
        }
        if let Some((lr, var)) = local_rank {
            let (limit, limit_var) = local_size.unwrap_or((world_size, launcher.size));
            if lr >= limit {
                return Err(ConfigError::LocalOutOfRange {
                    var: var.into(),
                    value: lr,
                    limit_var: limit_var.into(),
                    limit,
                });
            }
        }
        let local_world_size = local_size.map(|(n, _)| n);

        let single_host = world_size == 1 || local_world_size == Some(world_size);
        let slurm_addr = if launcher.source == LaunchSource::Slurm {
            Some("SLURM_LAUNCH_NODE_IPADDR")
        } else {
            None
        };
        let addr = ["HCOMM_MASTER_ADDR", "MASTER_ADDR"]
            .into_iter()
            .chain(slurm_addr)
            .find_map(|var| vars.get(var).map(|v| (v, var)));
        let master_addr = match addr {
            Some((a, var)) => {
                if a.chars().any(char::is_whitespace) {
                    return Err(ConfigError::InvalidValue {
                        var: var.into(),
                        reason: format!("'{a}' contains whitespace"),
                    });
                }
                a
            }
            None if single_host => "127.0.0.1".to_string(),
            None => {
                return Err(ConfigError::MissingMasterAddr {
                    world_size,
                    launcher: launcher.source,
                })
            }
        };
        let master_port = match ["HCOMM_MASTER_PORT", "MASTER_PORT"]
            .into_iter()
            .find_map(|var| vars.get(var).map(|v| (v, var)))
        {
            Some((v, var)) => parse_port(var, &v)?,
            None => Self::DEFAULT_PORT,
        };

        BootstrapConfig {
            rank,
            world_size,
            local_rank: local_rank.map(|(n, _)| n),
            local_world_size,
            host_id: vars.get("HCOMM_HOST_ID"),
            master_addr,
            master_port,
            timeout: vars.timeout()?.unwrap_or(Self::DEFAULT_TIMEOUT),
            transport: vars.transport()?.unwrap_or_default(),
            socket_ifname: vars.get("HCOMM_SOCKET_IFNAME"),
            listen_host: None,
            token_file: vars.get("HCOMM_TOKEN_FILE").map(PathBuf::from),
            job_token: None,
            source: launcher.source,
            nsocks: vars.nsocks()?.unwrap_or(1),
        }
        .with_env_token(&vars, false)
    }

    /// Take `HCOMM_JOB_TOKEN` from `vars`, unless the rank table names a token file
    /// (`table_file`: the table wins). With `HCOMM_TOKEN_FILE` set too, it is an error.
    fn with_env_token<F: Fn(&str) -> Option<String>>(
        mut self,
        vars: &Vars<F>,
        table_file: bool,
    ) -> Result<Self, ConfigError> {
        const VAR: &str = "HCOMM_JOB_TOKEN";
        let Some(value) = vars.get(VAR) else {
            return Ok(self);
        };
        if table_file {
            return Ok(self);
        }
        if vars.get("HCOMM_TOKEN_FILE").is_some() {
            return Err(ConfigError::Token {
                origin: VAR.into(),
                reason: "HCOMM_TOKEN_FILE is set too: set one of them".into(),
            });
        }
        let token = JobToken::new(value.as_bytes()).map_err(|e| ConfigError::Token {
            origin: VAR.into(),
            reason: e.to_string(),
        })?;
        self.job_token = Some(token);
        Ok(self)
    }

    /// The job token: `job_token`, else the content of `token_file`, else `None` (connections
    /// are then not authenticated).
    pub fn token(&self) -> Result<Option<JobToken>, ConfigError> {
        match (&self.job_token, &self.token_file) {
            (Some(_), Some(_)) => Err(ConfigError::Token {
                origin: "configuration".into(),
                reason: "both a job token and a token file are set: set one of them".into(),
            }),
            (Some(t), None) => Ok(Some(t.clone())),
            (None, Some(path)) => {
                JobToken::from_file(path)
                    .map(Some)
                    .map_err(|e| ConfigError::Token {
                        origin: "HCOMM_TOKEN_FILE / token_file".into(),
                        reason: e.to_string(),
                    })
            }
            (None, None) => Ok(None),
        }
    }

    /// Loads the rank table at `path` (see [`RankTable::load`]) and returns
    /// the configuration of `rank`.
    ///
    /// What the table names wins. For what it leaves out, `HCOMM_TIMEOUT`,
    /// `HCOMM_TRANSPORT`, `HCOMM_SOCKET_IFNAME` and `HCOMM_TOKEN_FILE` from
    /// the environment still apply, then the defaults. `HCOMM_NSOCKS` (which
    /// the table has no field for) always applies.
    pub fn from_rank_table(path: &Path, rank: usize) -> Result<Self, ConfigError> {
        Self::from_rank_table_with(path, rank, env_var)
    }

    fn from_rank_table_with(
        path: &Path,
        rank: usize,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let table = RankTable::load(path)?;
        let mut cfg = table.bootstrap_for(rank).map_err(|e| e.with_path(path))?;
        let vars = Vars(get);
        // The launcher that gave the rank may say how many ranks it started: a table that
        // describes another number would leave the ranks waiting for each other until the
        // timeout.
        if let Some(l) = LAUNCHERS.iter().find(|l| vars.get(l.rank).is_some()) {
            if let Some(v) = vars.get(l.size) {
                let n = parse_uint(l.size, &v)?;
                if n != cfg.world_size {
                    return Err(ConfigError::InvalidValue {
                        var: l.size.into(),
                        reason: format!(
                            "{n} ranks, but the rank table {} describes {}",
                            path.display(),
                            cfg.world_size
                        ),
                    });
                }
            }
        }
        if table.timeout_s.is_none() {
            if let Some(t) = vars.timeout()? {
                cfg.timeout = t;
            }
        }
        if table.transport.is_none() {
            if let Some(t) = vars.transport()? {
                cfg.transport = t;
            }
        }
        if cfg.socket_ifname.is_none() {
            cfg.socket_ifname = vars.get("HCOMM_SOCKET_IFNAME");
        }
        if let Some(n) = vars.nsocks()? {
            cfg.nsocks = n;
        }
        if cfg.token_file.is_none() {
            cfg.token_file = vars.get("HCOMM_TOKEN_FILE").map(PathBuf::from);
        }
        cfg.with_env_token(&vars, table.token_file.is_some())
    }
}

impl From<ConfigError> for crate::base::error::Error {
    fn from(e: ConfigError) -> Self {
        crate::base::error::Error::Config(e.to_string())
    }
}

/// Parses a duration: a plain number of seconds (`"30"`, `"2.5"`) or a
/// number with a unit `ms`, `s`, `m` or `h` (`"500ms"`, `"30s"`, `"2m"`,
/// `"1h"`). Surrounding whitespace is ignored. Negative, empty and malformed
/// values are rejected; the error quotes the input.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let t = s.trim();
    let bad = || {
        format!(
            "'{t}' is not a valid duration (expected seconds such as 30 or 2.5, \
             or a number with a unit: 500ms, 30s, 2m, 1h)"
        )
    };
    if t.is_empty() {
        return Err("empty duration (expected e.g. 30, 2.5, 500ms, 30s, 2m, 1h)".into());
    }
    if t.starts_with('-') {
        return Err(format!(
            "'{t}' is negative: a duration must be greater than zero"
        ));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit_nanos: u128 = match unit.trim_start() {
        "" | "s" => NANOS_PER_SEC,
        "ms" => 1_000_000,
        "m" => 60 * NANOS_PER_SEC,
        "h" => 3600 * NANOS_PER_SEC,
        _ => return Err(bad()),
    };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(bad());
    }
    let too_large = || format!("'{t}' is too large for a duration");
    let int: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_large())?
    };
    // Digits beyond nanosecond precision of an hour do not matter.
    let frac = &frac[..frac.len().min(18)];
    let frac_nanos = if frac.is_empty() {
        0
    } else {
        let digits: u128 = frac.parse().map_err(|_| bad())?;
        digits * unit_nanos / 10u128.pow(frac.len() as u32)
    };
    let total = int
        .checked_mul(unit_nanos)
        .and_then(|n| n.checked_add(frac_nanos))
        .ok_or_else(too_large)?;
    let secs = u64::try_from(total / NANOS_PER_SEC).map_err(|_| too_large())?;
    let nanos = u32::try_from(total % NANOS_PER_SEC).map_err(|_| too_large())?;
    Ok(Duration::new(secs, nanos))
}

/// Checks that `s` is an IPv4/IPv6 literal or an RFC 1123 host name.
fn check_host(s: &str) -> Result<(), String> {
    if s.parse::<IpAddr>().is_ok() || is_hostname(s) {
        Ok(())
    } else {
        Err(format!("'{s}' is not a valid IP address or host name"))
    }
}

fn is_hostname(s: &str) -> bool {
    let s = s.strip_suffix('.').unwrap_or(s);
    if s.is_empty() || s.len() > 253 {
        return false;
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    // An all-numeric last label would make "10.0.0.999" a host name; it is a bad IP.
    s.split('.').all(label_ok)
        && !s
            .rsplit('.')
            .next()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
}

/// The master (rendezvous) endpoint in a rank table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MasterEntry {
    /// IP address or host name of the master.
    pub addr: String,
    /// TCP port of the master, 1..=65535.
    pub port: u16,
}

/// One rank's entry in a rank table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankEntry {
    /// The rank, `0..world_size`.
    pub rank: usize,
    /// Address (IP or host name) this rank listens on.
    pub host: String,
    /// Rank among the ranks with the same host id, `0..count`.
    pub local_rank: usize,
    /// Identifies the rank's host; defaults to `host`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_id: Option<String>,
    /// Network interface for this rank's sockets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ifname: Option<String>,
}

/// The id that groups a rank table entry with the others on its host.
fn host_id_of(entry: &RankEntry) -> &str {
    entry.host_id.as_deref().unwrap_or(&entry.host)
}

/// A rank table (`hcom_config.json`): the whole job's layout in one JSON
/// file. Unknown fields are rejected. See `docs/configuration.md`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankTable {
    /// Schema version; only `"1.0"` is supported.
    pub version: String,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// The master endpoint.
    pub master: MasterEntry,
    /// File holding the job's authentication token. A relative path is
    /// resolved against the table's directory by [`RankTable::load`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Bootstrap timeout in seconds (greater than zero).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Requested transport: `"auto"`, `"tcp"` or `"shm"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<TransportKind>,
    /// One entry per rank, in any order.
    pub ranks: Vec<RankEntry>,
}

impl RankTable {
    const VERSION: &'static str = "1.0";

    /// Parses and validates a rank table from JSON text.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        // serde_path_to_error: a schema error names the field (`master.port`, `ranks[1].rank`),
        // not only where in the text it is.
        let deserializer = &mut serde_json::Deserializer::from_str(json);
        let table: RankTable = match serde_path_to_error::deserialize(deserializer) {
            Ok(t) => t,
            Err(e) => {
                let field = e.path().to_string();
                let e = e.into_inner();
                // Another version may have another schema: report the version,
                // not a field error that follows from it.
                if let Ok(serde_json::Value::Object(map)) = serde_json::from_str(json) {
                    if let Some(serde_json::Value::String(v)) = map.get("version") {
                        if v != Self::VERSION {
                            return Err(table_err(Self::version_message(v)));
                        }
                    }
                }
                let line = e.line();
                let column = e.column();
                let full = e.to_string();
                let message = full
                    .strip_suffix(&format!(" at line {line} column {column}"))
                    .unwrap_or(&full);
                // A syntax error has no field ("."), nor does a missing top-level one.
                let message = if field.is_empty() || field == "." || !e.is_data() {
                    message.to_string()
                } else {
                    format!("{field}: {message}")
                };
                return Err(ConfigError::RankTableJson {
                    path: None,
                    line,
                    column,
                    message,
                });
            }
        };
        table.validate()?;
        Ok(table)
    }

    /// Reads, parses and validates the rank table at `path`. A relative
    /// `token_file` is made relative to the directory holding `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut table = Self::parse(&text).map_err(|e| e.with_path(path))?;
        if let (Some(file), Some(dir)) = (&table.token_file, path.parent()) {
            if file.is_relative() {
                table.token_file = Some(dir.join(file));
            }
        }
        Ok(table)
    }

    fn version_message(v: &str) -> String {
        format!("unsupported version '{v}' (supported: {})", Self::VERSION)
    }

    /// Checks the table: the version; `world_size` ≥ 1; the master address
    /// and port; `timeout_s` and `token_file` when present; every rank's
    /// host, host id and interface; ranks in range, unique, and exactly
    /// `0..world_size`; and, per host id, local ranks unique and exactly
    /// `0..n` for the host's `n` ranks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.version != Self::VERSION {
            return Err(table_err(Self::version_message(&self.version)));
        }
        let ws = self.world_size;
        if ws == 0 {
            return Err(table_err("world_size: must be at least 1".into()));
        }
        check_host(&self.master.addr).map_err(|m| table_err(format!("master.addr: {m}")))?;
        if self.master.port == 0 {
            return Err(table_err("master.port: 0 is not a valid port".into()));
        }
        if let Some(t) = self.timeout_s {
            if t <= 0.0 || Duration::try_from_secs_f64(t).is_err() {
                return Err(table_err(format!(
                    "timeout_s: {t} is not a positive number of seconds"
                )));
            }
            if t > BootstrapConfig::MAX_TIMEOUT.as_secs_f64() {
                return Err(table_err(format!(
                    "timeout_s: {t} is too large: the longest timeout is 100 years ({} s)",
                    BootstrapConfig::MAX_TIMEOUT.as_secs()
                )));
            }
        }
        if self
            .token_file
            .as_ref()
            .is_some_and(|f| f.as_os_str().is_empty())
        {
            return Err(table_err("token_file: must not be empty".into()));
        }
        let count_message = format!(
            "world_size is {ws} but {} ranks are listed",
            self.ranks.len()
        );
        if self.ranks.len() > ws {
            return Err(table_err(count_message));
        }

        // Sized by the entries, never by `world_size` (which the file may set to anything).
        let mut seen: HashMap<usize, usize> = HashMap::with_capacity(self.ranks.len());
        for (i, e) in self.ranks.iter().enumerate() {
            check_host(&e.host).map_err(|m| table_err(format!("ranks[{i}].host: {m}")))?;
            if e.host_id.as_ref().is_some_and(|h| h.trim().is_empty()) {
                return Err(table_err(format!("ranks[{i}].host_id: must not be empty")));
            }
            if let Some(n) = &e.ifname {
                if n.is_empty() || n.chars().any(char::is_whitespace) {
                    return Err(table_err(format!(
                        "ranks[{i}].ifname: '{n}' is not a valid interface name"
                    )));
                }
            }
            if e.rank >= ws {
                return Err(table_err(format!(
                    "ranks[{i}].rank: rank {} is out of range for world size {ws}",
                    e.rank
                )));
            }
            if let Some(j) = seen.insert(e.rank, i) {
                return Err(table_err(format!(
                    "ranks[{i}].rank: duplicate rank {} (also at ranks[{j}])",
                    e.rank
                )));
            }
        }
        if self.ranks.len() < ws {
            // Every listed rank is unique and below `ws`: exactly `ws - len` are missing. Name
            // the first few, walking the gaps between the listed ranks.
            let mut listed: Vec<usize> = seen.into_keys().collect();
            listed.sort_unstable();
            let mut missing = Vec::new();
            let mut next = 0;
            for r in listed.into_iter().chain(std::iter::once(ws)) {
                while next < r && missing.len() <= 8 {
                    missing.push(next.to_string());
                    next += 1;
                }
                next = r.saturating_add(1);
                if missing.len() > 8 {
                    break;
                }
            }
            let count = ws - self.ranks.len();
            let shown = count.min(8);
            let more = if count > shown { ", ..." } else { "" };
            return Err(table_err(format!(
                "missing rank{} {}{more} ({count_message})",
                if count == 1 { "" } else { "s" },
                missing[..shown].join(", "),
            )));
        }

        let mut per_host: HashMap<&str, usize> = HashMap::new();
        for e in &self.ranks {
            *per_host.entry(host_id_of(e)).or_default() += 1;
        }
        let mut local_seen: HashMap<(&str, usize), usize> = HashMap::new();
        for (i, e) in self.ranks.iter().enumerate() {
            let host = host_id_of(e);
            let n = per_host[host];
            if e.local_rank >= n {
                return Err(table_err(format!(
                    "ranks[{i}].local_rank: local_rank {} is out of range for host '{host}', \
                     which has {n} rank{} (local ranks must be 0..{n})",
                    e.local_rank,
                    if n == 1 { "" } else { "s" },
                )));
            }
            if let Some(j) = local_seen.insert((host, e.local_rank), i) {
                return Err(table_err(format!(
                    "ranks[{i}].local_rank: duplicate local_rank {} on host '{host}' \
                     (also at ranks[{j}])",
                    e.local_rank
                )));
            }
        }
        Ok(())
    }

    /// Validates the table and returns the configuration of `rank`, with
    /// `source` [`LaunchSource::RankTable`]. Settings the table leaves out
    /// take their defaults; the environment is not consulted.
    pub fn bootstrap_for(&self, rank: usize) -> Result<BootstrapConfig, ConfigError> {
        self.validate()?;
        let entry = self.ranks.iter().find(|e| e.rank == rank).ok_or_else(|| {
            table_err(format!(
                "requested rank {rank} is out of range for world size {}",
                self.world_size
            ))
        })?;
        let host = host_id_of(entry);
        let local_world_size = self.ranks.iter().filter(|e| host_id_of(e) == host).count();
        Ok(BootstrapConfig {
            rank,
            world_size: self.world_size,
            local_rank: Some(entry.local_rank),
            local_world_size: Some(local_world_size),
            host_id: Some(host.to_string()),
            master_addr: self.master.addr.clone(),
            master_port: self.master.port,
            // validate() checked that the conversion succeeds.
            timeout: self
                .timeout_s
                .and_then(|t| Duration::try_from_secs_f64(t).ok())
                .unwrap_or(BootstrapConfig::DEFAULT_TIMEOUT),
            transport: self.transport.unwrap_or_default(),
            socket_ifname: entry.ifname.clone(),
            listen_host: Some(entry.host.clone()),
            token_file: self.token_file.clone(),
            job_token: None,
            source: LaunchSource::RankTable,
            nsocks: 1,
        })
    }
}

#[cfg(test)]
mod tests;
