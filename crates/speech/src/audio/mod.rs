//! Uploaded audio, in any common container, as the 16 kHz mono `f32` samples Whisper
//! reads.
//!
//! WAV (8/16/24/32-bit integer, 32/64-bit float, A-law, mu-law, WAVE_FORMAT_EXTENSIBLE),
//! FLAC, MP3, OGG/Vorbis, Opus (WebM, OGG) and MP4/M4A (AAC, ALAC) are recognised by their content, decoded by symphonia (Opus by `opus.rs`),
//! averaged to one channel and resampled to 16 kHz. Two ways in:
//!
//! * [`probe`] decodes the whole file once and keeps nothing but counts: how long it
//!   really is (counted samples, never a header's claim), what it was, and the peak of
//!   its log-mel spectrum that Whisper's normalisation needs before the first window.
//!   The server runs it before any model work, so a file over `max_seconds` is refused
//!   after decoding `max_seconds` of it, and a corrupt one before a model is loaded.
//! * [`AudioStream`] decodes again, on demand, handing out samples in bounded pieces
//!   while the transcription moves from window to window.
//!
//! A file cut short or damaged part-way is decoded up to the damage, and flagged
//! (`AudioInfo::damaged`) when that shows: packets that failed, a WAV data chunk or a
//! FLAC/MP3 header announcing more than was there (an MP3 without a length tag cut
//! between frames looks complete); a file from which no audio at all can be decoded
//! is an error. Before symphonia reads a WAV or OGG header, its declared sizes are
//! checked against the upload (`riff`, `vorbis`): symphonia would allocate them. Every error is an [`AudioError`]: a sentence for the user, and a kind
//! (`InvalidInput`, or `PayloadTooLarge` for audio over the limit) for the transport.

mod decode;
mod mp4;
mod opus;
mod resample;
mod riff;
mod stream;
mod vorbis;

use bytes::Bytes;
use snooze_core::{ErrorKind, SnoozeError};

use crate::mel::{LogMelPeaks, PeakTracker};
pub use stream::AudioStream;

/// The rate of every sample this module hands out, as Whisper expects.
pub const SAMPLE_RATE: u32 = 16_000;

/// The lowest source rate accepted: below it there is no speech band left to hear.
pub const MIN_SOURCE_RATE: u32 = 1_000;
/// The highest source rate accepted (the highest in common use is 384 kHz).
pub const MAX_SOURCE_RATE: u32 = 384_000;

/// Samples handed over per read in the whole-file passes.
const READ_CHUNK: usize = 16_000;

/// Limits applied while decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioLimits {
    /// Audio longer than this is refused as soon as that much has been decoded.
    pub max_seconds: f64,
}

impl Default for AudioLimits {
    /// Three hours: an ordinary long recording, far from what a request could hold up.
    fn default() -> Self {
        AudioLimits { max_seconds: 3.0 * 3600.0 }
    }
}

/// What the upload was, before decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFormat {
    /// `WAV`, `FLAC`, `MP3` or `OGG`.
    pub container: &'static str,
    /// The codec's name as symphonia gives it (e.g. "PCM Signed 16-bit Little-Endian Interleaved").
    pub codec: String,
    /// The original sample rate in Hz.
    pub sample_rate: u32,
    /// The original channel count (averaged into one).
    pub channels: usize,
}

/// What one decoding pass over the whole upload found.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioInfo {
    /// 16 kHz mono samples the audio decodes to: exactly what an [`AudioStream`] yields.
    pub samples: u64,
    pub source: SourceFormat,
    /// Part of the file was damaged or cut short; the audio ends at the damage or
    /// skips the packets that could not be decoded.
    pub damaged: bool,
    /// The highest log10 mel power of the whole audio, for 80 and 128 mel bands.
    pub log_mel_peaks: LogMelPeaks,
}

impl AudioInfo {
    /// The decoded duration in seconds.
    pub fn duration_seconds(&self) -> f64 {
        self.samples as f64 / f64::from(SAMPLE_RATE)
    }
}

/// Why an upload cannot be used as audio. Each message is a sentence for the user.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AudioError {
    #[error(
        "the upload is empty: send an audio file (WAV, FLAC, MP3, OGG (Vorbis, Opus), WebM/Opus or M4A/AAC)"
    )]
    NoData,
    #[error(
        "the upload is not audio in a format this server reads: send WAV, FLAC, MP3, OGG (Vorbis, Opus), WebM/Opus or M4A/AAC"
    )]
    UnknownFormat,
    #[error("the {container} file holds no audio track")]
    NoAudioTrack { container: &'static str },
    #[error(
        "the {container} file's audio is encoded as {codec}, which this server cannot decode: \
         convert it to PCM WAV, FLAC, MP3, OGG (Vorbis, Opus), WebM/Opus or M4A/AAC"
    )]
    UnsupportedCodec { container: &'static str, codec: String },
    #[error("the audio cannot be used: {0}")]
    Unsupported(String),
    #[error("the audio's parameters are impossible: {0}")]
    AbsurdParameters(String),
    #[error("the audio is corrupt and no sound could be decoded from it: {0}")]
    Corrupt(String),
    #[error("the audio contains no samples (or the file ends before its first complete frame)")]
    Empty,
    #[error(
        "the audio is longer than the {limit_seconds} s this server accepts (max_audio_seconds; \
         it was still going after {at_least_seconds:.1} s): send a shorter file"
    )]
    TooLong { limit_seconds: f64, at_least_seconds: f64 },
    /// A fault on the server's side, not the upload's.
    #[error("{0}")]
    Internal(String),
}

impl AudioError {
    /// How a transport should answer: 413 for audio over the limit, 400 for a bad file.
    pub fn kind(&self) -> ErrorKind {
        match self {
            AudioError::TooLong { .. } => ErrorKind::PayloadTooLarge,
            AudioError::Internal(_) => ErrorKind::Internal,
            _ => ErrorKind::InvalidInput,
        }
    }
}

impl From<AudioError> for SnoozeError {
    fn from(e: AudioError) -> SnoozeError {
        SnoozeError::new(e.kind(), e.to_string())
    }
}

/// Anything that hands out 16 kHz mono samples in order: an [`AudioStream`], or
/// samples already in memory ([`SamplesInMemory`]).
pub trait SampleSource {
    /// Appends up to `max` samples to `out` and returns how many; 0 means the end.
    fn read(&mut self, out: &mut Vec<f32>, max: usize) -> Result<usize, AudioError>;
}

/// 16 kHz mono samples already decoded, as a [`SampleSource`].
#[derive(Debug, Clone)]
pub struct SamplesInMemory<T> {
    samples: T,
    position: usize,
}

impl<T: AsRef<[f32]>> SamplesInMemory<T> {
    pub fn new(samples: T) -> Self {
        SamplesInMemory { samples, position: 0 }
    }
}

impl<T: AsRef<[f32]>> SampleSource for SamplesInMemory<T> {
    fn read(&mut self, out: &mut Vec<f32>, max: usize) -> Result<usize, AudioError> {
        let rest = &self.samples.as_ref()[self.position..];
        let take = rest.len().min(max);
        out.extend_from_slice(&rest[..take]);
        self.position += take;
        Ok(take)
    }
}

/// Decodes the whole upload once, keeping no samples: its counted length, its
/// source format, and the log-mel peaks Whisper's features are normalised by.
pub fn probe(bytes: Bytes, limits: &AudioLimits) -> Result<AudioInfo, AudioError> {
    let mut stream = AudioStream::open(bytes, limits)?;
    let mut peaks = PeakTracker::new();
    let mut chunk = Vec::with_capacity(READ_CHUNK);
    loop {
        chunk.clear();
        if stream.read(&mut chunk, READ_CHUNK)? == 0 {
            break;
        }
        peaks.push(&chunk);
    }
    Ok(AudioInfo {
        samples: stream.samples_read(),
        source: stream.source().clone(),
        damaged: stream.damaged(),
        log_mel_peaks: peaks.finish(),
    })
}

/// Decodes the whole upload into memory: for short clips and tests. Long audio
/// should go through an [`AudioStream`].
pub fn decode_all(bytes: Bytes, limits: &AudioLimits) -> Result<Vec<f32>, AudioError> {
    let mut stream = AudioStream::open(bytes, limits)?;
    let mut samples = Vec::new();
    while stream.read(&mut samples, READ_CHUNK)? > 0 {}
    Ok(samples)
}
