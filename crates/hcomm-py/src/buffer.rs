//! Python buffers (numpy arrays and CPU torch tensors) as raw byte ranges.
//!
//! Only contiguous, native-endian memory of a supported dtype is accepted; anything else is a
//! `TypeError` (wrong kind of object, unsupported dtype) or a `ValueError` (not contiguous,
//! not on the CPU, read-only output) naming the call and the argument.

use crate::errors::invalid_argument;
use hcomm::DType;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Supported dtypes by numpy / torch name.
pub const DTYPE_NAMES: [(&str, DType); 11] = [
    ("float32", DType::F32),
    ("float64", DType::F64),
    ("float16", DType::F16),
    ("bfloat16", DType::BF16),
    ("int8", DType::I8),
    ("int16", DType::I16),
    ("int32", DType::I32),
    ("int64", DType::I64),
    ("uint8", DType::U8),
    ("uint32", DType::U32),
    ("uint64", DType::U64),
];

fn supported() -> String {
    DTYPE_NAMES
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

fn dtype_named(op: &str, what: &str, name: &str) -> PyResult<DType> {
    DTYPE_NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, d)| *d)
        .ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{op}: {what} has dtype {name}, which hcomm does not communicate (supported: {})",
                supported()
            ))
        })
}

/// A byte range of a Python object that the caller keeps alive, with its element type.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    addr: usize,
    len: usize,
    pub dtype: DType,
}

impl Buf {
    /// An empty buffer (for arguments a rank does not use).
    pub fn empty(dtype: DType) -> Buf {
        Buf {
            addr: 0,
            len: 0,
            dtype,
        }
    }

    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.len / self.dtype.size()
    }

    /// True when both are the same non-empty range.
    pub fn same_memory(&self, o: &Buf) -> bool {
        self.len > 0 && self.addr == o.addr && self.len == o.len
    }

    /// True when the ranges share at least one byte.
    pub fn overlaps(&self, o: &Buf) -> bool {
        self.len > 0 && o.len > 0 && self.addr < o.addr + o.len && o.addr < self.addr + self.len
    }

    /// The bytes.
    ///
    /// # Safety
    /// The object the range came from must stay alive, unmoved and unresized while the slice
    /// is used, and no `bytes_mut` view of an overlapping range may exist at the same time.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            &[]
        } else {
            // SAFETY: the caller's obligation (see above); the range was checked to be the
            // object's contiguous data.
            unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
        }
    }

    /// The bytes, writable.
    ///
    /// # Safety
    /// As for [`bytes`](Self::bytes), and no other view of an overlapping range may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            &mut []
        } else {
            // SAFETY: as above; the object reported the range as writable.
            unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
        }
    }
}

/// Check that input and output have one dtype.
pub fn same_dtype(op: &str, input: Option<&Buf>, output: &Buf) -> PyResult<()> {
    match input {
        Some(i) if i.dtype != output.dtype => Err(PyTypeError::new_err(format!(
            "{op}: input has dtype {} but output has dtype {}",
            dtype_name(i.dtype),
            dtype_name(output.dtype)
        ))),
        _ => Ok(()),
    }
}

/// numpy / torch name of a dtype.
pub fn dtype_name(d: DType) -> &'static str {
    DTYPE_NAMES
        .iter()
        .find(|(_, x)| *x == d)
        .map(|(n, _)| *n)
        .unwrap_or("?")
}

/// [`buffer`] for an optional argument.
pub fn opt_buffer(
    op: &str,
    what: &str,
    obj: Option<&Bound<'_, PyAny>>,
    writable: bool,
) -> PyResult<Option<Buf>> {
    obj.filter(|o| !o.is_none())
        .map(|o| buffer(op, what, o, writable))
        .transpose()
}

/// The memory of a numpy array or CPU torch tensor. `op` and `what` name the call and the
/// argument in errors; `writable` refuses read-only arrays.
pub fn buffer(op: &str, what: &str, obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Buf> {
    if obj.hasattr("data_ptr")? && obj.hasattr("is_contiguous")? {
        return torch_buffer(op, what, obj);
    }
    if let Ok(ai) = obj.getattr("__array_interface__") {
        return array_buffer(op, what, obj, &ai, writable);
    }
    let ty = obj.get_type().name()?;
    Err(PyTypeError::new_err(format!(
        "{op}: {what} must be a numpy.ndarray or a CPU torch.Tensor, got {ty}"
    )))
}

fn torch_buffer(op: &str, what: &str, t: &Bound<'_, PyAny>) -> PyResult<Buf> {
    let device = t.getattr("device")?.getattr("type")?.extract::<String>()?;
    if device != "cpu" {
        return Err(invalid_argument(format!(
            "{op}: {what} is on device '{device}'; hcomm communicates CPU tensors (use .cpu())"
        )));
    }
    let layout = t.getattr("layout")?.str()?.to_string();
    if layout != "torch.strided" {
        return Err(invalid_argument(format!(
            "{op}: {what} has layout {layout}; hcomm needs a dense (strided) tensor"
        )));
    }
    // A lazily negated view (`torch._neg_view`, what `x.conj().imag` gives) keeps the values
    // un-negated in memory: reading or writing its bytes would give the wrong sign.
    if t.call_method0("is_neg")?.extract::<bool>()? {
        return Err(invalid_argument(format!(
            "{op}: {what} is a negated view (from x.conj().imag or torch._neg_view): its memory \
             holds the values with the other sign; pass tensor.resolve_neg() (a copy)"
        )));
    }
    let dtype = t.getattr("dtype")?.str()?.to_string();
    let dtype = dtype_named(op, what, dtype.strip_prefix("torch.").unwrap_or(&dtype))?;
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        let shape = t.getattr("shape")?.str()?.to_string();
        let stride = t.call_method0("stride")?.str()?.to_string();
        return Err(invalid_argument(format!(
            "{op}: {what} is not contiguous ({shape}, strides {stride}); pass a contiguous \
             tensor (tensor.contiguous() makes a copy, and the result would not land in the original)"
        )));
    }
    let numel: usize = t.call_method0("numel")?.extract()?;
    let esize: usize = t.call_method0("element_size")?.extract()?;
    if esize != dtype.size() {
        return Err(PyTypeError::new_err(format!(
            "{op}: {what} has {esize}-byte elements, expected {}",
            dtype.size()
        )));
    }
    let len = numel
        .checked_mul(esize)
        .ok_or_else(|| invalid_argument(format!("{op}: {what} has {numel} elements: too large")))?;
    let addr: usize = if numel == 0 {
        0
    } else {
        t.call_method0("data_ptr")?.extract()?
    };
    if numel > 0 {
        // The tensor's shape is not its memory: a storage resized after the tensor was made
        // (`t.untyped_storage().resize_(0)`, how FSDP frees unsharded parameters) leaves the
        // shape as it was over fewer bytes, or none (a null data pointer).
        let storage = t.call_method0("untyped_storage")?;
        let nbytes: usize = storage.call_method0("nbytes")?.extract()?;
        let offset: usize = t.call_method0("storage_offset")?.extract()?;
        let end = offset
            .checked_mul(esize)
            .and_then(|o| o.checked_add(len))
            .unwrap_or(usize::MAX);
        if addr == 0 || end > nbytes {
            return Err(invalid_argument(format!(
                "{op}: {what} has {numel} elements ({len} bytes from byte {}) but its storage \
                 holds {nbytes} bytes (was the storage resized or freed, e.g. by \
                 untyped_storage().resize_()?)",
                offset.saturating_mul(esize)
            )));
        }
    }
    Ok(Buf { addr, len, dtype })
}

fn array_buffer(
    op: &str,
    what: &str,
    obj: &Bound<'_, PyAny>,
    ai: &Bound<'_, PyAny>,
    writable: bool,
) -> PyResult<Buf> {
    let bad = |m: &str| PyTypeError::new_err(format!("{op}: {what}: {m}"));
    let ai = ai
        .cast::<PyDict>()
        .map_err(|_| bad("__array_interface__ is not a dict"))?;
    let get = |k: &str| ai.get_item(k);
    let typestr: String = get("typestr")?
        .ok_or_else(|| bad("__array_interface__ has no typestr"))?
        .extract()?;
    if typestr.starts_with('>') && cfg!(target_endian = "little")
        || typestr.starts_with('<') && cfg!(target_endian = "big")
    {
        return Err(invalid_argument(format!(
            "{op}: {what} is not in native byte order ({typestr}); convert it with \
             arr.astype(arr.dtype.newbyteorder('='))"
        )));
    }
    // The dtype's name tells bfloat16 (ml_dtypes, typestr '<V2') from other 2-byte types.
    let name = match obj.getattr("dtype").and_then(|d| d.getattr("name")) {
        Ok(n) => n.extract::<String>()?,
        Err(_) => match &typestr.get(1..) {
            Some("f2") => "float16".into(),
            Some("f4") => "float32".into(),
            Some("f8") => "float64".into(),
            Some("i1") => "int8".into(),
            Some("i2") => "int16".into(),
            Some("i4") => "int32".into(),
            Some("i8") => "int64".into(),
            Some("u1") => "uint8".into(),
            Some("u4") => "uint32".into(),
            Some("u8") => "uint64".into(),
            _ => typestr.clone(),
        },
    };
    let dtype = dtype_named(op, what, &name)?;
    // The element size the interface declares must be the dtype's (an object may expose any
    // __array_interface__; numpy's own are consistent).
    if let Some(itemsize) = typestr.get(2..).and_then(|n| n.parse::<usize>().ok()) {
        if itemsize != dtype.size() {
            return Err(bad(&format!(
                "dtype {name} has {}-byte elements but __array_interface__ declares {typestr}",
                dtype.size()
            )));
        }
    }
    let data = get("data")?.ok_or_else(|| bad("__array_interface__ has no data"))?;
    let (addr, readonly): (usize, bool) = data
        .extract()
        .map_err(|_| bad("__array_interface__['data'] is not (address, read_only)"))?;
    if writable && readonly {
        return Err(invalid_argument(format!(
            "{op}: {what} is read-only; the result must be written into it (pass a writable array)"
        )));
    }
    let shape: Vec<usize> = get("shape")?
        .ok_or_else(|| bad("__array_interface__ has no shape"))?
        .extract()?;
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size()).map(|_| n))
        .ok_or_else(|| bad(&format!("shape {shape:?} is too large")))?;
    if let Some(strides) = get("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<isize> = strides.extract()?;
        let mut expect = dtype.size() as isize;
        let mut contiguous = true;
        for (&n, &s) in shape.iter().zip(&strides).rev() {
            if n > 1 && s != expect {
                contiguous = false;
            }
            expect *= n as isize;
        }
        if numel > 0 && !contiguous {
            return Err(invalid_argument(format!(
                "{op}: {what} is not C-contiguous (shape {shape:?}, strides {strides:?}); pass \
                 a contiguous array (numpy.ascontiguousarray makes a copy, and the result would not \
                 land in the original)"
            )));
        }
    }
    if let Some(off) = get("offset")?.filter(|o| !o.is_none()) {
        if off.extract::<usize>()? != 0 {
            return Err(bad("__array_interface__ with an offset is not supported"));
        }
    }
    Ok(Buf {
        addr: if numel == 0 { 0 } else { addr },
        len: numel * dtype.size(),
        dtype,
    })
}
