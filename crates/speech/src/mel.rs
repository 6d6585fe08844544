//! Whisper's log-mel features, exactly as faster-whisper 1.2.1 computes them, from a
//! stream of 16 kHz samples, one 30-second window at a time.
//!
//! faster-whisper's `FeatureExtractor` appends 160 zeros to the audio, takes a centred
//! STFT (400-sample periodic Hann window, hop 160, the signal reflected at both ends),
//! keeps the power of all frames but the last, applies Slaney-normalised mel filters
//! (80 bands, or 128 for large-v3), takes `log10(max(x, 1e-10))`, raises everything
//! to at least the *whole file's* peak minus 8, and maps `x` to `(x + 4) / 4`. The
//! transcription loop then slices 3,000-frame windows at any frame `seek`, leaving
//! out the very last frame, and pads a short window with zeros.
//!
//! The peak is what keeps this from being a per-window computation: one loud second
//! at the end of an hour changes the floor of the first window. So the peak is found
//! by a first pass ([`PeakTracker`], run by `audio::probe` for both band counts at
//! once, since the STFT dominates), and [`LogMelWindows`] then computes any window
//! from the stream with that peak. Each frame sees the samples around it whichever
//! window it falls in, so the windows equal slices of the whole-file computation
//! ([`log_mel_spectrogram`]), bit for bit. Arithmetic is `f32` as in numpy: the
//! features match faster-whisper's within 1e-5 (7.8e-6 on beckett.wav, the fixture's
//! six-decimal rounding included; `tests/mel_reference.rs`).

use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};

use crate::audio::{AudioError, SampleSource, SAMPLE_RATE};

/// STFT window length in samples (25 ms).
pub const N_FFT: usize = 400;
/// Samples between frames (10 ms): one frame per 160 samples.
pub const HOP_LENGTH: usize = 160;
/// Frequency bins of one frame.
pub const N_FREQUENCIES: usize = N_FFT / 2 + 1;
/// Frames in one encoder window (30 s).
pub const FRAMES_PER_WINDOW: usize = 3000;
/// Mel band counts of Whisper models: 80, and 128 for large-v3.
pub const WHISPER_MEL_BANDS: [usize; 2] = [80, 128];

/// Zeros faster-whisper appends to the audio before the STFT.
const TAIL_PADDING: u64 = HOP_LENGTH as u64;
/// Samples of the reflected margin on each side of the centred STFT.
const MARGIN: i64 = (N_FFT / 2) as i64;
/// The first samples, kept for the reflection at the start (indices 0..=200).
const HEAD_SAMPLES: usize = N_FFT / 2 + 1;
/// Power below this is taken as this before the log (-100 dB).
const POWER_FLOOR: f32 = 1e-10;
/// Decades kept below the peak.
const DYNAMIC_RANGE: f32 = 8.0;
/// Samples read from the source at a time.
const READ_CHUNK: usize = 16_000;

/// Content frames (frames the transcription windows may use) of `samples` samples.
pub fn content_frames(samples: u64) -> u64 {
    samples / HOP_LENGTH as u64
}

/// Slaney-style triangular mel filters over the 201 bins of a 400-point FFT at 16 kHz,
/// each stored as its non-zero run of weights.
#[derive(Debug, Clone)]
pub struct MelFilters {
    bands: Vec<(usize, Vec<f32>)>,
}

impl MelFilters {
    /// The filters librosa (and faster-whisper) compute for `n_mels` bands, in `f64`
    /// and then rounded to `f32` as they do.
    pub fn new(n_mels: usize) -> MelFilters {
        let sample_rate = f64::from(SAMPLE_RATE);
        // numpy's rfftfreq: k * 1 / (n * (1 / sr)).
        let bin_step = 1.0 / (N_FFT as f64 * (1.0 / sample_rate));
        let bin_hz: Vec<f64> = (0..N_FREQUENCIES).map(|k| k as f64 * bin_step).collect();
        // The mel of 8 kHz on the Slaney scale; points evenly spaced as numpy's linspace.
        let max_mel = 45.245640471924965;
        let points = n_mels + 2;
        let step = max_mel / (points - 1) as f64;
        let (hz_per_mel, log_start_hz) = (200.0 / 3.0, 1000.0);
        let log_start_mel = log_start_hz / hz_per_mel;
        let log_step = 6.4f64.ln() / 27.0;
        let band_hz: Vec<f64> = (0..points)
            .map(|i| if i + 1 == points { max_mel } else { i as f64 * step })
            .map(|mel| {
                if mel >= log_start_mel {
                    log_start_hz * (log_step * (mel - log_start_mel)).exp()
                } else {
                    hz_per_mel * mel
                }
            })
            .collect();
        let bands = (0..n_mels)
            .map(|m| {
                let (low, centre, high) = (band_hz[m], band_hz[m + 1], band_hz[m + 2]);
                let norm = 2.0 / (high - low);
                let weights: Vec<(usize, f32)> = bin_hz
                    .iter()
                    .enumerate()
                    .map(|(k, &hz)| {
                        let rising = -(low - hz) / (centre - low);
                        let falling = (high - hz) / (high - centre);
                        (k, (rising.min(falling).max(0.0) * norm) as f32)
                    })
                    .filter(|&(_, w)| w > 0.0)
                    .collect();
                let first = weights.first().map_or(0, |&(k, _)| k);
                (first, weights.into_iter().map(|(_, w)| w).collect())
            })
            .collect();
        MelFilters { bands }
    }

    pub fn n_mels(&self) -> usize {
        self.bands.len()
    }

    /// Mel powers of one frame's power spectrum.
    fn apply(&self, power: &[f32], mel: &mut [f32]) {
        for ((first, weights), out) in self.bands.iter().zip(mel.iter_mut()) {
            *out = weights.iter().zip(&power[*first..]).map(|(w, p)| w * p).sum();
        }
    }

    /// The highest mel power of one frame.
    fn peak(&self, power: &[f32]) -> f32 {
        self.bands
            .iter()
            .map(|(first, weights)| weights.iter().zip(&power[*first..]).map(|(w, p)| w * p).sum::<f32>())
            .fold(f32::MIN, f32::max)
    }
}

fn log_power(power: f32) -> f32 {
    power.max(POWER_FLOOR).log10()
}

/// What the next frame of a [`Framer`] is.
enum Next {
    /// A frame the transcription uses.
    Content,
    /// The last frame: counted in the peak, never in a window.
    Last,
    /// Its samples have not arrived yet.
    NeedSamples,
    /// There are no more frames.
    End,
}

/// Power spectra of consecutive STFT frames over samples pushed in pieces, with the
/// padding and reflection of faster-whisper's whole-array computation.
struct Framer {
    fft: Arc<dyn RealToComplex<f32>>,
    window: Vec<f32>,
    frame: Vec<f32>,
    spectrum: Vec<realfft::num_complex::Complex<f32>>,
    scratch: Vec<realfft::num_complex::Complex<f32>>,
    head: Vec<f32>,
    buffer: Vec<f32>,
    buffer_start: u64,
    received: u64,
    total: Option<u64>,
    next_frame: u64,
}

impl Framer {
    fn new() -> Framer {
        let fft = RealFftPlanner::<f32>::new().plan_fft_forward(N_FFT);
        // numpy's hanning(401)[:-1] in f64, rounded to f32.
        let window = (0..N_FFT)
            .map(|n| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos()) as f32)
            .collect();
        Framer {
            frame: fft.make_input_vec(),
            spectrum: fft.make_output_vec(),
            scratch: fft.make_scratch_vec(),
            fft,
            window,
            head: Vec::with_capacity(HEAD_SAMPLES),
            buffer: Vec::new(),
            buffer_start: 0,
            received: 0,
            total: None,
            next_frame: 0,
        }
    }

    fn push(&mut self, samples: &[f32]) {
        let take = (HEAD_SAMPLES - self.head.len()).min(samples.len());
        self.head.extend_from_slice(&samples[..take]);
        self.buffer.extend_from_slice(samples);
        self.received += samples.len() as u64;
    }

    fn finish(&mut self) {
        self.total = Some(self.received);
    }

    fn content_frames(&self) -> Option<u64> {
        self.total.map(content_frames)
    }

    fn next(&self) -> Next {
        let start = self.next_frame * HOP_LENGTH as u64;
        match self.total {
            Some(total) if start + HOP_LENGTH as u64 <= total => Next::Content,
            Some(total) if start <= total => Next::Last,
            Some(_) => Next::End,
            // Enough samples that the frame is whole and the audio longer than it.
            None if self.received > start + MARGIN as u64 => Next::Content,
            None => Next::NeedSamples,
        }
    }

    /// Leaves out frames up to `frame` (their samples are still needed for later ones).
    fn skip_to(&mut self, frame: u64) {
        self.next_frame = self.next_frame.max(frame);
    }

    /// Sample `i` of the audio with its zero tail, reflected beyond both ends the way
    /// numpy's `pad(mode="reflect")` repeats its reflection when the pad is longer.
    fn padded_sample(&self, i: i64) -> f32 {
        let length = match self.total {
            Some(total) => i64::try_from(total + TAIL_PADDING).unwrap_or(i64::MAX / 4),
            None => i64::MAX / 4,
        };
        let j = if (0..length).contains(&i) {
            i
        } else {
            let period = 2 * (length - 1);
            let r = i.rem_euclid(period);
            if r < length {
                r
            } else {
                period - r
            }
        };
        let j = j as u64;
        if j >= self.received {
            0.0
        } else if j >= self.buffer_start {
            self.buffer.get((j - self.buffer_start) as usize).copied().unwrap_or(0.0)
        } else {
            self.head.get(j as usize).copied().unwrap_or(0.0)
        }
    }

    /// Computes the power spectrum of the next frame (which `next` said is ready).
    fn power(&mut self, power: &mut [f32]) -> Result<(), AudioError> {
        let start = self.next_frame as i64 * HOP_LENGTH as i64 - MARGIN;
        let end = start + N_FFT as i64;
        if start >= self.buffer_start as i64 && end as u64 <= self.received {
            let from = (start as u64 - self.buffer_start) as usize;
            let samples = &self.buffer[from..from + N_FFT];
            for ((x, s), w) in self.frame.iter_mut().zip(samples).zip(&self.window) {
                *x = s * w;
            }
        } else {
            for (k, w) in self.window.iter().enumerate() {
                self.frame[k] = self.padded_sample(start + k as i64) * w;
            }
        }
        self.fft
            .process_with_scratch(&mut self.frame, &mut self.spectrum, &mut self.scratch)
            .map_err(|e| AudioError::Internal(format!("the STFT failed: {e}")))?;
        for (p, c) in power.iter_mut().zip(&self.spectrum) {
            *p = c.re * c.re + c.im * c.im;
        }
        self.next_frame += 1;
        self.drop_used_samples();
        Ok(())
    }

    /// Forgets samples no later frame reads, in large steps so each sample moves once
    /// or twice.
    fn drop_used_samples(&mut self) {
        let keep_from = (self.next_frame * HOP_LENGTH as u64).saturating_sub(MARGIN as u64);
        let unused = keep_from.saturating_sub(self.buffer_start).min(self.buffer.len() as u64) as usize;
        if unused >= 1 << 16 || unused == self.buffer.len() && unused > 0 {
            self.buffer.drain(..unused);
            self.buffer_start += unused as u64;
        }
    }
}

/// A log-mel spectrogram of a whole clip: `values[m * n_frames + t]` for band `m`
/// and frame `t`.
#[derive(Debug, Clone, PartialEq)]
pub struct LogMelSpectrogram {
    pub n_mels: usize,
    pub n_frames: usize,
    pub values: Vec<f32>,
}

/// `FeatureExtractor(feature_size=n_mels)(samples)` of faster-whisper: every frame
/// including the last, normalised by this clip's own peak. For short clips and
/// checks; long audio goes through [`LogMelWindows`].
pub fn log_mel_spectrogram(samples: &[f32], filters: &MelFilters) -> Result<LogMelSpectrogram, AudioError> {
    let mut framer = Framer::new();
    framer.push(samples);
    framer.finish();
    let n_mels = filters.n_mels();
    let mut power = vec![0.0; N_FREQUENCIES];
    let mut mel = vec![0.0; n_mels];
    let mut frames: Vec<f32> = Vec::new();
    while matches!(framer.next(), Next::Content | Next::Last) {
        framer.power(&mut power)?;
        filters.apply(&power, &mut mel);
        frames.extend(mel.iter().map(|&p| log_power(p)));
    }
    let n_frames = frames.len() / n_mels.max(1);
    let floor = frames.iter().copied().fold(f32::MIN, f32::max) - DYNAMIC_RANGE;
    let mut values = vec![0.0; frames.len()];
    for (t, frame) in frames.chunks_exact(n_mels.max(1)).enumerate() {
        for (m, &x) in frame.iter().enumerate() {
            values[m * n_frames + t] = (x.max(floor) + 4.0) / 4.0;
        }
    }
    Ok(LogMelSpectrogram { n_mels, n_frames, values })
}

/// The highest log10 mel power of a whole audio, per band count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogMelPeaks {
    pub mel80: f32,
    pub mel128: f32,
}

impl LogMelPeaks {
    /// The peak for a model with `n_mels` bands, if it is one of Whisper's.
    pub fn get(&self, n_mels: usize) -> Option<f32> {
        match n_mels {
            80 => Some(self.mel80),
            128 => Some(self.mel128),
            _ => None,
        }
    }
}

/// Finds the log-mel peaks of audio pushed in pieces, keeping no features.
pub struct PeakTracker {
    framer: Framer,
    filters: [MelFilters; 2],
    peaks: [f32; 2],
    power: Vec<f32>,
}

impl Default for PeakTracker {
    fn default() -> Self {
        PeakTracker::new()
    }
}

impl PeakTracker {
    pub fn new() -> PeakTracker {
        PeakTracker {
            framer: Framer::new(),
            filters: WHISPER_MEL_BANDS.map(MelFilters::new),
            peaks: [0.0; 2],
            power: vec![0.0; N_FREQUENCIES],
        }
    }

    pub fn push(&mut self, samples: &[f32]) {
        self.framer.push(samples);
        self.drain();
    }

    /// The peaks, once all the audio has been pushed.
    pub fn finish(mut self) -> LogMelPeaks {
        self.framer.finish();
        self.drain();
        let [mel80, mel128] = self.peaks.map(log_power);
        LogMelPeaks { mel80, mel128 }
    }

    fn drain(&mut self) {
        while matches!(self.framer.next(), Next::Content | Next::Last) {
            if self.framer.power(&mut self.power).is_err() {
                // Only a wrong buffer length fails, which cannot happen here; the frame
                // is skipped rather than losing the file.
                continue;
            }
            for (peak, filters) in self.peaks.iter_mut().zip(&self.filters) {
                *peak = peak.max(filters.peak(&self.power));
            }
        }
    }
}

/// The 3,000-frame windows of a stream's log-mel features, for a given peak, read
/// from the stream as they are asked for. Windows must be asked for at
/// non-decreasing `seek`s (they overlap freely): samples before the current window
/// are gone.
pub struct LogMelWindows<S> {
    source: S,
    framer: Framer,
    filters: MelFilters,
    floor: f32,
    /// Finished frames from `cache_first`, `n_mels` values each.
    cache: Vec<f32>,
    cache_first: u64,
    source_ended: bool,
    samples: Vec<f32>,
    power: Vec<f32>,
    mel: Vec<f32>,
}

impl<S: SampleSource> LogMelWindows<S> {
    /// `peak` is the whole audio's highest log10 mel power for `n_mels` bands
    /// (`AudioInfo::log_mel_peaks`).
    pub fn new(source: S, n_mels: usize, peak: f32) -> Self {
        LogMelWindows {
            source,
            framer: Framer::new(),
            filters: MelFilters::new(n_mels),
            floor: peak - DYNAMIC_RANGE,
            cache: Vec::new(),
            cache_first: 0,
            source_ended: false,
            samples: Vec::with_capacity(READ_CHUNK),
            power: vec![0.0; N_FREQUENCIES],
            mel: vec![0.0; n_mels],
        }
    }

    pub fn n_mels(&self) -> usize {
        self.filters.n_mels()
    }

    /// The number of content frames, known once the stream has been read to its end.
    pub fn content_frames(&self) -> Option<u64> {
        self.framer.content_frames()
    }

    /// Fills `out` (`n_mels × 3000`, band-major, as the encoder takes it) with frames
    /// `seek..seek + 3000`, zeros past the end of the audio, and returns how many
    /// frames are audio (0 when `seek` is past the end).
    pub fn window(&mut self, seek: u64, out: &mut [f32]) -> Result<usize, AudioError> {
        let n_mels = self.n_mels();
        if out.len() != n_mels * FRAMES_PER_WINDOW {
            return Err(AudioError::Internal(format!(
                "a mel window holds {n_mels} x {FRAMES_PER_WINDOW} values, not {}",
                out.len()
            )));
        }
        if seek < self.cache_first {
            return Err(AudioError::Internal(format!(
                "mel windows go forward only: frame {seek} was asked for after frame {}",
                self.cache_first
            )));
        }
        let cached = (self.cache.len() / n_mels) as u64;
        let stale = (seek - self.cache_first).min(cached);
        self.cache.drain(..stale as usize * n_mels);
        self.cache_first += stale;
        if self.cache.is_empty() {
            self.framer.skip_to(seek);
            self.cache_first = seek;
        }
        let wanted_end = seek + FRAMES_PER_WINDOW as u64;
        while self.cache_first + ((self.cache.len() / n_mels) as u64) < wanted_end {
            match self.framer.next() {
                Next::Content => {
                    self.framer.power(&mut self.power)?;
                    self.filters.apply(&self.power, &mut self.mel);
                    let floor = self.floor;
                    self.cache.extend(self.mel.iter().map(|&p| (log_power(p).max(floor) + 4.0) / 4.0));
                }
                Next::NeedSamples if !self.source_ended => {
                    self.samples.clear();
                    if self.source.read(&mut self.samples, READ_CHUNK)? == 0 {
                        self.source_ended = true;
                        self.framer.finish();
                    } else {
                        self.framer.push(&self.samples);
                    }
                }
                Next::NeedSamples | Next::Last | Next::End => break,
            }
        }
        let frames = (self.cache.len() / n_mels).min(FRAMES_PER_WINDOW);
        out.fill(0.0);
        for (t, frame) in self.cache.chunks_exact(n_mels).take(frames).enumerate() {
            for (m, &x) in frame.iter().enumerate() {
                out[m * FRAMES_PER_WINDOW + t] = x;
            }
        }
        Ok(frames)
    }
}
