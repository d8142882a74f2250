//! The last operations a communicator ran, for hang reports: when a deadline passes, the
//! rank logs what it was doing, which ranks it waited for, and what it ran before
//! (`HCOMM_DEBUG=info` or any level that shows errors), so the lagging rank can be found
//! from any rank's log.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::base::deadline::OpStart;
use crate::base::error::{Error, OpContext};

/// How many finished operations a communicator remembers.
pub const HISTORY_LEN: usize = 16;

/// One finished operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpRecord {
    /// Operation name (`all_reduce`, `send`, …).
    pub op: &'static str,
    /// The communicator's collective sequence number when it started.
    pub seq: u64,
    /// How long it took, from its first wait on: `None` when it never had to wait (it ran
    /// within the spin window, and its clock was never read; see `crate::base::deadline`).
    pub took: Option<Duration>,
    /// The error it ended with; `None` when it succeeded (no allocation per operation).
    pub error: Option<String>,
}

#[derive(Debug)]
pub(crate) struct History {
    rank: usize,
    records: VecDeque<OpRecord>,
    current: Option<OpContext>,
    /// When the current operation first waited (its deadline counts from there).
    start: OpStart,
}

impl History {
    pub(crate) fn new(rank: usize) -> History {
        History {
            rank,
            records: VecDeque::with_capacity(HISTORY_LEN),
            current: None,
            start: OpStart::unset(),
        }
    }

    /// Start an operation. Reads no clock: the clock is a visible part of a small
    /// operation's cost, so the start is read when the operation first waits.
    pub(crate) fn begin(&mut self, ctx: &OpContext) {
        self.current = Some(ctx.clone());
        self.start.clear();
    }

    /// The current operation's start, for a lazy [`Deadline`](crate::base::deadline::Deadline).
    pub(crate) fn start(&self) -> &OpStart {
        &self.start
    }

    /// The deadline of the current operation, `timeout` after its start (read now if no wait
    /// read it yet).
    pub(crate) fn deadline(&self, timeout: std::time::Duration) -> Instant {
        self.start.get_or(Instant::now) + timeout
    }

    /// Record the end of the current operation; returns a hang report if it timed out.
    pub(crate) fn end(&mut self, outcome: Result<(), &Error>) -> Option<String> {
        let ctx = self.current.take()?;
        let report = match outcome {
            Err(e @ Error::Timeout { .. }) => Some(self.report(&ctx, e)),
            _ => None,
        };
        if self.records.len() == HISTORY_LEN {
            self.records.pop_front();
        }
        self.records.push_back(OpRecord {
            op: ctx.op,
            seq: ctx.seq,
            took: self.start.get().map(|s| s.elapsed()),
            error: outcome.err().map(|e| e.to_string()),
        });
        report
    }

    pub(crate) fn records(&self) -> Vec<OpRecord> {
        self.records.iter().cloned().collect()
    }

    fn report(&self, ctx: &OpContext, e: &Error) -> String {
        let mut s = format!(
            "hang report from rank {}: {e}\n  last operations (oldest first):",
            self.rank
        );
        if self.records.is_empty() {
            s.push_str(" none");
        }
        for r in &self.records {
            let took = match r.took {
                Some(t) => format!("{:.3} ms", t.as_secs_f64() * 1e3),
                None => "no wait".to_string(),
            };
            s.push_str(&format!(
                "\n    {} (seq {}) {took}: {}",
                r.op,
                r.seq,
                r.error.as_deref().unwrap_or("ok")
            ));
        }
        if let Error::Timeout { peers, .. } = e {
            s.push_str(&format!(
                "\n  rank(s) {peers:?} did not do their part of {} (seq {}) in time: they are behind, stopped or dead, called another operation, or the network to them is down or slow",
                ctx.op, ctx.seq
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_operations_and_reports_a_timeout() {
        let mut h = History::new(3);
        for seq in 0..20 {
            h.begin(&OpContext {
                op: "all_reduce",
                seq,
            });
            assert!(h.end(Ok(())).is_none());
        }
        assert_eq!(h.records().len(), HISTORY_LEN);
        assert_eq!(h.records()[0].seq, 4);
        let ctx = OpContext {
            op: "broadcast",
            seq: 20,
        };
        h.begin(&ctx);
        let e = Error::Timeout {
            ctx: ctx.clone(),
            peers: vec![2],
            after: Duration::from_secs(1),
            detail: String::new(),
        };
        let report = h.end(Err(&e)).expect("a report");
        assert!(report.contains("rank 3"), "{report}");
        assert!(report.contains("all_reduce (seq 19)"), "{report}");
        assert!(
            report.contains("rank(s) [2] did not do their part of broadcast (seq 20) in time"),
            "{report}"
        );
        assert_eq!(h.records().last().unwrap().op, "broadcast");
    }

    #[test]
    fn an_operation_that_never_waited_records_no_duration() {
        let mut h = History::new(0);
        let ctx = OpContext {
            op: "all_reduce",
            seq: 0,
        };
        h.begin(&ctx);
        assert!(h.start().get().is_none(), "begin must not read the clock");
        h.end(Ok(()));
        assert_eq!(h.records()[0].took, None);
        h.begin(&OpContext { seq: 1, ..ctx });
        let deadline = h.deadline(Duration::from_secs(5));
        let start = h
            .start()
            .get()
            .expect("asking for the deadline reads the start");
        assert_eq!(deadline, start + Duration::from_secs(5));
        h.end(Ok(()));
        assert!(h.records()[1].took.is_some());
        // The next operation starts unread again.
        h.begin(&OpContext { seq: 2, ..ctx });
        assert!(h.start().get().is_none());
    }
}
