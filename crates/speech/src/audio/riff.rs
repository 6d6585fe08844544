//! A WAV file's chunk layout checked against the bytes really uploaded, before
//! symphonia reads it.
//!
//! WAV headers are routinely wrong: a recorder killed mid-file leaves a `data` chunk
//! that claims more bytes than exist, and programs writing to a pipe put 0 or
//! `0xFFFF_FFFF` in the RIFF and data lengths. Symphonia trusts these numbers: it
//! allocates a `LIST/INFO` chunk's declared length before reading it, drops the last
//! partial packet of a data chunk that runs past the end, and cannot find a data
//! chunk whose parent length is 0. Since the whole upload is in memory, its real
//! length is known: here every chunk before the audio is checked to fit in the file,
//! the format is checked for values no player could honour (0 channels, 0 Hz, a block
//! size that disagrees with its samples), and symphonia is handed a copy of the
//! header with both lengths set to what is really there.

use std::io::{self, Read, Seek, SeekFrom};

use bytes::Bytes;
use symphonia::core::io::MediaSource;

use super::AudioError;

/// Whether `rest` starts with a chunk header that fits in it: a four-character code of
/// printable ASCII and a length no longer than what follows. Samples are not that (the
/// first bytes of a recording are near silence: zeros and small values).
fn chunk_follows(rest: &[u8]) -> bool {
    let (Some(id), Some(len)) = (rest.get(..4), rest.get(4..8)) else { return false };
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    id.iter().all(|b| b.is_ascii_graphic() || *b == b' ') && len <= rest.len() - 8
}

/// What the `fmt ` chunk says, kept for error messages and checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WavFormat {
    pub format_tag: u16,
    pub channels: u16,
    pub sample_rate: u32,
    pub block_align: u16,
    pub bits_per_sample: u16,
}

/// A WAV upload with its header fixed to the bytes present.
pub(crate) struct CheckedWav {
    pub source: SplicedWav,
    pub format: WavFormat,
    /// The data chunk declared more bytes than the file holds.
    pub truncated: bool,
}

const FORMAT_PCM: u16 = 0x0001;
const FORMAT_FLOAT: u16 = 0x0003;
const FORMAT_ALAW: u16 = 0x0006;
const FORMAT_MULAW: u16 = 0x0007;
const FORMAT_EXTENSIBLE: u16 = 0xFFFE;

/// True when the bytes start like a RIFF/WAVE file.
pub(crate) fn is_wav(bytes: &[u8]) -> bool {
    bytes.len() >= 12 && &bytes[0..4] == b"RIFF" && &bytes[8..12] == b"WAVE"
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn corrupt(what: impl Into<String>) -> AudioError {
    AudioError::Corrupt(what.into())
}

/// Whether symphonia decodes this encoding (PCM integer or float, A-law, mu-law).
pub(crate) fn is_pcm(tag: u16) -> bool {
    matches!(tag, FORMAT_PCM | FORMAT_FLOAT | FORMAT_ALAW | FORMAT_MULAW)
}

/// A readable name for a WAV format tag, for messages.
pub(crate) fn format_name(tag: u16) -> String {
    let name = match tag {
        FORMAT_PCM => "PCM",
        0x0002 => "Microsoft ADPCM",
        FORMAT_FLOAT => "IEEE float",
        FORMAT_ALAW => "A-law",
        FORMAT_MULAW => "mu-law",
        0x0011 => "IMA ADPCM",
        0x0031 => "GSM 6.10",
        0x0050 => "MPEG audio",
        0x0055 => "MP3",
        FORMAT_EXTENSIBLE => "extensible",
        _ => "an unknown encoding",
    };
    format!("format 0x{tag:04X} ({name})")
}

fn parse_format(chunk: &[u8]) -> Result<WavFormat, AudioError> {
    let field =
        |at| u16_at(chunk, at).ok_or_else(|| corrupt("the WAV 'fmt ' chunk is shorter than 16 bytes"));
    let mut format = WavFormat {
        format_tag: field(0)?,
        channels: field(2)?,
        sample_rate: u32_at(chunk, 4)
            .ok_or_else(|| corrupt("the WAV 'fmt ' chunk is shorter than 16 bytes"))?,
        block_align: field(12)?,
        bits_per_sample: field(14)?,
    };
    if format.channels == 0 {
        return Err(AudioError::AbsurdParameters("the WAV header declares 0 channels".into()));
    }
    if format.sample_rate == 0 {
        return Err(AudioError::AbsurdParameters("the WAV header declares a sample rate of 0 Hz".into()));
    }
    // For extensible files the sample encoding is the first two bytes of the sub-format GUID.
    let encoding = match format.format_tag {
        FORMAT_EXTENSIBLE => u16_at(chunk, 24).ok_or_else(|| {
            corrupt("the WAV 'fmt ' chunk says WAVE_FORMAT_EXTENSIBLE but is shorter than 40 bytes")
        })?,
        tag => tag,
    };
    if is_pcm(encoding) {
        let bytes_per_sample = format.bits_per_sample.div_ceil(8);
        let expected = u32::from(format.channels) * u32::from(bytes_per_sample);
        if format.bits_per_sample == 0 || u32::from(format.block_align) != expected {
            return Err(corrupt(format!(
                "the WAV header declares {} channels of {} bits but frames of {} bytes",
                format.channels, format.bits_per_sample, format.block_align
            )));
        }
    }
    if format.format_tag == FORMAT_EXTENSIBLE {
        format.format_tag = encoding;
    }
    Ok(format)
}

/// Walks the chunks up to `data`, checking each against the bytes present, and
/// returns the upload as symphonia should see it.
pub(crate) fn check(bytes: &Bytes) -> Result<CheckedWav, AudioError> {
    let mut at = 12usize;
    let mut format: Option<WavFormat> = None;
    loop {
        let (Some(tag), Some(declared)) = (bytes.get(at..at + 4), u32_at(bytes, at + 4)) else {
            return Err(match format {
                None => corrupt("the WAV file ends before its 'fmt ' chunk"),
                Some(_) => corrupt("the WAV file ends before its 'data' chunk"),
            });
        };
        let body = at + 8;
        let declared = usize::try_from(declared).unwrap_or(usize::MAX);
        let available = bytes.len() - body;
        let name = String::from_utf8_lossy(tag).into_owned();
        if tag == b"data" {
            let Some(format) = format else {
                return Err(corrupt("the WAV 'data' chunk comes before any 'fmt ' chunk"));
            };
            // 0 is what a recorder stopped before it went back to write the length
            // leaves (as 0xFFFF_FFFF is): the data runs to the end, as ffmpeg reads it —
            // unless another chunk follows at once (a truly empty recording, then `LIST`).
            let declared = match declared {
                0 if !chunk_follows(&bytes[body..]) => available,
                _ => declared,
            };
            let truncated = declared > available;
            let mut length = declared.min(available);
            if is_pcm(format.format_tag) {
                length -= length % usize::from(format.block_align.max(1));
            }
            let data_length = u32::try_from(length)
                .map_err(|_| corrupt("the WAV data is longer than 4 GiB, which RIFF cannot describe"))?;
            let mut head = bytes[..body].to_vec();
            let riff_length = u32::try_from(head.len() - 8 + length).unwrap_or(u32::MAX);
            head[4..8].copy_from_slice(&riff_length.to_le_bytes());
            head[at + 4..at + 8].copy_from_slice(&data_length.to_le_bytes());
            let source = SplicedWav::new(head, bytes.slice(body..body + length));
            return Ok(CheckedWav { source, format, truncated });
        }
        if declared > available {
            return Err(corrupt(format!(
                "the WAV '{name}' chunk declares {declared} bytes but only {available} follow it"
            )));
        }
        if tag == b"fmt " {
            format = Some(parse_format(&bytes[body..body + declared])?);
        }
        // Chunks are padded to an even length.
        at = body + declared + (declared & 1);
    }
}

/// A corrected WAV header followed by the untouched audio bytes, without copying them.
pub(crate) struct SplicedWav {
    head: Vec<u8>,
    body: Bytes,
    position: u64,
}

impl SplicedWav {
    fn new(head: Vec<u8>, body: Bytes) -> Self {
        SplicedWav { head, body, position: 0 }
    }

    fn len(&self) -> u64 {
        (self.head.len() + self.body.len()) as u64
    }
}

impl Read for SplicedWav {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let position = usize::try_from(self.position).unwrap_or(usize::MAX);
        let rest: &[u8] = if position < self.head.len() {
            &self.head[position..]
        } else {
            self.body.get(position - self.head.len()..).unwrap_or(&[])
        };
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        self.position += n as u64;
        Ok(n)
    }
}

impl Seek for SplicedWav {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let target = match to {
            SeekFrom::Start(offset) => Some(offset),
            SeekFrom::End(delta) => self.len().checked_add_signed(delta),
            SeekFrom::Current(delta) => self.position.checked_add_signed(delta),
        };
        let target =
            target.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek before start"))?;
        self.position = target;
        Ok(target)
    }
}

impl MediaSource for SplicedWav {
    fn is_seekable(&self) -> bool {
        true
    }

    fn byte_len(&self) -> Option<u64> {
        Some(self.len())
    }
}
