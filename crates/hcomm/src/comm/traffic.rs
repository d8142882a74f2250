//! Byte counters: how many bytes each kind of operation moved on this rank, measured where the
//! bytes really move.
//!
//! * TCP: bytes passed to `send(2)` and returned by `recv(2)` on the links, frame headers
//!   included (the one-off connection handshake of each link is not counted).
//! * Shared memory: payload bytes this rank copies into the communicator's segment (and the
//!   reduced slices it computes in place there, once each), and bytes it copies or reduces out
//!   of it. Control words (arrival counters, fingerprints) are not counted.
//! * Not counted: shared-memory windows ([`Communicator::all_reduce_window`] works in
//!   user-allocated windows; only its barriers count).
//!
//! The transports keep plain counters (a field increment per `send`/`recv` call or copy, no
//! atomics, no locks); when an operation ends, the difference since it started is added to
//! the row of its name. An operation built from others (a compressed all-reduce, the
//! hierarchical all-reduce) names its row for all of them, through a scope.

use std::cell::Cell;

use crate::comm::Communicator;

/// Bytes one kind of operation moved on this rank (see [`Communicator::traffic`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OpTraffic {
    /// Operation name (`all_reduce`, `send`, `all_reduce_compressed`, …).
    pub op: &'static str,
    /// Calls of the operation.
    pub calls: u64,
    /// Bytes this rank wrote to TCP links.
    pub tcp_sent: u64,
    /// Bytes this rank read from TCP links.
    pub tcp_received: u64,
    /// Bytes this rank copied into the shared-memory segment.
    pub shm_written: u64,
    /// Bytes this rank copied (or reduced) out of the shared-memory segment.
    pub shm_read: u64,
}

impl OpTraffic {
    /// Bytes sent: TCP bytes written plus shared-memory bytes written.
    pub fn bytes_sent(&self) -> u64 {
        self.tcp_sent + self.shm_written
    }

    /// Bytes received: TCP bytes read plus shared-memory bytes read.
    pub fn bytes_received(&self) -> u64 {
        self.tcp_received + self.shm_read
    }
}

/// A snapshot of a communicator's transport counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub tcp_sent: u64,
    pub tcp_received: u64,
    pub shm_written: u64,
    pub shm_read: u64,
}

impl Counters {
    pub(crate) fn since(self, start: Counters) -> Counters {
        Counters {
            tcp_sent: self.tcp_sent.wrapping_sub(start.tcp_sent),
            tcp_received: self.tcp_received.wrapping_sub(start.tcp_received),
            shm_written: self.shm_written.wrapping_sub(start.shm_written),
            shm_read: self.shm_read.wrapping_sub(start.shm_read),
        }
    }
}

/// Per-operation rows, in the order operations first ran.
#[derive(Clone, Debug, Default)]
pub(crate) struct TrafficTable(Vec<OpTraffic>);

impl TrafficTable {
    pub(crate) fn add(&mut self, op: &'static str, calls: u64, c: Counters) {
        // Names are static: the pointer decides at once for the rows of this very name.
        let row = match self
            .0
            .iter()
            .position(|r| std::ptr::eq(r.op, op) || r.op == op)
        {
            Some(i) => &mut self.0[i],
            None => {
                self.0.push(OpTraffic {
                    op,
                    ..OpTraffic::default()
                });
                self.0.last_mut().expect("just pushed")
            }
        };
        row.calls += calls;
        row.tcp_sent += c.tcp_sent;
        row.tcp_received += c.tcp_received;
        row.shm_written += c.shm_written;
        row.shm_read += c.shm_read;
    }

    /// Add another table's bytes (not its calls: they are parts of calls counted here).
    pub(crate) fn add_bytes_of(&mut self, rows: &[OpTraffic]) {
        for r in rows {
            self.add(
                r.op,
                0,
                Counters {
                    tcp_sent: r.tcp_sent,
                    tcp_received: r.tcp_received,
                    shm_written: r.shm_written,
                    shm_read: r.shm_read,
                },
            );
        }
    }

    pub(crate) fn rows(&self) -> Vec<OpTraffic> {
        self.0.clone()
    }

    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

thread_local! {
    /// The name of the compound operation running on this thread, if any.
    static LABEL: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// The row the operation ending now on this thread belongs to: the enclosing compound
/// operation's, if there is one (then the call is counted by the compound operation).
pub(crate) fn current_label() -> Option<&'static str> {
    LABEL.with(|l| l.get())
}

/// While alive, the bytes of every operation this thread runs are counted under `label`, on
/// whichever communicator they run (the sub-communicators of a compound operation included);
/// when dropped, one call of `label` is counted on `comm`. Nested scopes defer to the
/// outermost one.
pub(crate) struct TrafficScope<'a> {
    comm: &'a Communicator,
    label: Option<&'static str>,
    /// When the outermost scope began, while tracing: the compound operation's slice.
    started: Option<std::time::Instant>,
}

impl<'a> TrafficScope<'a> {
    pub(crate) fn enter(comm: &'a Communicator, label: &'static str) -> TrafficScope<'a> {
        let outermost = LABEL.with(|l| {
            if l.get().is_none() {
                l.set(Some(label));
                true
            } else {
                false
            }
        });
        TrafficScope {
            comm,
            label: outermost.then_some(label),
            started: (outermost && comm.traces()).then(std::time::Instant::now),
        }
    }
}

impl Drop for TrafficScope<'_> {
    fn drop(&mut self) {
        if let Some(label) = self.label {
            LABEL.with(|l| l.set(None));
            self.comm.count_call(label);
            if let Some(started) = self.started {
                self.comm.trace_compound(label, started);
            }
        }
    }
}
