//! Opus, the codec of browsers' recordings (WebM from `MediaRecorder`) and of voice notes
//! (OGG/Opus), which symphonia 0.5 demuxes but cannot decode: a symphonia [`Decoder`]
//! over `opus-rs`, a pure-Rust port of libopus 1.6 (no C library to build or ship). Its
//! output of the WebM fixture agrees with libopus's to 62.7 dB, and it decodes 20 minutes
//! of 48 kHz speech in 1.8 s; `opus-decoder`, tried first, agreed as well but took ~150 s
//! (its CELT path: a browser's 48 kHz recording decoded at 5-9x real time, so a long
//! upload kept a core busy for minutes).
//!
//! Output is at 48 kHz, Opus's own rate, in the stream's channels (1 or 2): the audio
//! stream downmixes and resamples as for any codec. The header's output gain is applied,
//! and the last packet's end padding cut where the container says (an OGG's last granule
//! position). The encoder's pre-skip (`OpusHead`, 312 samples from libopus), which RFC
//! 7845 says to drop from the start, is left to the one place every start trim is made
//! (`decode.rs`, [`pre_skip`]): an MP4's edit list counts it too, and two stages that
//! each cut it had cut it twice. One mono or stereo stream under
//! channel mapping family 1 or 255 is read as family 0; surround (several streams, or
//! more than two channels) is refused by name.

use opus_rs::OpusDecoder as Inner;
use symphonia::core::{
    audio::{AsAudioBufferRef, AudioBuffer, AudioBufferRef, Channels, Signal, SignalSpec},
    codecs::{CodecDescriptor, CodecParameters, Decoder, DecoderOptions, FinalizeResult, CODEC_TYPE_OPUS},
    errors::{decode_error, unsupported_error, Result},
    formats::Packet,
};

/// The rate every Opus stream decodes to here.
const RATE: u32 = 48_000;

/// The longest packet: 120 ms at 48 kHz, per channel.
const MAX_FRAMES: usize = 5_760;

pub(crate) struct OpusDecoder {
    inner: Inner,
    params: CodecParameters,
    channels: usize,
    /// Linear factor of the header's output gain.
    gain: f32,
    pcm: Vec<f32>,
    buf: AudioBuffer<f32>,
}

/// What `OpusHead` (RFC 7845 section 5.1: in the OGG stream's first packet, WebM's
/// `CodecPrivate`) says: (channels, pre-skip, output gain in dB, channel mapping family).
///
/// An MP4's `dOps` box holds the same fields after a version byte of 0 (an `OpusHead`'s
/// is 1), but big-endian (the ISO BMFF encapsulation of Opus); symphonia hands it on
/// behind the `OpusHead` magic as it is. Read as little-endian, its 312-sample pre-skip
/// was 14,337: the first 0.3 s of every Opus recording in an MP4 was dropped.
fn head(extra: &[u8]) -> Option<(u8, u16, f32, u8)> {
    if extra.len() < 19 || &extra[..8] != b"OpusHead" {
        return None;
    }
    let (pre_skip, gain_q8) = match extra[8] {
        0 => (u16::from_be_bytes([extra[10], extra[11]]), i16::from_be_bytes([extra[16], extra[17]])),
        _ => (u16::from_le_bytes([extra[10], extra[11]]), i16::from_le_bytes([extra[16], extra[17]])),
    };
    Some((extra[9], pre_skip, f32::from(gain_q8) / 256.0, extra[18]))
}

/// Whether a header of channel mapping family 1 or 255 (after the family byte: stream
/// count, coupled count, one mapping byte per channel) describes what family 0 does: one
/// stream of the header's one or two channels, in order. Legal, and ffmpeg and libopus
/// read it; anything else is surround (several streams), which is refused.
fn single_stream(extra: &[u8], channels: u8) -> bool {
    let identity: &[u8] = if channels == 2 { &[1, 1, 0, 1] } else { &[1, 0, 0] };
    (1..=2).contains(&channels) && extra.get(19..19 + identity.len()) == Some(identity)
}

/// What is wrong with an OGG's `OpusHead` (in its first page), if something is:
/// symphonia skips a stream whose header it refuses and reads on to the end, so the
/// upload would be refused as ending "before its audio begins".
pub(crate) fn ogg_head_problem(bytes: &[u8]) -> Option<String> {
    let first_page = &bytes[..bytes.len().min(27 + 255 + 255)];
    let at = first_page.windows(8).position(|w| w == b"OpusHead")?;
    let h = &bytes[at..];
    let Some(&[version, channels]) = h.get(8..10) else { return Some("Opus header is cut short".into()) };
    if version >> 4 != 0 {
        return Some(format!("Opus header is of version {version}, which this server does not read"));
    }
    if channels == 0 {
        return Some("Opus header declares 0 channels".into());
    }
    let Some(&family) = h.get(18) else { return Some("Opus header is cut short".into()) };
    if family == 0 && channels > 2 {
        return Some(format!("Opus header declares {channels} channels without a channel mapping"));
    }
    if family != 0 && h.len() < 21 + usize::from(channels) {
        return Some("Opus header's channel mapping is cut short".into());
    }
    None
}

/// The samples at the start of an Opus stream that are not the recording: the encoder's
/// pre-skip, at 48 kHz (0 for other codecs).
pub(crate) fn pre_skip(params: &CodecParameters) -> u64 {
    if params.codec != CODEC_TYPE_OPUS {
        return 0;
    }
    params.extra_data.as_deref().and_then(head).map_or(params.delay.unwrap_or(0).into(), |h| h.1.into())
}

impl Decoder for OpusDecoder {
    fn try_new(params: &CodecParameters, _options: &DecoderOptions) -> Result<Self> {
        let header = params.extra_data.as_deref().and_then(head);
        let (channels, gain_db) = match header {
            Some((channels, _, _, family))
                if family != 0
                    && !params.extra_data.as_deref().is_some_and(|e| single_stream(e, channels)) =>
            {
                return unsupported_error("surround Opus (more than one stream)")
            }
            Some((channels, _, gain_db, _)) => (usize::from(channels), gain_db),
            None => (params.channels.map_or(1, |c| c.count()), 0.0),
        };
        let layout = match channels {
            1 => Channels::FRONT_LEFT,
            2 => Channels::FRONT_LEFT | Channels::FRONT_RIGHT,
            0 => return decode_error("opus: the header declares 0 channels"),
            _ => return unsupported_error("surround Opus (more than two channels)"),
        };
        let inner = Inner::new(RATE as i32, channels)
            .map_err(|_| symphonia::core::errors::Error::Unsupported("opus"))?;
        Ok(OpusDecoder {
            inner,
            params: params.clone(),
            channels,
            gain: 10f32.powf(gain_db / 20.0),
            pcm: vec![0.0; MAX_FRAMES * channels],
            buf: AudioBuffer::new(MAX_FRAMES as u64, SignalSpec::new(RATE, layout)),
        })
    }

    fn supported_codecs() -> &'static [CodecDescriptor] {
        &[symphonia::core::support_codec!(CODEC_TYPE_OPUS, "opus", "Opus")]
    }

    fn reset(&mut self) {
        // After a seek (never here: uploads are read from the start), a fresh state.
        if let Ok(fresh) = Inner::new(RATE as i32, self.channels) {
            self.inner = fresh;
        }
    }

    fn codec_params(&self) -> &CodecParameters {
        &self.params
    }

    fn decode(&mut self, packet: &Packet) -> Result<AudioBufferRef<'_>> {
        self.buf.clear();
        // An empty packet would ask for loss concealment: nothing was lost in a file.
        if packet.buf().is_empty() {
            return Ok(self.buf.as_audio_buffer_ref());
        }
        let frames = match self.inner.decode(packet.buf(), MAX_FRAMES, &mut self.pcm) {
            Ok(n) => n.min(MAX_FRAMES),
            Err(_) => return decode_error("opus: a packet is not valid Opus"),
        };
        // The last packet's end padding, as the container says (an OGG's last granule
        // position, RFC 7845 section 4.4): the audio ends where it ended.
        let kept = frames.saturating_sub(packet.trim_end as usize);
        self.buf.render_reserved(Some(kept));
        for ch in 0..self.channels {
            let out = self.buf.chan_mut(ch);
            for (i, sample) in out.iter_mut().enumerate() {
                *sample = self.pcm[i * self.channels + ch] * self.gain;
            }
        }
        Ok(self.buf.as_audio_buffer_ref())
    }

    fn finalize(&mut self) -> FinalizeResult {
        FinalizeResult::default()
    }

    fn last_decoded(&self) -> AudioBufferRef<'_> {
        self.buf.as_audio_buffer_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_gives_channels_pre_skip_gain_and_family() {
        let mut h = b"OpusHead".to_vec();
        h.extend([1, 2]); // version, channels
        h.extend(312u16.to_le_bytes());
        h.extend(48_000u32.to_le_bytes());
        h.extend((-256i16).to_le_bytes()); // -1 dB
        h.push(0);
        assert_eq!(head(&h), Some((2, 312, -1.0, 0)));
        assert_eq!(head(&h[..18]), None, "cut short");
        assert_eq!(head(b"OpusTags and more bytes"), None);
        // An MP4's dOps (version 0): the same fields, big-endian.
        let mut dops = b"OpusHead".to_vec();
        dops.extend([0, 1]);
        dops.extend(312u16.to_be_bytes());
        dops.extend(16_000u32.to_be_bytes());
        dops.extend((-512i16).to_be_bytes());
        dops.push(0);
        assert_eq!(head(&dops), Some((1, 312, -2.0, 0)));
        // Family 1 with one stereo stream, channels in order: what family 0 says.
        h[18] = 1;
        let one = [h.clone(), vec![1, 1, 0, 1]].concat();
        assert!(single_stream(&one, 2));
        assert!(!single_stream(&[h.clone(), vec![2, 1, 0, 1]].concat(), 2), "two streams");
        assert!(!single_stream(&[h.clone(), vec![1, 1, 1, 0]].concat(), 2), "swapped channels");
        assert!(!single_stream(&h, 2), "no mapping table");
        let mut params = CodecParameters::new();
        params.for_codec(CODEC_TYPE_OPUS).with_extra_data(one.into_boxed_slice());
        assert!(OpusDecoder::try_new(&params, &DecoderOptions::default()).is_ok(), "read as family 0");
        params.with_extra_data([h, vec![2, 1, 0, 1]].concat().into_boxed_slice());
        let refused = OpusDecoder::try_new(&params, &DecoderOptions::default()).err().map(|e| e.to_string());
        assert!(refused.as_deref().is_some_and(|e| e.contains("surround Opus")), "{refused:?}");
    }
}
