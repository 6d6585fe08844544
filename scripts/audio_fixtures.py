"""Writes tests/fixtures/audio/: LibriVox clip 0880 (pocketsphinx-testdata, public domain)
in the containers and codecs no Debian tool of `make system-packages` writes —
M4A/AAC, M4A/ALAC, WebM/Opus (a browser's MediaRecorder, voice alone and with a camera's
video), OGG/Opus (a voice note) and MP4/Opus (Chrome's `audio/mp4` MediaRecorder, ffmpeg).

Needs PyAV (`pip install av==18.1.0` in a scratch venv; not a dependency of the project,
whose tests read the files committed):

    /tmp/av-venv/bin/python scripts/audio_fixtures.py
"""

import os
import sys
import wave

import av
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIP = "/usr/share/pocketsphinx/test/data/librivox/sense_and_sensibility_01_austen_64kb-0880.wav"
OUT = os.path.join(ROOT, "tests", "fixtures", "audio")


def encode(samples, rate, path, container, codec, sample_fmt, bit_rate=None):
    with av.open(path, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        if bit_rate:
            stream.bit_rate = bit_rate
        frame_size = 1024
        for start in range(0, len(samples), frame_size):
            chunk = samples[start:start + frame_size]
            frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = rate
            frame.pts = start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


def camera_webm(samples, path):
    """What a browser records from a camera and a microphone: a VP8 video track first,
    then the voice as stereo Opus at 48 kHz."""
    with av.open(path, "w", format="webm") as out:
        video = out.add_stream("libvpx", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = out.add_stream("libopus", rate=48000, layout="stereo")
        for i in range(30):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 8, dtype=np.uint8), format="rgb24")
            frame.pts = i
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
        # 16 kHz to 48 kHz by repetition: crude, but the voice's words are all there.
        stereo = np.stack([np.repeat(samples, 3)] * 2)
        for start in range(0, stereo.shape[1], 960):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(stereo[:, start:start + 960]),
                                               format="s16p", layout="stereo")
            frame.sample_rate, frame.pts = 48000, start
            for packet in audio.encode(frame):
                out.mux(packet)
        for packet in audio.encode(None):
            out.mux(packet)


def main():
    with wave.open(CLIP) as w:
        rate = w.getframerate()
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy()
    os.makedirs(OUT, exist_ok=True)
    encode(samples, rate, os.path.join(OUT, "0880_aac.m4a"), "ipod", "aac", "fltp", 64000)
    encode(samples, rate, os.path.join(OUT, "0880_alac.m4a"), "ipod", "alac", "s16p")
    encode(samples, rate, os.path.join(OUT, "0880_opus.webm"), "webm", "libopus", "s16", 24000)
    encode(samples, rate, os.path.join(OUT, "0880_opus.ogg"), "ogg", "libopus", "s16", 24000)
    encode(samples, rate, os.path.join(OUT, "0880_opus.mp4"), "mp4", "libopus", "s16", 24000)
    camera_webm(samples, os.path.join(OUT, "0880_camera.webm"))
    for name in sorted(os.listdir(OUT)):
        print(name, os.path.getsize(os.path.join(OUT, name)))


if __name__ == "__main__":
    main()
