//! Transports: how bytes move between ranks.

pub mod frame;
pub mod tcp;
pub mod wait;
