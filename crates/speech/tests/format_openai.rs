//! Transcripts rendered in each `response_format`, checked byte for byte where the
//! format is text and, for every format, parsed by the official `openai` Python SDK
//! from the project's venv exactly as a client would receive them: its HTTP client is
//! given our body through `httpx.MockTransport`, and `audio.transcriptions.create` /
//! `audio.translations.create` return the parsed object.
#![allow(clippy::unwrap_used)]

use std::{path::Path, process::Command};

use serde_json::{json, Value};
use snooze_speech::format::{render, timestamp, ResponseFormat, Segment, Task, Transcript, Word};

fn segment(id: u32, start: f64, end: f64, text: &str) -> Segment {
    Segment {
        id,
        seek: (start * 100.0) as u64,
        start,
        end,
        text: text.into(),
        tokens: vec![50364, 440, 7534 + id, 50530],
        temperature: 0.0,
        avg_logprob: -0.28607,
        compression_ratio: 1.2363636,
        no_speech_prob: 0.0098,
    }
}

fn transcript() -> Transcript {
    Transcript::from_segments(
        Task::Transcribe,
        "english".into(),
        7.1,
        vec![
            segment(0, 0.0, 3.32, " And Mister John Dashwood had then leisure to consider"),
            segment(1, 3.32, 7.1, " how much there might be --> prudently\n\nin his power."),
        ],
    )
}

#[test]
fn text_is_the_joined_segments_and_a_newline() {
    let t = transcript();
    assert_eq!(
        t.text,
        "And Mister John Dashwood had then leisure to consider how much there might be --> prudently\n\nin his power."
    );
    assert_eq!(render(&t, ResponseFormat::Text), format!("{}\n", t.text));
    let usage = json!({ "type": "duration", "seconds": 7.1 });
    assert_eq!(render(&t, ResponseFormat::Json), json!({ "text": t.text, "usage": usage }).to_string());
    let translation = Transcript { task: Task::Translate, ..t.clone() };
    assert_eq!(render(&translation, ResponseFormat::Json), json!({ "text": t.text }).to_string());
}

#[test]
fn srt_and_vtt_cues() {
    let t = transcript();
    assert_eq!(
        render(&t, ResponseFormat::Srt),
        "1\n00:00:00,000 --> 00:00:03,320\nAnd Mister John Dashwood had then leisure to consider\n\n\
         2\n00:00:03,320 --> 00:00:07,100\nhow much there might be -> prudently\nin his power.\n\n"
    );
    assert_eq!(
        render(&t, ResponseFormat::Vtt),
        "WEBVTT\n\n00:00:00.000 --> 00:00:03.320\nAnd Mister John Dashwood had then leisure to consider\n\n\
         00:00:03.320 --> 00:00:07.100\nhow much there might be -> prudently\nin his power.\n\n"
    );
}

#[test]
fn blank_segments_make_no_cue_and_numbering_stays_consecutive() {
    let t = Transcript::from_segments(
        Task::Transcribe,
        "english".into(),
        9.0,
        vec![segment(0, 0.0, 1.0, " one"), segment(1, 1.0, 2.0, "  \n "), segment(2, 2.0, 3.0, " three")],
    );
    let srt = render(&t, ResponseFormat::Srt);
    assert!(srt.starts_with("1\n00:00:00,000 --> 00:00:01,000\none\n\n2\n00:00:02,000"), "{srt}");
}

#[test]
fn timestamps_round_to_the_millisecond_and_hours_do_not_wrap() {
    assert_eq!(timestamp(0.0, ','), "00:00:00,000");
    assert_eq!(timestamp(1.23, ','), "00:00:01,230");
    assert_eq!(timestamp(1.2305, '.'), "00:00:01.231");
    assert_eq!(timestamp(59.9996, '.'), "00:01:00.000");
    assert_eq!(timestamp(3_599.999_4, ','), "00:59:59,999");
    assert_eq!(timestamp(3_725.5, ','), "01:02:05,500");
    assert_eq!(timestamp(100.0 * 3600.0 + 61.007, ','), "100:01:01,007");
    assert_eq!(timestamp(-0.5, ','), "00:00:00,000");
    assert_eq!(timestamp(f64::NAN, ','), "00:00:00,000");
}

#[test]
fn response_formats_parse_by_name() {
    for (name, format) in [
        ("json", ResponseFormat::Json),
        ("text", ResponseFormat::Text),
        ("srt", ResponseFormat::Srt),
        ("vtt", ResponseFormat::Vtt),
        ("verbose_json", ResponseFormat::VerboseJson),
    ] {
        assert_eq!(name.parse::<ResponseFormat>(), Ok(format));
    }
    let e = "xml".parse::<ResponseFormat>().unwrap_err();
    assert_eq!(e, "unknown response_format 'xml': use json, text, srt, verbose_json or vtt");
}

/// Each case: the endpoint, the response_format, our body and content type. The
/// script answers with what the SDK returned, as JSON.
const SDK_SCRIPT: &str = r#"
import json, sys
import httpx, openai

cases = json.load(open(sys.argv[1]))
results = []
for case in cases:
    def handler(request, case=case):
        return httpx.Response(200, content=case["body"].encode(), headers={"content-type": case["content_type"]})
    client = openai.OpenAI(api_key="test", base_url="http://snooze.test/v1",
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    api = client.audio.transcriptions if case["endpoint"] == "transcriptions" else client.audio.translations
    parsed = api.create(file=("a.wav", b"RIFF"), model="whisper-1", response_format=case["format"])
    if isinstance(parsed, str):
        results.append({"type": "str", "value": parsed})
    else:
        results.append({"type": type(parsed).__name__, "value": parsed.model_dump(mode="json", exclude_unset=True),
                        "extra": sorted((parsed.model_extra or {}).keys())})
print(json.dumps(results))
"#;

fn python() -> std::path::PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run `make venv` (the openai SDK is in scripts/requirements.txt)",
        python.display()
    );
    python
}

#[test]
fn the_openai_sdk_parses_every_format() {
    let mut t = transcript();
    t.words = Some(vec![Word { word: "And".into(), start: 0.0, end: 0.32 }]);
    let mut translation = transcript();
    translation.task = Task::Translate;
    let formats = [
        ("json", ResponseFormat::Json),
        ("text", ResponseFormat::Text),
        ("srt", ResponseFormat::Srt),
        ("vtt", ResponseFormat::Vtt),
        ("verbose_json", ResponseFormat::VerboseJson),
    ];
    let mut cases = Vec::new();
    for (endpoint, transcript) in [("transcriptions", &t), ("translations", &translation)] {
        for (name, format) in formats {
            cases.push(json!({
                "endpoint": endpoint,
                "format": name,
                "body": render(transcript, format),
                "content_type": format.content_type(),
            }));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let cases_path = dir.path().join("cases.json");
    std::fs::write(&cases_path, serde_json::to_string(&cases).unwrap()).unwrap();
    let output = Command::new(python()).arg("-c").arg(SDK_SCRIPT).arg(&cases_path).output().unwrap();
    assert!(output.status.success(), "the SDK script failed: {}", String::from_utf8_lossy(&output.stderr));
    let results: Vec<Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(results.len(), cases.len());

    for (case, result) in cases.iter().zip(&results) {
        let (endpoint, format) = (case["endpoint"].as_str().unwrap(), case["format"].as_str().unwrap());
        let body = case["body"].as_str().unwrap();
        match format {
            "text" | "srt" | "vtt" => assert_eq!(result["value"], body, "{endpoint} {format}"),
            "json" => {
                let expected = if endpoint == "transcriptions" { "Transcription" } else { "Translation" };
                assert_eq!(result["type"], expected);
                // A transcription's usage is a field of the SDK's type, not an extra.
                let value = if endpoint == "transcriptions" {
                    json!({ "text": t.text, "usage": { "type": "duration", "seconds": 7.1 } })
                } else {
                    json!({ "text": t.text })
                };
                assert_eq!(result["value"], value, "{endpoint}");
                assert_eq!(result["extra"], json!([]), "{endpoint}");
            }
            _ => {
                let sent: Value = serde_json::from_str(body).unwrap();
                let value = &result["value"];
                let expected =
                    if endpoint == "transcriptions" { "TranscriptionVerbose" } else { "TranslationVerbose" };
                assert_eq!(result["type"], expected);
                // Every field the SDK declares came through with the value and type we sent.
                for field in ["language", "duration", "text", "segments"] {
                    assert_eq!(value[field], sent[field], "{endpoint} {field}");
                }
                let segment = &value["segments"][1];
                for field in [
                    "id",
                    "seek",
                    "start",
                    "end",
                    "text",
                    "tokens",
                    "temperature",
                    "avg_logprob",
                    "compression_ratio",
                    "no_speech_prob",
                ] {
                    assert!(!segment[field].is_null(), "{endpoint}: segment field {field} missing");
                }
                if endpoint == "transcriptions" {
                    assert_eq!(value["words"], json!([{ "word": "And", "start": 0.0, "end": 0.32 }]));
                    assert_eq!(value["usage"], json!({ "type": "duration", "seconds": 7.1 }));
                    assert_eq!(result["extra"], json!(["task"]), "only `task` is beyond the SDK's model");
                    assert_eq!(sent["task"], "transcribe");
                } else {
                    assert_eq!(sent["task"], "translate");
                }
            }
        }
    }
}
