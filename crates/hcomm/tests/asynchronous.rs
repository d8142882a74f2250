//! Asynchronous operations: every `*_async` form against a reference at 1–4 ranks, over TCP
//! and shared memory; many operations in flight; issue-order completion; independent progress
//! of different communicators; errors, timeouts, abort and panics delivered through `Work`.
//! Ranks are threads of this process.

use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Communicator, Error, ReduceOp, Work};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(30);

/// Run `f` on `n` ranks (threads), each with a communicator on `transport` held in an `Arc`.
fn ranks<R, F>(n: usize, transport: TransportKind, timeout: Duration, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(Arc<Communicator>) -> hcomm::Result<R> + Sync,
{
    expect_all(run_threads_with(n, transport, timeout, |c| f(Arc::new(c))))
}

const TRANSPORTS: [TransportKind; 2] = [TransportKind::Tcp, TransportKind::Auto];

#[test]
fn every_async_form_matches_the_reference() {
    for transport in TRANSPORTS {
        for n in 1..=4usize {
            ranks(n, transport, T, |c| {
                let (r, w) = (c.rank(), c.world_size());
                let count = 1001; // odd
                let mine: Vec<i64> = (0..count).map(|i| (i * (r + 1)) as i64).collect();
                let sum: Vec<i64> = (0..count)
                    .map(|i| (1..=w).map(|k| (i * k) as i64).sum())
                    .collect();
                let root = w - 1;

                // Issue everything first, wait afterwards: all in flight at once.
                let ar = c.all_reduce_async(mine.clone(), ReduceOp::Sum);
                let bc = c.broadcast_async(
                    if r == root {
                        mine.clone()
                    } else {
                        vec![0; count]
                    },
                    root,
                );
                let rd = c.reduce_async(mine.clone(), ReduceOp::Sum, root);
                let ag = c.all_gather_async(mine.clone(), vec![0i64; count * w]);
                let rs_send: Vec<i64> = (0..count * w).map(|i| (i + r) as i64).collect();
                let rs = c.reduce_scatter_async(rs_send, vec![0i64; count], ReduceOp::Max);
                let ga = c.gather_async(
                    mine.clone(),
                    if r == root {
                        vec![0; count * w]
                    } else {
                        vec![]
                    },
                    root,
                );
                let sc_send: Vec<i64> = if r == 0 {
                    (0..(count * w) as i64).collect()
                } else {
                    vec![]
                };
                let sc = c.scatter_async(sc_send, vec![0i64; count], 0);
                let a2a_send: Vec<i64> = (0..w).map(|dst| (r * 100 + dst) as i64).collect();
                let a2a = c.all_to_all_async(a2a_send, vec![0i64; w]);
                let bar = c.barrier_async();

                assert_eq!(ar.wait()?, sum, "all_reduce");
                assert_eq!(bc.wait()?, mine_of(root, count), "broadcast");
                let reduced = rd.wait()?;
                if r == root {
                    assert_eq!(reduced, sum, "reduce at root");
                } else {
                    assert_eq!(reduced, mine, "reduce leaves non-roots' input");
                }
                let (_, gathered) = ag.wait()?;
                let want: Vec<i64> = (0..w).flat_map(|q| mine_of(q, count)).collect();
                assert_eq!(gathered, want, "all_gather");
                let (_, scattered) = rs.wait()?;
                let want: Vec<i64> = (0..count).map(|i| (r * count + i + w - 1) as i64).collect();
                assert_eq!(scattered, want, "reduce_scatter max");
                let (_, g) = ga.wait()?;
                if r == root {
                    let want: Vec<i64> = (0..w).flat_map(|q| mine_of(q, count)).collect();
                    assert_eq!(g, want, "gather");
                }
                let (_, s) = sc.wait()?;
                let want: Vec<i64> = ((r * count) as i64..((r + 1) * count) as i64).collect();
                assert_eq!(s, want, "scatter");
                let (_, a) = a2a.wait()?;
                let want: Vec<i64> = (0..w).map(|src| (src * 100 + r) as i64).collect();
                assert_eq!(a, want, "all_to_all");
                bar.wait()?;

                if w >= 2 {
                    // Ring of point-to-point: send to the next, receive from the previous.
                    let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
                    // (Any order works: posted point-to-point progresses in the background;
                    // tests/p2p_orders.rs sweeps them.)
                    let sd = c.send_async(next, 5, vec![r as u8; 100]);
                    let rv = c.recv_async(prev, 5, vec![0u8; 100]);
                    sd.wait()?;
                    assert!(rv.wait()?.iter().all(|&b| b == prev as u8), "recv");
                    c.signal_async(next, 9).wait()?;
                    c.wait_signal_async(prev, 9).wait()?;
                }
                Ok(())
            });
        }
    }
}

fn mine_of(rank: usize, count: usize) -> Vec<i64> {
    (0..count).map(|i| (i * (rank + 1)) as i64).collect()
}

#[test]
fn operations_complete_in_issue_order_and_blocking_calls_wait_for_earlier_async_ones() {
    for transport in TRANSPORTS {
        ranks(3, transport, T, |c| {
            let log = Arc::new(Mutex::new(Vec::new()));
            let mut works: Vec<Work<()>> = Vec::new();
            for i in 0..40u32 {
                let log = log.clone();
                // Sizes vary so later operations would finish first if they could overtake.
                let n = if i % 2 == 0 { 200_000 } else { 1 };
                works.push(c.run_async("step", move |c| {
                    let mut v = vec![i; n];
                    c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
                    assert_eq!(v[0], 3 * i);
                    log.lock().unwrap().push(i);
                    Ok(())
                }));
            }
            // A blocking call issued now runs after all 40.
            let mut x = [1u32];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            assert_eq!(x[0], 3);
            assert_eq!(
                log.lock().unwrap().len(),
                40,
                "blocking call overtook async ones"
            );
            // Waiting in reverse order works too.
            for w in works.into_iter().rev() {
                w.wait()?;
            }
            assert_eq!(*log.lock().unwrap(), (0..40).collect::<Vec<_>>());
            Ok(())
        });
    }
}

#[test]
fn async_operations_from_several_threads_on_one_communicator_are_serialised() {
    ranks(2, TransportKind::Auto, T, |c| {
        // Each rank issues from 4 threads. The ranks interleave their threads differently, so
        // the operations are identical (same size and values) and pair up in any order; what
        // is checked is that concurrent issue never mixes two operations' bytes.
        std::thread::scope(|s| {
            for _ in 0..4 {
                let c = c.clone();
                s.spawn(move || {
                    let works: Vec<_> = (0..10)
                        .map(|_| c.all_reduce_async(vec![3u64; 70_000], ReduceOp::Sum))
                        .collect();
                    for w in works {
                        assert!(w.wait().unwrap().iter().all(|&x| x == 6));
                    }
                });
            }
        });
        Ok(())
    });
}

#[test]
fn different_communicators_progress_independently() {
    ranks(2, TransportKind::Auto, T, |c| {
        let other = Arc::new(c.new_group(&[0, 1])?);
        if c.rank() == 1 {
            // `c` is blocked on a receive that rank 0 only sends after `other`'s all-reduce,
            // which rank 1 issues after the receive: only independent progress avoids a hang.
            let rv = c.recv_async(0, 1, vec![0u32; 4]);
            let ar = other.all_reduce_async(vec![5u32; 8], ReduceOp::Sum);
            assert_eq!(ar.wait()?, vec![10; 8]);
            assert_eq!(rv.wait()?, vec![7; 4]);
        } else {
            let ar = other.all_reduce_async(vec![5u32; 8], ReduceOp::Sum);
            assert_eq!(ar.wait()?, vec![10; 8]);
            c.send(1, 1, &[7u32; 4])?;
        }
        Ok(())
    });
}

#[test]
fn errors_come_back_through_work() {
    ranks(2, TransportKind::Auto, T, |c| {
        // Bad argument: not fatal, the communicator goes on.
        let e = c.broadcast_async(vec![0u8; 4], 7).wait().unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("root 7"),
            "{e}"
        );
        let e = c
            .all_gather_async(vec![1u8; 3], vec![0u8; 5])
            .wait()
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert_eq!(c.all_reduce_async(vec![1u8], ReduceOp::Sum).wait()?, [2]);

        // A panic in a closure becomes an error, not a hang or an abort of the process.
        let e = c
            .run_async("custom", |_| -> hcomm::Result<()> { panic!("boom") })
            .wait()
            .unwrap_err();
        assert!(
            matches!(e, Error::Panicked { .. }) && e.to_string().contains("boom"),
            "{e}"
        );
        c.barrier()?;
        Ok(())
    });
}

#[test]
fn a_missing_peer_times_out_through_work_and_poisons_later_calls() {
    let done = hcomm::testing::TestBarrier::new(2);
    ranks(2, TransportKind::Auto, Duration::from_millis(400), |c| {
        if c.rank() == 0 {
            let start = Instant::now();
            let e = c.recv_async(1, 3, vec![0u8; 8]).wait().unwrap_err();
            assert!(e.is_timeout(), "{e}");
            assert!(e.to_string().contains("rank(s) [1]"), "{e}");
            assert!(start.elapsed() < Duration::from_secs(20));
            let e = c.barrier_async().wait().unwrap_err();
            assert!(matches!(e, Error::Poisoned { .. }), "{e}");
        }
        done.wait(); // rank 1 stays alive (silent) until rank 0 is done
        Ok(())
    });
}

/// A rank that reaches a collective after its peer gave up on it is told that it was the
/// one waited for. It used to read `rank 0 reported an error: timed out waiting for rank 0`
/// over shared memory: the blame that landed on it was passed on to the rank it waited for.
#[test]
fn a_rank_that_comes_after_its_peer_gave_up_is_told_it_was_the_one_waited_for() {
    for transport in TRANSPORTS {
        let step = hcomm::testing::TestBarrier::new(2);
        ranks(2, transport, Duration::from_millis(400), |c| {
            let mut v = vec![1.0f32; 1 << 20];
            if c.rank() == 0 {
                let e = c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                assert!(e.is_timeout(), "{transport:?}: {e}");
                step.wait(); // rank 1 comes now
                step.wait(); // and has its error: this rank stays until then
            } else {
                step.wait();
                let e = c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                let msg = e.to_string();
                assert!(
                    msg.contains(
                        "rank 0 reported an error: timed out waiting for this rank (rank 1)"
                    ),
                    "{transport:?}: {msg}"
                );
                assert!(hcomm::testing::names_rank(&e, 1), "{transport:?}: {e:?}");
                step.wait();
            }
            Ok(())
        });
    }
}

#[test]
fn wait_timeout_leaves_the_operation_in_flight() {
    let go = hcomm::testing::TestBarrier::new(2);
    ranks(2, TransportKind::Auto, T, |c| {
        if c.rank() == 0 {
            let mut w = c.recv_async(1, 4, vec![0u64; 16]);
            let e = w.wait_timeout(Duration::from_millis(20)).unwrap_err();
            assert!(matches!(e, Error::WaitTimeout { .. }), "{e}");
            assert!(!w.is_completed());
            go.wait(); // now rank 1 may send
            let got = w.wait_timeout(Duration::from_secs(20))?;
            assert_eq!(got, vec![42; 16]);
            let e = w.wait_timeout(Duration::from_millis(1)).unwrap_err();
            assert!(matches!(e, Error::AlreadyTaken { .. }), "{e}");
        } else {
            go.wait();
            c.send(0, 4, &[42u64; 16])?;
        }
        Ok(())
    });
}

#[test]
fn dropping_unfinished_work_still_runs_the_operation() {
    ranks(3, TransportKind::Auto, T, |c| {
        for i in 0..20u32 {
            drop(c.all_reduce_async(vec![i; 1000], ReduceOp::Sum));
        }
        // Every rank ran all 20 in order: the next one matches up.
        let got = c.all_reduce_async(vec![1u32; 3], ReduceOp::Sum).wait()?;
        assert_eq!(got, vec![3; 3]);
        Ok(())
    });
}

#[test]
fn the_communicator_may_be_dropped_while_work_is_in_flight() {
    ranks(2, TransportKind::Auto, T, |c| {
        let w = c.all_reduce_async(vec![1.5f32; 1 << 16], ReduceOp::Sum);
        drop(c); // the operation keeps the communicator alive until it is done
        assert!(w.wait()?.iter().all(|&x| x == 3.0));
        Ok(())
    });
}

#[test]
fn abort_fails_work_in_flight() {
    let done = hcomm::testing::TestBarrier::new(2);
    ranks(2, TransportKind::Auto, T, |c| {
        if c.rank() == 0 {
            let w = c.recv_async(1, 8, vec![0u8; 4]);
            std::thread::sleep(Duration::from_millis(50));
            c.abort();
            let e = w.wait().unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{e}");
        }
        done.wait();
        Ok(())
    });
}

#[test]
fn many_operations_in_flight_on_several_communicators() {
    for transport in TRANSPORTS {
        ranks(3, transport, T, |c| {
            let comms: Vec<Arc<Communicator>> = (0..3)
                .map(|_| c.new_group(&[0, 1, 2]).map(Arc::new))
                .collect::<hcomm::Result<_>>()?;
            // 3 communicators x 30 operations, issued round-robin before any wait.
            let mut works = Vec::new();
            for i in 0..30u64 {
                for (k, comm) in comms.iter().enumerate() {
                    let v = vec![i * 10 + k as u64; 1 + (i as usize * 997) % 50_000];
                    works.push((i * 10 + k as u64, comm.all_reduce_async(v, ReduceOp::Sum)));
                }
            }
            for (x, w) in works {
                let got = w.wait()?;
                assert!(got.iter().all(|&y| y == 3 * x), "value {x}");
            }
            Ok(())
        });
    }
}

#[test]
fn set_algorithm_takes_effect_in_issue_order() {
    // Found by `hcomm check --soak`: a setting changed by the caller must not apply to an
    // asynchronous operation issued before it (the ranks would run different algorithms).
    let go = hcomm::testing::TestBarrier::new(2);
    ranks(2, TransportKind::Tcp, T, |c| {
        use hcomm::{Algo, Collective};
        if c.rank() == 0 {
            let w = c.run_async("forced", |c| {
                let mut x = [0u8; 4];
                c.recv(1, 2, &mut x)?; // holds the turn until rank 1 sends
                c.algorithm_for(Collective::AllReduce, 8);
                Ok(c.algorithm_for(Collective::AllReduce, 8))
            });
            go.wait();
            c.set_algorithm(Collective::AllReduce, Algo::Ring)?;
            assert!(
                w.is_completed(),
                "set_algorithm ran before the queued operation"
            );
            assert_ne!(w.wait()?, Algo::Ring);
        } else {
            go.wait();
            std::thread::sleep(Duration::from_millis(50));
            c.send(0, 2, &[1u8; 4])?;
        }
        Ok(())
    });
}

/// Run `f` on a thread of its own and fail (instead of hanging the test run) when it does not
/// finish within `limit`.
fn within<R: Send + 'static>(limit: Duration, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("still running after {limit:?}: deadlock"))
}

#[test]
fn an_async_operation_issued_inside_a_job_can_be_waited_for() {
    // A job holds its communicator's turn; an operation it issues asynchronously (through
    // another handle on the same communicator) is part of it. Queued behind the job instead,
    // waiting for it would never return.
    within(Duration::from_secs(60), || {
        ranks(2, TransportKind::Tcp, T, |c| {
            let inner = c.clone();
            let w = c.run_async("outer", move |_| {
                let v = inner
                    .all_reduce_async(vec![1u32; 4], ReduceOp::Sum)
                    .wait()?;
                let b = inner.barrier_async();
                Ok((v, b.is_completed()))
            });
            let (v, barrier_done) = w.wait()?;
            assert_eq!(v, vec![2; 4]);
            assert!(barrier_done);
            // Later operations still line up on both ranks.
            assert_eq!(c.all_reduce_async(vec![3u8], ReduceOp::Sum).wait()?, [6]);
            Ok(())
        })
    });
}

#[test]
fn first_hierarchical_all_reduces_from_a_job_and_the_caller_do_not_deadlock() {
    // The first hierarchical all-reduce makes the sub-communicators under a lock. A blocking
    // call that took that lock before its turn waited for the turn of an asynchronous one
    // issued earlier, which held the turn and waited for the lock.
    within(Duration::from_secs(120), || {
        let out = hcomm::testing::run_threads_on_hosts(&["a", "a", "b", "b"], T, |c| {
            use hcomm::{Algo, Collective};
            let c = Arc::new(c);
            assert_eq!(
                c.algorithm_for(Collective::AllReduce, 4 << 20),
                Algo::Hierarchical
            );
            let w = c.all_reduce_async(vec![1.0f32; 1 << 20], ReduceOp::Sum);
            let mut v = vec![2.0f32; 1 << 20];
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            let got = w.wait()?;
            assert!(got.iter().all(|&x| x == 4.0));
            assert!(v.iter().all(|&x| x == 8.0));
            Ok(())
        });
        for (r, o) in out.into_iter().enumerate() {
            o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    });
}

/// A rank lost during a hierarchical all-reduce (2 hosts × 2) is named by its rank in the
/// communicator the user called, in the user's operation. The errors used to come from the
/// internal sub-communicators as they were: rank 1 read `all_reduce (seq 10): rank 1 closed
/// the connection` about rank 3, rank 2 `all_gather (seq 21): rank 1 …`, so that torch's
/// `shrink_group(e.peers)` excluded a live rank (found by a network-fault campaign, 2026-12-08).
#[test]
fn a_rank_lost_in_a_hierarchical_all_reduce_is_named_by_its_rank_in_the_users_communicator() {
    // Hosts of consecutive ranks, and hosts that take turns (the sub-communicators' members
    // are then not blocks of ranks).
    for hosts in [["a", "a", "b", "b"], ["a", "b", "a", "b"]] {
        within(Duration::from_secs(120), move || {
            let gone = hcomm::testing::TestBarrier::new(4);
            let out = hcomm::testing::run_threads_on_hosts(&hosts, Duration::from_secs(3), |c| {
                use hcomm::{Algo, Collective};
                c.set_algorithm(Collective::AllReduce, Algo::Hierarchical)?;
                let mut v = vec![1.0f32; 1 << 16];
                c.all_reduce_in_place(&mut v, ReduceOp::Sum)?; // makes the hierarchy
                if c.rank() == 3 {
                    drop(c);
                    gone.wait();
                    return Ok(None);
                }
                gone.wait();
                Ok(Some(
                    c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err(),
                ))
            });
            for (r, o) in out.into_iter().enumerate().take(3) {
                let e = o
                    .unwrap_or_else(|e| panic!("rank {r}: {e}"))
                    .expect("failed");
                let text = e.to_string();
                // The user's operation (the sub-communicators' steps are named inside).
                assert!(
                    text.starts_with("all_reduce (seq "),
                    "{hosts:?}: rank {r}: {text}"
                );
                assert!(text.contains("in its step "), "{hosts:?}: rank {r}: {text}");
                assert!(
                    !hcomm::testing::names_rank(&e, r),
                    "rank {r} blames itself: {text}"
                );
                // Ranks 1 and 2 work with rank 3 directly (one on its host, the other across);
                // rank 0 waits for one of them, or is told by one of them.
                let named = if r == 0 { &[1, 2, 3][..] } else { &[3][..] };
                assert!(
                    named.iter().any(|&x| hcomm::testing::names_rank(&e, x)),
                    "{hosts:?}: rank {r} should name one of {named:?}: {e:?}"
                );
            }
        });
    }
}

#[test]
fn an_algorithm_set_by_an_earlier_job_applies_to_a_later_hierarchical_all_reduce_on_every_rank() {
    // A job switches the all-reduce to hierarchical; a blocking all-reduce issued after it must
    // run hierarchically on every rank. It decided before waiting for its turn: ranks whose
    // job had not run yet (here host b) ran another algorithm than the others and waited for
    // each other until the deadline.
    within(Duration::from_secs(120), || {
        let t = Duration::from_secs(10);
        let out = hcomm::testing::run_threads_on_hosts(&["a", "a", "b", "b"], t, |c| {
            use hcomm::{Algo, Collective};
            let c = Arc::new(c);
            let w = c.run_async("switch", |c| {
                std::thread::sleep(Duration::from_millis(200));
                c.set_algorithm(Collective::AllReduce, Algo::Hierarchical)
            });
            if c.rank() < 2 {
                std::thread::sleep(Duration::from_millis(600)); // the job has run here
            }
            let mut v = vec![1.0f32; 1024];
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            w.wait()?;
            assert!(v.iter().all(|&x| x == 4.0));
            Ok(c.traffic())
        });
        for (r, o) in out.into_iter().enumerate() {
            let t = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
            let ar = t
                .iter()
                .find(|x| x.op == "all_reduce")
                .expect("an all_reduce row");
            // Hierarchical: within the host over shared memory, across hosts over TCP.
            assert!(ar.shm_written > 0 && ar.tcp_sent > 0, "rank {r}: {ar:?}");
        }
    });
}
