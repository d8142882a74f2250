//! The tuning knobs: the `HCOMM_*` variables that change how the library works, not where the
//! job is (that is [`BootstrapConfig`](super::BootstrapConfig)). Each knob is declared once,
//! below, with its variable, what it accepts, its default and a one-line description (in the
//! spirit of NCCL's `NCCL_PARAM`); [`KNOBS`] lists them all. [`Tuning`] holds their values,
//! read and checked once when a communicator is built ([`Tuning::from_env`]) and handed down
//! from there to the code that uses them, which reads no variable itself.
//!
//! `docs/configuration.md` lists every knob with the same description, range and default; a
//! unit test keeps the two in step.

use std::collections::HashMap;
use std::ops::RangeInclusive;

use super::{ConfigError, Vars};
use crate::wire::collective::{Algo, Collective};

/// What a knob's variable accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Accepts {
    /// A whole number (decimal digits) of `unit` in `range`; with `or_zero`, also `0`, which
    /// turns the feature off.
    Number {
        /// What the number counts (`bytes`, `microseconds`).
        unit: &'static str,
        /// The values accepted.
        range: RangeInclusive<usize>,
        /// Whether `0` (off) is accepted too.
        or_zero: bool,
    },
    /// Text, checked by the knob's own parser (its description says what).
    Text,
}

/// A knob's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnobDefault {
    /// One number (of the knob's unit).
    Number(usize),
    /// Words: the default depends on the job, or is "unset".
    Described(&'static str),
}

/// One tuning variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Knob {
    /// The environment variable.
    pub var: &'static str,
    /// What it accepts.
    pub accepts: Accepts,
    /// Its default.
    pub default: KnobDefault,
    /// What it does, in one line (the start of its row in `docs/configuration.md`).
    pub doc: &'static str,
}

/// `HCOMM_SPIN_US`.
pub const SPIN_US: Knob = Knob {
    var: "HCOMM_SPIN_US",
    accepts: Accepts::Number {
        unit: "microseconds",
        range: 0..=1_000_000,
        or_zero: true,
    },
    default: KnobDefault::Described("`50` (`20`, yielding, when ranks outnumber cores)"),
    doc:
        "Microseconds to busy-poll before blocking (shared memory: where the learned window starts)",
};

/// `HCOMM_CPUS`.
pub const CPUS: Knob = Knob {
    var: "HCOMM_CPUS",
    accepts: Accepts::Number {
        unit: "CPUs",
        range: 1..=1_048_576,
        or_zero: false,
    },
    default: KnobDefault::Described("this process's CPUs (its affinity mask)"),
    doc: "CPUs the ranks of this host share, against which the wait policy counts them (more ranks than CPUs yield instead of spinning); `hcomm run` sets it when it binds each rank to its own CPUs",
};

/// The step sizes `HCOMM_SHM_CHUNK` may set (bytes).
pub const SHM_CHUNK_RANGE: RangeInclusive<usize> = (16 << 10)..=(64 << 20);

/// Default bytes of the vector the shared-memory collectives handle per pipeline step.
pub const DEFAULT_SHM_CHUNK: usize = 512 << 10;

/// `HCOMM_SHM_CHUNK`.
pub const SHM_CHUNK: Knob = Knob {
    var: "HCOMM_SHM_CHUNK",
    accepts: Accepts::Number {
        unit: "bytes",
        range: SHM_CHUNK_RANGE,
        or_zero: false,
    },
    default: KnobDefault::Number(DEFAULT_SHM_CHUNK),
    doc: "Bytes per pipeline step of the shared-memory collectives",
};

/// The ring sizes `HCOMM_SHM_P2P_BYTES` may set (bytes; 0 also, for none).
pub const SHM_P2P_BYTES_RANGE: RangeInclusive<usize> = (4 << 10)..=(64 << 20);

/// `HCOMM_SHM_P2P_BYTES`.
pub const SHM_P2P_BYTES: Knob = Knob {
    var: "HCOMM_SHM_P2P_BYTES",
    accepts: Accepts::Number {
        unit: "bytes",
        range: SHM_P2P_BYTES_RANGE,
        or_zero: true,
    },
    default: KnobDefault::Described("256 KiB, less above 16 ranks per host"),
    doc: "Bytes of each shared-memory point-to-point ring (per direction and pair)",
};

/// `HCOMM_SOCKET_BUF`.
pub const SOCKET_BUF: Knob = Knob {
    var: "HCOMM_SOCKET_BUF",
    accepts: Accepts::Number {
        unit: "bytes",
        range: (4 << 10)..=(1 << 30),
        or_zero: true,
    },
    default: KnobDefault::Number(0),
    doc: "TCP socket buffer size in bytes",
};

/// `HCOMM_ALGO`.
pub const ALGO: Knob = Knob {
    var: "HCOMM_ALGO",
    accepts: Accepts::Text,
    default: KnobDefault::Described("chosen by size and topology"),
    doc: "Force an algorithm: one for every collective (`ring`), or per collective \
          (`allreduce=rd,broadcast=chain`, each collective once)",
};

/// `HCOMM_FAULT_INJECT`.
pub const FAULT_INJECT: Knob = Knob {
    var: "HCOMM_FAULT_INJECT",
    accepts: Accepts::Text,
    default: KnobDefault::Described("unset"),
    doc: "`corrupt-one`: the last rank flips one bit of every collective result; \
          `die-in-shrink-setup`: this process kills itself (SIGKILL) while a shrunk \
          communicator is being set up",
};

/// `HCOMM_DETERMINISTIC`.
pub const DETERMINISTIC: Knob = Knob {
    var: "HCOMM_DETERMINISTIC",
    accepts: Accepts::Text,
    default: KnobDefault::Described("`0`"),
    doc: "`1`: reductions give the same bits whatever the algorithm, size, bucket or transport",
};

/// `HCOMM_ACCUMULATE`.
pub const ACCUMULATE: Knob = Knob {
    var: "HCOMM_ACCUMULATE",
    accepts: Accepts::Text,
    default: KnobDefault::Described("`native`"),
    doc: "`f32`: f16 and bf16 sums, products and means are accumulated in f32 and rounded once",
};

/// `HCOMM_SHM_PUBLISH`.
pub const SHM_PUBLISH: Knob = Knob {
    var: "HCOMM_SHM_PUBLISH",
    accepts: Accepts::Text,
    default: KnobDefault::Described("`auto`"),
    doc: "How a rank of the shared-memory collectives writes what its peers read next (staging, its slice of a reduced result): `cache`, plain stores, the lines stay in its CPU's cache; `memory`, streaming stores, the lines go to memory; `auto`, each rank times its calls and uses the cheaper way per collective and size class, trying the other now and then. A VM whose two vCPUs the hypervisor places apart from time to time moves a line from one to the other several times slower then, and reading from memory wins",
};

/// `HCOMM_SKIP_ZEROS`.
pub const SKIP_ZEROS: Knob = Knob {
    var: "HCOMM_SKIP_ZEROS",
    accepts: Accepts::Text,
    default: KnobDefault::Described("`1`"),
    doc: "`1`: sum and mean all-reduces of two ranks on different hosts (and the cross-host step of the hierarchical all-reduce on two hosts), and sum and mean reduce-scatters of two ranks on different hosts (FSDP's gradients), send only the 1 KiB blocks that are not all zero bits, with the dense result's bits; `0`: always dense",
};

/// `HCOMM_GATHER_CACHE_MB`.
pub const GATHER_CACHE_MB: Knob = Knob {
    var: "HCOMM_GATHER_CACHE_MB",
    accepts: Accepts::Number {
        unit: "MiB",
        range: 0..=(1 << 20),
        or_zero: true,
    },
    default: KnobDefault::Described("1/64 of the host's memory shared among its ranks, at most `256`, per communicator"),
    doc: "All-gathers of at least 1 MiB whose ranks span hosts keep their outputs (the same on every rank) up to this many MiB; a rank whose block is bitwise one it sent in a kept all-gather sends a reference instead (FSDP2 gathers the same parameters in forward and backward); `0`: off",
};

/// `HCOMM_TRACE`.
pub const TRACE: Knob = Knob {
    var: "HCOMM_TRACE",
    accepts: Accepts::Text,
    default: KnobDefault::Described("unset (no trace)"),
    doc: "Write a Chrome / Perfetto trace of every operation: a directory (one `hcomm-trace-rank{R}.json` per rank) or a file name containing `{rank}`",
};

/// Every knob, in the order they are checked.
pub const KNOBS: [&Knob; 13] = [
    &SPIN_US,
    &CPUS,
    &SHM_CHUNK,
    &SHM_PUBLISH,
    &SHM_P2P_BYTES,
    &SOCKET_BUF,
    &ALGO,
    &FAULT_INJECT,
    &DETERMINISTIC,
    &ACCUMULATE,
    &SKIP_ZEROS,
    &GATHER_CACHE_MB,
    &TRACE,
];

/// The knob read from `var`, if it is one.
pub fn knob(var: &str) -> Option<&'static Knob> {
    KNOBS.iter().copied().find(|k| k.var == var)
}

/// How a rank writes what its peers read next on shared memory (see `crate::shm::publish`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publish {
    /// Plain stores: the lines stay in this CPU's cache, where a peer sharing it reads them.
    Cache,
    /// Streaming (non-temporal) stores: the lines go to memory, which any CPU reads at the
    /// same speed.
    Memory,
}

/// `HCOMM_SHM_PUBLISH`: learn the way per collective and size, or force one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PublishSetting {
    /// Learned from each call's time (the default).
    #[default]
    Auto,
    /// Always this way.
    Always(Publish),
}

impl std::str::FromStr for PublishSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(PublishSetting::Auto),
            "cache" => Ok(PublishSetting::Always(Publish::Cache)),
            "memory" => Ok(PublishSetting::Always(Publish::Memory)),
            _ => Err(format!("expected auto, cache or memory, not '{s}'")),
        }
    }
}

/// Rounds `n` up to a multiple of 4 KiB (the shared-memory sizes are in pages).
fn round_to_page(n: usize) -> usize {
    n.div_ceil(4096) * 4096
}

/// `n` as `docs/configuration.md` writes it: `512 KiB` (whole KiB, MiB or GiB of bytes), else
/// the number in backquotes.
fn amount(n: usize, unit: &str) -> String {
    if unit == "bytes" && n > 0 {
        for (name, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            if n.is_multiple_of(1 << shift) {
                return format!("{} {name}", n >> shift);
            }
        }
    }
    format!("`{n}`")
}

impl Knob {
    /// The default as `docs/configuration.md` writes it.
    pub fn default_text(&self) -> String {
        match (&self.default, &self.accepts) {
            (KnobDefault::Number(n), Accepts::Number { unit, .. }) => amount(*n, unit),
            (KnobDefault::Number(n), Accepts::Text) => format!("`{n}`"),
            (KnobDefault::Described(words), _) => (*words).to_string(),
        }
    }

    /// The accepted range as `docs/configuration.md` writes it (`16 KiB–64 MiB`,
    /// `4 KiB–1 GiB, or `0``); `None` for text knobs.
    pub fn range_text(&self) -> Option<String> {
        let Accepts::Number {
            unit,
            range,
            or_zero,
        } = &self.accepts
        else {
            return None;
        };
        let (lo, hi) = (*range.start(), *range.end());
        let zero = if *or_zero && lo > 0 { ", or `0`" } else { "" };
        Some(format!("{}–{}{zero}", amount(lo, unit), amount(hi, unit)))
    }

    /// The variable's value (trimmed; empty counts as unset) as a number checked against the
    /// knob's range. Panics for text knobs.
    fn number(
        &self,
        vars: &Vars<impl Fn(&str) -> Option<String>>,
    ) -> Result<Option<usize>, ConfigError> {
        let Accepts::Number {
            unit,
            range,
            or_zero,
        } = &self.accepts
        else {
            panic!("{} is not a number", self.var);
        };
        let var = self.var;
        let Some(value) = vars.get(var) else {
            return Ok(None);
        };
        let (lo, hi) = (*range.start(), *range.end());
        let zero_too = if *or_zero && lo > 0 { " or 0" } else { "" };
        let n = super::parse_uint(var, &value).map_err(|_| ConfigError::Tuning {
            message: format!(
                "{var}={value}: expected a whole number of {unit}, {lo} to {hi}{zero_too}"
            ),
        })?;
        if !(range.contains(&n) || (*or_zero && n == 0)) {
            return Err(ConfigError::Tuning {
                message: format!(
                    "{var}={value}: out of range; expected {lo} to {hi} {unit}{zero_too}"
                ),
            });
        }
        Ok(Some(n))
    }
}

/// The values of the tuning knobs, read and checked once when a communicator is built
/// ([`Tuning::from_env`]) and handed to the parts that use them; sub-communicators inherit
/// their parent's. [`Tuning::default`] is every knob unset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuning {
    /// `HCOMM_SPIN_US`: microseconds to busy-poll before blocking; `None` for the default,
    /// which depends on whether the host's ranks outnumber its cores
    /// ([`WaitPolicy::for_local_ranks`](crate::wait::WaitPolicy::for_local_ranks)).
    pub spin_us: Option<u64>,
    /// `HCOMM_CPUS`: the CPUs the host's ranks share, for the wait policy; `None` for this
    /// process's own CPUs.
    pub cpus: Option<usize>,
    /// `HCOMM_SHM_CHUNK`: bytes per pipeline step of the shared-memory collectives, rounded up
    /// to 4 KiB ([`DEFAULT_SHM_CHUNK`] when unset).
    pub shm_chunk: usize,
    /// `HCOMM_SHM_P2P_BYTES`: bytes of each shared-memory point-to-point ring, rounded up to
    /// 4 KiB; `Some(0)` turns point-to-point over shared memory off; `None` for the default,
    /// which depends on the number of ranks on the host
    /// ([`ring_bytes_for`](crate::shm::p2p::ring_bytes_for)).
    pub shm_p2p_bytes: Option<usize>,
    /// `HCOMM_SOCKET_BUF`: send and receive buffer size of the TCP sockets in bytes; 0 keeps
    /// the kernel's autotuning.
    pub socket_buf: usize,
    /// `HCOMM_ALGO`: the algorithm forced for each collective (none: chosen by size and
    /// topology); see [`parse_algo_overrides`].
    pub algo: HashMap<Collective, Algo>,
    /// `HCOMM_FAULT_INJECT=corrupt-one`: the last rank flips one bit of every collective
    /// result (a test hook, to prove that checks catch wrong results).
    pub corrupt_one: bool,
    /// `HCOMM_FAULT_INJECT=die-in-shrink-setup`: this process kills itself (SIGKILL) after it
    /// joined the store of a shrunk communicator (a test hook for the fault matrix).
    pub die_in_shrink_setup: bool,
    /// `HCOMM_DETERMINISTIC=1`: all-reduce, reduce-scatter and reduce combine the ranks'
    /// contributions in rank order (f16 and bf16 accumulated in f32) whatever the size,
    /// transport or layout ([`crate::algo::canonical`]).
    pub deterministic: bool,
    /// `HCOMM_ACCUMULATE=f32`: f16 and bf16 all-reduce, reduce-scatter and reduce run the
    /// canonical schedules, which accumulate in f32 and round once (as deterministic mode
    /// does, for these two dtypes only).
    pub accumulate_f32: bool,
    /// `HCOMM_SKIP_ZEROS` (default on): two-rank all-reduces across hosts skip zero blocks
    /// ([`crate::algo::skip_zeros`]).
    pub skip_zeros: bool,
    /// `HCOMM_SHM_PUBLISH`: how the shared-memory collectives write what peers read next
    /// (learned per call when [`PublishSetting::Auto`], the default).
    pub shm_publish: PublishSetting,
    /// `HCOMM_GATHER_CACHE_MB`: MiB of all-gather outputs kept between hosts
    /// ([`crate::algo::gather_cache`]); `None` for the default, which depends on the host's
    /// memory and ranks.
    pub gather_cache_mb: Option<usize>,
    /// `HCOMM_TRACE`: where the world communicator writes its trace ([`crate::trace`]).
    pub trace: Option<String>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            spin_us: None,
            cpus: None,
            shm_chunk: DEFAULT_SHM_CHUNK,
            shm_p2p_bytes: None,
            socket_buf: 0,
            algo: HashMap::new(),
            corrupt_one: false,
            die_in_shrink_setup: false,
            deterministic: false,
            accumulate_f32: false,
            skip_zeros: true,
            shm_publish: PublishSetting::Auto,
            gather_cache_mb: None,
            trace: None,
        }
    }
}

impl Tuning {
    /// Reads the knobs from the process environment; see [`Tuning::from_vars`].
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(super::env_var)
    }

    /// Reads the knobs from variables supplied by `get` (a name to value lookup). Values are
    /// trimmed and an empty value counts as unset. A bad value is an error that names the
    /// variable, its value and what it accepts (`HCOMM_SHM_CHUNK=0: out of range; expected
    /// 16384 to 67108864 bytes`).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let vars = Vars(get);
        let spin_us = SPIN_US.number(&vars)?.map(|n| n as u64);
        let cpus = CPUS.number(&vars)?;
        let shm_chunk = SHM_CHUNK
            .number(&vars)?
            .map_or(DEFAULT_SHM_CHUNK, round_to_page);
        let shm_p2p_bytes = SHM_P2P_BYTES.number(&vars)?.map(round_to_page);
        let socket_buf = SOCKET_BUF.number(&vars)?.unwrap_or(0);
        let algo = match vars.get(ALGO.var) {
            Some(spec) => {
                parse_algo_overrides(&spec).map_err(|message| ConfigError::Tuning { message })?
            }
            None => HashMap::new(),
        };
        let (corrupt_one, die_in_shrink_setup) = match vars.get(FAULT_INJECT.var).as_deref() {
            None => (false, false),
            Some("corrupt-one") => (true, false),
            Some("die-in-shrink-setup") => (false, true),
            Some(v) => {
                return Err(ConfigError::Tuning {
                    message: format!(
                        "{}={v}: the faults are corrupt-one (the last rank flips a bit of \
                         every collective result) and die-in-shrink-setup",
                        FAULT_INJECT.var
                    ),
                })
            }
        };
        let deterministic = match vars.get(DETERMINISTIC.var).as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(v) => {
                return Err(ConfigError::Tuning {
                    message: format!("{}={v}: expected 0 or 1", DETERMINISTIC.var),
                })
            }
        };
        let accumulate_f32 = match vars.get(ACCUMULATE.var).as_deref() {
            None | Some("native") => false,
            Some("f32") => true,
            Some(v) => {
                return Err(ConfigError::Tuning {
                    message: format!(
                        "{}={v}: expected f32 (accumulate f16 and bf16 in f32) or native",
                        ACCUMULATE.var
                    ),
                })
            }
        };
        let skip_zeros = match vars.get(SKIP_ZEROS.var).as_deref() {
            None | Some("1") => true,
            Some("0") => false,
            Some(v) => {
                return Err(ConfigError::Tuning {
                    message: format!(
                        "{}={v}: expected 1 (skip zero blocks between hosts) or 0",
                        SKIP_ZEROS.var
                    ),
                })
            }
        };
        let shm_publish = match vars.get(SHM_PUBLISH.var) {
            None => PublishSetting::Auto,
            Some(v) => v.parse().map_err(|e| ConfigError::Tuning {
                message: format!("{}={v}: {e}", SHM_PUBLISH.var),
            })?,
        };
        Ok(Tuning {
            spin_us,
            cpus,
            shm_chunk,
            shm_p2p_bytes,
            socket_buf,
            algo,
            corrupt_one,
            die_in_shrink_setup,
            deterministic,
            accumulate_f32,
            skip_zeros,
            shm_publish,
            gather_cache_mb: GATHER_CACHE_MB.number(&vars)?,
            trace: vars.get(TRACE.var),
        })
    }
}

/// Parses `HCOMM_ALGO`: either one algorithm for every collective that has it (`ring`), or a
/// list of `collective=algo` pairs (`allreduce=rd,broadcast=chain`). The error names the
/// variable and the part at fault.
pub fn parse_algo_overrides(spec: &str) -> Result<HashMap<Collective, Algo>, String> {
    let mut map = HashMap::new();
    let spec = spec.trim();
    if spec.is_empty() {
        return Ok(map);
    }
    if !spec.contains('=') {
        let algo: Algo = spec.parse().map_err(|e| format!("HCOMM_ALGO: {e}"))?;
        for c in Collective::ALL {
            if c.algorithms().contains(&algo) {
                map.insert(c, algo);
            }
        }
        if map.is_empty() && algo != Algo::Auto {
            return Err(format!(
                "HCOMM_ALGO={spec}: no collective has that algorithm"
            ));
        }
        return Ok(map);
    }
    for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
        let (c, a) = part
            .split_once('=')
            .ok_or_else(|| format!("HCOMM_ALGO: '{part}' is not collective=algorithm"))?;
        let coll =
            Collective::parse(c).ok_or_else(|| format!("HCOMM_ALGO: unknown collective '{c}'"))?;
        let algo: Algo = a.parse().map_err(|e| format!("HCOMM_ALGO: {e}"))?;
        if algo != Algo::Auto && !coll.algorithms().contains(&algo) {
            return Err(format!(
                "HCOMM_ALGO: {} cannot run with '{algo}' (choices: {})",
                coll.name(),
                coll.algorithms()
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if let Some(earlier) = map.insert(coll, algo) {
            return Err(format!(
                "HCOMM_ALGO: {} is named twice ('{earlier}' and '{algo}'): give each collective once",
                coll.name()
            ));
        }
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BOOTSTRAP_VARIABLES, OTHER_VARIABLES};

    fn read(pairs: &[(&str, &str)]) -> Result<Tuning, String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Tuning::from_vars(|k| map.get(k).cloned()).map_err(|e| e.to_string())
    }

    fn tuning(pairs: &[(&str, &str)]) -> Result<(), String> {
        read(pairs).map(|_| ())
    }

    #[test]
    fn tuning_variables_are_checked_and_bad_values_named() {
        for good in [
            vec![],
            vec![("HCOMM_SPIN_US", "0")],
            vec![("HCOMM_SPIN_US", " 50 ")],
            vec![("HCOMM_SHM_CHUNK", "16384")],
            vec![("HCOMM_SHM_CHUNK", "")],
            vec![("HCOMM_SHM_P2P_BYTES", "0")],
            vec![("HCOMM_SHM_P2P_BYTES", "262144")],
            vec![("HCOMM_SOCKET_BUF", "0")],
            vec![("HCOMM_SOCKET_BUF", "4194304")],
            vec![("HCOMM_FAULT_INJECT", "corrupt-one")],
            vec![("HCOMM_ALGO", "ring")],
            vec![("HCOMM_ALGO", "allreduce=rd,broadcast=chain")],
            vec![("HCOMM_ACCUMULATE", "f32")],
            vec![("HCOMM_ACCUMULATE", "native")],
            vec![("HCOMM_SKIP_ZEROS", "0")],
            vec![("HCOMM_SKIP_ZEROS", "1")],
            vec![("HCOMM_SHM_PUBLISH", "memory")],
            vec![("HCOMM_SHM_PUBLISH", " auto ")],
        ] {
            assert_eq!(tuning(&good), Ok(()), "{good:?}");
        }
        for (var, value, want) in [
            (
                "HCOMM_SPIN_US",
                "xyz",
                "HCOMM_SPIN_US=xyz: expected a whole number of microseconds",
            ),
            ("HCOMM_SPIN_US", "-1", "HCOMM_SPIN_US=-1: expected"),
            (
                "HCOMM_SPIN_US",
                "2000000",
                "HCOMM_SPIN_US=2000000: out of range",
            ),
            (
                "HCOMM_SHM_CHUNK",
                "xyz",
                "HCOMM_SHM_CHUNK=xyz: expected a whole number of bytes, 16384 to 67108864",
            ),
            (
                "HCOMM_SHM_CHUNK",
                "0",
                "HCOMM_SHM_CHUNK=0: out of range; expected 16384 to 67108864 bytes",
            ),
            (
                "HCOMM_SHM_P2P_BYTES",
                "abc",
                "HCOMM_SHM_P2P_BYTES=abc: expected a whole number of bytes, 4096 to 67108864 or 0",
            ),
            (
                "HCOMM_SHM_P2P_BYTES",
                "100",
                "HCOMM_SHM_P2P_BYTES=100: out of range",
            ),
            ("HCOMM_SOCKET_BUF", "abc", "HCOMM_SOCKET_BUF=abc: expected"),
            (
                "HCOMM_FAULT_INJECT",
                "bogus",
                "HCOMM_FAULT_INJECT=bogus: the faults are corrupt-one",
            ),
            ("HCOMM_ALGO", "allreduce=bogus", "HCOMM_ALGO: "),
            (
                "HCOMM_ALGO",
                "nosuch=ring",
                "HCOMM_ALGO: unknown collective 'nosuch'",
            ),
            (
                "HCOMM_ALGO",
                "allreduce=ring,allreduce=rd",
                "HCOMM_ALGO: all_reduce is named twice ('ring' and 'rd')",
            ),
            (
                "HCOMM_ACCUMULATE",
                "f64",
                "HCOMM_ACCUMULATE=f64: expected f32 (accumulate f16 and bf16 in f32) or native",
            ),
            (
                "HCOMM_SKIP_ZEROS",
                "yes",
                "HCOMM_SKIP_ZEROS=yes: expected 1 (skip zero blocks between hosts) or 0",
            ),
            (
                "HCOMM_SHM_PUBLISH",
                "fast",
                "HCOMM_SHM_PUBLISH=fast: expected auto, cache or memory, not 'fast'",
            ),
        ] {
            let e = tuning(&[(var, value)]).expect_err(value);
            assert!(e.starts_with(want), "{var}={value}: {e}");
        }
    }

    #[test]
    fn values_are_parsed_rounded_and_defaulted() {
        assert_eq!(read(&[]).unwrap(), Tuning::default());
        let t = read(&[
            ("HCOMM_SPIN_US", " 7 "),
            ("HCOMM_SHM_CHUNK", "20000"),
            ("HCOMM_SHM_P2P_BYTES", "5000"),
            ("HCOMM_SOCKET_BUF", "65536"),
            ("HCOMM_ALGO", "ring"),
            ("HCOMM_FAULT_INJECT", " corrupt-one "),
            ("HCOMM_ACCUMULATE", " f32 "),
            ("HCOMM_SKIP_ZEROS", "0"),
        ])
        .unwrap();
        assert!(t.accumulate_f32);
        assert!(!t.skip_zeros);
        assert!(read(&[]).unwrap().skip_zeros);
        assert_eq!(t.spin_us, Some(7));
        assert_eq!(t.shm_chunk, 20480); // rounded up to 4 KiB
        assert_eq!(t.shm_p2p_bytes, Some(8192));
        assert_eq!(t.socket_buf, 65536);
        assert_eq!(t.algo.get(&Collective::AllReduce), Some(&Algo::Ring));
        assert!(t.corrupt_one);
        let off = read(&[("HCOMM_SHM_P2P_BYTES", "0"), ("HCOMM_SPIN_US", "0")]).unwrap();
        assert_eq!(off.shm_p2p_bytes, Some(0));
        assert_eq!(off.spin_us, Some(0));
        let top = read(&[("HCOMM_SHM_CHUNK", "67108864")]).unwrap();
        assert_eq!(top.shm_chunk, 64 << 20);
        assert_eq!(
            read(&[("HCOMM_SHM_CHUNK", "")]).unwrap().shm_chunk,
            DEFAULT_SHM_CHUNK
        );
    }

    /// The rows of the tables of `docs/configuration.md`: (first cell, middle cells, last
    /// cell) of every row whose first cell is a variable in backquotes.
    fn doc_rows(doc: &str) -> Vec<(String, String, String)> {
        doc.lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.trim().trim_matches('|').split(" | ").collect();
                (
                    cells[0].trim().trim_matches('`').to_string(),
                    cells[1..cells.len() - 1].join(" | ").trim().to_string(),
                    cells[cells.len() - 1].trim().to_string(),
                )
            })
            .collect()
    }

    /// Every `HCOMM_*` name in `text`.
    fn hcomm_names(text: &str) -> Vec<&str> {
        let mut names = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find("HCOMM_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            names.push(&tail[..end]);
            rest = &tail[end..];
        }
        names
    }

    #[test]
    fn docs_list_every_knob_with_its_range_and_default() {
        const DOC: &str = include_str!("../../../../docs/configuration.md");
        let rows = doc_rows(DOC);
        for knob in KNOBS {
            let Some((_, meaning, default)) = rows.iter().find(|(v, _, _)| v == knob.var) else {
                panic!("docs/configuration.md has no row for {}", knob.var);
            };
            assert!(
                meaning.starts_with(knob.doc),
                "{}: the doc says '{meaning}', knobs.rs '{}'",
                knob.var,
                knob.doc
            );
            if let Some(range) = knob.range_text() {
                assert!(
                    meaning.contains(&range),
                    "{}: the doc says '{meaning}', which lacks the range '{range}'",
                    knob.var
                );
            }
            assert_eq!(*default, knob.default_text(), "{}'s default", knob.var);
        }
        // And every variable the tables name is one config knows.
        for line in DOC.lines().filter(|l| l.starts_with('|')) {
            for name in hcomm_names(line) {
                assert!(
                    knob(name).is_some()
                        || BOOTSTRAP_VARIABLES.contains(&name)
                        || OTHER_VARIABLES.contains(&name),
                    "docs/configuration.md names {name}, which is neither a knob nor a \
                     bootstrap variable: {line}"
                );
            }
        }
        // And every bootstrap variable has a row.
        for var in BOOTSTRAP_VARIABLES.iter().chain(&OTHER_VARIABLES) {
            assert!(
                rows.iter().any(|(v, _, _)| v == var),
                "docs/configuration.md has no row for {var}"
            );
        }
    }

    #[test]
    fn amounts_as_the_docs_write_them() {
        assert_eq!(amount(512 << 10, "bytes"), "512 KiB");
        assert_eq!(amount(64 << 20, "bytes"), "64 MiB");
        assert_eq!(amount(1 << 30, "bytes"), "1 GiB");
        assert_eq!(amount(0, "bytes"), "`0`");
        assert_eq!(amount(1_000_000, "microseconds"), "`1000000`");
        assert_eq!(SOCKET_BUF.range_text().unwrap(), "4 KiB–1 GiB, or `0`");
        assert_eq!(SPIN_US.range_text().unwrap(), "`0`–`1000000`");
        assert_eq!(ALGO.range_text(), None);
    }
}
