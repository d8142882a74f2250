//! What hcomm's programs share beyond the library: the local launcher ([`launch()`], behind
//! `hcomm run` and `python -m hcomm`, through the extension's `_hcomm.launch`) and the logging set-up
//! ([`init_logging`]) that the `hcomm` command and the Python extension install at start.

pub mod launch;
mod logging;

pub use launch::{cpus_for_rank, launch, launch_with_output, Bind, LaunchError, LaunchSpec};
pub use logging::init_logging;
