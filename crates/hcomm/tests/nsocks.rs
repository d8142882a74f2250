//! Several TCP sockets per pair of ranks (`HCOMM_NSOCKS`, [`BootstrapConfig::nsocks`]): large
//! payloads striped across them, point-to-point and collectives over TCP, failures, and
//! ranks that disagree on the setting. (The collective × dtype × size matrix with 4 sockets is
//! in `crates/hcomm-cli/tests/collectives.rs`.)

use hcomm::config::TransportKind;
use hcomm::testing::{expect_all as all_ok, run_threads_configured};
use hcomm::transport::tcp::{stripe_bounds, stripes, STRIPE_MIN};
use hcomm::{BootstrapConfig, Communicator, Error, ReduceOp, Result};
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// `n` ranks over TCP only, each with `nsocks(rank)` sockets per peer.
fn run<R: Send>(
    n: usize,
    nsocks: impl Fn(usize) -> usize + Sync,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    run_threads_configured(
        n,
        T,
        |cfg| BootstrapConfig {
            transport: TransportKind::Tcp,
            nsocks: nsocks(cfg.rank),
            ..cfg
        },
        f,
    )
}

/// Sizes around every boundary: empty, eager, just above eager, just below and above the
/// striping threshold, odd sizes that no socket count divides, and several MiB.
const SIZES: &[usize] = &[
    0,
    1,
    65_536,
    65_537,
    2 * STRIPE_MIN - 1,
    2 * STRIPE_MIN,
    2 * STRIPE_MIN + 1,
    3 * STRIPE_MIN + 7,
    1_000_003,
    (4 << 20) + 13,
];

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8)
        .collect()
}

#[test]
fn the_cut_covers_every_byte_once_on_element_boundaries() {
    for nsocks in 1..=16 {
        for len in [0, 1, 4095, STRIPE_MIN, 2 * STRIPE_MIN - 1, 2 * STRIPE_MIN]
            .into_iter()
            .chain((0..200).map(|i| 2 * STRIPE_MIN + i * 40_961 + i % 7))
        {
            let n = stripes(len, nsocks);
            assert!((1..=nsocks).contains(&n));
            if len < 2 * STRIPE_MIN {
                assert_eq!(n, 1, "{len} bytes are never striped");
            }
            let mut at = 0;
            for i in 0..n {
                let (lo, hi) = stripe_bounds(len, n, i);
                assert_eq!(lo, at, "len {len}, {n} stripes, stripe {i}");
                assert!(
                    hi > lo || len == 0,
                    "empty stripe {i} of {n} for {len} bytes"
                );
                if n > 1 {
                    assert!(hi - lo >= 64 << 10, "a {} byte stripe", hi - lo);
                }
                if i + 1 < n {
                    assert_eq!(hi % 4096, 0, "stripes end on element boundaries");
                }
                at = hi;
            }
            assert_eq!(at, len);
        }
    }
}

#[test]
fn point_to_point_of_every_size_both_ways() {
    let res = run(
        2,
        |_| 4,
        |c| {
            assert_eq!(c.nsocks(), 4);
            let peer = 1 - c.rank();
            for (k, &len) in SIZES.iter().enumerate() {
                let mine = pattern(len, c.rank() + k);
                let mut got = vec![0u8; len];
                c.send_recv(peer, &mine, peer, &mut got, k as u32)?;
                assert!(got == pattern(len, peer + k), "{len} bytes from {peer}");
            }
            // Plain send / recv, large messages first then small ones with other tags, received
            // in another order than sent.
            let big = pattern(3_000_001, 5);
            if c.rank() == 0 {
                c.send(1, 100, &big)?;
                c.send(1, 101, &[7u8; 10])?;
                c.send(1, 102, &big[..600_000])?;
            } else {
                let mut b = vec![0u8; 3_000_001];
                c.recv(0, 100, &mut b)?;
                assert!(b == big);
                let mut small = [0u8; 10];
                let mut mid = vec![0u8; 600_000];
                c.recv(0, 101, &mut small)?;
                c.recv(0, 102, &mut mid)?;
                assert!(small == [7u8; 10] && mid[..] == big[..600_000]);
            }
            // Every pair is linked with 4 sockets.
            Ok(c.open_links())
        },
    );
    assert_eq!(all_ok(res), vec![4, 4]);
}

#[test]
fn a_ring_of_large_messages_among_four_ranks() {
    all_ok(run(
        4,
        |_| 3,
        |c| {
            let n = c.world_size();
            let (right, left) = ((c.rank() + 1) % n, (c.rank() + n - 1) % n);
            for len in [1_000_003usize, 65_537, 4 << 20] {
                let mine = pattern(len, c.rank());
                let mut got = vec![0u8; len];
                c.send_recv(right, &mine, left, &mut got, 3)?;
                assert!(got == pattern(len, left));
            }
            Ok(())
        },
    ));
}

#[test]
fn large_size_mismatch_still_fails_on_both_sides() {
    let res = run(
        2,
        |_| 4,
        |c| {
            if c.rank() == 0 {
                Ok(c.send(1, 5, &vec![1u8; 1 << 20]).unwrap_err())
            } else {
                let mut b = vec![0u8; (1 << 20) + 4096];
                Ok(c.recv(0, 5, &mut b).unwrap_err())
            }
        },
    );
    for e in all_ok(res) {
        assert!(matches!(e, Error::SizeMismatch { .. }), "{e}");
    }
}

#[test]
fn collectives_over_striped_links_match_the_reference() {
    // A few collectives at striped sizes with odd counts (the full matrix is in hcomm-cli).
    for n in [2, 3] {
        all_ok(run(
            n,
            |_| 4,
            |c| {
                for count in [7usize, 100_003, 262_147, (1 << 20) + 3] {
                    let mine: Vec<f32> = (0..count)
                        .map(|i| ((i * 7 + c.rank() * 13) % 1009) as f32)
                        .collect();
                    let mut out = vec![0f32; count];
                    c.all_reduce(&mine, &mut out, ReduceOp::Sum)?;
                    for (i, &x) in out.iter().enumerate() {
                        let want: f32 = (0..n).map(|r| ((i * 7 + r * 13) % 1009) as f32).sum();
                        assert_eq!(x, want, "{n} ranks, count {count}, element {i}");
                    }
                    let mut b: Vec<f32> = if c.rank() == 0 {
                        mine.clone()
                    } else {
                        vec![0.0; count]
                    };
                    c.broadcast(&mut b, 0)?;
                    assert!(b
                        .iter()
                        .enumerate()
                        .all(|(i, &x)| x == ((i * 7) % 1009) as f32));
                }
                Ok(())
            },
        ));
    }
}

#[test]
fn a_closed_peer_is_reported_by_name_on_striped_links() {
    let res = run(
        3,
        |_| 4,
        |c| {
            c.set_timeout(Duration::from_secs(5));
            // Linked first, so that rank 2 leaves with its sockets open mid-collective.
            let mut v = vec![1f32; 1 << 20];
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            if c.rank() == 2 {
                drop(c);
                return Ok(None);
            }
            Ok(Some(
                c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err(),
            ))
        },
    );
    for r in res.into_iter().take(2) {
        let e = r.unwrap().unwrap();
        assert!(hcomm::testing::names_rank(&e, 2), "{e}");
    }
}

#[test]
fn an_abort_reaches_a_peer_waiting_on_striped_data() {
    let done = hcomm::testing::TestBarrier::new(2);
    let res = run(
        2,
        |_| 4,
        |c| {
            let mut big = vec![0u8; 1 << 20];
            c.send_recv(1 - c.rank(), &big.clone(), 1 - c.rank(), &mut big, 1)?;
            let out = if c.rank() == 0 {
                c.abort();
                std::thread::sleep(Duration::from_millis(100)); // rank 1 is waiting
                let e = c.barrier().unwrap_err();
                assert!(matches!(e, Error::Aborted { .. }), "{e}");
                None
            } else {
                // Waits for rank 0's stripes of the first ring step.
                let start = std::time::Instant::now();
                let mut v = vec![1f32; 1 << 20];
                let e = c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                Some((e, start.elapsed()))
            };
            done.wait();
            Ok(out)
        },
    );
    let (e, took) = all_ok(res).pop().unwrap().unwrap();
    assert!(
        matches!(&e, Error::Remote { peer: 0, .. }) && e.to_string().contains("aborted"),
        "{e}"
    );
    assert!(took < Duration::from_secs(10), "{e} after {took:?}");
}

#[test]
fn ranks_that_disagree_on_nsocks_fail_at_once_naming_the_variable() {
    let res = run(3, |r| if r == 1 { 2 } else { 1 }, |c| c.barrier());
    for (rank, r) in res.into_iter().enumerate() {
        let e = r
            .expect_err("ranks with different HCOMM_NSOCKS must not run")
            .to_string();
        assert!(e.contains("HCOMM_NSOCKS differs"), "rank {rank}: {e}");
    }
}

#[test]
fn bytes_moved_count_one_header_per_stripe() {
    let len = 1 << 20; // 4 stripes of 256 KiB
    let res = run(
        2,
        |_| 4,
        |c| {
            let peer = 1 - c.rank();
            // Link first, then measure one message each way.
            c.send_recv(peer, &[0u8], peer, &mut [0u8], 1)?;
            c.reset_traffic();
            let mut got = vec![0u8; len];
            c.send_recv(peer, &vec![1u8; len], peer, &mut got, 2)?;
            Ok(c.traffic())
        },
    );
    for t in all_ok(res) {
        let sent: u64 = t.iter().map(|o| o.tcp_sent).sum();
        let received: u64 = t.iter().map(|o| o.tcp_received).sum();
        // Data: 4 frame headers + the payload; control: RTS and Ready (40 bytes each).
        assert_eq!(sent, (len + 4 * 40 + 2 * 40) as u64, "{t:?}");
        assert_eq!(received, sent, "{t:?}");
    }
}

#[test]
fn an_authenticated_connection_naming_a_wrong_socket_is_dropped() {
    use hcomm::auth::{self, JobToken, Local, Role};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Instant;
    const TOKEN: &str = "nsocks-test-token-0123456789";
    let token = JobToken::new(TOKEN.as_bytes()).unwrap();
    let stats = hcomm::testing::TestBarrier::new(2);
    let res = run_threads_configured(
        2,
        T,
        |cfg| BootstrapConfig {
            transport: TransportKind::Tcp,
            nsocks: 4,
            job_token: Some(token.clone()),
            ..cfg
        },
        |c| {
            let peer = 1 - c.rank();
            c.send_recv(peer, &[1u8; 600_000], peer, &mut [0u8; 600_000], 1)?;
            if c.rank() == 1 {
                // Knows the token and claims rank 0, then names socket 7 of 4, and socket 0 of 9.
                for bad in [[7u8, 4], [0, 9]] {
                    let mut s = TcpStream::connect(c.listen_addr()).unwrap();
                    let me = Local {
                        role: Role::LinkDialer,
                        rank: 0,
                        comm_hash: auth::comm_hash("world"),
                    };
                    let far = Instant::now() + Duration::from_secs(10);
                    auth::connect(&mut s, Some(&token), me, 1, far).unwrap();
                    s.write_all(&bad).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                    let mut got = Vec::new();
                    let _ = s.read_to_end(&mut got);
                    assert!(got.is_empty(), "{bad:?} got {got:?}");
                }
            }
            stats.wait();
            // The links still work.
            let mut back = vec![0u8; 600_000];
            c.send_recv(peer, &[2u8; 600_000], peer, &mut back, 2)?;
            assert!(back.iter().all(|&x| x == 2));
            Ok(c.connection_stats())
        },
    );
    let stats = all_ok(res);
    assert_eq!(stats[1].malformed, 2, "{:?}", stats[1]);
    // Rank 1 accepted rank 0's 4 sockets (rank 0 may also have seen an ask of rank 1's that
    // lost the race to its own connection).
    assert!(
        stats[1].accepted >= 4 && stats[0].malformed == 0,
        "{stats:?}"
    );
}

#[test]
fn a_higher_rank_that_needs_the_link_first_opens_every_socket() {
    // Rank 1 sends to rank 0 while rank 0 waits for rank 2: rank 0 adopts rank 1's ask
    // (socket 0), rank 1 then opens sockets 1-3 itself, and its message is striped over all
    // four. Rank 1 never accepts a connection from rank 0.
    let res = run(
        3,
        |_| 4,
        |c| {
            let big = pattern(2_000_003, 1);
            match c.rank() {
                0 => {
                    let mut b = [0u8; 3];
                    c.recv(2, 5, &mut b)?;
                    let mut got = vec![0u8; big.len()];
                    c.recv(1, 4, &mut got)?;
                    assert!(got == big && b == [5; 3]);
                }
                1 => c.send(0, 4, &big)?,
                _ => {
                    std::thread::sleep(Duration::from_millis(300));
                    c.send(0, 5, &[5u8; 3])?;
                }
            }
            Ok(c.connection_stats().accepted)
        },
    );
    let accepted = all_ok(res);
    assert_eq!(accepted[1], 0, "{accepted:?}");
    assert!(accepted[0] >= 4, "{accepted:?}");
}

#[test]
fn striped_sockets_and_shared_memory_pipes_in_one_communicator() {
    // Hosts a: ranks 0, 2; b: rank 1. Point-to-point 0 <-> 2 goes over the shared-memory
    // pipe (never striped), anything with rank 1 over 3 striped sockets; collectives over the
    // sockets. Every payload checked.
    let hosts = ["a", "b", "a"];
    let out = all_ok(run_threads_configured(
        3,
        T,
        |cfg| BootstrapConfig {
            host_id: Some(hosts[cfg.rank].to_string()),
            local_rank: Some(usize::from(cfg.rank == 2)),
            local_world_size: Some(if cfg.rank == 1 { 1 } else { 2 }),
            nsocks: 3,
            ..cfg
        },
        |c| {
            let (n, me) = (c.world_size(), c.rank());
            for shift in 1..n {
                let (right, left) = ((me + shift) % n, (me + n - shift) % n);
                for &len in SIZES {
                    let mut got = vec![0u8; len];
                    c.send_recv(right, &pattern(len, me), left, &mut got, len as u32)?;
                    assert!(got == pattern(len, left), "{len} bytes from {left}");
                }
            }
            let mut v: Vec<f32> = (0..700_001).map(|i| (i % 13) as f32).collect();
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            assert!(v
                .iter()
                .enumerate()
                .all(|(i, &x)| x == 3.0 * (i % 13) as f32));
            Ok((0..n)
                .filter(|&p| p != me)
                .map(|p| (p, c.p2p_over_shared_memory(p)))
                .collect::<Vec<_>>())
        },
    ));
    for (me, peers) in out.into_iter().enumerate() {
        for (peer, shm) in peers {
            assert_eq!(shm, hosts[me] == hosts[peer], "rank {me} to {peer}");
        }
    }
}
