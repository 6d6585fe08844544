//! Uploads that are not good audio: each must end in the right `AudioError` (a
//! sentence for the user) or in the audio that is really there, never in a panic, a
//! hang or an allocation sized by a header's claim.
//!
//! The damage policy under test: a file cut short or corrupted part-way decodes up to
//! the damage and says `damaged`; a file from which no audio at all can be decoded is
//! refused as corrupt.
#![allow(clippy::unwrap_used)]

mod audio_support;

use std::panic::{catch_unwind, AssertUnwindSafe};

use audio_support::*;
use bytes::Bytes;
use snooze_core::ErrorKind;
use snooze_speech::audio::{decode_all, probe, AudioError, AudioLimits, AudioStream};

fn limits() -> AudioLimits {
    AudioLimits::default()
}

fn pcm16(samples: &[i16]) -> Vec<u8> {
    samples.iter().flat_map(|s| s.to_le_bytes()).collect()
}

fn ramp(n: usize) -> Vec<i16> {
    (0..n).map(|i| ((i * 37 % 2000) as i16) - 1000).collect()
}

#[test]
fn an_empty_upload_is_refused() {
    assert_eq!(decode_all(Bytes::new(), &limits()), Err(AudioError::NoData));
}

#[test]
fn text_and_random_bytes_are_not_audio() {
    for junk in [
        Bytes::from_static(b"hello, this is not audio at all\n"),
        Bytes::from_static(b"{\"json\": true}"),
        Bytes::from(vec![0u8; 4096]),
    ] {
        let e = decode_all(junk, &limits()).unwrap_err();
        assert!(matches!(e, AudioError::UnknownFormat | AudioError::Corrupt(_)), "{e:?}");
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
}

#[test]
fn a_wav_with_no_samples_is_empty() {
    let e = decode_all(Bytes::from(wav_file(1, 1, 16_000, 16, &[])), &limits()).unwrap_err();
    assert_eq!(e, AudioError::Empty);
    assert!(e.to_string().starts_with("the audio contains no samples"), "{e}");
}

#[test]
fn absurd_wav_parameters_are_named() {
    let data = pcm16(&ramp(1000));
    let zero_channels = {
        let mut f = wav_file(1, 1, 16_000, 16, &data);
        f[22..24].copy_from_slice(&0u16.to_le_bytes());
        f
    };
    let zero_rate = wav_file(1, 1, 0, 16, &data);
    let huge_rate = wav_file(1, 1, 4_000_000_000, 16, &data);
    let wrong_block = {
        let mut f = wav_file(1, 1, 16_000, 16, &data);
        f[32..34].copy_from_slice(&7u16.to_le_bytes());
        f
    };
    for (file, words) in [
        (zero_channels, "0 channels"),
        (zero_rate, "0 Hz"),
        (huge_rate, "4000000000 Hz"),
        (wrong_block, "frames of 7 bytes"),
    ] {
        let e = decode_all(Bytes::from(file), &limits()).unwrap_err();
        assert!(e.to_string().contains(words), "{e}");
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
}

#[test]
fn an_unsupported_wav_encoding_is_named() {
    // Format 0x0055 is MP3 inside WAV; symphonia's WAV reader does not take it.
    let e = decode_all(Bytes::from(wav_file(0x55, 1, 16_000, 16, &[0; 64])), &limits()).unwrap_err();
    assert!(matches!(e, AudioError::UnsupportedCodec { container: "WAV", .. }), "{e:?}");
    assert!(e.to_string().contains("0x0055 (MP3)"), "{e}");
}

#[test]
fn a_header_claiming_hours_decodes_what_is_there() {
    let samples = ramp(8000);
    for declared in [u32::MAX, u32::MAX - 1, 16_000 * 2 * 3600 * 4] {
        let mut file = wav_header(1, 1, 16_000, 16, declared);
        file.extend_from_slice(&pcm16(&samples));
        let info = probe(Bytes::from(file.clone()), &limits()).unwrap();
        assert_eq!(info.samples, 8000, "declared {declared}");
        assert!(info.damaged, "a data chunk shorter than declared is marked damaged");
        let decoded = decode_all(Bytes::from(file), &limits()).unwrap();
        let expected: Vec<f32> = samples.iter().map(|&s| f32::from(s) / 32768.0).collect();
        assert_eq!(decoded, expected);
    }
}

#[test]
fn a_riff_length_of_zero_or_max_is_ignored() {
    let samples = ramp(3000);
    for riff in [0u32, u32::MAX] {
        let mut file = wav_file(1, 1, 16_000, 16, &pcm16(&samples));
        file[4..8].copy_from_slice(&riff.to_le_bytes());
        assert_eq!(decode_all(Bytes::from(file), &limits()).unwrap().len(), 3000, "RIFF length {riff}");
    }
}

#[test]
fn a_chunk_claiming_more_than_the_file_is_corrupt_not_allocated() {
    // A LIST chunk declaring 4 GiB before the data: symphonia would allocate it.
    let mut file = b"RIFF\0\0\0\0WAVE".to_vec();
    file.extend_from_slice(&wav_file(1, 1, 16_000, 16, &[])[12..36]);
    file.extend_from_slice(b"LIST");
    file.extend_from_slice(&u32::MAX.to_le_bytes());
    file.extend_from_slice(b"INFOdata");
    let e = decode_all(Bytes::from(file), &limits()).unwrap_err();
    assert!(e.to_string().contains("'LIST' chunk declares 4294967295 bytes"), "{e}");
}

#[test]
fn too_long_audio_is_refused_while_decoding() {
    let dir = tempdir();
    let clip = convert_with_effects(&librivox("0870"), dir.path(), "long.flac", &[], &["repeat", "20"]); // 149 s
    let limits = AudioLimits { max_seconds: 30.0 };
    let e = probe(read(&clip), &limits).unwrap_err();
    let AudioError::TooLong { limit_seconds, at_least_seconds } = e.clone() else { panic!("{e:?}") };
    assert_eq!(limit_seconds, 30.0);
    assert!((30.0..31.0).contains(&at_least_seconds), "stopped after {at_least_seconds} s, not at the limit");
    assert_eq!(e.kind(), ErrorKind::PayloadTooLarge);
    assert!(e.to_string().contains("longer than the 30 s"), "{e}");
    let mut stream = AudioStream::open(read(&clip), &limits).unwrap();
    let mut out = Vec::new();
    let result = loop {
        match stream.read(&mut out, 16_000) {
            Ok(0) => break Ok(()),
            Ok(_) => out.clear(),
            Err(e) => break Err(e),
        }
    };
    assert!(matches!(result, Err(AudioError::TooLong { .. })), "{result:?}");
    let again = stream.read(&mut out, 16_000);
    assert_eq!(again, result.map(|()| 0), "a later read repeats the error");
}

#[test]
fn a_truncated_file_decodes_up_to_the_cut() {
    let dir = tempdir();
    let original = librivox("0880");
    let reference = pcm16_samples(&original);
    for (name, options) in [("a.wav", &[][..]), ("a.flac", &[]), ("a.mp3", &[]), ("a.ogg", &[])] {
        let path = convert(&original, dir.path(), name, options);
        let whole = decode(&path);
        let bytes = read(&path);
        let cut = bytes.slice(..bytes.len() * 6 / 10);
        let info = probe(cut.clone(), &limits()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let decoded = decode_all(cut, &limits()).unwrap();
        println!("{name}: {} of {} samples from 60% of the bytes", decoded.len(), whole.len());
        assert_eq!(info.samples, decoded.len() as u64);
        // Up to the last whole packet or page before the cut: OGG loses the most, its
        // 4 KB of codebooks come first and a cut page is dropped (60% of this file's
        // bytes end 4 KB into the third audio page: 31% of the audio).
        let fraction = decoded.len() as f64 / reference.len() as f64;
        assert!((0.25..0.65).contains(&fraction), "{name}: {fraction:.2} of the audio");
        assert!(info.damaged || name == "a.ogg" || name == "a.mp3", "{name}: the cut is not reported");
        let head = decoded.len().min(whole.len()) - 2048;
        assert!(
            max_abs_diff(&decoded[..head], &whole[..head]) < 1e-6,
            "{name}: the part before the cut differs"
        );
    }
}

/// Every prefix of a small file, and random corruptions of it, decode or fail cleanly.
#[test]
fn no_prefix_or_corruption_of_a_real_file_panics() {
    let dir = tempdir();
    let short = convert_with_effects(&librivox("0880"), dir.path(), "short.wav", &[], &["trim", "0", "0.25"]);
    let mut files = vec![("wav", read(&short))];
    for (ext, options) in [("flac", &[][..]), ("mp3", &[]), ("ogg", &[]), ("wav", &["-b", "24", "-c", "2"])] {
        let name = format!("short-{}.{ext}", files.len());
        files.push((ext, read(&convert(&short, dir.path(), &name, options))));
    }
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for (ext, bytes) in &files {
        let step = (bytes.len() / 400).max(1);
        let mut candidates: Vec<Bytes> = (0..bytes.len()).step_by(step).map(|n| bytes.slice(..n)).collect();
        candidates.extend((0..64.min(bytes.len())).map(|n| bytes.slice(..n)));
        for _ in 0..300 {
            let mut damaged = bytes.to_vec();
            for _ in 0..1 + random() % 8 {
                let at = (random() % damaged.len() as u64) as usize;
                damaged[at] = random() as u8;
            }
            candidates.push(Bytes::from(damaged));
        }
        for candidate in candidates {
            let len = candidate.len();
            let outcome = catch_unwind(AssertUnwindSafe(|| probe(candidate, &limits())))
                .unwrap_or_else(|_| panic!("probe panicked on a {len}-byte {ext} file"));
            let key = match outcome {
                Ok(info) => format!("{ext}: ok{}", if info.damaged { ", damaged" } else { "" }),
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    assert_ne!(e.kind(), ErrorKind::Internal, "{e}");
                    format!("{ext}: {}", e.to_string().split(':').next().unwrap_or_default())
                }
            };
            *outcomes.entry(key).or_default() += 1;
        }
    }
    println!("{outcomes:#?}");
}

#[test]
fn random_bytes_never_panic() {
    let mut seed = 42u64;
    for round in 0..400 {
        let len = (round * 37) % 5000;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 56) as u8
            })
            .collect();
        // Half of them behind a real container's magic, so the parsers get past the first check.
        let bytes = match round % 4 {
            0 => [b"RIFF\xff\xff\xff\xffWAVEfmt ".as_slice(), &bytes].concat(),
            1 => [b"fLaC".as_slice(), &bytes].concat(),
            2 => [b"OggS\x00\x02".as_slice(), &bytes].concat(),
            _ => [b"\xff\xfb\x90\x64".as_slice(), &bytes].concat(),
        };
        let result = catch_unwind(AssertUnwindSafe(|| probe(Bytes::from(bytes), &limits())));
        assert!(result.is_ok(), "round {round} panicked");
    }
}

#[test]
fn stereo_is_the_average_of_its_channels() {
    let dir = tempdir();
    let (left, right) = (librivox("0880"), librivox("0930"));
    let stereo = dir.path().join("stereo.wav");
    sox(&["-M", left.to_str().unwrap(), right.to_str().unwrap(), stereo.to_str().unwrap()]);
    let (l, r) = (pcm16_samples(&left), pcm16_samples(&right));
    let decoded = decode(&stereo);
    assert_eq!(decoded.len(), l.len().max(r.len()));
    let expected: Vec<f32> = (0..decoded.len())
        .map(|i| (l.get(i).copied().unwrap_or(0.0) + r.get(i).copied().unwrap_or(0.0)) / 2.0)
        .collect();
    assert!(max_abs_diff(&decoded, &expected) < 1e-7);
}

#[test]
fn the_stream_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<AudioStream>();
}

/// OGG's CRC-32: polynomial 0x04C11DB7, no reflection, initial value 0.
fn ogg_crc(data: &[u8]) -> u32 {
    let mut crc = 0u32;
    for &byte in data {
        crc ^= u32::from(byte) << 24;
        for _ in 0..8 {
            crc = if crc & 0x8000_0000 != 0 { (crc << 1) ^ 0x04C1_1DB7 } else { crc << 1 };
        }
    }
    crc
}

fn ogg_page(header_type: u8, sequence: u32, packets: &[&[u8]]) -> Vec<u8> {
    let mut lacing = Vec::new();
    for packet in packets {
        lacing.extend(std::iter::repeat_n(255u8, packet.len() / 255));
        lacing.push((packet.len() % 255) as u8);
    }
    let mut page = b"OggS\0".to_vec();
    page.push(header_type);
    page.extend_from_slice(&0u64.to_le_bytes());
    page.extend_from_slice(&0x5EED_u32.to_le_bytes());
    page.extend_from_slice(&sequence.to_le_bytes());
    page.extend_from_slice(&[0; 4]);
    page.push(lacing.len() as u8);
    page.extend_from_slice(&lacing);
    for packet in packets {
        page.extend_from_slice(packet);
    }
    let crc = ogg_crc(&page);
    page[22..26].copy_from_slice(&crc.to_le_bytes());
    page
}

/// Vorbis's bit order: least significant bit first.
fn push_bits(bytes: &mut Vec<u8>, position: &mut usize, value: u64, count: u32) {
    for i in 0..count {
        if position.is_multiple_of(8) {
            bytes.push(0);
        }
        let last = bytes.len() - 1;
        bytes[last] |= (((value >> i) & 1) as u8) << (*position % 8);
        *position += 1;
    }
}

#[test]
fn a_vorbis_codebook_asking_for_gigabytes_is_refused_before_symphonia_builds_it() {
    let mut ident = b"\x01vorbis".to_vec();
    ident.extend_from_slice(&0u32.to_le_bytes());
    ident.push(1);
    ident.extend_from_slice(&16_000u32.to_le_bytes());
    ident.extend_from_slice(&[0; 12]);
    ident.extend_from_slice(&[0xB8, 1]);
    let comment = b"\x03vorbis\x04\0\0\0test\0\0\0\0\x01".to_vec();
    // One codebook: 2^24 - 1 entries of 31 dimensions, all codewords of length 1, with a
    // type-1 lookup table: symphonia would fill 2^24 x 31 floats (2 GB) before it
    // noticed that the lengths make no valid code.
    let mut setup = b"\x05vorbis".to_vec();
    let mut position = 0;
    for (value, count) in [
        (0, 8),
        (0x56_4342, 24),
        (31, 16),
        (0xFF_FFFF, 24),
        (1, 1),
        (0, 5),
        (0xFF_FFFF, 24),
        (1, 4),
        (0, 32),
        (0, 32),
        (0, 4),
        (0, 1),
        (0, 1),
    ] {
        push_bits(&mut setup, &mut position, value, count);
    }
    let mut file = ogg_page(2, 0, &[&ident]);
    file.extend(ogg_page(0, 1, &[&comment, &setup]));
    file.extend(ogg_page(4, 2, &[&[0u8; 16]]));
    let e = probe(Bytes::from(file), &limits()).unwrap_err();
    assert!(e.to_string().contains("Vorbis codebook 0 declares 16777215 entries of 31 dimensions"), "{e}");
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}

#[test]
fn real_vorbis_files_pass_the_codebook_bound() {
    let dir = tempdir();
    for (name, options) in
        [("q0.ogg", &["-C", "0"][..]), ("q10.ogg", &["-C", "10"]), ("s48.ogg", &["-r", "48000", "-c", "2"])]
    {
        let path = convert(&librivox("0930"), dir.path(), name, options);
        probe(read(&path), &limits()).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn a_bad_opus_header_is_named() {
    // symphonia skips an OGG stream whose OpusHead it refuses and reads on to the end:
    // the 400 said the file "ends before its audio begins".
    let head = |version: u8, channels: u8, family: u8| {
        let mut h = b"OpusHead".to_vec();
        h.extend([version, channels]);
        h.extend(312u16.to_le_bytes());
        h.extend(48_000u32.to_le_bytes());
        h.extend([0, 0, family]);
        h
    };
    let tags = b"OpusTags\x04\0\0\0test\0\0\0\0".to_vec();
    for (h, named) in [
        (head(1, 0, 0), "declares 0 channels"),
        (head(255, 1, 0), "version 255"),
        (head(1, 8, 0), "8 channels without a channel mapping"),
    ] {
        let mut file = ogg_page(2, 0, &[&h]);
        file.extend(ogg_page(0, 1, &[&tags]));
        file.extend(ogg_page(4, 2, &[&[0xF8, 0xFF, 0xFE]]));
        let e = probe(Bytes::from(file), &AudioLimits::default()).unwrap_err().to_string();
        assert!(e.contains(named), "{named}: {e}");
    }
}
