//! The ground floor: errors, element types, reduction kernels, segment arithmetic, ids and
//! deadlines.
//!
//! Nothing here imports anything else of the crate; every other layer may import it.

pub mod deadline;
pub mod dtype;
pub mod error;
pub mod half_mean;
pub mod ids;
pub mod integer_mean;
pub mod reduce;
pub mod scratch;
pub mod segments;
#[allow(unsafe_code)]
pub(crate) mod simd;
pub(crate) mod widen;
pub mod zero_blocks;
