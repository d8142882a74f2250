//! Correctness tooling shared by the test suite, `hcomm check` and `hcomm demo`: deterministic
//! inputs every rank can regenerate for every other rank, a plain CPU reference for each
//! collective, and helpers to run several ranks as threads of one process.
//!
//! Inputs are small integers (also for float types), so every summation order gives exactly the
//! same result and the comparison with the reference can be bitwise. Deterministic mode's cases
//! ([`Case::deterministic`]) take random non-integer floats instead ([`random_input`]), whose
//! sums do depend on the order, and compare bitwise with the canonical rank-order fold
//! ([`canonical_reference`]).

use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::Result;
use crate::comm::Communicator;
use crate::config::{BootstrapConfig, LaunchSource, TransportKind};
use crate::wire::collective::Collective;
use crate::Algo;
use half::{bf16, f16};
use std::time::Duration;

/// A configuration for `rank` of a `size`-rank job on this host, rendezvous on
/// 127.0.0.1:`port`.
pub fn local_config(rank: usize, size: usize, port: u16, timeout: Duration) -> BootstrapConfig {
    BootstrapConfig {
        rank,
        world_size: size,
        local_rank: Some(rank),
        local_world_size: Some(size),
        host_id: Some("local-test-host".into()),
        master_addr: "127.0.0.1".into(),
        master_port: port,
        timeout,
        transport: TransportKind::Auto,
        socket_ifname: None,
        listen_host: None,
        token_file: None,
        job_token: None,
        source: LaunchSource::Hcomm,
        nsocks: 1,
    }
}

/// A master port free on loopback a moment ago, outside the ephemeral range and new to this
/// process ([`crate::bootstrap::free_master_port`]).
pub fn free_port() -> u16 {
    crate::bootstrap::free_master_port("127.0.0.1").expect("a free port")
}

/// Run `f` on `n` ranks, each a thread with its own communicator, and return each rank's result
/// (index = rank). Bootstrap failures are returned as that rank's error.
pub fn run_threads<R, F>(n: usize, timeout: Duration, f: F) -> Vec<Result<R>>
where
    R: Send,
    F: Fn(Communicator) -> Result<R> + Sync,
{
    run_threads_with(n, TransportKind::Auto, timeout, f)
}

/// [`run_threads`] with the ranks' transport forced to `transport`.
pub fn run_threads_with<R, F>(
    n: usize,
    transport: TransportKind,
    timeout: Duration,
    f: F,
) -> Vec<Result<R>>
where
    R: Send,
    F: Fn(Communicator) -> Result<R> + Sync,
{
    run_threads_configured(n, timeout, |cfg| BootstrapConfig { transport, ..cfg }, f)
}

/// [`run_threads`] with each rank's configuration passed through `configure` first (to set
/// the transport, the sockets per peer (`nsocks`), ...).
pub fn run_threads_configured<R, C, F>(
    n: usize,
    timeout: Duration,
    configure: C,
    f: F,
) -> Vec<Result<R>>
where
    R: Send,
    C: Fn(BootstrapConfig) -> BootstrapConfig + Sync,
    F: Fn(Communicator) -> Result<R> + Sync,
{
    let port = free_port();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (f, configure) = (&f, &configure);
                s.spawn(move || {
                    let cfg = configure(local_config(r, n, port, timeout));
                    Communicator::from_config(&cfg).and_then(f)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// A barrier for the threads of a test that gives up: [`wait`](Self::wait) panics when the
/// others have not all arrived within its bound. With `std::sync::Barrier`, one rank thread
/// that failed an assertion left the others waiting for ever, and the test run hung instead
/// of failing (2026-12-07).
pub struct TestBarrier {
    parties: usize,
    bound: Duration,
    /// (threads arrived in this round, rounds completed)
    state: std::sync::Mutex<(usize, u64)>,
    all_in: std::sync::Condvar,
}

impl TestBarrier {
    /// A barrier for `parties` threads that waits at most 60 s.
    pub fn new(parties: usize) -> TestBarrier {
        TestBarrier::with_bound(parties, Duration::from_secs(60))
    }

    /// A barrier for `parties` threads that waits at most `bound`.
    pub fn with_bound(parties: usize, bound: Duration) -> TestBarrier {
        TestBarrier {
            parties,
            bound,
            state: std::sync::Mutex::new((0, 0)),
            all_in: std::sync::Condvar::new(),
        }
    }

    /// Wait until all the parties have called `wait` in this round. Panics, naming how many
    /// arrived, when they have not within the bound (a thread that failed never comes).
    pub fn wait(&self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let round = st.1;
        st.0 += 1;
        if st.0 == self.parties {
            *st = (0, round + 1);
            self.all_in.notify_all();
            return;
        }
        let deadline = std::time::Instant::now() + self.bound;
        while st.1 == round {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                let arrived = st.0;
                drop(st);
                panic!(
                    "test barrier: {arrived} of {} threads arrived within {:?} (another thread failed?)",
                    self.parties, self.bound
                );
            }
            st = self
                .all_in
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Every rank's value, panicking with the rank and its error if one failed (for tests).
pub fn expect_all<R>(results: Vec<Result<R>>) -> Vec<R> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// Like [`run_threads`], with rank `r` claiming to be on host `hosts[r]` (as `HCOMM_HOST_ID`
/// would), to test multi-host algorithms on one machine.
pub fn run_threads_on_hosts<R, F>(hosts: &[&str], timeout: Duration, f: F) -> Vec<Result<R>>
where
    R: Send,
    F: Fn(Communicator) -> Result<R> + Sync,
{
    run_threads_on_hosts_configured(hosts, timeout, |cfg| cfg, f)
}

/// [`run_threads_on_hosts`] with each rank's configuration passed through `configure` first
/// (a transport, a number of sockets).
pub fn run_threads_on_hosts_configured<R, C, F>(
    hosts: &[&str],
    timeout: Duration,
    configure: C,
    f: F,
) -> Vec<Result<R>>
where
    R: Send,
    C: Fn(BootstrapConfig) -> BootstrapConfig + Sync,
    F: Fn(Communicator) -> Result<R> + Sync,
{
    let port = free_port();
    let n = hosts.len();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (f, configure) = (&f, &configure);
                let host = hosts[r].to_string();
                s.spawn(move || {
                    let local: Vec<usize> = (0..n).filter(|&q| hosts[q] == host).collect();
                    let cfg = configure(BootstrapConfig {
                        host_id: Some(host.clone()),
                        local_rank: local.iter().position(|&q| q == r),
                        local_world_size: Some(local.len()),
                        ..local_config(r, n, port, timeout)
                    });
                    Communicator::from_config(&cfg).and_then(f)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Value (as f64) of element `i` of rank `rank`'s input for a test with `seed`.
pub fn input_value(dtype: DType, op: ReduceOp, rank: usize, i: usize, seed: u64) -> f64 {
    let h = (i as u64)
        .wrapping_mul(7)
        .wrapping_add(rank as u64 * 13)
        .wrapping_add(seed.wrapping_mul(31))
        % 1009;
    let signed = !matches!(dtype, DType::U8 | DType::U32 | DType::U64);
    match op {
        ReduceOp::Prod => {
            let v = [1.0, 2.0, -1.0, 1.0, 1.0][(h % 5) as usize];
            if signed {
                v
            } else {
                v.abs()
            }
        }
        ReduceOp::Min | ReduceOp::Max => {
            if signed {
                (h % 101) as f64 - 50.0
            } else {
                (h % 101) as f64
            }
        }
        ReduceOp::Sum | ReduceOp::Mean => {
            if signed {
                (h % 7) as f64 - 3.0
            } else {
                (h % 7) as f64
            }
        }
    }
}

/// Append `v` (a small integer) as one `dtype` element.
fn push_value(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
        DType::I8 => out.extend_from_slice(&(v as i8).to_le_bytes()),
        DType::I16 => out.extend_from_slice(&(v as i16).to_le_bytes()),
        DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
        DType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
        DType::U8 => out.extend_from_slice(&(v as u8).to_le_bytes()),
        DType::U32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
        DType::U64 => out.extend_from_slice(&(v as u64).to_le_bytes()),
    }
}

/// Encode f64 values (small integers) as `dtype` bytes.
pub fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    vals.iter().for_each(|&v| push_value(dtype, v, &mut out));
    out
}

/// Rank `rank`'s input of `count` elements.
pub fn input(dtype: DType, op: ReduceOp, rank: usize, count: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    (0..count).for_each(|i| push_value(dtype, input_value(dtype, op, rank, i, seed), &mut out));
    out
}

/// The reference reduction of element `i` over `n` ranks, computed in f64 (exact for the small
/// integer inputs), with `Mean` as the integer-truncating or float division the library
/// documents.
pub fn reference_value(dtype: DType, op: ReduceOp, n: usize, i: usize, seed: u64) -> f64 {
    let vals = (0..n).map(|r| input_value(dtype, op, r, i, seed));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Mean => {
            let s: f64 = vals.sum();
            if dtype.is_float() {
                s / n as f64
            } else {
                (s / n as f64).trunc()
            }
        }
    }
}

/// Reference reduction of `count` elements as `dtype` bytes.
pub fn reference(dtype: DType, op: ReduceOp, n: usize, count: usize, seed: u64) -> Vec<u8> {
    let vals: Vec<f64> = (0..count)
        .map(|i| reference_value(dtype, op, n, i, seed))
        .collect();
    encode(dtype, &vals)
}

/// Rank `rank`'s input of `count` elements for a deterministic-mode case: random floats that
/// are not integers (24 random bits, so the order of additions shows in the last bits: small
/// integers would sum exactly in any order), from `[-1000, 1000)` for `Sum`, `Mean`, `Min` and
/// `Max`, from `[0.5, 2)` for `Prod` (a product of a few ranks stays finite even in f16).
/// Integer types get [`input`]'s small integers, whose reductions are exact in any order.
pub fn random_input(dtype: DType, op: ReduceOp, rank: usize, count: usize, seed: u64) -> Vec<u8> {
    if !dtype.is_float() {
        return input(dtype, op, rank, count, seed);
    }
    let mut rng = crate::compress::SplitMix64::new(
        seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9),
    );
    let vals: Vec<f64> = (0..count)
        .map(|_| {
            let u = rng.next_unit_f32() as f64;
            if op == ReduceOp::Prod {
                0.5 + 1.5 * u
            } else {
                (u - 0.5) * 2000.0
            }
        })
        .collect();
    encode_rounded(dtype, &vals)
}

/// Encode f64 values as `dtype` bytes, rounded to the nearest (floats only).
fn encode_rounded(dtype: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            _ => unreachable!("encode_rounded is for floats"),
        }
    }
    out
}

/// The canonical expression of deterministic mode, computed plainly, one element at a time:
/// rank 0's element, combined with rank 1's, then rank 2's, … in rank order; f32 and f64 in
/// their own precision, f16 and bf16 widened to f32 and rounded once at the end; `Mean` is the
/// sum divided by `n` in that precision (f32 for the 16-bit floats), then rounded once. Inputs are
/// [`random_input`]'s. Integer types: [`reference()`] (exact).
pub fn canonical_reference(
    dtype: DType,
    op: ReduceOp,
    n: usize,
    count: usize,
    seed: u64,
) -> Vec<u8> {
    if !dtype.is_float() {
        return reference(dtype, op, n, count, seed);
    }
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| random_input(dtype, op, r, count, seed))
        .collect();
    let es = dtype.size();
    let mut out = Vec::with_capacity(count * es);
    for i in 0..count {
        let at = |r: usize| &inputs[r][i * es..(i + 1) * es];
        match dtype {
            DType::F64 => {
                let x = |r| f64::from_le_bytes(at(r).try_into().unwrap());
                let mut acc = x(0);
                for r in 1..n {
                    acc = combine(op, acc, x(r));
                }
                if op == ReduceOp::Mean {
                    acc /= n as f64;
                }
                out.extend_from_slice(&acc.to_le_bytes());
            }
            _ => {
                let x = |r: usize| -> f32 {
                    let b: [u8; 2] = at(r).try_into().unwrap_or([0, 0]);
                    match dtype {
                        DType::F32 => f32::from_le_bytes(at(r).try_into().unwrap()),
                        DType::F16 => f16::from_le_bytes(b).to_f32(),
                        _ => bf16::from_le_bytes(b).to_f32(),
                    }
                };
                let mut acc = x(0);
                for r in 1..n {
                    acc = combine(op, acc, x(r));
                }
                match dtype {
                    DType::F32 => {
                        if op == ReduceOp::Mean {
                            acc /= n as f32;
                        }
                        out.extend_from_slice(&acc.to_le_bytes());
                    }
                    _ => {
                        // f16, bf16: the mean is divided in f32 and rounded once, as the sum is.
                        if op == ReduceOp::Mean {
                            acc /= n as f32;
                        }
                        if dtype == DType::F16 {
                            out.extend_from_slice(&f16::from_f32(acc).to_le_bytes());
                        } else {
                            out.extend_from_slice(&bf16::from_f32(acc).to_le_bytes());
                        }
                    }
                }
            }
        }
    }
    out
}

/// One step of the canonical fold, as the library's kernels compute it: Min and Max keep the
/// accumulated value on ties (the sign of a zero included).
fn combine<T>(op: ReduceOp, a: T, b: T) -> T
where
    T: Copy + PartialOrd + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    match op {
        ReduceOp::Sum | ReduceOp::Mean => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min if b < a => b,
        ReduceOp::Max if b > a => b,
        ReduceOp::Min | ReduceOp::Max => a,
    }
}

/// One correctness case.
#[derive(Clone, Debug)]
pub struct Case {
    /// Which collective.
    pub coll: Collective,
    /// Element type.
    pub dtype: DType,
    /// Reduction (ignored by non-reducing collectives).
    pub op: ReduceOp,
    /// Elements per rank (per block for gather/scatter/all-gather/reduce-scatter/all-to-all).
    pub count: usize,
    /// Root of rooted collectives.
    pub root: usize,
    /// In-place variant.
    pub in_place: bool,
    /// Algorithm to force (`Auto` = selector's choice).
    pub algo: Algo,
    /// Seed of the inputs.
    pub seed: u64,
    /// Deterministic mode: the communicator reduces in the canonical order
    /// ([`Communicator::set_deterministic`]), the float inputs are [`random_input`]'s and the
    /// result must be bitwise [`canonical_reference`]'s, whatever `algo` asks for.
    pub deterministic: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} dtype={} op={} count={} root={} {} algo={} seed={}",
            self.coll.name(),
            self.dtype,
            self.op,
            self.count,
            self.root,
            if self.in_place {
                "in-place"
            } else {
                "out-of-place"
            },
            self.algo,
            self.seed
        )
    }
}

fn first_diff(dtype: DType, got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("length {} != expected {}", got.len(), want.len()));
    }
    let es = dtype.size();
    let bad: Vec<usize> = (0..got.len() / es)
        .filter(|&i| got[i * es..(i + 1) * es] != want[i * es..(i + 1) * es])
        .collect();
    let &i = bad.first()?;
    Some(format!(
        "{} wrong element(s), first at index {i}: got bytes {:02x?}, expected {:02x?}",
        bad.len(),
        &got[i * es..(i + 1) * es],
        &want[i * es..(i + 1) * es]
    ))
}

/// The two-stage compressed all-reduce of `inputs` (one vector per rank), simulated from
/// `codec`: for each chunk, every rank's part encoded and summed as decoded, and that sum
/// encoded and decoded once more (what each chunk's owner sends back). The reference the
/// compressed all-reduce's tests compare with bit for bit.
pub fn two_stage_compressed<C: crate::compress::Codec>(
    inputs: &[Vec<f32>],
    codec: &mut C,
    chunks: impl IntoIterator<Item = std::ops::Range<usize>>,
) -> Vec<f32> {
    let n = inputs[0].len();
    let mut out = vec![0f32; n];
    for c in chunks {
        let mut sum = vec![0f32; c.len()];
        for x in inputs {
            let mut enc = vec![0u8; codec.encoded_len(c.len())];
            codec.encode(&x[c.clone()], &mut enc).unwrap();
            codec.decode_add(&enc, &mut sum).unwrap();
        }
        let mut enc = vec![0u8; codec.encoded_len(c.len())];
        codec.encode(&sum, &mut enc).unwrap();
        codec.decode(&enc, &mut out[c]).unwrap();
    }
    out
}

/// For error-feedback conservation checks: add what `state` holds back (its residual, placed
/// at its slice of the vector when it has one, and its owner residual) into `sum`, and their
/// magnitudes into `scale` (`sum` and `scale` span the whole vector).
pub fn add_held_back(state: &crate::CompressionState, sum: &mut [f64], scale: &mut [f64]) {
    let base = state.slice().map_or(0, |s| s.start);
    for (i, v) in state.residual().iter().enumerate() {
        sum[base + i] += *v as f64;
        scale[base + i] += v.abs() as f64;
    }
    if let Some(owned) = state.owner_range() {
        for (i, v) in owned.zip(state.owner_residual()) {
            sum[i] += *v as f64;
            scale[i] += v.abs() as f64;
        }
    }
}

/// How many elements of `got` differ from `want` (the `#wrong` column of benchmarks).
pub fn count_wrong(dtype: DType, got: &[u8], want: &[u8]) -> usize {
    let es = dtype.size();
    if got.len() != want.len() {
        return got.len().max(want.len()) / es;
    }
    got.chunks(es)
        .zip(want.chunks(es))
        .filter(|(a, b)| a != b)
        .count()
}

/// Run `case` on `comm` and compare this rank's result with the reference. `Ok(None)` means
/// correct, `Ok(Some(msg))` a wrong result, `Err` an operation error.
pub fn run_case(comm: &Communicator, case: &Case) -> Result<Option<String>> {
    let n = comm.world_size();
    let me = comm.rank();
    let (dt, op, c, root, seed) = (case.dtype, case.op, case.count, case.root, case.seed);
    let es = dt.size();
    comm.set_algorithm(case.coll, case.algo)?;
    if case.deterministic != comm.is_deterministic() {
        comm.set_deterministic(case.deterministic);
    }
    let inp = |r: usize, cnt: usize| {
        if case.deterministic {
            random_input(dt, op, r, cnt, seed)
        } else {
            input(dt, op, r, cnt, seed)
        }
    };
    let reference = |dt, op, n, cnt, seed| {
        if case.deterministic {
            canonical_reference(dt, op, n, cnt, seed)
        } else {
            reference(dt, op, n, cnt, seed)
        }
    };
    let diff = match case.coll {
        Collective::AllReduce => {
            let send = inp(me, c);
            let mut recv = vec![0u8; c * es];
            if case.in_place {
                recv.copy_from_slice(&send);
                comm.all_reduce_bytes(None, &mut recv, dt, op)?;
            } else {
                comm.all_reduce_bytes(Some(&send), &mut recv, dt, op)?;
            }
            first_diff(dt, &recv, &reference(dt, op, n, c, seed))
        }
        Collective::Reduce => {
            let send = inp(me, c);
            let mut recv = if case.in_place {
                send.clone()
            } else {
                vec![0u8; if me == root { c * es } else { 0 }]
            };
            if case.in_place {
                comm.reduce_bytes(None, &mut recv, dt, op, root)?;
            } else {
                comm.reduce_bytes(Some(&send), &mut recv, dt, op, root)?;
            }
            if me == root {
                first_diff(dt, &recv, &reference(dt, op, n, c, seed))
            } else if case.in_place {
                first_diff(dt, &recv, &send).map(|m| format!("non-root input modified: {m}"))
            } else {
                None
            }
        }
        Collective::ReduceScatter => {
            // Block b of rank r = elements [b*c, (b+1)*c) of a (n*c)-element input.
            let send = inp(me, n * c);
            let full = reference(dt, op, n, n * c, seed);
            let want = &full[me * c * es..(me + 1) * c * es];
            if case.in_place {
                let mut buf = send.clone();
                let counts = vec![c; n];
                comm.reduce_scatter_v_bytes(None, &mut buf, &counts, dt, op)?;
                let mut expect = send.clone();
                expect[me * c * es..(me + 1) * c * es].copy_from_slice(want);
                first_diff(dt, &buf, &expect)
            } else {
                let mut recv = vec![0u8; c * es];
                comm.reduce_scatter_v_bytes(Some(&send), &mut recv, &vec![c; n], dt, op)?;
                first_diff(dt, &recv, want)
            }
        }
        Collective::AllGather => {
            let want: Vec<u8> = (0..n).flat_map(|r| inp(r, c)).collect();
            let mut recv = vec![0u8; n * c * es];
            if case.in_place {
                recv[me * c * es..(me + 1) * c * es].copy_from_slice(&inp(me, c));
                comm.all_gather_v_bytes(None, &mut recv, &vec![c; n], dt)?;
            } else {
                comm.all_gather_v_bytes(Some(&inp(me, c)), &mut recv, &vec![c; n], dt)?;
            }
            first_diff(dt, &recv, &want)
        }
        Collective::Broadcast => {
            let want = inp(root, c);
            let mut buf = if me == root {
                want.clone()
            } else {
                vec![0u8; c * es]
            };
            comm.broadcast_bytes(&mut buf, dt, root)?;
            first_diff(dt, &buf, &want)
        }
        Collective::Gather => {
            let mut recv = vec![0u8; if me == root { n * c * es } else { 0 }];
            comm.gather_v_bytes(&inp(me, c), &mut recv, &vec![c; n], dt, root)?;
            if me == root {
                let want: Vec<u8> = (0..n).flat_map(|r| inp(r, c)).collect();
                first_diff(dt, &recv, &want)
            } else {
                None
            }
        }
        Collective::Scatter => {
            let all = inp(root, n * c);
            let send = if me == root { all.clone() } else { Vec::new() };
            let mut recv = vec![0u8; c * es];
            comm.scatter_v_bytes(&send, &mut recv, &vec![c; n], dt, root)?;
            first_diff(dt, &recv, &all[me * c * es..(me + 1) * c * es])
        }
        Collective::AllToAll => {
            // Rank r's input: n blocks of c; block p goes to rank p.
            let send = inp(me, n * c);
            let mut recv = vec![0u8; n * c * es];
            comm.all_to_all_v_bytes(&send, &vec![c; n], &mut recv, &vec![c; n], dt)?;
            let want: Vec<u8> = (0..n)
                .flat_map(|p| inp(p, n * c)[me * c * es..(me + 1) * c * es].to_vec())
                .collect();
            first_diff(dt, &recv, &want)
        }
        Collective::Barrier => {
            comm.barrier()?;
            None
        }
    };
    Ok(diff)
}

/// True if `e` names rank `r` as the cause of a failure: `r` closed its link, was among the
/// ranks a timeout waited for, or another rank reported it as the culprit.
pub fn names_rank(e: &crate::Error, r: usize) -> bool {
    use crate::Error;
    match e {
        Error::PeerClosed { peer, .. } => *peer == r,
        Error::Timeout { peers, .. } => peers.contains(&r),
        Error::Remote { culprit, .. } => *culprit == Some(r),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::TestBarrier;
    use std::time::Duration;

    #[test]
    fn a_test_barrier_lets_rounds_through_and_gives_up_on_a_missing_thread() {
        let b = TestBarrier::with_bound(2, Duration::from_secs(30));
        std::thread::scope(|s| {
            s.spawn(|| (0..3).for_each(|_| b.wait()));
            (0..3).for_each(|_| b.wait());
        });
        let alone = TestBarrier::with_bound(2, Duration::from_millis(50));
        let why = std::panic::catch_unwind(|| alone.wait()).expect_err("nobody else comes");
        let why = why.downcast_ref::<String>().expect("a message");
        assert!(why.contains("1 of 2 threads arrived within 50ms"), "{why}");
    }
}
