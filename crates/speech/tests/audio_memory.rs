//! Streaming holds a bounded amount of decoded audio: 20 minutes of speech (a 38 MB
//! upload that would be 77 MB as `f32` samples) go through `probe` and then through
//! every 30-second mel window while the process's peak memory grows by less than
//! 16 MB. Alone in its file, so no other test shares the process.
#![allow(clippy::unwrap_used)]

mod audio_support;

use audio_support::*;
use snooze_speech::{
    audio::{probe, AudioLimits, AudioStream},
    mel::{LogMelWindows, FRAMES_PER_WINDOW},
};

/// Peak resident memory of this process so far, in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/self/status");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn twenty_minutes_stream_in_bounded_memory() {
    let dir = tempdir();
    let all: Vec<String> = librivox_all().iter().map(|p| p.to_str().unwrap().to_string()).collect();
    let joined = dir.path().join("joined.wav");
    let mut args: Vec<&str> = all.iter().map(String::as_str).collect();
    args.push(joined.to_str().unwrap());
    sox(&args);
    let long = convert_with_effects(&joined, dir.path(), "long.wav", &[], &["repeat", "48"]); // 49 x 24.7 s
    let bytes = read(&long);
    let limits = AudioLimits::default();
    let mut window = vec![0.0f32; 80 * FRAMES_PER_WINDOW];
    let before = peak_rss();

    let info = probe(bytes.clone(), &limits).unwrap();
    assert!(info.duration_seconds() > 20.0 * 60.0, "{} s", info.duration_seconds());
    let stream = AudioStream::open(bytes.clone(), &limits).unwrap();
    let mut windows = LogMelWindows::new(stream, 80, info.log_mel_peaks.get(80).unwrap());
    let (mut seek, mut count) = (0u64, 0);
    loop {
        let frames = windows.window(seek, &mut window).unwrap();
        if frames == 0 {
            break;
        }
        seek += frames as u64;
        count += 1;
    }
    let grown = peak_rss().saturating_sub(before);
    println!("{count} windows; peak memory grew by {:.1} MB", grown as f64 / 1e6);
    assert_eq!(seek, info.samples / 160);
    assert!(grown < 16 << 20, "streaming grew the peak by {grown} bytes");
}
