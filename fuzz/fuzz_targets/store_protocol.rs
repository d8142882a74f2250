//! Fuzz target: `hcomm::fuzzing::store_protocol` (see that function for what it checks).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hcomm::fuzzing::store_protocol(data);
});
