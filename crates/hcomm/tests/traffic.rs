//! Byte counters: exact counts for point-to-point frames, conservation (every byte sent is
//! received), the ring's 2(n-1)/n volume, shared-memory copies, reset, and the hierarchical
//! all-reduce counted as one operation.

use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_on_hosts, run_threads_with};
use hcomm::wire::frame::HEADER_LEN;
use hcomm::{Algo, Collective, Communicator, OpTraffic, ReduceOp};
use std::time::Duration;

fn ranks<R: Send, F>(n: usize, transport: TransportKind, f: F) -> Vec<R>
where
    F: Fn(Communicator) -> hcomm::Result<R> + Sync,
{
    expect_all(run_threads_with(n, transport, Duration::from_secs(30), f))
}

fn row<'a>(t: &'a [OpTraffic], op: &str) -> &'a OpTraffic {
    t.iter()
        .find(|r| r.op == op)
        .unwrap_or_else(|| panic!("no row {op} in {t:?}"))
}

#[test]
fn point_to_point_frames_are_counted_exactly() {
    let h = HEADER_LEN as u64;
    let out = ranks(2, TransportKind::Tcp, |c| {
        let small = vec![7u8; 1000];
        let big = vec![1u8; 1 << 20];
        if c.rank() == 0 {
            c.send(1, 5, &small)?;
            c.send(1, 6, &big)?;
        } else {
            let mut b = vec![0u8; 1000];
            c.recv(0, 5, &mut b)?;
            let mut b = vec![0u8; 1 << 20];
            c.recv(0, 6, &mut b)?;
        }
        Ok(c.traffic())
    });
    // Eager: header + data. Rendezvous: RTS, then header + data; the receiver answers Ready.
    let send = row(&out[0], "send");
    assert_eq!(send.calls, 2);
    assert_eq!(send.tcp_sent, (h + 1000) + h + (h + (1 << 20)));
    assert_eq!(send.tcp_received, h);
    let recv = row(&out[1], "recv");
    assert_eq!(recv.calls, 2);
    assert_eq!(recv.tcp_received, send.tcp_sent);
    assert_eq!(recv.tcp_sent, h);
    assert_eq!(send.shm_written + send.shm_read + recv.shm_written, 0);
}

#[test]
fn ring_all_reduce_moves_2_n_minus_1_over_n_and_every_byte_sent_is_received() {
    let n = 3;
    let bytes = 3 << 20; // f32: 786432 elements
    let out = ranks(n, TransportKind::Tcp, |c| {
        c.set_algorithm(Collective::AllReduce, Algo::Ring)?;
        let mut v = vec![1.0f32; bytes / 4];
        c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        c.barrier()?;
        Ok(c.traffic())
    });
    let expected = (2 * (n - 1) * bytes / n) as u64;
    for t in &out {
        let ar = row(t, "all_reduce");
        assert_eq!(ar.calls, 1);
        assert!(
            ar.tcp_sent >= expected && ar.tcp_sent < expected + expected / 100,
            "sent {} vs 2(n-1)/n x {bytes} = {expected}",
            ar.tcp_sent
        );
        assert_eq!(row(t, "barrier").calls, 1);
    }
    let sent: u64 = out.iter().flatten().map(|r| r.tcp_sent).sum();
    let received: u64 = out.iter().flatten().map(|r| r.tcp_received).sum();
    assert_eq!(sent, received);
}

#[test]
fn shared_memory_copies_are_counted_and_reset_clears() {
    let n = 2;
    let bytes: u64 = 1 << 20;
    let out = ranks(n, TransportKind::Shm, |c| {
        assert!(c.has_shared_memory());
        let mut v = vec![1.0f32; bytes as usize / 4];
        c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        let before = c.traffic();
        c.reset_traffic();
        let after = c.traffic();
        Ok((before, after))
    });
    for (before, after) in &out {
        let ar = row(before, "all_reduce");
        assert_eq!(ar.tcp_sent + ar.tcp_received, 0);
        // Stage the peers' halves (B/2) and write the own reduced half (B/2); read the peer's
        // staged half to reduce it (B/2) and copy the whole result out (B).
        assert_eq!(ar.shm_written, bytes);
        assert_eq!(ar.shm_read, bytes / 2 + bytes);
        assert!(after.is_empty(), "{after:?}");
    }
}

#[test]
fn hierarchical_all_reduce_counts_its_sub_communicators_as_one_call() {
    let out = run_threads_on_hosts(&["a", "a", "b", "b"], Duration::from_secs(30), |c| {
        let mut v = vec![1.0f32; 1 << 20]; // 4 MiB: hierarchical from 2 MiB
        assert_eq!(
            c.algorithm_for(Collective::AllReduce, 4 << 20),
            Algo::Hierarchical
        );
        c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        assert!(v.iter().all(|&x| x == 4.0));
        Ok(c.traffic())
    });
    for t in out {
        let t = t.unwrap();
        let ar = row(&t, "all_reduce");
        assert_eq!(ar.calls, 1, "{t:?}");
        // Within the host over shared memory, across hosts over TCP.
        assert!(ar.shm_written > 0 && ar.tcp_sent > 0, "{ar:?}");
        assert!(
            !t.iter().any(|r| r.op == "reduce_scatter"),
            "sub-operations are not rows of their own: {t:?}"
        );
    }
}
