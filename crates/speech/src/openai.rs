//! A transcription request as OpenAI's API asks for it (`/v1/audio/transcriptions` and
//! `/translations`): its options checked against the model, the upload checked and
//! opened as a stream of log-mel windows behind a [`Transcription`] job, and the job's
//! result as the transcript the API answers with. Engine- and transport-neutral: the
//! server's handlers only parse their wire format around these.

use bytes::Bytes;

use crate::{
    audio::{self, AudioError, AudioInfo, AudioLimits, AudioStream},
    format::{self, Transcript},
    languages,
    mel::LogMelWindows,
    whisper::{Task, Transcription, TranscriptionOptions, TranscriptionResult, WhisperConfig},
};

/// What a request asked, before it is checked against the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Request {
    /// A code (`en`) or a name (`english`); `None`: detected (multilingual models).
    pub language: Option<String>,
    /// Text that comes before the audio (names, spellings, style).
    pub prompt: Option<String>,
    /// 0: greedy, raised by Whisper's fallback rules while an attempt fails them; above 0:
    /// sampled from there, raised the same way.
    pub temperature: f32,
    pub task: Task,
}

/// The job's options for `request` on the model `config` describes; an error is a
/// sentence naming the field (`language`, `temperature`) that the model cannot take.
pub fn options(
    config: &WhisperConfig,
    request: &Request,
) -> Result<TranscriptionOptions, (&'static str, String)> {
    let t = request.temperature;
    if !(0.0..=1.0).contains(&t) || t.is_nan() {
        return Err(("temperature", format!("temperature {t} is not between 0 and 1")));
    }
    let language = match request.language.as_deref().map(str::trim).filter(|l| !l.is_empty()) {
        None => None,
        Some(given) => {
            let code = languages::code(given)
                .ok_or_else(|| ("language", format!("'{given}' is not a language Whisper knows")))?;
            if !config.transcribes(code) {
                let why = if config.multilingual {
                    let known: Vec<&str> = config.languages.iter().map(|l| l.code.as_str()).collect();
                    format!("'{given}' is not one of this model's languages ({})", known.join(", "))
                } else {
                    format!("this model is English-only: it cannot transcribe '{given}' (use a multilingual model)")
                };
                return Err(("language", why));
            }
            Some(code.to_string())
        }
    };
    if request.task == Task::Translate && !config.multilingual {
        return Err((
            "model",
            "this model is English-only: it cannot translate (use a multilingual model)".into(),
        ));
    }
    // OpenAI's temperature 0 is faster-whisper's fallback ladder from 0; a higher one
    // starts the ladder there.
    let mut temperatures = vec![t];
    let mut next = t + 0.2;
    while next <= 1.0 + 1e-6 {
        temperatures.push(next.min(1.0));
        next += 0.2;
    }
    Ok(TranscriptionOptions {
        language,
        task: request.task,
        initial_prompt: request.prompt.clone().filter(|p| !p.trim().is_empty()),
        temperatures,
        ..TranscriptionOptions::default()
    })
}

/// Opens an upload for transcription: decodes it once, counting (never trusting a
/// header) and refusing what is not audio or longer than `limits` allow, then returns
/// the job that streams it window by window. Decodes the whole file: call it where
/// blocking is fine.
pub fn open(
    bytes: Bytes,
    limits: &AudioLimits,
    config: &WhisperConfig,
    options: TranscriptionOptions,
) -> Result<(Transcription, AudioInfo), AudioError> {
    let info = audio::probe(bytes.clone(), limits)?;
    let peak = info.log_mel_peaks.get(config.n_mels).ok_or_else(|| {
        AudioError::Internal(format!("no log-mel features for a model of {} mel bands", config.n_mels))
    })?;
    let stream = AudioStream::open(bytes, limits)?;
    let windows = LogMelWindows::new(stream, config.n_mels, peak);
    Ok((Transcription::new(Box::new(windows), info.duration_seconds(), options), info))
}

/// The job's result as OpenAI answers it: the language by name (`english`; always
/// `english` for a translation), the segments with their decoding figures (their times
/// within the audio: [`Transcript::from_segments`]).
pub fn transcript(result: &TranscriptionResult, task: Task) -> Transcript {
    let language = match task {
        Task::Translate => "english".to_string(),
        Task::Transcribe => languages::name(&result.language).to_string(),
    };
    let segments = result
        .segments
        .iter()
        .map(|s| format::Segment {
            // Whisper numbers segments from 1, OpenAI's API from 0.
            id: u32::try_from(s.id.saturating_sub(1)).unwrap_or(u32::MAX),
            seek: s.seek,
            start: s.start,
            end: s.end,
            text: s.text.clone(),
            tokens: s.tokens.clone(),
            temperature: s.temperature,
            avg_logprob: s.avg_logprob as f32,
            compression_ratio: s.compression_ratio as f32,
            no_speech_prob: s.no_speech_prob as f32,
        })
        .collect();
    Transcript::from_segments(task, language, result.duration, segments)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::whisper::{tiny_en, Language};

    fn asking(language: &str) -> Request {
        Request { language: Some(language.into()), ..Request::default() }
    }

    #[test]
    fn an_english_only_model_takes_english_by_code_or_name_and_refuses_other_languages() {
        let config = tiny_en();
        for english in ["en", "English", " EN "] {
            let options = options(&config, &asking(english)).unwrap();
            assert_eq!(options.language.as_deref(), Some("en"), "asked {english:?}");
        }
        let (field, message) = options(&config, &asking("fr")).unwrap_err();
        assert_eq!(field, "language");
        assert!(message.contains("English-only"), "{message}");
        assert_eq!(options(&config, &Request::default()).unwrap().language, None);
    }

    #[test]
    fn a_multilingual_model_takes_the_languages_it_lists_only() {
        let mut config = tiny_en();
        config.multilingual = true;
        config.languages =
            vec![Language { code: "en".into(), token: 50259 }, Language { code: "fr".into(), token: 50265 }];
        assert_eq!(options(&config, &asking("french")).unwrap().language.as_deref(), Some("fr"));
        let (field, message) = options(&config, &asking("de")).unwrap_err();
        assert_eq!(field, "language");
        assert!(message.contains("not one of this model's languages (en, fr)"), "{message}");
        assert!(!message.contains("English-only"), "{message}");
        assert_eq!(options(&config, &asking("klingon")).unwrap_err().0, "language");
    }

    #[test]
    fn segment_times_stay_within_the_audio() {
        use crate::whisper::Segment;
        let segment = |id, start, end| Segment {
            id,
            seek: 0,
            start,
            end,
            text: format!(" segment {id}"),
            tokens: vec![1],
            temperature: 0.0,
            avg_logprob: -0.2,
            compression_ratio: 1.2,
            no_speech_prob: 0.01,
        };
        // beckett.wav: 9.963 s of audio, its last segment's timestamp at 10.0 s.
        let result = TranscriptionResult {
            language: "en".into(),
            duration: 9.963,
            segments: vec![segment(1, 0.0, 4.0), segment(2, 8.0, 10.0), segment(3, 10.0, 12.0)],
            ..TranscriptionResult::default()
        };
        let times: Vec<(f64, f64)> =
            transcript(&result, Task::Transcribe).segments.iter().map(|s| (s.start, s.end)).collect();
        assert_eq!(times, [(0.0, 4.0), (8.0, 9.963), (9.963, 9.963)]);
    }
}
