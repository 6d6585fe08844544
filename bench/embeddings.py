#!/usr/bin/env python3
"""Embeddings/s: SnoozeML's /v1/embeddings (Candle) vs sentence-transformers (PyTorch),
same machine, same run, same model folder, batches of 1, 8 and 32 short sentences.

Needs the bench venv (torch is large, so it is kept out of `make test`):

    python3 -m venv bench/.venv && bench/.venv/bin/pip install -r bench/requirements-st.txt
    make prepare && cargo build --release --bin snooze
    bench/.venv/bin/python bench/embeddings.py            # or: make bench-embeddings

Both sides use every core (torch's default threads; Candle's rayon pool), the server
is warmed up first, and each figure is the median of several timed rounds.
"""

import json
import os
import re
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
MODEL = os.path.join(ROOT, "models", "minilm")
BINARY = os.path.join(ROOT, "target", "release", "snooze")
SENTENCES = [
    "The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "How do I reset my password?",
    "Memory is the scarce resource on this machine.", "Embeddings map text to vectors.",
    "Paris is the capital of France.", "The weather is nice today.", "Rust has no garbage collector.",
]


def batch(n):
    return [SENTENCES[i % len(SENTENCES)] + f" #{i}" for i in range(n)]


def start_server():
    tmp = tempfile.mkdtemp(prefix="snooze-bench-")
    cfg = os.path.join(tmp, "snooze.toml")
    with open(cfg, "w") as f:
        f.write(f'[models.minilm]\nbackend = "candle"\npath = "{MODEL}"\nkeep_alive = "-1"\n')
    proc = subprocess.Popen([BINARY, "serve", "--config", cfg, "--http-address", "127.0.0.1:0", "--grpc-address", "off",
                             "--state-dir", os.path.join(tmp, "state")],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, NO_COLOR="1"))
    found = threading.Event()
    addr = {}

    def pump():
        for line in proc.stderr:
            m = re.search(r"listening on http://(\S+)", line)
            if m and not found.is_set():
                addr["a"] = m.group(1)
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(30):
        proc.kill()
        sys.exit("server did not start")
    return proc, "http://" + addr["a"]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def measure(fn, items, seconds=3.0, rounds=5):
    fn()  # warm-up
    rates = []
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / rounds:
            fn()
            n += items
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def main():
    if not os.path.exists(BINARY):
        sys.exit(f"{BINARY} missing: cargo build --release --bin snooze")
    from sentence_transformers import SentenceTransformer
    import torch

    st = SentenceTransformer(MODEL, device="cpu")
    proc, base = start_server()
    try:
        post(base + "/v1/embeddings", {"model": "minilm", "input": "warm up"})
        print(f"machine: {os.cpu_count()} cores; torch {torch.__version__} threads={torch.get_num_threads()}")
        print(f"{'batch':>6} {'sentence-transformers/s':>24} {'snooze/s':>10} {'ratio':>7}")
        for n in (1, 8, 32):
            texts = batch(n)
            ref = measure(lambda: st.encode(texts, batch_size=n, normalize_embeddings=True), n)
            ours = measure(lambda: post(base + "/v1/embeddings",
                                        {"model": "minilm", "input": texts, "encoding_format": "base64"}), n)
            print(f"{n:>6} {ref:>24.1f} {ours:>10.1f} {ours / ref:>6.2f}x")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
