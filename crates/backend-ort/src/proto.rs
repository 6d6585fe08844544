//! A minimal reader of the protobuf wire format, enough to walk an ONNX file.
//!
//! Why not `prost` + the ONNX schema: a decoder materialises every field, so a
//! 400 MB model would be copied into memory just to learn its input names. This
//! reader borrows from the (memory-mapped) buffer and skips a length-delimited
//! field by moving an index, so the weights are never touched. Every length is
//! checked against what is left of the buffer: a corrupt file is an error, never
//! a panic, an out-of-bounds read or a huge allocation.

/// One field of a message: its number and its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    Varint(u64),
    Fixed64,
    Fixed32,
    Bytes(&'a [u8]),
}

impl<'a> Value<'a> {
    /// The payload of a length-delimited field (sub-message, string, packed array).
    pub(crate) fn bytes(self, field: u32) -> Result<&'a [u8], String> {
        match self {
            Value::Bytes(b) => Ok(b),
            _ => Err(format!("field {field} should be length-delimited")),
        }
    }

    pub(crate) fn varint(self, field: u32) -> Result<u64, String> {
        match self {
            Value::Varint(v) => Ok(v),
            _ => Err(format!("field {field} should be a varint")),
        }
    }

    pub(crate) fn string(self, field: u32) -> Result<&'a str, String> {
        std::str::from_utf8(self.bytes(field)?).map_err(|_| format!("field {field} is not valid UTF-8"))
    }
}

/// Iterates over the fields of one message.
pub(crate) struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Fields { buf, pos: 0 }
    }

    /// The varints of a packed repeated field's payload (`[packed = true]` int64s).
    pub(crate) fn packed_varints(buf: &'a [u8]) -> impl Iterator<Item = Result<u64, String>> + 'a {
        let mut reader = Fields::new(buf);
        std::iter::from_fn(move || (reader.pos < reader.buf.len()).then(|| reader.read_varint()))
    }

    fn read_varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self.buf.get(self.pos).ok_or("truncated varint")?;
            self.pos += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint longer than 10 bytes".to_owned())
    }

    fn take(&mut self, len: u64) -> Result<&'a [u8], String> {
        let left = self.buf.len() - self.pos;
        let len = usize::try_from(len).ok().filter(|&l| l <= left).ok_or_else(|| {
            format!("a field claims {len} bytes at offset {} but only {left} are left", self.pos)
        })?;
        let out = &self.buf[self.pos..self.pos + len];
        self.pos += len;
        Ok(out)
    }

    fn next_field(&mut self) -> Result<(u32, Value<'a>), String> {
        let key = self.read_varint()?;
        let field = u32::try_from(key >> 3).ok().filter(|&f| f != 0).ok_or("invalid field number")?;
        let value = match key & 7 {
            0 => Value::Varint(self.read_varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                let len = self.read_varint()?;
                Value::Bytes(self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed32
            }
            // 3/4 are the long-deprecated groups, which ONNX never uses; 6/7 do not exist.
            other => return Err(format!("unsupported wire type {other} for field {field}")),
        };
        Ok((field, value))
    }
}

/// Iterates over the fields of one message with each field's encoding (key and payload)
/// as it stands in the buffer, for a rewriter that copies the fields it does not change.
pub(crate) struct RawFields<'a>(Fields<'a>);

impl<'a> RawFields<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        RawFields(Fields::new(buf))
    }
}

impl<'a> Iterator for RawFields<'a> {
    type Item = Result<(u32, Value<'a>, &'a [u8]), String>;

    fn next(&mut self) -> Option<Self::Item> {
        let start = self.0.pos;
        let item = self.0.next()?;
        Some(item.map(|(field, value)| (field, value, &self.0.buf[start..self.0.pos])))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.buf.len() {
            return None;
        }
        let item = self.next_field();
        if item.is_err() {
            // Stop after the first error: what follows a bad byte is noise.
            self.pos = self.buf.len();
        }
        Some(item)
    }
}

/// Appends a varint.
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Encodes a length-delimited field (sub-message or string).
pub(crate) fn bytes_field(field: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 6);
    put_bytes_field(&mut out, field, payload);
    out
}

/// Appends a length-delimited field.
pub(crate) fn put_bytes_field(out: &mut Vec<u8>, field: u32, payload: &[u8]) {
    put_varint(out, u64::from(field) << 3 | 2);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

/// Encodes a varint field.
pub(crate) fn varint_field(field: u32, v: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(11);
    put_varint_field(&mut out, field, v);
    out
}

/// Appends a varint field.
pub(crate) fn put_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_varint(out, u64::from(field) << 3);
    put_varint(out, v);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn collect(buf: &[u8]) -> Result<Vec<(u32, Value<'_>)>, String> {
        Fields::new(buf).collect()
    }

    #[test]
    fn reads_every_wire_type() {
        // field 1 varint 300, field 2 "hi", field 3 fixed32, field 4 fixed64
        let buf = [0x08, 0xac, 0x02, 0x12, 2, b'h', b'i', 0x1d, 0, 0, 0, 0, 0x21, 0, 0, 0, 0, 0, 0, 0, 0];
        let fields = collect(&buf).unwrap();
        assert_eq!(fields[0], (1, Value::Varint(300)));
        assert_eq!(fields[1], (2, Value::Bytes(b"hi")));
        assert_eq!(fields[2], (3, Value::Fixed32));
        assert_eq!(fields[3], (4, Value::Fixed64));
    }

    #[test]
    fn encodes_what_it_reads() {
        let buf = [varint_field(1, 300), bytes_field(300, &[7; 200])].concat();
        let fields = collect(&buf).unwrap();
        assert_eq!(fields, vec![(1, Value::Varint(300)), (300, Value::Bytes(&[7; 200]))]);
    }

    #[test]
    fn raw_fields_are_the_bytes_that_encode_them() {
        let buf = [0x08, 0xac, 0x02, 0x1d, 1, 2, 3, 4, 0x12, 2, b'h', b'i'];
        let raw: Vec<_> = RawFields::new(&buf).map(|f| f.unwrap().2).collect();
        assert_eq!(raw, vec![&buf[..3], &buf[3..8], &buf[8..]]);
        assert_eq!(raw.concat(), buf);
        assert!(RawFields::new(&[0x12, 5, 1]).next().unwrap().is_err(), "a field cut short");
    }

    #[test]
    fn rejects_lengths_past_the_end_without_allocating() {
        // field 2, length = 2^62: must be refused, not allocated or sliced.
        let buf = [0x12, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x40];
        let err = collect(&buf).unwrap_err();
        assert!(err.contains("claims"), "{err}");
    }

    #[test]
    fn rejects_truncated_and_invalid_input() {
        assert!(collect(&[0x08]).is_err(), "varint cut short");
        assert!(collect(&[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]).is_err());
        assert!(collect(&[0x0b]).is_err(), "group start");
        assert!(collect(&[0x00, 0x00]).is_err(), "field number 0");
        assert!(collect(&[0x1d, 0, 0]).is_err(), "fixed32 cut short");
    }
}
