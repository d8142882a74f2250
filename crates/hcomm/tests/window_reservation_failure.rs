//! A rank that cannot reserve its part of a collective window makes every rank fail at once,
//! naming it and the cause, instead of leaving the others to time out waiting for its part.
//!
//! Its own test binary: the failure is made real with a process-wide file size limit
//! (`RLIMIT_FSIZE`), under which the larger part's memory file cannot be sized, and that limit
//! must not reach any other test.

use hcomm::testing::run_threads;
use hcomm::Error;
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::signal::{signal, SigHandler, Signal};
use std::time::Duration;

#[test]
fn a_rank_that_cannot_reserve_its_part_is_named_by_every_rank() {
    // SAFETY: ignoring a signal installs no handler code; exceeding the limit must give EFBIG
    // instead of SIGXFSZ's default, which ends the process.
    unsafe { signal(Signal::SIGXFSZ, SigHandler::SigIgn) }.unwrap();
    let (_, hard) = getrlimit(Resource::RLIMIT_FSIZE).unwrap();
    setrlimit(Resource::RLIMIT_FSIZE, 1 << 20, hard).unwrap();
    let timeout = Duration::from_secs(20);
    let res = run_threads(2, timeout, |c| {
        // Rank 1's part is larger than a file may be; rank 0's fits.
        let bytes = if c.rank() == 1 { 8 << 20 } else { 4096 };
        match c.alloc_window(bytes) {
            Err(Error::Io { .. }) if c.rank() == 1 => {}
            // Not fatal on either rank: nothing was kept.
            Err(Error::InvalidArgument { msg, .. }) if c.rank() == 0 => assert!(
                msg.contains("rank 1 could not reserve its part") && msg.contains("alloc_window"),
                "{msg}"
            ),
            other => panic!("rank {}: {:?}", c.rank(), other.err()),
        }
        // The communicator is unharmed.
        let w = c.alloc_window(64)?;
        assert_eq!(w.len(), 2);
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}
