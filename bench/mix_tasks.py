"""The tasks of bench/mix.py — what each sends, how its answers are checked, its arrival
process — and the figures made from what was sent and answered (goodput, percentiles,
latencies split by whether a transcription or an OCR page was in flight)."""

import base64
import glob
import json
import os
import random
import subprocess
import sys
import uuid
import zlib

import numpy as np

from embeddings import MODELS, ROOT

# --- the tasks -------------------------------------------------------------------------------

SITE = (sorted(glob.glob(os.path.join(ROOT, ".venv", "lib", "python3*", "site-packages"))) or [""])[0]
BECKETT = os.path.join(SITE, "moonshine_onnx", "assets", "beckett.wav")
LIBRIVOX = "/usr/share/pocketsphinx/test/data/librivox/sense_and_sensibility_01_austen_64kb-{}.wav"
# Clips of 5-30 s: originals and sox concatenations (0.5 s of silence between parts).
CLIPS = [["0890"], ["0870"], ["beckett"], ["0880", "0930", "0890"], ["beckett", "0920"],
         ["0870", "0880", "0890", "0920", "0930"], ["beckett", "0870", "0920", "0880"]]
PAGES = ["color.png", "columns.png", "fonts.png", "fonts_jpeg.jpg", "rotated.png", "upside_down.png", "small.png"]
WORDS = ("memory budget model load evict queue request answer page audio text vector batch thread core "
         "server client latency idle resident swap weights cache").split()
# name -> (rate per second, heavy: its requests define "in flight" for fairness, p99 target while heavy run)
RATES = {"transcribe": 0.2, "ocr": 0.3, "embed-fp32": 2.5, "embed-int8": 2.5, "mlp-10m": 20.0, "mlp-100m": 2.0}
LIGHT_TARGETS = {"mlp-10m": 0.050, "embed-fp32": 0.250, "embed-int8": 0.250}


class Request:
    """One prepared HTTP POST and how to check its 200 answer (None: fine, else the problem)."""

    def __init__(self, path, body, content_type, check):
        self.path, self.body, self.content_type, self.check = path, body, content_type, check


class Task:
    """A stream of requests: `make(rng)` draws the next one; `warmup` are sent before timing."""

    def __init__(self, name, rate, describe, make, warmup):
        self.name, self.rate, self.describe, self.make, self.warmup = name, rate, describe, make, warmup
        self.heavy = name in ("transcribe", "ocr")
        self.light_target = LIGHT_TARGETS.get(name)

    @staticmethod
    def schedule(tasks, seconds, seed):
        """Every task's Poisson arrivals over [0, seconds), merged: (t, task, request)."""
        out = []
        for task in tasks:
            rng = random.Random(seed ^ zlib.crc32(task.name.encode()))
            t = rng.expovariate(task.rate)
            while t < seconds:
                out.append((t, task, task.make(rng)))
                t += rng.expovariate(task.rate)
        return sorted(out, key=lambda x: x[0])


def multipart(fields, filename, data):
    boundary = "mix-" + uuid.uuid4().hex
    head = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                    for k, v in fields.items())
    head += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
             "Content-Type: application/octet-stream\r\n\r\n").encode()
    return head + data + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def check_json(test):
    def check(body):
        try:
            return test(json.loads(body))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return f"unreadable answer ({e}): {body[:200]!r}"
    return check


def sox(*args):
    try:
        subprocess.run(["sox", *args], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit("sox is missing: apt-get install sox (make test installs it)")
    except subprocess.CalledProcessError as e:
        sys.exit(f"sox {' '.join(args)} failed: {e.stderr.strip()}")


def clip_files(workdir):
    """[(path, seconds)] of CLIPS, concatenations made in `workdir`."""
    sources = {"beckett": BECKETT, **{n: LIBRIVOX.format(n) for p in CLIPS for n in p if n != "beckett"}}
    for path in sources.values():
        if not os.path.isfile(path):
            sys.exit(f"{path} missing: make prepare (beckett.wav) / apt-get install pocketsphinx-testdata")
    gap = os.path.join(workdir, "gap.wav")
    sox("-n", "-r", "16000", "-c", "1", "-b", "16", gap, "trim", "0", "0.5")
    out = []
    for parts in CLIPS:
        path = sources[parts[0]]
        if len(parts) > 1:
            path = os.path.join(workdir, "-".join(parts) + ".wav")
            sox(*[x for p in parts for x in (sources[p], gap)][:-1], path)
        seconds = float(subprocess.run(["soxi", "-D", path], capture_output=True, text=True, check=True).stdout)
        out.append((path, seconds))
    return out


def kserve_request(model):
    """x FP32 [1,256]: the first row of the model's reference.json, checked against its y."""
    with open(os.path.join(MODELS, model, "reference.json")) as f:
        ref = json.load(f)
    x = np.asarray(ref["input"]["x"], dtype=np.float32).reshape(ref["shape"])[0]
    y = np.asarray(ref["output"]["y"], dtype=np.float32).reshape(ref["shape"][0], -1)[0]
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                   "data": x.tolist()}]}).encode()

    def test(answer):
        got = np.asarray(answer["outputs"][0]["data"], dtype=np.float32)
        if got.shape != y.shape or np.max(np.abs(got - y)) > 1e-4:
            return f"{model}: output differs from reference.json"
        return None

    return Request(f"/v2/models/{model}/infer", body, "application/json", check_json(test))


def embed_request(model, n):
    texts = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 10)) for i in range(n)]
    body = json.dumps({"model": model, "input": texts, "encoding_format": "base64"}).encode()

    def test(answer):
        data = answer["data"]
        if len(data) != n or any(len(base64.b64decode(d["embedding"])) != 384 * 4 for d in data):
            return f"{model}: {len(data)} vectors for {n} texts, or not 384 floats each"
        return None

    return Request("/v1/embeddings", body, "application/json", check_json(test))


def build_tasks(workdir, rates, k_big, scale=1.0):
    """The six tasks at their rates (`rates` overrides RATES, then all times `scale`); a task
    at 0 is left out."""
    unknown = set(rates) - set(RATES)
    if unknown:
        sys.exit(f"unknown task(s) {sorted(unknown)}; the tasks are {', '.join(RATES)}")
    rate = {k: v * scale for k, v in dict(RATES, **rates).items()}
    tasks = []

    clips = clip_files(workdir)
    speech = []
    for path, _ in clips:
        with open(path, "rb") as f:
            body, ctype = multipart({"model": "whisper-tiny-en", "response_format": "json"},
                                    os.path.basename(path), f.read())
        speech.append(Request("/v1/audio/transcriptions", body, ctype,
                              check_json(lambda a: None if a["text"].strip() else "empty transcription")))
    longest = max(range(len(clips)), key=lambda i: clips[i][1])
    tasks.append(Task("transcribe", rate["transcribe"],
                      f"whisper-tiny-en, one of {len(clips)} clips of {min(s for _, s in clips):.1f}-"
                      f"{max(s for _, s in clips):.1f} s (mean {sum(s for _, s in clips) / len(clips):.1f} s)",
                      lambda rng: rng.choice(speech), [speech[longest]]))

    pages = []
    for name in PAGES:
        with open(os.path.join(ROOT, "tests", "fixtures", "ocr_pages", name), "rb") as f:
            body, ctype = multipart({}, name, f.read())
        pages.append(Request("/v1/ocr", body, ctype,
                             check_json(lambda a: None if a["pages"][0]["lines"] else "no line read")))
    tasks.append(Task("ocr", rate["ocr"], f"POST /v1/ocr, one of {len(pages)} pages (tests/fixtures/ocr_pages)",
                      lambda rng: rng.choice(pages), pages))

    for task, model in (("embed-fp32", "minilm-onnx"), ("embed-int8", "minilm-onnx-int8")):
        bodies = [embed_request(model, n) for n in range(1, 33)]
        tasks.append(Task(task, rate[task], f"{model}, 1-32 texts (uniform) of 6-15 words",
                          lambda rng, b=bodies: rng.choice(b), [bodies[-1]]))

    small = kserve_request("mlp-10m")
    tasks.append(Task("mlp-10m", rate["mlp-10m"], "KServe v2 JSON, x FP32 [1,256]", lambda rng: small, [small]))
    big = [kserve_request(f"mlp-100m-{i}") for i in range(1, k_big + 1)]
    tasks.append(Task("mlp-100m", rate["mlp-100m"], f"KServe v2 JSON, x FP32 [1,256], mlp-100m-1..{k_big} uniform",
                      lambda rng: rng.choice(big), big))
    return [t for t in tasks if t.rate > 0]


# --- figures ---------------------------------------------------------------------------------

def percentile(values, q):
    """Nearest-rank percentile of `values` (seconds); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(np.ceil(q / 100 * len(ordered))) - 1))]


def summarise(records, schedule, tasks, seconds):
    """Per task: requests, ok, goodput (ok / the span from the start to the later of
    `seconds` and its last answer), errors by status, p50 / p99 / max latency of the ok."""
    out = {}
    for task in tasks:
        mine = [r for r in records if r[0] == task.name]
        ok = [r[3] - r[1] for r in mine if r[4] == 200 and r[5] is None]
        errors = {}
        for r in mine:
            if r[4] != 200 or r[5] is not None:
                key = str(r[4]) if r[4] not in (None, 200) else ("wrong" if r[4] == 200 else "transport")
                errors[key] = errors.get(key, 0) + 1
        requests = sum(1 for s in schedule if s[1] is task)
        if requests > len(mine):
            errors["unfinished"] = requests - len(mine)
        span = max([seconds] + [r[3] for r in mine])
        out[task.name] = {"requests": requests, "ok": len(ok), "goodput": len(ok) / span, "errors": errors,
                          "p50": percentile(ok, 50), "p99": percentile(ok, 99), "max": max(ok, default=None)}
    return out


def heavy_intervals(records, tasks):
    heavy = {t.name for t in tasks if t.heavy}
    return [(r[1], r[3]) for r in records if r[0] in heavy]


def fairness(records, name, heavy):
    """Latencies of `name`'s ok requests split by whether a heavy request was in flight
    (scheduled, not yet answered) at any time during theirs: (during, quiet)."""
    during, quiet = [], []
    for r in records:
        if r[0] != name or r[4] != 200 or r[5] is not None:
            continue
        busy = any(start < r[3] and end > r[1] for start, end in heavy)
        (during if busy else quiet).append(r[3] - r[1])
    return during, quiet
