//! Fuzz target: `hcomm::fuzzing::handshake` (see that function for what it checks).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hcomm::fuzzing::handshake(data);
});
