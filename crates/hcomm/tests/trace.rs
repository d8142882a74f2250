//! Traces (`HCOMM_TRACE`, `Communicator::trace_to`): each rank writes a Chrome trace whose
//! slices name every operation with what the communicator knew of it (algorithm, bytes,
//! peers, queue time, errors), agree with the byte counters, put sub-communicators on tracks
//! of their own, and are closed when the communicators are dropped.

use hcomm::config::TransportKind;
use hcomm::testing::{expect_all, run_threads_with};
use hcomm::{Algo, Collective, Communicator, ReduceOp};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn trace_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hcomm-trace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The events of a closed trace file (it must parse as it stands: the `]` was written).
fn events(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    v.as_array().expect("an array").clone()
}

fn slices<'a>(events: &'a [Value], name: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == name)
        .collect()
}

fn track_names(events: &[Value]) -> Vec<(u64, String)> {
    events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn every_operation_is_a_slice_with_its_algorithm_bytes_peers_and_errors() {
    let n = 4;
    let dir = trace_dir("ops");
    let setting = dir.to_str().unwrap().to_string();
    let traffic = expect_all(run_threads_with(
        n,
        TransportKind::Tcp,
        Duration::from_secs(60),
        |c| {
            c.trace_to(&setting)?;
            let rank = c.rank();
            c.set_algorithm(Collective::AllReduce, Algo::Ring)?;
            let mut v = vec![1.0f32; 1 << 16];
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            c.set_trace_label(Some("bucket 3"));
            let mut b = vec![rank as i32; 5];
            c.broadcast(&mut b, 2)?;
            c.set_trace_label(None);
            // Point-to-point in a ring, and a receive of the wrong size (an error).
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let mut got = vec![0u8; 100];
            c.send_recv(next, &[rank as u8; 100], prev, &mut got, 9)?;
            if rank == 0 {
                c.send(1, 11, &[0u8; 16])?;
            } else if rank == 1 {
                let mut small = vec![0u8; 8];
                let e = c.recv(0, 11, &mut small).expect_err("16 bytes into 8");
                assert!(e.to_string().contains("16"), "{e}");
            }
            let traffic = c.traffic();
            // Three asynchronous all-reduces queued behind a job that holds the turn until
            // all three are issued: each waits for the one before.
            let c = Arc::new(c);
            let (go, wait_for_go) = std::sync::mpsc::channel::<()>();
            let hold = c.run_async("hold", move |_| {
                let _ = wait_for_go.recv();
                Ok(())
            });
            // Each labelled as it is issued (they run after the label changed again).
            let works: Vec<_> = (0..3)
                .map(|i| {
                    c.set_trace_label(Some(&format!("async {i}")));
                    c.all_reduce_async(vec![i as f64; 1 << 14], ReduceOp::Max)
                })
                .collect();
            c.set_trace_label(None);
            go.send(()).expect("the hold job waits");
            hold.wait()?;
            for w in works {
                w.wait()?;
            }
            // A sub-communicator writes to the same file on a track of its own.
            let sub = c.split((rank < 2).then_some(0), rank as i64)?;
            if let Some(sub) = sub {
                let mut x = [1u64; 3];
                sub.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            }
            assert_eq!(c.trace_file(), Some(dir_file(&setting, rank)));
            Ok(traffic)
        },
    ));
    for (rank, traffic) in traffic.iter().enumerate() {
        let ev = events(&dir.join(format!("hcomm-trace-rank{rank}.json")));
        assert!(ev.iter().all(|e| e["pid"] == rank as u64), "rank {rank}");
        let tracks = track_names(&ev);
        assert!(
            tracks
                .iter()
                .any(|(_, n)| n == &format!("world (rank {rank} of 4)")),
            "{tracks:?}"
        );
        // The ring all-reduce: its algorithm, size and ring neighbours, and the bytes the
        // counters saw.
        let ar = slices(&ev, "all_reduce");
        let ring = ar[0];
        let a = &ring["args"];
        assert_eq!(a["algo"], "ring", "{ring}");
        assert_eq!(a["dtype"], "float");
        assert_eq!(a["reduce"], "sum");
        assert_eq!(a["count"], 1 << 16);
        assert_eq!(a["bytes"], 4 << 16);
        let mut ring_peers = vec![(rank + 1) % n, (rank + n - 1) % n];
        ring_peers.sort();
        assert_eq!(a["peers"], serde_json::json!(ring_peers), "{ring}");
        let row = traffic.iter().find(|r| r.op == "all_reduce").unwrap();
        assert_eq!(a["tcp_sent"], row.tcp_sent);
        assert_eq!(a["tcp_received"], row.tcp_received);
        assert!(ring["dur"].as_f64().unwrap() > 0.0);
        // The labelled broadcast, rooted at 2.
        let bc = slices(&ev, "broadcast");
        assert_eq!(bc.len(), 1);
        assert_eq!(bc[0]["args"]["root"], 2);
        assert_eq!(bc[0]["args"]["label"], "bucket 3");
        assert!(slices(&ev, "send_recv")[0]["args"].get("label").is_none());
        let sr = slices(&ev, "send_recv");
        assert_eq!(sr[0]["args"]["peer"], (rank + 1) % n);
        assert_eq!(sr[0]["args"]["tag"], 9);
        assert_eq!(sr[0]["args"]["bytes"], 100);
        if rank == 1 {
            let recv = slices(&ev, "recv");
            assert_eq!(recv.len(), 1);
            let e = recv[0]["args"]["error"].as_str().expect("an error");
            assert!(e.contains("16"), "{e}");
        }
        // The asynchronous ones: all issued before the first could start, run one after the
        // other, so each was queued from its issue until the one before it ended.
        let asyncs: Vec<_> = ar
            .iter()
            .filter(|s| s["args"]["dtype"] == "double")
            .collect();
        assert_eq!(asyncs.len(), 3);
        let first_start = asyncs[0]["ts"].as_f64().unwrap();
        for (i, s) in asyncs.iter().enumerate() {
            assert_eq!(s["args"]["label"], format!("async {i}"), "{s}");
            let issued = s["ts"].as_f64().unwrap() - s["args"]["queue_us"].as_f64().unwrap();
            assert!(
                issued <= first_start + 0.01,
                "issued after the first began: {s}"
            );
        }
        for w in asyncs.windows(2) {
            let (a, b) = (w[0], w[1]);
            let (ts_a, dur_a) = (a["ts"].as_f64().unwrap(), a["dur"].as_f64().unwrap());
            assert!(b["ts"].as_f64().unwrap() >= ts_a + dur_a - 0.01, "{a}\n{b}");
        }
        // The sub-communicator's all-reduce is on another track of the same file.
        let world_tid = tracks
            .iter()
            .find(|(_, name)| name.starts_with("world "))
            .unwrap()
            .0;
        let sub: Vec<_> = ar.iter().filter(|s| s["tid"] != world_tid).collect();
        assert_eq!(sub.len(), usize::from(rank < 2), "rank {rank}");
        if rank < 2 {
            assert_eq!(sub[0]["args"]["dtype"], "uint64");
            assert_eq!(sub[0]["args"]["peers"], serde_json::json!([1 - rank]));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn dir_file(setting: &str, rank: usize) -> PathBuf {
    hcomm::trace::trace_file(setting, rank)
}

#[test]
fn shared_memory_collectives_and_compound_operations_are_traced() {
    let dir = trace_dir("shm");
    let setting = format!("{}/r{{rank}}.json", dir.display());
    expect_all(run_threads_with(
        2,
        TransportKind::Shm,
        Duration::from_secs(60),
        |c| {
            c.trace_to(&setting)?;
            let mut v = vec![1.0f32; 1000];
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            let mut grads = vec![0.5f32; 4096];
            let mut state = hcomm::CompressionState::new(hcomm::Compressor::Int8 {
                block: 256,
                stochastic: false,
            })?;
            c.all_reduce_compressed(&mut grads, ReduceOp::Sum, &mut state)?;
            c.stop_trace();
            // Not traced any more.
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            Ok(())
        },
    ));
    for rank in 0..2 {
        let ev = events(&dir.join(format!("r{rank}.json")));
        let ar = slices(&ev, "all_reduce");
        assert_eq!(ar[0]["args"]["algo"], "shm", "{}", ar[0]);
        assert_eq!(ar[0]["args"]["peers"], serde_json::json!([1 - rank]));
        assert!(ar[0]["args"]["shm_written"].as_u64().unwrap() > 0);
        // The compressed all-reduce is one compound slice, its parts name it.
        let compressed = slices(&ev, "all_reduce_compressed");
        assert_eq!(compressed.len(), 1, "{ev:?}");
        assert_eq!(compressed[0]["cat"], "compound");
        let parts: Vec<_> = ev
            .iter()
            .filter(|e| e["args"]["part_of"] == "all_reduce_compressed")
            .collect();
        assert!(!parts.is_empty());
        let (ts, end) = (
            compressed[0]["ts"].as_f64().unwrap(),
            compressed[0]["ts"].as_f64().unwrap() + compressed[0]["dur"].as_f64().unwrap(),
        );
        for p in parts {
            let t = p["ts"].as_f64().unwrap();
            assert!(
                t >= ts - 0.01 && t <= end + 0.01,
                "{p} outside {}",
                compressed[0]
            );
        }
        // Stopped: the last all-reduce is not there (one before the compressed one, plus its
        // parts that are all-reduces, if any).
        let after: Vec<_> = ar
            .iter()
            .filter(|s| s["args"].get("part_of").is_none())
            .collect();
        assert_eq!(after.len(), 1);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_trace_that_cannot_be_created_is_an_error_naming_the_file() {
    let out = expect_all(run_threads_with(
        1,
        TransportKind::Tcp,
        Duration::from_secs(20),
        |c: Communicator| Ok(c.trace_to("/proc/hcomm-no-such/{rank}.json").unwrap_err()),
    ));
    let e = out[0].to_string();
    assert!(e.contains("/proc/hcomm-no-such/0.json"), "{e}");
}
