//! An uploaded file read as 16 kHz mono samples, a bounded piece at a time.
//!
//! An hour of 16 kHz audio is 230 MB as `f32`; a transcription only ever needs one
//! 30-second window of it. `AudioStream` decodes a packet, resamples it and hands
//! the samples out, so what it holds is the compressed upload (shared, not copied)
//! plus about one packet and one resampler chunk of decoded audio.

use bytes::Bytes;

use super::{decode::TrackDecoder, resample::To16k, AudioError, AudioLimits, SampleSource, SourceFormat};

/// 16 kHz mono samples of one upload, decoded on demand. `Send`, so a job can move
/// between worker threads between windows.
pub struct AudioStream {
    decoder: TrackDecoder,
    resampler: Option<To16k>,
    /// One packet at the source rate, downmixed.
    packet: Vec<f32>,
    /// Resampled samples not read yet, from `ready_from`.
    ready: Vec<f32>,
    ready_from: usize,
    ended: bool,
    /// The error that ended decoding, returned again by every later read.
    failed: Option<AudioError>,
    samples_read: u64,
}

impl AudioStream {
    /// Opens the upload: finds its container and audio track and checks what they
    /// declare. No audio is decoded yet, so this is cheap.
    pub fn open(bytes: Bytes, limits: &AudioLimits) -> Result<AudioStream, AudioError> {
        Ok(AudioStream {
            decoder: TrackDecoder::open(bytes, limits)?,
            resampler: None,
            packet: Vec::new(),
            ready: Vec::new(),
            ready_from: 0,
            ended: false,
            failed: None,
            samples_read: 0,
        })
    }

    /// The container, codec, rate and channels (rate and channels as decoded, once
    /// the first packet is in — of the latest part, for joined files of different
    /// rates; as declared before).
    pub fn source(&self) -> &SourceFormat {
        &self.decoder.source
    }

    /// 16 kHz samples handed out so far.
    pub fn samples_read(&self) -> u64 {
        self.samples_read
    }

    /// Whether a damaged or truncated part of the file was skipped or ended the audio
    /// (so far).
    pub fn damaged(&self) -> bool {
        self.decoder.damaged
    }

    /// Appends up to `max` samples to `out` and returns how many; 0 means the end.
    /// After an error (audio over the limit, a decoder failure) every read returns it.
    pub fn read(&mut self, out: &mut Vec<f32>, max: usize) -> Result<usize, AudioError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut written = 0;
        while written < max {
            if self.ready_from < self.ready.len() {
                let take = (self.ready.len() - self.ready_from).min(max - written);
                out.extend_from_slice(&self.ready[self.ready_from..self.ready_from + take]);
                self.ready_from += take;
                written += take;
                continue;
            }
            if self.ended {
                break;
            }
            if let Err(e) = self.refill() {
                self.failed = Some(e.clone());
                return Err(e);
            }
        }
        self.samples_read += written as u64;
        Ok(written)
    }

    /// Decodes and resamples the next packet into `ready`.
    fn refill(&mut self) -> Result<(), AudioError> {
        self.ready.clear();
        self.ready_from = 0;
        let more = self.decoder.next_packet(&mut self.packet)?;
        if self.resampler.is_none() && more {
            self.resampler = Some(To16k::new(self.decoder.source.sample_rate)?);
        }
        let Some(resampler) = self.resampler.as_mut() else {
            // `next_packet` refuses a file with no audio, so this is the end of an empty read.
            self.ended = true;
            return Ok(());
        };
        if more && resampler.source_rate() != self.decoder.source.sample_rate {
            // Joined files of different rates: the part before ends, the next one is
            // resampled from its own rate.
            resampler.finish(&mut self.ready)?;
            *resampler = To16k::new(self.decoder.source.sample_rate)?;
        }
        if more {
            resampler.push(&self.packet, &mut self.ready)
        } else {
            self.ended = true;
            resampler.finish(&mut self.ready)
        }
    }
}

impl SampleSource for AudioStream {
    fn read(&mut self, out: &mut Vec<f32>, max: usize) -> Result<usize, AudioError> {
        AudioStream::read(self, out, max)
    }
}
