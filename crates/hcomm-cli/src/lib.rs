//! The `hcomm` command: launcher (`run`), main demo (`demo`), correctness sweep (`check`) and
//! benchmark (`bench`). The modules are a library so that tests can drive them directly.

pub mod bench;
pub mod check;
pub mod compression_bench;
pub mod cross_core;
pub mod demo;
pub mod doctor;
pub mod fusion_bench;
pub mod plot;
pub mod simulate;
pub mod trace_tool;
pub mod workers;

/// The launcher, which lives in `hcomm-launch` (shared with the Python extension); kept here
/// under its old path.
pub use hcomm_launch::launch;
