//! Every collective × algorithm × dtype × reduce op × size × root × in-place/out-of-place
//! against the CPU reference, at 1, 2, 3 and 4 ranks (ranks are threads of this process, each
//! with its own communicator over loopback TCP).

use hcomm::config::TransportKind;
use hcomm::testing::{run_threads, run_threads_configured};
use hcomm::{BootstrapConfig, Collective, DType, ReduceOp};
use hcomm_cli::check::{run, CheckOpts};
use std::time::Duration;

fn sweep(n: usize, o: CheckOpts) {
    let res = run_threads(n, Duration::from_secs(60), |comm| run(&comm, &o));
    assert_clean(n, res);
}

fn assert_clean(n: usize, res: Vec<hcomm::Result<(usize, usize)>>) {
    for (rank, r) in res.into_iter().enumerate() {
        let (cases, failed) = r.unwrap_or_else(|e| panic!("{n} ranks, rank {rank}: {e}"));
        assert!(cases > 0);
        assert_eq!(
            failed, 0,
            "{n} ranks: {failed} of {cases} cases failed (see stderr)"
        );
    }
}

/// Every dtype and op at sizes 0, 1, 7 (prime) and 1031 (prime, divisible by no world size).
fn small_matrix(n: usize) {
    sweep(
        n,
        CheckOpts {
            counts: vec![0, 1, 7, 1031],
            ..CheckOpts::full()
        },
    );
}

/// ≥ 1 MiB per rank for every collective and algorithm, a spread of dtypes.
fn large(n: usize) {
    sweep(
        n,
        CheckOpts {
            dtypes: vec![DType::F32, DType::BF16, DType::I8, DType::F64],
            ops: vec![ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean],
            counts: vec![(1 << 20) + 3],
            ..CheckOpts::full()
        },
    );
}

/// TCP only, 4 sockets per peer (`HCOMM_NSOCKS=4`): sizes carried by one socket (below the
/// 256 KiB striping threshold per frame) and striped ones, with counts that neither the world
/// size nor the socket count divides (1 MiB + 3 bytes of i8: uneven stripes and blocks).
fn striped(n: usize) {
    let o = CheckOpts {
        dtypes: vec![DType::F32, DType::I8, DType::BF16, DType::F64],
        ops: vec![ReduceOp::Sum, ReduceOp::Max],
        counts: vec![0, 7, 1031, 100_003, (1 << 20) + 3],
        ..CheckOpts::full()
    };
    let res = run_threads_configured(
        n,
        Duration::from_secs(60),
        |cfg| BootstrapConfig {
            transport: TransportKind::Tcp,
            nsocks: 4,
            ..cfg
        },
        |comm| {
            assert_eq!(comm.nsocks(), 4);
            run(&comm, &o)
        },
    );
    assert_clean(n, res);
}

#[test]
fn nsocks_4_1_rank() {
    striped(1);
}

#[test]
fn nsocks_4_2_ranks() {
    striped(2);
}

#[test]
fn nsocks_4_3_ranks() {
    striped(3);
}

#[test]
fn nsocks_4_4_ranks() {
    striped(4);
}

#[test]
fn matrix_1_rank() {
    small_matrix(1);
    large(1);
}

#[test]
fn matrix_2_ranks() {
    small_matrix(2);
}

#[test]
fn matrix_3_ranks() {
    small_matrix(3);
}

#[test]
fn matrix_4_ranks() {
    small_matrix(4);
}

#[test]
fn large_2_ranks() {
    large(2);
}

#[test]
fn large_3_ranks() {
    large(3);
}

#[test]
fn large_4_ranks() {
    large(4);
}

/// The shared-memory algorithms with every rank publishing to memory (streaming stores) or
/// through the cache, forced (`HCOMM_SHM_PUBLISH`): the reference results either way, at sizes
/// that take the pipelined paths (over 4 KiB; several steps at 1 MiB + 3) and, at 3 ranks,
/// with the ranks disagreeing.
fn shm_publishing(n: usize) {
    use hcomm::config::{Publish, PublishSetting};
    let o = CheckOpts {
        dtypes: vec![DType::F32, DType::I8, DType::F64],
        ops: vec![ReduceOp::Sum, ReduceOp::Mean],
        counts: vec![1031, (1 << 20) + 3],
        algos: vec![hcomm::Algo::Shm],
        ..CheckOpts::full()
    };
    for mix in [
        [Publish::Memory; 3],
        [Publish::Cache, Publish::Memory, Publish::Cache],
    ] {
        let res = run_threads(n, Duration::from_secs(60), |comm| {
            comm.set_shm_publishing(PublishSetting::Always(mix[comm.rank() % 3]));
            run(&comm, &o)
        });
        assert_clean(n, res);
    }
}

#[test]
fn shm_publishing_2_ranks() {
    shm_publishing(2);
}

#[test]
fn shm_publishing_3_ranks() {
    shm_publishing(3);
}

#[test]
fn shm_publishing_4_ranks() {
    shm_publishing(4);
}

#[test]
fn results_are_bitwise_identical_across_ranks_with_non_integer_floats() {
    // Random-looking floats: sums depend on order, so equality across ranks shows every rank
    // got the same bits, and two runs give the same bits (determinism).
    for n in [2, 3, 4] {
        let runs: Vec<Vec<Vec<u32>>> = (0..2)
            .map(|_| {
                run_threads(n, Duration::from_secs(60), |comm| {
                    let mut out = Vec::new();
                    for &count in &[5usize, 1000, 300_001] {
                        let v: Vec<f32> = (0..count)
                            .map(|i| {
                                ((i * 2654435761 + comm.rank() * 97) % 10007) as f32 * 1.37e-3 + 0.1
                            })
                            .collect();
                        let mut r = vec![0f32; count];
                        comm.all_reduce(&v, &mut r, ReduceOp::Sum)?;
                        out.extend(r.iter().map(|x| x.to_bits()));
                    }
                    Ok(out)
                })
                .into_iter()
                .map(|r| r.unwrap())
                .collect()
            })
            .collect();
        for r in 1..n {
            assert!(
                runs[0][r] == runs[0][0],
                "{n} ranks: rank {r} differs from rank 0"
            );
        }
        assert!(runs[0][0] == runs[1][0], "{n} ranks: two runs differ");
    }
}

#[test]
fn hierarchical_all_reduce_on_two_simulated_hosts_matches_the_reference_and_flat() {
    use hcomm::testing::run_threads_on_hosts;
    use hcomm::Algo;
    // 2 hosts x 2 ranks (and 2 x 3): the sweep runs every algorithm, hierarchical included.
    for hosts in [
        &["a", "a", "b", "b"][..],
        &["a", "b", "a", "b", "a", "b"][..],
    ] {
        let o = CheckOpts {
            colls: vec![Collective::AllReduce],
            dtypes: vec![DType::F32, DType::I32, DType::BF16],
            counts: vec![0, 1, 7, 1031, 70_001],
            ..CheckOpts::full()
        };
        let res = run_threads_on_hosts(hosts, Duration::from_secs(60), |comm| {
            assert!(comm.supports(Algo::Hierarchical) && !comm.has_shared_memory());
            // Chosen automatically for large messages across hosts.
            assert_eq!(
                comm.algorithm_for(Collective::AllReduce, 4 << 20),
                Algo::Hierarchical
            );
            let sweep = run(&comm, &o)?;
            // Identical bits to the flat ring on non-integer data? Different orders may round
            // differently, so compare on integer-valued data (exact in any order).
            let v: Vec<f64> = (0..100_003)
                .map(|i| ((i * 7 + comm.rank() * 3) % 11) as f64)
                .collect();
            let mut hier = vec![0f64; v.len()];
            let mut flat = vec![0f64; v.len()];
            comm.set_algorithm(Collective::AllReduce, Algo::Hierarchical)?;
            comm.all_reduce(&v, &mut hier, ReduceOp::Sum)?;
            comm.set_algorithm(Collective::AllReduce, Algo::Ring)?;
            comm.all_reduce(&v, &mut flat, ReduceOp::Sum)?;
            assert!(hier == flat);
            Ok(sweep)
        });
        for (rank, r) in res.into_iter().enumerate() {
            let (cases, failed) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert!(cases > 0);
            assert_eq!(failed, 0, "{hosts:?}: {failed} of {cases} cases failed");
        }
    }
}

#[test]
fn every_collective_has_a_case() {
    let cases = hcomm_cli::check::cases(&CheckOpts::quick(), 3);
    for c in Collective::ALL {
        assert!(cases.iter().any(|k| k.coll == c), "{c:?} not covered");
    }
}
