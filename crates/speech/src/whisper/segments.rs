//! From one window's tokens to segments and the next window's start — faster-whisper's
//! `_split_segments_by_timestamps`.
//!
//! Consecutive timestamp tokens close one segment and open the next. If the window ends
//! on a single timestamp, the speech ended there and the next window starts after this
//! one; otherwise the last segment is unfinished and is dropped, and the next window
//! starts at the last closing timestamp so that speech is decoded again, whole. Without
//! timestamp pairs the window is one segment (ending at its last timestamp, if any).

/// A segment before its text is decoded: times in seconds, tokens with timestamps.
#[derive(Debug, Clone, PartialEq)]
pub struct RawSegment {
    pub start: f64,
    pub end: f64,
    pub tokens: Vec<u32>,
}

/// Where a window's decoding lives in the audio and how its tokens read.
#[derive(Debug, Clone, Copy)]
pub struct WindowPlace {
    /// First mel frame of the window.
    pub seek: u64,
    /// Mel frames of audio in it (the window is zero-padded past them).
    pub frames: u64,
    pub seconds_per_frame: f64,
    /// Seconds per timestamp step.
    pub time_precision: f64,
    pub timestamp_begin: u32,
}

/// Seconds rounded to the millisecond: sums of 20 ms steps in binary floating point
/// read `15.780000000000001`, and no format shows more than milliseconds.
fn millis(seconds: f64) -> f64 {
    (seconds * 1000.0).round() / 1000.0
}

/// The window's segments and the frame the next window starts at.
pub fn split_by_timestamps(tokens: &[u32], place: &WindowPlace) -> (Vec<RawSegment>, u64) {
    let begin = place.timestamp_begin;
    let is_ts = |t: u32| t >= begin;
    let offset = millis(place.seek as f64 * place.seconds_per_frame);
    let time = |t: u32| millis(offset + f64::from(t - begin) * place.time_precision);
    let single_ending =
        tokens.len() >= 2 && !is_ts(tokens[tokens.len() - 2]) && is_ts(tokens[tokens.len() - 1]);
    let pairs: Vec<usize> = (1..tokens.len()).filter(|&i| is_ts(tokens[i]) && is_ts(tokens[i - 1])).collect();
    if pairs.is_empty() {
        let mut end = millis(offset + place.frames as f64 * place.seconds_per_frame);
        if let Some(&last) = tokens.iter().rev().find(|&&t| is_ts(t)) {
            if last != begin {
                end = time(last);
            }
        }
        let segment = RawSegment { start: offset, end, tokens: tokens.to_vec() };
        return (vec![segment], place.seek + place.frames);
    }
    let mut cuts = pairs;
    if single_ending {
        cuts.push(tokens.len());
    }
    let mut segments = Vec::with_capacity(cuts.len());
    let mut from = 0;
    for &cut in &cuts {
        let slice = &tokens[from..cut];
        // Each slice starts and ends with a timestamp: it runs from a pair's second to the next pair's first.
        if let (Some(&first), Some(&last)) = (slice.first(), slice.last()) {
            if is_ts(first) && is_ts(last) {
                segments.push(RawSegment { start: time(first), end: time(last), tokens: slice.to_vec() });
            }
        }
        from = cut;
    }
    let next = if single_ending {
        place.seek + place.frames
    } else {
        // Frames per timestamp step: the encoder halves the mel frames.
        let steps = u64::from(tokens[from - 1].saturating_sub(begin));
        place.seek + steps * 2
    };
    (segments, next)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const B: u32 = 50363;

    fn place(seek: u64, frames: u64) -> WindowPlace {
        WindowPlace { seek, frames, seconds_per_frame: 0.01, time_precision: 0.02, timestamp_begin: B }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn pairs_split_segments_and_a_single_ending_moves_a_whole_window() {
        // <|0.00|> a b <|1.50|><|1.50|> c <|3.00|> EOT-stripped, single timestamp ending.
        let tokens = [B, 10, 11, B + 75, B + 75, 12, B + 150];
        let (segments, next) = split_by_timestamps(&tokens, &place(1000, 3000));
        assert_eq!(segments.len(), 2);
        assert!(close(segments[0].start, 10.0) && close(segments[0].end, 11.5));
        assert_eq!(segments[0].tokens, vec![B, 10, 11, B + 75]);
        assert!(close(segments[1].start, 11.5) && close(segments[1].end, 13.0));
        assert_eq!(next, 4000);
    }

    #[test]
    fn an_unfinished_last_segment_is_dropped_and_decoded_again() {
        // The window ends inside a segment: the next window starts at its opening timestamp.
        let tokens = [B, 10, B + 100, B + 100, 11, 12];
        let (segments, next) = split_by_timestamps(&tokens, &place(0, 3000));
        assert_eq!(segments.len(), 1);
        assert!(close(segments[0].end, 2.0));
        assert_eq!(next, 200);
        // A pair at the very end: same.
        let tokens = [B, 10, B + 100, B + 100];
        let (segments, next) = split_by_timestamps(&tokens, &place(500, 3000));
        assert_eq!(segments.len(), 1);
        assert_eq!(next, 700);
    }

    #[test]
    fn without_pairs_the_window_is_one_segment() {
        // No timestamps at all (timestamps off): the whole audio part of the window.
        let (segments, next) = split_by_timestamps(&[10, 11, 12], &place(3000, 1234));
        assert_eq!(segments.len(), 1);
        assert!(close(segments[0].start, 30.0) && close(segments[0].end, 42.34));
        assert_eq!(next, 4234);
        // One opening timestamp and text: ends at the last timestamp unless it is 0.00.
        let (segments, _) = split_by_timestamps(&[B + 10, 11, 12, B + 60], &place(0, 3000));
        assert!(close(segments[0].end, 1.2));
        let (segments, _) = split_by_timestamps(&[B, 11, 12], &place(0, 800));
        assert!(close(segments[0].end, 8.0));
    }

    #[test]
    fn times_are_whole_milliseconds_as_every_format_writes_them() {
        // Sums of 20 ms steps: unrounded, times such as 15.780000000000001 come out.
        let tokens = [B + 521, 10, B + 789, B + 789];
        let (segments, _) = split_by_timestamps(&tokens, &place(521, 2479));
        assert_eq!(segments[0].start.to_string(), "15.63");
        assert_eq!(segments[0].end.to_string(), "20.99");
        for seek in 0..3000u64 {
            let (segments, _) = split_by_timestamps(&[B + 7, 10, B + 33, B + 33], &place(seek, 3000));
            for t in [segments[0].start, segments[0].end] {
                let text = t.to_string();
                let decimals = text.split('.').nth(1).map_or(0, str::len);
                assert!(decimals <= 3, "{text} at seek {seek}");
            }
        }
    }
}
