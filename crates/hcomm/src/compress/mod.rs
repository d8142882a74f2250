//! Gradient compression with error feedback.
//!
//! [`Communicator::all_reduce_compressed`] sums (or averages) an f32 vector over the ranks
//! while sending a compressed form of it; a [`CompressionState`] per tensor holds what
//! compression dropped (the *residual*), which is added back to the next step's input (error
//! feedback), so over many steps nothing is lost. [`crate::fusion::Fusion::with_compression`]
//! does the same for fused buckets.
//!
//! | [`Compressor`] | on the wire (per rank) | how it is reduced | round-trip bound |
//! |---|---|---|---|
//! | `Fp16`, `Bf16` | 2 bytes / element | ring / shm all-reduce in f16 (bf16): every step adds in f32 and rounds once | relative 2^-11 (2^-8) per rounding |
//! | `Int8 { block }` | 1 byte / element + 4 bytes / block | all-to-all of chunks, sum in f32, re-encode, all-gather | m / 254, m = largest magnitude of the block |
//! | `Sign { block }` | 1 bit / element + 4 bytes / block | same as int8 | m |
//! | `TopK(k)` | 8 bytes per kept element | all-gather of (index, value) pairs, summed in f32 | exact for kept, 0 else |
//! | `RandomK { k, seed }` | 4 bytes per kept element | dense all-reduce of the k values (same indices on every rank) | exact for kept, 0 else |
//!
//! Guarantees of every compressor: all ranks end with bitwise identical results (each rank
//! decodes the same bytes, or the reduction is the deterministic all-reduce); the per-codec
//! error bounds are those of [`codec`]'s types; with error feedback, after every step
//! `sum of results over steps + sum of residuals == sum of inputs` (up to f32 rounding), the
//! residuals being every rank's [`CompressionState::residual`] and, for int8 and sign, every
//! owner's [`CompressionState::owner_residual`]. fp16/bf16 are the exception: the residual
//! holds the error of casting the input, but the all-reduce rounds its partial sums to the
//! half format too (each step adds in f32 and rounds once: `n - 1` roundings per element),
//! and that error is not fed back.
//!
//! int8 and sign run a *compressed* all-reduce: the vector is cut into one chunk per rank
//! (at block boundaries); each rank encodes its whole input and sends chunk `c` to rank `c`
//! (all-to-all), rank `c` decodes the chunks it got, sums them in f32 in rank order, adds its
//! own residual for the chunk (a second, per-owner error feedback), re-encodes the sum and
//! all-gathers it; every rank decodes the gathered encoding. Each rank sends about
//! `2 (n-1)/n` times the encoded size, as a ring all-reduce does with the dense vector.
//!
//! On ranks forming several hosts of several ranks each (as the hierarchical all-reduce
//! needs), int8 and sign run hierarchically: the host's ranks reduce-scatter their vectors
//! exactly (f32, over shared memory), each runs the compressed all-reduce above on its slice
//! of the host's sum with the same-index ranks of the other hosts (with its own residuals:
//! [`CompressionState::slice`]), and the host's ranks all-gather the slices; only compressed
//! slices cross hosts. A forced all-reduce algorithm other than the hierarchical one
//! (`HCOMM_ALGO`, [`Communicator::set_algorithm`]) keeps them flat, and so does
//! deterministic mode ([`Communicator::set_deterministic`]), where every compressor's result
//! then depends only on the ranks' inputs and residuals, not on the host layout, transport or
//! algorithm (the dense reductions inside run the canonical schedules). Top-k stays flat (its
//! picks are sparse already); fp16/bf16 and random-k are dense all-reduces, which are
//! hierarchical anyway.
//!
//! `ReduceOp::Mean` is the sum divided by the number of ranks in f32 after decoding; other
//! operators are refused.
//!
//! ```no_run
//! use hcomm::{Communicator, CompressionState, Compressor, Density, ReduceOp};
//! let comm = Communicator::from_env()?;
//! // One state per tensor, kept from step to step (it holds the residual).
//! let mut state = CompressionState::new(Compressor::TopK(Density::Fraction(0.01)))?;
//! let mut grad = vec![0.5f32; 1 << 20];
//! comm.all_reduce_compressed(&mut grad, ReduceOp::Mean, &mut state)?;
//! let sent: u64 = comm
//!     .traffic()
//!     .iter()
//!     .filter(|t| t.op == "all_reduce_compressed")
//!     .map(|t| t.bytes_sent())
//!     .sum();
//! # Ok::<(), hcomm::Error>(())
//! ```

pub mod codec;
mod reduce_scatter;
mod rng;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

pub use codec::{top_k_indices, top_k_take, Codec, Half, Int8Block, RandomK, SignBlock, TopK};
pub use rng::{mix_seed, random_k_indices, SplitMix64};

use crate::algo::Algo;
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::{Error, Result};
use crate::base::segments::even_segments;
use crate::comm::traffic::TrafficScope;
use crate::comm::Communicator;
use crate::engine::Work;
use crate::wire::collective::Collective;

const OP: &str = "all_reduce_compressed";

fn bad(msg: String) -> Error {
    Error::invalid(OP, 0, msg)
}

/// Default block of [`Compressor::Int8`]: 256 elements (1.6% of scale overhead).
pub const DEFAULT_INT8_BLOCK: usize = 256;
/// Default block of [`Compressor::Sign`]: 1024 elements (3% of scale overhead).
pub const DEFAULT_SIGN_BLOCK: usize = 1024;

/// How many elements a sparsifier keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Density {
    /// This many (at most the vector's length).
    Count(usize),
    /// This fraction of the vector, `0 < f <= 1`, rounded up (at least one element).
    Fraction(f64),
}

impl Density {
    /// Elements kept of `n`.
    pub fn k(self, n: usize) -> usize {
        match self {
            Density::Count(k) => k.min(n),
            Density::Fraction(f) => ((f * n as f64).ceil() as usize).clamp(usize::from(n > 0), n),
        }
    }

    fn validate(self, what: &str) -> Result<()> {
        match self {
            Density::Count(0) => Err(bad(format!("{what}: k = 0 (it must be at least 1)"))),
            Density::Fraction(f) if !(f > 0.0 && f <= 1.0) => {
                Err(bad(format!("{what}: fraction {f} is not in (0, 1]")))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Density {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Density::Count(k) => write!(f, "{k}"),
            Density::Fraction(x) => write!(f, "{}%", x * 100.0),
        }
    }
}

impl FromStr for Density {
    type Err = String;
    /// `1000` (count), `1%` or `0.01` (fraction).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let d = if let Some(p) = s.strip_suffix('%') {
            Density::Fraction(
                p.parse::<f64>()
                    .map_err(|_| format!("'{s}' is not a percentage"))?
                    / 100.0,
            )
        } else if s.contains('.') || s.contains('e') {
            Density::Fraction(s.parse().map_err(|_| format!("'{s}' is not a fraction"))?)
        } else {
            Density::Count(s.parse().map_err(|_| format!("'{s}' is not a count"))?)
        };
        d.validate("density").map_err(|e| e.to_string())?;
        Ok(d)
    }
}

/// A compression scheme for [`Communicator::all_reduce_compressed`] (see the module
/// documentation for what each sends and guarantees).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compressor {
    /// No compression: the plain f32 all-reduce.
    None,
    /// Cast to IEEE half precision ([`Half::F16`]).
    Fp16,
    /// Cast to bfloat16 ([`Half::Bf16`]).
    Bf16,
    /// int8 with one scale per `block` elements ([`Int8Block`]), round to nearest or
    /// stochastic.
    Int8 {
        /// Elements per scale.
        block: usize,
        /// Stochastic rounding (unbiased) instead of round to nearest.
        stochastic: bool,
    },
    /// Each rank's `k` largest-magnitude elements, gathered sparse ([`TopK`]).
    TopK(Density),
    /// `k` elements at indices drawn from `seed` (the same on every rank), reduced dense
    /// ([`RandomK`]).
    RandomK {
        /// Elements kept.
        density: Density,
        /// Shared seed (mixed with the step number and the state's key).
        seed: u64,
    },
    /// Signs with one scale (mean magnitude) per `block` elements ([`SignBlock`]).
    Sign {
        /// Elements per scale.
        block: usize,
    },
}

impl Compressor {
    /// int8 with the default block, round to nearest.
    pub const INT8: Compressor = Compressor::Int8 {
        block: DEFAULT_INT8_BLOCK,
        stochastic: false,
    };
    /// Sign with the default block.
    pub const SIGN: Compressor = Compressor::Sign {
        block: DEFAULT_SIGN_BLOCK,
    };

    /// Check the parameters: a block of 0, `k` of 0 or a fraction outside `(0, 1]` is an
    /// [`Error::InvalidArgument`] naming it.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Compressor::Int8 { block: 0, .. } => {
                Err(bad("int8: block size 0 (it must be at least 1)".into()))
            }
            Compressor::Sign { block: 0 } => {
                Err(bad("sign: block size 0 (it must be at least 1)".into()))
            }
            Compressor::TopK(d) => d.validate("top-k"),
            Compressor::RandomK { density, .. } => density.validate("random-k"),
            _ => Ok(()),
        }
    }

    /// True when the compressor loses information (everything but `None`).
    pub fn is_lossy(&self) -> bool {
        *self != Compressor::None
    }
}

impl fmt::Display for Compressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compressor::None => write!(f, "none"),
            Compressor::Fp16 => write!(f, "fp16"),
            Compressor::Bf16 => write!(f, "bf16"),
            Compressor::Int8 { block, stochastic } => {
                write!(f, "int8{}:{block}", if *stochastic { "sr" } else { "" })
            }
            Compressor::TopK(d) => write!(f, "topk:{d}"),
            Compressor::RandomK { density, seed } => write!(f, "randk:{density}:{seed}"),
            Compressor::Sign { block } => write!(f, "sign:{block}"),
        }
    }
}

impl FromStr for Compressor {
    type Err = String;
    /// `none`, `fp16`, `bf16`, `int8[:BLOCK]`, `int8sr[:BLOCK]` (stochastic rounding),
    /// `topk:K` / `topk:1%` / `topk:0.01`, `randk:K[:SEED]`, `sign[:BLOCK]`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let lower = s.trim().to_ascii_lowercase();
        let mut parts = lower.split(':');
        let name = parts.next().unwrap_or("");
        let arg = parts.next();
        let arg2 = parts.next();
        if parts.next().is_some() {
            return Err(format!("compressor '{s}': too many ':' fields"));
        }
        let block = |default: usize| -> std::result::Result<usize, String> {
            arg.map_or(Ok(default), |b| {
                b.parse::<usize>()
                    .map_err(|_| format!("compressor '{s}': block '{b}' is not a number"))
            })
        };
        let density = || -> std::result::Result<Density, String> {
            arg.ok_or(format!(
                "compressor '{s}': give k, e.g. {name}:1% or {name}:1000"
            ))?
            .parse::<Density>()
            .map_err(|e| format!("compressor '{s}': {e}"))
        };
        let no_more = |c: Compressor| {
            if arg2.is_some() {
                Err(format!("compressor '{s}': unexpected second ':' field"))
            } else {
                Ok(c)
            }
        };
        let plain = |c: Compressor| {
            if arg.is_some() {
                Err(format!("compressor '{s}' takes no parameter"))
            } else {
                Ok(c)
            }
        };
        let c = match name {
            "none" | "f32" | "fp32" => plain(Compressor::None)?,
            "fp16" | "f16" | "half" => plain(Compressor::Fp16)?,
            "bf16" | "bfloat16" => plain(Compressor::Bf16)?,
            "int8" | "int8sr" => no_more(Compressor::Int8 {
                block: block(DEFAULT_INT8_BLOCK)?,
                stochastic: name == "int8sr",
            })?,
            "sign" | "1bit" => no_more(Compressor::Sign {
                block: block(DEFAULT_SIGN_BLOCK)?,
            })?,
            "topk" => no_more(Compressor::TopK(density()?))?,
            "randk" | "randomk" => Compressor::RandomK {
                density: density()?,
                seed: arg2.map_or(Ok(0), |v| {
                    v.parse::<u64>()
                        .map_err(|_| format!("compressor '{s}': seed '{v}' is not a number"))
                })?,
            },
            _ => {
                return Err(format!(
                "unknown compressor '{s}' (expected none, fp16, bf16, int8[:BLOCK], int8sr[:BLOCK], topk:K, randk:K[:SEED], sign[:BLOCK])"
            ))
            }
        };
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

/// One tensor's compression state: the compressor, whether error feedback is on, the
/// residuals and the step count. Keep one per tensor (or fused bucket) and pass it to every
/// [`Communicator::all_reduce_compressed`] of that tensor.
///
/// The state binds to the tensor's length, the world size and the rank at its first use;
/// using it with another length or communicator size is an error (call
/// [`reset`](Self::reset) to rebind).
#[derive(Clone, Debug)]
pub struct CompressionState {
    compressor: Compressor,
    error_feedback: bool,
    key: u64,
    steps: u64,
    /// (elements, world size, rank) of the first use.
    bound: Option<(usize, usize, usize)>,
    /// What this rank's compression dropped (input + old residual − what was sent).
    residual: Vec<f32>,
    /// int8 / sign: what re-encoding the sum of the chunk this rank owns dropped.
    owner_residual: Vec<f32>,
    /// int8 / sign: the elements of the chunk this rank owns.
    owner: Option<std::ops::Range<usize>>,
    /// Top-k: the next call's encoding, made ahead by [`prepare`](Self::prepare).
    prepared: Pending,
    /// On a communicator of several hosts of several ranks (int8, sign): the elements
    /// whose host sum this rank compresses across hosts, and the state of that compressed
    /// all-reduce (see [`Communicator::all_reduce_compressed`]).
    across: Option<Box<(std::ops::Range<usize>, CompressionState)>>,
}

/// A top-k encoding made ahead by [`CompressionState::prepare`] for one buffer (its address
/// and length). A clone of the state does not carry it: it belongs to one call.
#[derive(Debug, Default)]
struct Pending(Option<(usize, usize, Vec<u8>)>);

impl Clone for Pending {
    fn clone(&self) -> Self {
        Pending(None)
    }
}

impl CompressionState {
    /// A state for `compressor`, with error feedback (errors if the compressor's parameters
    /// are invalid, see [`Compressor::validate`]).
    pub fn new(compressor: Compressor) -> Result<CompressionState> {
        compressor.validate()?;
        Ok(CompressionState {
            compressor,
            error_feedback: true,
            key: 0,
            steps: 0,
            bound: None,
            residual: Vec::new(),
            owner_residual: Vec::new(),
            owner: None,
            prepared: Pending::default(),
            across: None,
        })
    }

    /// Turn error feedback on (the default) or off. Turning it off drops the residuals.
    pub fn with_error_feedback(mut self, on: bool) -> CompressionState {
        self.set_error_feedback(on);
        self
    }

    /// [`with_error_feedback`](Self::with_error_feedback) in place (the state across hosts
    /// too).
    fn set_error_feedback(&mut self, on: bool) {
        self.error_feedback = on;
        if !on {
            self.residual = Vec::new();
            self.owner_residual = Vec::new();
            self.prepared = Pending::default();
        }
        if let Some(a) = self.across.as_mut() {
            a.1.set_error_feedback(on);
        }
    }

    /// A key mixed into random-k's seed, so that different tensors sharing a seed draw
    /// different indices (every rank must use the same key for the same tensor).
    pub fn with_key(mut self, key: u64) -> CompressionState {
        self.key = key;
        self
    }

    /// The compressor.
    pub fn compressor(&self) -> Compressor {
        self.compressor
    }

    /// Whether error feedback is on.
    pub fn error_feedback(&self) -> bool {
        self.error_feedback
    }

    /// Compressed all-reduces run with this state.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// What this rank's compression dropped and will add to the next input (empty before
    /// the first step, without error feedback, and for `Compressor::None`).
    ///
    /// On a communicator of several hosts of several ranks, int8 and sign compress the
    /// host's sum of this rank's [`slice`](Self::slice) instead; the residual is then that
    /// slice's (in the host sum's units).
    pub fn residual(&self) -> &[f32] {
        match &self.across {
            Some(a) => &a.1.residual,
            None => &self.residual,
        }
    }

    /// On a communicator of several hosts of several ranks (int8, sign), once the
    /// state was used: the elements whose host sum this rank compresses across hosts, which
    /// [`residual`](Self::residual) and [`owner_range`](Self::owner_range) then refer to.
    pub fn slice(&self) -> Option<std::ops::Range<usize>> {
        self.across.as_ref().map(|a| a.0.clone())
    }

    /// int8 and sign: what re-encoding the sum of the chunk this rank owns dropped, for the
    /// elements [`owner_range`](Self::owner_range), in the sum's units (see the module
    /// documentation). Empty otherwise.
    pub fn owner_residual(&self) -> &[f32] {
        match &self.across {
            Some(a) => &a.1.owner_residual,
            None => &self.owner_residual,
        }
    }

    /// int8 and sign: the elements of the chunk this rank owns (decodes, sums and
    /// re-encodes), once the state was used.
    pub fn owner_range(&self) -> Option<std::ops::Range<usize>> {
        match &self.across {
            Some(a) => {
                let o = a.1.owner.clone()?;
                Some(a.0.start + o.start..a.0.start + o.end)
            }
            None => self.owner.clone(),
        }
    }

    /// Forget the residuals, the step count and the binding to a tensor (and an encoding
    /// [`prepare`](Self::prepare) made: with it, the values of the tensor it was made for).
    pub fn reset(&mut self) {
        self.steps = 0;
        self.bound = None;
        self.residual = Vec::new();
        self.owner_residual = Vec::new();
        self.owner = None;
        self.prepared = Pending::default();
        self.across = None;
    }

    /// Do the local part of the next compressed all-reduce of `buf` now, on the calling
    /// thread: for top-k with error feedback, the residual add, the selection and the
    /// clearing of `buf` ([`top_k_take`]). The next
    /// [`all_reduce_compressed`](Communicator::all_reduce_compressed) of the same `buf` with
    /// this state then only exchanges the picks and sums them. Returns whether anything was
    /// done (other compressors, and top-k without error feedback, do it all in the call).
    ///
    /// Each rank then pays for its own selection on the thread that computes, instead of on
    /// its progress engine: on a host whose cores all compute, the engines' work otherwise
    /// lands on whichever core the scheduler picks, slowing one rank more than the other
    /// (see docs/training.md).
    ///
    /// `prepare` is the first half of that call: `buf` is cleared and its values are in the
    /// residual and the pending encoding. Call `all_reduce_compressed` next with the same
    /// `buf`, untouched. If that call is refused (a bad op, another buffer, a state bound to
    /// another tensor), the pending picks go back into the residual, so nothing is lost: the
    /// next call sends them. A second `prepare` before the call does nothing (returns false).
    pub fn prepare(&mut self, buf: &mut [f32]) -> bool {
        let Compressor::TopK(d) = self.compressor else {
            return false;
        };
        let n = buf.len();
        let bound_elsewhere = self.bound.is_some_and(|(bn, _, _)| bn != n);
        if !self.error_feedback
            || n == 0
            || bound_elsewhere
            || n as u64 > u32::MAX as u64 + 1
            || self.prepared.0.is_some()
        {
            return false; // the call does it all (and reports a wrong length)
        }
        self.size_residual(n);
        let k = d.k(n);
        let (idx, vals) = top_k_take(buf, &mut self.residual, k);
        let mut enc = vec![0u8; 8 * idx.len()];
        TopK::write(&idx, &vals, &mut enc);
        self.prepared = Pending(Some((buf.as_ptr() as usize, n, enc)));
        true
    }

    /// A call refused after [`prepare`](Self::prepare): the pending picks go back into the
    /// residual (which then holds the prepared buffer's values plus the old residual).
    fn give_back(&mut self, pending: Option<(usize, usize, Vec<u8>)>) {
        let Some((_, _, enc)) = pending else {
            return;
        };
        if let Ok(codec) = TopK::new((enc.len() / 8).max(1)) {
            // (made by `prepare` for this residual: the indices are in range)
            let _ = codec.decode_add(&enc, &mut self.residual);
        }
    }

    /// Size the residual for `n` elements: zeros when it was not (a first use, or error
    /// feedback turned on after the state was bound); kept when it was (`prepare` made it).
    fn size_residual(&mut self, n: usize) {
        if self.residual.len() != n {
            self.residual = vec![0.0; n];
        }
    }

    /// [`prepare`](Self::prepare) on bytes holding f32 elements; does nothing (returns false)
    /// when they are not whole, aligned f32s (the call then does it all).
    pub fn prepare_bytes(&mut self, buf: &mut [u8]) -> bool {
        match bytemuck::try_cast_slice_mut::<u8, f32>(buf) {
            Ok(f) => self.prepare(f),
            Err(_) => false,
        }
    }

    /// Bytes of memory the residuals hold.
    pub fn memory_bytes(&self) -> usize {
        4 * (self.residual.capacity() + self.owner_residual.capacity())
            + self.across.as_ref().map_or(0, |a| a.1.memory_bytes())
    }

    /// The state of this rank's slice across hosts (made on first use, with the same
    /// compressor, error feedback and, mixed with the slice's index, key): errors if the
    /// state was used with another slice.
    fn across_state(
        &mut self,
        slice: std::ops::Range<usize>,
        local: usize,
    ) -> Result<&mut CompressionState> {
        if let Some(a) = &self.across {
            if a.0 != slice {
                return Err(bad(format!(
                    "this CompressionState compresses elements {:?} across hosts; this \
                     communicator's hierarchy gives this rank elements {slice:?} (keep one \
                     state per tensor and communicator, or reset() it)",
                    a.0
                )));
            }
        } else {
            let st = CompressionState::new(self.compressor)?
                .with_error_feedback(self.error_feedback)
                .with_key(mix_seed(&[self.key, local as u64, 0x41c]));
            self.across = Some(Box::new((slice, st)));
        }
        Ok(&mut self.across.as_mut().expect("made above").1)
    }

    /// Switching to the hierarchical form: the flat residuals (this rank's, and its owner
    /// chunk's, in the sum's units) are added to `buf` and dropped. The sum over the ranks is
    /// linear, so adding to one rank's input is adding to the sum.
    fn fold_flat_residuals(&mut self, buf: &mut [f32]) {
        add_to(buf, &std::mem::take(&mut self.residual));
        if let Some(o) = self.owner.take() {
            add_to(&mut buf[o], &self.owner_residual);
        }
        self.owner_residual = Vec::new();
    }

    /// Switching to the flat form: the hierarchical state's residuals (of this rank's slice
    /// of the host sum, and of its owner chunk within it) are added to `buf` and dropped.
    fn fold_across_residuals(&mut self, buf: &mut [f32]) {
        let Some(a) = self.across.take() else {
            return;
        };
        let (slice, st) = *a;
        let part = &mut buf[slice];
        add_to(part, &st.residual);
        if let Some(o) = st.owner {
            add_to(&mut part[o], &st.owner_residual);
        }
    }

    /// Whether `compressor` runs hierarchically on a hierarchy: the two-stage codecs, int8
    /// and sign. fp16/bf16 and random-k are dense all-reduces, hierarchical already. Top-k
    /// stays flat: its picks are sparse, and reducing the host's dense sum costs more than
    /// it saves (2 hosts x 2 ranks, 21 MB of gradients: 32 MB of shared-memory copies per
    /// rank and step against 1.3 MB of picks, and the step no faster at 1 Gbit/s).
    fn compresses_across_hosts(compressor: Compressor) -> bool {
        matches!(
            compressor,
            Compressor::Int8 { .. } | Compressor::Sign { .. }
        )
    }

    fn bind(&mut self, n: usize, world: usize, rank: usize) -> Result<()> {
        match self.bound {
            None => {
                self.bound = Some((n, world, rank));
                Ok(())
            }
            Some(b) if b == (n, world, rank) => Ok(()),
            Some((bn, bw, br)) => Err(bad(format!(
                "this CompressionState belongs to a {bn}-element tensor on rank {br} of {bw}; \
                 it was given {n} elements on rank {rank} of {world} (keep one state per \
                 tensor, or reset() it)"
            ))),
        }
    }
}

/// Element ranges of the chunks of the compressed all-reduce: `world` chunks of whole
/// blocks (the last block may be short), as even as blocks allow.
fn chunk_ranges(n: usize, block: usize, world: usize) -> Vec<std::ops::Range<usize>> {
    even_segments(n.div_ceil(block), world, 1)
        .into_iter()
        .map(|b| (b.start * block).min(n)..(b.end * block).min(n))
        .collect()
}

/// `buf[i] += add[i]` over the shorter of the two (a residual added back to its elements).
fn add_to(buf: &mut [f32], add: &[f32]) {
    buf.iter_mut().zip(add).for_each(|(x, r)| *x += *r);
}

fn divide(buf: &mut [f32], world: usize) {
    let w = world as f32;
    buf.iter_mut().for_each(|x| *x /= w);
}

impl Communicator {
    /// All-reduce `buf` (f32) compressed with `state`'s compressor; `op` is `Sum` or `Mean`.
    ///
    /// With error feedback (the default), `state`'s residual is added to `buf` first and what
    /// compression drops is kept for the next call. Every rank must call it with the same
    /// compressor and length, in the same order as its other operations; the result is
    /// bitwise identical on every rank. The call runs as one operation (nothing else on this
    /// communicator interleaves with its steps), and its bytes are counted under
    /// `all_reduce_compressed` in [`traffic`](Self::traffic).
    ///
    /// Errors: `op` other than `Sum`/`Mean`, a state bound to another length or world size
    /// ([`Error::InvalidArgument`], nothing sent); any error of the underlying collectives.
    pub fn all_reduce_compressed(
        &self,
        buf: &mut [f32],
        op: ReduceOp,
        state: &mut CompressionState,
    ) -> Result<()> {
        // An encoding `prepare` made is used up by this call whatever happens: by the top-k
        // below, or given back to the residual when the call is refused.
        let pending = state.prepared.0.take();
        let checked = (|| {
            if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                return Err(bad(format!(
                    "compressed all-reduce sums or averages; got op {op}"
                )));
            }
            if let Some((at, n, _)) = &pending {
                if *at != buf.as_ptr() as usize || *n != buf.len() {
                    return Err(bad(format!(
                        "top-k: prepared for another buffer ({n} elements), called with {} elements",
                        buf.len()
                    )));
                }
            }
            state.compressor.validate()?;
            state.bind(buf.len(), self.world_size(), self.rank())
        })();
        if let Err(e) = checked {
            state.give_back(pending);
            return Err(e);
        }
        // One unit: the collectives below run back to back in this operation's turn.
        let _turn = self.engine().turns.enter();
        let _traffic = TrafficScope::enter(self, OP);
        // Hierarchical or flat (decided in the turn); a state kept for another slice is
        // refused before anything changes.
        let slice = if buf.is_empty() {
            None
        } else {
            self.compressed_slice(state.compressor, buf.len())
        };
        if let Some(slice) = &slice {
            let (_, local, _) = self.hierarchical_layout().expect("a hierarchy");
            state.across_state(slice.clone(), local)?;
        }
        let step = state.steps;
        state.steps += 1;
        if buf.is_empty() {
            return Ok(());
        }
        if slice.is_some() {
            // (`prepare` makes encodings for top-k only, which stays flat)
            debug_assert!(pending.is_none());
            return self.all_reduce_compressed_across_hosts(buf, op, state);
        }
        // What a hierarchical use of this state kept joins the input (a forced algorithm, or
        // the state used on another communicator of this size).
        state.fold_across_residuals(buf);
        let ef = state.error_feedback;
        if ef && state.compressor.is_lossy() {
            // (first use, or error feedback turned on after binding; kept if `prepare` made it)
            state.size_residual(buf.len());
        }
        // Error feedback: random-k adds the residual and keeps the sum as the next residual
        // (minus what it sends, below) in one pass; the other compressors add it in their
        // own pass, with the selection or the encoding.
        // Random-k sends only its sample, so it notes whether any element is NaN or infinite
        // (in the same pass) to make that visible in this step's result, and never keeps a
        // non-finite residual (a NaN kept would come out at whichever later step samples it).
        let mut non_finite = false;
        if matches!(state.compressor, Compressor::RandomK { .. }) {
            if ef {
                buf.iter_mut().zip(&mut state.residual).for_each(|(x, r)| {
                    *x += *r;
                    let finite = x.is_finite();
                    non_finite |= !finite;
                    *r = if finite { *x } else { 0.0 };
                });
            } else {
                non_finite = buf.iter().fold(false, |any, x| any | !x.is_finite());
            }
        }
        match state.compressor {
            Compressor::None => return self.all_reduce_in_place(buf, op),
            Compressor::Fp16 | Compressor::Bf16 => {
                let (codec, dtype) = if state.compressor == Compressor::Fp16 {
                    (Half::F16, DType::F16)
                } else {
                    (Half::Bf16, DType::BF16)
                };
                let mut enc = vec![0u8; codec.encoded_len(buf.len())];
                if ef {
                    codec
                        .clone()
                        .encode_keeping_error(buf, &mut state.residual, &mut enc)?;
                } else {
                    codec.clone().encode(buf, &mut enc)?;
                }
                self.all_reduce_bytes(None, &mut enc, dtype, ReduceOp::Sum)?;
                codec.decode(&enc, buf)?;
            }
            Compressor::Int8 { block, stochastic } => {
                let seed = mix_seed(&[state.key, step, self.rank() as u64, 0x1a7]);
                let mut codec = if stochastic {
                    Int8Block::stochastic(block, seed)?
                } else {
                    Int8Block::new(block)?
                };
                self.two_stage(buf, state, &mut codec, block)?;
            }
            Compressor::Sign { block } => {
                let mut codec = SignBlock::new(block)?;
                self.two_stage(buf, state, &mut codec, block)?;
            }
            Compressor::TopK(d) => {
                if buf.len() as u64 > u32::MAX as u64 + 1 {
                    return Err(bad(format!(
                        "top-k: {} elements; indices are 32-bit (at most 2^32 elements)",
                        buf.len()
                    )));
                }
                let k = d.k(buf.len());
                let mut codec = TopK::new(k)?;
                let len = codec.encoded_len(buf.len());
                let mut enc = vec![0u8; len];
                if let Some((_, _, made)) = pending {
                    // made ahead by `prepare` for this buffer (cleared, residual kept)
                    enc = made;
                } else if ef {
                    // one pass: adds the residual, keeps the rest as the next residual,
                    // clears `buf` for the sum
                    let (idx, vals) = top_k_take(buf, &mut state.residual, k);
                    TopK::write(&idx, &vals, &mut enc);
                } else {
                    codec.encode(buf, &mut enc)?;
                    buf.fill(0.0);
                }
                let mut all = vec![0u8; len * self.world_size()];
                let lens = vec![len; self.world_size()];
                self.all_gather_v_unkept(Some(&enc), &mut all, &lens, DType::U8)?;
                let divisor = (op == ReduceOp::Mean).then_some(self.world_size() as f32);
                return TopK::sum_parts(&all, len, buf, divisor);
            }
            Compressor::RandomK { density, seed } => {
                let k = density.k(buf.len());
                let mut codec = RandomK::new(mix_seed(&[seed, state.key, step]), buf.len(), k)?;
                let mut enc = vec![0u8; codec.encoded_len(buf.len())];
                codec.encode(buf, &mut enc)?;
                if ef {
                    // (the residual holds the input already)
                    for &i in codec.indices() {
                        state.residual[i as usize] = 0.0;
                    }
                }
                // A NaN or infinity outside the sample makes the first sampled value NaN, so
                // that the step's result shows it (a gradient scaler skips the step).
                let sampled_non_finite = || {
                    codec
                        .indices()
                        .iter()
                        .any(|&i| !buf[i as usize].is_finite())
                };
                if non_finite && enc.len() >= 4 && !sampled_non_finite() {
                    enc[..4].copy_from_slice(&f32::NAN.to_ne_bytes());
                }
                self.all_reduce_bytes(None, &mut enc, DType::F32, ReduceOp::Sum)?;
                codec.decode(&enc, buf)?;
            }
        }
        if op == ReduceOp::Mean {
            divide(buf, self.world_size());
        }
        Ok(())
    }

    /// This rank's slice of `n` elements when `compressor` runs hierarchically here: ranks
    /// forming several hosts of several ranks each, and no all-reduce algorithm other than
    /// the hierarchical one set (read in the operation's turn, as the all-reduce does). In
    /// deterministic mode it stays flat: the host-wise exact sum first would change the bits
    /// with the host layout.
    fn compressed_slice(&self, compressor: Compressor, n: usize) -> Option<std::ops::Range<usize>> {
        if !CompressionState::compresses_across_hosts(compressor) || self.is_deterministic() {
            return None;
        }
        match self.forced_algorithm(Collective::AllReduce) {
            Algo::Auto | Algo::Hierarchical => self.hierarchical_slice(n),
            _ => None,
        }
    }

    /// The compressed all-reduce on a hierarchy: the host's ranks reduce-scatter their
    /// vectors exactly (f32, shared memory), each compresses its slice of the host sum in a
    /// compressed all-reduce with the same-index ranks of the other hosts (its own state,
    /// error feedback included), and the host's ranks all-gather the slices. Only the
    /// compressed slices cross hosts: each host sends what one rank of a flat job would,
    /// instead of one rank's share per rank on it.
    fn all_reduce_compressed_across_hosts(
        &self,
        buf: &mut [f32],
        op: ReduceOp,
        state: &mut CompressionState,
    ) -> Result<()> {
        // What a flat use of this state kept joins the input, so nothing it dropped is lost.
        state.fold_flat_residuals(buf);
        let across = &mut state.across.as_mut().expect("made above").1;
        self.hierarchically(
            OP,
            bytemuck::cast_slice_mut(buf),
            DType::F32,
            op,
            |comm, part, _| {
                comm.all_reduce_compressed(bytemuck::cast_slice_mut(part), ReduceOp::Sum, across)
            },
        )
    }

    /// The compressed all-reduce of int8 and sign (see the module documentation): encode
    /// per destination chunk, all-to-all, decode and sum the own chunk in f32, re-encode,
    /// all-gather, decode. Leaves the sum in `buf`.
    fn two_stage<C: Codec>(
        &self,
        buf: &mut [f32],
        state: &mut CompressionState,
        codec: &mut C,
        block: usize,
    ) -> Result<()> {
        let world = self.world_size();
        let me = self.rank();
        let chunks = chunk_ranges(buf.len(), block, world);
        let lens: Vec<usize> = chunks.iter().map(|c| codec.encoded_len(c.len())).collect();
        // Equal blocks for the all-to-all (shared memory needs them): pad to the longest.
        let pad = lens.iter().copied().max().unwrap_or(0);
        let mine = chunks[me].clone();
        // Reused between calls (a bucket-sized allocation per call costs a page fault per
        // 4 KiB); every byte read below is written first.
        let mut scratch = self.scratch();
        let (send, recv, enc, sum) = scratch.take(pad * world, pad * world, lens[me], mine.len());
        for ((c, &l), out) in chunks.iter().zip(&lens).zip(send.chunks_mut(pad.max(1))) {
            if state.error_feedback {
                // buf + residual encoded, the residual left with what that loses
                codec.encode_keeping_error(
                    &buf[c.clone()],
                    &mut state.residual[c.clone()],
                    &mut out[..l],
                )?;
            } else {
                codec.encode(&buf[c.clone()], &mut out[..l])?;
            }
            out[l..].fill(0); // the padding travels too
        }
        self.all_to_all(send, recv)?;
        // The chunk this rank owns: the sum of every rank's encoding of it, in rank order.
        state.owner = Some(mine.clone());
        sum.fill(0.0);
        for part in recv.chunks(pad.max(1)) {
            codec.decode_add(&part[..lens[me]], sum)?;
        }
        if state.error_feedback {
            if state.owner_residual.len() != sum.len() {
                state.owner_residual = vec![0.0; sum.len()];
            }
            codec.encode_keeping_error(sum, &mut state.owner_residual, enc)?;
        } else {
            codec.encode(sum, enc)?;
        }
        // (the all-to-all's send buffer is free again)
        let all = &mut send[..lens.iter().sum()];
        self.all_gather_v_unkept(Some(enc), all, &lens, DType::U8)?;
        let mut off = 0;
        for (c, &l) in chunks.iter().zip(&lens) {
            codec.decode(&all[off..off + l], &mut buf[c.clone()])?;
            off += l;
        }
        Ok(())
    }

    /// [`all_reduce_compressed`](Self::all_reduce_compressed) on bytes holding f32 elements
    /// (any alignment); `dtype` must be `F32`.
    pub fn all_reduce_compressed_bytes(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        state: &mut CompressionState,
    ) -> Result<()> {
        if dtype != DType::F32 {
            return Err(bad(format!(
                "compressed all-reduce takes f32 data; got {dtype} (compressor {})",
                state.compressor
            )));
        }
        if !buf.len().is_multiple_of(4) {
            return Err(bad(format!(
                "buffer is {} bytes, not a whole number of f32 elements",
                buf.len()
            )));
        }
        match bytemuck::try_cast_slice_mut::<u8, f32>(buf) {
            Ok(f) => self.all_reduce_compressed(f, op, state),
            Err(_) => {
                let mut f = vec![0f32; buf.len() / 4];
                bytemuck::cast_slice_mut::<f32, u8>(&mut f).copy_from_slice(buf);
                self.all_reduce_compressed(&mut f, op, state)?;
                buf.copy_from_slice(bytemuck::cast_slice(&f));
                Ok(())
            }
        }
    }

    /// Non-blocking [`all_reduce_compressed`](Self::all_reduce_compressed); `wait()` gives
    /// back the buffer and the state.
    pub fn all_reduce_compressed_async<B>(
        self: &Arc<Self>,
        mut buf: B,
        op: ReduceOp,
        mut state: CompressionState,
    ) -> Work<(B, CompressionState)>
    where
        B: AsMut<[f32]> + Send + 'static,
    {
        self.run_async(OP, move |c| {
            c.all_reduce_compressed(buf.as_mut(), op, &mut state)?;
            Ok((buf, state))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_vector_at_block_boundaries() {
        for (n, block, world) in [(0, 4, 3), (10, 4, 3), (1000, 256, 4), (5, 8, 4), (17, 1, 5)] {
            let c = chunk_ranges(n, block, world);
            assert_eq!(c.len(), world);
            assert_eq!(c[0].start, 0);
            assert_eq!(c[world - 1].end, n);
            for w in c.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].end == n || w[0].end % block == 0);
            }
        }
    }

    #[test]
    fn compressors_parse_and_print() {
        for (s, c) in [
            ("none", Compressor::None),
            ("fp16", Compressor::Fp16),
            ("bf16", Compressor::Bf16),
            ("int8", Compressor::INT8),
            (
                "int8sr:64",
                Compressor::Int8 {
                    block: 64,
                    stochastic: true,
                },
            ),
            ("topk:1%", Compressor::TopK(Density::Fraction(0.01))),
            ("topk:1000", Compressor::TopK(Density::Count(1000))),
            (
                "randk:0.5:7",
                Compressor::RandomK {
                    density: Density::Fraction(0.5),
                    seed: 7,
                },
            ),
            ("sign", Compressor::SIGN),
        ] {
            assert_eq!(s.parse::<Compressor>().unwrap(), c, "{s}");
            assert_eq!(c.to_string().parse::<Compressor>().unwrap(), c, "{c}");
        }
        for bad in [
            "int8:0", "sign:0", "topk", "topk:0", "topk:0%", "topk:1.5", "randk:-1", "zip",
            "int8:x", "fp16:3",
        ] {
            assert!(bad.parse::<Compressor>().is_err(), "{bad} must be refused");
        }
    }

    #[test]
    fn bad_parameters_are_typed_errors_naming_the_parameter() {
        let e = CompressionState::new(Compressor::Int8 {
            block: 0,
            stochastic: false,
        })
        .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("block size 0")),
            "{e}"
        );
        let e = CompressionState::new(Compressor::TopK(Density::Count(0))).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("k = 0")),
            "{e}"
        );
        let e = CompressionState::new(Compressor::RandomK {
            density: Density::Fraction(f64::NAN),
            seed: 0,
        })
        .unwrap_err();
        assert!(e.to_string().contains("fraction"), "{e}");
    }

    #[test]
    fn density_rounds_up_and_clamps() {
        assert_eq!(Density::Fraction(0.01).k(1000), 10);
        assert_eq!(Density::Fraction(0.01).k(1001), 11);
        assert_eq!(Density::Fraction(0.001).k(10), 1);
        assert_eq!(Density::Fraction(1.0).k(10), 10);
        assert_eq!(Density::Count(50).k(10), 10);
        assert_eq!(Density::Fraction(0.5).k(0), 0);
    }
}
