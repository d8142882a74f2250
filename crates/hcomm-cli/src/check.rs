//! `hcomm check`: a correctness sweep of every collective × algorithm × dtype × reduce op ×
//! size × root × in-place/out-of-place against the CPU reference in [`hcomm::testing`].

use hcomm::testing::{run_case, Case};
use hcomm::{Algo, Collective, Communicator, DType, ReduceOp, Result};

/// What to sweep.
#[derive(Clone, Debug)]
pub struct CheckOpts {
    /// Collectives.
    pub colls: Vec<Collective>,
    /// Element types.
    pub dtypes: Vec<DType>,
    /// Reductions (for reducing collectives).
    pub ops: Vec<ReduceOp>,
    /// Element counts (per block for blocked collectives).
    pub counts: Vec<usize>,
    /// Input seed.
    pub seed: u64,
    /// Print every case.
    pub verbose: bool,
    /// Only these algorithms (empty: every algorithm of each collective).
    pub algos: Vec<Algo>,
    /// Deterministic mode: only the reducing collectives, on random non-integer floats, each
    /// result bitwise the canonical rank-order fold ([`hcomm::testing::canonical_reference`])
    /// whatever algorithm is forced.
    pub deterministic: bool,
}

impl CheckOpts {
    /// The full sweep: sizes 0, 1, a prime, a count no world size up to 4 divides evenly, and
    /// a large one (> 1 MiB of f32).
    pub fn full() -> CheckOpts {
        CheckOpts {
            colls: Collective::ALL.to_vec(),
            dtypes: DType::ALL.to_vec(),
            ops: ReduceOp::ALL.to_vec(),
            counts: vec![0, 1, 7, 1031, 262_147],
            seed: 1,
            verbose: false,
            algos: Vec::new(),
            deterministic: false,
        }
    }

    /// A quick sweep (three dtypes, small sizes).
    pub fn quick() -> CheckOpts {
        CheckOpts {
            dtypes: vec![DType::F32, DType::BF16, DType::I32],
            counts: vec![0, 1, 7, 1031],
            ..CheckOpts::full()
        }
    }
}

fn reduces(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter
    )
}

fn has_in_place(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce
            | Collective::Reduce
            | Collective::ReduceScatter
            | Collective::AllGather
    )
}

fn rooted(c: Collective) -> bool {
    matches!(
        c,
        Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
    )
}

/// Every case of the sweep for `n` ranks, in the order all ranks run them.
pub fn cases(o: &CheckOpts, n: usize) -> Vec<Case> {
    let mut v = Vec::new();
    for &coll in o.colls.iter().filter(|&&c| !o.deterministic || reduces(c)) {
        let counts: &[usize] = if coll == Collective::Barrier {
            &[0]
        } else {
            &o.counts
        };
        let dtypes: &[DType] = if coll == Collective::Barrier {
            &[DType::U8]
        } else {
            &o.dtypes
        };
        for &algo in coll
            .algorithms()
            .iter()
            .filter(|a| o.algos.is_empty() || o.algos.contains(a))
        {
            for &dtype in dtypes {
                let ops: &[ReduceOp] = if reduces(coll) {
                    &o.ops
                } else {
                    &[ReduceOp::Sum]
                };
                for &op in ops {
                    for &count in counts {
                        let roots = if rooted(coll) { n } else { 1 };
                        for root in 0..roots {
                            for in_place in [false, true] {
                                if in_place && !has_in_place(coll) {
                                    continue;
                                }
                                v.push(Case {
                                    coll,
                                    dtype,
                                    op,
                                    count,
                                    root,
                                    in_place,
                                    algo,
                                    seed: o.seed,
                                    deterministic: o.deterministic,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

/// Run the sweep on this rank. Returns (cases run, failures seen by any rank). Each rank prints
/// its own failures with everything needed to reproduce them.
pub fn run(comm: &Communicator, o: &CheckOpts) -> Result<(usize, usize)> {
    let n = comm.world_size();
    let me = comm.rank();
    // Only the algorithms this communicator's topology allows (shm: one host; hierarchical:
    // several hosts of several ranks).
    let all: Vec<Case> = cases(o, n)
        .into_iter()
        .filter(|c| comm.supports(c.algo))
        .collect();
    let mut failed_cases = 0usize;
    for case in &all {
        let diff = run_case(comm, case)?;
        if o.verbose && me == 0 {
            println!("ok? {}  {case}", diff.is_none());
        }
        let mut bad = [u32::from(diff.is_some())];
        comm.all_reduce_in_place(&mut bad, ReduceOp::Sum)?;
        if let Some(msg) = diff {
            crate::say!("FAIL rank {me} of {n}: {case}: {msg}");
            crate::say!(
                "     reproduce: hcomm check -np {n}{} --colls {} --algos {} --dtypes {} --ops {} --counts {} --seed {}",
                if case.deterministic { " --deterministic" } else { "" },
                case.coll.name(),
                case.algo,
                case.dtype,
                case.op,
                case.count,
                case.seed
            );
        }
        if bad[0] > 0 {
            failed_cases += 1;
        }
    }
    comm.set_algorithm(Collective::AllReduce, Algo::Auto)?;
    Ok((all.len(), failed_cases))
}

/// What a soak run does: `ops` random cases (or until `duration` passes, whichever is first),
/// from `seed`.
#[derive(Clone, Debug)]
pub struct SoakOpts {
    /// Random cases to run.
    pub ops: usize,
    /// Stop early after this long (the ranks agree on when, at a case boundary).
    pub duration: Option<std::time::Duration>,
    /// Seed of the case sequence (the same on every rank).
    pub seed: u64,
}

/// What a soak run saw (summed over ranks).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SoakReport {
    /// Cases run (each by every rank).
    pub ops: usize,
    /// Of which run through the asynchronous engine.
    pub async_ops: usize,
    /// Wrong results (rank × case).
    pub wrong: usize,
}

/// splitmix64: a tiny deterministic generator, identical on every rank.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The `i`-th random case of a soak with `seed` on `n` ranks (every rank computes the same).
pub fn soak_case(seed: u64, i: usize, n: usize, supports: &dyn Fn(Algo) -> bool) -> Case {
    let mut g = SplitMix(seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let coll = Collective::ALL[g.below(Collective::ALL.len())];
    let algos: Vec<Algo> = std::iter::once(Algo::Auto)
        .chain(coll.algorithms().iter().copied())
        .filter(|&a| supports(a))
        .collect();
    // Mostly small (latency paths), some medium, a few large (pipelined paths).
    let count = match g.below(100) {
        0..=69 => g.below(2000),
        70..=94 => g.below(100_000),
        _ => g.below(1_000_000),
    };
    Case {
        coll,
        dtype: DType::ALL[g.below(DType::ALL.len())],
        op: if reduces(coll) {
            ReduceOp::ALL[g.below(ReduceOp::ALL.len())]
        } else {
            ReduceOp::Sum
        },
        count: if coll == Collective::Barrier {
            0
        } else {
            count
        },
        root: if rooted(coll) { g.below(n) } else { 0 },
        in_place: has_in_place(coll) && g.below(2) == 1,
        algo: algos[g.below(algos.len())],
        seed: g.next() % 1000,
        deterministic: false,
    }
}

/// Random operations, each checked against the reference; every fourth case runs through the
/// asynchronous engine with up to three more in flight. Wrong results are printed with the
/// case as they happen; the report is summed over the ranks.
pub fn soak(comm: &std::sync::Arc<Communicator>, o: &SoakOpts) -> Result<SoakReport> {
    let n = comm.world_size();
    let me = comm.rank();
    let start = std::time::Instant::now();
    let mut in_flight: std::collections::VecDeque<(Case, hcomm::Work<Option<String>>)> =
        std::collections::VecDeque::new();
    let mut rep = SoakReport::default();
    let report = |case: &Case, diff: Option<String>, rep: &mut SoakReport| {
        if let Some(msg) = diff {
            rep.wrong += 1;
            crate::say!("FAIL rank {me} of {n}: {case}: {msg}");
        }
    };
    for i in 0..o.ops {
        if i % 64 == 0 {
            if let Some(limit) = o.duration {
                // Agree on stopping (rank 0's clock) so that every rank runs the same cases.
                let mut stop = [u8::from(start.elapsed() >= limit)];
                comm.broadcast(&mut stop, 0)?;
                if stop[0] == 1 {
                    break;
                }
            }
        }
        let case = soak_case(o.seed, i, n, &|a| comm.supports(a));
        if i % 4 == 3 {
            let c = case.clone();
            in_flight.push_back((case, comm.run_async("soak", move |comm| run_case(comm, &c))));
            rep.async_ops += 1;
            if in_flight.len() >= 4 {
                let (case, w) = in_flight.pop_front().expect("non-empty");
                report(&case, w.wait()?, &mut rep);
            }
        } else {
            // A blocking case waits its turn behind the asynchronous ones already issued.
            report(&case, run_case(comm, &case)?, &mut rep);
        }
        rep.ops += 1;
    }
    while let Some((case, w)) = in_flight.pop_front() {
        report(&case, w.wait()?, &mut rep);
    }
    let mut wrong = [rep.wrong as u64];
    comm.all_reduce_in_place(&mut wrong, ReduceOp::Sum)?;
    rep.wrong = wrong[0] as usize;
    for c in Collective::ALL {
        comm.set_algorithm(c, Algo::Auto)?;
    }
    Ok(rep)
}

#[cfg(test)]
mod soak_tests {
    use super::*;

    #[test]
    fn soak_cases_are_deterministic_and_cover_every_collective() {
        let all = |_: Algo| true;
        let a: Vec<String> = (0..500)
            .map(|i| soak_case(7, i, 3, &all).to_string())
            .collect();
        let b: Vec<String> = (0..500)
            .map(|i| soak_case(7, i, 3, &all).to_string())
            .collect();
        assert_eq!(a, b);
        for c in Collective::ALL {
            assert!(a.iter().any(|s| s.starts_with(c.name())), "{}", c.name());
        }
        let tcp_only = |a: Algo| a != Algo::Shm && a != Algo::Hierarchical;
        assert!((0..500).all(|i| tcp_only(soak_case(7, i, 3, &tcp_only).algo)));
    }
}
