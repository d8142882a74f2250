//! Element types and reduction operators, and the marker trait that ties Rust types to them.

use std::fmt;
use std::str::FromStr;

/// The element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE-754 binary32.
    F32 = 1,
    /// IEEE-754 binary64.
    F64 = 2,
    /// IEEE-754 binary16.
    F16 = 3,
    /// bfloat16.
    BF16 = 4,
    /// Signed 8-bit integer.
    I8 = 5,
    /// Signed 16-bit integer.
    I16 = 6,
    /// Signed 32-bit integer.
    I32 = 7,
    /// Signed 64-bit integer.
    I64 = 8,
    /// Unsigned 8-bit integer.
    U8 = 9,
    /// Unsigned 32-bit integer.
    U32 = 10,
    /// Unsigned 64-bit integer.
    U64 = 11,
}

impl DType {
    /// Every supported dtype.
    pub const ALL: [DType; 11] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U32,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// True for floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The short name used on the command line and in tables (`float`, `half`, `int32`, …;
    /// nccl-tests spelling).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
        }
    }

    /// Decode the wire code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == code)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => DType::F32,
            "f64" | "double" | "float64" => DType::F64,
            "f16" | "half" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i8" | "int8" => DType::I8,
            "i16" | "int16" => DType::I16,
            "i32" | "int" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            "u8" | "uint8" => DType::U8,
            "u32" | "uint32" => DType::U32,
            "u64" | "uint64" => DType::U64,
            _ => {
                return Err(format!(
                    "unknown dtype '{s}' (expected one of f32, f64, f16, bf16, i8, i16, i32, i64, u8, u32, u64)"
                ))
            }
        })
    }
}

/// A reduction operator.
///
/// Integer `Sum`/`Prod` wrap on overflow. `Mean` is `Sum` followed by a division by the number
/// of ranks: for floating types in the element type's precision (f16/bf16 via f32), for integer
/// types as an integer division truncating toward zero. `Min`/`Max` on floats propagate NaN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum.
    Sum = 1,
    /// Product.
    Prod = 2,
    /// Minimum.
    Min = 3,
    /// Maximum.
    Max = 4,
    /// Arithmetic mean over ranks.
    Mean = 5,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Mean,
    ];

    /// nccl-tests spelling.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Mean => "avg",
        }
    }

    /// Decode the wire code.
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| *o as u8 == code)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "mean" | "avg" => ReduceOp::Mean,
            _ => {
                return Err(format!(
                    "unknown reduce op '{s}' (expected sum, prod, min, max or mean)"
                ))
            }
        })
    }
}

/// A Rust type hcomm can communicate: plain old data with a [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype tag of this type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16, i8 => I8, i16 => I16,
         i32 => I32, i64 => I64, u8 => U8, u32 => U32, u64 => U64);
