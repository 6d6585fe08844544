"""Speech through the official clients against the real binary: the `openai` SDK's
`audio.transcriptions` and `audio.translations` in every response format (its parsed
objects checked against the SDK's own types), its errors for a bad upload and a missing
API key, and Triton's `tritonclient.http` and `tritonclient.grpc` sending audio files
as a BYTES tensor. Real recordings (LibriVox, Beckett), an espeak-ng sentence for the
multilingual model; transcripts are judged by word error rate, never exact strings."""

import importlib.util
import os
import re
import subprocess
import tempfile
import unittest

import numpy as np
import openai
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from openai.types.audio import Transcription, TranscriptionVerbose, Translation, TranslationVerbose
from tritonclient.utils import InferenceServerException

from server import MODELS, Server

TINY = "whisper-tiny-en"
BASE = "whisper-base"
KEY = "k1"

CONFIG = f"""
[models.{TINY}]
path = "{MODELS}/whisper-tiny-en"
[models.{BASE}]
path = "{MODELS}/whisper-base"
"""

LIBRIVOX = "/usr/share/pocketsphinx/test/data/librivox"
APT = "apt-get install -y pocketsphinx-testdata sox espeak-ng"


def beckett():
    """beckett.wav from the useful-moonshine-onnx wheel, found without importing it."""
    spec = importlib.util.find_spec("moonshine_onnx")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("moonshine_onnx is missing: .venv/bin/pip install --no-deps useful-moonshine-onnx==20251121")
    path = os.path.join(spec.submodule_search_locations[0], "assets", "beckett.wav")
    return path, "Ever tried, ever failed. No matter, try again. Fail again. Fail better."


def librivox(number):
    name = f"sense_and_sensibility_01_austen_64kb-{number}"
    with open(os.path.join(LIBRIVOX, "transcription")) as f:
        line = next(l for l in f if l.rstrip().endswith(f"({name})"))
    words = line.replace("<s>", "").replace("</s>", "").replace(f"({name})", "").strip()
    return os.path.join(LIBRIVOX, name + ".wav"), words


def words(text):
    """Lower case, no punctuation, hyphens split, `Mr.` spelled out as the readings say it."""
    text = re.sub(r"[-\u2014]", " ", text.lower())
    text = re.sub(r"[^\w\s']", "", text)
    out = [w.strip("'") for w in text.split()]
    return ["mister" if w == "mr" else w for w in out if w]


def wer(reference, hypothesis):
    r, h = words(reference), words(hypothesis)
    row = list(range(len(h) + 1))
    for i, rw in enumerate(r):
        diagonal, row[0] = row[0], i + 1
        for j, hw in enumerate(h):
            diagonal, row[j + 1] = row[j + 1], min(diagonal + (rw != hw), row[j] + 1, row[j + 1] + 1)
    return row[len(h)] / len(r)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def timestamp(stamp, decimal):
    m = re.fullmatch(r"(\d\d):(\d\d):(\d\d)" + re.escape(decimal) + r"(\d\d\d)", stamp)
    if not m:
        raise AssertionError(f"{stamp!r} is not HH:MM:SS{decimal}mmm")
    h, mi, s, ms = map(int, m.groups())
    return h * 3600 + mi * 60 + s + ms / 1000


def cues(body, numbered):
    """(start, end, text) of each cue of an SRT (`numbered`) or VTT body."""
    out = []
    for i, block in enumerate(body.strip().split("\n\n")):
        lines = block.split("\n")
        if numbered:
            assert lines.pop(0) == str(i + 1), f"cue {i} is misnumbered: {body!r}"
        start, end = lines[0].split(" --> ")
        decimal = "," if numbered else "."
        out.append((timestamp(start, decimal), timestamp(end, decimal), " ".join(lines[1:])))
    return out


class SpeechSdkTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server.for_class(cls, CONFIG)
        cls.client = openai.OpenAI(base_url=cls.server.base + "/v1", api_key="unused", max_retries=0)
        cls.addClassCleanup(cls.client.close)

    def transcribe(self, path, **kwargs):
        with open(path, "rb") as f:
            return self.client.audio.transcriptions.create(model=TINY, file=f, **kwargs)

    def assertWer(self, reference, hypothesis, limit, what):
        rate = wer(reference, hypothesis)
        self.assertLessEqual(rate, limit, f"{what}: WER {rate:.0%}\n  want: {reference}\n  got:  {hypothesis}")

    def test_every_response_format(self):
        for path, reference in (beckett(), librivox("0870"), librivox("0920")):
            what = os.path.basename(path)
            default = self.transcribe(path)
            self.assertIsInstance(default, Transcription)
            self.assertWer(reference, default.text, 0.10, what)
            self.assertEqual(self.transcribe(path, response_format="json").text, default.text)
            # What SDK users often send: English named on an English-only model.
            self.assertEqual(self.transcribe(path, language="en").text, default.text, what)

            text = self.transcribe(path, response_format="text")
            self.assertIsInstance(text, str)
            self.assertEqual(text.strip(), default.text, what)

            verbose = self.transcribe(path, response_format="verbose_json", timestamp_granularities=["segment"])
            self.assertIsInstance(verbose, TranscriptionVerbose)
            # The SDK builds its objects without validation: validating again checks every field's type.
            TranscriptionVerbose.model_validate(verbose.model_dump())
            self.assertEqual(verbose.text, default.text, what)
            self.assertEqual(verbose.language, "english", what)
            seconds = float(subprocess.run(["soxi", "-D", path], capture_output=True, text=True, check=True).stdout)
            self.assertAlmostEqual(verbose.duration, seconds, delta=0.05, msg=what)
            self.assertEqual((verbose.usage.type, verbose.usage.seconds), ("duration", verbose.duration))
            self.assertTrue(verbose.segments, what)
            previous = 0.0
            for i, segment in enumerate(verbose.segments):
                self.assertEqual(segment.id, i)
                self.assertLessEqual(previous, segment.start, f"{what}: segment {i} goes back in time")
                self.assertLess(segment.start, segment.end, f"{what}: segment {i}")
                self.assertLessEqual(segment.end, verbose.duration, f"{what}: segment {i}")
                self.assertTrue(segment.tokens, f"{what}: segment {i}")
                previous = segment.start
            self.assertEqual("".join(s.text for s in verbose.segments).strip(), verbose.text)

            for fmt in ("srt", "vtt"):
                body = self.transcribe(path, response_format=fmt)
                self.assertIsInstance(body, str)
                if fmt == "vtt":
                    self.assertTrue(body.startswith("WEBVTT\n\n"), body)
                    body = body[len("WEBVTT\n\n"):]
                got = cues(body, numbered=fmt == "srt")
                self.assertEqual(len(got), len(verbose.segments), f"{what} {fmt}: one cue per segment")
                for (start, end, cue), segment in zip(got, verbose.segments):
                    self.assertAlmostEqual(start, segment.start, delta=0.0005)
                    self.assertAlmostEqual(end, segment.end, delta=0.0005)
                    self.assertEqual(cue, segment.text.strip())

    def test_translation_with_the_multilingual_model(self):
        text = "Buenos días. Hoy vamos a hablar de la historia de España y de sus ciudades."
        with tempfile.TemporaryDirectory(prefix="snooze-py-speech-") as tmp:
            raw, wav = os.path.join(tmp, "es-22k.wav"), os.path.join(tmp, "es.wav")
            # espeak-ng's Spanish at 140 wpm is what whisper-base recognises reliably.
            subprocess.run(["espeak-ng", "-v", "es", "-s", "140", "-w", raw, text], check=True)
            subprocess.run(["sox", raw, wav, "rate", "16000"], check=True)
            with open(wav, "rb") as f:
                spanish = self.client.audio.transcriptions.create(model=BASE, file=f, response_format="verbose_json")
            self.assertEqual(spanish.language, "spanish", spanish.text)
            self.assertWer(text, spanish.text, 0.35, "Spanish")
            with open(wav, "rb") as f:
                english = self.client.audio.translations.create(model=BASE, file=f)
            self.assertIsInstance(english, Translation)
            with open(wav, "rb") as f:
                verbose = self.client.audio.translations.create(model=BASE, file=f, response_format="verbose_json")
        TranslationVerbose.model_validate(verbose.model_dump())
        self.assertEqual(verbose.language, "english")
        self.assertEqual(verbose.text, english.text)
        said = set(words(english.text))
        # whisper-base's English for it varies ("the story of the Spanish..."): the meaning, not the words.
        meanings = ({"today"}, {"talk", "speak"}, {"history", "story"}, {"spain", "spanish"}, {"cities", "city"})
        found = [m for m in meanings if m & said]
        self.assertGreaterEqual(len(found), 3, english.text)
        self.assertFalse(said & {"hoy", "vamos", "hablar", "historia", "ciudades"}, english.text)

    def test_a_bad_upload_is_a_bad_request_naming_it(self):
        with self.assertRaises(openai.BadRequestError) as caught:
            self.client.audio.transcriptions.create(model=TINY, file=("notes.wav", b"not a recording at all" * 20))
        self.assertEqual(caught.exception.status_code, 400)
        self.assertIn("not audio", caught.exception.message)
        self.assertEqual(caught.exception.param, "file")
        with self.assertRaises(openai.BadRequestError) as caught:
            self.client.audio.translations.create(model=TINY, file=("beckett.wav", read(beckett()[0])))
        self.assertIn("English-only", caught.exception.message)
        with self.assertRaises(openai.NotFoundError):
            self.client.audio.transcriptions.create(model="nope", file=("beckett.wav", read(beckett()[0])))


class SpeechApiKeyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server.for_class(cls, CONFIG, "--api-keys", KEY)

    def client(self, key):
        client = openai.OpenAI(base_url=self.server.base + "/v1", api_key=key, max_retries=0)
        self.addCleanup(client.close)
        return client

    def test_the_key_is_passed_through(self):
        path, reference = beckett()
        with open(path, "rb") as f:
            got = self.client(KEY).audio.transcriptions.create(model=TINY, file=f)
        self.assertLessEqual(wer(reference, got.text), 0.10, got.text)
        with self.assertRaises(openai.AuthenticationError) as caught:
            self.client("wrong").audio.transcriptions.create(model=TINY, file=("b.wav", read(path)))
        self.assertEqual(caught.exception.status_code, 401)
        self.assertIn("API key", caught.exception.message)


class SpeechTritonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server.for_class(cls, CONFIG)
        cls.http = httpclient.InferenceServerClient(cls.server.addr)
        cls.addClassCleanup(cls.http.close)
        cls.grpc = grpcclient.InferenceServerClient(cls.server.grpc)
        cls.addClassCleanup(cls.grpc.close)

    def infer(self, files, client, module, binary):
        tensor = module.InferInput("audio", [len(files)], "BYTES")
        data = np.array(files, dtype=np.object_)
        if module is httpclient:
            tensor.set_data_from_numpy(data, binary_data=True)
            outputs = [httpclient.InferRequestedOutput("text", binary_data=binary)]
        else:
            tensor.set_data_from_numpy(data)
            outputs = [grpcclient.InferRequestedOutput("text")]
        result = client.infer(TINY, [tensor], outputs=outputs)
        return [t.decode() if isinstance(t, bytes) else t for t in result.as_numpy("text").reshape(-1)]

    def test_bytes_audio_in_text_out(self):
        clips = [beckett(), librivox("0890"), librivox("0930")]
        files = [read(path) for path, _ in clips]
        for client, module, binary, what in (
            (self.http, httpclient, True, "http, binary output"),
            (self.http, httpclient, False, "http, JSON output"),
            (self.grpc, grpcclient, True, "grpc"),
        ):
            texts = self.infer(files, client, module, binary)
            self.assertEqual(len(texts), 3, what)
            for text, (path, reference) in zip(texts, clips):
                self.assertLessEqual(wer(reference, text), 0.10, f"{what} {os.path.basename(path)}: {text}")
            self.assertEqual(self.infer(files[:1], client, module, binary), texts[:1], f"{what}: alone")

    def test_a_file_that_is_not_audio_is_refused(self):
        for client, module in ((self.http, httpclient), (self.grpc, grpcclient)):
            with self.assertRaises(InferenceServerException) as caught:
                self.infer([read(beckett()[0]), b"plain text"], client, module, True)
            self.assertIn("audio file 1", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
