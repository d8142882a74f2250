//! `hcomm`: launcher, demo, correctness check and benchmark for the hcomm library.

// The doc comments on the argument structs are clap's --help text, written for a terminal:
// `[:BLOCK]` is an optional suffix there, not a link, and addresses are printed as they are.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::bare_urls)]

use clap::{Args, Parser, Subcommand};
use hcomm::{Algo, Collective, Communicator, DType, ReduceOp};
use hcomm_cli::bench::{self, BenchOp, BenchOpts};
use hcomm_cli::workers::{args_without, in_job, spawn_self};
use hcomm_cli::{check, demo};
use hcomm_launch::{launch, LaunchError, LaunchSpec};
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "hcomm",
    version,
    about = "Collective communication for CPU processes: launcher, demo, check, bench"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start N local ranks of PROGRAM with the hcomm (and torchrun) launch variables set.
    Run(RunArgs),
    /// Run every primitive on N local ranks, check each against a CPU reference, print a table.
    Demo(DemoArgs),
    /// Correctness sweep: every collective × algorithm × dtype × op × size × root against a CPU reference.
    Check(CheckArgs),
    /// Benchmark an operation in the nccl-tests format.
    Bench(BenchArgs),
    /// Predict collective times at any scale from an α-β-γ model of hcomm's schedules.
    Simulate(SimulateArgs),
    /// Diagnose configuration and connectivity (config, master port, interfaces, /dev/shm, fd limit, all-pairs latency/bandwidth).
    Doctor(DoctorArgs),
    /// Join the ranks' HCOMM_TRACE files into one Chrome / Perfetto trace, or sum where the time went.
    #[command(subcommand)]
    Trace(TraceCmd),
    /// A busy process for `bench --noise` (spins until its parent exits).
    #[command(hide = true)]
    Spin,
}

#[derive(Subcommand)]
enum TraceCmd {
    /// Write the events of every rank's file into one trace (open it in https://ui.perfetto.dev).
    Merge {
        /// HCOMM_TRACE directories (their hcomm-trace-rank*.json) or trace files.
        #[arg(required = true)]
        inputs: Vec<std::path::PathBuf>,
        /// The merged trace.
        #[arg(short, long)]
        output: std::path::PathBuf,
    },
    /// Draw the ranks' operations on a time line (SVG): bars per operation, queue time, gaps.
    Timeline {
        /// HCOMM_TRACE directories (their hcomm-trace-rank*.json) or trace files.
        #[arg(required = true)]
        inputs: Vec<std::path::PathBuf>,
        /// The picture (SVG).
        #[arg(short, long)]
        output: std::path::PathBuf,
        /// Start of the window shown, in ms after the first operation (default: the whole trace).
        #[arg(long)]
        from_ms: Option<f64>,
        /// End of the window shown, in ms after the first operation.
        #[arg(long)]
        to_ms: Option<f64>,
    },
    /// Print, per rank, communicator and operation: calls, run and queue time, wire bytes, errors.
    Summary {
        /// HCOMM_TRACE directories (their hcomm-trace-rank*.json) or trace files.
        #[arg(required = true)]
        inputs: Vec<std::path::PathBuf>,
    },
}

fn cmd_trace(cmd: TraceCmd) -> ExitCode {
    use hcomm_cli::trace_tool::{merge, summary_table, timeline_svg, trace_files, trace_start};
    let inputs = match &cmd {
        TraceCmd::Merge { inputs, .. }
        | TraceCmd::Timeline { inputs, .. }
        | TraceCmd::Summary { inputs } => inputs,
    };
    let events = match trace_files(inputs).and_then(|f| merge(&f)) {
        Ok(e) => e,
        Err(e) => {
            hcomm_cli::say!("hcomm trace: {e}");
            return ExitCode::from(2);
        }
    };
    match cmd {
        TraceCmd::Merge { output, .. } => {
            let text = serde_json::to_string(&events).expect("serialisable");
            if let Err(e) = std::fs::write(&output, text) {
                hcomm_cli::say!("hcomm trace merge: cannot write {}: {e}", output.display());
                return ExitCode::from(1);
            }
            println!(
                "hcomm trace merge: {} events into {}",
                events.len(),
                output.display()
            );
        }
        TraceCmd::Timeline {
            output,
            from_ms,
            to_ms,
            ..
        } => {
            let window = match (trace_start(&events), from_ms, to_ms) {
                (Some(t0), from, to) if from.is_some() || to.is_some() => {
                    let end = events
                        .iter()
                        .filter(|e| e["ph"] == "X")
                        .filter_map(|e| Some(e["ts"].as_f64()? + e["dur"].as_f64()?))
                        .fold(t0, f64::max);
                    Some((
                        from.map_or(t0, |f| t0 + f * 1e3),
                        to.map_or(end, |t| t0 + t * 1e3),
                    ))
                }
                _ => None,
            };
            let svg = match timeline_svg(&events, window) {
                Ok(s) => s,
                Err(e) => {
                    hcomm_cli::say!("hcomm trace timeline: {e}");
                    return ExitCode::from(2);
                }
            };
            if let Err(e) = std::fs::write(&output, svg) {
                hcomm_cli::say!(
                    "hcomm trace timeline: cannot write {}: {e}",
                    output.display()
                );
                return ExitCode::from(1);
            }
            println!("hcomm trace timeline: {}", output.display());
        }
        TraceCmd::Summary { .. } => print!("{}", summary_table(&events)),
    }
    ExitCode::SUCCESS
}

#[derive(Args)]
struct DoctorArgs {
    /// Start this many local ranks and test the connections between them.
    #[arg(long = "np")]
    np: Option<usize>,
    /// Validate this rank table (hcom_config.json).
    #[arg(long)]
    rank_table: Option<std::path::PathBuf>,
    /// With --rank-table: check the configuration of this rank.
    #[arg(long, requires = "rank_table")]
    rank: Option<usize>,
    /// Check this master address HOST:PORT as rank 0 would (is the port free?).
    #[arg(long)]
    master: Option<String>,
}

#[derive(Args)]
struct RunArgs {
    /// Ranks to start on this node (`--np`, and MPI's `-np`, are accepted too).
    #[arg(short = 'n', long = "nprocs", alias = "np", default_value_t = 1)]
    nprocs: usize,
    /// Number of nodes (each runs `hcomm run` with its --node-rank).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Rendezvous address HOST:PORT (default 127.0.0.1 and a free port outside the system's
    /// ephemeral range). The ranks get it as HCOMM_MASTER_ADDR/PORT and MASTER_ADDR/PORT,
    /// replacing any in the environment.
    #[arg(long)]
    master: Option<String>,
    /// Do not prefix output lines with the rank.
    #[arg(long)]
    no_prefix: bool,
    /// Milliseconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 3000)]
    grace_ms: u64,
    /// A rank killed by a signal does not stop the others (fault-tolerant programs that shrink).
    #[arg(long)]
    keep_going: bool,
    /// Master port, 1-65535 (alternative to --master).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    port: Option<u16>,
    /// CPU placement: spread (each rank its own share of the CPUs, when ranks do not
    /// outnumber them) or none (the scheduler's).
    #[arg(long, default_value = "spread")]
    bind: hcomm_launch::Bind,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    program: Vec<OsString>,
}

#[derive(Args)]
struct DemoArgs {
    /// Ranks to start.
    #[arg(short = 'n', long = "nprocs", default_value_t = 4)]
    nprocs: usize,
    /// Message size in bytes for the timed rows.
    #[arg(long, default_value_t = 4 << 20)]
    size: usize,
    /// Timed iterations per row.
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

#[derive(Args)]
struct CheckArgs {
    /// Start this many local ranks (omit when running under a launcher).
    #[arg(long = "np")]
    np: Option<usize>,
    /// Small sweep (3 dtypes, sizes up to 1031).
    #[arg(long)]
    quick: bool,
    /// Comma-separated collectives (default: all).
    #[arg(long, value_delimiter = ',')]
    colls: Vec<String>,
    /// Comma-separated dtypes (default: all).
    #[arg(long, value_delimiter = ',')]
    dtypes: Vec<String>,
    /// Comma-separated reduce ops (default: all).
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    /// Comma-separated element counts.
    #[arg(long, value_delimiter = ',')]
    counts: Vec<usize>,
    /// Input seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Comma-separated algorithms (default: every algorithm of each collective).
    #[arg(long, value_delimiter = ',')]
    algos: Vec<String>,
    /// Print every case.
    #[arg(short, long)]
    verbose: bool,
    /// Soak instead of the sweep: this many random cases (random collective, dtype, op, count,
    /// root, algorithm; a quarter through the async engine), each checked.
    #[arg(long)]
    soak: Option<usize>,
    /// Soak: stop after this many seconds even if cases remain.
    #[arg(long)]
    seconds: Option<f64>,
    /// Fault tolerance: this rank kills itself (SIGKILL) in the middle of an all-reduce loop;
    /// the others shrink the communicator and run the sweep on it (start under
    /// `hcomm run --keep-going`; `--np` does that itself).
    #[arg(long, value_name = "RANK")]
    kill: Option<usize>,
    /// Deterministic mode (`HCOMM_DETERMINISTIC`): the reducing collectives only, on random
    /// non-integer floats (default dtypes f32, f64, f16, bf16), each result bitwise the
    /// rank-order fold computed on the CPU, whatever algorithm is forced.
    #[arg(long)]
    deterministic: bool,
}

#[derive(Args)]
struct SimulateArgs {
    /// Ranks per host.
    #[arg(long, default_value_t = 8)]
    ranks_per_host: usize,
    /// Hosts.
    #[arg(long, default_value_t = 128)]
    hosts: usize,
    /// Message sizes (comma-separated, K/M/G suffixes).
    #[arg(long, default_value = "8,64K,1M,64M,1G", value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Network latency between hosts, microseconds.
    #[arg(long, default_value_t = 30.0)]
    net_latency_us: f64,
    /// Network bandwidth of one host link, Gbit/s.
    #[arg(long, default_value_t = 10.0)]
    net_gbit: f64,
    /// Shared-memory handoff latency, microseconds.
    #[arg(long, default_value_t = 1.0)]
    shm_latency_us: f64,
    /// Shared-memory copy bandwidth per rank, GB/s.
    #[arg(long, default_value_t = 10.0)]
    mem_gbs: f64,
    /// Reduction throughput per rank, GB/s.
    #[arg(long, default_value_t = 8.0)]
    reduce_gbs: f64,
    /// One JSON object per row.
    #[arg(long)]
    json: bool,
    /// Instead of predicting: fit the network latency and bandwidth to the ring all-reduce
    /// rows of this `hcomm bench allreduce --json` output (one rank per host; the reduction
    /// runs at --reduce-gbs), and show measured against predicted times.
    #[arg(long, value_name = "FILE")]
    calibrate: Option<std::path::PathBuf>,
}

#[derive(Args)]
struct BenchArgs {
    /// allreduce, allgather, reducescatter, broadcast, reduce, gather, scatter, alltoall, barrier, sendrecv,
    /// fusion (per-tensor vs fused vs overlapped all-reduce of BERT-base's gradients),
    /// or compression (each gradient compressor: measured wire bytes, time, error)
    op: String,
    /// Start this many local ranks (omit when running under a launcher).
    #[arg(long = "np")]
    np: Option<usize>,
    /// Minimum size in bytes (K/M/G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Maximum size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    max_bytes: usize,
    /// Size multiplication factor.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Warm-up iterations.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Timed iterations.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    check: u8,
    /// Element type.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    dtype: String,
    /// Reduction.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    redop: String,
    /// Root rank.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Force an algorithm (ring, rd, tree, chain, …); for fusion and compression, the
    /// all-reduce's.
    #[arg(long, default_value = "auto")]
    algo: String,
    /// Transport: auto (shared memory when all ranks share a host), tcp, shm.
    #[arg(long, default_value = "auto")]
    transport: String,
    /// One JSON object per row instead of the table.
    #[arg(long)]
    json: bool,
    /// Pick the iterations per repeat so that a repeat takes about this many seconds.
    #[arg(long, default_value_t = 0.0)]
    target: f64,
    /// Timed repeats per size (the median is reported).
    #[arg(long, default_value_t = 1)]
    reps: usize,
    /// Write an SVG plot of busbw and time per call against size.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Append the rows to this JSON-lines file and compare with its last run of the same setup.
    #[arg(long)]
    results: Option<std::path::PathBuf>,
    /// allreduce: keep the buffers in a shared window and run the zero-copy window all-reduce.
    #[arg(long)]
    window: bool,
    /// fusion, compression: timed steps (calls) per mode (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// compression: f32 gradient size per rank in bytes (K/M/G suffixes).
    #[arg(long, default_value = "100M", value_parser = parse_size)]
    size: usize,
    /// compression: comma-separated compressors (none, fp16, bf16, int8[:BLOCK], int8sr[:BLOCK], sign[:BLOCK], topk:K|P%, randk:K|P%[:SEED]).
    #[arg(long, value_delimiter = ',', default_value = hcomm_cli::compression_bench::DEFAULT_COMPRESSORS)]
    compressors: Vec<String>,
    /// compression: turn error feedback off.
    #[arg(long)]
    no_error_feedback: bool,
    /// fusion: bucket caps of the sweep, in MiB.
    #[arg(long, default_value = "1,4,25,100", value_delimiter = ',')]
    caps: Vec<f64>,
    /// fusion: scale every tensor of the model by this factor (1 = BERT-base).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Run this many busy processes beside the ranks (hostile conditions; needs --np); the
    /// header says so, and the steal time of every size is reported.
    #[arg(long, default_value_t = 0)]
    noise: usize,
    /// With --np: CPU placement of the ranks, spread (each its own share of the CPUs, when
    /// they do not outnumber them; the default, as Open MPI binds two ranks to a core each)
    /// or none.
    #[arg(long, default_value = "spread")]
    bind: hcomm_launch::Bind,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1usize << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("'{s}' is not a size (e.g. 8, 64K, 16M, 1G)"))
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(code.clamp(0, 255) as u8)
}

fn join() -> Result<Communicator, ExitCode> {
    Communicator::from_env().map_err(|e| {
        hcomm_cli::say!("{}", cannot_join(&e));
        ExitCode::from(1)
    })
}

/// After rank 0 has written a subcommand's report, wait for every rank before exiting: a rank
/// that exits with a failure first has the launcher stop the others, rank 0 mid-report. Only
/// on paths where every rank ran the same operations (so the barrier meets); its own failure
/// changes nothing about the exit code.
/// `hcomm check --kill RANK`: `victim` dies during an all-reduce loop; every survivor shrinks
/// the communicator, checks who is left, and runs the sweep on the shrunk communicator.
fn check_after_a_kill(comm: Communicator, victim: usize, o: &check::CheckOpts) -> ExitCode {
    let (me, n) = (comm.rank(), comm.world_size());
    if victim >= n {
        hcomm_cli::say!("hcomm check: --kill {victim}: out of range for {n} ranks");
        return ExitCode::from(2);
    }
    let mut v = vec![1.0f64; 1 << 16];
    let err = (0..)
        .find_map(|i| {
            if me == victim && i == 3 {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::this(),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum).err()
        })
        .expect("the loop ends with an error");
    let failed_at = std::time::Instant::now();
    let shrunk = match comm.shrink() {
        Ok(s) => s,
        Err(e) => {
            hcomm_cli::say!("hcomm check --kill: rank {me}: shrink failed: {e}");
            return ExitCode::from(1);
        }
    };
    let shrink_ms = failed_at.elapsed().as_secs_f64() * 1e3;
    let mut olds = vec![0u64; shrunk.world_size()];
    if let Err(e) = shrunk.all_gather(&[me as u64], &mut olds) {
        hcomm_cli::say!(
            "hcomm check --kill: rank {me}: all-gather on the shrunk communicator: {e}"
        );
        return ExitCode::from(1);
    }
    let want: Vec<u64> = (0..n as u64).filter(|&r| r != victim as u64).collect();
    if olds != want {
        hcomm_cli::say!(
            "hcomm check --kill: rank {me}: the shrunk communicator holds ranks {olds:?}, not {want:?}"
        );
        return ExitCode::from(1);
    }
    let start = std::time::Instant::now();
    let code = match check::run(&shrunk, o) {
        Ok((cases, failed)) => {
            if shrunk.rank() == 0 {
                println!(
                    "hcomm check --kill {victim}: {n} ranks: after \"{err}\", the {} survivors shrank in {shrink_ms:.1} ms (rank {me}); \
                     on the shrunk communicator: {cases} cases, {} passed, {failed} failed ({:.1} s)",
                    shrunk.world_size(),
                    cases - failed,
                    start.elapsed().as_secs_f64()
                );
            }
            if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            hcomm_cli::say!("hcomm check --kill: rank {me}: on the shrunk communicator: {e}");
            ExitCode::from(1)
        }
    };
    leave_together(&shrunk);
    drop(shrunk);
    drop(comm);
    code
}

fn leave_together(comm: &Communicator) {
    let _ = comm.barrier();
}

/// Why a subcommand could not join the job; outside any job, it also says how to start ranks.
fn cannot_join(e: &hcomm::Error) -> String {
    let hint = if in_job() {
        ""
    } else {
        " (or give --np N to start N local ranks)"
    };
    format!("hcomm: cannot join the job: {e}{hint}")
}

fn cmd_run(a: RunArgs) -> ExitCode {
    let mut program = a.program.into_iter();
    let Some(prog) = program.next() else {
        hcomm_cli::say!("hcomm run: no program given");
        return ExitCode::from(2);
    };
    // The program list takes anything after the options, so an option `hcomm run` does not
    // know would otherwise be started as the program.
    if prog.to_string_lossy().starts_with('-') {
        hcomm_cli::say!(
            "hcomm run: unknown option '{}' (see hcomm run --help; the program goes last, e.g. hcomm run -n 2 -- python train.py)",
            prog.to_string_lossy()
        );
        return ExitCode::from(2);
    }
    let mut spec = LaunchSpec::new(a.nprocs, prog, program.collect::<Vec<_>>());
    spec.nnodes = a.nnodes;
    spec.node_rank = a.node_rank;
    spec.prefix_output = !a.no_prefix;
    spec.grace = Duration::from_millis(a.grace_ms);
    spec.keep_going = a.keep_going;
    spec.master_port = a.port;
    spec.bind = a.bind;
    let master_given = a.master.is_some();
    let rendezvous_given = master_given || a.port.is_some();
    if let Some(m) = a.master {
        match m
            .rsplit_once(':')
            .map(|(h, p)| (h.to_string(), p.parse::<u16>()))
        {
            Some((h, Ok(p))) if !h.is_empty() && p != 0 => {
                if a.port.is_some_and(|q| q != p) {
                    hcomm_cli::say!(
                        "hcomm run: --port {} and --master {m} name different ports: give one",
                        a.port.unwrap_or(0)
                    );
                    return ExitCode::from(2);
                }
                spec.master_addr = h;
                spec.master_port = Some(p);
            }
            _ => {
                hcomm_cli::say!(
                    "hcomm run: --master must be HOST:PORT with a host and a port of 1-65535, got '{m}'"
                );
                return ExitCode::from(2);
            }
        }
    }
    // The launcher gives its ranks its own rendezvous: say so when the environment named
    // another (an address unless --master was given, a port unless --master or --port was).
    let replaced: &[&str] = match (master_given, rendezvous_given) {
        (true, _) => &[],
        (false, true) => &["HCOMM_MASTER_ADDR", "MASTER_ADDR"],
        (false, false) => &[
            "HCOMM_MASTER_ADDR",
            "HCOMM_MASTER_PORT",
            "MASTER_ADDR",
            "MASTER_PORT",
        ],
    };
    let named: Vec<String> = replaced
        .iter()
        .filter_map(|k| {
            let v = std::env::var(k).ok()?;
            (!v.is_empty()).then(|| format!("{k}={v}"))
        })
        .collect();
    if !named.is_empty() {
        hcomm_cli::say!(
            "hcomm run: {} in the environment is not used: the ranks meet at {} on {} \
             (give --master HOST:PORT or --port to choose)",
            named.join(", "),
            spec.master_addr,
            spec.master_port
                .map_or("a free port".to_string(), |p| format!("port {p}"))
        );
    }
    match launch(&spec) {
        Ok(code) => exit(code),
        Err(e) => {
            hcomm_cli::say!("hcomm run: {e}");
            ExitCode::from(if matches!(e, LaunchError::Spawn { .. }) {
                127
            } else {
                1
            })
        }
    }
}

fn cmd_demo(a: DemoArgs) -> ExitCode {
    // The timed rows move float32 elements.
    if a.size == 0 || !a.size.is_multiple_of(4) {
        hcomm_cli::say!(
            "hcomm demo: --size {}: the timed rows move float32 elements; give a positive multiple of 4 bytes",
            a.size
        );
        return ExitCode::from(2);
    }
    if !in_job() {
        return exit(spawn_self(a.nprocs, args_without(&["-n", "--nprocs"])));
    }
    let comm = match join() {
        Ok(c) => c,
        Err(code) => return code,
    };
    match demo::run(&comm, a.size, a.iters) {
        Ok(rows) => {
            if comm.rank() == 0 {
                demo::print(
                    &rows,
                    comm.world_size(),
                    comm.has_shared_memory(),
                    comm.world_size() > 1 && comm.p2p_over_shared_memory(1),
                );
            }
            leave_together(&comm);
            if rows.iter().all(|r| r.correct) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            hcomm_cli::say!("hcomm demo: rank {}: {e}", comm.rank());
            ExitCode::from(1)
        }
    }
}

fn parse_list<T, F: Fn(&str) -> Result<T, String>>(
    items: &[String],
    f: F,
) -> Result<Vec<T>, String> {
    items.iter().map(|s| f(s)).collect()
}

fn cmd_check(a: CheckArgs) -> ExitCode {
    if let (Some(np), false) = (a.np, in_job()) {
        return exit(hcomm_cli::workers::spawn_self_with(
            np,
            args_without(&["--np", "-np"]),
            a.kill.is_some(),
        ));
    }
    let mut o = if a.quick {
        check::CheckOpts::quick()
    } else {
        check::CheckOpts::full()
    };
    let parsed = (|| -> Result<(), String> {
        if !a.colls.is_empty() {
            o.colls = parse_list(&a.colls, |s| {
                Collective::parse(s).ok_or(format!("unknown collective '{s}'"))
            })?;
        }
        if a.deterministic {
            o.deterministic = true;
            o.dtypes = vec![DType::F32, DType::F64, DType::F16, DType::BF16];
        }
        if !a.dtypes.is_empty() {
            o.dtypes = parse_list(&a.dtypes, |s| s.parse::<DType>())?;
        }
        if !a.ops.is_empty() {
            o.ops = parse_list(&a.ops, |s| s.parse::<ReduceOp>())?;
        }
        if !a.counts.is_empty() {
            o.counts = a.counts.clone();
        }
        if !a.algos.is_empty() {
            o.algos = parse_list(&a.algos, |s| s.parse::<Algo>())?;
        }
        Ok(())
    })();
    if let Err(e) = parsed {
        hcomm_cli::say!("hcomm check: {e}");
        return ExitCode::from(2);
    }
    o.seed = a.seed;
    o.verbose = a.verbose;
    let comm = match join() {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Some(victim) = a.kill {
        return check_after_a_kill(comm, victim, &o);
    }
    let start = std::time::Instant::now();
    if let Some(ops) = a.soak {
        let comm = std::sync::Arc::new(comm);
        let so = check::SoakOpts {
            ops,
            duration: a.seconds.map(Duration::from_secs_f64),
            seed: a.seed,
        };
        return match check::soak(&comm, &so) {
            Ok(r) => {
                if comm.rank() == 0 {
                    println!(
                        "hcomm check --soak: {} ranks: {} random operations ({} async), {} wrong results, seed {} ({:.1} s)",
                        comm.world_size(),
                        r.ops,
                        r.async_ops,
                        r.wrong,
                        a.seed,
                        start.elapsed().as_secs_f64()
                    );
                }
                leave_together(&comm);
                if r.wrong == 0 {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                }
            }
            Err(e) => {
                hcomm_cli::say!(
                    "hcomm check --soak: rank {}: operation failed: {e}",
                    comm.rank()
                );
                ExitCode::from(1)
            }
        };
    }
    match check::run(&comm, &o) {
        Ok((cases, failed)) => {
            if comm.rank() == 0 {
                println!(
                    "hcomm check: {} ranks{}: {cases} cases, {} passed, {failed} failed ({:.1} s)",
                    comm.world_size(),
                    if o.deterministic {
                        ", deterministic"
                    } else {
                        ""
                    },
                    cases - failed,
                    start.elapsed().as_secs_f64()
                );
            }
            leave_together(&comm);
            if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            hcomm_cli::say!("hcomm check: rank {}: operation failed: {e}", comm.rank());
            ExitCode::from(1)
        }
    }
}

/// A finite number above zero (the benchmark and simulator options that scale things).
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// The exit code of a benchmark run on this rank: its error, if any, said with the rank.
fn bench_exit<T>(what: &str, rank: usize, r: hcomm::Result<T>) -> ExitCode {
    match r {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            hcomm_cli::say!("{what}: rank {rank}: {e}");
            ExitCode::from(1)
        }
    }
}

/// Join the job from the environment, with `--transport` applied.
fn join_for_bench(transport: &str) -> Result<Communicator, String> {
    let kind: hcomm::config::TransportKind = transport
        .parse()
        .map_err(|e| format!("hcomm bench: --transport: {e}"))?;
    hcomm::BootstrapConfig::from_env()
        .map_err(hcomm::Error::from)
        .and_then(|cfg| {
            let cfg = if transport == "auto" {
                cfg
            } else {
                hcomm::BootstrapConfig {
                    transport: kind,
                    ..cfg
                }
            };
            Communicator::from_config(&cfg)
        })
        .map_err(|e| cannot_join(&e))
}

/// `--algo` for the benchmarks built on the all-reduce (fusion, compression): set it for the
/// all-reduce (`auto` leaves `HCOMM_ALGO` or the default in force).
fn all_reduce_algo_for_bench(comm: &Communicator, algo: &str, what: &str) -> Result<(), ExitCode> {
    let algo: Algo = algo.parse().map_err(|e| {
        hcomm_cli::say!("{what}: --algo: {e}");
        ExitCode::from(2)
    })?;
    if algo != Algo::Auto {
        comm.set_algorithm(hcomm::Collective::AllReduce, algo)
            .map_err(|e| {
                hcomm_cli::say!("{what}: --algo {algo}: {e}");
                ExitCode::from(2)
            })?;
    }
    Ok(())
}

fn cmd_bench_fusion(a: BenchArgs) -> ExitCode {
    if !positive(a.scale) || !a.caps.iter().all(|&c| positive(c)) {
        hcomm_cli::say!("hcomm bench fusion: --scale and --caps must be positive");
        return ExitCode::from(2);
    }
    let comm = match join_for_bench(&a.transport) {
        Ok(c) => std::sync::Arc::new(c),
        Err(e) => {
            hcomm_cli::say!("{e}");
            return ExitCode::from(1);
        }
    };
    if let Err(code) = all_reduce_algo_for_bench(&comm, &a.algo, "hcomm bench fusion") {
        return code;
    }
    let o = hcomm_cli::fusion_bench::FusionBenchOpts {
        steps: a.steps,
        caps_mib: a.caps,
        scale: a.scale,
        json: a.json,
    };
    bench_exit(
        "hcomm bench fusion",
        comm.rank(),
        hcomm_cli::fusion_bench::run(&comm, &o),
    )
}

fn cmd_simulate(a: SimulateArgs) -> ExitCode {
    use hcomm_cli::simulate::{predict, Model};
    if a.ranks_per_host == 0
        || a.hosts == 0
        || ![a.net_gbit, a.mem_gbs, a.reduce_gbs]
            .into_iter()
            .all(positive)
        || !(a.net_latency_us >= 0.0 && a.shm_latency_us >= 0.0)
    {
        hcomm_cli::say!("hcomm simulate: ranks, hosts, bandwidths and rates must be positive, latencies not negative");
        return ExitCode::from(2);
    }
    // The model keeps per-rank state: a world it could not hold is refused, not attempted.
    const MAX_SIMULATED_RANKS: usize = 1 << 20;
    match a.hosts.checked_mul(a.ranks_per_host) {
        Some(n) if n <= MAX_SIMULATED_RANKS => {}
        _ => {
            hcomm_cli::say!(
                "hcomm simulate: {} hosts x {} ranks per host is more than the {MAX_SIMULATED_RANKS} ranks it simulates",
                a.hosts,
                a.ranks_per_host
            );
            return ExitCode::from(2);
        }
    }
    if let Some(path) = &a.calibrate {
        return simulate_calibrate(path, a.reduce_gbs * 1e9, a.json);
    }
    let m = Model {
        ranks_per_host: a.ranks_per_host,
        hosts: a.hosts,
        alpha_net: a.net_latency_us * 1e-6,
        beta_net: a.net_gbit * 1e9 / 8.0,
        alpha_shm: a.shm_latency_us * 1e-6,
        beta_mem: a.mem_gbs * 1e9,
        gamma: a.reduce_gbs * 1e9,
    };
    if !a.json {
        println!(
            "# hcomm simulate: {} hosts x {} ranks = {} ranks; network {} Gbit/s, {} us; shm {} GB/s, {} us; reduce {} GB/s",
            a.hosts, a.ranks_per_host, m.ranks(), a.net_gbit, a.net_latency_us, a.mem_gbs, a.shm_latency_us, a.reduce_gbs
        );
        println!(
            "#{:>13} {:>12} {:>14} {:>14} {:>10}",
            "size(B)", "collective", "algorithm", "time(us)", "busbw"
        );
    }
    for &size in &a.sizes {
        for p in predict(&m, size) {
            if a.json {
                println!("{}", serde_json::to_string(&p).unwrap_or_default());
            } else {
                println!(
                    " {:>13} {:>12} {:>14} {:>14.2} {:>10.3}",
                    p.bytes,
                    p.collective,
                    p.algorithm,
                    p.seconds * 1e6,
                    p.busbw_gbs
                );
            }
        }
    }
    ExitCode::SUCCESS
}

/// `hcomm simulate --calibrate FILE`.
fn simulate_calibrate(path: &std::path::Path, gamma: f64, json: bool) -> ExitCode {
    use hcomm_cli::simulate::{calibrate, parse_bench_rows};
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            hcomm_cli::say!("hcomm simulate: --calibrate {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let rows = parse_bench_rows(&text);
    let c = match calibrate(&rows, gamma) {
        Ok(c) => c,
        Err(e) => {
            hcomm_cli::say!(
                "hcomm simulate: --calibrate {}: {e} (rows of `hcomm bench allreduce --json --algo ring` are used)",
                path.display()
            );
            return ExitCode::from(2);
        }
    };
    let (alpha_us, gbit) = (c.alpha_net * 1e6, c.beta_net * 8.0 / 1e9);
    if json {
        let rows: Vec<serde_json::Value> = c
            .rows
            .iter()
            .map(|(s, t)| {
                serde_json::json!({
                    "ranks": s.ranks,
                    "bytes": s.bytes,
                    "measured_us": s.seconds * 1e6,
                    "predicted_us": t * 1e6,
                })
            })
            .collect();
        let out = serde_json::json!({
            "net_latency_us": alpha_us,
            "net_gbit": gbit,
            "reduce_gbs": gamma / 1e9,
            "rows": rows,
        });
        println!("{out}");
        return ExitCode::SUCCESS;
    }
    println!(
        "# hcomm simulate --calibrate {}: {} ring all-reduce rows, one rank per host, reduction {} GB/s",
        path.display(),
        c.rows.len(),
        gamma / 1e9
    );
    println!(
        "# fitted: alpha = {alpha_us:.2} us per message, beta = {gbit:.3} Gbit/s per host link"
    );
    println!(
        "#{:>6} {:>13} {:>14} {:>14} {:>8}",
        "ranks", "size(B)", "measured(us)", "predicted(us)", "error"
    );
    for (s, t) in &c.rows {
        println!(
            " {:>6} {:>13} {:>14.2} {:>14.2} {:>7.1}%",
            s.ranks,
            s.bytes,
            s.seconds * 1e6,
            t * 1e6,
            (t / s.seconds - 1.0) * 100.0
        );
    }
    println!(
        "# predict with: hcomm simulate --net-latency-us {alpha_us:.2} --net-gbit {gbit:.3} ..."
    );
    ExitCode::SUCCESS
}

fn cmd_bench_compression(a: BenchArgs) -> ExitCode {
    let compressors: Result<Vec<hcomm::Compressor>, String> =
        a.compressors.iter().map(|c| c.parse()).collect();
    let compressors = match compressors {
        Ok(c) if a.size >= 4 => c,
        Ok(_) => {
            hcomm_cli::say!("hcomm bench compression: --size must be at least 4 bytes");
            return ExitCode::from(2);
        }
        Err(e) => {
            hcomm_cli::say!("hcomm bench compression: --compressors: {e}");
            return ExitCode::from(2);
        }
    };
    let comm = match join_for_bench(&a.transport) {
        Ok(c) => c,
        Err(e) => {
            hcomm_cli::say!("{e}");
            return ExitCode::from(1);
        }
    };
    if let Err(code) = all_reduce_algo_for_bench(&comm, &a.algo, "hcomm bench compression") {
        return code;
    }
    let o = hcomm_cli::compression_bench::CompressionBenchOpts {
        bytes: a.size,
        steps: a.steps,
        compressors,
        error_feedback: !a.no_error_feedback,
        json: a.json,
    };
    bench_exit(
        "hcomm bench compression",
        comm.rank(),
        hcomm_cli::compression_bench::run(&comm, &o),
    )
}

/// `hcomm bench`'s options for one of the collectives (not fusion or compression), checked
/// before any rank starts, so that a bad value is reported once.
fn bench_opts(a: &BenchArgs) -> Result<BenchOpts, String> {
    let dtype: DType = a.dtype.parse()?;
    if a.max_bytes < a.min_bytes {
        return Err(format!(
            "-e {} is below -b {}: the largest size must be at least the smallest",
            a.max_bytes, a.min_bytes
        ));
    }
    for (flag, bytes) in [("-b", a.min_bytes), ("-e", a.max_bytes)] {
        if !bytes.is_multiple_of(dtype.size()) {
            return Err(format!(
                "{flag} {bytes}: not a whole number of {dtype} elements ({} bytes each)",
                dtype.size()
            ));
        }
    }
    if a.factor < 2 && a.max_bytes > a.min_bytes {
        return Err(format!(
            "-f {}: the size factor must be at least 2 to go from -b {} to -e {} (or give -b equal to -e)",
            a.factor, a.min_bytes, a.max_bytes
        ));
    }
    if a.iters == 0 && a.target <= 0.0 {
        return Err("-n 0: at least one timed iteration (or --target SECONDS)".into());
    }
    if a.reps == 0 {
        return Err("--reps 0: at least one timed repeat".into());
    }
    Ok(BenchOpts {
        op: BenchOp::parse(&a.op).ok_or(format!("unknown operation '{}'", a.op))?,
        min_bytes: a.min_bytes,
        max_bytes: a.max_bytes,
        factor: a.factor,
        warmup: a.warmup,
        iters: a.iters,
        check: a.check != 0,
        dtype,
        redop: a.redop.parse()?,
        root: a.root,
        algo: a.algo.parse::<Algo>()?,
        target_secs: a.target,
        reps: a.reps,
        window: a.window,
        noise: std::env::var(hcomm_cli::workers::NOISE_VAR)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    })
}

fn cmd_bench(a: BenchArgs) -> ExitCode {
    if let (Some(np), false) = (a.np, in_job()) {
        // Report a bad option once, here, rather than once per rank after they start.
        if a.op != "fusion" && a.op != "compression" {
            let out = bench::Output {
                json: a.json,
                plot: a.plot.clone(),
                results: a.results.clone(),
            };
            let checked = out
                .check_paths()
                .and_then(|()| bench_opts(&a))
                .and_then(|o| {
                    if np == 0 {
                        Err("--np 0: at least one rank".into())
                    } else if o.op == BenchOp::SendRecv && np < 2 {
                        Err(format!("sendrecv needs at least 2 ranks (--np {np})"))
                    } else if o.root >= np {
                        Err(format!("root {} is out of range for {np} ranks", o.root))
                    } else {
                        Ok(())
                    }
                });
            if let Err(e) = checked {
                hcomm_cli::say!("hcomm bench: {e}");
                return ExitCode::from(2);
            }
        }
        let noise = match hcomm_cli::workers::start_noise(a.noise) {
            Ok(n) => n,
            Err(e) => {
                hcomm_cli::say!("hcomm bench: --noise {}: {e}", a.noise);
                return ExitCode::from(1);
            }
        };
        let code = hcomm_cli::workers::spawn_self_env(
            np,
            args_without(&["--np", "-np", "--noise"]),
            false,
            vec![(
                hcomm_cli::workers::NOISE_VAR.to_string(),
                a.noise.to_string(),
            )],
            a.bind,
        );
        drop(noise);
        return exit(code);
    }
    if a.noise > 0 {
        hcomm_cli::say!(
            "hcomm bench: --noise needs --np (the driver that starts the ranks starts the busy processes too)"
        );
        return ExitCode::from(2);
    }
    if a.op == "fusion" {
        return cmd_bench_fusion(a);
    }
    if a.op == "compression" {
        return cmd_bench_compression(a);
    }
    let out = bench::Output {
        json: a.json,
        plot: a.plot.clone(),
        results: a.results.clone(),
    };
    let parsed = out.check_paths().and_then(|()| bench_opts(&a));
    let o = match parsed {
        Ok(o) => o,
        Err(e) => {
            hcomm_cli::say!("hcomm bench: {e}");
            return ExitCode::from(2);
        }
    };
    let comm = match join_for_bench(&a.transport) {
        Ok(c) => c,
        Err(e) => {
            hcomm_cli::say!("{e}");
            return ExitCode::from(if e.contains("--transport") { 2 } else { 1 });
        }
    };
    if o.root >= comm.world_size() {
        hcomm_cli::say!(
            "hcomm bench: root {} is out of range for {} ranks",
            o.root,
            comm.world_size()
        );
        return ExitCode::from(2);
    }
    if o.op == BenchOp::SendRecv && comm.world_size() < 2 {
        hcomm_cli::say!("hcomm bench: sendrecv needs at least 2 ranks (this job has 1)");
        return ExitCode::from(2);
    }
    match bench::run(&comm, &o, &out) {
        Ok(r) if r.wrong == 0 && !r.output_failed => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            hcomm_cli::say!("hcomm bench: rank {}: {e}", comm.rank());
            ExitCode::from(1)
        }
    }
}

fn cmd_doctor(a: DoctorArgs) -> ExitCode {
    use hcomm_cli::doctor::{self, Level, Report};
    if let (Some(np), false) = (a.np, in_job()) {
        return exit(spawn_self(np, args_without(&["--np", "-np"])));
    }
    let mut report = Report::default();
    let verdict = |report: &Report| match report.worst() {
        Level::Fail => ExitCode::from(1),
        _ => ExitCode::SUCCESS,
    };
    if let Some(path) = &a.rank_table {
        let table = doctor::rank_table_check(path, &mut report);
        if let (Some(t), Some(r)) = (table, a.rank) {
            match t.bootstrap_for(r) {
                Ok(cfg) => doctor::local_checks(Some(&cfg), &mut report),
                Err(e) => report.add_finding(Level::Fail, "rank table", e.to_string()),
            }
        }
        report.print("");
        return verdict(&report);
    }
    if let Some(m) = &a.master {
        let Some((host, port)) = m
            .rsplit_once(':')
            .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h.to_string(), p)))
            .filter(|(h, p)| !h.is_empty() && *p != 0)
        else {
            hcomm_cli::say!(
                "hcomm doctor: --master must be HOST:PORT with a host and a port of 1-65535, got '{m}'"
            );
            return ExitCode::from(2);
        };
        // The checks wait as a job would: HCOMM_TIMEOUT when it is set (and valid).
        let timeout =
            hcomm::config::parse_duration(&std::env::var("HCOMM_TIMEOUT").unwrap_or_default())
                .ok()
                .filter(|t| !t.is_zero() && *t <= hcomm::BootstrapConfig::MAX_TIMEOUT)
                .unwrap_or(Duration::from_secs(30));
        let cfg = hcomm::testing::local_config(0, 1, port, timeout);
        let cfg = hcomm::BootstrapConfig {
            master_addr: host,
            ..cfg
        };
        doctor::local_checks(Some(&cfg), &mut report);
        report.print("");
        return verdict(&report);
    }
    if !in_job() {
        doctor::local_checks(None, &mut report);
        report.add_finding(Level::Ok, "job", "not started as a rank: run `hcomm doctor -np 2` (or under hcomm run / mpirun / srun) to test connectivity".into());
        report.print("");
        return verdict(&report);
    }
    let cfg = match hcomm::BootstrapConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            report.add_finding(Level::Fail, "config", e.to_string());
            report.print("");
            return verdict(&report);
        }
    };
    doctor::local_checks(Some(&cfg), &mut report);
    let rank = cfg.rank;
    let prefix = format!("rank {rank}: ");
    if report.worst() == Level::Fail {
        report.print(&prefix);
        return verdict(&report);
    }
    let cfg = hcomm::BootstrapConfig {
        timeout: cfg.timeout.min(Duration::from_secs(60)),
        ..cfg
    };
    let comm = match Communicator::from_config(&cfg) {
        Ok(c) => c,
        Err(e) => {
            report.add_finding(Level::Fail, "bootstrap", e.to_string());
            report.print(&prefix);
            return verdict(&report);
        }
    };
    report.add_finding(
        Level::Ok,
        "bootstrap",
        format!(
            "joined: rank {} of {}, local rank {} of {} on this host",
            comm.rank(),
            comm.world_size(),
            comm.local_rank(),
            comm.local_world_size()
        ),
    );
    report.add_finding(
        Level::Ok,
        "shm footprint",
        if comm.shared_memory_bytes() > 0 {
            format!(
                "{} KiB of /dev/shm for this communicator's {} local ranks (a segment per communicator for collectives, HCOMM_SHM_CHUNK sizes it; one for point-to-point rings, HCOMM_SHM_P2P_BYTES per direction and pair)",
                comm.shared_memory_bytes() >> 10,
                comm.local_world_size()
            )
        } else {
            "none (ranks on several hosts, or HCOMM_TRANSPORT=tcp)".to_string()
        },
    );
    // Rank 0 prints everything it found; other ranks print only their problems.
    if rank == 0 {
        report.print("rank 0: ");
    } else if report.worst() != Level::Ok {
        report.print(&prefix);
    }
    match doctor::pair_matrix(&comm) {
        Ok((lat, bw)) => {
            if rank == 0 {
                let findings = doctor::print_matrix(comm.world_size(), &lat, &bw, comm.host_ids());
                let r = Report { findings };
                r.print("");
            }
            verdict(&report)
        }
        Err(e) => {
            hcomm_cli::say!("rank {rank}: [FAIL] pairs            {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    hcomm_launch::init_logging();
    // Accept MPI/nccl-tests style `-np N` as `--np N`, up to a `--`: what follows it is the
    // launched program's, which may have a `-np` of its own.
    let mut after_separator = false;
    let args: Vec<OsString> = std::env::args_os()
        .map(|a| {
            after_separator |= a == "--";
            if after_separator {
                a
            } else if a == "-np" {
                OsString::from("--np")
            } else if let Some(n) = a.to_str().and_then(|s| s.strip_prefix("-np=")) {
                OsString::from(format!("--np={n}"))
            } else {
                a
            }
        })
        .collect();
    let cli = Cli::parse_from(args);
    match cli.cmd {
        Cmd::Run(a) => cmd_run(a),
        Cmd::Demo(a) => cmd_demo(a),
        Cmd::Check(a) => cmd_check(a),
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::Simulate(a) => cmd_simulate(a),
        Cmd::Doctor(a) => cmd_doctor(a),
        Cmd::Trace(c) => cmd_trace(c),
        Cmd::Spin => hcomm_cli::workers::spin_until_orphaned(),
    }
}
