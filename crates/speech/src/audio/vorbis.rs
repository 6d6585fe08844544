//! A bound on the memory a Vorbis stream's setup header can ask for, checked before
//! symphonia reads it.
//!
//! A Vorbis codebook declares up to 2^24 entries of up to 65,535 dimensions, and
//! symphonia 0.5 builds each vector-quantisation table at its declared size (entries ×
//! dimensions `f32`s, every one written) before it checks that the codebook makes
//! sense: a 200-byte setup header can ask for gigabytes per codebook, and 256 of
//! them. libvorbis refuses a codebook whose `ilog(entries) + ilog(dimensions)` exceeds
//! 24; the same rule is applied here, plus a total over all codebooks. Real encoders
//! stay far below (sox's default Vorbis: ~20 thousand values in all). Anything this
//! walk cannot follow (a truncated or odd file) is left to symphonia, which fails
//! cleanly on it; only a positive finding refuses the file.

use super::AudioError;

/// libvorbis's bound on one codebook: `ilog(entries) + ilog(dimensions) <= 24`.
const MAX_CODEBOOK_BITS: u32 = 24;
/// All vector-quantisation values of a stream together (64 MB of `f32`).
const MAX_TOTAL_VALUES: u64 = 1 << 24;

/// Reads an OGG file's first logical stream's first three packets.
fn vorbis_headers(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut at = 0usize;
    let mut serial = None;
    let mut packets = 0;
    let mut current = Vec::new();
    while at + 27 <= bytes.len() && &bytes[at..at + 4] == b"OggS" {
        let page_serial = u32::from_le_bytes(bytes[at + 14..at + 18].try_into().ok()?);
        let segments = usize::from(bytes[at + 26]);
        let lacing = bytes.get(at + 27..at + 27 + segments)?;
        let mut body = at + 27 + segments;
        let ours = *serial.get_or_insert(page_serial) == page_serial;
        for &length in lacing {
            let length = usize::from(length);
            if ours {
                current.extend_from_slice(bytes.get(body..body + length)?);
                if length < 255 {
                    packets += 1;
                    if packets == 3 {
                        return Some(current);
                    }
                    current.clear();
                }
            }
            body += length;
        }
        at = body;
    }
    None
}

/// Vorbis's bit order: least significant bit first.
struct Bits<'a> {
    bytes: &'a [u8],
    position: u64,
}

impl Bits<'_> {
    fn read(&mut self, count: u32) -> Option<u64> {
        let mut value = 0u64;
        for i in 0..count {
            let byte = *self.bytes.get(usize::try_from(self.position / 8).ok()?)?;
            let bit = (byte >> (self.position % 8)) & 1;
            value |= u64::from(bit) << i;
            self.position += 1;
        }
        Some(value)
    }

    fn skip(&mut self, count: u64) -> Option<()> {
        self.position = self.position.checked_add(count)?;
        (self.position <= self.bytes.len() as u64 * 8).then_some(())
    }
}

fn ilog(x: u64) -> u32 {
    64 - x.leading_zeros()
}

/// The greatest `v` with `v^dimensions <= entries` (Vorbis I, 9.2.3).
fn lookup1_values(entries: u64, dimensions: u64) -> u64 {
    let fits =
        |v: u64| u32::try_from(dimensions).ok().and_then(|d| v.checked_pow(d)).is_some_and(|p| p <= entries);
    let mut v = (entries as f64).powf(1.0 / dimensions as f64).floor() as u64;
    while v > 0 && !fits(v) {
        v -= 1;
    }
    while fits(v + 1) {
        v += 1;
    }
    v
}

/// Refuses a Vorbis stream whose codebooks would need more memory than any real
/// encoder's; `Ok` for everything else, including what it cannot parse.
pub(crate) fn check(bytes: &[u8]) -> Result<(), AudioError> {
    let Some(setup) = vorbis_headers(bytes) else { return Ok(()) };
    if setup.get(..7) != Some(b"\x05vorbis".as_slice()) {
        return Ok(());
    }
    let mut bits = Bits { bytes: &setup[7..], position: 0 };
    walk_codebooks(&mut bits).unwrap_or(Ok(()))
}

/// `None` when the header ends or stops making sense (symphonia will say why).
fn walk_codebooks(bits: &mut Bits<'_>) -> Option<Result<(), AudioError>> {
    let count = bits.read(8)? + 1;
    let mut total = 0u64;
    for index in 0..count {
        if bits.read(24)? != 0x56_4342 {
            return None;
        }
        let dimensions = bits.read(16)?;
        let entries = bits.read(24)?;
        skip_lengths(bits, entries)?;
        let lookup = bits.read(4)?;
        if lookup == 0 {
            continue;
        }
        if lookup > 2 || dimensions == 0 {
            return None;
        }
        let values = entries * dimensions;
        total += values;
        if ilog(entries) + ilog(dimensions) > MAX_CODEBOOK_BITS || total > MAX_TOTAL_VALUES {
            return Some(Err(AudioError::AbsurdParameters(format!(
                "Vorbis codebook {index} declares {entries} entries of {dimensions} dimensions, \
                 far more than any encoder writes"
            ))));
        }
        bits.skip(32 + 32)?;
        let value_bits = bits.read(4)? + 1;
        bits.skip(1)?;
        let stored = if lookup == 1 { lookup1_values(entries, dimensions) } else { values };
        bits.skip(stored.checked_mul(value_bits)?)?;
    }
    Some(Ok(()))
}

/// Skips a codebook's codeword lengths.
fn skip_lengths(bits: &mut Bits<'_>, entries: u64) -> Option<()> {
    if bits.read(1)? == 0 {
        let sparse = bits.read(1)? == 1;
        for _ in 0..entries {
            if !sparse || bits.read(1)? == 1 {
                bits.skip(5)?;
            }
        }
        return Some(());
    }
    let mut length = bits.read(5)? + 1;
    let mut entry = 0;
    while entry < entries {
        entry += bits.read(ilog(entries - entry))?;
        length += 1;
        if entry > entries || length > 33 {
            return None;
        }
    }
    Some(())
}
