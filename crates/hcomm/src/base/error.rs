//! Typed errors. Every error says which operation failed, at which sequence number, and which
//! peer(s) were involved, so that a failure in a 1,000-rank job can be traced to its cause.

use std::fmt;
use std::time::Duration;

/// The operation an error happened in, with the communicator's sequence number for it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpContext {
    /// Operation name (`all_reduce`, `send`, `bootstrap`, …).
    pub op: &'static str,
    /// Sequence number of the operation on its communicator (0 for bootstrap).
    pub seq: u64,
}

impl fmt::Display for OpContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (seq {})", self.op, self.seq)
    }
}

/// Everything that can go wrong in hcomm.
#[derive(thiserror::Error, Debug, Clone)]
#[non_exhaustive]
pub enum Error {
    /// A caller passed something invalid (size, dtype, rank, root, …). Nothing was sent.
    #[error("{ctx}: invalid argument: {msg}")]
    InvalidArgument {
        /// Where.
        ctx: OpContext,
        /// What is wrong, naming the argument.
        msg: String,
    },
    /// A deadline passed while waiting for the named peers.
    #[error("{ctx}: timed out after {after:?} waiting for rank(s) {peers:?}{}", detail_suffix(.detail))]
    Timeout {
        /// Where.
        ctx: OpContext,
        /// Ranks (in the communicator) that had not delivered / accepted data.
        peers: Vec<usize>,
        /// The deadline that passed.
        after: Duration,
        /// What was still outstanding.
        detail: String,
    },
    /// A peer closed its connection or died.
    #[error("{ctx}: rank {peer} closed the connection (process exited or failed){}", detail_suffix(.detail))]
    PeerClosed {
        /// Where.
        ctx: OpContext,
        /// The peer's rank in the communicator.
        peer: usize,
        /// Extra information.
        detail: String,
    },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error("{ctx}: collective mismatch with rank {peer}: {msg}")]
    Mismatch {
        /// Where.
        ctx: OpContext,
        /// The peer whose call differs.
        peer: usize,
        /// Both sides' calls.
        msg: String,
    },
    /// Sender and receiver disagree on a point-to-point message size.
    #[error("{ctx}: message size mismatch with rank {peer} (tag {tag}): {msg}")]
    SizeMismatch {
        /// Where.
        ctx: OpContext,
        /// The other side.
        peer: usize,
        /// The user tag.
        tag: u32,
        /// Both sizes.
        msg: String,
    },
    /// A peer failed and told the others (so that every rank fails fast and names the cause,
    /// not only the ranks next to it).
    #[error("{ctx}: rank {peer} reported an error: {msg}")]
    Remote {
        /// Where.
        ctx: OpContext,
        /// Reporting peer.
        peer: usize,
        /// The rank that caused the failure, when known (a dead, stopped or mismatched rank).
        culprit: Option<usize>,
        /// What happened.
        msg: String,
    },
    /// A peer sent something the protocol does not allow (garbage, a frame nobody asked for).
    #[error("{ctx}: protocol error on the link from rank {peer}: {msg}")]
    Protocol {
        /// Where.
        ctx: OpContext,
        /// The peer whose bytes were bad.
        peer: usize,
        /// What was wrong.
        msg: String,
    },
    /// An operating-system level I/O error.
    #[error("{ctx}: I/O error{}: {msg}", peer_suffix(.peer))]
    Io {
        /// Where.
        ctx: OpContext,
        /// Peer involved, if any.
        peer: Option<usize>,
        /// The OS error text.
        msg: String,
    },
    /// Authentication failed: the rendezvous store (no `peer`) or a rank refused this
    /// process's job token, or the other way round (see `crate::auth`). Never quotes the token.
    #[error("{ctx}: authentication failed{}: {msg}", peer_suffix(.peer))]
    Auth {
        /// Where.
        ctx: OpContext,
        /// The rank involved, if any (none for the rendezvous store).
        peer: Option<usize>,
        /// What went wrong.
        msg: String,
    },
    /// Bad configuration (environment, rank table).
    #[error("configuration error: {0}")]
    Config(String),
    /// The communicator failed earlier and must be rebuilt.
    #[error("{ctx}: communicator is unusable after an earlier error: {first}")]
    Poisoned {
        /// Where this call was refused.
        ctx: OpContext,
        /// The first error.
        first: String,
    },
    /// The communicator was aborted.
    #[error("{ctx}: communicator was aborted")]
    Aborted {
        /// Where.
        ctx: OpContext,
    },
    /// The communicator was revoked ([`Communicator::revoke`](crate::Communicator::revoke),
    /// or a [`shrink`](crate::Communicator::shrink) started): every operation in flight or
    /// started later on it, on every rank, fails with this. Build a working communicator of
    /// the ranks that are left with [`shrink`](crate::Communicator::shrink).
    #[error("{ctx}: communicator was revoked by rank {by}; shrink() makes a working one of the ranks that are left")]
    Revoked {
        /// Where.
        ctx: OpContext,
        /// The rank that revoked it.
        by: usize,
    },
    /// [`Work::wait_timeout`](crate::Work::wait_timeout) gave up before the operation
    /// finished. Not fatal: the operation is still in flight; wait again, or `abort()`.
    #[error("{op}: still in flight after waiting {waited:?}")]
    WaitTimeout {
        /// The asynchronous operation waited for.
        op: &'static str,
        /// How long the caller waited.
        waited: Duration,
    },
    /// An asynchronous operation's result was asked for again after it was taken.
    #[error("{op}: the result was already taken by an earlier wait")]
    AlreadyTaken {
        /// The asynchronous operation.
        op: &'static str,
    },
    /// Code run by the progress engine panicked (a bug in hcomm or in a closure given to
    /// [`Communicator::run_async`](crate::Communicator::run_async)).
    #[error("{op}: panicked on the progress engine: {msg}")]
    Panicked {
        /// The asynchronous operation.
        op: &'static str,
        /// The panic message.
        msg: String,
    },
}

fn detail_suffix(d: &str) -> String {
    if d.is_empty() {
        String::new()
    } else {
        format!(" ({d})")
    }
}

/// `text` with every rank number it names ("rank 3", "rank(s) [1, 2]", "ranks [0, 1]") put
/// through `map`: hcomm's messages name ranks in these forms only.
fn renumber_ranks(text: &str, map: &dyn Fn(usize) -> usize) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("rank") {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let prefix = ["rank(s) [", "ranks [", "rank "]
            .into_iter()
            .find(|p| from.starts_with(p));
        let Some(prefix) = prefix else {
            out.push_str("rank");
            rest = &from[4..];
            continue;
        };
        out.push_str(prefix);
        let mut tail = &from[prefix.len()..];
        let list = prefix.ends_with('[');
        loop {
            let digits = tail.len() - tail.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 {
                break;
            }
            match tail[..digits].parse::<usize>() {
                Ok(r) => out.push_str(&map(r).to_string()),
                Err(_) => out.push_str(&tail[..digits]),
            }
            tail = &tail[digits..];
            if list && tail.starts_with(", ") {
                out.push_str(", ");
                tail = &tail[2..];
            } else {
                break;
            }
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

fn peer_suffix(p: &Option<usize>) -> String {
    match p {
        Some(p) => format!(" with rank {p}"),
        None => String::new(),
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(op: &'static str, seq: u64, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            ctx: OpContext { op, seq },
            msg: msg.into(),
        }
    }

    /// Shorthand for [`Error::Io`].
    pub fn io(ctx: OpContext, peer: Option<usize>, e: impl fmt::Display) -> Self {
        Error::Io {
            ctx,
            peer,
            msg: e.to_string(),
        }
    }

    /// True for errors after which the communicator is unusable: everything except bad
    /// arguments (detected before any byte moves) and point-to-point size mismatches (the
    /// message is consumed, so the links stay in step).
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            Error::InvalidArgument { .. }
                | Error::Config(_)
                | Error::SizeMismatch { .. }
                | Error::WaitTimeout { .. }
                | Error::AlreadyTaken { .. }
        )
    }

    /// The rank this error blames and why, as sent to the peers when a communicator fails
    /// (see [`Error::Remote`]): `(culprit, reason code)`.
    pub(crate) fn blame(&self) -> (Option<usize>, AbortReason) {
        match self {
            Error::PeerClosed { peer, .. } => (Some(*peer), AbortReason::PeerGone),
            Error::Timeout { peers, .. } => (peers.first().copied(), AbortReason::Timeout),
            Error::Mismatch { peer, .. } => (Some(*peer), AbortReason::Mismatch),
            Error::Protocol { peer, .. } => (Some(*peer), AbortReason::Protocol),
            Error::Io { peer, .. } => (*peer, AbortReason::Other),
            Error::Remote { culprit, .. } => (*culprit, AbortReason::Relayed),
            Error::Aborted { .. } => (None, AbortReason::Aborted),
            Error::Revoked { by, .. } => (Some(*by), AbortReason::Revoked),
            _ => (None, AbortReason::Other),
        }
    }

    /// [`blame`](Self::blame) in the numbers of an internal sub-communicator whose rank `i`
    /// is this communicator's rank `ranks[i]`, to relay this failure to it: a culprit outside
    /// it is sent as `ranks.len() + p` (see [`lifted`](Self::lifted)).
    pub(crate) fn blame_in(&self, ranks: &[usize]) -> (Option<usize>, AbortReason) {
        let (culprit, reason) = self.blame();
        let sub = culprit.map(|p| {
            ranks
                .iter()
                .position(|&r| r == p)
                .unwrap_or(ranks.len() + p)
        });
        (sub, reason)
    }

    /// This error of an internal sub-communicator (rank `i` of it is rank `ranks[i]` here)
    /// as an error of this communicator's operation `ctx`: every rank it names, in its fields
    /// and its text, in this communicator's numbers (a culprit `ranks.len() + p` is rank `p`,
    /// relayed by [`blame_in`](Self::blame_in)), and its text saying which inner step failed,
    /// among which ranks (`among` says who they are).
    pub(crate) fn lifted(self, ctx: &OpContext, ranks: &[usize], among: &str) -> Error {
        let n = ranks.len();
        let map = |r: usize| if r < n { ranks[r] } else { r - n };
        let step = |inner: &OpContext| {
            format!(
                "in its step {} (seq {}) among {among} {ranks:?}",
                inner.op, inner.seq
            )
        };
        let text = |t: &str, inner: &OpContext| {
            let t = renumber_ranks(t, &map);
            if t.is_empty() {
                step(inner)
            } else {
                format!("{t}; {}", step(inner))
            }
        };
        let c = ctx.clone();
        match self {
            Error::InvalidArgument { ctx: i, msg } => Error::InvalidArgument {
                msg: text(&msg, &i),
                ctx: c,
            },
            Error::Timeout {
                ctx: i,
                peers,
                after,
                detail,
            } => Error::Timeout {
                peers: peers.into_iter().map(map).collect(),
                after,
                detail: text(&detail, &i),
                ctx: c,
            },
            Error::PeerClosed {
                ctx: i,
                peer,
                detail,
            } => Error::PeerClosed {
                peer: map(peer),
                detail: text(&detail, &i),
                ctx: c,
            },
            Error::Mismatch { ctx: i, peer, msg } => Error::Mismatch {
                peer: map(peer),
                msg: text(&msg, &i),
                ctx: c,
            },
            Error::SizeMismatch {
                ctx: i,
                peer,
                tag,
                msg,
            } => Error::SizeMismatch {
                peer: map(peer),
                tag,
                msg: text(&msg, &i),
                ctx: c,
            },
            Error::Remote {
                ctx: i,
                peer,
                culprit,
                msg,
            } => Error::Remote {
                peer: map(peer),
                culprit: culprit.map(map),
                msg: text(&msg, &i),
                ctx: c,
            },
            Error::Protocol { ctx: i, peer, msg } => Error::Protocol {
                peer: map(peer),
                msg: text(&msg, &i),
                ctx: c,
            },
            Error::Io { ctx: i, peer, msg } => Error::Io {
                peer: peer.map(map),
                msg: text(&msg, &i),
                ctx: c,
            },
            Error::Auth { ctx: i, peer, msg } => Error::Auth {
                peer: peer.map(map),
                msg: text(&msg, &i),
                ctx: c,
            },
            Error::Poisoned { ctx: _, first } => Error::Poisoned {
                first: renumber_ranks(&first, &map),
                ctx: c,
            },
            Error::Aborted { .. } => Error::Aborted { ctx: c },
            Error::Revoked { by, .. } => Error::Revoked {
                by: map(by),
                ctx: c,
            },
            e => e,
        }
    }

    /// True if the communicator was revoked.
    pub fn is_revoked(&self) -> bool {
        matches!(self, Error::Revoked { .. })
    }

    /// True if this is a timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }
}

/// Why a rank gave up, as carried to its peers (one byte on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum AbortReason {
    /// A peer's process or connection is gone.
    PeerGone = 1,
    /// A deadline passed.
    Timeout = 2,
    /// Ranks called different collectives.
    Mismatch = 3,
    /// A peer broke the protocol.
    Protocol = 4,
    /// `abort()` was called.
    Aborted = 5,
    /// Passed on from another rank.
    Relayed = 6,
    /// Anything else.
    Other = 7,
    /// The communicator was revoked (the culprit is the rank that revoked it).
    Revoked = 8,
}

impl AbortReason {
    pub(crate) fn from_u8(v: u8) -> AbortReason {
        match v {
            1 => AbortReason::PeerGone,
            2 => AbortReason::Timeout,
            3 => AbortReason::Mismatch,
            4 => AbortReason::Protocol,
            5 => AbortReason::Aborted,
            6 => AbortReason::Relayed,
            8 => AbortReason::Revoked,
            _ => AbortReason::Other,
        }
    }

    /// The error rank `me` gets when `reporter` tells it that it failed for this reason,
    /// blaming `culprit`. When the blame lands on `me` itself while `me` waits for rank
    /// another rank than the reporter (`waiting_for`), the message says both and the error's
    /// culprit passes on to that rank: a rank blamed while it waits is not the cause, the rank
    /// it waits for is, along the chain. Blame that lands on `me` otherwise stays (`me` came
    /// late, after the reporter gave up on it) and names it as this rank.
    pub(crate) fn remote_error(
        self,
        ctx: OpContext,
        reporter: usize,
        culprit: Option<usize>,
        me: usize,
        waiting_for: Option<usize>,
    ) -> Error {
        if self == AbortReason::Revoked {
            return Error::Revoked {
                ctx,
                by: culprit.unwrap_or(reporter),
            };
        }
        let blamed_me = culprit == Some(me);
        let who = |c: usize| {
            if blamed_me {
                format!("this rank (rank {c})")
            } else {
                format!("rank {c}")
            }
        };
        let mut what = match (self, culprit) {
            (AbortReason::PeerGone, Some(c)) if blamed_me => {
                format!("lost its connection to {}", who(c))
            }
            (AbortReason::PeerGone, Some(c)) => format!("rank {c} died or closed its connection"),
            (AbortReason::Timeout, Some(c)) => format!("timed out waiting for {}", who(c)),
            (AbortReason::Mismatch, Some(c)) => {
                format!("{} called a different collective", who(c))
            }
            (AbortReason::Protocol, Some(c)) => format!("protocol error from {}", who(c)),
            (AbortReason::Relayed, Some(c)) => {
                format!("the job failed because of {}", who(c))
            }
            (AbortReason::Aborted, _) => "aborted".to_string(),
            (_, Some(c)) => format!("failed (blaming {})", who(c)),
            (_, None) => "failed".to_string(),
        };
        let mut culprit = culprit;
        if blamed_me {
            if let Some(w) = waiting_for.filter(|&w| w != me && w != reporter) {
                what.push_str(&format!(", while this rank was waiting for rank {w}"));
                culprit = Some(w);
            }
        }
        Error::Remote {
            ctx,
            peer: reporter,
            culprit,
            msg: format!("{what}; this communicator is unusable"),
        }
    }
}

/// Result type of hcomm.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(
        reason: AbortReason,
        reporter: usize,
        culprit: Option<usize>,
        me: usize,
        waiting_for: Option<usize>,
    ) -> (Option<usize>, String) {
        let ctx = OpContext {
            op: "all_reduce",
            seq: 3,
        };
        match reason.remote_error(ctx, reporter, culprit, me, waiting_for) {
            Error::Remote { culprit, msg, .. } => (culprit, msg),
            e => panic!("not a remote error: {e}"),
        }
    }

    #[test]
    fn an_error_of_a_sub_communicator_names_the_parents_ranks_and_operation() {
        let inner = OpContext {
            op: "all_gather",
            seq: 21,
        };
        let outer = OpContext {
            op: "all_reduce",
            seq: 32,
        };
        // The ranks [1, 3] of the parent: 0 is 1, 1 is 3, and 2 + p relays the parent's p.
        let ranks = [1, 3];
        let e = Error::PeerClosed {
            ctx: inner.clone(),
            peer: 1,
            detail: "its process is gone (shared memory)".into(),
        }
        .lifted(&outer, &ranks, "the ranks of this host");
        assert_eq!(
            e.to_string(),
            "all_reduce (seq 32): rank 3 closed the connection (process exited or failed) \
             (its process is gone (shared memory); in its step all_gather (seq 21) among the \
             ranks of this host [1, 3])"
        );
        let e = Error::Timeout {
            ctx: inner.clone(),
            peers: vec![0, 1],
            after: Duration::from_secs(5),
            detail: "shared memory: rank 1 did not arrive (at 0 of 1); ranks [0, 1] and rank(s) [1] late".into(),
        }
        .lifted(&outer, &ranks, "hosts");
        match &e {
            Error::Timeout { peers, detail, .. } => {
                assert_eq!(peers, &[1, 3]);
                assert!(
                    detail.starts_with(
                        "shared memory: rank 3 did not arrive (at 0 of 1); ranks [1, 3] and \
                         rank(s) [3] late; in its step all_gather"
                    ),
                    "{detail}"
                );
            }
            e => panic!("{e}"),
        }
        // A culprit relayed from outside the sub-communicator (rank 2 of the parent).
        let (culprit, reason) = Error::PeerClosed {
            ctx: outer.clone(),
            peer: 2,
            detail: String::new(),
        }
        .blame_in(&ranks);
        assert_eq!(culprit, Some(4));
        let e = reason
            .remote_error(inner.clone(), 0, culprit, 1, None)
            .lifted(&outer, &ranks, "hosts");
        match &e {
            Error::Remote {
                peer, culprit, msg, ..
            } => {
                assert_eq!((*peer, *culprit), (1, Some(2)));
                assert!(
                    msg.starts_with("rank 2 died or closed its connection; this communicator"),
                    "{msg}"
                );
            }
            e => panic!("{e}"),
        }
        let e = Error::Revoked { ctx: inner, by: 0 }.lifted(&outer, &ranks, "hosts");
        assert!(
            matches!(e, Error::Revoked { by: 1, ref ctx } if ctx.seq == 32),
            "{e}"
        );
        assert_eq!(
            renumber_ranks("ranks ranking rank x rank 10", &|r| r + 1),
            "ranks ranking rank x rank 11"
        );
    }

    #[test]
    fn blame_on_a_waiting_rank_passes_on_and_a_late_rank_is_named_as_itself() {
        // Blamed by rank 2 while waiting for rank 0: rank 0 is the cause, both are said.
        let (culprit, msg) = remote(AbortReason::Timeout, 2, Some(1), 1, Some(0));
        assert_eq!(culprit, Some(0));
        assert_eq!(
            msg,
            "timed out waiting for this rank (rank 1), while this rank was waiting for rank 0; \
             this communicator is unusable"
        );
        // Came late: the reporter gave up on this rank, which now waits for the reporter. It
        // used to read "timed out waiting for rank 0" on rank 1, from rank 0.
        let (culprit, msg) = remote(AbortReason::Timeout, 0, Some(1), 1, Some(0));
        assert_eq!(culprit, Some(1));
        assert_eq!(
            msg,
            "timed out waiting for this rank (rank 1); this communicator is unusable"
        );
        let (culprit, msg) = remote(AbortReason::Timeout, 0, Some(1), 1, None);
        assert_eq!(
            (culprit, msg.contains("this rank (rank 1)")),
            (Some(1), true)
        );
        // Blame on another rank is passed through as it came.
        let (culprit, msg) = remote(AbortReason::PeerGone, 0, Some(2), 1, Some(0));
        assert_eq!(culprit, Some(2));
        assert_eq!(
            msg,
            "rank 2 died or closed its connection; this communicator is unusable"
        );
        let (_, msg) = remote(AbortReason::PeerGone, 0, Some(1), 1, None);
        assert!(
            msg.starts_with("lost its connection to this rank (rank 1)"),
            "{msg}"
        );
        // A revocation names who revoked, this rank included.
        let e = AbortReason::Revoked.remote_error(
            OpContext {
                op: "barrier",
                seq: 0,
            },
            0,
            Some(1),
            1,
            Some(0),
        );
        assert!(matches!(e, Error::Revoked { by: 1, .. }), "{e}");
    }
}
