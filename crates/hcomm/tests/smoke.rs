use hcomm::testing::{run_case, run_threads, Case};
use hcomm::{Algo, Collective, DType, ReduceOp};
use std::time::Duration;

#[test]
fn smoke_all_collectives() {
    for n in 1..=4 {
        let res = run_threads(n, Duration::from_secs(20), |comm| {
            let mut failures = Vec::new();
            for coll in Collective::ALL {
                for &count in &[0usize, 1, 7, 1000, 300_000] {
                    for algo in std::iter::once(Algo::Auto).chain(coll.algorithms().iter().copied())
                    {
                        let case = Case {
                            coll,
                            dtype: DType::F32,
                            op: ReduceOp::Sum,
                            count,
                            root: n - 1,
                            in_place: false,
                            algo,
                            seed: 1,
                        };
                        if let Some(m) = run_case(&comm, &case)? {
                            failures.push(format!("rank {}: {case}: {m}", comm.rank()));
                        }
                    }
                }
            }
            Ok(failures)
        });
        for (r, x) in res.into_iter().enumerate() {
            let f = x.unwrap_or_else(|e| panic!("n={n} rank {r}: {e}"));
            assert!(f.is_empty(), "n={n}: {f:#?}");
        }
    }
}
