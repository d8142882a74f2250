//! The local launcher ([`launch`], behind `hcomm run` and the Python package's
//! `hcomm.launch`), shared by the `hcomm` command and the Python extension.

pub mod launch;

pub use launch::{launch, launch_with_output, LaunchError, LaunchSpec};
