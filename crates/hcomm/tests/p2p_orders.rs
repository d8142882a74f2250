//! Non-blocking point-to-point in every posting order: `send_async` / `recv_async` progress in
//! the background, so receives first, sends first, mixed orders, several messages per peer and
//! blocking calls among posted ones all complete, at 2–4 ranks, with 8 B (eager), 64 KiB (the
//! largest eager size) and 4 MiB (rendezvous) messages, over TCP and over the shared-memory
//! pipes. Each case is bounded by the communicators' timeout: a deadlock fails as a timeout
//! naming the peer, never a hang.

use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Communicator, Error, Work};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);
const SIZES: [usize; 3] = [8, 64 << 10, 4 << 20];
const TRANSPORTS: [TransportKind; 2] = [TransportKind::Tcp, TransportKind::Auto];

/// The message `src` sends to `dst` as its `k`-th with `tag`: every byte depends on all four.
fn payload(src: usize, dst: usize, tag: u32, k: usize, len: usize) -> Vec<u8> {
    let seed = (src * 131 + dst * 31 + tag as usize * 7 + k * 3) as u32;
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).to_le_bytes()[1])
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Order {
    /// Every rank posts all its receives, then all its sends.
    ReceivesFirst,
    /// Every rank posts all its sends, then all its receives.
    SendsFirst,
    /// Even ranks receive first, odd ranks send first.
    Mixed,
    /// Sends and receives alternate, peer by peer, in reverse peer order on odd ranks.
    Interleaved,
}

/// Every rank exchanges `per_peer` messages of `len` bytes with every other rank, posted in
/// `order`, then waits for all of them and checks every byte.
fn all_pairs(
    c: &Arc<Communicator>,
    order: Order,
    len: usize,
    per_peer: usize,
) -> hcomm::Result<()> {
    let (r, n) = (c.rank(), c.world_size());
    let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
    let mut sends: Vec<Work<Vec<u8>>> = Vec::new();
    let mut recvs: Vec<(usize, usize, Work<Vec<u8>>)> = Vec::new();
    let post_sends = |sends: &mut Vec<_>, ps: &[usize]| {
        for &p in ps {
            for k in 0..per_peer {
                sends.push(c.send_async(p, 3, payload(r, p, 3, k, len)));
            }
        }
    };
    let post_recvs = |recvs: &mut Vec<_>, ps: &[usize]| {
        for &p in ps {
            for k in 0..per_peer {
                recvs.push((p, k, c.recv_async(p, 3, vec![0u8; len])));
            }
        }
    };
    let receive_first = match order {
        Order::ReceivesFirst => true,
        Order::SendsFirst => false,
        Order::Mixed | Order::Interleaved => r % 2 == 0,
    };
    match order {
        Order::Interleaved => {
            let mut ps = peers.clone();
            if r % 2 == 1 {
                ps.reverse();
            }
            for p in ps {
                if receive_first {
                    post_recvs(&mut recvs, &[p]);
                    post_sends(&mut sends, &[p]);
                } else {
                    post_sends(&mut sends, &[p]);
                    post_recvs(&mut recvs, &[p]);
                }
            }
        }
        _ if receive_first => {
            post_recvs(&mut recvs, &peers);
            post_sends(&mut sends, &peers);
        }
        _ => {
            post_sends(&mut sends, &peers);
            post_recvs(&mut recvs, &peers);
        }
    }
    // Wait in reverse order of posting: completion must not depend on it.
    for (p, k, w) in recvs.into_iter().rev() {
        let got = w.wait()?;
        assert!(
            got == payload(p, r, 3, k, len),
            "rank {r}: message {k} from rank {p} ({len} bytes, {order:?}) is wrong"
        );
    }
    for w in sends.into_iter().rev() {
        w.wait()?;
    }
    Ok(())
}

fn each_case(f: impl Fn(TransportKind, usize, usize)) {
    for transport in TRANSPORTS {
        for n in 2..=4 {
            for len in SIZES {
                let start = Instant::now();
                f(transport, n, len);
                eprintln!("{transport:?} n={n} len={len}: {:?}", start.elapsed());
            }
        }
    }
}

#[test]
fn every_posting_order_completes_at_2_to_4_ranks() {
    each_case(|transport, n, len| {
        expect_all(run_threads_with(n, transport, T, |c| {
            let c = Arc::new(c);
            for order in [
                Order::ReceivesFirst,
                Order::SendsFirst,
                Order::Mixed,
                Order::Interleaved,
            ] {
                all_pairs(&c, order, len, 1)?;
            }
            c.barrier()
        }));
    });
}

#[test]
fn several_messages_per_peer_with_one_tag_match_in_posting_order() {
    each_case(|transport, n, len| {
        if len > 64 << 10 && n > 2 {
            return; // 4 MiB × 3 per peer × all pairs: covered at 2 ranks
        }
        expect_all(run_threads_with(n, transport, T, |c| {
            let c = Arc::new(c);
            all_pairs(&c, Order::ReceivesFirst, len, 3)?;
            all_pairs(&c, Order::SendsFirst, len, 3)
        }));
    });
}

#[test]
fn eager_and_rendezvous_messages_with_one_tag_interleave() {
    // A large message followed by small ones with the same tag: the small ones' frames reach
    // the receiver before the large one's data, and must not be taken for it.
    for transport in TRANSPORTS {
        expect_all(run_threads_with(2, transport, T, |c| {
            let c = Arc::new(c);
            let peer = 1 - c.rank();
            let lens = [3 << 20, 16, 100_000, 0, 5];
            let recvs: Vec<_> = lens
                .iter()
                .map(|&l| c.recv_async(peer, 9, vec![0u8; l]))
                .collect();
            let sends: Vec<_> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| c.send_async(peer, 9, payload(c.rank(), peer, 9, k, l)))
                .collect();
            for (k, w) in recvs.into_iter().enumerate() {
                assert_eq!(
                    w.wait()?,
                    payload(peer, c.rank(), 9, k, lens[k]),
                    "message {k}"
                );
            }
            for w in sends {
                w.wait()?;
            }
            Ok(())
        }));
    }
}

#[test]
fn blocking_calls_join_the_posted_messages() {
    // Both ranks post a large send and then receive with a blocking call: the blocking receive
    // must not wait for the send (which waits for the peer's receive).
    for transport in TRANSPORTS {
        for n in 2..=4 {
            expect_all(run_threads_with(n, transport, T, |c| {
                let c = Arc::new(c);
                let (r, n) = (c.rank(), c.world_size());
                let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                let len = 1 << 20;
                let s = c.send_async(next, 1, payload(r, next, 1, 0, len));
                let mut got = vec![0u8; len];
                c.recv(prev, 1, &mut got)?;
                assert!(got == payload(prev, r, 1, 0, len));
                // And the other way round: a posted receive, then a blocking send.
                let rv = c.recv_async(next, 2, vec![0u8; len]);
                c.send(prev, 2, &payload(r, prev, 2, 0, len))?;
                assert!(rv.wait()? == payload(next, r, 2, 0, len));
                s.wait()?;
                // Collectives after the messages run once they are done.
                let ar = c.all_reduce_async(vec![1u32; 5], hcomm::ReduceOp::Sum);
                assert_eq!(ar.wait()?, vec![n as u32; 5]);
                Ok(())
            }));
        }
    }
}

#[test]
fn posted_messages_report_completion_and_size_mismatches() {
    expect_all(run_threads_with(2, TransportKind::Tcp, T, |c| {
        let c = Arc::new(c);
        let peer = 1 - c.rank();
        // A bad peer is refused at once, naming it.
        let e = c.send_async(7, 0, vec![0u8; 4]).wait().unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("peer rank 7"),
            "{e}"
        );
        // is_completed turns true without wait().
        let w = c.recv_async(peer, 4, vec![0u8; 10]);
        let s = c.send_async(peer, 4, vec![1u8; 10]);
        let start = Instant::now();
        while !(w.is_completed() && s.is_completed()) {
            assert!(start.elapsed() < T, "never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(w.wait()?, vec![1u8; 10]);
        s.wait()?;
        // A large message of the wrong size fails on both ends, naming the sizes.
        if c.rank() == 0 {
            let e = c.send_async(1, 5, vec![0u8; 200_000]).wait().unwrap_err();
            assert!(matches!(e, Error::SizeMismatch { .. }), "{e}");
            assert!(e.to_string().contains("200000"), "{e}");
        } else {
            let e = c.recv_async(0, 5, vec![0u8; 100_000]).wait().unwrap_err();
            assert!(matches!(e, Error::SizeMismatch { .. }), "{e}");
            assert!(e.to_string().contains("100000"), "{e}");
        }
        // The communicator goes on.
        c.barrier()
    }));
}

#[test]
fn a_posted_receive_from_a_silent_peer_times_out_naming_it() {
    let done = hcomm::testing::TestBarrier::new(2);
    expect_all(run_threads_with(
        2,
        TransportKind::Tcp,
        Duration::from_millis(500),
        |c| {
            let c = Arc::new(c);
            if c.rank() == 0 {
                let start = Instant::now();
                let a = c.recv_async(1, 1, vec![0u8; 8]);
                let b = c.send_async(1, 2, vec![0u8; 1 << 20]);
                let ea = a.wait().unwrap_err();
                let eb = b.wait().unwrap_err();
                assert!(
                    ea.is_timeout() && ea.to_string().contains("rank(s) [1]"),
                    "{ea}"
                );
                assert!(eb.is_timeout(), "{eb}");
                assert!(start.elapsed() < Duration::from_secs(10));
                let e = c.send_async(1, 3, vec![0u8; 4]).wait().unwrap_err();
                assert!(matches!(e, Error::Poisoned { .. }), "{e}");
            }
            done.wait();
            Ok(())
        },
    ));
}

#[test]
fn receives_from_any_source_bind_to_whoever_sends_first() {
    for transport in TRANSPORTS {
        for n in 2..=4 {
            expect_all(run_threads_with(n, transport, T, |c| {
                let c = Arc::new(c);
                let (r, n) = (c.rank(), c.world_size());
                for len in SIZES {
                    if r == 0 {
                        // Posted before any message is there, then blocking ones.
                        let works: Vec<_> = (1..n)
                            .map(|_| c.recv_any_async(7, vec![0u8; len]))
                            .collect();
                        let mut seen: Vec<usize> = Vec::new();
                        for w in works {
                            let (src, got) = w.wait()?;
                            assert!(got == payload(src, 0, 7, 0, len), "{len} B from {src}");
                            seen.push(src);
                        }
                        c.barrier()?;
                        for _ in 1..n {
                            let mut got = vec![0u8; len];
                            let src = c.recv_any(8, &mut got)?;
                            assert!(got == payload(src, 0, 8, 0, len), "blocking, from {src}");
                            seen.push(src);
                        }
                        seen.sort_unstable();
                        let want: Vec<usize> = (1..n).flat_map(|p| [p, p]).collect();
                        assert_eq!(seen, want, "every sender once per round");
                    } else {
                        c.send_async(0, 7, payload(r, 0, 7, 0, len)).wait()?;
                        c.barrier()?;
                        c.send(0, 8, &payload(r, 0, 8, 0, len))?;
                    }
                    c.barrier()?;
                }
                Ok(())
            }));
        }
    }
}

#[test]
fn a_receive_posted_for_a_rank_is_served_before_a_later_one_from_any_source() {
    expect_all(run_threads_with(2, TransportKind::Tcp, T, |c| {
        let c = Arc::new(c);
        if c.rank() == 0 {
            let named = c.recv_async(1, 4, vec![0u8; 16]);
            let any = c.recv_any_async(4, vec![0u8; 16]);
            assert_eq!(named.wait()?, payload(1, 0, 4, 0, 16), "the first message");
            let (src, got) = any.wait()?;
            assert_eq!((src, got), (1, payload(1, 0, 4, 1, 16)), "the second");
        } else {
            c.send(0, 4, &payload(1, 0, 4, 0, 16))?;
            c.send(0, 4, &payload(1, 0, 4, 1, 16))?;
        }
        c.barrier()
    }));
}
