//! One audio track decoded packet by packet into mono samples at its own rate, with
//! its length counted and limited as it goes.
//!
//! Symphonia finds the container by its content (no file name needed) and decodes
//! WAV (integer, float, A-law, mu-law PCM; WAVE_FORMAT_EXTENSIBLE), FLAC, MP3,
//! OGG/Vorbis and MP4/M4A with AAC or ALAC; Opus (in WebM or OGG), which it demuxes,
//! is decoded by `opus.rs`. Around it, this file holds the rules
//! symphonia leaves to its caller:
//!
//! * **Counting.** Nothing is sized from a header: the duration is the number of
//!   frames decoded so far, and `max_seconds` is checked after every packet, so an
//!   hour-long upload under a ten-minute limit costs ten minutes of decoding.
//! * **Damage.** A packet that fails to decode is skipped (one glitch in a long
//!   recording should not lose the whole transcript). When the container itself
//!   stops making sense, or the file ends mid-frame, decoding ends there: the audio
//!   decoded so far is kept and marked `damaged`; if nothing at all was decoded, the
//!   upload is refused as corrupt.
//! * **Joined MP3s.** With gapless decoding (the encoder's delay and padding cut, so
//!   timestamps line up with the original), frames past the length the first file's
//!   LAME tag declares are cut whole. A file or two of them is that padding; more is a
//!   second MP3 joined after the first (`cat a.mp3 b.mp3`), decoded in full. Joined
//!   files may differ in rate or channels: symphonia's MP3 decoder refuses a frame
//!   unlike the first, so a fresh decoder takes over there, and the rate may change
//!   between packets (the stream resamples each part from its own rate).
//! * **MP4 edit lists.** An AAC encoder's priming and padding are cut as the file's
//!   edit list says (`mp4`), so the audio starts and ends where the recording does.
//! * **Panics.** Symphonia 0.5 can panic on crafted input (arithmetic overflow,
//!   slicing past a buffer); every call into it runs under `catch_unwind`, and a
//!   panic is treated as corrupt data from that point on.

use std::{
    collections::VecDeque,
    io::Cursor,
    panic::{catch_unwind, AssertUnwindSafe},
};

use bytes::Bytes;
use symphonia::core::{
    audio::{AudioBuffer, AudioBufferRef, Signal},
    codecs::{
        CodecParameters, CodecRegistry, CodecType, Decoder, DecoderOptions, CODEC_TYPE_NULL, CODEC_TYPE_OPUS,
    },
    conv::IntoSample,
    errors::Error as SymphoniaError,
    formats::{FormatOptions, FormatReader, Packet},
    io::{MediaSource, MediaSourceStream, ReadOnlySource},
    meta::{Limit, MetadataOptions},
    probe::Hint,
    sample::Sample,
};

use super::{mp4, riff, vorbis, AudioError, AudioLimits, SourceFormat, MAX_SOURCE_RATE, MIN_SOURCE_RATE};

/// Tags and cover art are read by symphonia while it looks for the audio; they are
/// not used here, so each may take little memory.
const METADATA_LIMIT_BYTES: usize = 64 * 1024;

/// MP3 frames past the declared length that are still the encoder's padding (at most
/// 4,095 samples: four frames of 1,152).
const PADDING_FRAMES: usize = 4;

/// How symphonia's MP3 decoder refuses a frame whose rate or channels differ from the
/// first frame's.
const SPEC_CHANGED: &str = "invalid audio buffer signal spec";

/// symphonia's codecs and Opus (see `opus.rs`), which it demuxes but cannot decode.
fn codecs() -> &'static CodecRegistry {
    static CODECS: std::sync::LazyLock<CodecRegistry> = std::sync::LazyLock::new(|| {
        let mut registry = CodecRegistry::new();
        symphonia::default::register_enabled_codecs(&mut registry);
        registry.register_all::<super::opus::OpusDecoder>();
        registry
    });
    &CODECS
}

/// A decoder for `params`, made under `catch_unwind` as every call into symphonia is.
fn make_decoder(params: &CodecParameters) -> std::thread::Result<Result<Box<dyn Decoder>, SymphoniaError>> {
    catch_unwind(AssertUnwindSafe(|| codecs().make(params, &DecoderOptions::default())))
}

/// A track being decoded, one packet per call.
pub(crate) struct TrackDecoder {
    format: Box<dyn FormatReader>,
    decoder: Box<dyn Decoder>,
    /// What the decoder was made from, to make a fresh one where joined files change
    /// rate or channels.
    params: CodecParameters,
    track_id: u32,
    pub source: SourceFormat,
    limits: AudioLimits,
    /// The length the header declares, if any: only compared with the count at the
    /// end, to tell a cut file from a complete one.
    declared_frames: Option<u64>,
    frames: u64,
    /// Seconds decoded so far (the rate may change part-way).
    seconds: f64,
    skipped_packets: u64,
    pub damaged: bool,
    finished: bool,
    /// Frames cut whole as past the declared length, held until it is clear whether
    /// they are padding or another file (see *Joined MP3s*).
    past_end: Vec<Packet>,
    /// Frames to decode before reading more.
    pending: VecDeque<Packet>,
    /// More followed the declared length than padding can be: nothing is cut any more.
    joined: bool,
    /// An MP4's edit list, applied from the first decoded packet (when the rate is known).
    edit: Option<mp4::Edit>,
    /// Frames still to drop at the start (the encoder's priming), and frames to keep in
    /// all (its padding cut), from `edit`.
    trim_skip: u64,
    trim_keep: Option<u64>,
}

/// The container, by its magic bytes, and whether they were there (an MP3 without an
/// ID3 tag starts with any frame's sync word, so it is only a guess).
fn container_of(bytes: &[u8]) -> (&'static str, bool) {
    match bytes.get(..4) {
        Some(b"RIFF") => ("WAV", true),
        Some(b"fLaC") => ("FLAC", true),
        Some(b"OggS") => ("OGG", true),
        Some([0x1A, 0x45, 0xDF, 0xA3]) => ("WebM", true),
        _ if bytes.get(4..8) == Some(b"ftyp") => ("MP4", true),
        _ => ("MP3", bytes.starts_with(b"ID3")),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into());
    format!("the decoder failed on malformed data ({text})")
}

fn check_rate(rate: u32) -> Result<(), AudioError> {
    if rate == 0 {
        return Err(AudioError::AbsurdParameters("the audio declares a sample rate of 0 Hz".into()));
    }
    if !(MIN_SOURCE_RATE..=MAX_SOURCE_RATE).contains(&rate) {
        return Err(AudioError::AbsurdParameters(format!(
            "the audio's sample rate of {rate} Hz is outside the {MIN_SOURCE_RATE}-{MAX_SOURCE_RATE} Hz \
             this server resamples from"
        )));
    }
    Ok(())
}

impl TrackDecoder {
    /// Finds the container and the first audio track, and checks what it declares.
    pub fn open(bytes: Bytes, limits: &AudioLimits) -> Result<TrackDecoder, AudioError> {
        if bytes.is_empty() {
            return Err(AudioError::NoData);
        }
        let (container, recognised) = container_of(&bytes);
        let edit = if container == "MP4" { mp4::audio_edit(&bytes) } else { None };
        let mut wav_format = None;
        let mut truncated = false;
        let upload = bytes.clone();
        let media: Box<dyn MediaSource> = if riff::is_wav(&bytes) {
            let checked = riff::check(&bytes)?;
            wav_format = Some(checked.format);
            truncated = checked.truncated;
            Box::new(checked.source)
        } else {
            if container == "OGG" {
                vorbis::check(&bytes)?;
            }
            Box::new(Cursor::new(bytes))
        };
        let stream = MediaSourceStream::new(media, Default::default());
        let format_options = FormatOptions { enable_gapless: true, ..Default::default() };
        let metadata_options = MetadataOptions {
            limit_metadata_bytes: Limit::Maximum(METADATA_LIMIT_BYTES),
            limit_visual_bytes: Limit::Maximum(METADATA_LIMIT_BYTES),
        };
        let probe = |stream: MediaSourceStream| {
            catch_unwind(AssertUnwindSafe(|| {
                symphonia::default::get_probe().format(
                    &Hint::new(),
                    stream,
                    &format_options,
                    &metadata_options,
                )
            }))
        };
        // A Matroska/WebM upload is read front to back: over a seekable source symphonia
        // follows the SeekHead to the Cues at the end, and in a finished file cut short
        // (an interrupted upload) it panics there, losing every word before the cut.
        // WebM puts its Info and Tracks before the first Cluster; a file that keeps them
        // only behind its SeekHead is read seekable, as before.
        let front_to_back = || {
            let source = ReadOnlySource::new(Cursor::new(upload.clone()));
            probe(MediaSourceStream::new(Box::new(source), Default::default()))
        };
        let probed = match container {
            "WebM" => match front_to_back() {
                found @ Ok(Ok(_)) => found,
                _ => probe(stream),
            },
            _ => probe(stream),
        }
        .map_err(|payload| AudioError::Corrupt(panic_message(payload.as_ref())))?;
        let format = match probed {
            Ok(probed) => probed.format,
            Err(SymphoniaError::Unsupported(what)) => {
                return Err(match wav_format {
                    Some(wav) if !riff::is_pcm(wav.format_tag) => {
                        AudioError::UnsupportedCodec { container, codec: riff::format_name(wav.format_tag) }
                    }
                    Some(_) => AudioError::Unsupported(format!(
                        "its WAV header is not one this server reads ({what})"
                    )),
                    None => AudioError::UnknownFormat,
                })
            }
            Err(SymphoniaError::IoError(_)) if recognised => {
                let why = match container {
                    "OGG" => super::opus::ogg_head_problem(&upload),
                    _ => None,
                }
                .unwrap_or_else(|| "file ends before its audio begins".into());
                return Err(AudioError::Corrupt(format!("the {container} {why}")));
            }
            Err(SymphoniaError::IoError(_)) => return Err(AudioError::UnknownFormat),
            Err(e) => return Err(AudioError::Corrupt(format!("the {container} header cannot be read: {e}"))),
        };
        let Some(track) = format.tracks().iter().find(|t| t.codec_params.codec != CODEC_TYPE_NULL) else {
            return Err(AudioError::NoAudioTrack { container });
        };
        let params = track.codec_params.clone();
        let track_id = track.id;
        if let Some(rate) = params.sample_rate {
            check_rate(rate)?;
        }
        if params.channels.is_some_and(|c| c.count() == 0) {
            return Err(AudioError::AbsurdParameters(format!("the {container} audio declares 0 channels")));
        }
        let codec = match (codecs().get_codec(params.codec), wav_format) {
            (Some(descriptor), _) => descriptor.long_name.to_string(),
            (None, Some(wav)) => riff::format_name(wav.format_tag),
            (None, None) => codec_name(params.codec),
        };
        let made =
            make_decoder(&params).map_err(|payload| AudioError::Corrupt(panic_message(payload.as_ref())))?;
        let decoder = match made {
            Ok(decoder) => decoder,
            // Opus says which of its streams it cannot decode (surround).
            Err(SymphoniaError::Unsupported(what)) if params.codec == CODEC_TYPE_OPUS => {
                return Err(AudioError::UnsupportedCodec { container, codec: what.into() });
            }
            Err(SymphoniaError::Unsupported(_)) => {
                return Err(AudioError::UnsupportedCodec { container, codec });
            }
            Err(e) => {
                return Err(AudioError::Corrupt(format!("the {container} codec setup is invalid: {e}")))
            }
        };
        // The start that is not the recording (Opus's pre-skip), cut here by `trim`; an
        // OGG's length counts it.
        let codec_delay = super::opus::pre_skip(&params);
        let declared_frames = params.n_frames.map(|n| n.saturating_sub(codec_delay));
        let source = SourceFormat {
            container,
            codec,
            sample_rate: params.sample_rate.unwrap_or(0),
            channels: params.channels.map(|c| c.count()).unwrap_or(0),
        };
        Ok(TrackDecoder {
            format,
            decoder,
            params,
            track_id,
            source,
            limits: limits.clone(),
            declared_frames,
            frames: 0,
            seconds: 0.0,
            skipped_packets: 0,
            damaged: truncated,
            finished: false,
            past_end: Vec::new(),
            pending: VecDeque::new(),
            joined: false,
            edit,
            trim_skip: codec_delay,
            trim_keep: None,
        })
    }

    /// Replaces `mono` with the next packet's samples, downmixed; `false` at the end.
    /// The sample rate is `self.source.sample_rate`, fixed by the first packet.
    pub fn next_packet(&mut self, mono: &mut Vec<f32>) -> Result<bool, AudioError> {
        mono.clear();
        while !self.finished && mono.is_empty() {
            self.step(mono)?;
        }
        if self.finished && self.declared_frames.is_some_and(|declared| self.frames < declared) {
            self.damaged = true;
        }
        if self.finished && self.frames == 0 {
            return Err(match (self.skipped_packets, self.declared_frames) {
                (0, Some(declared)) if declared > 0 => AudioError::Corrupt(format!(
                    "its header announces {declared} samples but none of them could be read"
                )),
                (0, _) => AudioError::Empty,
                (skipped, _) => AudioError::Corrupt(format!(
                    "none of its {skipped} {} packets could be decoded",
                    self.source.codec
                )),
            });
        }
        Ok(!mono.is_empty())
    }

    /// Reads and decodes one packet; an empty `mono` means nothing came out of it.
    fn step(&mut self, mono: &mut Vec<f32>) -> Result<(), AudioError> {
        if let Some(packet) = self.pending.pop_front() {
            return self.decode(packet, mono);
        }
        let mut packet = match catch_unwind(AssertUnwindSafe(|| self.format.next_packet())) {
            Ok(Ok(packet)) => packet,
            Ok(Err(SymphoniaError::IoError(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                self.finished = true;
                return Ok(());
            }
            // A second chained stream (OGG) would need a new decoder: the first one is the audio.
            Ok(Err(SymphoniaError::ResetRequired)) => {
                self.finished = true;
                return Ok(());
            }
            Ok(Err(e)) => return self.stop_at_damage(e.to_string()),
            Err(payload) => return self.stop_at_damage(panic_message(payload.as_ref())),
        };
        if packet.track_id() != self.track_id {
            return Ok(());
        }
        if packet.dur == 0 && packet.trim_end > 0 && !self.joined {
            // Past the declared length: padding, or another file (see *Joined MP3s*).
            self.past_end.push(packet);
            if self.past_end.len() > PADDING_FRAMES {
                self.joined = true;
                self.pending.extend(self.past_end.drain(..).map(uncut));
            }
            return Ok(());
        }
        if self.joined {
            packet = uncut(packet);
        }
        self.decode(packet, mono)
    }

    /// Decodes one packet into `mono`; an empty `mono` means nothing came out of it.
    fn decode(&mut self, packet: Packet, mono: &mut Vec<f32>) -> Result<(), AudioError> {
        let mut decoded = self.try_decode(&packet, mono);
        if matches!(&decoded, Ok(Err(SymphoniaError::DecodeError(why))) if why.contains(SPEC_CHANGED))
            && self.frames > 0
        {
            // A joined file of another rate or channel count: its frames need a decoder of
            // their own (the reservoir of the file before does not carry over anyway).
            if let Ok(Ok(fresh)) = make_decoder(&self.params) {
                self.decoder = fresh;
                decoded = self.try_decode(&packet, mono);
            }
        }
        let (rate, channels) = match decoded {
            Ok(Ok((rate, channels, ()))) => (rate, channels),
            Ok(Err(SymphoniaError::DecodeError(_) | SymphoniaError::IoError(_))) => {
                self.skipped_packets += 1;
                self.damaged = true;
                mono.clear();
                return Ok(());
            }
            Ok(Err(SymphoniaError::Unsupported(what))) if self.frames == 0 => {
                return Err(AudioError::UnsupportedCodec {
                    container: self.source.container,
                    codec: format!("{} ({what})", self.source.codec),
                });
            }
            Ok(Err(e)) => {
                mono.clear();
                return self.stop_at_damage(e.to_string());
            }
            Err(payload) => {
                mono.clear();
                return self.stop_at_damage(panic_message(payload.as_ref()));
            }
        };
        self.trim(rate, mono);
        if mono.is_empty() {
            return Ok(());
        }
        self.accept(rate, channels, mono.len())
    }

    /// Cuts what is not the recording from a decoded packet: the codec's delay at the
    /// start (Opus's pre-skip), or, where an MP4's edit list says, its priming and padding.
    /// Every start trim is made here, once.
    fn trim(&mut self, rate: u32, mono: &mut Vec<f32>) {
        if let Some(edit) = self.edit.take() {
            let (skip, keep) = edit.in_frames(rate);
            // The edit's start counts the codec's delay too (an Opus pre-skip, as the ISO
            // BMFF encapsulation of Opus says): it replaces it. What the container counts
            // includes the priming and the padding.
            let delay = std::mem::replace(&mut self.trim_skip, skip);
            self.trim_keep = keep;
            self.declared_frames = keep.or(self.declared_frames.map(|d| (d + delay).saturating_sub(skip)));
        }
        let cut = usize::try_from(self.trim_skip).unwrap_or(usize::MAX).min(mono.len());
        mono.drain(..cut);
        self.trim_skip -= cut as u64;
        if let Some(keep) = self.trim_keep {
            let room = usize::try_from(keep.saturating_sub(self.frames)).unwrap_or(usize::MAX);
            mono.truncate(room);
        }
    }

    fn try_decode(
        &mut self,
        packet: &Packet,
        mono: &mut Vec<f32>,
    ) -> std::thread::Result<Result<(u32, usize, ()), SymphoniaError>> {
        let decoder = &mut self.decoder;
        catch_unwind(AssertUnwindSafe(|| match decoder.decode(packet) {
            Ok(buffer) => Ok((buffer.spec().rate, buffer.spec().channels.count(), downmix(buffer, mono))),
            Err(e) => Err(e),
        }))
    }

    /// Checks a decoded packet's signal and counts it against the limit.
    fn accept(&mut self, rate: u32, channels: usize, frames: usize) -> Result<(), AudioError> {
        if channels == 0 {
            return Err(AudioError::AbsurdParameters("the audio decodes to 0 channels".into()));
        }
        if self.frames == 0 {
            check_rate(rate)?;
            self.source.sample_rate = rate;
            self.source.channels = channels;
        } else if rate != self.source.sample_rate {
            // Joined files of different rates: `source` tells the current one.
            check_rate(rate)?;
            tracing::debug!(from = self.source.sample_rate, to = rate, "the sample rate changes part-way");
            self.source.sample_rate = rate;
        }
        self.frames += frames as u64;
        self.seconds += frames as f64 / f64::from(rate);
        if self.seconds > self.limits.max_seconds {
            return Err(AudioError::TooLong {
                limit_seconds: self.limits.max_seconds,
                at_least_seconds: self.seconds,
            });
        }
        Ok(())
    }

    /// Ends decoding where the data stops making sense, keeping what came before.
    fn stop_at_damage(&mut self, what: String) -> Result<(), AudioError> {
        if self.frames == 0 {
            return Err(AudioError::Corrupt(what));
        }
        tracing::debug!(frames = self.frames, "audio decoding stopped at damaged data: {what}");
        self.damaged = true;
        self.finished = true;
        Ok(())
    }
}

/// A packet decoded whole: none of its frames cut as padding.
fn uncut(mut packet: Packet) -> Packet {
    packet.dur += u64::from(packet.trim_end);
    packet.trim_end = 0;
    packet
}

/// A codec symphonia knows by number but cannot decode here.
fn codec_name(codec: CodecType) -> String {
    format!("codec {codec}")
}

/// Averages the channels of a decoded buffer into `mono`, as ffmpeg's downmix to one
/// channel does for 16-bit output (each channel weighted 1/n). Non-finite samples
/// (float WAV can hold them) become silence so one bad value cannot poison a window.
fn downmix(buffer: AudioBufferRef<'_>, mono: &mut Vec<f32>) {
    match buffer {
        AudioBufferRef::U8(b) => mix(&b, mono),
        AudioBufferRef::U16(b) => mix(&b, mono),
        AudioBufferRef::U24(b) => mix(&b, mono),
        AudioBufferRef::U32(b) => mix(&b, mono),
        AudioBufferRef::S8(b) => mix(&b, mono),
        AudioBufferRef::S16(b) => mix(&b, mono),
        AudioBufferRef::S24(b) => mix(&b, mono),
        AudioBufferRef::S32(b) => mix(&b, mono),
        AudioBufferRef::F32(b) => mix(&b, mono),
        AudioBufferRef::F64(b) => mix(&b, mono),
    }
}

fn mix<S: Sample + IntoSample<f32>>(buffer: &AudioBuffer<S>, mono: &mut Vec<f32>) {
    let channels = buffer.spec().channels.count();
    let frames = buffer.frames();
    mono.clear();
    if channels == 0 {
        return;
    }
    mono.resize(frames, 0.0);
    for channel in 0..channels {
        for (sum, &sample) in mono.iter_mut().zip(buffer.chan(channel)) {
            *sum += sample.into_sample();
        }
    }
    if channels > 1 {
        let scale = 1.0 / channels as f32;
        mono.iter_mut().for_each(|s| *s *= scale);
    }
    mono.iter_mut().filter(|s| !s.is_finite()).for_each(|s| *s = 0.0);
}
