//! Gradient fusion: many small tensors all-reduced as a few large buckets, so a model with
//! hundreds of parameters pays a collective's start-up cost a few times per step instead of
//! hundreds, and buckets are launched while the caller is still computing.
//!
//! * [`BucketPlanner`] decides which tensors share a bucket (pure; property-tested).
//! * [`Fusion::step`] lends a [`Bucketer`] to the caller's closure; the bucketer takes tensors
//!   one at a time, in the order gradients become ready, and starts each closed bucket's
//!   all-reduce asynchronously; when the closure returns, the step waits for every bucket and
//!   the results are in the tensors.
//! * [`Communicator::all_reduce_coalesced`] does a whole step for a list of tensors.
//!
//! Buckets hold one dtype each (tensors of several dtypes are grouped by dtype). A bucket
//! closes when it reaches the cap, or before a tensor that would push it past the cap; a
//! tensor larger than the cap gets a bucket of its own. The first bucket closed may use a
//! smaller cap (as DDP does) so communication starts early in the backward pass.
//!
//! Packing costs two copies of every byte (into the bucket, back out), which on one host is
//! as much memory traffic as the all-reduce itself. So tensors of at least
//! [`FusionOptions::direct_bytes`] (1 MiB by default) are not packed: each is all-reduced in
//! place, in its turn, with no copy — their start-up cost is negligible against their
//! transfer time anyway. Every rank must push the same tensors in the same order.
//!
//! With [`Fusion::with_compression`], every bucket (packed or direct) is all-reduced with
//! [`Communicator::all_reduce_compressed`]; each bucket keeps its own
//! [`CompressionState`] (residual) from step to step, keyed by its tensors (their positions in
//! the step) and its size, so the residual of a bucket is carried over as long as the same
//! tensors form the same bucket.

use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use crate::base::dtype::{DType, Element, ReduceOp};
use crate::base::error::{Error, Result};
use crate::comm::Communicator;
use crate::compress::{CompressionState, Compressor};
use crate::engine::Work;
use crate::lent::{self, Lender};

/// Bucket sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionOptions {
    /// Bytes per bucket (default 25 MiB, DDP's `bucket_cap_mb`).
    pub cap_bytes: usize,
    /// Bytes of the first bucket closed (default 1 MiB, as DDP); equal to `cap_bytes` to
    /// disable the smaller first bucket.
    pub first_bucket_bytes: usize,
    /// Tensors of at least this many bytes are all-reduced in place, alone, instead of being
    /// copied into a bucket (default 1 MiB; `usize::MAX` packs everything).
    pub direct_bytes: usize,
    /// All-reduce uncompressed buckets with
    /// [`all_reduce_skipping_zeros_bytes`](Communicator::all_reduce_skipping_zeros_bytes):
    /// a bucket whose non-zero blocks are few (an embedding's gradient) moves only those;
    /// lossless (default off: it scans each bucket and adds a small all-gather).
    pub skip_zero_blocks: bool,
    /// Compressed buckets: do the compressor's local part (top-k's selection, see
    /// [`CompressionState::prepare`]) on the thread that pushes the tensor that closes the
    /// bucket, instead of on the progress engine, so that each rank pays for its own on the
    /// thread that computes (default off: on a host with idle cores the engine overlaps it).
    pub encode_on_push: bool,
}

impl Default for FusionOptions {
    fn default() -> Self {
        FusionOptions {
            cap_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
            direct_bytes: 1 << 20,
            skip_zero_blocks: false,
            encode_on_push: false,
        }
    }
}

impl FusionOptions {
    /// Buckets of `cap_bytes` (the first one too) that pack every tensor.
    pub fn with_cap(cap_bytes: usize) -> FusionOptions {
        FusionOptions {
            cap_bytes,
            first_bucket_bytes: cap_bytes,
            direct_bytes: usize::MAX,
            skip_zero_blocks: false,
            encode_on_push: false,
        }
    }
}

/// A closed bucket: which tensors (by the index they were added with) it holds, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Element type of every member.
    pub dtype: DType,
    /// Indices of the member tensors, in the order they were added.
    pub members: Vec<usize>,
    /// Total bytes of the members.
    pub bytes: usize,
    /// One tensor of at least [`FusionOptions::direct_bytes`], reduced in place (not packed).
    pub direct: bool,
}

/// Decides bucket membership as tensors arrive (see the module documentation for the rule).
#[derive(Debug)]
pub struct BucketPlanner {
    opts: FusionOptions,
    open: HashMap<DType, Bucket>,
    /// Open dtypes in the order their bucket was opened (deterministic flush order).
    order: Vec<DType>,
    closed: usize,
}

impl BucketPlanner {
    /// A planner with these sizes.
    pub fn new(opts: FusionOptions) -> BucketPlanner {
        BucketPlanner {
            opts,
            open: HashMap::new(),
            order: Vec::new(),
            closed: 0,
        }
    }

    fn cap(&self) -> usize {
        if self.closed == 0 {
            self.opts.first_bucket_bytes.max(1)
        } else {
            self.opts.cap_bytes.max(1)
        }
    }

    fn close(&mut self, dtype: DType, out: &mut Vec<Bucket>) {
        if let Some(b) = self.open.remove(&dtype) {
            self.order.retain(|&d| d != dtype);
            self.closed += 1;
            out.push(b);
        }
    }

    /// Add tensor `index` of `bytes` bytes; returns the buckets this closes (zero, one or two),
    /// ready to launch.
    pub fn add(&mut self, index: usize, dtype: DType, bytes: usize) -> Vec<Bucket> {
        if bytes >= self.opts.direct_bytes {
            return vec![Bucket {
                dtype,
                members: vec![index],
                bytes,
                direct: true,
            }];
        }
        let mut out = Vec::new();
        let cap = self.cap();
        if let Some(b) = self.open.get(&dtype) {
            if !b.members.is_empty() && b.bytes + bytes > cap {
                self.close(dtype, &mut out);
            }
        }
        if !self.open.contains_key(&dtype) {
            self.order.push(dtype);
        }
        let b = self.open.entry(dtype).or_insert_with(|| Bucket {
            dtype,
            members: Vec::new(),
            bytes: 0,
            direct: false,
        });
        b.members.push(index);
        b.bytes += bytes;
        if b.bytes >= self.cap() {
            self.close(dtype, &mut out);
        }
        out
    }

    /// Close every open bucket (end of the step).
    pub fn flush(&mut self) -> Vec<Bucket> {
        let mut out = Vec::new();
        for d in std::mem::take(&mut self.order) {
            self.close(d, &mut out);
        }
        out
    }
}

/// All buckets for tensors of these `(dtype, bytes)`, in the order they would be launched.
pub fn plan_buckets(tensors: &[(DType, usize)], opts: FusionOptions) -> Vec<Bucket> {
    let mut p = BucketPlanner::new(opts);
    let mut out = Vec::new();
    for (i, &(d, b)) in tensors.iter().enumerate() {
        out.extend(p.add(i, d, b));
    }
    out.extend(p.flush());
    out
}

/// A mutable tensor of any element type, as bytes with its dtype.
#[derive(Debug)]
pub struct TensorMut<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

impl<'a> TensorMut<'a> {
    /// A typed slice.
    pub fn new<T: Element>(data: &'a mut [T]) -> TensorMut<'a> {
        TensorMut {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice_mut(data),
        }
    }

    /// Raw bytes holding elements of `dtype`; the length must be a multiple of its size.
    pub fn from_bytes(dtype: DType, bytes: &'a mut [u8]) -> Result<TensorMut<'a>> {
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(Error::invalid(
                "fusion",
                0,
                format!(
                    "{} bytes is not a whole number of {dtype} elements",
                    bytes.len()
                ),
            ));
        }
        Ok(TensorMut { dtype, bytes })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.bytes.len()
    }
}

impl<'a, T: Element> From<&'a mut [T]> for TensorMut<'a> {
    fn from(data: &'a mut [T]) -> Self {
        TensorMut::new(data)
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for TensorMut<'a> {
    fn from(data: &'a mut Vec<T>) -> Self {
        TensorMut::new(data.as_mut_slice())
    }
}

/// Staging buffers kept between steps, so a training loop does not allocate (and page-fault
/// in) a bucket's worth of memory every step. Clone it to share between bucketers.
#[derive(Clone, Debug, Default)]
pub struct BufferPool(Arc<Mutex<Vec<Vec<u8>>>>);

impl BufferPool {
    /// An empty pool.
    pub fn new() -> BufferPool {
        BufferPool::default()
    }

    fn take(&self, bytes: usize) -> Vec<u8> {
        let mut pool = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // The smallest buffer that fits, else the largest (grown).
        let pick = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= bytes)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)
            .or_else(|| (0..pool.len()).max_by_key(|&i| pool[i].capacity()));
        let mut buf = pick.map(|i| pool.swap_remove(i)).unwrap_or_default();
        buf.clear();
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(buf);
    }

    /// Bytes held by idle buffers.
    pub fn idle_bytes(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|b| b.capacity())
            .sum()
    }
}

/// Fused all-reduces of one model's gradients, step after step: the communicator, the
/// reduction, the bucket sizes, and staging buffers reused between steps.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use hcomm::{Communicator, ReduceOp};
/// # use hcomm::fusion::{Fusion, FusionOptions};
/// let comm = Arc::new(Communicator::from_env()?);
/// let fusion = Fusion::new(&comm, ReduceOp::Mean, FusionOptions::default());
/// let mut grads: Vec<Vec<f32>> = vec![vec![1.0; 1000]; 100];
/// fusion.step(|bucketer| {
///     for g in grads.iter_mut().rev() {
///         // ... compute this gradient (backward pass, last layer first) ...
///         bucketer.push(g)?;
///     }
///     Ok(())
/// })?;
/// // every gradient now holds the mean over the ranks
/// # Ok::<(), hcomm::Error>(())
/// ```
#[derive(Debug)]
pub struct Fusion {
    comm: Arc<Communicator>,
    op: ReduceOp,
    opts: FusionOptions,
    pool: BufferPool,
    /// The state a new bucket starts from, when buckets are compressed.
    compression: Option<CompressionState>,
    /// Each bucket's compression state between steps.
    states: BucketStates,
}

/// A bucket's identity from step to step: its members (positions in the step) and bytes.
pub type StateKey = (Vec<usize>, usize);

/// A stable hash of a bucket's identity (mixed into random-k's seed; the same on every rank,
/// and the same in every binding that keys compression states by bucket).
pub fn key_hash(key: &StateKey) -> u64 {
    key.0
        .iter()
        .chain(std::iter::once(&key.1))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &v| {
            (h ^ v as u64).wrapping_mul(0x0100_0000_01b3)
        })
}

/// A bucket's compression state, taken for its all-reduce and put back after it.
pub type BucketState = (StateKey, CompressionState);

/// Each bucket's compression state (residuals) between steps, keyed by the bucket's identity,
/// so that a bucket of the same tensors finds its residual again next step.
#[derive(Debug, Default)]
pub struct BucketStates(Mutex<HashMap<StateKey, CompressionState>>);

impl BucketStates {
    /// The state of `bucket`: the one kept from an earlier step, or a copy of `fresh` keyed by
    /// the bucket.
    pub fn take(&self, fresh: &CompressionState, bucket: &Bucket) -> BucketState {
        let key: StateKey = (bucket.members.clone(), bucket.bytes);
        let state = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key)
            .unwrap_or_else(|| fresh.clone().with_key(key_hash(&key)));
        (key, state)
    }

    /// Keep a bucket's state for the next step.
    pub fn put(&self, (key, state): BucketState) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, state);
    }

    /// Forget every state.
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// States kept, and the bytes their residuals hold.
    pub fn memory(&self) -> (usize, usize) {
        let states = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (
            states.len(),
            states.values().map(|s| s.memory_bytes()).sum(),
        )
    }
}

/// With [`FusionOptions::encode_on_push`] (`on`), do a compressed bucket's local part now, on
/// the calling thread ([`CompressionState::prepare_bytes`]); the bucket's job then finds it
/// done. Nothing for uncompressed buckets.
pub fn prepare_bucket(state: &mut Option<BucketState>, bytes: &mut [u8], on: bool) {
    if let (true, Some((_, state))) = (on, state.as_mut()) {
        state.prepare_bytes(bytes);
    }
}

/// All-reduce one bucket's bytes: compressed with its state when it has one, else plainly
/// (skipping zero blocks with `skip_zeros`, see [`FusionOptions::skip_zero_blocks`]).
pub fn reduce_bucket(
    c: &Communicator,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    state: &mut Option<BucketState>,
    skip_zeros: bool,
) -> Result<()> {
    match state {
        Some((_, state)) => c.all_reduce_compressed_bytes(buf, dtype, op, state),
        None if skip_zeros => c.all_reduce_skipping_zeros_bytes(buf, dtype, op).map(drop),
        None => c.all_reduce_bytes(None, buf, dtype, op),
    }
}

impl Fusion {
    /// Fusion on `comm`, reducing with `op`.
    pub fn new(comm: &Arc<Communicator>, op: ReduceOp, opts: FusionOptions) -> Fusion {
        Fusion {
            comm: comm.clone(),
            op,
            opts,
            pool: BufferPool::new(),
            compression: None,
            states: BucketStates::default(),
        }
    }

    /// All-reduce every bucket compressed with `compressor`, with or without error feedback
    /// (see [`crate::compress`]). Every tensor pushed must then be f32, and the reduction
    /// `Sum` or `Mean`; a bad compressor parameter or another reduction is an
    /// [`Error::InvalidArgument`]. `Compressor::None` runs the plain all-reduce (any dtype).
    pub fn with_compression(
        mut self,
        compressor: Compressor,
        error_feedback: bool,
    ) -> Result<Fusion> {
        if !matches!(self.op, ReduceOp::Sum | ReduceOp::Mean) {
            return Err(Error::invalid(
                "fusion",
                0,
                format!(
                    "compressed buckets are summed or averaged; this Fusion reduces with {}",
                    self.op
                ),
            ));
        }
        self.compression =
            Some(CompressionState::new(compressor)?.with_error_feedback(error_feedback));
        self.states.clear();
        Ok(self)
    }

    /// The compressor of the buckets, if any.
    pub fn compressor(&self) -> Option<Compressor> {
        self.compression.as_ref().map(|s| s.compressor())
    }

    /// Forget every bucket's residual (e.g. when the model changes).
    pub fn reset_compression(&self) {
        self.states.clear();
    }

    /// Buckets with a compression state kept between steps, and the bytes their residuals
    /// hold.
    pub fn compression_memory(&self) -> (usize, usize) {
        self.states.memory()
    }

    /// The staging buffers kept between steps.
    pub fn pool(&self) -> &BufferPool {
        &self.pool
    }

    /// One step: `f` pushes tensors into the [`Bucketer`] as they become ready (buckets are
    /// launched while it keeps computing); then the step launches what is left, waits for
    /// every bucket and leaves the results in the tensors.
    ///
    /// The tensors stay borrowed until `step` returns, so they cannot be touched while their
    /// bucket is in flight. `step` waits for every launched bucket before it returns, even
    /// when `f` fails or panics; when `f` fails or panics, the buckets still open are not
    /// launched (that rank alone may have failed), so their tensors are left as they were. On
    /// a communication error the tensors' contents are unspecified (the communicator is then
    /// poisoned).
    ///
    /// ```compile_fail,E0499
    /// # fn f(fusion: &hcomm::fusion::Fusion) -> hcomm::Result<()> {
    /// let mut grad = vec![0.5f32; 1024];
    /// fusion.step(|b| {
    ///     b.push(&mut grad)?;
    ///     grad[0] = 1.0; // error: `grad` is lent to the step until it returns
    ///     Ok(())
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn step<'env, R, F>(&self, f: F) -> Result<R>
    where
        F: for<'scope> FnOnce(&mut Bucketer<'scope, 'env>) -> Result<R>,
    {
        // The lending scope returns only once every tensor lent to a job is back.
        lent::scope(|lender| {
            let mut b = Bucketer {
                fusion: self,
                lender,
                planner: BucketPlanner::new(self.opts),
                tensors: Vec::new(),
                in_flight: VecDeque::new(),
                launched: 0,
                _scope: PhantomData,
            };
            // On the closure's error, the open buckets are not launched (this rank alone may
            // have failed: launching would run collectives its peers do not); dropping the
            // bucketer still waits for the buckets in flight.
            let r = f(&mut b)?;
            b.finish()?;
            Ok(r)
        })
    }
}

/// What a bucket's all-reduce hands back: the staging buffer of a packed bucket (returned to
/// the pool), nothing for a tensor reduced in place; and the bucket's compression state.
type BucketWork = Work<(Option<Vec<u8>>, Option<BucketState>)>;

/// Takes tensors for one [`Fusion::step`] and launches their buckets.
///
/// `'env` is how long the tensors are borrowed; `'scope` (invariant) ties the bucketer to its
/// step, so it cannot be moved out of it or swapped with another step's.
pub struct Bucketer<'scope, 'env> {
    fusion: &'scope Fusion,
    lender: &'scope Lender<'env>,
    planner: BucketPlanner,
    tensors: Vec<Option<TensorMut<'env>>>,
    in_flight: VecDeque<(Bucket, BucketWork)>,
    launched: usize,
    _scope: PhantomData<&'scope mut &'scope ()>,
}

impl<'scope, 'env> Bucketer<'scope, 'env> {
    /// Add a ready tensor; launches a bucket when this fills one (or the tensor itself when it
    /// is at least [`FusionOptions::direct_bytes`]).
    ///
    /// With compression, a tensor that is not f32 is refused ([`Error::InvalidArgument`]; the
    /// tensor is not taken and nothing is launched for it).
    pub fn push(&mut self, tensor: impl Into<TensorMut<'env>>) -> Result<()> {
        let t = tensor.into();
        let (dtype, bytes) = (t.dtype, t.bytes.len());
        let index = self.tensors.len();
        if let Some(c) = self.fusion.compressor().filter(|c| c.is_lossy()) {
            if dtype != DType::F32 {
                return Err(Error::invalid(
                    "fusion",
                    0,
                    format!(
                        "compressor {c} takes f32 tensors; tensor #{index} of this step is {dtype}"
                    ),
                ));
            }
        }
        self.tensors.push(Some(t));
        for b in self.planner.add(index, dtype, bytes) {
            self.launch(b);
        }
        Ok(())
    }

    /// Launch every open bucket now (the step does it anyway when the closure returns).
    pub fn flush(&mut self) {
        for b in self.planner.flush() {
            self.launch(b);
        }
    }

    /// Buckets (all-reduces) launched so far in this step.
    pub fn buckets_launched(&self) -> usize {
        self.launched
    }

    fn launch(&mut self, bucket: Bucket) {
        let (dtype, op) = (bucket.dtype, self.fusion.op);
        let lossy = self
            .fusion
            .compression
            .as_ref()
            .filter(|s| s.compressor().is_lossy());
        let mut comp = lossy.map(|fresh| self.fusion.states.take(fresh, &bucket));
        let (skip_zeros, encode_here) = (
            self.fusion.opts.skip_zero_blocks,
            self.fusion.opts.encode_on_push,
        );
        let reduce = move |c: &Communicator, buf: &mut [u8], comp: &mut Option<BucketState>| {
            reduce_bucket(c, buf, dtype, op, comp, skip_zeros)
        };
        let work = if bucket.direct {
            // The tensor is lent to the job for good: it is reduced in place, nothing of this
            // step touches it again, and the step's lending scope waits for it.
            let t = self.tensors[bucket.members[0]]
                .take()
                .expect("a tensor is in one bucket only");
            prepare_bucket(&mut comp, t.bytes, encode_here);
            let mut lent = self.lender.lend(t.bytes);
            self.fusion.comm.run_async("all_reduce", move |c| {
                reduce(c, lent.as_mut(), &mut comp)?;
                Ok((None, comp))
            })
        } else {
            let mut buf = self.fusion.pool.take(bucket.bytes);
            for &i in &bucket.members {
                let t = self.tensors[i]
                    .as_ref()
                    .expect("a tensor is in one bucket only");
                buf.extend_from_slice(t.bytes);
            }
            prepare_bucket(&mut comp, &mut buf, encode_here);
            self.fusion.comm.run_async("all_reduce", move |c| {
                reduce(c, &mut buf, &mut comp)?;
                Ok((Some(buf), comp))
            })
        };
        self.launched += 1;
        self.in_flight.push_back((bucket, work));
    }

    /// Launch what is left, wait for every bucket, unpack. Waits for everything even after an
    /// error; returns the first.
    fn finish(&mut self) -> Result<()> {
        self.flush();
        let mut first_err = None;
        while let Some((bucket, work)) = self.in_flight.pop_front() {
            let result = work.wait().map(|(buf, comp)| {
                if let Some(state) = comp {
                    self.fusion.states.put(state);
                }
                buf
            });
            match result {
                Ok(Some(buf)) => {
                    let mut off = 0;
                    for &i in &bucket.members {
                        let t = self.tensors[i].as_mut().expect("unpacked once");
                        let n = t.bytes.len();
                        t.bytes.copy_from_slice(&buf[off..off + n]);
                        off += n;
                    }
                    self.fusion.pool.give(buf);
                }
                Ok(None) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Bucketer<'_, '_> {
    /// Reached with buckets in flight only when the step's closure panicked: wait for them,
    /// so no lent tensor is freed while the engine still uses it.
    fn drop(&mut self) {
        while let Some((_, work)) = self.in_flight.pop_front() {
            let _ = work.wait();
        }
    }
}

impl Communicator {
    /// All-reduce every tensor in `tensors` (any mix of sizes and dtypes) in fused buckets of
    /// `opts` size; the results land in the tensors, as if each had been all-reduced alone.
    /// For repeated steps, keep a [`Fusion`] (it reuses its staging buffers).
    pub fn all_reduce_coalesced(
        self: &Arc<Self>,
        tensors: Vec<TensorMut<'_>>,
        op: ReduceOp,
        opts: FusionOptions,
    ) -> Result<()> {
        Fusion::new(self, op, opts).step(|b| {
            for t in tensors {
                b.push(t)?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::I64];

    proptest! {
        #[test]
        fn every_tensor_is_planned_exactly_once_within_the_cap(
            tensors in proptest::collection::vec((0usize..3, 0usize..5000), 0..200),
            cap in 1usize..20_000,
            first in 1usize..20_000,
            direct in prop_oneof![Just(usize::MAX), 1usize..10_000],
        ) {
            let tensors: Vec<(DType, usize)> =
                tensors.into_iter().map(|(d, n)| (DTYPES[d], n)).collect();
            let opts = FusionOptions { cap_bytes: cap, first_bucket_bytes: first, direct_bytes: direct, skip_zero_blocks: false, encode_on_push: false };
            let plan = plan_buckets(&tensors, opts);
            let mut seen = vec![0; tensors.len()];
            // The first bucket closed uses `first`, later ones `cap`; a bucket opened before the
            // first one closed may have filled under either.
            let limit = cap.max(first);
            for b in &plan {
                prop_assert!(!b.members.is_empty());
                if b.direct {
                    prop_assert_eq!(b.members.len(), 1);
                    prop_assert!(b.bytes >= direct);
                } else {
                    prop_assert!(b.members.iter().all(|&i| tensors[i].1 < direct));
                }
                let total: usize = b.members.iter().map(|&i| tensors[i].1).sum();
                prop_assert_eq!(total, b.bytes);
                // Within the cap, unless a single tensor is larger than it.
                prop_assert!(b.bytes <= limit || b.members.len() == 1);
                if b.members.len() > 1 {
                    // All but the last member fit under the cap in force when it was added.
                    let before_last = b.bytes - tensors[*b.members.last().unwrap()].1;
                    prop_assert!(before_last < limit);
                }
                prop_assert!(b.members.windows(2).all(|w| w[0] < w[1]), "order kept");
                for &i in &b.members {
                    prop_assert_eq!(tensors[i].0, b.dtype);
                    seen[i] += 1;
                }
            }
            prop_assert!(seen.iter().all(|&s| s == 1), "every tensor exactly once: {:?}", seen);
        }
    }

    #[test]
    fn strict_cap_when_the_first_bucket_is_not_special() {
        let tensors = vec![(DType::F32, 40); 10];
        let plan = plan_buckets(&tensors, FusionOptions::with_cap(100));
        let sizes: Vec<usize> = plan.iter().map(|b| b.bytes).collect();
        assert_eq!(sizes, vec![80, 80, 80, 80, 80]);
        assert!(plan.iter().all(|b| b.bytes <= 100));
    }

    #[test]
    fn small_first_bucket_then_the_cap() {
        let tensors = vec![(DType::F32, 10); 30];
        let plan = plan_buckets(
            &tensors,
            FusionOptions {
                cap_bytes: 100,
                first_bucket_bytes: 20,
                direct_bytes: usize::MAX,
                skip_zero_blocks: false,
                encode_on_push: false,
            },
        );
        let sizes: Vec<usize> = plan.iter().map(|b| b.bytes).collect();
        assert_eq!(sizes, vec![20, 100, 100, 80]);
    }

    #[test]
    fn large_tensors_go_direct_without_closing_the_open_bucket() {
        let tensors = vec![(DType::F32, 10), (DType::F32, 1000), (DType::F32, 10)];
        let opts = FusionOptions {
            direct_bytes: 500,
            ..FusionOptions::with_cap(100)
        };
        let plan = plan_buckets(&tensors, opts);
        assert_eq!(
            plan.iter()
                .map(|b| (b.members.clone(), b.direct))
                .collect::<Vec<_>>(),
            vec![(vec![1], true), (vec![0, 2], false)]
        );
    }

    #[test]
    fn oversized_tensors_get_their_own_bucket_and_dtypes_never_mix() {
        let tensors = vec![
            (DType::F32, 10),
            (DType::F32, 500),
            (DType::I64, 8),
            (DType::F32, 10),
        ];
        let plan = plan_buckets(&tensors, FusionOptions::with_cap(100));
        assert_eq!(
            plan.iter().map(|b| b.members.clone()).collect::<Vec<_>>(),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
    }
}
