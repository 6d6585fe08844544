//! Binary tensor data (the KServe binary extension and gRPC's raw contents): fixed-size
//! elements checked against the byte count, BYTES as u32-length-prefixed strings whose
//! prefixes may lie — each is checked against what is left before anything is copied.

use half::f16;
use snooze_core::{DataType, SnoozeError, TensorData};

use super::{bad, InputPlan};

pub(super) fn from_binary(p: &InputPlan<'_>, bytes: &[u8]) -> Result<TensorData, SnoozeError> {
    macro_rules! le {
        ($variant:ident, $t:ty) => {
            TensorData::$variant(
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect(),
            )
        };
    }
    Ok(match p.datatype {
        DataType::Bool => TensorData::Bool(bytes.iter().map(|b| *b != 0).collect()),
        DataType::Uint8 => TensorData::Uint8(bytes.to_vec()),
        DataType::Int8 => TensorData::Int8(bytes.iter().map(|b| *b as i8).collect()),
        DataType::Uint16 => le!(Uint16, u16),
        DataType::Uint32 => le!(Uint32, u32),
        DataType::Uint64 => le!(Uint64, u64),
        DataType::Int16 => le!(Int16, i16),
        DataType::Int32 => le!(Int32, i32),
        DataType::Int64 => le!(Int64, i64),
        DataType::Fp16 => le!(Fp16, f16),
        DataType::Fp32 => le!(Fp32, f32),
        DataType::Fp64 => le!(Fp64, f64),
        DataType::Bytes => TensorData::Bytes(length_prefixed(p, bytes)?),
    })
}

/// BYTES in the binary extension: a little-endian u32 length before each element.
fn length_prefixed(p: &InputPlan<'_>, bytes: &[u8]) -> Result<Vec<Vec<u8>>, SnoozeError> {
    let name = p.name;
    let mut items = Vec::with_capacity(p.count.min(bytes.len() / 4));
    let mut rest = bytes;
    while !rest.is_empty() {
        if items.len() == p.count {
            return Err(bad(format!(
                "input '{name}' has more than the {} BYTES elements its shape {:?} declares",
                p.count, p.shape
            )));
        }
        let (len, tail) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad(format!("input '{name}': truncated BYTES length prefix")))?;
        let len = u32::from_le_bytes(*len) as usize;
        if len > tail.len() {
            return Err(bad(format!(
                "input '{name}': a BYTES element claims {len} bytes, {} remain",
                tail.len()
            )));
        }
        items.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    Ok(items)
}
