//! Resampling to 16 kHz compared with sox's (`rate`, its default high quality) on the
//! same files, and its filter checked with pure tones.
//!
//! Whisper's training audio was resampled by ffmpeg; sox is the reference available
//! here, and both are near-ideal band-limiting resamplers, so what is compared is how
//! close ours is to an ideal one: SNR of our output against sox's, with speech plus a
//! strong component above 8 kHz that must be removed (a 44.1 or 48 kHz recording has
//! one) and for 8 kHz telephone-band speech. Measured: 52 dB at 22.05, 44.1 and
//! 48 kHz, 39 dB at 8 kHz (the filters' 3.9-4 kHz edges differ); the test asks for 35
//! dB. Tones: flat to 0.001 dB up to 7.6 kHz, more than 130 dB down from 8.5 kHz.
#![allow(clippy::unwrap_used)]

mod audio_support;

use std::path::Path;

use audio_support::*;

/// Float samples of a WAV that sox wrote as 32-bit float mono 16 kHz.
fn sox_reference(input: &Path, dir: &Path, name: &str) -> Vec<f32> {
    let path = convert(input, dir, name, &["-e", "floating-point", "-b", "32", "-r", "16000"]);
    decode(&path)
}

/// Speech at `rate`, with white noise above 9 kHz (when the rate has room for it)
/// mixed in 12 dB below the speech peak level.
fn wideband_speech(dir: &Path, rate: u32) -> std::path::PathBuf {
    let speech = librivox("0870");
    let rate_text = rate.to_string();
    let up = convert(
        &speech,
        dir,
        &format!("speech{rate}.wav"),
        &["-e", "floating-point", "-b", "32", "-r", &rate_text],
    );
    if rate <= 18_000 {
        return up;
    }
    let noise = dir.join(format!("noise{rate}.wav"));
    let (noise_path, up_path) = (noise.to_str().unwrap(), up.to_str().unwrap());
    sox(&[
        "-n",
        "-r",
        &rate_text,
        "-c",
        "1",
        "-e",
        "floating-point",
        "-b",
        "32",
        noise_path,
        "synth",
        "7.1",
        "whitenoise",
        "sinc",
        "9000",
        "vol",
        "0.1",
    ]);
    let mixed = dir.join(format!("mixed{rate}.wav"));
    sox(&["-m", up_path, noise_path, "-e", "floating-point", "-b", "32", mixed.to_str().unwrap()]);
    mixed
}

#[test]
fn resampling_matches_sox_within_35_db() {
    let dir = tempdir();
    for rate in [44_100u32, 48_000, 22_050, 8_000] {
        let input = wideband_speech(dir.path(), rate);
        let ours = decode(&input);
        let reference = sox_reference(&input, dir.path(), &format!("sox{rate}.wav"));
        let (snr, lag) = aligned_snr_db(&reference, &ours, 4);
        println!(
            "{rate} Hz: ours {} samples, sox {}, SNR {snr:.1} dB at lag {lag}",
            ours.len(),
            reference.len()
        );
        assert_eq!(lag, 0, "{rate} Hz: our output is shifted against sox's");
        assert!(
            ours.len().abs_diff(reference.len()) <= 1,
            "{rate} Hz: {} vs {} samples",
            ours.len(),
            reference.len()
        );
        assert!(snr > 35.0, "{rate} Hz: SNR against sox {snr:.1} dB");
    }
}

fn tone(dir: &Path, rate: u32, hz: u32) -> Vec<f32> {
    let path = dir.join(format!("tone{rate}_{hz}.wav"));
    let rate_text = rate.to_string();
    sox(&[
        "-n",
        "-r",
        &rate_text,
        "-c",
        "1",
        "-e",
        "floating-point",
        "-b",
        "32",
        path.to_str().unwrap(),
        "synth",
        "2",
        "sine",
        &hz.to_string(),
        "vol",
        "0.5",
    ]);
    decode(&path)
}

fn rms_db(samples: &[f32]) -> f64 {
    // The middle second: away from the filter's ramp at both ends.
    let middle = &samples[samples.len() / 4..samples.len() * 3 / 4];
    let power = middle.iter().map(|&s| f64::from(s) * f64::from(s)).sum::<f64>() / middle.len() as f64;
    10.0 * power.max(1e-30).log10()
}

#[test]
fn the_filter_keeps_the_speech_band_and_removes_what_would_alias() {
    let dir = tempdir();
    let full_scale = rms_db(&[0.5f32 / std::f32::consts::SQRT_2; 8]);
    for rate in [44_100u32, 48_000] {
        for (hz, low, high) in [(1000, -0.05, 0.05), (7000, -0.2, 0.05), (7600, -1.0, 0.05)] {
            let level = rms_db(&tone(dir.path(), rate, hz)) - full_scale;
            println!("{rate} Hz, {hz} Hz tone: {level:.3} dB");
            assert!(
                (low..=high).contains(&level),
                "{rate} Hz input, {hz} Hz tone comes out at {level:.3} dB"
            );
        }
        for hz in [8500, 9000, 12_000, 20_000] {
            let level = rms_db(&tone(dir.path(), rate, hz)) - full_scale;
            println!("{rate} Hz, {hz} Hz tone: {level:.1} dB");
            assert!(level < -90.0, "{rate} Hz input, {hz} Hz tone aliases in at {level:.1} dB");
        }
    }
}

#[test]
fn unusual_rates_keep_length_and_level() {
    let dir = tempdir();
    let full_scale = rms_db(&[0.5f32 / std::f32::consts::SQRT_2; 8]);
    // 22051 Hz shares no factor with 16 kHz: the resampler's block is a whole second.
    for rate in [1_000u32, 11_025, 22_051, 37_800, 96_000, 192_000, 384_000] {
        let hz = if rate < 2_000 { 300 } else { 1_000 };
        let decoded = tone(dir.path(), rate, hz);
        let level = rms_db(&decoded) - full_scale;
        println!("{rate} Hz: {} samples, {hz} Hz tone at {level:.3} dB", decoded.len());
        assert_eq!(decoded.len(), 32_000, "{rate} Hz: 2 s should be 32000 samples");
        assert!(level.abs() < 0.05, "{rate} Hz: the tone comes out at {level:.3} dB");
    }
}
