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
    for &coll in &o.colls {
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
                "     reproduce: hcomm check -np {n} --colls {} --algos {} --dtypes {} --ops {} --counts {} --seed {}",
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
