//! `hcomm simulate`: predicted time of each all-reduce / broadcast algorithm at a scale nobody
//! can test on one machine, from an α-β-γ model of the schedules hcomm runs.
//!
//! A schedule is a list of rounds; in a round every rank sends at most one message per peer
//! and reduces what it received. A round takes as long as its slowest rank:
//!
//! * a message between hosts costs `α_net + bytes / β_net`, where a host's link is shared by
//!   every message leaving (and, separately, entering) that host in the round;
//! * a message within a host costs `α_shm + bytes / β_mem` (shared memory copies);
//! * reducing `b` bytes costs `b / γ`.
//!
//! The rounds are those of hcomm's algorithms (`crates/hcomm/src/algo/` and the hierarchical
//! all-reduce): ring = n−1 reduce-scatter rounds of S/n then n−1 all-gather rounds;
//! recursive doubling = ⌈log₂ n⌉ exchanges of S (+2 rounds folding the ranks beyond the power
//! of two); binomial tree broadcast = ⌈log₂ n⌉ rounds of S; hierarchical = ring reduce-scatter
//! within each host, ring all-reduce of S/L across hosts (L flows per host link), ring
//! all-gather within each host. Identical rounds are computed once and multiplied, so 16,384
//! ranks take microseconds.

/// Machine and network constants of the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Model {
    /// Ranks per host.
    pub ranks_per_host: usize,
    /// Hosts.
    pub hosts: usize,
    /// Latency of a message between hosts (s).
    pub alpha_net: f64,
    /// Bandwidth of one host's network link, each direction (bytes/s).
    pub beta_net: f64,
    /// Latency of a shared-memory handoff (s).
    pub alpha_shm: f64,
    /// Copy bandwidth through shared memory, per rank (bytes/s).
    pub beta_mem: f64,
    /// Reduction throughput per rank (bytes/s).
    pub gamma: f64,
}

impl Model {
    /// Total ranks.
    pub fn ranks(&self) -> usize {
        self.ranks_per_host * self.hosts
    }

    fn host(&self, rank: usize) -> usize {
        rank / self.ranks_per_host
    }
}

/// One round: `(src, dst, bytes)` messages and the bytes each receiver reduces.
struct Round {
    msgs: Vec<(usize, usize, f64)>,
    /// Reduce the received bytes (reduce-scatter / reduce rounds).
    reduce: bool,
}

/// Time of one round under `m`.
fn round_time(m: &Model, r: &Round) -> f64 {
    let mut out_bytes = vec![0.0f64; m.hosts];
    let mut in_bytes = vec![0.0f64; m.hosts];
    for &(s, d, b) in &r.msgs {
        let (hs, hd) = (m.host(s), m.host(d));
        if hs != hd {
            out_bytes[hs] += b;
            in_bytes[hd] += b;
        }
    }
    let mut t = 0.0f64;
    for &(s, d, b) in &r.msgs {
        let (hs, hd) = (m.host(s), m.host(d));
        let transfer = if hs != hd {
            // The message shares its host links with the others crossing them this round.
            m.alpha_net + out_bytes[hs].max(in_bytes[hd]) / m.beta_net
        } else {
            m.alpha_shm + b / m.beta_mem
        };
        let reduce = if r.reduce { b / m.gamma } else { 0.0 };
        t = t.max(transfer + reduce);
    }
    t
}

/// A schedule: rounds, each repeated some times.
type Schedule = Vec<(Round, usize)>;

fn time_of(m: &Model, s: &Schedule) -> f64 {
    s.iter().map(|(r, k)| round_time(m, r) * *k as f64).sum()
}

/// Ring over `ranks` (in this order) of `bytes`: reduce-scatter then all-gather.
fn ring(ranks: &[usize], bytes: f64, reduce_scatter: bool, all_gather: bool) -> Schedule {
    let n = ranks.len();
    if n < 2 {
        return Vec::new();
    }
    let step = |reduce| Round {
        msgs: (0..n)
            .map(|i| (ranks[i], ranks[(i + 1) % n], bytes / n as f64))
            .collect(),
        reduce,
    };
    let mut s = Vec::new();
    if reduce_scatter {
        s.push((step(true), n - 1));
    }
    if all_gather {
        s.push((step(false), n - 1));
    }
    s
}

fn merge_parallel(parts: Vec<Schedule>) -> Schedule {
    // Run schedules of the same shape side by side (one flow per host slice).
    let mut out: Schedule = Vec::new();
    let mut parts: Vec<std::vec::IntoIter<(Round, usize)>> =
        parts.into_iter().map(|p| p.into_iter()).collect();
    loop {
        let mut msgs = Vec::new();
        let mut reduce = false;
        let mut reps = None;
        for p in parts.iter_mut() {
            if let Some((r, k)) = p.next() {
                msgs.extend(r.msgs);
                reduce |= r.reduce;
                reps = Some(k);
            }
        }
        match reps {
            Some(k) => out.push((Round { msgs, reduce }, k)),
            None => return out,
        }
    }
}

/// Recursive doubling over all ranks (hcomm's: the ranks beyond the largest power of two fold
/// into partners first and get the result back at the end).
fn recursive_doubling(m: &Model, bytes: f64) -> Schedule {
    let n = m.ranks();
    let p = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    let extra = n - p;
    let mut s = Vec::new();
    if extra > 0 {
        let fold = Round {
            msgs: (0..extra).map(|i| (p + i, i, bytes)).collect(),
            reduce: true,
        };
        s.push((fold, 1));
    }
    let mut d = 1;
    while d < p {
        let r = Round {
            msgs: (0..p).map(|i| (i, i ^ d, bytes)).collect(),
            reduce: true,
        };
        s.push((r, 1));
        d <<= 1;
    }
    if extra > 0 {
        let back = Round {
            msgs: (0..extra).map(|i| (i, p + i, bytes)).collect(),
            reduce: false,
        };
        s.push((back, 1));
    }
    s
}

/// Binomial-tree broadcast from rank 0.
fn binomial_broadcast(m: &Model, bytes: f64) -> Schedule {
    let n = m.ranks();
    let mut s = Vec::new();
    let mut have = 1;
    while have < n {
        let msgs = (0..have.min(n - have))
            .map(|i| (i, i + have, bytes))
            .collect();
        s.push((
            Round {
                msgs,
                reduce: false,
            },
            1,
        ));
        have *= 2;
    }
    s
}

/// Hierarchical all-reduce: ring reduce-scatter in each host, ring all-reduce of each slice
/// across hosts (L parallel flows), ring all-gather in each host.
fn hierarchical(m: &Model, bytes: f64) -> Schedule {
    let (l, h) = (m.ranks_per_host, m.hosts);
    let within = |rs, ag| {
        merge_parallel(
            (0..h)
                .map(|host| {
                    let ranks: Vec<usize> = (0..l).map(|i| host * l + i).collect();
                    ring(&ranks, bytes, rs, ag)
                })
                .collect(),
        )
    };
    let across = merge_parallel(
        (0..l)
            .map(|i| {
                let ranks: Vec<usize> = (0..h).map(|host| host * l + i).collect();
                ring(&ranks, bytes / l as f64, true, true)
            })
            .collect(),
    );
    let mut s = within(true, false);
    s.extend(across);
    s.extend(within(false, true));
    s
}

/// One prediction.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// Collective.
    pub collective: &'static str,
    /// Algorithm.
    pub algorithm: &'static str,
    /// Message size in bytes.
    pub bytes: usize,
    /// Predicted time (s).
    pub seconds: f64,
    /// nccl-tests bus bandwidth (GB/s).
    pub busbw_gbs: f64,
}

/// Predictions of every algorithm for `bytes` under `m`.
pub fn predict(m: &Model, bytes: usize) -> Vec<Prediction> {
    let n = m.ranks();
    let b = bytes as f64;
    let all: Vec<usize> = (0..n).collect();
    let mut v = vec![
        ("all_reduce", "ring", ring(&all, b, true, true)),
        ("all_reduce", "rd", recursive_doubling(m, b)),
        ("broadcast", "tree", binomial_broadcast(m, b)),
    ];
    if m.hosts >= 2 && m.ranks_per_host >= 2 {
        v.push(("all_reduce", "hierarchical", hierarchical(m, b)));
    }
    v.into_iter()
        .map(|(coll, algo, s)| {
            let t = time_of(m, &s);
            let factor = if coll == "all_reduce" {
                2.0 * (n as f64 - 1.0) / n as f64
            } else {
                1.0
            };
            Prediction {
                collective: coll,
                algorithm: algo,
                bytes,
                seconds: t,
                busbw_gbs: if t > 0.0 { b / t * factor / 1e9 } else { 0.0 },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(n: usize) -> Model {
        // One rank per host: every message crosses the network.
        Model {
            ranks_per_host: 1,
            hosts: n,
            alpha_net: 20e-6,
            beta_net: 1.25e9,
            alpha_shm: 1e-6,
            beta_mem: 10e9,
            gamma: 4e9,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1e-12)
    }

    fn get<'a>(p: &'a [Prediction], coll: &str, algo: &str) -> &'a Prediction {
        p.iter()
            .find(|x| x.collective == coll && x.algorithm == algo)
            .unwrap()
    }

    #[test]
    fn ring_matches_the_closed_form() {
        for n in [2usize, 3, 8, 1024, 16_384] {
            let m = flat(n);
            let s = 64.0 * (1 << 20) as f64;
            let p = predict(&m, s as usize);
            let nf = n as f64;
            let want = 2.0 * (nf - 1.0) * (m.alpha_net + s / nf / m.beta_net)
                + (nf - 1.0) * s / nf / m.gamma;
            assert!(close(get(&p, "all_reduce", "ring").seconds, want), "n={n}");
        }
    }

    #[test]
    fn tree_and_recursive_doubling_match_their_closed_forms() {
        for n in [2usize, 4, 8, 1024] {
            let m = flat(n);
            let s = 4096.0;
            let p = predict(&m, s as usize);
            let lg = (n as f64).log2();
            let tree = lg * (m.alpha_net + s / m.beta_net);
            assert!(close(get(&p, "broadcast", "tree").seconds, tree), "n={n}");
            let rd = lg * (m.alpha_net + s / m.beta_net + s / m.gamma);
            assert!(close(get(&p, "all_reduce", "rd").seconds, rd), "n={n}");
        }
        // Not a power of two: two extra rounds.
        let m = flat(6);
        let s = 4096.0;
        let p = predict(&m, s as usize);
        let step = m.alpha_net + s / m.beta_net;
        let want = 2.0 * (step + s / m.gamma) + (step + s / m.gamma) + step;
        assert!(close(get(&p, "all_reduce", "rd").seconds, want));
        assert!(close(get(&p, "broadcast", "tree").seconds, 3.0 * step));
    }

    #[test]
    fn hierarchical_moves_fewer_bytes_across_hosts_than_the_flat_ring() {
        let m = Model {
            ranks_per_host: 2,
            hosts: 2,
            alpha_net: 50e-6,
            beta_net: 125e6,
            alpha_shm: 2e-6,
            beta_mem: 8e9,
            gamma: 4e9,
        };
        let s = (64 << 20) as f64;
        let p = predict(&m, s as usize);
        // Flat ring: two edges cross hosts, 1.5 S out of each host.
        let ring = get(&p, "all_reduce", "ring").seconds;
        assert!(
            ring > 1.5 * s / m.beta_net && ring < 1.6 * s / m.beta_net,
            "{ring}"
        );
        // Hierarchical: S out of each host (two flows of S/2).
        let hier = get(&p, "all_reduce", "hierarchical").seconds;
        assert!(
            hier > s / m.beta_net && hier < 1.1 * s / m.beta_net,
            "{hier}"
        );
    }
}
