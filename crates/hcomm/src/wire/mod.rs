//! The wire layer: what travels between ranks and how it is described. Frame headers
//! ([`frame`]) and the vocabulary of collective calls with their fingerprints
//! ([`collective`]). Imports only `crate::base`.

pub mod collective;
pub mod frame;
