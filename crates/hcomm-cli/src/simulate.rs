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

/// One measured ring all-reduce: a row of `hcomm bench allreduce --json`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Ranks of the run.
    pub ranks: usize,
    /// Message size in bytes.
    pub bytes: usize,
    /// Measured time per call (s).
    pub seconds: f64,
}

/// The ring all-reduce rows of `hcomm bench allreduce --json` output (one JSON object per
/// line; lines that are not such rows, and a launcher's `[rank] ` prefix, are skipped). Rows
/// of other algorithms (the selector picks recursive doubling for small sizes: force
/// `--algo ring` to calibrate on every size) and of one rank are left out.
pub fn parse_bench_rows(text: &str) -> Vec<Sample> {
    text.lines()
        .filter_map(|line| {
            let v: serde_json::Value = serde_json::from_str(&line[line.find('{')?..]).ok()?;
            let field = |k: &str| v.get(k);
            if field("op")?.as_str()? != "allreduce" || field("algo")?.as_str()? != "ring" {
                return None;
            }
            let sample = Sample {
                ranks: usize::try_from(field("ranks")?.as_u64()?).ok()?,
                bytes: usize::try_from(field("bytes")?.as_u64()?).ok()?,
                seconds: field("time_us")?.as_f64()? * 1e-6,
            };
            (sample.ranks >= 2 && sample.seconds > 0.0 && sample.seconds.is_finite())
                .then_some(sample)
        })
        .collect()
}

/// Link constants fitted to measured ring all-reduce times.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// Latency of a message between hosts (s).
    pub alpha_net: f64,
    /// Bandwidth of a host's link (bytes/s).
    pub beta_net: f64,
    /// Each sample with the time the fitted model predicts for it (s).
    pub rows: Vec<(Sample, f64)>,
}

/// Fit α (latency) and β (link bandwidth) of the one-rank-per-host ring all-reduce,
/// `T(S) = 2(n−1)·(α + S/(n·β)) + (n−1)·S/(n·γ)` (the schedule [`predict`] times; `gamma`,
/// the reduction throughput, is given, not fitted), by least squares in two steps, as times
/// spanning microseconds to seconds need: β from an ordinary least-squares fit of α and β to
/// the times (which the large sizes dominate), then α, with that β, by least squares on the
/// relative error (each sample weighs `1/T²`) of the sizes in the latency regime (where
/// `S/β` is at most half the time; every size if none is). α is never negative.
pub fn calibrate(samples: &[Sample], gamma: f64) -> Result<Calibration, String> {
    if samples.len() < 2 {
        return Err(format!(
            "{} ring all-reduce row(s): at least 2, of different sizes, are needed",
            samples.len()
        ));
    }
    // y = T − reduction = x1·α + x2·(1/β); t = T.
    struct Term {
        x1: f64,
        x2: f64,
        y: f64,
        t: f64,
    }
    let terms: Vec<Term> = samples
        .iter()
        .map(|s| {
            let (n, b) = (s.ranks as f64, s.bytes as f64);
            Term {
                x1: 2.0 * (n - 1.0),
                x2: 2.0 * (n - 1.0) * b / n,
                y: s.seconds - (n - 1.0) * b / (n * gamma),
                t: s.seconds,
            }
        })
        .collect();
    let sum = |f: &dyn Fn(&Term) -> f64| terms.iter().map(f).sum::<f64>();
    // Step 1: ordinary least squares for (α, 1/β); keep 1/β (refitted alone if α < 0).
    let (s11, s12, s22) = (
        sum(&|t| t.x1 * t.x1),
        sum(&|t| t.x1 * t.x2),
        sum(&|t| t.x2 * t.x2),
    );
    let (s1y, s2y) = (sum(&|t| t.x1 * t.y), sum(&|t| t.x2 * t.y));
    let det = s11 * s22 - s12 * s12;
    if det <= 1e-12 * s11 * s22 {
        return Err("every row has the same size: α and β cannot be told apart".into());
    }
    let mut inv_beta = (s11 * s2y - s12 * s1y) / det;
    if (s1y * s22 - s2y * s12) / det < 0.0 {
        inv_beta = s2y / s22;
    }
    if inv_beta.is_nan() || inv_beta <= 0.0 {
        return Err(format!(
            "the times grow no faster with size than the reduction alone ({} GB/s, --reduce-gbs) explains",
            gamma / 1e9
        ));
    }
    // Step 2: α given β, on the relative error, from the sizes where the bandwidth term is at
    // most half the time (the latency regime; all sizes if there are none such).
    let latency_bound = |t: &Term| t.x2 * inv_beta <= 0.5 * t.y;
    let any_latency_bound = terms.iter().any(latency_bound);
    let w = |t: &Term| {
        if latency_bound(t) || !any_latency_bound {
            1.0 / (t.t * t.t)
        } else {
            0.0
        }
    };
    let alpha =
        (sum(&|t| w(t) * t.x1 * (t.y - t.x2 * inv_beta)) / sum(&|t| w(t) * t.x1 * t.x1)).max(0.0);
    let beta = 1.0 / inv_beta;
    let rows = samples
        .iter()
        .map(|&s| {
            let m = Model {
                ranks_per_host: 1,
                hosts: s.ranks,
                alpha_net: alpha,
                beta_net: beta,
                alpha_shm: 0.0,
                beta_mem: f64::INFINITY,
                gamma,
            };
            let t = predict(&m, s.bytes)
                .into_iter()
                .find(|p| p.collective == "all_reduce" && p.algorithm == "ring")
                .map_or(f64::NAN, |p| p.seconds);
            (s, t)
        })
        .collect();
    Ok(Calibration {
        alpha_net: alpha,
        beta_net: beta,
        rows,
    })
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

    /// Ring all-reduce times of a known model, optionally off by `noise(i)` (relative).
    fn synthetic(alpha: f64, beta: f64, gamma: f64, noise: impl Fn(usize) -> f64) -> String {
        let mut out = String::new();
        let mut i = 0;
        for n in [2usize, 4] {
            for bytes in [8usize, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20] {
                let nf = n as f64;
                let b = bytes as f64;
                let t =
                    2.0 * (nf - 1.0) * (alpha + b / (nf * beta)) + (nf - 1.0) * b / (nf * gamma);
                let t = t * (1.0 + noise(i));
                i += 1;
                out += &format!(
                    "[0] {{\"op\":\"allreduce\",\"ranks\":{n},\"bytes\":{bytes},\"algo\":\"ring\",\"time_us\":{}}}\n",
                    t * 1e6
                );
            }
        }
        // Rows that must be left out: another algorithm, another op, garbage, a table line.
        out += "{\"op\":\"allreduce\",\"ranks\":2,\"bytes\":8,\"algo\":\"rd\",\"time_us\":1e9}\n";
        out += "{\"op\":\"broadcast\",\"ranks\":2,\"bytes\":8,\"algo\":\"ring\",\"time_us\":1e9}\n";
        out += "#        size        count     type\nnot json {\n";
        out
    }

    #[test]
    fn calibration_recovers_known_constants() {
        let (alpha, beta, gamma) = (50e-6, 1.25e9, 8e9);
        let rows = parse_bench_rows(&synthetic(alpha, beta, gamma, |_| 0.0));
        assert_eq!(rows.len(), 12);
        let c = calibrate(&rows, gamma).unwrap();
        assert!((c.alpha_net / alpha - 1.0).abs() < 1e-6, "{}", c.alpha_net);
        assert!((c.beta_net / beta - 1.0).abs() < 1e-6, "{}", c.beta_net);
        for (s, t) in &c.rows {
            assert!((t / s.seconds - 1.0).abs() < 1e-6, "{s:?}: predicted {t}");
        }
        // ±2% noise on every row: still within a few percent.
        let noisy = parse_bench_rows(&synthetic(alpha, beta, gamma, |i| {
            0.02 * if i % 3 == 0 { 1.0 } else { -1.0 }
        }));
        let c = calibrate(&noisy, gamma).unwrap();
        assert!((c.alpha_net / alpha - 1.0).abs() < 0.05, "{}", c.alpha_net);
        assert!((c.beta_net / beta - 1.0).abs() < 0.05, "{}", c.beta_net);
    }

    #[test]
    fn calibration_refuses_what_it_cannot_fit() {
        assert!(calibrate(&[], 8e9).is_err());
        let one = Sample {
            ranks: 2,
            bytes: 1 << 20,
            seconds: 1e-3,
        };
        assert!(calibrate(&[one, one], 8e9)
            .unwrap_err()
            .contains("same size"));
        // Faster than the reduction alone allows.
        let fast = |bytes| Sample {
            ranks: 2,
            bytes,
            seconds: 1e-6,
        };
        assert!(calibrate(&[fast(8), fast(64 << 20)], 1e9)
            .unwrap_err()
            .contains("--reduce-gbs"));
    }
}
