//! Fuzz target: `hcomm::fuzzing::frame` (see that function for what it checks).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hcomm::fuzzing::frame(data);
});
