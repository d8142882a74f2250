//! The last operations a communicator ran, for hang reports: when a deadline passes, the
//! rank logs what it was doing, which ranks it waited for, and what it ran before
//! (`HCOMM_DEBUG=info` or any level that shows errors), so the lagging rank can be found
//! from any rank's log.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

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
    /// How long it took.
    pub took: Duration,
    /// The error it ended with; `None` when it succeeded (no allocation per operation).
    pub error: Option<String>,
}

#[derive(Debug)]
pub(crate) struct History {
    rank: usize,
    records: VecDeque<OpRecord>,
    current: Option<(OpContext, Instant)>,
}

impl History {
    pub(crate) fn new(rank: usize) -> History {
        History {
            rank,
            records: VecDeque::with_capacity(HISTORY_LEN),
            current: None,
        }
    }

    pub(crate) fn begin(&mut self, ctx: &OpContext) {
        self.current = Some((ctx.clone(), Instant::now()));
    }

    /// The deadline of the current operation: `timeout` after it began (one clock read per
    /// operation fewer than reading the clock again; the clock is a visible part of a small
    /// operation's cost).
    pub(crate) fn deadline(&self, timeout: std::time::Duration) -> Instant {
        self.current
            .as_ref()
            .map_or_else(Instant::now, |(_, start)| *start)
            + timeout
    }

    /// Record the end of the current operation; returns a hang report if it timed out.
    pub(crate) fn end(&mut self, outcome: Result<(), &Error>) -> Option<String> {
        let (ctx, start) = self.current.take()?;
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
            took: start.elapsed(),
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
            s.push_str(&format!(
                "\n    {} (seq {}) {:.3} ms: {}",
                r.op,
                r.seq,
                r.took.as_secs_f64() * 1e3,
                r.error.as_deref().unwrap_or("ok")
            ));
        }
        if let Error::Timeout { peers, .. } = e {
            s.push_str(&format!(
                "\n  rank(s) {peers:?} did not take part in {} (seq {}): they are behind, stopped, or called another operation",
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
            report.contains("rank(s) [2] did not take part in broadcast (seq 20)"),
            "{report}"
        );
        assert_eq!(h.records().last().unwrap().op, "broadcast");
    }
}
