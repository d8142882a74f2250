//! Which algorithm a collective runs with: an override (`HCOMM_ALGO`, parsed in
//! [`crate::config::knobs`], or `set_algorithm`) when this topology has it, else the choice by
//! message size, world size and topology. Kept apart from the schedules and
//! from the communicator, so the rule can be read and tested on its own.

use crate::wire::collective::{Algo, Collective};

/// What the selector needs to know of a communicator.
#[derive(Clone, Copy, Debug)]
pub struct Topology {
    /// World size.
    pub size: usize,
    /// Every rank shares this host and the shared-memory collectives are set up.
    pub shared_memory: bool,
    /// Several hosts with several ranks each (the hierarchical layout exists).
    pub hierarchical: bool,
    /// The hierarchical layout's hosts hold consecutive ranks (the canonical hierarchical
    /// all-reduce needs the rank order to be the host order).
    pub hosts_contiguous: bool,
    /// Reductions must give the same bits whatever else changes (`HCOMM_DETERMINISTIC`).
    pub deterministic: bool,
}

/// Size thresholds of the algorithm selector (bytes per rank).
#[derive(Clone, Copy, Debug)]
pub struct Thresholds {
    /// All-reduce: recursive doubling up to this size, ring above.
    pub allreduce_rd_max: usize,
    /// Broadcast / reduce: binomial tree up to this size, pipelined chain above.
    pub tree_max: usize,
    /// All-reduce across several hosts with several ranks each: hierarchical from this size.
    pub hierarchical_min: usize,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            allreduce_rd_max: 64 << 10,
            tree_max: 64 << 10,
            hierarchical_min: 2 << 20,
        }
    }
}

/// The algorithm for `coll` on `bytes` bytes per rank: the canonical one for reductions in
/// deterministic mode (whatever is forced: only it gives the same bits everywhere; for large
/// all-reduces on hosts of consecutive ranks its hierarchical form), else
/// `forced` when it is set and available on this topology, else the default rule (hierarchical for large all-reduces across hosts of
/// several ranks, shared memory within one host, otherwise by size).
pub fn select(
    coll: Collective,
    bytes: usize,
    forced: Algo,
    topology: &Topology,
    thresholds: &Thresholds,
) -> Algo {
    if topology.deterministic && coll.algorithms().contains(&Algo::Canonical) {
        if coll == Collective::AllReduce
            && topology.hierarchical
            && topology.hosts_contiguous
            && bytes >= thresholds.hierarchical_min
        {
            // The canonical hierarchical all-reduce (`algo::canonical::host_chain`): the
            // same bits as the flat one, the cross-host bytes of the hierarchical one.
            return Algo::Hierarchical;
        }
        // The shared-memory reductions fold in rank order too (with f16/bf16 widened in
        // deterministic mode), so they give the canonical bits, faster.
        return if topology.shared_memory {
            Algo::Shm
        } else {
            Algo::Canonical
        };
    }
    let available = match forced {
        Algo::Shm => topology.shared_memory,
        Algo::Hierarchical => topology.hierarchical,
        _ => true,
    };
    if forced != Algo::Auto && available {
        return forced;
    }
    if coll == Collective::AllReduce
        && bytes >= thresholds.hierarchical_min
        && topology.hierarchical
    {
        return Algo::Hierarchical;
    }
    if topology.shared_memory && coll.algorithms().contains(&Algo::Shm) {
        return Algo::Shm;
    }
    match coll {
        Collective::AllReduce if bytes <= thresholds.allreduce_rd_max => Algo::RecursiveDoubling,
        Collective::AllReduce => Algo::Ring,
        Collective::Broadcast | Collective::Reduce
            if bytes <= thresholds.tree_max || topology.size <= 2 =>
        {
            Algo::Tree
        }
        Collective::Broadcast | Collective::Reduce => Algo::Chain,
        c => c.algorithms()[0],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::knobs::parse_algo_overrides;

    const TCP: Topology = Topology {
        size: 4,
        shared_memory: false,
        hierarchical: false,
        hosts_contiguous: false,
        deterministic: false,
    };

    #[test]
    fn deterministic_mode_picks_the_canonical_reductions_only() {
        let t = Thresholds::default();
        let det = Topology {
            deterministic: true,
            shared_memory: true,
            hierarchical: true,
            ..TCP
        };
        let det_tcp = Topology {
            shared_memory: false,
            ..det
        };
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::Reduce,
        ] {
            for bytes in [0, 8, 1 << 20, 64 << 20] {
                for forced in [Algo::Auto, Algo::Ring, Algo::Shm, Algo::RecursiveDoubling] {
                    assert_eq!(select(coll, bytes, forced, &det, &t), Algo::Shm);
                    assert_eq!(select(coll, bytes, forced, &det_tcp, &t), Algo::Canonical);
                }
            }
        }
        // Large all-reduces on hosts of consecutive ranks: the canonical hierarchical form;
        // reduce-scatter and reduce stay flat, and so do interleaved hosts.
        let hosts = Topology {
            shared_memory: false,
            hosts_contiguous: true,
            ..det
        };
        let interleaved = Topology {
            hosts_contiguous: false,
            ..hosts
        };
        for forced in [Algo::Auto, Algo::Ring, Algo::Hierarchical] {
            let big = t.hierarchical_min;
            assert_eq!(
                select(Collective::AllReduce, big, forced, &hosts, &t),
                Algo::Hierarchical
            );
            assert_eq!(
                select(Collective::AllReduce, big - 1, forced, &hosts, &t),
                Algo::Canonical
            );
            assert_eq!(
                select(Collective::ReduceScatter, big, forced, &hosts, &t),
                Algo::Canonical
            );
            assert_eq!(
                select(Collective::AllReduce, big, forced, &interleaved, &t),
                Algo::Canonical
            );
        }
        assert_eq!(
            select(Collective::Broadcast, 8, Algo::Auto, &det, &t),
            Algo::Shm
        );
        assert_eq!(
            select(Collective::AllGather, 8, Algo::Auto, &det, &t),
            Algo::Shm
        );
    }

    #[test]
    fn by_size_over_tcp() {
        let t = Thresholds::default();
        let pick = |c, b| select(c, b, Algo::Auto, &TCP, &t);
        assert_eq!(pick(Collective::AllReduce, 8), Algo::RecursiveDoubling);
        assert_eq!(
            pick(Collective::AllReduce, t.allreduce_rd_max),
            Algo::RecursiveDoubling
        );
        assert_eq!(
            pick(Collective::AllReduce, t.allreduce_rd_max + 1),
            Algo::Ring
        );
        assert_eq!(pick(Collective::Broadcast, 8), Algo::Tree);
        assert_eq!(pick(Collective::Reduce, 1 << 20), Algo::Chain);
        assert_eq!(pick(Collective::AllToAll, 8), Algo::Pairwise);
        assert_eq!(pick(Collective::Barrier, 0), Algo::Dissemination);
        let two = Topology { size: 2, ..TCP };
        assert_eq!(
            select(Collective::Broadcast, 1 << 20, Algo::Auto, &two, &t),
            Algo::Tree
        );
    }

    #[test]
    fn topology_first_then_overrides() {
        let t = Thresholds::default();
        let shm = Topology {
            shared_memory: true,
            ..TCP
        };
        let hier = Topology {
            hierarchical: true,
            ..TCP
        };
        assert_eq!(
            select(Collective::AllReduce, 8, Algo::Auto, &shm, &t),
            Algo::Shm
        );
        assert_eq!(
            select(Collective::AllReduce, 8, Algo::Ring, &shm, &t),
            Algo::Ring
        );
        let big = t.hierarchical_min;
        assert_eq!(
            select(Collective::AllReduce, big, Algo::Auto, &hier, &t),
            Algo::Hierarchical
        );
        assert_eq!(
            select(Collective::AllReduce, big - 1, Algo::Auto, &hier, &t),
            Algo::Ring
        );
        // A forced algorithm this topology lacks falls back to the rule.
        assert_eq!(
            select(Collective::AllReduce, 8, Algo::Shm, &TCP, &t),
            Algo::RecursiveDoubling
        );
        assert_eq!(
            select(Collective::AllReduce, big, Algo::Hierarchical, &TCP, &t),
            Algo::Ring
        );
    }

    #[test]
    fn overrides_parse_and_refuse() {
        let all = parse_algo_overrides("ring").unwrap();
        assert_eq!(all.get(&Collective::AllReduce), Some(&Algo::Ring));
        assert_eq!(all.get(&Collective::Broadcast), None);
        let some = parse_algo_overrides("allreduce=rd, bcast=chain").unwrap();
        assert_eq!(
            some.get(&Collective::AllReduce),
            Some(&Algo::RecursiveDoubling)
        );
        assert_eq!(some.get(&Collective::Broadcast), Some(&Algo::Chain));
        assert!(parse_algo_overrides("").unwrap().is_empty());
        for bad in [
            "nosuch",
            "broadcast=ring",
            "allreduce",
            "gather=linear,x=ring",
        ] {
            let e = parse_algo_overrides(bad).unwrap_err().to_string();
            assert!(e.contains("HCOMM_ALGO"), "{bad}: {e}");
        }
    }
}
