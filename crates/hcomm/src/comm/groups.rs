//! Sub-communicators: [`Communicator::split`] (collective over the parent) and
//! [`Communicator::new_group`] (the members only), both built through `sub_communicator`,
//! which inherits the parent's store, settings and forced algorithms.
//!
//! It may use the communicator's state and collectives (the split's all-gather), the
//! rendezvous store, and [`super::build`] and [`super::join`].

use super::build::BuildArgs;
use super::join::all_built_key;
use super::join::store_connect_error;
use super::Communicator;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::bootstrap::store::StoreClient;
use std::collections::HashSet;
use std::time::Instant;

impl Communicator {
    /// Split into sub-communicators (collective over this communicator): ranks passing the
    /// same `color` form one, ordered by (`key`, rank). `None` as color leaves this rank out
    /// (returns `Ok(None)`).
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        // One turn for the whole split, so that its number is the same on every rank even when
        // several threads split this communicator.
        let _turn = self.engine.turns.enter();
        let mine = [color.map_or(-1i64, |c| c as i64), key];
        let mut all = vec![0i64; 2 * self.size];
        // Internal: never subject to the fault-injection hook.
        let counts = vec![2; self.size];
        self.all_gather_v_inner(
            Some(bytemuck::cast_slice(&mine)),
            bytemuck::cast_slice_mut(&mut all),
            &counts,
            DType::I64,
            false,
            false,
        )?;
        let split_no = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inner.splits += 1;
            inner.splits
        };
        let id_of = |c: i64| format!("{}/split{split_no}/c{c}", self.comm_id);
        // The rank holding the store waits until every new communicator is built, its own
        // (see `build`) and the others (it may be in none of them), so that dropping its
        // communicators at once cannot take the store away from ranks still setting up.
        let wait_for_the_others = |own: Option<i64>| -> Result<()> {
            if self._server.is_none() {
                return Ok(());
            }
            let deadline = Instant::now() + self.timeout();
            let colors: std::collections::BTreeSet<i64> = (0..self.size)
                .map(|r| all[2 * r])
                .filter(|&c| c >= 0)
                .collect();
            for c in colors.into_iter().filter(|&c| Some(c) != own) {
                self.store_get(&all_built_key(&id_of(c)), deadline)?;
            }
            Ok(())
        };
        let Some(color) = color else {
            wait_for_the_others(None)?;
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..self.size)
            .filter(|&r| all[2 * r] == color as i64)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort();
        let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        let sub = self.sub_communicator(id_of(color as i64), &ranks)?;
        wait_for_the_others(Some(color as i64))?;
        Ok(Some(sub))
    }

    /// A communicator of `ranks` (in that order: the new rank of `ranks[i]` is `i`). Only the
    /// members call it, each with the same list; calling it again with the same list makes a
    /// new, independent communicator.
    ///
    /// Its setup goes through the job's rendezvous store, which rank 0 of the job holds: rank 0
    /// must keep this communicator (or one made from it) until the group's members have it.
    /// [`split`](Self::split), which every rank calls, waits for that itself.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Communicator> {
        // One turn for the whole call (see `split`).
        let _turn = self.engine.turns.enter();
        let seq = self.peek_seq();
        let mut seen = HashSet::new();
        for &r in ranks {
            if r >= self.size {
                return Err(Error::invalid(
                    "new_group",
                    seq,
                    format!(
                        "rank {r} is out of range for a communicator of {} ranks",
                        self.size
                    ),
                ));
            }
            if !seen.insert(r) {
                return Err(Error::invalid(
                    "new_group",
                    seq,
                    format!("rank {r} is listed twice"),
                ));
            }
        }
        if !seen.contains(&self.rank) {
            return Err(Error::invalid(
                "new_group",
                seq,
                format!("this rank ({}) is not in the group {ranks:?}", self.rank),
            ));
        }
        let n = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let c = inner.groups.entry(ranks.to_vec()).or_insert(0);
            *c += 1;
            *c
        };
        let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        let id = format!("{}/group[{}]#{n}", self.comm_id, list.join(","));
        self.sub_communicator(id, ranks)
    }

    fn sub_communicator(&self, comm_id: String, ranks: &[usize]) -> Result<Communicator> {
        let rank = ranks.iter().position(|&r| r == self.rank).expect("member");
        let timeout = self.timeout();
        let store = StoreClient::connect(&self.store_addr, timeout, self.token.as_ref())
            .map_err(|e| store_connect_error("", e))?;
        // The sub-communicator accepts its links on this one's listener: no new port, no new
        // accept thread (connections name their communicator in the handshake).
        let (ip, listener) = {
            let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            (inner.links.listen_ip(), inner.links.shared_listener())
        };
        // The parent's knobs, with the algorithms it forces now.
        let tuning = self.inherited_tuning();
        let mut c = Self::build(BuildArgs {
            comm_id,
            rank,
            size: ranks.len(),
            store,
            store_addr: self.store_addr.clone(),
            server: self._server.clone(),
            ip,
            listener: Some(listener),
            host_id: self.host_id.clone(),
            timeout,
            local_size_hint: None,
            tuning,
            transport: self.transport,
            token: self.token.clone(),
            nsocks: self.nsocks,
            tracer: self.tracer(),
        })?;
        c.thresholds = self.thresholds;
        Ok(c)
    }
}
