//! JSON tensor data, flat or nested: elements parsed straight into typed vectors, the
//! nesting checked to be rectangular and to match the shape, nothing reserved beyond
//! what the text can hold.

use std::fmt;

use half::f16;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde_json::value::RawValue;
use snooze_core::{DataType, SnoozeError, TensorData};

use super::{bad, InputPlan};

/// What one element of a datatype may be written as in JSON.
trait Element: Sized {
    /// The fewest bytes of JSON an element takes with its separator: bounds how much
    /// room the bytes at hand can back.
    const MIN_JSON_BYTES: usize = 2;
    fn from_bool(_: bool) -> Option<Self> {
        None
    }
    fn from_i64(_: i64) -> Option<Self> {
        None
    }
    fn from_u64(_: u64) -> Option<Self> {
        None
    }
    fn from_f64(_: f64) -> Option<Self> {
        None
    }
    fn from_str(_: &str) -> Option<Self> {
        None
    }
}

impl Element for bool {
    fn from_bool(v: bool) -> Option<Self> {
        Some(v)
    }
}

macro_rules! int_element {
    ($($t:ty),*) => {$(
        impl Element for $t {
            fn from_i64(v: i64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn from_u64(v: u64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
        }
    )*};
}
int_element!(u8, u16, u32, u64, i8, i16, i32, i64);

macro_rules! float_element {
    ($($t:ty => $from:expr),*) => {$(
        impl Element for $t {
            fn from_i64(v: i64) -> Option<Self> {
                Some($from(v as f64))
            }
            fn from_u64(v: u64) -> Option<Self> {
                Some($from(v as f64))
            }
            fn from_f64(v: f64) -> Option<Self> {
                Some($from(v))
            }
        }
    )*};
}
float_element!(f32 => |x: f64| x as f32, f64 => |x: f64| x, f16 => f16::from_f64);

impl Element for Vec<u8> {
    const MIN_JSON_BYTES: usize = 3; // "",
    fn from_str(v: &str) -> Option<Self> {
        Some(v.as_bytes().to_vec())
    }
}

pub(super) fn from_json(p: &InputPlan<'_>, raw: &RawValue) -> Result<TensorData, SnoozeError> {
    Ok(match p.datatype {
        DataType::Bool => TensorData::Bool(json_elements(p, raw)?),
        DataType::Uint8 => TensorData::Uint8(json_elements(p, raw)?),
        DataType::Uint16 => TensorData::Uint16(json_elements(p, raw)?),
        DataType::Uint32 => TensorData::Uint32(json_elements(p, raw)?),
        DataType::Uint64 => TensorData::Uint64(json_elements(p, raw)?),
        DataType::Int8 => TensorData::Int8(json_elements(p, raw)?),
        DataType::Int16 => TensorData::Int16(json_elements(p, raw)?),
        DataType::Int32 => TensorData::Int32(json_elements(p, raw)?),
        DataType::Int64 => TensorData::Int64(json_elements(p, raw)?),
        DataType::Fp16 => TensorData::Fp16(json_elements(p, raw)?),
        DataType::Fp32 => TensorData::Fp32(json_elements(p, raw)?),
        DataType::Fp64 => TensorData::Fp64(json_elements(p, raw)?),
        DataType::Bytes => TensorData::Bytes(json_elements(p, raw)?),
    })
}

/// Elements of `raw` (a value, a flat array, or arrays nested exactly as the shape),
/// row-major, streamed into a vector no larger than the JSON can back.
fn json_elements<T: Element>(p: &InputPlan<'_>, raw: &RawValue) -> Result<Vec<T>, SnoozeError> {
    let text = raw.get();
    let mut st = Nesting {
        out: Vec::with_capacity(p.count.min(text.len() / T::MIN_JSON_BYTES + 1)),
        expected: p.count,
        datatype: p.datatype,
        dims: Vec::new(),
        leaf_depth: None,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    Level { st: &mut st, depth: 0 }
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| bad(format!("input '{}': {e}", p.name)))?;
    let shape = p.shape;
    match st.leaf_depth {
        // Nested: the arrays must be the shape, dimension by dimension.
        Some(depth) if depth > 1 => {
            let nested: Vec<usize> = st.dims.iter().take(depth).map(|d| d.unwrap_or(0)).collect();
            let same = nested.len() == shape.len() && nested.iter().zip(shape).all(|(&n, &s)| n as i64 == s);
            if !same {
                return Err(bad(format!(
                    "input '{}' is nested as {nested:?} but its shape is {shape:?}",
                    p.name
                )));
            }
        }
        Some(0) if p.count != 1 => {
            return Err(bad(format!(
                "input '{}' has one value but its shape {shape:?} needs {}",
                p.name, p.count
            )));
        }
        _ => {}
    }
    Ok(st.out)
}

/// What the visitor has seen so far.
struct Nesting<T> {
    out: Vec<T>,
    expected: usize,
    datatype: DataType,
    /// Length of the arrays at each depth (all arrays at a depth must agree).
    dims: Vec<Option<usize>>,
    /// The depth values were found at (all values must be at one depth).
    leaf_depth: Option<usize>,
}

impl<T: Element> Nesting<T> {
    fn value<E: de::Error>(&mut self, depth: usize, v: Option<T>, shown: impl fmt::Display) -> Result<(), E> {
        let arrays_here = self.dims.get(depth).is_some_and(Option::is_some);
        match self.leaf_depth {
            _ if arrays_here => return Err(E::custom("ragged data: arrays and values mixed at one level")),
            Some(d) if d != depth => {
                return Err(E::custom("ragged data: values at different nesting depths"))
            }
            _ => self.leaf_depth = Some(depth),
        }
        if self.out.len() == self.expected {
            return Err(E::custom(format_args!(
                "more than the {} elements its shape declares",
                self.expected
            )));
        }
        let v = v.ok_or_else(|| {
            E::custom(format_args!(
                "element {}: {shown} is not a valid {} value",
                self.out.len(),
                self.datatype
            ))
        })?;
        self.out.push(v);
        Ok(())
    }

    fn array_closed<E: de::Error>(&mut self, depth: usize, len: usize) -> Result<(), E> {
        if self.leaf_depth.is_some_and(|d| d <= depth) {
            return Err(E::custom("ragged data: arrays and values mixed at one level"));
        }
        if self.dims.len() <= depth {
            self.dims.resize(depth + 1, None);
        }
        match self.dims[depth] {
            Some(first) if first != len => Err(E::custom(format_args!(
                "ragged data: an array at depth {depth} has {len} items where another has {first}"
            ))),
            _ => {
                self.dims[depth] = Some(len);
                Ok(())
            }
        }
    }
}

/// The value at one depth of the nesting.
struct Level<'s, T> {
    st: &'s mut Nesting<T>,
    depth: usize,
}

impl<'de, T: Element> DeserializeSeed<'de> for Level<'_, T> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T: Element> Visitor<'de> for Level<'_, T> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} values, flat or nested in arrays", self.st.datatype)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut len = 0usize;
        while seq.next_element_seed(Level { st: &mut *self.st, depth: self.depth + 1 })?.is_some() {
            len += 1;
        }
        self.st.array_closed(self.depth, len)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.st.value(self.depth, T::from_bool(v), v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.st.value(self.depth, T::from_i64(v), v)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.st.value(self.depth, T::from_u64(v), v)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.st.value(self.depth, T::from_f64(v), v)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        let shown = Quoted(v);
        self.st.value(self.depth, T::from_str(v), shown)
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.st.value(self.depth, None, "null")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        self.st.value(self.depth, None, "an object")
    }
}

/// A string shown in an error, cut so a huge one does not flood the message.
struct Quoted<'a>(&'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let cut: String = self.0.chars().take(40).collect();
        let more = if cut.len() < self.0.len() { "..." } else { "" };
        write!(f, "{:?}{more}", cut)
    }
}
