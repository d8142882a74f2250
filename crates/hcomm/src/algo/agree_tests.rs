//! The agreement on an in-memory mesh whose ranks die at chosen points: every rank that
//! decides decides the same, and a rerun after the coordinator died settles everyone.

use super::{AgreeError, Agreement, Decision};
use crate::transport::mem::MemMeshFabric;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who arrived to build each new communicator: (members, coordinator's payload) -> ranks.
type Board = HashMap<(Vec<usize>, Vec<u8>), BTreeSet<usize>>;

/// Run the agreement on `n` ranks; `deaths[r]` = sends rank `r` makes before it dies. After
/// a decision each rank "builds" the new communicator as `shrink` does, modelled by a board
/// where the decision's members meet: it succeeds when every member arrives with the same
/// decision, and fails (the rank agrees again) when a member died. Returns each survivor's
/// final decision (None for the ranks that died or were dropped on purpose).
fn run(
    n: usize,
    known: &[usize],
    deaths: &[Option<usize>],
) -> Vec<Option<Result<Decision, AgreeError>>> {
    let fabric = MemMeshFabric::new(n);
    let board: Arc<Mutex<Board>> = Arc::default();
    let meshes: Vec<_> = (0..n)
        .map(|r| fabric.mesh(r, deaths.get(r).copied().flatten()))
        .collect();
    let handles: Vec<_> = meshes
        .into_iter()
        .map(|mut mesh| {
            let known = known.to_vec();
            let (fabric, board) = (fabric.clone(), board.clone());
            std::thread::spawn(move || {
                use crate::transport::Mesh;
                let me = mesh.rank();
                if known.contains(&me) {
                    // Dropped on purpose: it does not take part.
                    return None;
                }
                let mut a = Agreement::new(known);
                for attempt in 0..n {
                    // A new store (a new address) for every attempt, as in `shrink`.
                    let payload = format!("store of {me}, attempt {attempt}").into_bytes();
                    match a.run(&mut mesh, &payload, Duration::from_secs(5)) {
                        Ok(_) if fabric.is_dead(me) => return None,
                        Ok(d) => {
                            let members = d.survivors(n);
                            let key = (members.clone(), d.payload.clone());
                            board
                                .lock()
                                .unwrap()
                                .entry(key.clone())
                                .or_default()
                                .insert(me);
                            let until = Instant::now() + Duration::from_secs(2);
                            let built = loop {
                                if board.lock().unwrap()[&key].len() == members.len() {
                                    break true;
                                }
                                if members.iter().any(|&m| fabric.is_dead(m))
                                    || Instant::now() > until
                                {
                                    break false;
                                }
                                std::thread::sleep(Duration::from_millis(1));
                            };
                            if built {
                                return Some(Ok(d));
                            }
                            if fabric.is_dead(me) {
                                return None;
                            }
                        }
                        Err(AgreeError::Excluded { .. }) if fabric.is_dead(me) => return None,
                        Err(e) => return Some(Err(e)),
                    }
                }
                Some(Err(AgreeError::Excluded { by: None }))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Every survivor decided, and the same thing, excluding every dead rank and the known ones.
fn check_agreed(
    n: usize,
    known: &[usize],
    outcomes: &[Option<Result<Decision, AgreeError>>],
    fabric_deaths: &[Option<usize>],
) -> Decision {
    let decisions: Vec<&Decision> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(r, o)| match o {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => panic!("rank {r} failed: {e} (n {n}, deaths {fabric_deaths:?})"),
        })
        .collect();
    assert!(!decisions.is_empty(), "nobody survived");
    for d in &decisions {
        assert_eq!(
            *d, decisions[0],
            "two different decisions (n {n}, deaths {fabric_deaths:?}): {outcomes:?}"
        );
    }
    let d = decisions[0].clone();
    for &k in known {
        assert!(d.dead.contains(&k), "known-dead rank {k} is not in {d:?}");
    }
    for (r, o) in outcomes.iter().enumerate() {
        if known.contains(&r) {
            continue;
        }
        // A live rank is never dropped; a rank dead from the start always is; one that died
        // during the protocol may be in or out (it may have died after the new communicator
        // was built), as long as every survivor says the same.
        if o.is_some() {
            assert!(!d.dead.contains(&r), "live rank {r} was dropped: {d:?}");
        }
        if fabric_deaths.get(r) == Some(&Some(0)) {
            assert!(
                d.dead.contains(&r),
                "rank {r} was dead from the start: {d:?}"
            );
        }
    }
    assert_eq!(d.coordinator, d.survivors(n)[0]);
    assert!(d
        .payload
        .starts_with(format!("store of {},", d.coordinator).as_bytes()));
    d
}

#[test]
fn with_no_failure_everyone_agrees_on_the_ranks_named() {
    for n in 1..=5 {
        let out = run(n, &[], &[]);
        let d = check_agreed(n, &[], &out, &[]);
        assert!(d.dead.is_empty());
        if n > 2 {
            let out = run(n, &[1], &[]);
            let d = check_agreed(n, &[1], &out, &[]);
            assert_eq!(d.dead, BTreeSet::from([1]));
        }
    }
}

#[test]
fn dead_ranks_are_found_whoever_they_are() {
    for n in 2..=5 {
        for victim in 0..n {
            let mut deaths = vec![None; n];
            deaths[victim] = Some(0);
            let out = run(n, &[], &deaths);
            let d = check_agreed(n, &[], &out, &deaths);
            assert_eq!(d.dead, BTreeSet::from([victim]));
        }
    }
}

#[test]
fn a_rank_dying_at_any_message_of_the_agreement_never_splits_the_survivors() {
    // Each victim dies after k of its sends, for every k up to past the end of the protocol;
    // the coordinator (rank 0) dying part-way through its decision is the hard case.
    for n in 2..=5 {
        for victim in 0..n {
            for k in 1..=n + 1 {
                let mut deaths = vec![None; n];
                deaths[victim] = Some(k);
                let out = run(n, &[], &deaths);
                check_agreed(n, &[], &out, &deaths);
            }
        }
    }
}

#[test]
fn two_ranks_dying_during_the_agreement_never_split_the_survivors() {
    for n in 3..=5 {
        for a in 0..n {
            for b in a + 1..n {
                for (ka, kb) in [(0, 0), (1, 1), (1, 2), (2, 1), (0, 2), (3, 1)] {
                    let mut deaths = vec![None; n];
                    deaths[a] = Some(ka);
                    deaths[b] = Some(kb);
                    let out = run(n, &[], &deaths);
                    check_agreed(n, &[], &out, &deaths);
                }
            }
        }
    }
}

#[test]
fn random_deaths_of_up_to_all_but_one_rank_never_split_the_survivors() {
    // A fixed pseudo-random sweep (xorshift): 1 to n - 1 ranks die, each after a random
    // number of its sends (0: before it starts).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    for _ in 0..300 {
        let n = 2 + next(6) as usize;
        let victims = 1 + next(n as u64 - 1) as usize;
        let mut deaths = vec![None; n];
        for _ in 0..victims {
            let v = next(n as u64) as usize;
            deaths[v] = Some(next(2 * n as u64) as usize);
        }
        if deaths.iter().all(Option::is_some) {
            continue;
        }
        let out = run(n, &[], &deaths);
        check_agreed(n, &[], &out, &deaths);
    }
}

/// A network partition (no rank exited; each side finds the other unreachable): only the
/// side with more than half of the ranks, or half with the lowest rank, decides; the other
/// fails with `Minority` instead of forming a second communicator. Both sides used to go on
/// (found by a network-fault campaign, 2026-12-08).
#[test]
fn across_a_partition_only_the_majority_decides() {
    use crate::transport::Mesh;
    // (world size, one side): the expected winner is the side holding a majority, or half
    // with rank 0.
    for (n, side) in [
        (2, vec![0]),
        (4, vec![0, 1]),
        (4, vec![0, 3]),
        (5, vec![0, 1]),
        (5, vec![2]),
        (3, vec![1, 2]),
    ] {
        let other: Vec<usize> = (0..n).filter(|r| !side.contains(r)).collect();
        let wins = |s: &[usize]| 2 * s.len() > n || (2 * s.len() == n && s.contains(&0));
        let winner = if wins(&side) { &side } else { &other };
        // Each side may also name a rank of the other as dropped (as torch's `shrink_group`
        // always does): that must not let both go on.
        for naming in [false, true] {
            let fabric = MemMeshFabric::new(n);
            fabric.partition(&side);
            let (side_c, other_c) = (side.clone(), other.clone());
            let handles: Vec<_> = (0..n)
                .map(|r| {
                    let mut mesh = fabric.mesh(r, None);
                    let named: Vec<usize> = match (naming, side_c.contains(&r)) {
                        (false, _) => vec![],
                        (true, true) => vec![other_c[0]],
                        (true, false) => vec![side_c[0]],
                    };
                    std::thread::spawn(move || {
                        let me = mesh.rank();
                        let payload = format!("store of {me}").into_bytes();
                        Agreement::new(named).run(&mut mesh, &payload, Duration::from_secs(5))
                    })
                })
                .collect();
            for (r, h) in handles.into_iter().enumerate() {
                let out = h.join().unwrap();
                let ctx = format!("n {n}, sides {side:?} | {other:?}, naming {naming}, rank {r}");
                if winner.contains(&r) {
                    let d = out.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    assert_eq!(d.survivors(n), *winner, "{ctx}");
                } else {
                    match out {
                        Err(AgreeError::Minority {
                            reachable,
                            unreachable,
                            alive,
                        }) => {
                            assert_eq!(alive, n, "{ctx}");
                            assert!(!reachable.is_empty() && reachable.contains(&r), "{ctx}");
                            assert_eq!(&unreachable, winner, "{ctx}");
                        }
                        other => panic!("{ctx}: the minority must not decide: {other:?}"),
                    }
                }
            }
        }
    }
}

/// Ranks that exited do not count: one survivor of two, when the other is gone (killed),
/// decides, whichever rank it is; so does the last of five.
#[test]
fn survivors_of_deaths_decide_however_few() {
    for (n, deaths) in [
        (2, vec![Some(0), None]),
        (2, vec![None, Some(0)]),
        (5, vec![Some(0), Some(0), None, Some(0), Some(0)]),
    ] {
        let out = run(n, &[], &deaths);
        check_agreed(n, &[], &out, &deaths);
    }
}
