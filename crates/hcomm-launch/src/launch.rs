//! The local launcher behind `hcomm run -n N -- PROGRAM ARGS…`.
//!
//! [`launch`] starts `nprocs` copies of a program on this node, one per local
//! rank, tells each one who it is through environment variables (both the
//! `HCOMM_*` names and the ones `torchrun` sets), forwards their output with a
//! `[rank] ` prefix, and supervises them:
//!
//! * the first rank (in time) that exits non-zero or dies by a signal decides
//!   the launcher's exit code, and the other ranks are stopped (SIGTERM to
//!   each rank's process group, SIGKILL after [`LaunchSpec::grace`]);
//! * SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded the same
//!   way, and the launcher then reports `128 + signo` (130 for Ctrl-C);
//! * nothing the launcher started is left running when [`launch`] returns:
//!   every rank is reaped, and each rank's process group (which holds the
//!   rank's descendants unless they moved to a group of their own) is killed.
//!
//! Every rank runs in its own process group, with stdin connected to
//! `/dev/null`.
//!
//! Each job gets a fresh random token ([`ENV_JOB_TOKEN`], 32 bytes from the
//! operating system's generator) that its ranks prove on every connection,
//! unless the environment (or [`LaunchSpec::extra_env`]) already names a
//! token or a token file, which the ranks then use. A job on several nodes
//! needs the same token on every node, so there the launcher makes none: set
//! one (it warns when none is set and the job runs unauthenticated).

use std::ffi::{OsStr, OsString};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// Environment variable holding the global rank of a process.
pub const ENV_RANK: &str = "HCOMM_RANK";
/// Environment variable holding the total number of ranks on all nodes.
pub const ENV_WORLD_SIZE: &str = "HCOMM_WORLD_SIZE";
/// Environment variable holding the rank of a process among those on its node.
pub const ENV_LOCAL_RANK: &str = "HCOMM_LOCAL_RANK";
/// Environment variable holding the number of ranks on the node.
pub const ENV_LOCAL_WORLD_SIZE: &str = "HCOMM_LOCAL_WORLD_SIZE";
/// Environment variable holding the rendezvous address.
pub const ENV_MASTER_ADDR: &str = "HCOMM_MASTER_ADDR";
/// Environment variable holding the rendezvous port.
pub const ENV_MASTER_PORT: &str = "HCOMM_MASTER_PORT";
/// Environment variable holding the job's shared secret, which every connection proves.
pub const ENV_JOB_TOKEN: &str = "HCOMM_JOB_TOKEN";
/// Environment variable naming a file that holds the job's shared secret.
pub const ENV_TOKEN_FILE: &str = "HCOMM_TOKEN_FILE";

/// Default rendezvous address ([`LaunchSpec::master_addr`]).
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// Default time between SIGTERM and SIGKILL ([`LaunchSpec::grace`]).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3);

/// Lines longer than this are forwarded in pieces of this size, each with its
/// own prefix, so a child that never writes a newline cannot make the
/// launcher buffer without bound.
const MAX_LINE: usize = 64 * 1024;

/// How long [`launch`] waits, after the last rank is gone, for the output
/// pipes to close (at least; it waits [`LaunchSpec::grace`] if that is longer).
const MIN_DRAIN: Duration = Duration::from_secs(1);

/// What to launch and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Number of ranks to start on this node (at least 1).
    pub nprocs: usize,
    /// Program to run; looked up in `PATH` when it has no `/`.
    pub program: OsString,
    /// Arguments passed to every rank.
    pub args: Vec<OsString>,
    /// Rendezvous address handed to the ranks (default `127.0.0.1`).
    pub master_addr: String,
    /// Rendezvous port handed to the ranks. `None` picks a free port on
    /// `master_addr` (single node only).
    pub master_port: Option<u16>,
    /// Number of nodes taking part (default 1).
    pub nnodes: usize,
    /// Index of this node, below `nnodes` (default 0). Global rank =
    /// `node_rank * nprocs + local_rank`, world size = `nnodes * nprocs`.
    pub node_rank: usize,
    /// Extra environment variables set in every rank, after (and so
    /// overriding) the launcher's own.
    pub extra_env: Vec<(String, String)>,
    /// Prefix each output line with `[R] ` (R = global rank); default true.
    /// Without a prefix [`launch`] lets the ranks inherit its stdout/stderr.
    pub prefix_output: bool,
    /// Time between SIGTERM and SIGKILL when stopping ranks (default 3 s).
    pub grace: Duration,
    /// A rank killed by a signal does not stop the others, nor set the exit code (default
    /// false): for fault-tolerant programs whose survivors go on without it
    /// (`Communicator::shrink`). A rank that exits with a non-zero code still sets it.
    pub keep_going: bool,
    /// How the ranks are placed on this node's CPUs (default [`Bind::Spread`]).
    pub bind: Bind,
}

/// The variable telling a bound rank how many CPUs the host's ranks share (hcomm's
/// `HCOMM_CPUS` knob).
pub const ENV_CPUS: &str = "HCOMM_CPUS";

/// CPU placement of the local ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Bind {
    /// When the ranks do not outnumber the CPUs the launcher may use, rank `i` of `n` is
    /// bound to its own share of them (CPUs `i·C/n .. (i+1)·C/n` of the `C` allowed): two
    /// ranks never share a core, as Open MPI's default `--bind-to core` does for two ranks,
    /// while a rank on a large machine keeps many cores for its compute threads. More ranks
    /// than CPUs are left to the scheduler. On a 2-vCPU VM with one busy process beside two
    /// ranks, unbound ranks could be placed on one core and wait a time slice per exchange.
    #[default]
    Spread,
    /// Leave placement to the scheduler.
    None,
}

impl std::str::FromStr for Bind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "spread" => Ok(Bind::Spread),
            "none" => Ok(Bind::None),
            _ => Err(format!("'{s}' is not a binding (spread, none)")),
        }
    }
}

/// The CPUs local rank `local` of `nprocs` is bound to under `bind`, out of `allowed` (the
/// launcher's own CPUs, ascending); `None` when it is left unbound.
pub fn cpus_for_rank(
    bind: Bind,
    local: usize,
    nprocs: usize,
    allowed: &[usize],
) -> Option<Vec<usize>> {
    let c = allowed.len();
    if bind == Bind::None || nprocs == 0 || nprocs > c || local >= nprocs {
        return None;
    }
    Some(allowed[local * c / nprocs..(local + 1) * c / nprocs].to_vec())
}

/// The CPUs this process may run on, ascending.
fn allowed_cpus() -> Vec<usize> {
    use nix::sched::{sched_getaffinity, CpuSet};
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The calling thread bound to some CPUs until dropped, when its own CPUs come back: a rank
/// spawned meanwhile starts bound (no window in which it runs elsewhere, and no code between
/// fork and exec).
struct BoundThread(nix::sched::CpuSet);

impl BoundThread {
    /// Bind this thread to `cpus` (for spawning `rank`); a failure leaves the rank unbound,
    /// with a warning.
    fn to(rank: usize, cpus: &[usize]) -> Option<BoundThread> {
        use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
        let me = Pid::from_raw(0);
        let before = sched_getaffinity(me).ok()?;
        let mut set = CpuSet::new();
        for &c in cpus {
            set.set(c).ok()?;
        }
        match sched_setaffinity(me, &set) {
            Ok(()) => Some(BoundThread(before)),
            Err(e) => {
                eprintln!(
                    "hcomm run: could not bind rank {rank} to CPUs {cpus:?}: {e}; it runs unbound"
                );
                None
            }
        }
    }
}

impl Drop for BoundThread {
    fn drop(&mut self) {
        let _ = nix::sched::sched_setaffinity(Pid::from_raw(0), &self.0);
    }
}

impl Default for LaunchSpec {
    fn default() -> Self {
        LaunchSpec {
            nprocs: 1,
            program: OsString::new(),
            args: Vec::new(),
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port: None,
            nnodes: 1,
            node_rank: 0,
            extra_env: Vec::new(),
            prefix_output: true,
            grace: DEFAULT_GRACE,
            keep_going: false,
            bind: Bind::Spread,
        }
    }
}

impl LaunchSpec {
    /// A spec for `nprocs` ranks of `program args…` with every other field at
    /// its default.
    pub fn new<P, I, A>(nprocs: usize, program: P, args: I) -> Self
    where
        P: Into<OsString>,
        I: IntoIterator<Item = A>,
        A: Into<OsString>,
    {
        LaunchSpec {
            nprocs,
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            ..LaunchSpec::default()
        }
    }

    /// Total number of ranks on all nodes (`nnodes * nprocs`).
    pub fn world_size(&self) -> usize {
        self.nnodes.saturating_mul(self.nprocs)
    }

    /// Global rank of local rank `local_rank` on this node.
    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.node_rank
            .saturating_mul(self.nprocs)
            .saturating_add(local_rank)
    }

    /// Checks the spec; the error message says what is wrong.
    pub fn validate(&self) -> Result<(), LaunchError> {
        let invalid = |msg: String| Err(LaunchError::InvalidSpec(msg));
        if self.nprocs == 0 {
            return invalid("the number of processes per node must be at least 1".into());
        }
        if self.nnodes == 0 {
            return invalid("the number of nodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return invalid(format!(
                "node rank {} is out of range: it must be below the number of nodes ({})",
                self.node_rank, self.nnodes
            ));
        }
        if self.nnodes.checked_mul(self.nprocs).is_none() {
            return invalid(format!(
                "world size {} nodes x {} processes is too large",
                self.nnodes, self.nprocs
            ));
        }
        if self.program.is_empty() {
            return invalid("no program given to run".into());
        }
        if self.master_addr.is_empty() {
            return invalid("the master address must not be empty".into());
        }
        match self.master_port {
            Some(0) => return invalid("the master port must not be 0".into()),
            None if self.nnodes > 1 => {
                return invalid(format!(
                    "a master port must be given when running on {} nodes, \
                     so that every node uses the same one",
                    self.nnodes
                ))
            }
            _ => {}
        }
        for (key, value) in &self.extra_env {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return invalid(format!("invalid environment variable name {key:?}"));
            }
            if value.contains('\0') {
                return invalid(format!(
                    "the value of environment variable {key} contains a NUL byte"
                ));
            }
        }
        Ok(())
    }
}

/// Why [`launch`] could not run the job.
#[derive(thiserror::Error, Debug)]
pub enum LaunchError {
    /// A rank could not be started; the ranks started before it were stopped.
    #[error("cannot start rank {rank} ({}): {source}", .program.to_string_lossy())]
    Spawn {
        /// Global rank that failed to start.
        rank: usize,
        /// The program that was to be run.
        program: OsString,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// The [`LaunchSpec`] is unusable.
    #[error("invalid launch: {0}")]
    InvalidSpec(String),
    /// Anything else: picking a port, starting a thread, installing the
    /// signal handler.
    #[error("launcher I/O error: {0}")]
    Io(#[from] io::Error),
}

/// A writer shared between the output threads of [`launch_with_output`];
/// each line is written under one lock.
pub type SharedWriter = Arc<Mutex<dyn Write + Send>>;

/// The port `hcomm run` gives torch.distributed (`MASTER_PORT`) next to hcomm's (`port`,
/// `HCOMM_MASTER_PORT`): with `--master HOST:PORT` (`given`) the next one up (every node must
/// agree; the one below for 65535), else another free port.
pub fn torch_port(port: u16, given: bool, addr: &str) -> io::Result<u16> {
    if given {
        return Ok(port.checked_add(1).unwrap_or(port - 1));
    }
    loop {
        let p = free_port(addr)?;
        if p != port {
            return Ok(p);
        }
    }
}

/// Returns a TCP port that is free on `addr` right now, outside the system's
/// ephemeral range so that nothing the system numbers itself can take it before
/// rank 0 binds it ([`hcomm::bootstrap::free_master_port`]).
pub fn free_port(addr: &str) -> io::Result<u16> {
    hcomm::bootstrap::free_master_port(addr)
}

/// Runs the job described by `spec` and returns the exit code `hcomm run`
/// should exit with: 0 when every rank exited 0, else the code of the first
/// rank that failed (`128 + signo` for a rank killed by a signal), or
/// `128 + signo` when the launcher itself got SIGINT, SIGTERM or SIGHUP.
///
/// Output goes to this process's stdout/stderr, line by line with a `[R] `
/// prefix when [`LaunchSpec::prefix_output`] is set, else inherited directly.
pub fn launch(spec: &LaunchSpec) -> Result<i32, LaunchError> {
    let output = Output {
        piped: spec.prefix_output,
        prefix: spec.prefix_output,
        out: Sink::Stdout,
        err: Sink::Stderr,
    };
    run(spec, output, &|_| spec.program.clone())
}

/// Like [`launch`], but the ranks' stdout and stderr lines, and the
/// launcher's own messages, are written to `out` and `err` (always piped,
/// prefixed only when [`LaunchSpec::prefix_output`] is set).
pub fn launch_with_output(
    spec: &LaunchSpec,
    out: SharedWriter,
    err: SharedWriter,
) -> Result<i32, LaunchError> {
    let output = Output {
        piped: true,
        prefix: spec.prefix_output,
        out: Sink::Shared(out),
        err: Sink::Shared(err),
    };
    run(spec, output, &|_| spec.program.clone())
}

// ---------------------------------------------------------------------------
// Output

/// Where forwarded lines go.
#[derive(Clone)]
enum Sink {
    Stdout,
    Stderr,
    Shared(SharedWriter),
}

impl Sink {
    /// Writes `buf` (one or more whole lines) under a single lock.
    fn write_locked(&self, buf: &[u8]) -> io::Result<()> {
        match self {
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(buf)?;
                out.flush()
            }
            Sink::Stderr => io::stderr().lock().write_all(buf),
            Sink::Shared(writer) => {
                let mut out = lock(writer);
                out.write_all(buf)?;
                out.flush()
            }
        }
    }

    /// Prints a launcher message (best effort).
    fn message(&self, msg: &str) {
        let _ = self.write_locked(format!("hcomm run: {msg}\n").as_bytes());
    }
}

struct Output {
    /// Pipe the ranks' stdout/stderr through reader threads (else inherit).
    piped: bool,
    /// Prefix forwarded lines with `[R] `.
    prefix: bool,
    out: Sink,
    err: Sink,
}

/// Copies `src` to `sink` line by line, each line prefixed with `prefix`,
/// until end of file. Keeps draining `src` when `sink` fails, so the child
/// never blocks on a full pipe.
fn forward_lines(src: impl Read, prefix: &[u8], sink: &Sink) {
    let mut reader = BufReader::new(src);
    let mut line = Vec::with_capacity(prefix.len() + 256);
    line.extend_from_slice(prefix);
    let mut sink_ok = true;
    loop {
        line.truncate(prefix.len());
        match (&mut reader)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line)
        {
            Ok(0) => break,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                if sink_ok {
                    sink_ok = sink.write_locked(&line).is_ok();
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------
// Signals

/// How a rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exit {
    Code(i32),
    Signal(i32),
    /// Its status could not be read (someone else reaped it).
    Unknown,
}

impl Exit {
    /// The exit code a shell would report.
    fn code(self) -> i32 {
        match self {
            Exit::Code(code) => code,
            Exit::Signal(signo) => 128 + signo,
            Exit::Unknown => 1,
        }
    }

    fn describe(self) -> String {
        match self {
            Exit::Code(code) => format!("exited with code {code}"),
            Exit::Signal(signo) => format!("was killed by signal {}", signal_name(signo)),
            Exit::Unknown => "ended with an unknown status".to_string(),
        }
    }
}

fn signal_name(signo: i32) -> String {
    match Signal::try_from(signo) {
        Ok(sig) => sig.as_str().to_string(),
        Err(_) => format!("{signo}"),
    }
}

enum Event {
    /// Rank at this index of the rank table has ended (not yet reaped).
    Exited { index: usize, exit: Exit },
    /// The launcher received this signal.
    Signal(i32),
}

/// Launches in progress, each listening for the launcher's signals.
static SUBSCRIBERS: Mutex<Vec<(u64, Sender<Event>)>> = Mutex::new(Vec::new());
static NEXT_SUBSCRIBER: AtomicU64 = AtomicU64::new(0);
/// Set once the signal thread runs; holds the error if it could not start.
static SIGNAL_THREAD: OnceLock<Result<(), String>> = OnceLock::new();

/// Installs (once per process) handlers for SIGINT, SIGTERM and SIGHUP, and
/// a thread that passes those signals on to every launch in progress. A
/// signal that arrives while no launch is in progress gets its default
/// action (terminating the process).
fn install_signal_thread() -> io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let started = SIGNAL_THREAD.get_or_init(|| {
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
            .map_err(|e| format!("cannot install signal handlers: {e}"))?;
        thread::Builder::new()
            .name("hcomm-launch-signals".into())
            .spawn(move || {
                for signo in signals.forever() {
                    dispatch_signal(signo);
                }
            })
            .map(drop)
            .map_err(|e| format!("cannot start the signal thread: {e}"))
    });
    started.clone().map_err(io::Error::other)
}

fn dispatch_signal(signo: i32) {
    let subscribers = lock(&SUBSCRIBERS);
    if subscribers.is_empty() {
        drop(subscribers);
        let _ = signal_hook::low_level::emulate_default_handler(signo);
        return;
    }
    for (_, tx) in subscribers.iter() {
        let _ = tx.send(Event::Signal(signo));
    }
}

/// Registration of one launch with the signal thread; removed on drop.
struct Subscription(u64);

impl Subscription {
    fn new(tx: Sender<Event>) -> Self {
        let id = NEXT_SUBSCRIBER.fetch_add(1, Ordering::Relaxed);
        lock(&SUBSCRIBERS).push((id, tx));
        Subscription(id)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        lock(&SUBSCRIBERS).retain(|(id, _)| *id != self.0);
    }
}

// ---------------------------------------------------------------------------
// Ranks

/// One started rank. Its pid is also its process group id.
struct Rank {
    rank: usize,
    pid: Pid,
    exit: Option<Exit>,
    waiter: Option<JoinHandle<()>>,
}

/// Waits until `pid` has ended, without reaping it: the zombie keeps the pid
/// (and so the process group id) from being reused until [`reap`].
fn wait_for_exit(pid: Pid) -> Exit {
    loop {
        match waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
            Ok(WaitStatus::Exited(_, code)) => return Exit::Code(code),
            Ok(WaitStatus::Signaled(_, sig, _)) => return Exit::Signal(sig as i32),
            Err(Errno::EINTR) => {}
            Ok(_) | Err(_) => return Exit::Unknown,
        }
    }
}

/// Reaps `pid` (blocking until it has ended).
fn reap(pid: Pid) {
    while let Err(Errno::EINTR) = waitpid(pid, None) {}
}

/// Sends `sig` to the process group of `pid` (best effort).
fn signal_group(pid: Pid, sig: Signal) {
    let _ = killpg(pid, sig);
}

/// Kills and reaps a rank that was started but cannot be supervised.
fn abandon(pid: Pid) {
    signal_group(pid, Signal::SIGKILL);
    reap(pid);
}

/// Things each spawned rank needs besides the spec.
struct Ctx<'a> {
    spec: &'a LaunchSpec,
    output: &'a Output,
    port: u16,
    /// `MASTER_PORT` for torch.distributed's own store: not hcomm's port, so that a program
    /// using both (hcomm's API and a gloo group, say) does not bind one port twice.
    torch_port: u16,
    /// The token this launcher made for the job, if it made one. Never printed.
    token: Option<&'a str>,
    events: &'a Sender<Event>,
    readers_done: &'a Sender<()>,
    /// The CPUs the launcher may use (for [`LaunchSpec::bind`]).
    cpus: Vec<usize>,
}

/// Starts local rank `local` with its output threads and its waiter thread.
fn spawn_rank(
    ctx: &Ctx<'_>,
    index: usize,
    local: usize,
    program: &OsStr,
    readers: &mut Vec<JoinHandle<()>>,
) -> Result<Rank, LaunchError> {
    let spec = ctx.spec;
    let rank = spec.global_rank(local);
    let world = spec.world_size().to_string();
    let (rank_s, local_s, nprocs_s) =
        (rank.to_string(), local.to_string(), spec.nprocs.to_string());
    let port = ctx.port.to_string();
    let torch_port = ctx.torch_port.to_string();

    let mut cmd = Command::new(program);
    cmd.args(&spec.args).process_group(0).stdin(Stdio::null());
    for (hcomm, torch, value) in [
        (ENV_RANK, "RANK", &rank_s),
        (ENV_WORLD_SIZE, "WORLD_SIZE", &world),
        (ENV_LOCAL_RANK, "LOCAL_RANK", &local_s),
        (ENV_LOCAL_WORLD_SIZE, "LOCAL_WORLD_SIZE", &nprocs_s),
        (ENV_MASTER_ADDR, "MASTER_ADDR", &spec.master_addr),
    ] {
        cmd.env(hcomm, value).env(torch, value);
    }
    cmd.env(ENV_MASTER_PORT, &port)
        .env("MASTER_PORT", &torch_port);
    if let Some(token) = ctx.token {
        cmd.env(ENV_JOB_TOKEN, token);
    }
    let cpus = cpus_for_rank(spec.bind, local, spec.nprocs, &ctx.cpus);
    if cpus.is_some() && std::env::var_os(ENV_CPUS).is_none() {
        // A rank bound to one CPU must not take that for the job's CPUs (its wait policy).
        cmd.env(ENV_CPUS, ctx.cpus.len().to_string());
    }
    cmd.envs(spec.extra_env.iter().map(|(k, v)| (k, v)));
    if ctx.output.piped {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }

    // The child inherits the spawning thread's CPUs: bind this thread for the spawn only
    // (the output threads started below keep the launcher's CPUs).
    let spawned = {
        let _bound = cpus.and_then(|cpus| BoundThread::to(rank, &cpus));
        cmd.spawn()
    };
    let mut child = spawned.map_err(|source| LaunchError::Spawn {
        rank,
        program: program.to_owned(),
        source,
    })?;
    let pid = Pid::from_raw(i32::try_from(child.id()).expect("pid fits in pid_t"));
    let pipes = [
        (
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
            &ctx.output.out,
        ),
        (
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
            &ctx.output.err,
        ),
    ];
    // Dropping a `std::process::Child` neither kills nor waits for it; from
    // here on the pid is all we use.
    drop(child);

    let prefix = if ctx.output.prefix {
        format!("[{rank}] ")
    } else {
        String::new()
    };
    for (pipe, sink) in pipes {
        let Some(pipe) = pipe else { continue };
        let (prefix, sink, done) = (prefix.clone(), sink.clone(), ctx.readers_done.clone());
        let reader = thread::Builder::new()
            .name(format!("hcomm-rank{rank}-out"))
            .spawn(move || {
                forward_lines(pipe, prefix.as_bytes(), &sink);
                drop(done);
            });
        match reader {
            Ok(handle) => readers.push(handle),
            Err(e) => {
                abandon(pid);
                return Err(e.into());
            }
        }
    }

    let events = ctx.events.clone();
    let waiter = thread::Builder::new()
        .name(format!("hcomm-rank{rank}-wait"))
        .spawn(move || {
            let exit = wait_for_exit(pid);
            let _ = events.send(Event::Exited { index, exit });
        });
    match waiter {
        Ok(handle) => Ok(Rank {
            rank,
            pid,
            exit: None,
            waiter: Some(handle),
        }),
        Err(e) => {
            abandon(pid);
            Err(e.into())
        }
    }
}

/// Supervises the started ranks until all of them have ended; returns the
/// launcher's exit code. `stop_now` stops them right away (a later rank
/// could not be started).
fn supervise(
    ranks: &mut [Rank],
    rx: &Receiver<Event>,
    spec: &LaunchSpec,
    err: &Sink,
    stop_now: bool,
) -> i32 {
    let mut running = ranks.len();
    let mut result = 0;
    let mut stopping = false;
    // When set, ranks still running then get SIGKILL.
    let mut kill_at: Option<Instant> = None;

    let term_running = |ranks: &[Rank], sig: Signal| {
        for r in ranks.iter().filter(|r| r.exit.is_none()) {
            signal_group(r.pid, sig);
        }
    };
    if stop_now {
        stopping = true;
        term_running(ranks, Signal::SIGTERM);
        kill_at = Some(Instant::now() + spec.grace);
    }

    while running > 0 {
        let event = match kill_at {
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    term_running(ranks, Signal::SIGKILL);
                    kill_at = None;
                    continue;
                }
                match rx.recv_timeout(deadline - now) {
                    Ok(event) => event,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            None => match rx.recv() {
                Ok(event) => event,
                Err(_) => break,
            },
        };
        match event {
            Event::Exited { index, exit } => {
                let Some(r) = ranks.get_mut(index) else {
                    continue;
                };
                if r.exit.is_some() {
                    continue;
                }
                r.exit = Some(exit);
                running -= 1;
                if spec.keep_going && matches!(exit, Exit::Signal(_)) && !stopping {
                    err.message(&format!(
                        "rank {} {}; the others go on (--keep-going)",
                        r.rank,
                        exit.describe()
                    ));
                    continue;
                }
                if exit.code() != 0 && !stopping {
                    stopping = true;
                    result = exit.code();
                    let what = format!("rank {} {}", r.rank, exit.describe());
                    if running > 0 {
                        err.message(&format!("{what}; stopping the other ranks"));
                        term_running(ranks, Signal::SIGTERM);
                        kill_at = Some(Instant::now() + spec.grace);
                    } else {
                        err.message(&what);
                    }
                }
            }
            Event::Signal(signo) => {
                if !stopping {
                    stopping = true;
                    result = 128 + signo;
                    err.message(&format!(
                        "received {}; stopping all ranks",
                        signal_name(signo)
                    ));
                    term_running(ranks, Signal::SIGTERM);
                    kill_at = Some(Instant::now() + spec.grace);
                } else {
                    err.message(&format!(
                        "received {} while stopping; killing all ranks",
                        signal_name(signo)
                    ));
                    term_running(ranks, Signal::SIGKILL);
                    kill_at = None;
                }
            }
        }
    }
    result
}

/// The token to export to the ranks: a fresh one, unless a token or token file
/// is given already (the ranks inherit it) or the job spans several nodes
/// (where each node's launcher would make a different one).
fn job_token(spec: &LaunchSpec, err: &Sink) -> Result<Option<String>, LaunchError> {
    let given = |var: &str| {
        std::env::var_os(var).is_some_and(|v| !v.to_string_lossy().trim().is_empty())
            || spec
                .extra_env
                .iter()
                .any(|(k, v)| k == var && !v.trim().is_empty())
    };
    if given(ENV_JOB_TOKEN) || given(ENV_TOKEN_FILE) {
        return Ok(None);
    }
    if spec.nnodes > 1 {
        err.message(&format!(
            "neither {ENV_JOB_TOKEN} nor {ENV_TOKEN_FILE} is set: the {} nodes cannot share \
             a generated token, so this job's connections are not authenticated \
             (set the same {ENV_TOKEN_FILE} or {ENV_JOB_TOKEN} on every node)",
            spec.nnodes
        ));
        return Ok(None);
    }
    Ok(Some(hcomm::auth::generate_token()?))
}

/// The whole launch; `program_of(local_rank)` names the program to run
/// (always `spec.program`, except in tests).
fn run(
    spec: &LaunchSpec,
    output: Output,
    program_of: &dyn Fn(usize) -> OsString,
) -> Result<i32, LaunchError> {
    spec.validate()?;
    let port = match spec.master_port {
        Some(port) => port,
        None => free_port(&spec.master_addr)?,
    };
    let torch_port = torch_port(port, spec.master_port.is_some(), &spec.master_addr)?;
    let token = job_token(spec, &output.err)?;
    // Before any rank exists, so that a signal cannot kill the launcher and
    // leave ranks behind.
    install_signal_thread()?;

    let (tx, rx) = mpsc::channel();
    let subscription = Subscription::new(tx.clone());
    let (readers_done, all_readers_done) = mpsc::channel::<()>();
    let mut readers = Vec::new();
    let mut ranks = Vec::with_capacity(spec.nprocs);
    let mut failure = None;
    {
        let ctx = Ctx {
            spec,
            output: &output,
            port,
            torch_port,
            token: token.as_deref(),
            events: &tx,
            readers_done: &readers_done,
            cpus: allowed_cpus(),
        };
        for local in 0..spec.nprocs {
            match spawn_rank(&ctx, ranks.len(), local, &program_of(local), &mut readers) {
                Ok(rank) => ranks.push(rank),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
    }
    drop(tx);
    drop(readers_done);

    let code = supervise(&mut ranks, &rx, spec, &output.err, failure.is_some());
    drop(subscription);

    // Every rank leader has ended but is not reaped yet, so its pid still
    // names its process group: kill whatever the rank left running there
    // (it could hold the output pipes open), then reap.
    for r in &ranks {
        signal_group(r.pid, Signal::SIGKILL);
    }
    for r in &mut ranks {
        reap(r.pid);
        if let Some(waiter) = r.waiter.take() {
            let _ = waiter.join();
        }
    }

    // Let the output threads finish the last lines; give up on them if a
    // descendant that left its rank's process group keeps a pipe open.
    let drain_until = Instant::now() + spec.grace.max(MIN_DRAIN);
    let drained = loop {
        let left = drain_until.saturating_duration_since(Instant::now());
        match all_readers_done.recv_timeout(left) {
            Ok(()) => {}
            Err(RecvTimeoutError::Disconnected) => break true,
            Err(RecvTimeoutError::Timeout) => break false,
        }
    };
    if drained {
        for reader in readers {
            let _ = reader.join();
        }
    } else {
        output.err.message(
            "some output is still open after all ranks ended \
             (a descendant left its rank's process group?); not waiting for it",
        );
    }

    match failure {
        Some(e) => Err(e),
        None => Ok(code),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(nprocs: usize) -> LaunchSpec {
        LaunchSpec::new(nprocs, "sh", ["-c", "true"])
    }

    fn invalid(spec: &LaunchSpec) -> String {
        match spec.validate() {
            Err(LaunchError::InvalidSpec(msg)) => msg,
            other => panic!("expected InvalidSpec, got {other:?}"),
        }
    }

    #[test]
    fn spread_gives_each_rank_its_own_share() {
        let cpus = [2, 3, 6, 7, 9];
        let share = |local, n| cpus_for_rank(Bind::Spread, local, n, &cpus);
        assert_eq!(share(0, 2), Some(vec![2, 3]));
        assert_eq!(share(1, 2), Some(vec![6, 7, 9]));
        assert_eq!(
            (0..5).map(|r| share(r, 5).unwrap()).collect::<Vec<_>>(),
            [[2], [3], [6], [7], [9]]
        );
        assert_eq!(share(0, 6), None, "more ranks than CPUs");
        assert_eq!(cpus_for_rank(Bind::None, 0, 2, &cpus), None);
        assert_eq!(cpus_for_rank(Bind::Spread, 0, 1, &[]), None);
        assert_eq!("none".parse::<Bind>(), Ok(Bind::None));
        assert!("core".parse::<Bind>().unwrap_err().contains("spread, none"));
    }

    #[test]
    fn defaults() {
        let s = LaunchSpec::default();
        assert_eq!(s.nprocs, 1);
        assert_eq!(s.master_addr, "127.0.0.1");
        assert_eq!(s.master_port, None);
        assert_eq!((s.nnodes, s.node_rank), (1, 0));
        assert!(s.prefix_output);
        assert_eq!(s.grace, Duration::from_secs(3));
        assert!(spec(2).validate().is_ok());
    }

    #[test]
    fn validation_messages() {
        assert!(invalid(&spec(0)).contains("at least 1"));
        let mut s = spec(2);
        s.nnodes = 2;
        s.node_rank = 2;
        s.master_port = Some(1234);
        assert!(invalid(&s).contains("node rank 2"));
        s.node_rank = 1;
        assert!(s.validate().is_ok());
        s.master_port = None;
        assert!(invalid(&s).contains("master port"));
        s.master_port = Some(0);
        assert!(invalid(&s).contains("must not be 0"));
        let mut s = spec(1);
        s.program = OsString::new();
        assert!(invalid(&s).contains("no program"));
        let mut s = spec(1);
        s.nnodes = 0;
        assert!(invalid(&s).contains("nodes"));
        let mut s = spec(usize::MAX);
        s.nnodes = 2;
        s.master_port = Some(1);
        assert!(invalid(&s).contains("too large"));
        let mut s = spec(1);
        s.extra_env.push(("A=B".into(), "x".into()));
        assert!(invalid(&s).contains("A=B"));
    }

    #[test]
    fn rank_arithmetic() {
        let mut s = spec(4);
        s.nnodes = 3;
        s.node_rank = 2;
        assert_eq!(s.world_size(), 12);
        assert_eq!(s.global_rank(0), 8);
        assert_eq!(s.global_rank(3), 11);
    }

    #[test]
    fn exit_codes_and_descriptions() {
        assert_eq!(Exit::Code(0).code(), 0);
        assert_eq!(Exit::Code(3).code(), 3);
        assert_eq!(Exit::Signal(9).code(), 137);
        assert_eq!(Exit::Unknown.code(), 1);
        assert_eq!(Exit::Code(3).describe(), "exited with code 3");
        assert_eq!(Exit::Signal(9).describe(), "was killed by signal SIGKILL");
        assert_eq!(signal_name(2), "SIGINT");
    }

    #[test]
    fn free_port_is_nonzero() {
        assert_ne!(free_port("127.0.0.1").unwrap(), 0);
    }

    #[test]
    fn torch_gets_its_own_port() {
        assert_eq!(torch_port(29500, true, "127.0.0.1").unwrap(), 29501);
        assert_eq!(torch_port(65535, true, "127.0.0.1").unwrap(), 65534);
        let p = free_port("127.0.0.1").unwrap();
        assert_ne!(torch_port(p, false, "127.0.0.1").unwrap(), p);
    }

    fn forwarded(input: &[u8], prefix: &str) -> String {
        let buf = Arc::new(Mutex::new(Vec::<u8>::new()));
        forward_lines(input, prefix.as_bytes(), &Sink::Shared(buf.clone()));
        let out = lock(&buf).clone();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn forwards_lines_with_prefix() {
        assert_eq!(forwarded(b"a\nb\n", "[1] "), "[1] a\n[1] b\n");
        assert_eq!(forwarded(b"a\npartial", "[0] "), "[0] a\n[0] partial\n");
        assert_eq!(forwarded(b"", "[0] "), "");
        assert_eq!(forwarded(b"\n", ""), "\n");
    }

    #[test]
    fn splits_overlong_lines() {
        let long = vec![b'x'; MAX_LINE + 10];
        let out = forwarded(&long, "[0] ");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].len(), 4 + MAX_LINE);
        assert_eq!(lines[1], format!("[0] {}", "x".repeat(10)));
    }

    #[test]
    fn keeps_draining_when_the_sink_fails() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let input = b"a\nb\nc\n";
        let mut reader = &input[..];
        forward_lines(
            &mut reader,
            b"",
            &Sink::Shared(Arc::new(Mutex::new(Broken))),
        );
        assert!(reader.is_empty());
    }

    /// A later rank that cannot be started stops the ranks already running.
    #[test]
    fn spawn_failure_of_a_later_rank_stops_earlier_ones() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = LaunchSpec::new(
            3,
            "sh",
            [
                "-c",
                "echo $$ > \"$T/p.$HCOMM_RANK.tmp\" && mv \"$T/p.$HCOMM_RANK.tmp\" \"$T/p.$HCOMM_RANK\"; sleep 30",
            ],
        );
        s.extra_env
            .push(("T".into(), dir.path().to_str().unwrap().into()));
        s.grace = Duration::from_millis(500);
        let out: SharedWriter = Arc::new(Mutex::new(Vec::<u8>::new()));
        let err: SharedWriter = Arc::new(Mutex::new(Vec::<u8>::new()));
        let output = Output {
            piped: true,
            prefix: true,
            out: Sink::Shared(out),
            err: Sink::Shared(err),
        };
        let start = Instant::now();
        let result = run(&s, output, &|local| {
            if local == 2 {
                "/nonexistent/hcomm-launch-test-program".into()
            } else {
                "sh".into()
            }
        });
        assert!(start.elapsed() < Duration::from_secs(10));
        match result {
            Err(LaunchError::Spawn {
                rank: 2, program, ..
            }) => {
                assert_eq!(program, "/nonexistent/hcomm-launch-test-program")
            }
            other => panic!("expected a Spawn error for rank 2, got {other:?}"),
        }
        for local in 0..2 {
            // A rank stopped before it wrote its pid file is gone anyway: it
            // was reaped by the launcher.
            if let Ok(pid) = std::fs::read_to_string(dir.path().join(format!("p.{local}"))) {
                let pid = Pid::from_raw(pid.trim().parse().unwrap());
                assert_eq!(nix::sys::signal::kill(pid, None), Err(Errno::ESRCH));
            }
        }
    }
}
