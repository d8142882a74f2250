//! An operation's deadline, read from the clock only when a wait first needs it.
//!
//! A small operation that never has to wait (an 8-byte all-reduce over shared memory whose
//! peers are already there) would otherwise spend a visible part of its cost reading the
//! clock: on this project's VMs a read is ~20 ns, a sixth of such a call. The deadline is
//! therefore `timeout` after the moment the operation first had to wait (its first blocking
//! wait, or its first transport call), not after it was issued; the difference is the time
//! the operation made progress without waiting, which is what a timeout is not about.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// When an operation began, as far as its deadline is concerned: unset until a wait asks.
#[derive(Debug, Default)]
pub struct OpStart(Cell<Option<Instant>>);

impl OpStart {
    /// Not read yet.
    pub fn unset() -> OpStart {
        OpStart(Cell::new(None))
    }

    /// Forget the previous operation's start.
    pub fn clear(&self) {
        self.0.set(None);
    }

    /// The start, if something read it.
    pub fn get(&self) -> Option<Instant> {
        self.0.get()
    }

    /// The start, set to `now()` if nothing read it yet.
    pub fn get_or(&self, now: impl FnOnce() -> Instant) -> Instant {
        match self.0.get() {
            Some(t) => t,
            None => {
                let t = now();
                self.0.set(Some(t));
                t
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Start<'a> {
    Lazy(&'a OpStart),
    Fixed(Instant),
}

/// When an operation gives up: its timeout after its (lazily read) start.
#[derive(Clone, Copy, Debug)]
pub struct Deadline<'a> {
    start: Start<'a>,
    timeout: Duration,
}

impl<'a> Deadline<'a> {
    /// `timeout` after `start` is first read.
    pub fn lazy(start: &'a OpStart, timeout: Duration) -> Deadline<'a> {
        Deadline {
            start: Start::Lazy(start),
            timeout,
        }
    }

    /// `timeout` after `start`.
    pub fn fixed(start: Instant, timeout: Duration) -> Deadline<'static> {
        Deadline {
            start: Start::Fixed(start),
            timeout,
        }
    }

    /// The deadline (reads the clock if the start was not read yet).
    pub fn at(&self) -> Instant {
        self.at_from(Instant::now)
    }

    /// The deadline, taking the start from `now` if it was not read yet (for a caller that
    /// has just read the clock anyway).
    pub fn at_from(&self, now: impl FnOnce() -> Instant) -> Instant {
        let start = match self.start {
            Start::Lazy(s) => s.get_or(now),
            Start::Fixed(t) => t,
        };
        start + self.timeout
    }

    /// The operation's timeout (for messages).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_is_read_once_when_first_asked() {
        let start = OpStart::unset();
        let d = Deadline::lazy(&start, Duration::from_secs(2));
        assert!(start.get().is_none(), "building a deadline reads no clock");
        let t0 = Instant::now();
        let first = d.at_from(|| t0);
        assert_eq!(first, t0 + Duration::from_secs(2));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(d.at(), first, "later reads keep the first start");
        assert_eq!(start.get(), Some(t0));
        start.clear();
        assert!(start.get().is_none());
        assert!(d.at() > first, "the next operation starts later");
        let f = Deadline::fixed(t0, Duration::from_millis(5));
        assert_eq!(f.at_from(|| unreachable!()), t0 + Duration::from_millis(5));
        assert_eq!(f.timeout(), Duration::from_millis(5));
    }
}
