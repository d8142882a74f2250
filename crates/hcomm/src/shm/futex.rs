//! Sleeping on a 32-bit word in shared memory until another process changes it.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;

/// Sleep while `*word == expected`, at most `timeout` (shared, not process-private, futex).
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    // EAGAIN (value changed), ETIMEDOUT and EINTR all mean "look again".
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

/// Wake every sleeper on `word`.
pub fn wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}
