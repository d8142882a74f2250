//! Non-blocking forms of every operation: each hands its buffers to the communicator's
//! progress engine ([`crate::engine`]) and returns a [`Work`] at once; `wait()` gives the
//! buffers back with the result.
//!
//! Operations on one communicator run in the order they were issued, blocking and
//! non-blocking alike (a blocking call issued after an asynchronous one waits for it), except
//! point-to-point: `send_async` / `recv_async` post messages that progress together in the
//! background, in any order ([`crate::comm::posted`]). Use
//! several communicators ([`Communicator::split`], [`Communicator::new_group`]) for operations
//! that must make progress independently.
//!
//! The asynchronous methods take `self: &Arc<Communicator>`: the operation may outlive the
//! caller's borrow, so it keeps the communicator alive itself.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use crate::base::dtype::{Element, ReduceOp};
use crate::base::error::{Error, Result};
use crate::comm::Communicator;
use crate::engine::{panic_message, Slot, Work};

impl Communicator {
    /// Run `f` on this communicator's progress engine, after every operation issued before it
    /// and before every operation issued after it; returns at once.
    ///
    /// `f` may run several operations on the communicator it is given; they run as one unit.
    /// Every `*_async` method is this with one blocking call inside. A panic in `f` becomes
    /// [`Error::Panicked`]. Issued from inside such a unit (by `f` itself, through another
    /// handle on the same communicator), an asynchronous operation is part of that unit: it
    /// runs at once and its [`Work`] is already complete.
    ///
    /// ```no_run
    /// # use std::sync::Arc;
    /// # use hcomm::{Communicator, ReduceOp};
    /// let comm = Arc::new(Communicator::from_env()?);
    /// let work = comm.run_async("norm", |c| {
    ///     let mut x = [3.0f32];
    ///     c.all_reduce_in_place(&mut x, ReduceOp::Max)?;
    ///     Ok(x[0])
    /// });
    /// let max = work.wait()?;
    /// # Ok::<(), hcomm::Error>(())
    /// ```
    pub fn run_async<R, F>(self: &Arc<Self>, op: &'static str, f: F) -> Work<R>
    where
        R: Send + 'static,
        F: FnOnce(&Communicator) -> Result<R> + Send + 'static,
    {
        let slot = Slot::new();
        let done = slot.clone();
        let comm = self.clone();
        let issue = self.traces().then(|| self.trace_issue());
        let job = Box::new(move || {
            let run = AssertUnwindSafe(|| crate::trace::issued_as(issue, || f(&comm)));
            let r = std::panic::catch_unwind(run).unwrap_or_else(|p| {
                Err(Error::Panicked {
                    op,
                    msg: panic_message(&*p),
                })
            });
            // Release the communicator before reporting, so a caller that drops its last
            // handle right after `wait()` tears it down on its own thread.
            drop(comm);
            done.complete(r);
        });
        if let Err(e) = self.engine().submit(self.id(), job) {
            slot.complete(Err(e));
        }
        Work::new(slot, op)
    }

    /// Non-blocking [`all_reduce_in_place`](Self::all_reduce_in_place).
    pub fn all_reduce_async<T, B>(self: &Arc<Self>, mut buf: B, op: ReduceOp) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("all_reduce", move |c| {
            c.all_reduce_in_place(buf.as_mut(), op)?;
            Ok(buf)
        })
    }

    /// Non-blocking [`broadcast`](Self::broadcast).
    pub fn broadcast_async<T, B>(self: &Arc<Self>, mut buf: B, root: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("broadcast", move |c| {
            c.broadcast(buf.as_mut(), root)?;
            Ok(buf)
        })
    }

    /// Non-blocking [`reduce_in_place`](Self::reduce_in_place).
    pub fn reduce_async<T, B>(self: &Arc<Self>, mut buf: B, op: ReduceOp, root: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("reduce", move |c| {
            c.reduce_in_place(buf.as_mut(), op, root)?;
            Ok(buf)
        })
    }

    /// Non-blocking [`all_gather`](Self::all_gather); returns `(send, recv)`.
    pub fn all_gather_async<T, S, B>(self: &Arc<Self>, send: S, mut recv: B) -> Work<(S, B)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("all_gather", move |c| {
            c.all_gather(send.as_ref(), recv.as_mut())?;
            Ok((send, recv))
        })
    }

    /// Non-blocking [`reduce_scatter`](Self::reduce_scatter); returns `(send, recv)`.
    pub fn reduce_scatter_async<T, S, B>(
        self: &Arc<Self>,
        send: S,
        mut recv: B,
        op: ReduceOp,
    ) -> Work<(S, B)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("reduce_scatter", move |c| {
            c.reduce_scatter(send.as_ref(), recv.as_mut(), op)?;
            Ok((send, recv))
        })
    }

    /// Non-blocking [`gather`](Self::gather); returns `(send, recv)`.
    pub fn gather_async<T, S, B>(
        self: &Arc<Self>,
        send: S,
        mut recv: B,
        root: usize,
    ) -> Work<(S, B)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("gather", move |c| {
            c.gather(send.as_ref(), recv.as_mut(), root)?;
            Ok((send, recv))
        })
    }

    /// Non-blocking [`scatter`](Self::scatter); returns `(send, recv)`.
    pub fn scatter_async<T, S, B>(
        self: &Arc<Self>,
        send: S,
        mut recv: B,
        root: usize,
    ) -> Work<(S, B)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("scatter", move |c| {
            c.scatter(send.as_ref(), recv.as_mut(), root)?;
            Ok((send, recv))
        })
    }

    /// Non-blocking [`all_to_all`](Self::all_to_all); returns `(send, recv)`.
    pub fn all_to_all_async<T, S, B>(self: &Arc<Self>, send: S, mut recv: B) -> Work<(S, B)>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        B: AsMut<[T]> + Send + 'static,
    {
        self.run_async("all_to_all", move |c| {
            c.all_to_all(send.as_ref(), recv.as_mut())?;
            Ok((send, recv))
        })
    }

    /// Non-blocking [`barrier`](Self::barrier).
    pub fn barrier_async(self: &Arc<Self>) -> Work<()> {
        self.run_async("barrier", |c| c.barrier())
    }

    /// Non-blocking [`signal`](Self::signal).
    pub fn signal_async(self: &Arc<Self>, peer: usize, tag: u32) -> Work<()> {
        self.run_async("signal", move |c| c.signal(peer, tag))
    }

    /// Non-blocking [`wait_signal`](Self::wait_signal).
    pub fn wait_signal_async(self: &Arc<Self>, peer: usize, tag: u32) -> Work<()> {
        self.run_async("wait_signal", move |c| c.wait_signal(peer, tag))
    }
}
