//! Compressed reduce-scatter with error feedback: what FSDP's gradient reduction needs.
//!
//! [`Communicator::reduce_scatter_compressed`] takes the `world_size` equal chunks of an f32
//! vector on every rank and leaves on rank `r` the sum (or mean) over the ranks of chunk `r`,
//! while a compressed form travels:
//!
//! | [`Compressor`] | on the wire (per rank) | how it is reduced |
//! |---|---|---|
//! | `Fp16`, `Bf16` | 2 bytes / element | reduce-scatter in f16 (bf16): every step adds in f32 and rounds once |
//! | `Int8`, `Sign` | 1 byte (1 bit) / element + 4 bytes / block | each chunk encoded on its own, all-to-all, the owner decodes and sums in f32 in rank order |
//! | `None` | 4 bytes / element | the exact reduce-scatter |
//!
//! Each rank sends `(n-1)/n` of its encoded vector, as a ring reduce-scatter does with the
//! dense one. With error feedback the state's residual (one per element of the *input*) is
//! added to the input before encoding and keeps what the encoding dropped, so over many steps
//! `sum of outputs + sum of residuals == sum of inputs` (up to f32 rounding; fp16/bf16 also
//! round their partial sums, which is not fed back, as in the all-reduce). The int8/sign
//! chunks start at chunk boundaries, so blocks never straddle two owners; the last block of
//! each chunk may be short.
//!
//! Top-k and random-k are refused: they pick elements of the whole vector, so their bytes do
//! not split evenly between owners; use them with the all-reduce.

use super::{Codec, CompressionState, Compressor, Half, Int8Block, SignBlock};
use crate::base::dtype::{DType, ReduceOp};
use crate::base::error::{Error, Result};
use crate::comm::traffic::TrafficScope;
use crate::comm::Communicator;

const OP: &str = "reduce_scatter_compressed";

fn bad(msg: String) -> Error {
    Error::invalid(OP, 0, msg)
}

impl Communicator {
    /// Reduce-scatter compressed: `send` holds `world_size` equal chunks of f32; `recv`
    /// (one chunk) receives the sum (`op` `Sum`) or mean (`Mean`) over the ranks of chunk
    /// `rank`, computed from compressed chunks (see the documentation of the module `compress::reduce_scatter`).
    ///
    /// With error feedback (the default) `state`'s residual, one value per element of
    /// `send`, is added to `send` before encoding and keeps what the encoding dropped; keep
    /// one state per tensor and pass it to every call for that tensor. The state binds to
    /// `send`'s length and the communicator's size at its first use. Every rank must call it
    /// with the same compressor and sizes, in the same order as its other operations. The
    /// call runs as one operation, and its bytes are counted under
    /// `reduce_scatter_compressed` in [`traffic`](Self::traffic).
    ///
    /// Errors ([`Error::InvalidArgument`], nothing sent): `op` other than `Sum`/`Mean`;
    /// `send.len() != world_size * recv.len()`; a top-k or random-k compressor; a state bound
    /// to another length or world size, or used by a hierarchical compressed all-reduce.
    pub fn reduce_scatter_compressed(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        state: &mut CompressionState,
    ) -> Result<()> {
        let world = self.world_size();
        if !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
            return Err(bad(format!(
                "compressed reduce-scatter sums or averages; got op {op}"
            )));
        }
        if send.len() != recv.len() * world {
            return Err(bad(format!(
                "send buffer has {} elements, expected world_size ({world}) x recv count ({}) = {}",
                send.len(),
                recv.len(),
                recv.len() * world
            )));
        }
        if matches!(
            state.compressor,
            Compressor::TopK(_) | Compressor::RandomK { .. }
        ) {
            return Err(bad(format!(
                "compressor {} picks elements of the whole vector; a compressed reduce-scatter takes \
                 fp16, bf16, int8, int8sr, sign or none (top-k and random-k work with all_reduce_compressed)",
                state.compressor
            )));
        }
        if state.across.is_some() {
            return Err(bad(
                "this CompressionState holds a hierarchical compressed all-reduce's residuals; \
                 keep one state per tensor and operation (or reset() it)"
                    .into(),
            ));
        }
        state.compressor.validate()?;
        state.bind(send.len(), world, self.rank())?;
        // One unit: the collectives below run back to back in this operation's turn.
        let _turn = self.engine().turns.enter();
        let _traffic = TrafficScope::enter(self, OP);
        let step = state.steps;
        state.steps += 1;
        let ef = state.error_feedback;
        if ef && state.compressor.is_lossy() {
            state.size_residual(send.len());
        }
        let m = recv.len();
        match state.compressor {
            Compressor::None => {
                let counts = vec![m; world];
                self.reduce_scatter_v_bytes(
                    Some(bytemuck::cast_slice(send)),
                    bytemuck::cast_slice_mut(recv),
                    &counts,
                    DType::F32,
                    ReduceOp::Sum,
                )?;
            }
            Compressor::Fp16 | Compressor::Bf16 => {
                let (mut codec, dtype) = if state.compressor == Compressor::Fp16 {
                    (Half::F16, DType::F16)
                } else {
                    (Half::Bf16, DType::BF16)
                };
                let mut enc = vec![0u8; codec.encoded_len(send.len())];
                if ef {
                    codec.encode_keeping_error(send, &mut state.residual, &mut enc)?;
                } else {
                    codec.encode(send, &mut enc)?;
                }
                let mut out = vec![0u8; codec.encoded_len(m)];
                self.reduce_scatter_v_bytes(
                    Some(&enc),
                    &mut out,
                    &vec![m; world],
                    dtype,
                    ReduceOp::Sum,
                )?;
                codec.decode(&out, recv)?;
            }
            Compressor::Int8 { block, stochastic } => {
                let seed = super::mix_seed(&[state.key, step, self.rank() as u64, 0x5c7]);
                let mut codec = if stochastic {
                    Int8Block::stochastic(block, seed)?
                } else {
                    Int8Block::new(block)?
                };
                self.chunk_exchange(send, recv, state, &mut codec)?;
            }
            Compressor::Sign { block } => {
                let mut codec = SignBlock::new(block)?;
                self.chunk_exchange(send, recv, state, &mut codec)?;
            }
            Compressor::TopK(_) | Compressor::RandomK { .. } => unreachable!("refused above"),
        }
        if op == ReduceOp::Mean {
            super::divide(recv, world);
        }
        Ok(())
    }

    /// int8 / sign: encode each rank's chunk of `send` on its own (with error feedback when
    /// on), all-to-all, and sum the encodings of this rank's chunk in rank order into `recv`.
    fn chunk_exchange<C: Codec>(
        &self,
        send: &[f32],
        recv: &mut [f32],
        state: &mut CompressionState,
        codec: &mut C,
    ) -> Result<()> {
        let m = recv.len();
        let world = self.world_size();
        // every chunk has m elements, so every encoding has the same length
        let len = codec.encoded_len(m);
        // Reused between calls, in this operation's turn (see `Communicator::scratch`); every
        // byte is written before it is read.
        let mut scratch = self.scratch();
        let (out, got, _, _) = scratch.take(len * world, len * world, 0, 0);
        if m > 0 {
            for (c, enc) in out.chunks_mut(len).enumerate() {
                let chunk = c * m..(c + 1) * m;
                if state.error_feedback {
                    codec.encode_keeping_error(
                        &send[chunk.clone()],
                        &mut state.residual[chunk],
                        enc,
                    )?;
                } else {
                    codec.encode(&send[chunk], enc)?;
                }
            }
        }
        self.all_to_all(out, got)?;
        recv.fill(0.0);
        if m > 0 {
            for part in got.chunks(len) {
                codec.decode_add(part, recv)?;
            }
        }
        Ok(())
    }

    /// [`reduce_scatter_compressed`](Self::reduce_scatter_compressed) on bytes holding f32
    /// elements (any alignment); `dtype` must be `F32`.
    pub fn reduce_scatter_compressed_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        state: &mut CompressionState,
    ) -> Result<()> {
        if dtype != DType::F32 {
            return Err(bad(format!(
                "compressed reduce-scatter takes f32 data; got {dtype} (compressor {})",
                state.compressor
            )));
        }
        if !send.len().is_multiple_of(4) || !recv.len().is_multiple_of(4) {
            return Err(bad(format!(
                "buffers of {} and {} bytes are not whole numbers of f32 elements",
                send.len(),
                recv.len()
            )));
        }
        let s: std::borrow::Cow<[f32]> = match bytemuck::try_cast_slice::<u8, f32>(send) {
            Ok(s) => s.into(),
            Err(_) => {
                let mut v = vec![0f32; send.len() / 4];
                bytemuck::cast_slice_mut::<f32, u8>(&mut v).copy_from_slice(send);
                v.into()
            }
        };
        match bytemuck::try_cast_slice_mut::<u8, f32>(recv) {
            Ok(r) => self.reduce_scatter_compressed(&s, r, op, state),
            Err(_) => {
                let mut r = vec![0f32; recv.len() / 4];
                self.reduce_scatter_compressed(&s, &mut r, op, state)?;
                recv.copy_from_slice(bytemuck::cast_slice(&r));
                Ok(())
            }
        }
    }
}
