//! The ground floor: errors, element types, reduction kernels, segment arithmetic and ids.
//!
//! Nothing here imports anything else of the crate; every other layer may import it.

pub mod dtype;
pub mod error;
pub mod ids;
pub mod reduce;
pub mod segments;
