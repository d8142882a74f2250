//! The progress engine: every operation on a communicator, blocking or not, takes a *turn*
//! from one ticket dispenser and runs only when its turn comes, so operations complete in the
//! order they were issued (stream semantics) and ranks never disagree on which operation a
//! message belongs to.
//!
//! * A blocking call takes a ticket and runs on the caller's thread when its turn comes
//!   (no thread hop, so small-message latency is unchanged when nothing is queued).
//! * An asynchronous call takes a ticket at issue time, queues a job and returns a [`Work`]
//!   at once; one engine thread per communicator (started on first use) runs the jobs in
//!   ticket order, each when its turn comes.
//! * An asynchronous call issued by the holder of the current turn (a job issuing more work
//!   on its own communicator) is part of the operation that holds it: it runs at once.
//!
//! Both forms run the same operation code; a blocking call is "take a turn, run, release",
//! an asynchronous one is the same on the engine thread with [`Work`] carrying the result.
//! Different communicators have different dispensers and engine threads, so they make
//! progress independently.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use crate::base::error::{Error, Result};

thread_local! {
    /// The turn dispensers whose current turn this thread holds (by address), so that an
    /// operation built from other operations (a job calling a collective) does not wait for
    /// itself.
    static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// A ticket dispenser: turn `n` runs after turns `0..n` have finished.
#[derive(Default)]
pub(crate) struct Turns {
    next: AtomicU64,
    serving: AtomicU64,
    /// Threads waiting (or about to wait) for their turn: a finished turn wakes them only when
    /// there are any (a condvar's notify is a syscall even with nobody waiting).
    waiters: AtomicUsize,
    lock: Mutex<()>,
    changed: Condvar,
}

/// The current turn, held until dropped. It borrows its dispenser (every turn is scoped to
/// a call, or to one job on the engine thread): no reference count to touch per operation.
pub(crate) struct TurnGuard<'a> {
    turns: &'a Turns,
    ticket: u64,
}

impl Turns {
    fn key(&self) -> usize {
        self as *const Turns as usize
    }

    /// True if the calling thread holds the current turn.
    fn held_here(&self) -> bool {
        let key = self.key();
        HELD.with(|h| h.borrow().contains(&key))
    }

    fn ticket(&self) -> u64 {
        self.next.fetch_add(1, Ordering::AcqRel)
    }

    /// Wait until turn `ticket` comes, then hold it on this thread.
    fn wait_for(&self, ticket: u64) -> TurnGuard<'_> {
        if self.serving.load(Ordering::Acquire) != ticket {
            let mut g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            // Dekker with the finishing turn (store, fence, read the count): either this check
            // sees the new turn, or the finisher sees a waiter and notifies under the lock,
            // which this thread holds until it waits (model: tests/shm_model.rs).
            self.waiters.fetch_add(1, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::SeqCst);
            while self.serving.load(Ordering::Acquire) != ticket {
                g = self.changed.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            self.waiters.fetch_sub(1, Ordering::Relaxed);
        }
        let key = self.key();
        HELD.with(|h| h.borrow_mut().push(key));
        TurnGuard {
            turns: self,
            ticket,
        }
    }

    /// Take a turn for an operation on the calling thread: `None` when this thread already
    /// holds the current turn (the operation is part of a larger one).
    pub(crate) fn enter(&self) -> Option<TurnGuard<'_>> {
        if self.held_here() {
            return None;
        }
        let ticket = self.ticket();
        Some(self.wait_for(ticket))
    }
}

impl Drop for TurnGuard<'_> {
    fn drop(&mut self) {
        let key = self.turns.key();
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|&k| k == key) {
                h.remove(i);
            }
        });
        self.turns.serving.store(self.ticket + 1, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.turns.waiters.load(Ordering::Relaxed) > 0 {
            // Taking the lock orders this store before a waiter's check-then-sleep.
            let _g = self.turns.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.turns.changed.notify_all();
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<(u64, Job)>,
    closed: bool,
}

/// One communicator's progress engine: its turns and (once an asynchronous operation was
/// issued) its engine thread.
#[derive(Default)]
pub(crate) struct Engine {
    pub(crate) turns: Arc<Turns>,
    queue: Arc<Queue>,
    thread: Mutex<Option<(ThreadId, JoinHandle<()>)>>,
}

impl Engine {
    /// Queue `job` to run on the engine thread in its turn (taken now).
    ///
    /// Issued by the holder of the current turn (a job, or an operation built from others),
    /// the job is part of that operation: it runs at once, on this thread. Queued, it would
    /// wait for the turn its issuer holds, and an issuer waiting for it would never return.
    pub(crate) fn submit(&self, name: &str, job: Job) -> Result<()> {
        if self.turns.held_here() {
            job();
            return Ok(());
        }
        self.ensure_thread(name)?;
        let mut st = self.queue.state.lock().unwrap_or_else(|p| p.into_inner());
        // The ticket is taken under the queue lock, so the queue is in ticket order.
        let ticket = self.turns.ticket();
        st.jobs.push_back((ticket, job));
        drop(st);
        self.queue.ready.notify_one();
        Ok(())
    }

    fn ensure_thread(&self, name: &str) -> Result<()> {
        let mut t = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_some() {
            return Ok(());
        }
        let queue = self.queue.clone();
        let turns = self.turns.clone();
        let handle = std::thread::Builder::new()
            .name(format!("hcomm-engine-{name}"))
            .spawn(move || engine_loop(&queue, &turns))
            .map_err(|e| {
                Error::io(
                    crate::base::error::OpContext {
                        op: "engine",
                        seq: 0,
                    },
                    None,
                    format!("cannot start the progress thread: {e}"),
                )
            })?;
        *t = Some((handle.thread().id(), handle));
        Ok(())
    }
}

fn engine_loop(queue: &Queue, turns: &Arc<Turns>) {
    loop {
        let (ticket, job) = {
            let mut st = queue.state.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(j) = st.jobs.pop_front() {
                    break j;
                }
                if st.closed {
                    return;
                }
                st = queue.ready.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let turn = turns.wait_for(ticket);
        // Jobs catch their own panics (see `Communicator::run_async`).
        job();
        drop(turn);
    }
}

impl Drop for Engine {
    /// Let the engine thread finish the queued jobs and exit. The communicator is dropped on
    /// the engine thread itself when a job held its last reference: then the thread is
    /// detached instead of joined (it exits right after that job).
    fn drop(&mut self) {
        self.queue
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .closed = true;
        self.queue.ready.notify_all();
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((id, handle)) = thread {
            if id != std::thread::current().id() {
                let _ = handle.join();
            }
        }
    }
}

/// Where an asynchronous operation's result lands.
pub(crate) struct Slot<R> {
    result: Mutex<Option<Result<R>>>,
    done: AtomicBool,
    finished: Condvar,
}

impl<R> Slot<R> {
    pub(crate) fn new() -> Arc<Slot<R>> {
        Arc::new(Slot {
            result: Mutex::new(None),
            done: AtomicBool::new(false),
            finished: Condvar::new(),
        })
    }

    pub(crate) fn complete(&self, r: Result<R>) {
        let mut g = self.result.lock().unwrap_or_else(|p| p.into_inner());
        *g = Some(r);
        self.done.store(true, Ordering::Release);
        self.finished.notify_all();
    }
}

/// A handle on an asynchronous operation (`*_async` methods of
/// [`Communicator`](crate::Communicator)); [`wait`](Work::wait) returns its result, including
/// the buffers that were handed to the operation.
///
/// The buffers belong to the operation until then, so they cannot be read or written while it
/// is in flight:
///
/// ```compile_fail,E0382
/// # fn f(comm: std::sync::Arc<hcomm::Communicator>) -> hcomm::Result<()> {
/// let grad = vec![1.0f32; 1024];
/// let work = comm.all_reduce_async(grad, hcomm::ReduceOp::Sum);
/// let first = grad[0]; // error[E0382]: borrow of moved value: `grad`
/// let grad = work.wait()?;
/// # Ok(()) }
/// ```
///
/// ```compile_fail,E0597
/// # fn f(comm: std::sync::Arc<hcomm::Communicator>) -> hcomm::Result<()> {
/// let mut grad = vec![1.0f32; 1024];
/// // Borrowed buffers are refused: the operation outlives any borrow.
/// let work = comm.all_reduce_async(&mut grad[..], hcomm::ReduceOp::Sum);
/// # Ok(()) }
/// ```
///
/// Dropping an unfinished `Work` does not cancel or wait for the operation (the other ranks
/// take part in it, so it must run): it still runs in its turn, and its buffers are freed when
/// it finishes. An error it ends with still poisons the communicator, so later calls report it.
#[must_use = "an asynchronous operation's errors and buffers come back through wait()"]
pub struct Work<R> {
    slot: Arc<Slot<R>>,
    op: &'static str,
}

impl<R> Work<R> {
    pub(crate) fn new(slot: Arc<Slot<R>>, op: &'static str) -> Work<R> {
        Work { slot, op }
    }

    /// The operation's name (`all_reduce`, `send`, …).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// True once the operation has finished (successfully or not). Never blocks.
    pub fn is_completed(&self) -> bool {
        self.slot.done.load(Ordering::Acquire)
    }

    /// A handle that tells whether this operation has finished, usable after the `Work` was
    /// moved into a waiting thread (for bindings that answer `is_completed` while another
    /// thread waits).
    pub fn completion(&self) -> Completion
    where
        R: Send + 'static,
    {
        let slot = self.slot.clone();
        Completion(Arc::new(move || slot.done.load(Ordering::Acquire)))
    }

    /// Same as [`is_completed`](Self::is_completed) (MPI's `MPI_Test`, torch's `Work.is_completed`).
    pub fn test(&self) -> bool {
        self.is_completed()
    }

    /// Wait for the operation and return its result.
    pub fn wait(mut self) -> Result<R> {
        self.wait_until(None)
    }

    /// Wait at most `d`. On [`Error::WaitTimeout`] the operation is still in flight and this
    /// handle stays valid: wait again, or abort the communicator. After a result was returned,
    /// further calls return [`Error::AlreadyTaken`].
    pub fn wait_timeout(&mut self, d: Duration) -> Result<R> {
        self.wait_until(Some(d))
    }

    fn wait_until(&mut self, limit: Option<Duration>) -> Result<R> {
        let start = Instant::now();
        // Spin a little first: a condvar wake-up costs tens of microseconds on an idle vCPU.
        let spin_until = start + Duration::from_micros(20);
        while !self.is_completed() && Instant::now() < spin_until {
            std::hint::spin_loop();
        }
        let mut g = self.slot.result.lock().unwrap_or_else(|p| p.into_inner());
        while !self.slot.done.load(Ordering::Acquire) {
            match limit {
                None => {
                    g = self
                        .slot
                        .finished
                        .wait(g)
                        .unwrap_or_else(|p| p.into_inner())
                }
                Some(d) => {
                    let waited = start.elapsed();
                    if waited >= d {
                        return Err(Error::WaitTimeout {
                            op: self.op,
                            waited,
                        });
                    }
                    g = self
                        .slot
                        .finished
                        .wait_timeout(g, d - waited)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        g.take().unwrap_or(Err(Error::AlreadyTaken { op: self.op }))
    }
}

/// Whether an asynchronous operation has finished (see [`Work::completion`]).
#[derive(Clone)]
pub struct Completion(Arc<dyn Fn() -> bool + Send + Sync>);

impl Completion {
    /// True once the operation has finished (successfully or not). Never blocks.
    pub fn is_completed(&self) -> bool {
        (self.0)()
    }
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Completion")
            .field(&self.is_completed())
            .finish()
    }
}

impl<R> std::fmt::Debug for Work<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("completed", &self.is_completed())
            .finish()
    }
}

/// A panic payload as text.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_run_in_ticket_order_across_threads() {
        let turns = Arc::new(Turns::default());
        let log = Arc::new(Mutex::new(Vec::new()));
        let tickets: Vec<u64> = (0..8).map(|_| turns.ticket()).collect();
        let handles: Vec<_> = tickets
            .into_iter()
            .rev()
            .map(|t| {
                let (turns, log) = (turns.clone(), log.clone());
                std::thread::spawn(move || {
                    let g = turns.wait_for(t);
                    log.lock().unwrap().push(t);
                    drop(g);
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(*log.lock().unwrap(), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn nested_entry_on_the_holding_thread_does_not_wait() {
        let turns = Arc::new(Turns::default());
        let outer = turns.enter();
        assert!(outer.is_some());
        assert!(turns.enter().is_none());
        drop(outer);
        assert!(turns.enter().is_some());
    }

    #[test]
    fn wait_timeout_then_wait() {
        let slot = Slot::<u32>::new();
        let mut w = Work::new(slot.clone(), "test");
        assert!(matches!(
            w.wait_timeout(Duration::from_millis(5)),
            Err(Error::WaitTimeout { .. })
        ));
        assert!(!w.test());
        slot.complete(Ok(7));
        assert!(w.is_completed());
        assert_eq!(w.wait_timeout(Duration::from_secs(1)).unwrap(), 7);
        assert!(matches!(
            w.wait_timeout(Duration::from_millis(1)),
            Err(Error::AlreadyTaken { .. })
        ));
    }
}
