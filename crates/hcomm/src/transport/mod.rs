//! Transports: how bytes move between ranks.

pub mod tcp;
pub mod wait;
