//! hcomm: collective communication for CPU processes, on one host and across hosts.
//!
//! ```no_run
//! use hcomm::{Communicator, ReduceOp};
//! let comm = Communicator::from_env()?; // under `hcomm run -n 4 -- prog`, torchrun, mpirun, srun
//! let mut grad = vec![1.0f32; 1024];
//! comm.all_reduce_in_place(&mut grad, ReduceOp::Sum)?;
//! assert_eq!(grad[0], comm.world_size() as f32);
//! # Ok::<(), hcomm::Error>(())
//! ```
//!
//! Layers, top to bottom: [`Communicator`] (front end) → [`algo`] (schedules) →
//! [`transport`] (bytes between ranks) and [`bootstrap`] (joining a job) → [`reduce`]
//! (kernels).
#![warn(missing_docs)]
// `unsafe` lives in three audited modules only, each allowed below (or in `shm/mod.rs`) with
// the invariant it upholds: `shm::segment` and `shm::ring` (shared memory) and `lent`
// (buffers borrowed from callers and lent to the progress engine). One test (a `fork` in
// `bootstrap/store.rs`) allows it on itself.
#![deny(unsafe_code)]

pub mod algo;
pub mod auth;
mod base;
pub mod bootstrap;
pub mod comm;
pub mod compress;
pub mod config;
mod engine;
pub mod fusion;
pub mod fuzzing;
pub mod history;
// Buffers borrowed from a caller (`&'env mut [u8]`) and lent to engine jobs as raw pointers.
// Invariant: a lent buffer is used only while its `LentBuf` exists, and `lent::scope` returns
// (or unwinds) only after every `LentBuf` lent in it was dropped, so the borrow outlives every
// use (see the module's documentation). And buffers owned by posted point-to-point
// (`lent::Held`): a view is used only while its `Held` exists, which `comm::posted` upholds
// (it drops the frames that borrow a message's bytes before completing the message).
#[allow(unsafe_code)]
mod lent;
pub mod shm;
pub mod sparse;
pub mod testing;
pub mod trace;
pub mod transport;
pub mod wait;
pub mod wire;

pub use base::{dtype, error, reduce};
pub use comm::traffic;

pub use algo::Algo;
pub use comm::traffic::OpTraffic;
pub use comm::window::{SharedMemory, Window};
pub use comm::{Collective, Communicator, Connection};
pub use compress::{CompressionState, Compressor, Density};
pub use config::BootstrapConfig;
pub use dtype::{DType, Element, ReduceOp};
pub use engine::{Completion, Work};
pub use error::{Error, OpContext, Result};
pub use sparse::SparseRows;
