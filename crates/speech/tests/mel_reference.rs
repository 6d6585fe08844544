//! Log-mel features against faster-whisper 1.2.1's, and streamed windows against the
//! whole-file computation.
//!
//! `tests/fixtures/mel_beckett.json` was written by `scripts/mel_fixture.py` from
//! faster-whisper's `FeatureExtractor` on beckett.wav (80 and 128 bands: whole frames
//! at 16 positions, the mean of every frame and of every band, the peak) and on short
//! synthetic clips whose lengths exercise numpy's reflection. Bound: 1e-4 absolute,
//! as asked; measured ~1e-6.
#![allow(clippy::unwrap_used)]

mod audio_support;

use audio_support::*;
use serde_json::Value;
use snooze_speech::{
    audio::{decode_all, probe, AudioLimits, AudioStream, SamplesInMemory},
    mel::{log_mel_spectrogram, LogMelWindows, MelFilters, PeakTracker, FRAMES_PER_WINDOW},
};

const TOLERANCE: f32 = 1e-4;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/mel_beckett.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(value: &Value) -> Vec<f32> {
    value.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
}

fn frame(values: &[f32], n_frames: usize, n_mels: usize, t: usize) -> Vec<f32> {
    (0..n_mels).map(|m| values[m * n_frames + t]).collect()
}

#[test]
fn beckett_matches_faster_whisper() {
    let fixture = fixture();
    let samples = decode(&beckett());
    assert_eq!(samples.len() as u64, fixture["samples"].as_u64().unwrap());
    let info = probe(read(&beckett()), &AudioLimits::default()).unwrap();
    for n_mels in [80usize, 128] {
        let reference = &fixture[format!("beckett_{n_mels}")];
        let ours = log_mel_spectrogram(&samples, &MelFilters::new(n_mels)).unwrap();
        let n_frames = reference["n_frames"].as_u64().unwrap() as usize;
        assert_eq!((ours.n_mels, ours.n_frames), (n_mels, n_frames));

        let mut worst = 0.0f32;
        for (t, values) in reference["frames"].as_object().unwrap() {
            let t: usize = t.parse().unwrap();
            worst = worst.max(max_abs_diff(&frame(&ours.values, n_frames, n_mels, t), &floats(values)));
        }
        let frame_means: Vec<f32> = (0..n_frames)
            .map(|t| {
                frame(&ours.values, n_frames, n_mels, t).iter().map(|&x| f64::from(x)).sum::<f64>() as f32
                    / n_mels as f32
            })
            .collect();
        let band_means: Vec<f32> = ours
            .values
            .chunks_exact(n_frames)
            .map(|band| (band.iter().map(|&x| f64::from(x)).sum::<f64>() / n_frames as f64) as f32)
            .collect();
        let worst_frame_mean = max_abs_diff(&frame_means, &floats(&reference["frame_means"]));
        let worst_band_mean = max_abs_diff(&band_means, &floats(&reference["band_means"]));
        let peak = info.log_mel_peaks.get(n_mels).unwrap();
        let peak_error = (peak - reference["peak"].as_f64().unwrap() as f32).abs();
        println!(
            "{n_mels} bands: frames {worst:.2e}, frame means {worst_frame_mean:.2e}, band means \
             {worst_band_mean:.2e}, peak {peak_error:.2e}"
        );
        assert!(worst < TOLERANCE, "{n_mels} bands: a frame is {worst} off");
        assert!(worst_frame_mean < TOLERANCE && worst_band_mean < TOLERANCE);
        assert!(peak_error < TOLERANCE, "peak {peak} vs {}", reference["peak"]);
    }
}

#[test]
fn short_clips_match_faster_whisper_including_numpys_repeated_reflection() {
    let fixture = fixture();
    let clips = fixture["synthetic_80"]["clips"].as_object().unwrap();
    let filters = MelFilters::new(80);
    let mut worst = 0.0f32;
    for (length, reference) in clips {
        let length: usize = length.parse().unwrap();
        let clip: Vec<f32> = (0..length)
            .map(|t| {
                let t = t as f64;
                (0.3 * (2.0 * std::f64::consts::PI * 440.0 * t / 16000.0).sin()
                    + 0.1 * (2.0 * std::f64::consts::PI * 3100.0 * t / 16000.0 + 1.0).sin())
                    as f32
            })
            .collect();
        let ours = log_mel_spectrogram(&clip, &filters).unwrap();
        let n_frames = reference["n_frames"].as_u64().unwrap() as usize;
        assert_eq!(ours.n_frames, n_frames, "{length} samples");
        // The fixture is frame-major.
        let expected = floats(&reference["values"]);
        let ours_frame_major: Vec<f32> =
            (0..n_frames).flat_map(|t| frame(&ours.values, n_frames, 80, t)).collect();
        let error = max_abs_diff(&ours_frame_major, &expected);
        assert!(error < TOLERANCE, "{length} samples: {error} off");
        worst = worst.max(error);
    }
    println!("short clips: worst {worst:.2e}");
}

/// Speech over several windows: the LibriVox clips, one after another, four times (99 s).
fn long_speech() -> Vec<f32> {
    let clips: Vec<Vec<f32>> = librivox_all().iter().map(|p| decode(p)).collect();
    (0..4).flat_map(|_| clips.iter().flatten().copied()).collect()
}

#[test]
fn streamed_windows_equal_slices_of_the_whole_spectrogram() {
    let samples = long_speech();
    let mut tracker = PeakTracker::new();
    for piece in samples.chunks(7_777) {
        tracker.push(piece);
    }
    let peaks = tracker.finish();
    for n_mels in [80usize, 128] {
        let whole = log_mel_spectrogram(&samples, &MelFilters::new(n_mels)).unwrap();
        let content = whole.n_frames - 1;
        let mut windows =
            LogMelWindows::new(SamplesInMemory::new(&samples[..]), n_mels, peaks.get(n_mels).unwrap());
        let mut out = vec![f32::NAN; n_mels * FRAMES_PER_WINDOW];
        // Faster-whisper's seeks move by less than a window when a segment ends early.
        let mut seeks = vec![
            0usize,
            1,
            2,
            2_990,
            3_000,
            5_432,
            8_999,
            9_000,
            content - 1_000,
            content - 1,
            content,
            content + 5,
        ];
        seeks.sort();
        for seek in seeks {
            let frames = windows.window(seek as u64, &mut out).unwrap();
            assert_eq!(frames, FRAMES_PER_WINDOW.min(content.saturating_sub(seek)), "seek {seek}");
            for m in 0..n_mels {
                for t in 0..FRAMES_PER_WINDOW {
                    let expected = if t < frames { whole.values[m * whole.n_frames + seek + t] } else { 0.0 };
                    assert_eq!(out[m * FRAMES_PER_WINDOW + t], expected, "seek {seek}, band {m}, frame {t}");
                }
            }
        }
        assert_eq!(windows.content_frames(), Some(content as u64));
    }
}

#[test]
fn windows_from_an_audio_stream_equal_windows_from_its_samples() {
    let dir = tempdir();
    let flac =
        convert_with_effects(&librivox("0870"), dir.path(), "long.flac", &["-r", "44100"], &["repeat", "5"]);
    let info = probe(read(&flac), &AudioLimits::default()).unwrap();
    let samples = decode_all(read(&flac), &AudioLimits::default()).unwrap();
    let peak = info.log_mel_peaks.get(80).unwrap();
    let stream = AudioStream::open(read(&flac), &AudioLimits::default()).unwrap();
    let mut streamed = LogMelWindows::new(stream, 80, peak);
    let mut in_memory = LogMelWindows::new(SamplesInMemory::new(samples), 80, peak);
    let (mut a, mut b) = (vec![0.0; 80 * FRAMES_PER_WINDOW], vec![0.0; 80 * FRAMES_PER_WINDOW]);
    for seek in [0, 2_500, 3_100] {
        assert_eq!(streamed.window(seek, &mut a).unwrap(), in_memory.window(seek, &mut b).unwrap());
        assert_eq!(a, b, "seek {seek}");
    }
}

#[test]
fn windows_refuse_going_back_and_a_wrong_buffer() {
    let samples = decode(&librivox("0930"));
    let mut windows = LogMelWindows::new(SamplesInMemory::new(samples), 80, 0.0);
    let mut out = vec![0.0; 80 * FRAMES_PER_WINDOW];
    windows.window(100, &mut out).unwrap();
    let back = windows.window(50, &mut out).unwrap_err();
    assert!(back.to_string().contains("forward only"), "{back}");
    let short = windows.window(100, &mut out[..10]).unwrap_err();
    assert!(short.to_string().contains("80 x 3000"), "{short}");
}
