//! The vocabulary of a collective call as it travels between ranks: which collective, which
//! algorithm, and the fingerprint that every rank's call must agree on. Built, packed,
//! compared and described here, for TCP frames and shared-memory words alike.

use crate::base::dtype::{DType, ReduceOp};
use crate::base::ids::fold_hash;
use crate::wire::frame::{Header, Kind};
use std::fmt;
use std::str::FromStr;

/// An algorithm a collective can run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Let the selector choose by size, world size and topology.
    Auto,
    /// Ring: reduce-scatter + all-gather, bandwidth-optimal for large messages.
    Ring,
    /// Recursive doubling: log2(n) exchanges of the whole vector; latency-optimal.
    RecursiveDoubling,
    /// Binomial tree (broadcast, reduce).
    Tree,
    /// Pipelined chain in chunks (broadcast, reduce): bandwidth-optimal for large messages.
    Chain,
    /// Root talks to every rank directly (gather, scatter).
    Linear,
    /// Every pair exchanges directly, all at once (all-to-all).
    Pairwise,
    /// Dissemination (barrier).
    Dissemination,
    /// Shared memory: every rank works directly on a segment mapped by all ranks of the host.
    Shm,
    /// The canonical order (`HCOMM_DETERMINISTIC`): every element reduced as one fixed
    /// expression over the ranks in rank order, whatever the size, transport or layout.
    Canonical,
    /// Several hosts with several ranks each: reduce-scatter within each host (shared memory),
    /// all-reduce of each slice across hosts (TCP, all slices in parallel), all-gather within
    /// each host. Only `1/L` of the data crosses the network per rank (L ranks per host).
    Hierarchical,
}

impl Algo {
    /// Code carried in collective fingerprints.
    pub fn code(self) -> u8 {
        match self {
            Algo::Auto => 0,
            Algo::Ring => 1,
            Algo::RecursiveDoubling => 2,
            Algo::Tree => 3,
            Algo::Chain => 4,
            Algo::Linear => 5,
            Algo::Pairwise => 6,
            Algo::Dissemination => 7,
            Algo::Shm => 8,
            Algo::Hierarchical => 9,
            Algo::Canonical => 10,
        }
    }

    /// Decode a fingerprint code.
    pub fn from_code(c: u8) -> Option<Algo> {
        [
            Algo::Auto,
            Algo::Ring,
            Algo::RecursiveDoubling,
            Algo::Tree,
            Algo::Chain,
            Algo::Linear,
            Algo::Pairwise,
            Algo::Dissemination,
            Algo::Shm,
            Algo::Hierarchical,
            Algo::Canonical,
        ]
        .into_iter()
        .find(|a| a.code() == c)
    }

    /// Name used by `HCOMM_ALGO` and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::Tree => "tree",
            Algo::Chain => "chain",
            Algo::Linear => "linear",
            Algo::Pairwise => "pairwise",
            Algo::Dissemination => "dissemination",
            Algo::Shm => "shm",
            Algo::Hierarchical => "hierarchical",
            Algo::Canonical => "canonical",
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Algo::Auto,
            "ring" => Algo::Ring,
            "rd" | "recursive_doubling" | "recursive-doubling" => Algo::RecursiveDoubling,
            "tree" | "binomial" => Algo::Tree,
            "chain" | "pipeline" => Algo::Chain,
            "linear" | "direct" => Algo::Linear,
            "pairwise" => Algo::Pairwise,
            "dissemination" => Algo::Dissemination,
            "shm" | "shared_memory" => Algo::Shm,
            "hier" | "hierarchical" => Algo::Hierarchical,
            "canonical" | "deterministic" => Algo::Canonical,
            other => {
                return Err(format!(
                    "unknown algorithm '{other}' (expected auto, ring, rd, tree, chain, linear, pairwise, dissemination, shm, hierarchical, canonical)"
                ))
            }
        })
    }
}

/// The collectives, as named in fingerprints, logs and `HCOMM_ALGO`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Collective {
    /// All-reduce.
    AllReduce = 1,
    /// All-gather (also the v-variant).
    AllGather = 2,
    /// Reduce-scatter (also the v-variant).
    ReduceScatter = 3,
    /// Broadcast.
    Broadcast = 4,
    /// Reduce.
    Reduce = 5,
    /// Gather.
    Gather = 6,
    /// Scatter.
    Scatter = 7,
    /// All-to-all (also the v-variant).
    AllToAll = 8,
    /// Barrier.
    Barrier = 9,
}

impl Collective {
    /// Every collective.
    pub const ALL: [Collective; 9] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Gather,
        Collective::Scatter,
        Collective::AllToAll,
        Collective::Barrier,
    ];

    /// snake_case name (`all_reduce`, …).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Barrier => "barrier",
        }
    }

    /// Decode a fingerprint code.
    pub fn from_code(c: u8) -> Option<Collective> {
        Collective::ALL.into_iter().find(|x| *x as u8 == c)
    }

    /// Parse `allreduce`, `all_reduce`, `AllReduce`, …
    pub fn parse(s: &str) -> Option<Collective> {
        let k: String = s
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase();
        Collective::ALL.into_iter().find(|c| {
            c.name().replace('_', "") == k || (k == "bcast" && *c == Collective::Broadcast)
        })
    }

    /// The algorithms this collective can run with (first = default family).
    pub fn algorithms(self) -> &'static [Algo] {
        match self {
            Collective::AllReduce => &[
                Algo::Ring,
                Algo::RecursiveDoubling,
                Algo::Shm,
                Algo::Hierarchical,
                Algo::Canonical,
            ],
            Collective::AllGather => &[Algo::Ring, Algo::Shm],
            Collective::ReduceScatter => &[Algo::Ring, Algo::Shm, Algo::Canonical],
            Collective::Broadcast => &[Algo::Tree, Algo::Chain, Algo::Shm],
            Collective::Reduce => &[Algo::Tree, Algo::Chain, Algo::Shm, Algo::Canonical],
            Collective::Gather => &[Algo::Linear, Algo::Shm],
            Collective::Scatter => &[Algo::Linear, Algo::Shm],
            Collective::AllToAll => &[Algo::Pairwise, Algo::Shm],
            Collective::Barrier => &[Algo::Dissemination, Algo::Shm],
        }
    }
}

/// The fingerprint's algorithm code of the zero-skipping pair exchange
/// (`crate::algo::skip_zeros`), which runs in place of the chosen algorithm (not an [`Algo`]
/// one can force): ranks that disagree on skipping zeros fail with a mismatch that names it.
pub const SKIP_ZEROS_CODE: u8 = 11;

/// The fingerprint's algorithm code of the all-gather that sends repeated blocks as references
/// to kept calls (`crate::algo::gather_cache`): ranks that disagree on keeping all-gathers fail
/// with a mismatch that names it.
pub const GATHER_CACHE_CODE: u8 = 12;

/// Human-readable description of a frame's call, for mismatch errors.
pub fn describe_frame(h: &Header) -> String {
    match h.kind {
        Kind::Collective => {
            let name = Collective::from_code(h.coll)
                .map(|c| c.name())
                .unwrap_or("unknown collective");
            let mut s = format!("{name}(count={}", h.count);
            if let Some(d) = DType::from_code(h.dtype) {
                s += &format!(", dtype={d}");
            }
            if let Some(o) = ReduceOp::from_code(h.redop) {
                s += &format!(", op={o}");
            }
            if h.root != u32::MAX {
                s += &format!(", root={}", h.root);
            }
            if h.algo == SKIP_ZEROS_CODE {
                s += ", algo=skip-zeros";
            } else if h.algo == GATHER_CACHE_CODE {
                s += ", algo=gather-cache";
            } else if let Some(a) = Algo::from_code(h.algo).filter(|a| *a != Algo::Auto) {
                s += &format!(", algo={a}");
            }
            s + &format!(") at seq {}", h.seq)
        }
        Kind::P2p => format!("send(tag={}, {} bytes)", h.tag, h.count),
        k => format!("{k:?}(tag={})", h.tag),
    }
}

/// Describe a shared-memory fingerprint word (see [`ShmFingerprint::of`]).
pub fn describe_shm_word(word: u64) -> String {
    let root = ((word >> 24) & 0xffff) as u32;
    describe_frame(&Header {
        kind: Kind::Collective,
        dtype: (word >> 8) as u8,
        coll: word as u8,
        redop: (word >> 16) as u8,
        algo: Algo::Shm.code(),
        root: if root == 0xffff { u32::MAX } else { root },
        tag: 0,
        seq: 0,
        count: word >> 40,
        len: 0,
    })
    .replace(" at seq 0", "")
}

/// Fingerprint of a collective call on a shared segment, compared between ranks at its first
/// barrier (the shared-memory form of a frame [`Header`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmFingerprint {
    /// Communicator sequence number.
    pub seq: u64,
    /// Collective, dtype, op, root and count (low 24 bits) packed, for messages
    /// ([`describe_shm_word`]).
    pub word: u64,
    /// Hash of everything that must agree: the full count, per-rank counts, algorithm.
    pub detail: u64,
}

impl ShmFingerprint {
    /// The shared-memory fingerprint of the call that frame header `fp` describes; `extra`
    /// is anything else that must agree on every rank (e.g. a hash of per-rank counts).
    pub fn of(fp: &Header, extra: u64) -> ShmFingerprint {
        ShmFingerprint {
            detail: fold_hash([fp.count, fp.algo as u64, extra]),
            seq: fp.seq,
            word: (fp.coll as u64)
                | (fp.dtype as u64) << 8
                | (fp.redop as u64) << 16
                | (fp.root as u64 & 0xffff) << 24
                | (fp.count & 0xff_ffff) << 40,
        }
    }
}

/// The header every frame of collective call number `seq` carries (`algo`, `tag` and `len`
/// are filled in later).
pub fn fingerprint(
    seq: u64,
    coll: Collective,
    dtype: Option<DType>,
    op: Option<ReduceOp>,
    root: Option<usize>,
    count: usize,
) -> Header {
    Header {
        kind: Kind::Collective,
        dtype: dtype.map_or(0, |d| d as u8),
        coll: coll as u8,
        redop: op.map_or(0, |o| o as u8),
        algo: 0,
        root: root.map_or(u32::MAX, |r| r as u32),
        tag: 0,
        seq,
        count: count as u64,
        len: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for c in Collective::ALL {
            assert_eq!(Collective::from_code(c as u8), Some(c));
            assert_eq!(Collective::parse(c.name()), Some(c));
            for a in c.algorithms() {
                assert_eq!(a.name().parse::<Algo>(), Ok(*a));
            }
        }
        assert_eq!(Collective::parse("bcast"), Some(Collective::Broadcast));
    }

    #[test]
    fn frames_and_shm_words_describe_the_call() {
        let h = Header {
            algo: Algo::Ring.code(),
            ..fingerprint(
                7,
                Collective::AllReduce,
                Some(DType::F32),
                Some(ReduceOp::Sum),
                None,
                5,
            )
        };
        assert_eq!(
            describe_frame(&h),
            format!(
                "all_reduce(count=5, dtype={}, op={}, algo=ring) at seq 7",
                DType::F32,
                ReduceOp::Sum
            )
        );
        let b = fingerprint(3, Collective::Broadcast, Some(DType::I32), None, Some(2), 9);
        let shm = ShmFingerprint::of(&b, 0);
        assert_eq!(shm.seq, 3);
        assert_eq!(
            describe_shm_word(shm.word),
            format!("broadcast(count=9, dtype={}, root=2, algo=shm)", DType::I32)
        );
        assert_ne!(ShmFingerprint::of(&b, 1).detail, shm.detail);
    }
}
