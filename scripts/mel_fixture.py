"""Reference log-mel features from faster-whisper 1.2.1, for crates/speech/tests/mel_reference.rs.

faster-whisper's FeatureExtractor is the definition the Rust `mel` module must match. This
script runs it on beckett.wav (decoded by faster-whisper's own ffmpeg path) for 80 and 128
mel bands and on a few synthetic clips of awkward lengths (shorter than the reflected margin,
one hop, a window and a bit), and writes what the test needs to check every frame without
committing megabytes: whole frames at chosen positions, the mean of every frame, the mean
of every band, and the global peak.

    python3 -m venv bench/.venv && bench/.venv/bin/pip install -r bench/requirements-speech.txt
    .venv/bin/pip install --no-deps useful-moonshine-onnx==20251121   # ships beckett.wav
    bench/.venv/bin/python scripts/mel_fixture.py --out tests/fixtures/mel_beckett.json
"""

import argparse
import glob
import json
import os

import numpy as np
from faster_whisper.audio import decode_audio
from faster_whisper.feature_extractor import FeatureExtractor


def beckett_path():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = glob.glob(os.path.join(here, ".venv/lib/python3*/site-packages/moonshine_onnx/assets/beckett.wav"))
    if not found:
        raise SystemExit("beckett.wav not found: pip install --no-deps useful-moonshine-onnx==20251121 into .venv")
    return found[0]


def rounded(values):
    """Six decimals: far below the 1e-4 the test allows, half the bytes of full floats."""
    return np.round(np.asarray(values, dtype=np.float64), 6).tolist()


def summary(features, frames):
    """What the Rust test compares: chosen whole frames, per-frame and per-band means."""
    n_frames = features.shape[1]
    return {
        "n_mels": int(features.shape[0]),
        "n_frames": int(n_frames),
        "frames": {str(t): rounded(features[:, t]) for t in frames if t < n_frames},
        "frame_means": rounded(features.mean(axis=0, dtype=np.float64)),
        "band_means": rounded(features.mean(axis=1, dtype=np.float64)),
    }


def log10_peak(extractor, audio):
    """The peak faster-whisper normalises by, recomputed the way __call__ does."""
    waveform = np.pad(audio.astype(np.float32), (0, 160))
    window = np.hanning(400 + 1)[:-1].astype("float32")
    stft = extractor.stft(waveform, 400, 160, window=window, return_complex=True).astype("complex64")
    power = np.abs(stft[..., :-1]) ** 2
    mel = extractor.mel_filters @ power
    return float(np.log10(np.clip(mel, a_min=1e-10, a_max=None)).max())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    audio = decode_audio(beckett_path(), sampling_rate=16000)
    out = {"source": "faster-whisper 1.2.1 FeatureExtractor, beckett.wav", "samples": int(audio.shape[0])}
    for n_mels in (80, 128):
        extractor = FeatureExtractor(feature_size=n_mels)
        features = extractor(audio)
        n_frames = features.shape[1]
        picks = [0, 1, 2, 3] + list(range(50, n_frames - 3, 97)) + [n_frames - 3, n_frames - 2, n_frames - 1]
        entry = summary(features, picks)
        entry["peak"] = log10_peak(extractor, audio)
        out[f"beckett_{n_mels}"] = entry

    # Short synthetic clips: the reflection at the start, numpy's repeated reflection
    # when the clip is shorter than the 200-sample margin, and the last frames.
    extractor = FeatureExtractor(feature_size=80)
    clips = {}
    for length in (1, 7, 40, 41, 100, 199, 200, 201, 359, 360, 361, 1000, 4321):
        t = np.arange(length, dtype=np.float64)
        clip = (0.3 * np.sin(2 * np.pi * 440 * t / 16000) + 0.1 * np.sin(2 * np.pi * 3100 * t / 16000 + 1.0))
        clip = clip.astype(np.float32)
        features = extractor(clip)
        clips[str(length)] = {"n_frames": int(features.shape[1]), "values": rounded(features.T.ravel())}
    out["synthetic_80"] = {"formula": "0.3 sin(2 pi 440 t / 16000) + 0.1 sin(2 pi 3100 t / 16000 + 1), f32", "clips": clips}

    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out}: {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
