//! Real speech for the integration tests that drive the binary's speech routes: the
//! clips with their reference transcripts, conversions made with sox, lame and espeak-ng
//! at test time (no audio fixtures in the tree), multipart uploads and KServe binary
//! requests built by hand (the hostile cases need malformed ones, and this crate's
//! reqwest has no multipart feature), and word error rate after normalising case and
//! punctuation: transcripts are judged by their words, never by exact strings.
//!
//! The clips are Debian's `pocketsphinx-testdata` LibriVox readings (with their
//! `transcription` file) and `beckett.wav` from the `useful-moonshine-onnx` wheel in
//! the project's venv. A missing tool or clip fails the test with the command that
//! installs it.
#![allow(dead_code, clippy::unwrap_used)]

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::{json, Value};

const LIBRIVOX: &str = "/usr/share/pocketsphinx/test/data/librivox";
const APT: &str = "apt-get install -y pocketsphinx-testdata sox libsox-fmt-all lame espeak-ng";

/// A recording and what is said in it.
#[derive(Debug, Clone)]
pub struct Clip {
    pub name: String,
    pub path: PathBuf,
    /// The reference transcript.
    pub words: String,
}

impl Clip {
    pub fn bytes(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap_or_else(|e| panic!("{}: {e}", self.path.display()))
    }

    /// The duration sox reads from the file.
    pub fn seconds(&self) -> f64 {
        seconds(&self.path)
    }
}

pub fn beckett() -> Clip {
    let lib = crate::common::repo_root().join(".venv/lib");
    let path = std::fs::read_dir(&lib)
        .ok()
        .and_then(|dirs| {
            dirs.flatten()
                .map(|d| d.path().join("site-packages/moonshine_onnx/assets/beckett.wav"))
                .find(|p| p.exists())
        })
        .unwrap_or_else(|| {
            panic!(
                "beckett.wav is missing under {}: .venv/bin/pip install --no-deps useful-moonshine-onnx==20251121",
                lib.display()
            )
        });
    Clip {
        name: "beckett".into(),
        path,
        words: "Ever tried, ever failed. No matter, try again. Fail again. Fail better.".into(),
    }
}

/// A LibriVox clip by its number (`0870`, `0880`, `0890`, `0920`, `0930`), its words
/// from the test data's own `transcription` file.
pub fn librivox(number: &str) -> Clip {
    let id = format!("sense_and_sensibility_01_austen_64kb-{number}");
    let path = Path::new(LIBRIVOX).join(format!("{id}.wav"));
    let listing = std::fs::read_to_string(Path::new(LIBRIVOX).join("transcription"))
        .unwrap_or_else(|e| panic!("{LIBRIVOX}/transcription: {e}: {APT}"));
    let line = listing
        .lines()
        .find(|l| l.ends_with(&format!("({id})")))
        .unwrap_or_else(|| panic!("no transcript of {id} in {LIBRIVOX}/transcription"));
    let words = line.replace("<s>", "").replace("</s>", "").replace(&format!("({id})"), "");
    assert!(path.exists(), "{} is missing: {APT}", path.display());
    Clip { name: number.into(), path, words: words.trim().to_string() }
}

/// Beckett and the five LibriVox clips: about 35 s of real English.
pub fn all_english() -> Vec<Clip> {
    let mut clips = vec![beckett()];
    clips.extend(["0870", "0880", "0890", "0920", "0930"].map(librivox));
    clips
}

/// A temporary folder removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("snooze-audio-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(tool: &str, args: &[&str]) -> Vec<u8> {
    let out =
        Command::new(tool).args(args).output().unwrap_or_else(|e| panic!("cannot run {tool} ({e}): {APT}"));
    assert!(out.status.success(), "{tool} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

/// `sox ARGS`.
pub fn sox(args: &[&str]) {
    run("sox", args);
}

/// Converts `input` into `output` with sox: `options` before the output file (its
/// format), `effects` after it (`rate`, `channels`, `pad`, `repeat`...).
pub fn convert(input: &Path, output: &Path, options: &[&str], effects: &[&str]) -> PathBuf {
    let mut args = vec![input.to_str().unwrap()];
    args.extend_from_slice(options);
    args.push(output.to_str().unwrap());
    args.extend_from_slice(effects);
    sox(&args);
    output.to_path_buf()
}

/// Encodes a WAV file to MP3 with `lame`, which writes the LAME/Info tag most MP3 files carry.
pub fn lame(input: &Path, output: &Path) -> PathBuf {
    run("lame", &["--quiet", input.to_str().unwrap(), output.to_str().unwrap()]);
    output.to_path_buf()
}

/// `text` spoken by espeak-ng's `voice` at `wpm` words a minute, as 16 kHz mono WAV.
pub fn espeak(voice: &str, wpm: u32, text: &str, output: &Path) -> PathBuf {
    let raw = output.with_extension("espeak.wav");
    run("espeak-ng", &["-v", voice, "-s", &wpm.to_string(), "-w", raw.to_str().unwrap(), text]);
    convert(&raw, output, &[], &["rate", "16000", "channels", "1"])
}

/// Seconds of audio in `path`, as sox counts them.
pub fn seconds(path: &Path) -> f64 {
    let out = run("soxi", &["-D", path.to_str().unwrap()]);
    String::from_utf8_lossy(&out).trim().parse().unwrap()
}

/// The words of `text` in lower case, without punctuation; hyphens split words and
/// the few abbreviations the readings spell out are spelled out.
pub fn words(text: &str) -> Vec<String> {
    text.to_lowercase()
        .replace(['-', '—'], " ")
        .chars()
        .filter(|c| c.is_alphanumeric() || c.is_whitespace() || *c == '\'')
        .collect::<String>()
        .split_whitespace()
        .map(|w| match w {
            "mr" => "mister".to_string(),
            "mrs" => "missus".to_string(),
            other => other.trim_matches('\'').to_string(),
        })
        .filter(|w| !w.is_empty())
        .collect()
}

/// Word error rate of `hypothesis` against `reference`: word edits (substitutions,
/// insertions, deletions) over the reference's words, after [`words`].
pub fn wer(reference: &str, hypothesis: &str) -> f64 {
    let (r, h) = (words(reference), words(hypothesis));
    assert!(!r.is_empty(), "an empty reference");
    let mut row: Vec<usize> = (0..=h.len()).collect();
    for (i, rw) in r.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, hw) in h.iter().enumerate() {
            let substitution = diagonal + usize::from(rw != hw);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[h.len()] as f64 / r.len() as f64
}

/// Fails unless `hypothesis` is within `limit` word error rate of `reference`.
#[track_caller]
pub fn assert_wer(what: &str, reference: &str, hypothesis: &str, limit: f64) {
    let rate = wer(reference, hypothesis);
    assert!(
        rate <= limit,
        "{what}: WER {:.0}% > {:.0}%\n  want: {reference}\n  got:  {hypothesis}",
        rate * 100.0,
        limit * 100.0
    );
}

/// A multipart/form-data body.
pub struct Multipart {
    pub content_type: String,
    pub body: Vec<u8>,
}

/// Long and unlike anything in audio: a file containing it by chance is not a worry.
const BOUNDARY: &str = "snooze-speech-test-7f3a9c2e41d86b05";

/// A form with text `fields` and, when given, a `file` field holding `file` as `filename`.
pub fn form(fields: &[(&str, &str)], file: Option<(&str, &[u8])>) -> Multipart {
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend_from_slice(
            format!("--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n")
                .as_bytes(),
        );
    }
    if let Some((filename, bytes)) = file {
        body.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
                 content-type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    Multipart { content_type: format!("multipart/form-data; boundary={BOUNDARY}"), body }
}

/// What the server answered.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The message of an OpenAI-shaped error.
    pub fn error_message(&self) -> String {
        let v = self.json();
        v["error"]["message"].as_str().unwrap_or_else(|| panic!("no error.message in {v}")).to_string()
    }

    /// A 200 in JSON: its `text`.
    #[track_caller]
    pub fn text(&self) -> String {
        assert_eq!(self.status, 200, "{}", self.body);
        self.json()["text"].as_str().unwrap_or_else(|| panic!("no text in {}", self.body)).to_string()
    }
}

/// POSTs `form` to `route` (`/v1/audio/transcriptions` or `/translations`), with
/// `Authorization: Bearer key` when given.
pub fn post_form(base: &str, route: &str, form: &Multipart, key: Option<&str>) -> Answer {
    let mut request = crate::common::client()
        .post(format!("{base}{route}"))
        .header("content-type", &form.content_type)
        .body(form.body.clone());
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().expect("POST");
    let status = response.status().as_u16();
    let content_type =
        response.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    Answer { status, content_type, body: response.text().expect("body") }
}

/// Transcribes `audio` with `model` and the extra `fields`.
pub fn transcribe(base: &str, model: &str, audio: &[u8], fields: &[(&str, &str)]) -> Answer {
    let mut all = vec![("model", model)];
    all.extend_from_slice(fields);
    post_form(base, "/v1/audio/transcriptions", &form(&all, Some(("audio", audio))), None)
}

/// POSTs `document` to `/v1/ocr` as the multipart `file` named `name`, with `fields`:
/// the status and the JSON answer (`null` if it is not JSON).
pub fn post_ocr(base: &str, document: &[u8], name: &str, fields: &[(&str, &str)]) -> (u16, Value) {
    let answer = post_form(base, "/v1/ocr", &form(fields, Some((name, document))), None);
    (answer.status, serde_json::from_str(&answer.body).unwrap_or(Value::Null))
}

/// A KServe v2 request for `model` with the BYTES input `audio` holding `files`, in the
/// binary extension (audio is not UTF-8, so it cannot travel as JSON strings); the
/// `text` output asked for in binary when `binary_output`. Returns the status and the
/// texts (or the error body as the one element).
pub fn kserve(base: &str, model: &str, files: &[Vec<u8>], binary_output: bool) -> (u16, Vec<String>) {
    let mut tail = Vec::new();
    for f in files {
        tail.extend_from_slice(&(f.len() as u32).to_le_bytes());
        tail.extend_from_slice(f);
    }
    let header = json!({
        "inputs": [{"name": "audio", "datatype": "BYTES", "shape": [files.len()],
                    "parameters": {"binary_data_size": tail.len()}}],
        "outputs": [{"name": "text", "parameters": {"binary_data": binary_output}}],
    })
    .to_string();
    let mut body = header.clone().into_bytes();
    body.extend_from_slice(&tail);
    let response = crate::common::client()
        .post(format!("{base}/v2/models/{model}/infer"))
        .header("content-type", "application/octet-stream")
        .header("inference-header-content-length", header.len().to_string())
        .body(body)
        .send()
        .expect("POST");
    let status = response.status().as_u16();
    let json_length = response
        .headers()
        .get("inference-header-content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let bytes = response.bytes().expect("body");
    if status != 200 {
        return (status, vec![String::from_utf8_lossy(&bytes).to_string()]);
    }
    let (head, tail) = bytes.split_at(json_length.unwrap_or(bytes.len()));
    let head: Value = serde_json::from_slice(head).expect("the response header is JSON");
    let output = &head["outputs"][0];
    assert_eq!(output["name"], "text", "{head}");
    assert_eq!(output["datatype"], "BYTES", "{head}");
    let texts = if binary_output {
        assert!(json_length.is_some(), "binary output asked for, but no Inference-Header-Content-Length");
        assert!(output.get("data").is_none(), "binary output asked for, but the data is JSON: {head}");
        let mut texts = Vec::new();
        let mut rest = tail;
        while rest.len() >= 4 {
            let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
            texts.push(String::from_utf8(rest[4..4 + n].to_vec()).expect("UTF-8 text"));
            rest = &rest[4 + n..];
        }
        assert!(rest.is_empty(), "{} bytes left over in the binary output", rest.len());
        texts
    } else {
        assert!(json_length.is_none() && tail.is_empty(), "JSON output asked for, but a binary tail came");
        output["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|t| t.as_str().expect("a string").into())
            .collect()
    };
    assert_eq!(output["shape"], json!([texts.len()]), "{head}");
    (status, texts)
}

/// The process's resident set and its high-water mark, in bytes, from `/proc`.
pub fn rss_and_peak(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets the high-water mark of `pid`'s resident set (`/proc/PID/clear_refs`, Linux
/// 4.0+), so that [`rss_and_peak`] then reports the peak since now.
pub fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// An upload the server must refuse, and how.
pub struct BadUpload {
    pub what: String,
    pub route: String,
    pub content_type: String,
    pub body: Vec<u8>,
    pub status: u16,
    /// The OpenAI error's `param` (OpenAI routes only).
    pub param: Option<&'static str>,
    /// Words the error message must contain.
    pub contains: &'static str,
}

/// A canonical 16 kHz 16-bit mono WAV header declaring `data_len` bytes of samples.
pub fn wav_header(data_len: u32) -> Vec<u8> {
    let mut h = b"RIFF".to_vec();
    h.extend_from_slice(&36u32.wrapping_add(data_len).to_le_bytes());
    h.extend_from_slice(b"WAVEfmt ");
    for (value, width) in [(16u32, 4), (1, 2), (1, 2), (16_000, 4), (32_000, 4), (2, 2), (16, 2)] {
        h.extend_from_slice(&value.to_le_bytes()[..width]);
    }
    h.extend_from_slice(b"data");
    h.extend_from_slice(&data_len.to_le_bytes());
    h
}

/// The uploads `model` (an English-only Whisper, served beside `mlp-10m`) must refuse
/// with a 4xx naming the problem, on a server whose `max_audio_seconds` is under 25 and
/// `max_request_size` at least 1 MiB. Made from beckett.wav and LibriVox 0870 in `scratch`.
pub fn bad_uploads(model: &str, scratch: &Scratch) -> Vec<BadUpload> {
    let wav = beckett().bytes();
    let mp3 = std::fs::read(lame(&librivox("0880").path, &scratch.path("bad.mp3"))).unwrap();
    // 0870 four times over (28 s) as MP3: under 1 MiB, over max_audio_seconds.
    let long = convert(&librivox("0870").path, &scratch.path("long.mp3"), &[], &["repeat", "3"]);
    let long = std::fs::read(long).unwrap();
    let random: Vec<u8> = (0u32..4096).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    // A LIST chunk declaring 4 GiB before the samples: reading it whole would allocate that.
    let mut list_chunk = wav_header(64)[..36].to_vec();
    list_chunk.extend_from_slice(b"LIST");
    list_chunk.extend_from_slice(&u32::MAX.to_le_bytes());
    list_chunk.extend_from_slice(b"INFOdata");
    list_chunk.extend_from_slice(&wav[44..1068]);

    let transcriptions = "/v1/audio/transcriptions";
    let mut v = Vec::new();
    let mut upload = |what: &str, fields: &[(&str, &str)], file: Option<&[u8]>, status, param, contains| {
        let mut all = vec![("model", model)];
        all.extend_from_slice(fields);
        let f = form(&all, file.map(|b| ("upload", b)));
        v.push(BadUpload {
            what: format!("audio: {what}"),
            route: transcriptions.into(),
            content_type: f.content_type,
            body: f.body,
            status,
            param: Some(param),
            contains,
        });
    };
    let file = Some(wav.as_slice());
    upload(
        "text, not audio",
        &[],
        Some(&b"This is a text file, not a recording.\n".repeat(40)),
        400,
        "file",
        "not audio",
    );
    upload("random bytes", &[], Some(&random), 400, "file", "not audio");
    upload("an empty file", &[], Some(b""), 400, "file", "empty");
    upload("a WAV header and no samples", &[], Some(&wav_header(0)), 400, "file", "no samples");
    upload("a WAV cut inside its header", &[], Some(&wav[..30]), 400, "file", "WAV");
    upload("an MP3 cut before its first frame", &[], Some(&mp3[..100]), 400, "file", "audio");
    upload("a chunk declaring 4 GiB", &[], Some(&list_chunk), 400, "file", "declares 4294967295 bytes");
    upload("longer than max_audio_seconds", &[], Some(&long), 413, "file", "max_audio_seconds");
    upload("no file field", &[], None, 400, "file", "no `file`");
    upload(
        "word timestamps",
        &[("timestamp_granularities[]", "word")],
        file,
        400,
        "timestamp_granularities",
        "word",
    );
    upload(
        "an unknown granularity",
        &[("timestamp_granularities[]", "syllable")],
        file,
        400,
        "timestamp_granularities",
        "syllable",
    );
    upload("an unknown language", &[("language", "xx")], file, 400, "language", "'xx' is not a language");
    upload("French on an English-only model", &[("language", "fr")], file, 400, "language", "English-only");
    upload("temperature above 1", &[("temperature", "1.5")], file, 400, "temperature", "between 0 and 1");
    upload("a negative temperature", &[("temperature", "-0.1")], file, 400, "temperature", "between 0 and 1");
    upload("temperature NaN", &[("temperature", "NaN")], file, 400, "temperature", "between 0 and 1");
    upload("temperature not a number", &[("temperature", "warm")], file, 400, "temperature", "not a number");
    upload(
        "an unknown response_format",
        &[("response_format", "xml")],
        file,
        400,
        "response_format",
        "'xml'",
    );
    upload("streaming", &[("stream", "true")], file, 400, "stream", "stream");
    upload("streaming, as Python writes true", &[("stream", "True")], file, 400, "stream", "stream");
    upload("log probabilities", &[("include[]", "logprobs")], file, 400, "include", "log probabilities");
    upload(
        "timestamp_granularities twice",
        &[("timestamp_granularities", "segment"), ("timestamp_granularities", "segment")],
        file,
        400,
        "timestamp_granularities",
        "more than once",
    );
    upload("the model named twice", &[("model", "whisper-base")], file, 400, "model", "more than once");
    upload("a prompt over 64 KiB", &[("prompt", &"words ".repeat(12_000))], file, 400, "file", "'prompt'");

    let mut form_as = |what: &str, route: &str, fields: &[(&str, &str)], status, param, contains| {
        let f = form(fields, Some(("beckett.wav", wav.as_slice())));
        v.push(BadUpload {
            what: format!("audio: {what}"),
            route: route.into(),
            content_type: f.content_type,
            body: f.body,
            status,
            param,
            contains,
        });
    };
    form_as("no model", transcriptions, &[], 400, Some("model"), "no model");
    form_as("an unknown model", transcriptions, &[("model", "nope")], 404, None, "nope");
    form_as("an empty model", transcriptions, &[("model", "")], 400, Some("model"), "`model` is empty");
    form_as(
        "an unknown language on a translation",
        "/v1/audio/translations",
        &[("model", model), ("language", "xx")],
        400,
        Some("language"),
        "'xx' is not a language",
    );
    form_as(
        "a model that is not a speech model",
        transcriptions,
        &[("model", "mlp-10m")],
        400,
        Some("model"),
        "does not transcribe",
    );
    form_as(
        "a translation on an English-only model",
        "/v1/audio/translations",
        &[("model", model)],
        400,
        Some("model"),
        "English-only",
    );

    let raw = |what: &str, route: &str, content_type: &str, body: &[u8], status, param, contains| BadUpload {
        what: format!("audio: {what}"),
        route: route.into(),
        content_type: content_type.into(),
        body: body.to_vec(),
        status,
        param,
        contains,
    };
    let infer = format!("/v2/models/{model}/infer");
    let bytes_input = |data: &str| {
        format!(r#"{{"inputs":[{{"name":"audio","datatype":"BYTES","shape":[1],"data":[{data}]}}]}}"#)
    };
    v.extend([
        raw(
            "a JSON body, not a form",
            transcriptions,
            "application/json",
            br#"{"model":"x"}"#,
            400,
            Some("file"),
            "multipart/form-data",
        ),
        raw(
            "a form that is not multipart",
            transcriptions,
            "multipart/form-data; boundary=zz",
            b"this is no form",
            400,
            Some("file"),
            "malformed",
        ),
        raw(
            "KServe: text that is not audio",
            &infer,
            "application/json",
            bytes_input("\"hello\"").as_bytes(),
            400,
            None,
            "audio file 0",
        ),
        raw(
            "KServe: FP32 to a speech model",
            &infer,
            "application/json",
            br#"{"inputs":[{"name":"audio","datatype":"FP32","shape":[1],"data":[1.0]}]}"#,
            400,
            None,
            "'audio'",
        ),
        raw(
            "KServe: an empty file",
            &infer,
            "application/json",
            bytes_input("\"\"").as_bytes(),
            400,
            None,
            "empty",
        ),
    ]);
    v
}
