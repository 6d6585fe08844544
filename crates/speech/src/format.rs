//! A transcript in the five `response_format`s of OpenAI's `/v1/audio/transcriptions`
//! and `/v1/audio/translations`: `json`, `text`, `srt`, `vtt` and `verbose_json`.
//!
//! The shapes are the ones the official `openai` Python SDK parses
//! (`openai.types.audio.Transcription`, `TranscriptionVerbose`, `TranscriptionSegment`,
//! `TranscriptionWord`), checked by `tests/format_openai_sdk.rs`. Following OpenAI's
//! own answers: `text` is the transcript and a newline; subtitles number their cues
//! from 1 (SRT) and always write the hours (`00:00:01,230` / `00:00:01.230`), with
//! more digits past 99 hours; segment texts lose Whisper's leading space in subtitles
//! but keep it in `verbose_json`. A cue's text never contains a blank line (it would
//! end the cue) nor `-->` (it would read as a timing line).

use std::{fmt::Write as _, str::FromStr};

use serde::Serialize;

/// One stretch of transcript as the decoding loop produced it, with the statistics
/// `verbose_json` reports (those Whisper's temperature fallback decides on).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Segment {
    /// Position in the transcript, from 0.
    pub id: u32,
    /// The mel frame (10 ms each) where the window that produced it started.
    pub seek: u64,
    /// Start and end in seconds from the start of the audio.
    pub start: f64,
    pub end: f64,
    /// As decoded, usually with a leading space.
    pub text: String,
    /// The text's token ids, timestamp tokens included as Whisper returns them.
    pub tokens: Vec<u32>,
    pub temperature: f32,
    pub avg_logprob: f32,
    pub compression_ratio: f32,
    pub no_speech_prob: f32,
}

/// One word with its times, for `timestamp_granularities[]=word`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Word {
    pub word: String,
    pub start: f64,
    pub end: f64,
}

pub use crate::whisper::Task;

/// A finished transcription.
#[derive(Debug, Clone, PartialEq)]
pub struct Transcript {
    pub task: Task,
    /// The spoken language as OpenAI names it: the English name in lower case
    /// (`english`, `german`), or `english` for a translation.
    pub language: String,
    /// Seconds of audio.
    pub duration: f64,
    /// The whole text, without leading or trailing spaces.
    pub text: String,
    pub segments: Vec<Segment>,
    /// Present only when word timestamps were asked for.
    pub words: Option<Vec<Word>>,
}

impl Transcript {
    /// A transcript whose text is its segments' texts joined, as Whisper joins them, and
    /// whose segments lie within the audio. Whisper's last timestamp in a window may lie
    /// past the end of the audio (the window is padded to 30 s: a 10 s clip's last segment
    /// ending at 10.0 s, a 0.2 s clip's at 2.0 s); a subtitle cue must not outlast the
    /// recording.
    pub fn from_segments(
        task: Task,
        language: String,
        duration: f64,
        mut segments: Vec<Segment>,
    ) -> Transcript {
        let within = |t: f64| t.min(duration).max(0.0);
        for s in &mut segments {
            (s.start, s.end) = (within(s.start), within(s.end));
        }
        let text = segments.iter().map(|s| s.text.as_str()).collect::<String>().trim().to_string();
        Transcript { task, language, duration, text, segments, words: None }
    }
}

/// The `response_format` of a transcription request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResponseFormat {
    #[default]
    Json,
    Text,
    Srt,
    Vtt,
    VerboseJson,
}

impl FromStr for ResponseFormat {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "json" => Ok(ResponseFormat::Json),
            "text" => Ok(ResponseFormat::Text),
            "srt" => Ok(ResponseFormat::Srt),
            "vtt" => Ok(ResponseFormat::Vtt),
            "verbose_json" => Ok(ResponseFormat::VerboseJson),
            other => {
                Err(format!("unknown response_format '{other}': use json, text, srt, verbose_json or vtt"))
            }
        }
    }
}

impl ResponseFormat {
    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            ResponseFormat::Json | ResponseFormat::VerboseJson => "application/json",
            ResponseFormat::Text | ResponseFormat::Srt => "text/plain; charset=utf-8",
            ResponseFormat::Vtt => "text/vtt; charset=utf-8",
        }
    }
}

#[derive(Serialize)]
struct Usage {
    #[serde(rename = "type")]
    kind: &'static str,
    seconds: f64,
}

#[derive(Serialize)]
struct VerboseBody<'a> {
    task: Task,
    language: &'a str,
    duration: f64,
    text: &'a str,
    segments: &'a [Segment],
    #[serde(skip_serializing_if = "Option::is_none")]
    words: Option<&'a [Word]>,
    usage: Usage,
}

/// The response body for `transcript` in `format`.
pub fn render(transcript: &Transcript, format: ResponseFormat) -> String {
    match format {
        // OpenAI's transcription `json` carries the usage too (whisper-1 bills by the
        // second: the SDKs' `Transcription.usage` was None); a translation's is its text.
        ResponseFormat::Json if transcript.task == Task::Transcribe => serde_json::json!({
            "text": transcript.text,
            "usage": Usage { kind: "duration", seconds: transcript.duration },
        })
        .to_string(),
        ResponseFormat::Json => serde_json::json!({ "text": transcript.text }).to_string(),
        ResponseFormat::Text => format!("{}\n", transcript.text),
        ResponseFormat::Srt => subtitles(transcript, Subtitles::Srt),
        ResponseFormat::Vtt => subtitles(transcript, Subtitles::Vtt),
        ResponseFormat::VerboseJson => {
            let body = VerboseBody {
                task: transcript.task,
                language: &transcript.language,
                duration: transcript.duration,
                text: &transcript.text,
                segments: &transcript.segments,
                words: transcript.words.as_deref(),
                usage: Usage { kind: "duration", seconds: transcript.duration },
            };
            // Serializing plain strings and numbers cannot fail; non-finite numbers become null.
            serde_json::to_string(&body)
                .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string())
        }
    }
}

#[derive(Clone, Copy)]
enum Subtitles {
    Srt,
    Vtt,
}

/// `HH:MM:SS,mmm` (SRT) or `HH:MM:SS.mmm` (VTT), rounded to the millisecond; hours
/// grow past two digits rather than wrapping. Negative or non-finite times are 0.
pub fn timestamp(seconds: f64, decimal: char) -> String {
    let millis = if seconds.is_finite() && seconds > 0.0 { (seconds * 1000.0).round() as u64 } else { 0 };
    let (hours, rest) = (millis / 3_600_000, millis % 3_600_000);
    let (minutes, rest) = (rest / 60_000, rest % 60_000);
    let (secs, ms) = (rest / 1000, rest % 1000);
    format!("{hours:02}:{minutes:02}:{secs:02}{decimal}{ms:03}")
}

/// A segment's text as one cue: trimmed, no blank lines, no timing arrow.
fn cue_text(text: &str) -> String {
    text.trim()
        .replace("-->", "->")
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

fn subtitles(transcript: &Transcript, kind: Subtitles) -> String {
    let mut out = String::new();
    if let Subtitles::Vtt = kind {
        out.push_str("WEBVTT\n\n");
    }
    let cues =
        transcript.segments.iter().map(|s| (s, cue_text(&s.text))).filter(|(_, text)| !text.is_empty());
    for (number, (segment, text)) in cues.enumerate() {
        let end = segment.end.max(segment.start);
        // Writing to a String cannot fail.
        let _ = match kind {
            Subtitles::Srt => write!(
                out,
                "{}\n{} --> {}\n{text}\n\n",
                number + 1,
                timestamp(segment.start, ','),
                timestamp(end, ',')
            ),
            Subtitles::Vtt => {
                write!(out, "{} --> {}\n{text}\n\n", timestamp(segment.start, '.'), timestamp(end, '.'))
            }
        };
    }
    out
}
