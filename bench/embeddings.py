#!/usr/bin/env python3
"""Embeddings/s: SnoozeML's /v1/embeddings vs sentence-transformers (PyTorch), same machine,
same run, the same all-MiniLM-L6-v2, batches of 1, 8 and 32 short sentences.

Four contenders, one server serving three models (keep_alive -1):

    st        sentence-transformers in this process (torch CPU, its default threads)
    candle    SnoozeML `minilm`           Candle, models/minilm (safetensors)
    ort-fp32  SnoozeML `minilm-onnx`      ONNX Runtime, models/minilm-onnx (onnx/model.onnx)
    ort-int8  SnoozeML `minilm-onnx-int8` ONNX Runtime, models/minilm-onnx-int8

Needs the bench venv (torch is large, so it is kept out of `make test`):

    python3 -m venv bench/.venv && bench/.venv/bin/pip install -r bench/requirements-st.txt
    make prepare && cargo build --release --bin snooze
    bench/.venv/bin/python bench/embeddings.py            # or: make bench-embeddings

Each contender is warmed up first; then, per batch size, timed rounds of each contender
are interleaved (the order rotating every round) so background load hits all of them
alike, and each figure is the median over the rounds. The server's responses are
base64 (the OpenAI SDK's default) and are checked against sentence-transformers' vectors
(minimum cosine over 32 sentences).

Candle runs its matmuls on a rayon pool sized from RAYON_NUM_THREADS (all cores when
unset): `--rayon-threads N` (or SNOOZE_BENCH_RAYON_THREADS=N) starts the server with
RAYON_NUM_THREADS=N, `--rayon-threads unset` without it, to compare thread settings.
ONNX Runtime's pool is the server's own (`intra_op_threads`), not affected by it.
"""

import argparse
import base64
import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
MODEL = os.path.join(MODELS, "minilm")
BINARY = os.environ.get("SNOOZE_BIN") or os.path.join(ROOT, "target", "release", "snooze")
SENTENCES = [
    "The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "How do I reset my password?",
    "Memory is the scarce resource on this machine.", "Embeddings map text to vectors.",
    "Paris is the capital of France.", "The weather is nice today.", "Rust has no garbage collector.",
]

# name -> (served model name, folder, extra TOML lines); "st" runs in-process.
SERVED = {
    "candle": ("minilm", "minilm", 'backend = "candle"\n'),
    "ort-fp32": ("minilm-onnx", "minilm-onnx", ""),
    "ort-int8": ("minilm-onnx-int8", "minilm-onnx-int8", ""),
}
CONTENDERS = ["st", *SERVED]


def batch(n):
    return [SENTENCES[i % len(SENTENCES)] + f" #{i}" for i in range(n)]


# --- the server (bench/ocr.py uses these too) ----------------------------------------------

def ort_dylib():
    """ORT_DYLIB_PATH as the Makefile sets it: libonnxruntime from .venv's onnxruntime wheel."""
    if os.environ.get("ORT_DYLIB_PATH"):
        return os.environ["ORT_DYLIB_PATH"]
    found = sorted(glob.glob(os.path.join(ROOT, ".venv", "lib", "python3*", "site-packages", "onnxruntime",
                                          "capi", "libonnxruntime.so.1*")))
    return found[0] if found else None


def start_server(config, env=None):
    """Start target/release/snooze on `config` (TOML text) on a free port; returns (proc,
    base URL). `env`: variables to set (value None: removed) on top of this process's."""
    if not os.path.exists(BINARY):
        sys.exit(f"{BINARY} missing: cargo build --release --bin snooze")
    tmp = tempfile.mkdtemp(prefix="snooze-bench-")
    cfg = os.path.join(tmp, "snooze.toml")
    with open(cfg, "w") as f:
        f.write(config)
    full_env = dict(os.environ, NO_COLOR="1")
    if ort_dylib():
        full_env["ORT_DYLIB_PATH"] = ort_dylib()
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    # SNOOZE_BENCH_SERVER_ARGS: more `snooze serve` flags (e.g. "--intra-op-spinning true").
    extra = os.environ.get("SNOOZE_BENCH_SERVER_ARGS", "").split()
    proc = subprocess.Popen([BINARY, "serve", *extra, "--config", cfg, "--http-address", "127.0.0.1:0", "--grpc-address", "off",
                             "--state-dir", os.path.join(tmp, "state")],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=full_env)
    found = threading.Event()
    addr = {}
    tail = []

    def pump():
        for line in proc.stderr:
            tail.append(line)
            del tail[:-40]
            m = re.search(r"listening on http://(\S+)", line)
            if m and not found.is_set():
                addr["a"] = m.group(1)
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(60):
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit("server did not start:\n" + "".join(tail))
    proc.stderr_tail = tail
    # Its config and state dir (the models' converted copies: ~100 MiB for the OCR
    # stages) go with it: `stop_server` removes them.
    proc.workdir = tmp
    return proc, "http://" + addr["a"]


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(getattr(proc, "workdir", ""), ignore_errors=True)


def proc_cpu_seconds(pid):
    """user + system CPU seconds of process `pid` (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def system_cpu_seconds():
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, steal / tick


class Background:
    """CPU the rest of the machine used while the bench ran: machine-wide busy CPU minus
    this process's and the server's (`pids`), in cores, averaged over the span."""

    def __init__(self, pids):
        self.pids = [p for p in pids if p]
        self.t0, self.mine0 = time.perf_counter(), self._mine()
        self.sys0, self.steal0 = system_cpu_seconds()

    def _mine(self):
        total = 0.0
        for p in self.pids:
            try:
                total += proc_cpu_seconds(p)
            except OSError:
                pass
        return total

    def report(self):
        wall = time.perf_counter() - self.t0
        busy, steal = system_cpu_seconds()
        others = (busy - self.sys0 - (self._mine() - self.mine0)) / wall
        return (f"other processes used {max(others, 0.0):.2f} cores (steal {(steal - self.steal0) / wall:.2f}) "
                f"over the {wall:.0f} s timed")


def status_bytes(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak(pid):
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakSampler:
    """The highest VmRSS of `pid`, sampled every 50 ms while running."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, status_bytes(self.pid, "VmRSS"))
            self.stop.wait(0.05)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return max(self.peak, status_bytes(self.pid, "VmRSS"))


def machine_info():
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.1f} GiB RAM"
    except (OSError, StopIteration):
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"machine: {os.cpu_count()} cores ({usable} usable), {model}{mem}; {platform.system()} "
            f"{platform.release()}; Python {platform.python_version()}")


def loadavg():
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


def interleaved(fns, round_seconds, rounds):
    """`fns`: name -> (call, items per call, cpu-seconds function). Each is warmed up,
    then `rounds` rounds time each for `round_seconds`, the order rotating by one every
    round. Returns name -> (median items/s, median CPU cores used, every round's items/s)."""
    for call, _, _ in fns.values():
        call()
    names = list(fns)
    rates = {n: [] for n in names}
    cores = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call, items, cpu = fns[name]
            n, c0, start = 0, cpu(), time.perf_counter()
            while True:
                call()
                n += items
                elapsed = time.perf_counter() - start
                if elapsed >= round_seconds:
                    break
            rates[name].append(n / elapsed)
            cores[name].append((cpu() - c0) / elapsed)
    return {n: (statistics.median(rates[n]), statistics.median(cores[n]), rates[n]) for n in names}


# --- /v1/embeddings --------------------------------------------------------------------------

def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def embed(base, model, texts):
    """The server's vectors for `texts` (base64 responses), as an [n, dim] float32 array."""
    import numpy as np

    resp = post(base + "/v1/embeddings", {"model": model, "input": texts, "encoding_format": "base64"})
    data = sorted(resp["data"], key=lambda d: d["index"])
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])


def contenders(ap, value, known):
    """The comma-separated `--contenders` value as a list, each one of `known`."""
    chosen = [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in chosen if c not in known]
    if bad or not chosen:
        ap.error(f"unknown contender(s) {bad}; choose from {known}")
    return chosen


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rayon-threads", default=os.environ.get("SNOOZE_BENCH_RAYON_THREADS"),
                    help="start the server with RAYON_NUM_THREADS=N (Candle's pool); 'unset' removes it "
                         "(default: SNOOZE_BENCH_RAYON_THREADS, else the environment's RAYON_NUM_THREADS, if any)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes (default 1,8,32)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per contender and batch (default 7)")
    ap.add_argument("--round-seconds", type=float, default=1.0, help="length of one timed round (default 1.0)")
    args = ap.parse_args(argv)
    args.contenders = contenders(ap, args.contenders, CONTENDERS)
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    served = [c for c in args.contenders if c in SERVED]
    for c in served:
        folder = os.path.join(MODELS, SERVED[c][1])
        if not os.path.isdir(folder):
            sys.exit(f"{folder} missing (contender {c}): make prepare")
    t_begin = time.perf_counter()

    rayon = args.rayon_threads
    if rayon is None or rayon == "":
        inherited = os.environ.get("RAYON_NUM_THREADS")
        rayon_env = {}
        rayon_desc = f"{inherited} (inherited)" if inherited else f"unset (rayon's default: {os.cpu_count()} threads)"
    elif rayon.lower() in ("unset", "none", "default"):
        rayon_env = {"RAYON_NUM_THREADS": None}
        rayon_desc = f"unset (rayon's default: {os.cpu_count()} threads)"
    else:
        rayon_env = {"RAYON_NUM_THREADS": str(int(rayon))}
        rayon_desc = str(int(rayon))

    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in the output
    st = SentenceTransformer(MODEL, device="cpu")
    config = "".join(f'[models.{SERVED[c][0]}]\n{SERVED[c][2]}path = "{os.path.join(MODELS, SERVED[c][1])}"\n'
                     f'keep_alive = "-1"\n\n' for c in served)
    proc = base = None
    if served:
        proc, base = start_server(config, rayon_env)
    try:
        print(machine_info())
        print(f"torch {torch.__version__} threads={torch.get_num_threads()} interop={torch.get_num_interop_threads()}; "
              f"sentence-transformers {sentence_transformers.__version__}")
        if served:
            print(f"server: {os.path.relpath(BINARY, ROOT)}, RAYON_NUM_THREADS={rayon_desc}; "
                  f"ORT_DYLIB_PATH={os.path.basename(ort_dylib() or 'unset')}")
        print(f"{args.rounds} interleaved rounds of {args.round_seconds:g} s per contender and batch, "
              f"medians; base64 responses; {loadavg()}")

        # Load every model (the first request loads it) and check the vectors.
        t0 = time.perf_counter()
        for c in served:
            embed(base, SERVED[c][0], ["warm up"])
        if served:
            print(f"models loaded in {time.perf_counter() - t0:.1f} s")
        texts = batch(32)
        ref = st.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True).astype(np.float64)
        for c in served:
            got = embed(base, SERVED[c][0], texts).astype(np.float64)
            one = np.stack([embed(base, SERVED[c][0], [t])[0] for t in texts[:8]]).astype(np.float64)
            cos = np.sum(got * ref, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
            cos1 = np.sum(one * ref[:8], axis=1) / (np.linalg.norm(one, axis=1) * np.linalg.norm(ref[:8], axis=1))
            print(f"cosine vs sentence-transformers, {c:<8} ({SERVED[c][0]}): min {cos.min():.6f} over 32 "
                  f"(batch 32), min {cos1.min():.6f} over 8 (batch 1); max |diff| {np.abs(got - ref).max():.2e}")

        me = os.getpid()
        background = Background([me, proc.pid if proc else None])
        results = {}
        for n in args.batches:
            texts = batch(n)
            fns = {}
            for c in args.contenders:
                if c == "st":
                    fns[c] = (lambda t=texts, n=n: st.encode(t, batch_size=n, normalize_embeddings=True), n,
                              lambda: proc_cpu_seconds(me))
                else:
                    body = {"model": SERVED[c][0], "input": texts, "encoding_format": "base64"}
                    fns[c] = (lambda b=body: post(base + "/v1/embeddings", b), n,
                              lambda: proc_cpu_seconds(proc.pid))
            results[n] = interleaved(fns, args.round_seconds, args.rounds)

        cols = args.contenders
        head = f"{'batch':>5} " + " ".join(f"{c + '/s':>11}" for c in cols)
        others = [c for c in cols if c != "st"]
        if "st" in cols:
            head += "  " + " ".join(f"{c + ' vs st':>15}" for c in others)
        print()
        print(head)
        for n in args.batches:
            row = f"{n:>5} " + " ".join(f"{results[n][c][0]:>11.1f}" for c in cols)
            if "st" in cols:
                row += "  " + " ".join(f"{results[n][c][0] / results[n]['st'][0]:>14.2f}x" for c in others)
            print(row)
        print()
        print("CPU cores used while timed (st: this process; the others: the server process)")
        print(f"{'batch':>5} " + " ".join(f"{c:>11}" for c in cols))
        for n in args.batches:
            print(f"{n:>5} " + " ".join(f"{results[n][c][1]:>11.2f}" for c in cols))
        print(f"\n{background.report()}; {loadavg()}; total {time.perf_counter() - t_begin:.0f} s")
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    main()
