//! Gradient fusion: many small tensors all-reduced as a few large buckets, so a model with
//! hundreds of parameters pays a collective's start-up cost a few times per step instead of
//! hundreds, and buckets are launched while the caller is still computing.
//!
//! * [`BucketPlanner`] decides which tensors share a bucket (pure; property-tested).
//! * [`Bucketer`] takes tensors one at a time, in the order gradients become ready, copies
//!   each closed bucket into a staging buffer and starts its all-reduce asynchronously;
//!   [`Bucketer::finish`] waits and copies the results back into the tensors.
//! * [`Communicator::all_reduce_coalesced`] does both for a list of tensors.
//!
//! Buckets hold one dtype each (tensors of several dtypes are grouped by dtype). A bucket
//! closes when it reaches the cap, or before a tensor that would push it past the cap; a
//! tensor larger than the cap gets a bucket of its own. The first bucket closed may use a
//! smaller cap (as DDP does) so communication starts early in the backward pass.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::engine::Work;
use crate::error::{Error, Result};

/// Bucket sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionOptions {
    /// Bytes per bucket (default 25 MiB, DDP's `bucket_cap_mb`).
    pub cap_bytes: usize,
    /// Bytes of the first bucket closed (default 1 MiB, as DDP); equal to `cap_bytes` to
    /// disable the smaller first bucket.
    pub first_bucket_bytes: usize,
}

impl Default for FusionOptions {
    fn default() -> Self {
        FusionOptions {
            cap_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
        }
    }
}

impl FusionOptions {
    /// Buckets of `cap_bytes`, the first one too.
    pub fn with_cap(cap_bytes: usize) -> FusionOptions {
        FusionOptions {
            cap_bytes,
            first_bucket_bytes: cap_bytes,
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

/// Launches fused all-reduces as tensors become ready; see the module documentation.
///
/// The tensors stay borrowed until [`finish`](Self::finish), so the caller cannot touch them
/// while their bucket is in flight; it is free to compute anything else.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use hcomm::{Communicator, ReduceOp};
/// # use hcomm::fusion::{Bucketer, FusionOptions};
/// let comm = Arc::new(Communicator::from_env()?);
/// let mut grads: Vec<Vec<f32>> = vec![vec![1.0; 1000]; 100];
/// let mut bucketer = Bucketer::new(&comm, ReduceOp::Mean, FusionOptions::default());
/// for g in grads.iter_mut().rev() {
///     // ... compute this gradient (backward pass, last layer first) ...
///     bucketer.push(g)?;
/// }
/// bucketer.finish()?; // every gradient now holds the mean over the ranks
/// # Ok::<(), hcomm::Error>(())
/// ```
pub struct Bucketer<'a> {
    comm: Arc<Communicator>,
    op: ReduceOp,
    planner: BucketPlanner,
    pool: BufferPool,
    tensors: Vec<Option<TensorMut<'a>>>,
    in_flight: VecDeque<(Bucket, Work<Vec<u8>>)>,
    launched: usize,
}

impl<'a> Bucketer<'a> {
    /// A bucketer reducing with `op`, with its own buffer pool.
    pub fn new(comm: &Arc<Communicator>, op: ReduceOp, opts: FusionOptions) -> Bucketer<'a> {
        Self::with_pool(comm, op, opts, BufferPool::new())
    }

    /// A bucketer that takes staging buffers from `pool` and returns them to it.
    pub fn with_pool(
        comm: &Arc<Communicator>,
        op: ReduceOp,
        opts: FusionOptions,
        pool: BufferPool,
    ) -> Bucketer<'a> {
        Bucketer {
            comm: comm.clone(),
            op,
            planner: BucketPlanner::new(opts),
            pool,
            tensors: Vec::new(),
            in_flight: VecDeque::new(),
            launched: 0,
        }
    }

    /// Add a ready tensor; launches a bucket when this fills one.
    pub fn push(&mut self, tensor: impl Into<TensorMut<'a>>) -> Result<()> {
        let t = tensor.into();
        let (dtype, bytes) = (t.dtype, t.bytes.len());
        let index = self.tensors.len();
        self.tensors.push(Some(t));
        for b in self.planner.add(index, dtype, bytes) {
            self.launch(b);
        }
        Ok(())
    }

    /// Buckets launched so far.
    pub fn buckets_launched(&self) -> usize {
        self.launched
    }

    fn launch(&mut self, bucket: Bucket) {
        let mut buf = self.pool.take(bucket.bytes);
        for &i in &bucket.members {
            let t = self.tensors[i]
                .as_ref()
                .expect("a tensor is in one bucket only");
            buf.extend_from_slice(t.bytes);
        }
        let (dtype, op) = (bucket.dtype, self.op);
        let work = self.comm.run_async("all_reduce", move |c| {
            c.all_reduce_bytes(None, &mut buf, dtype, op)?;
            Ok(buf)
        });
        self.launched += 1;
        self.in_flight.push_back((bucket, work));
    }

    /// Launch what is left, wait for every bucket and copy the results into the tensors.
    /// On error the tensors' contents are unspecified (the communicator is poisoned).
    pub fn finish(mut self) -> Result<()> {
        for b in self.planner.flush() {
            self.launch(b);
        }
        let mut first_err = None;
        while let Some((bucket, work)) = self.in_flight.pop_front() {
            match work.wait() {
                Ok(buf) => {
                    let mut off = 0;
                    for &i in &bucket.members {
                        let t = self.tensors[i].take().expect("unpacked once");
                        let n = t.bytes.len();
                        t.bytes.copy_from_slice(&buf[off..off + n]);
                        off += n;
                    }
                    self.pool.give(buf);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Communicator {
    /// All-reduce every tensor in `tensors` (any mix of sizes and dtypes) in fused buckets of
    /// `opts` size; the results land in the tensors, as if each had been all-reduced alone.
    pub fn all_reduce_coalesced(
        self: &Arc<Self>,
        tensors: Vec<TensorMut<'_>>,
        op: ReduceOp,
        opts: FusionOptions,
    ) -> Result<()> {
        let mut b = Bucketer::new(self, op, opts);
        for t in tensors {
            b.push(t)?;
        }
        b.finish()
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
        ) {
            let tensors: Vec<(DType, usize)> =
                tensors.into_iter().map(|(d, n)| (DTYPES[d], n)).collect();
            let opts = FusionOptions { cap_bytes: cap, first_bucket_bytes: first };
            let plan = plan_buckets(&tensors, opts);
            let mut seen = vec![0; tensors.len()];
            // The first bucket closed uses `first`, later ones `cap`; a bucket opened before the
            // first one closed may have filled under either.
            let limit = cap.max(first);
            for b in &plan {
                prop_assert!(!b.members.is_empty());
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
            },
        );
        let sizes: Vec<usize> = plan.iter().map(|b| b.bytes).collect();
        assert_eq!(sizes, vec![20, 100, 100, 80]);
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
