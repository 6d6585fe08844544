//! Speech end to end through the real binary: real recordings (LibriVox, Beckett) and
//! espeak-ng sentences, converted by sox and lame at test time, sent to
//! `/v1/audio/transcriptions`, `/v1/audio/translations` and KServe v2 as a client would,
//! judged by word error rate against the reference transcripts (never by exact strings)
//! and by exact rules where the behaviour is exact (subtitle timestamps, JSON shapes).
//! Bad uploads and bad forms get a 4xx naming what is wrong, a header's claimed length
//! never sizes an allocation, the memory comes back and the server goes on serving.
#![allow(clippy::unwrap_used)]

#[path = "common/audio.rs"]
mod audio;
mod common;

use std::{
    sync::{Arc, Barrier},
    thread,
};

use audio::*;
use common::*;
use serde_json::Value;

const TINY: &str = "whisper-tiny-en";
const BASE: &str = "whisper-base";
const TRANSCRIPTIONS: &str = "/v1/audio/transcriptions";
const TRANSLATIONS: &str = "/v1/audio/translations";

/// Both Whisper models and a model that is not a speech model, with `server` settings.
fn config(server: &str) -> String {
    let dir = models_dir();
    format!(
        "[server]\n{server}\n\
         [models.{TINY}]\npath = \"{0}/whisper-tiny-en\"\nmax_batch_size = 8\n\
         [models.{BASE}]\npath = \"{0}/whisper-base\"\nmax_batch_size = 8\n\
         [models.mlp-10m]\npath = \"{0}/mlp-10m\"\n",
        dir.display()
    )
}

/// One cue of a subtitle file.
#[derive(Debug)]
struct Cue {
    start: f64,
    end: f64,
    text: String,
}

/// `HH:MM:SS<decimal>mmm`, in seconds; panics on any other shape.
fn parse_timestamp(stamp: &str, decimal: char) -> f64 {
    let ok = stamp.len() == 12
        && stamp.char_indices().all(|(i, c)| match i {
            2 | 5 => c == ':',
            8 => c == decimal,
            _ => c.is_ascii_digit(),
        });
    assert!(ok, "'{stamp}' is not HH:MM:SS{decimal}mmm");
    let number = |r: std::ops::Range<usize>| stamp[r].parse::<f64>().unwrap();
    number(0..2) * 3600.0 + number(3..5) * 60.0 + number(6..8) + number(9..12) / 1000.0
}

/// The cues of an SRT (`numbered`, `,` in times) or VTT body, checking their layout.
fn parse_subtitles(body: &str, numbered: bool) -> Vec<Cue> {
    let decimal = if numbered { ',' } else { '.' };
    assert!(body.ends_with("\n\n"), "the last cue does not end with a blank line: {body:?}");
    let mut cues = Vec::new();
    for (i, block) in body.trim_end().split("\n\n").enumerate() {
        let mut lines = block.lines();
        if numbered {
            assert_eq!(lines.next(), Some((i + 1).to_string().as_str()), "cue {i} is misnumbered: {body}");
        }
        let timing = lines.next().unwrap_or_else(|| panic!("cue {i} has no timing line: {body}"));
        let (start, end) = timing.split_once(" --> ").unwrap_or_else(|| panic!("'{timing}' has no ' --> '"));
        let text: Vec<&str> = lines.collect();
        assert!(!text.is_empty() && text.iter().all(|l| !l.trim().is_empty()), "cue {i} has no text: {body}");
        cues.push(Cue {
            start: parse_timestamp(start, decimal),
            end: parse_timestamp(end, decimal),
            text: text.join(" "),
        });
    }
    cues
}

/// Checks a `verbose_json` body against the clip's duration: segment ids from 0, times
/// that only move forward and stay inside the audio, `text` the segments joined.
fn check_verbose(what: &str, v: &Value, seconds: f64, language: &str, task: &str) -> Vec<(f64, f64, String)> {
    assert_eq!(v["task"], task, "{what}: {v}");
    assert_eq!(v["language"], language, "{what}: {v}");
    let duration = v["duration"].as_f64().unwrap_or_else(|| panic!("{what}: no duration"));
    assert!((duration - seconds).abs() < 0.05, "{what}: duration {duration}, the clip is {seconds} s");
    assert_eq!(v["usage"]["type"], "duration", "{what}");
    assert_eq!(v["usage"]["seconds"].as_f64(), Some(duration), "{what}");
    let segments = v["segments"].as_array().unwrap_or_else(|| panic!("{what}: no segments"));
    assert!(!segments.is_empty(), "{what}: no segments");
    let mut out = Vec::new();
    let mut previous_start = 0.0;
    for (i, s) in segments.iter().enumerate() {
        assert_eq!(s["id"].as_u64(), Some(i as u64), "{what}: segment {i}: {s}");
        let (start, end) = (s["start"].as_f64().unwrap(), s["end"].as_f64().unwrap());
        assert!(start >= previous_start, "{what}: segment {i} starts at {start}, before {previous_start}");
        assert!(start < end, "{what}: segment {i} is {start}..{end}");
        assert!(end <= duration, "{what}: segment {i} ends at {end}, after the audio ({duration})");
        previous_start = start;
        for field in ["avg_logprob", "compression_ratio", "no_speech_prob", "temperature"] {
            assert!(s[field].is_number(), "{what}: segment {i} lacks {field}: {s}");
        }
        assert!(s["tokens"].as_array().is_some_and(|t| !t.is_empty()), "{what}: segment {i} has no tokens");
        out.push((start, end, s["text"].as_str().unwrap().to_string()));
    }
    let joined: String = out.iter().map(|(_, _, t)| t.as_str()).collect();
    assert_eq!(v["text"].as_str(), Some(joined.trim()), "{what}: text is not its segments joined");
    out
}

#[test]
fn english_clips_match_their_transcripts_in_every_format() {
    let s = Server::start("speech-formats", &config(""), &[]);
    // Four clips in `json`; the first two (17 s) also in every other format.
    let clips = [beckett(), librivox("0870"), librivox("0890"), librivox("0920")];
    for (i, clip) in clips.iter().enumerate() {
        let bytes = clip.bytes();
        let json = transcribe(&s.base, TINY, &bytes, &[]);
        assert_eq!(json.content_type, "application/json", "{}", clip.name);
        // `{text, usage}`, as OpenAI's json is for whisper-1 (billed by the second).
        let body = json.json();
        assert_eq!(body.as_object().map(|o| o.len()), Some(2), "json is {{text, usage}}: {}", json.body);
        assert_eq!(body["usage"]["type"], "duration", "{}", json.body);
        let seconds = body["usage"]["seconds"].as_f64().unwrap_or(0.0);
        assert!((seconds - clip.seconds()).abs() < 0.05, "{}: usage {seconds} s", clip.name);
        let text = json.text();
        assert_wer(&clip.name, &clip.words, &text, 0.10);
        if i >= 2 {
            continue;
        }
        let explicit = transcribe(&s.base, TINY, &bytes, &[("response_format", "json")]);
        assert_eq!(explicit.text(), text, "{}: response_format=json differs from the default", clip.name);
        // Options sent empty (`-F temperature=`, a form's blank inputs) take their defaults.
        let blank = [("response_format", ""), ("temperature", ""), ("language", ""), ("prompt", "")];
        let blank = transcribe(&s.base, TINY, &bytes, &blank);
        assert_eq!((blank.status, blank.content_type.as_str()), (200, "application/json"), "{}", blank.body);
        assert_eq!(blank.text(), text, "{}: options sent empty changed the answer", clip.name);

        let plain = transcribe(&s.base, TINY, &bytes, &[("response_format", "text")]);
        assert_eq!((plain.status, plain.content_type.as_str()), (200, "text/plain; charset=utf-8"));
        assert_eq!(plain.body, format!("{text}\n"), "{}: text is the transcript and a newline", clip.name);

        let verbose = transcribe(&s.base, TINY, &bytes, &[("response_format", "verbose_json")]);
        assert_eq!(verbose.status, 200, "{}", verbose.body);
        let segments = check_verbose(&clip.name, &verbose.json(), clip.seconds(), "english", "transcribe");
        assert_eq!(verbose.json()["text"].as_str(), Some(text.as_str()), "{}", clip.name);

        for (format, numbered, content_type) in
            [("srt", true, "text/plain; charset=utf-8"), ("vtt", false, "text/vtt; charset=utf-8")]
        {
            let what = format!("{} as {format}", clip.name);
            let sub = transcribe(&s.base, TINY, &bytes, &[("response_format", format)]);
            assert_eq!((sub.status, sub.content_type.as_str()), (200, content_type), "{what}: {}", sub.body);
            let body = if numbered {
                sub.body.clone()
            } else {
                sub.body
                    .strip_prefix("WEBVTT\n\n")
                    .unwrap_or_else(|| panic!("{what}: no WEBVTT header"))
                    .into()
            };
            let cues = parse_subtitles(&body, numbered);
            assert_eq!(cues.len(), segments.len(), "{what}: one cue per segment");
            for (cue, (start, end, text)) in cues.iter().zip(&segments) {
                // The cue's times are the segment's, rounded to the millisecond.
                assert!(
                    (cue.start - start).abs() <= 0.0005 && (cue.end - end).abs() <= 0.0005,
                    "{what}: {cue:?}"
                );
                assert_eq!(cue.text, text.trim(), "{what}");
            }
            let all: Vec<&str> = cues.iter().map(|c| c.text.as_str()).collect();
            assert_wer(&what, &clip.words, &all.join(" "), 0.10);
        }
    }
}

#[test]
fn every_container_and_rate_gives_the_same_words() {
    let s = Server::start("speech-containers", &config(""), &[]);
    let scratch = Scratch::new("containers");
    for clip in [beckett(), librivox("0870")] {
        let reference = transcribe(&s.base, TINY, &clip.bytes(), &[]).text();
        let p = |ext: &str| scratch.path(&format!("{}.{ext}", clip.name));
        let variants = [
            ("FLAC", convert(&clip.path, &p("flac"), &[], &[])),
            ("MP3 (lame)", lame(&clip.path, &p("mp3"))),
            ("OGG/Vorbis", convert(&clip.path, &p("ogg"), &[], &[])),
            ("8-bit WAV", convert(&clip.path, &p("u8.wav"), &["-b", "8", "-e", "unsigned-integer"], &[])),
            (
                "44.1 kHz stereo WAV",
                convert(&clip.path, &p("44k.wav"), &[], &["rate", "44100", "channels", "2"]),
            ),
        ];
        for (what, path) in variants {
            let what = format!("{} as {what}", clip.name);
            let answer = transcribe(
                &s.base,
                TINY,
                &std::fs::read(&path).unwrap(),
                &[("response_format", "verbose_json")],
            );
            assert_eq!(answer.status, 200, "{what}: {}", answer.body);
            let v = answer.json();
            let text = v["text"].as_str().unwrap();
            assert_wer(&what, &reference, text, 0.10);
            assert_wer(&what, &clip.words, text, 0.10);
            // Lossy codecs pad a little: lame's encoder delay and padding are not trimmed
            // (+0.1 s on these clips), nor a Vorbis block.
            let duration = v["duration"].as_f64().unwrap();
            assert!(
                (duration - clip.seconds()).abs() < 0.15,
                "{what}: duration {duration} vs {}",
                clip.seconds()
            );
        }
    }
}

#[test]
fn phone_and_joined_recordings_give_all_their_words() {
    // A voice memo (M4A/AAC), a browser's recording (WebM/Opus), a voice note
    // (OGG/Opus), and two MP3s joined with `cat`, whose first LAME tag once cut the
    // second file off with a 200.
    let s = Server::start("speech-recordings", &config(""), &[]);
    let scratch = Scratch::new("recordings");
    let fixtures = repo_root().join("tests/fixtures/audio");
    let clip = librivox("0880");
    let m4a = std::fs::read(fixtures.join("0880_aac.m4a")).unwrap();
    let answer = transcribe(&s.base, TINY, &m4a, &[]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let wav = transcribe(&s.base, TINY, &clip.bytes(), &[]).text();
    assert_wer("0880 as M4A/AAC", &wav, answer.text().as_str(), 0.10);
    let other = librivox("0870");
    let mut joined = std::fs::read(lame(&other.path, &scratch.path("0870.mp3"))).unwrap();
    joined.extend(std::fs::read(lame(&clip.path, &scratch.path("0880.mp3"))).unwrap());
    let answer = transcribe(&s.base, TINY, &joined, &[("response_format", "verbose_json")]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let v = answer.json();
    let both = format!("{} {}", other.words, clip.words);
    assert_wer("0870.mp3 + 0880.mp3", &both, v["text"].as_str().unwrap(), 0.10);
    let duration = v["duration"].as_f64().unwrap();
    assert!((duration - other.seconds() - clip.seconds()).abs() < 0.4, "duration {duration}");
    for file in ["0880_opus.webm", "0880_opus.ogg"] {
        let opus = std::fs::read(fixtures.join(file)).unwrap();
        let answer = transcribe(&s.base, TINY, &opus, &[]);
        assert_eq!(answer.status, 200, "{file}: {}", answer.body);
        assert_wer(file, &wav, answer.text().as_str(), 0.10);
    }
}

#[test]
fn kserve_bytes_audio_gives_the_openai_text() {
    let s = Server::start("speech-kserve", &config(""), &[]);
    let scratch = Scratch::new("kserve");
    let (status, meta) = s.get(&format!("/v2/models/{TINY}"));
    assert_eq!(status, 200, "{meta}");
    assert_eq!(meta["inputs"][0]["name"], "audio", "{meta}");
    assert_eq!(meta["inputs"][0]["datatype"], "BYTES", "{meta}");
    assert_eq!(meta["outputs"][0]["name"], "text", "{meta}");
    let clips = [beckett(), librivox("0890"), librivox("0930")];
    let files: Vec<Vec<u8>> = vec![
        clips[0].bytes(),
        std::fs::read(convert(&clips[1].path, &scratch.path("0890.flac"), &[], &[])).unwrap(),
        std::fs::read(lame(&clips[2].path, &scratch.path("0930.mp3"))).unwrap(),
    ];
    let openai: Vec<String> = files.iter().map(|f| transcribe(&s.base, TINY, f, &[]).text()).collect();
    // Each transcription is one request's queue wait, however many slices it ran in.
    let metrics = s.metrics();
    let waits = format!("snooze_queue_wait_seconds_count{{model=\"{TINY}\"}} ");
    let count =
        metrics.lines().find_map(|l| l.strip_prefix(waits.as_str())).unwrap_or_else(|| panic!("{metrics}"));
    assert_eq!(count.trim(), "3", "queue waits observed for three transcriptions");
    for binary_output in [false, true] {
        let what = if binary_output { "binary output" } else { "JSON output" };
        let (status, all) = kserve(&s.base, TINY, &files, binary_output);
        assert_eq!((status, all.len()), (200, 3), "{what}: {all:?}");
        for ((got, want), clip) in all.iter().zip(&openai).zip(&clips) {
            assert_eq!(words(got), words(want), "{what}: {} among three files", clip.name);
            assert_wer(&clip.name, &clip.words, got, 0.10);
        }
    }
    // One bad file among good ones: the request fails, naming which.
    let (status, body) = kserve(&s.base, TINY, &[files[0].clone(), b"not audio at all".to_vec()], false);
    assert_eq!(status, 400, "{body:?}");
    assert!(body[0].contains("audio file 1") && body[0].contains("not audio"), "{body:?}");
}

#[test]
fn concurrent_requests_get_the_text_each_gets_alone() {
    let s = Server::start("speech-concurrent", &config(""), &[]);
    let clips = all_english();
    let alone: Vec<String> =
        clips.iter().map(|c| transcribe(&s.base, TINY, &c.bytes(), &[]).text()).collect();
    // Eight at once (two clips twice), released together so their decoder steps share slices.
    let order: Vec<usize> = (0..8).map(|i| i % clips.len()).collect();
    let barrier = Arc::new(Barrier::new(order.len()));
    let handles: Vec<_> = order
        .iter()
        .map(|&i| {
            let (base, bytes, barrier) = (s.base.clone(), clips[i].bytes(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                transcribe(&base, TINY, &bytes, &[])
            })
        })
        .collect();
    for (handle, &i) in handles.into_iter().zip(&order) {
        let together = handle.join().expect("request thread").text();
        assert_eq!(words(&together), words(&alone[i]), "{}: alone vs among 8 at once", clips[i].name);
    }
}

/// One placement of a clip in the long recording.
struct Placement {
    clip: usize,
    start: f64,
    end: f64,
}

#[test]
fn three_minutes_are_segmented_at_the_right_times() {
    let s = Server::start("speech-long", &config(""), &[]);
    let scratch = Scratch::new("long");
    let clips = all_english();
    let gap = 2.0;
    let silence = scratch.path("silence.wav");
    sox(&[
        "-n",
        "-r",
        "16000",
        "-c",
        "1",
        "-b",
        "16",
        silence.to_str().unwrap(),
        "trim",
        "0",
        &gap.to_string(),
    ]);
    // Four rounds of the six clips, each round in another order, a silence after each.
    let mut parts = Vec::new();
    let mut placements = Vec::new();
    let mut at = 0.0;
    for round in 0..4 {
        for k in 0..clips.len() {
            // Steps of 1 and 5 through the six clips: each round a permutation.
            let i = (k * [1, 5][round % 2] + round) % clips.len();
            let seconds = clips[i].seconds();
            placements.push(Placement { clip: i, start: at, end: at + seconds });
            at += seconds + gap;
            parts.push(clips[i].path.to_str().unwrap().to_string());
            parts.push(silence.to_str().unwrap().to_string());
        }
    }
    let long = scratch.path("long.wav");
    let mut args: Vec<&str> = parts.iter().map(String::as_str).collect();
    args.push(long.to_str().unwrap());
    sox(&args);
    let total = seconds(&long);
    assert!((170.0..200.0).contains(&total), "the long recording is {total} s");

    let answer =
        transcribe(&s.base, TINY, &std::fs::read(&long).unwrap(), &[("response_format", "verbose_json")]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let v = answer.json();
    let segments = check_verbose("3 minutes", &v, total, "english", "transcribe");
    let reference: Vec<&str> = placements.iter().map(|p| clips[p.clip].words.as_str()).collect();
    assert_wer("3 minutes", &reference.join(" "), v["text"].as_str().unwrap(), 0.10);

    // Each segment's words are spoken where it says: inside the clips its times overlap.
    let slack = 1.0;
    for (start, end, text) in &segments {
        let said: Vec<String> = words(text);
        if said.len() < 3 {
            continue;
        }
        let heard: Vec<String> = placements
            .iter()
            .filter(|p| p.start < end + slack && p.end > start - slack)
            .flat_map(|p| words(&clips[p.clip].words))
            .collect();
        let found = said.iter().filter(|w| heard.contains(w)).count();
        assert!(
            found as f64 >= 0.8 * said.len() as f64,
            "the segment {start:.2}..{end:.2} '{text}' is not what is spoken there"
        );
    }
    // Every clip starts after a silence: the segment that opens with one of its first three
    // words (Whisper drops a leading "And" at times) and starts nearest to it is within
    // 3.5 s. Whisper's own timestamps are that coarse: tiny.en predicts whole seconds from
    // each window's start, and drifts by up to ~2.9 s over these three minutes.
    let mut worst: f64 = 0.0;
    for p in &placements {
        let first = &words(&clips[p.clip].words)[..3];
        let opens = |text: &str| words(text).first().is_some_and(|w| first.contains(w));
        let off = segments
            .iter()
            .filter(|(_, _, text)| opens(text))
            .map(|(start, _, _)| (start - p.start).abs())
            .fold(f64::INFINITY, f64::min);
        assert!(
            off <= 3.5,
            "no segment opening '{}' starts within 3.5 s of {:.2}: {segments:?}",
            clips[p.clip].name,
            p.start
        );
        worst = worst.max(off);
    }
    eprintln!("3 minutes: {} segments, clip starts found within {worst:.2} s", segments.len());
}

#[test]
fn the_multilingual_model_hears_spanish_and_french_and_translates() {
    let s = Server::start("speech-base", &config(""), &[]);
    let scratch = Scratch::new("base");
    // espeak-ng voices whisper-base recognises: Spanish at 140 wpm, French at 130 (at
    // its default 175 wpm the French is taken for another language).
    let spanish_text = "Buenos días. Hoy vamos a hablar de la historia de España y de sus ciudades.";
    let spanish = std::fs::read(espeak("es", 140, spanish_text, &scratch.path("es.wav"))).unwrap();
    let french_text =
        "Bonjour à tous. Aujourd'hui, nous allons parler de la cuisine française et de ses recettes.";
    let french = std::fs::read(espeak("fr", 130, french_text, &scratch.path("fr.wav"))).unwrap();

    // Each detected; Spanish also named (French named costs a run and adds little).
    // espeak's French is harder for whisper-base than its Spanish, and a window that
    // fails Whisper's checks is resampled at a higher temperature: French gets a looser bound.
    for (what, bytes, text, languages, name, limit) in [
        ("Spanish", &spanish, spanish_text, &[None, Some("es")][..], "spanish", 0.35),
        ("French", &french, french_text, &[None][..], "french", 0.5),
    ] {
        for &given in languages {
            let mut fields = vec![("response_format", "verbose_json")];
            fields.extend(given.map(|l| ("language", l)));
            let answer = transcribe(&s.base, BASE, bytes, &fields);
            assert_eq!(answer.status, 200, "{what}: {}", answer.body);
            let v = answer.json();
            let said = format!("{what} (language {given:?})");
            assert_eq!(v["language"], name, "{said}: {}", v["text"]);
            assert_wer(&said, text, v["text"].as_str().unwrap(), limit);
        }
    }

    let answer = post_form(
        &s.base,
        TRANSLATIONS,
        &form(&[("model", BASE), ("response_format", "verbose_json")], Some(("es.wav", &spanish))),
        None,
    );
    assert_eq!(answer.status, 200, "{}", answer.body);
    let v = answer.json();
    assert_eq!((&v["task"], &v["language"]), (&Value::from("translate"), &Value::from("english")), "{v}");
    let english = words(v["text"].as_str().unwrap());
    // whisper-base's English for it varies ("the story of the Spanish..."): the meaning, not the words.
    let meanings: [&[&str]; 5] =
        [&["today"], &["talk", "speak"], &["history", "story"], &["spain", "spanish"], &["cities", "city"]];
    let found = meanings.iter().filter(|m| english.iter().any(|e| m.contains(&e.as_str()))).count();
    assert!(found >= 3, "the translation lacks the meaning of {meanings:?}: {english:?}");
    let spanish = ["hoy", "vamos", "hablar", "historia", "ciudades"];
    assert!(!english.iter().any(|w| spanish.contains(&w.as_str())), "still Spanish: {english:?}");

    // English in, English out; `language` names the spoken language on translations too.
    let clip = beckett();
    let answer = post_form(
        &s.base,
        TRANSLATIONS,
        &form(&[("model", BASE), ("language", "english")], Some(("beckett.wav", &clip.bytes()))),
        None,
    );
    assert_wer("beckett translated", &clip.words, &answer.text(), 0.15);
}

#[test]
fn api_keys_guard_the_audio_routes() {
    let s = Server::start("speech-keys", &config(""), &["--api-keys", "k1"]);
    let clip = beckett();
    let upload = form(&[("model", TINY)], Some(("beckett.wav", &clip.bytes())));
    for (key, what) in [(None, "no key"), (Some("k2"), "a wrong key")] {
        let answer = post_form(&s.base, TRANSCRIPTIONS, &upload, key);
        assert_eq!(answer.status, 401, "{what}: {}", answer.body);
        let v = answer.json();
        assert_eq!(v["error"]["type"], "authentication_error", "{what}: {v}");
        assert!(answer.error_message().contains("API key"), "{what}: {v}");
    }
    assert_eq!(kserve(&s.base, TINY, &[clip.bytes()], false).0, 401, "KServe without a key");
    let answer = post_form(&s.base, TRANSCRIPTIONS, &upload, Some("k1"));
    assert_wer("with the key", &clip.words, &answer.text(), 0.10);
    let upload = form(&[("model", BASE)], Some(("beckett.wav", &clip.bytes())));
    assert_eq!(post_form(&s.base, TRANSLATIONS, &upload, None).status, 401, "translations");
}

/// Sends one bad upload; checks the status, the error's shape and what it names.
fn refused(s: &Server, case: &BadUpload) {
    let response = client()
        .post(s.url(&case.route))
        .header("content-type", &case.content_type)
        .body(case.body.clone())
        .send()
        .expect("POST");
    let status = response.status().as_u16();
    let body = response.text().expect("body");
    let what = &case.what;
    assert_eq!(status, case.status, "{what}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {body}"));
    let message = if case.route.starts_with("/v1/") {
        assert_eq!(v["error"]["param"].as_str(), case.param, "{what}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{what}: {v}");
        v["error"]["message"].as_str()
    } else {
        v["error"].as_str()
    };
    let message = message.unwrap_or_else(|| panic!("{what}: no message in {v}"));
    assert!(message.contains(case.contains), "{what}: '{message}' lacks '{}'", case.contains);
}

/// `VmPeak` of `pid`: the most address space it ever held, reserved or touched.
fn address_space_peak(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmPeak:")).unwrap();
    kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

#[test]
fn bad_uploads_are_refused_by_name_and_the_memory_comes_back() {
    const MIB: u64 = 1 << 20;
    let mut s =
        Server::start("speech-bad", &config("max_audio_seconds = 20\nmax_request_size = \"2MiB\""), &[]);
    let scratch = Scratch::new("bad");
    let clip = beckett();
    let wav = clip.bytes();
    let mp3 = std::fs::read(lame(&clip.path, &scratch.path("beckett.mp3"))).unwrap();
    let cases = bad_uploads(TINY, &scratch);
    // Warm: the model loaded and two transcriptions run, so what follows is the steady
    // state (RSS grows ~125 MiB from the first to the second, then stays within a few MiB).
    for _ in 0..2 {
        assert_wer("before", &clip.words, &transcribe(&s.base, TINY, &wav, &[]).text(), 0.10);
    }
    let pid = s.child.id();
    let (baseline, _) = rss_and_peak(pid);
    let address_space_before = address_space_peak(pid);
    reset_peak(pid);

    for case in &cases {
        refused(&s, case);
    }
    // Damaged files decode up to the damage: a cut WAV or MP3 is transcribed as far as it goes.
    let full = transcribe(&s.base, TINY, &wav, &[("response_format", "verbose_json")]).json();
    for (what, bytes) in [("WAV", &wav), ("MP3", &mp3)] {
        let cut = &bytes[..bytes.len() * 6 / 10];
        let answer = transcribe(&s.base, TINY, cut, &[("response_format", "verbose_json")]);
        assert_eq!(answer.status, 200, "{what} cut at 60%: {}", answer.body);
        let v = answer.json();
        let share = v["duration"].as_f64().unwrap() / full["duration"].as_f64().unwrap();
        assert!((0.5..0.7).contains(&share), "{what} cut at 60%: {share:.2} of the audio decoded");
        let (got, all) = (words(v["text"].as_str().unwrap()), words(full["text"].as_str().unwrap()));
        assert!(got.len() >= 3 && got.len() < all.len(), "{what} cut at 60%: {got:?} of {all:?}");
        assert_eq!(got[..3], all[..3], "{what} cut at 60%: {got:?} of {all:?}");
    }
    // A header claiming 37 hours over 1 KB of samples: the 1 KB is counted, the claim is
    // neither believed (it would be 413 here) nor allocated.
    let mut claim = wav_header(u32::MAX - 1);
    claim.extend_from_slice(&wav[44..1068]);
    let answer = transcribe(&s.base, TINY, &claim, &[("response_format", "verbose_json")]);
    assert_eq!(answer.status, 200, "a header claiming hours: {}", answer.body);
    let duration = answer.json()["duration"].as_f64().unwrap();
    assert!(
        (duration - 0.032).abs() < 0.002,
        "a header claiming hours over 512 samples: duration {duration}"
    );

    let (rss, peak) = rss_and_peak(pid);
    let reserved = address_space_peak(pid).saturating_sub(address_space_before);
    eprintln!(
        "{} bad uploads: RSS {} -> {} MiB, peak {} MiB, address space peak +{} MiB",
        cases.len(),
        baseline / MIB,
        rss / MIB,
        peak / MIB,
        reserved / MIB
    );
    // Transcriptions here hold a 30 s window's activations; believing a claim would take
    // gigabytes of address space (the 4 GiB chunk, 37 hours of samples).
    assert!(reserved < 1024 * MIB, "the address space grew by {} MiB", reserved / MIB);
    assert!(peak < baseline + 200 * MIB, "RSS peaked at {} MiB over {} MiB", peak / MIB, baseline / MIB);
    assert!(rss < baseline + 64 * MIB, "RSS {} MiB after, {} MiB before", rss / MIB, baseline / MIB);
    assert!(s.child.try_wait().map(|st| st.is_none()).unwrap_or(false), "the server is alive");
    assert_wer("after", &clip.words, &transcribe(&s.base, TINY, &wav, &[]).text(), 0.10);
}

#[test]
fn a_transcription_whose_client_left_stops_and_is_counted_as_cancelled() {
    let s = Server::start("speech-cancelled", &config(""), &[]);
    // 70 s of speech: seconds of work the client will not wait for.
    let clip = librivox("0870").bytes();
    let pcm = &clip[44..];
    let mut wav = wav_header((pcm.len() * 10) as u32);
    for _ in 0..10 {
        wav.extend_from_slice(pcm);
    }
    let upload = form(&[("model", TINY)], Some(("long.wav", &wav)));
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut client = std::net::TcpStream::connect(&addr).unwrap();
    let head = format!(
        "POST {TRANSCRIPTIONS} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: {}\r\ncontent-length: {}\r\n\r\n",
        upload.content_type,
        upload.body.len()
    );
    std::io::Write::write_all(&mut client, head.as_bytes()).unwrap();
    std::io::Write::write_all(&mut client, &upload.body).unwrap();
    let metric = |s: &Server, series: &str| {
        let text = client_get_text(&s.url("/metrics"));
        text.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    let started = format!("snooze_queue_wait_seconds_count{{model=\"{TINY}\"}}");
    s.wait_for("the transcription's first slice", |s| metric(s, &started) == Some(1.0));
    drop(client);
    let cancelled =
        format!("snooze_requests_total{{model=\"{TINY}\",protocol=\"openai\",outcome=\"cancelled\"}}");
    s.wait_for("the request to be counted as cancelled", |s| metric(s, &cancelled) == Some(1.0));
    // Its job stopped: the model is free, and the next request is answered.
    s.wait_for("the job to stop", |s| s.model(TINY)["leases"] == 0 && s.model(TINY)["queued"]["normal"] == 0);
    let answer = transcribe(&s.base, TINY, &librivox("0880").bytes(), &[]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let ok = format!("snooze_requests_total{{model=\"{TINY}\",protocol=\"openai\",outcome=\"ok\"}}");
    assert_eq!(metric(&s, &ok), Some(1.0));
    assert_eq!(metric(&s, &cancelled), Some(1.0), "counted once");
}

fn client_get_text(url: &str) -> String {
    client().get(url).send().unwrap().text().unwrap()
}

#[test]
fn whisper_is_said_to_be_held_as_it_is_prepacked() {
    // `auto` under a cap on loaded models resolves to `mapped`, which Whisper's graphs
    // never use: /admin/models said mapped, and two preparations were made and logged
    // (the 'mapped' one made the prepacked copies, the 'prepacked' one did nothing).
    let s = Server::start("speech-weights", &config("max_loaded_models = 1"), &[]);
    for name in [TINY, BASE] {
        let m = s.model(name);
        assert_eq!(m["weights"], "prepacked", "{m}");
    }
    assert_eq!(s.model("mlp-10m")["weights"], "mapped", "the others as auto decides");
    s.wait_for("the background preparations", |s| {
        let events = s.get("/admin/events").1;
        events["events"]
            .as_array()
            .is_some_and(|e| e.iter().filter(|e| e["kind"] == "prepared" && e["model"] == TINY).count() >= 1)
    });
    let events = s.get("/admin/events").1;
    let forms: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "prepared" && e["model"] == TINY)
        .filter_map(|e| e["reason"].as_str())
        .collect();
    assert_eq!(forms, ["prepacked"], "{events}");
}

#[test]
fn whisper_base_is_served_by_a_budget_its_measured_peak_fits() {
    // whisper-base's first run peaks at ~550 MiB. Its estimate counted eight full-length
    // sequences' KV caches beside an encoder window (a working set the scheduler holds
    // run by run anyway): 1.0 GiB, so a 900 MiB budget refused it as a model that could
    // never fit, and it was never loaded to be measured.
    let s = Server::start("speech-budget", &config("host_memory_limit = \"900MiB\""), &[]);
    let clip = beckett();
    let answer = transcribe(&s.base, BASE, &clip.bytes(), &[("language", "en")]);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_wer(&clip.name, &clip.words, &answer.text(), 0.10);
    let m = s.model(BASE);
    let bytes = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k}: {m}"));
    // The estimate stays above what the load and the run measured: it admits the first load.
    for (estimated, measured) in [
        ("footprint_peak_estimated_bytes", "footprint_peak_measured_bytes"),
        ("footprint_estimated_bytes", "footprint_measured_bytes"),
    ] {
        assert!(bytes(estimated) >= bytes(measured), "{estimated} below {measured}: {m}");
    }
}
