//! Real speech and the tools that convert it, shared by the audio and mel tests.
//!
//! The clips are Debian's `pocketsphinx-testdata` (LibriVox readings and `goforward.raw`)
//! and `beckett.wav` from the `useful-moonshine-onnx` wheel in the project's venv;
//! other containers, codecs and rates are made from them with sox at test time. A
//! missing tool or clip fails the test with the command that installs it: these tests
//! never skip.
#![allow(dead_code, clippy::unwrap_used)]

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use bytes::Bytes;
use snooze_speech::audio::{decode_all, AudioLimits};

pub const POCKETSPHINX: &str = "/usr/share/pocketsphinx/test/data";
const APT: &str = "apt-get install -y pocketsphinx-testdata sox libsox-fmt-all lame";

pub fn librivox(name: &str) -> PathBuf {
    let path = Path::new(POCKETSPHINX)
        .join("librivox")
        .join(format!("sense_and_sensibility_01_austen_64kb-{name}.wav"));
    assert!(path.exists(), "{} is missing: {APT}", path.display());
    path
}

/// The five LibriVox clips, 16 kHz 16-bit mono WAV.
pub fn librivox_all() -> Vec<PathBuf> {
    ["0870", "0880", "0890", "0920", "0930"].iter().map(|n| librivox(n)).collect()
}

pub fn beckett() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    let found = std::fs::read_dir(&root).ok().and_then(|dirs| {
        dirs.flatten()
            .map(|d| d.path().join("site-packages/moonshine_onnx/assets/beckett.wav"))
            .find(|p| p.exists())
    });
    found.unwrap_or_else(|| {
        panic!(
            "beckett.wav is missing under {}: .venv/bin/pip install --no-deps useful-moonshine-onnx==20251121",
            root.display()
        )
    })
}

/// `goforward.raw` (16 kHz signed 16-bit little-endian, no header) as a WAV file.
pub fn goforward_wav(dir: &Path) -> PathBuf {
    let raw = Path::new(POCKETSPHINX).join("goforward.raw");
    let pcm = std::fs::read(&raw).unwrap_or_else(|e| panic!("{}: {e}: {APT}", raw.display()));
    let path = dir.join("goforward.wav");
    std::fs::write(&path, wav_file(1, 1, 16_000, 16, &pcm)).unwrap();
    path
}

/// A canonical 44-byte-header WAV around `data`.
pub fn wav_file(format_tag: u16, channels: u16, rate: u32, bits: u16, data: &[u8]) -> Vec<u8> {
    let mut out = wav_header(format_tag, channels, rate, bits, data.len() as u32);
    out.extend_from_slice(data);
    out
}

/// The header of a canonical WAV declaring `data_len` bytes of data.
pub fn wav_header(format_tag: u16, channels: u16, rate: u32, bits: u16, data_len: u32) -> Vec<u8> {
    let block_align = channels * bits.div_ceil(8);
    let mut h = Vec::with_capacity(44);
    h.extend_from_slice(b"RIFF");
    h.extend_from_slice(&36u32.wrapping_add(data_len).to_le_bytes());
    h.extend_from_slice(b"WAVEfmt ");
    h.extend_from_slice(&16u32.to_le_bytes());
    h.extend_from_slice(&format_tag.to_le_bytes());
    h.extend_from_slice(&channels.to_le_bytes());
    h.extend_from_slice(&rate.to_le_bytes());
    h.extend_from_slice(&(rate.wrapping_mul(u32::from(block_align))).to_le_bytes());
    h.extend_from_slice(&block_align.to_le_bytes());
    h.extend_from_slice(&bits.to_le_bytes());
    h.extend_from_slice(b"data");
    h.extend_from_slice(&data_len.to_le_bytes());
    h
}

/// Runs sox with `args`; fails with the install command when sox is missing.
pub fn sox(args: &[&str]) {
    let out =
        Command::new("sox").args(args).output().unwrap_or_else(|e| panic!("cannot run sox ({e}): {APT}"));
    assert!(out.status.success(), "sox {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// Converts `input` with sox into `dir/name`, with `options` before the output file.
pub fn convert(input: &Path, dir: &Path, name: &str, options: &[&str]) -> PathBuf {
    let output = dir.join(name);
    let mut args = vec![input.to_str().unwrap()];
    args.extend_from_slice(options);
    args.push(output.to_str().unwrap());
    sox(&args);
    output
}

/// Encodes a WAV file to MP3 with the `lame` encoder, which (unlike sox) writes the
/// LAME/Info tag that gives the encoder delay and padding.
pub fn lame(input: &Path, dir: &Path, name: &str, options: &[&str]) -> PathBuf {
    let output = dir.join(name);
    let out = Command::new("lame")
        .arg("--quiet")
        .args(options)
        .arg(input)
        .arg(&output)
        .output()
        .unwrap_or_else(|e| panic!("cannot run lame ({e}): {APT}"));
    assert!(out.status.success(), "lame failed: {}", String::from_utf8_lossy(&out.stderr));
    output
}

/// Like [`convert`], with sox effects (`trim`, `repeat`...) after the output file.
pub fn convert_with_effects(
    input: &Path,
    dir: &Path,
    name: &str,
    options: &[&str],
    effects: &[&str],
) -> PathBuf {
    let output = dir.join(name);
    let mut args = vec![input.to_str().unwrap()];
    args.extend_from_slice(options);
    args.push(output.to_str().unwrap());
    args.extend_from_slice(effects);
    sox(&args);
    output
}

pub fn read(path: &Path) -> Bytes {
    Bytes::from(std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

pub fn decode(path: &Path) -> Vec<f32> {
    decode_all(read(path), &AudioLimits::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// 16-bit PCM samples of a canonical WAV, parsed here independently of the decoder.
pub fn pcm16_samples(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let at = bytes.windows(4).position(|w| w == b"data").expect("a data chunk");
    let declared = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
    let data = &bytes[at + 8..(at + 8 + declared).min(bytes.len())];
    data.chunks_exact(2).map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / 32768.0).collect()
}

/// Signal-to-noise ratio of `test` against `reference` in dB, after shifting `test` by
/// the lag in `-max_lag..=max_lag` that correlates best (codecs may delay).
pub fn aligned_snr_db(reference: &[f32], test: &[f32], max_lag: i64) -> (f64, i64) {
    let overlap = |lag: i64| {
        reference.iter().enumerate().filter_map(move |(i, &r)| {
            let j = i as i64 + lag;
            (j >= 0 && (j as usize) < test.len()).then(|| (f64::from(r), f64::from(test[j as usize])))
        })
    };
    let best_lag = (-max_lag..=max_lag)
        .max_by(|&a, &b| {
            let ca: f64 = overlap(a).map(|(r, t)| r * t).sum();
            let cb: f64 = overlap(b).map(|(r, t)| r * t).sum();
            ca.total_cmp(&cb)
        })
        .unwrap_or(0);
    let (signal, noise) =
        overlap(best_lag).fold((0.0, 0.0), |(s, n), (r, t)| (s + r * r, n + (r - t) * (r - t)));
    (10.0 * (signal / noise.max(1e-30)).log10(), best_lag)
}

/// Maximum absolute difference between two equally long sequences.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}
