#!/usr/bin/env python3
"""faster-whisper's greedy decoding in numpy over the ONNX graphs of export_whisper.py, and
the check of those graphs against the fixture of scripts/whisper_fixture.py.

The logit rules are CTranslate2's, in its order (SuppressTokens, SuppressTokensBegin,
ApplyTimestampRules): the suppress list at every step; a blank and end-of-text at the
first; with timestamps, <|notimestamps|> never, a first timestamp of at most 1 s,
timestamps in pairs (text after a pair, a timestamp or the end after a lone one, a lone
first timestamp counting as a pair), never decreasing, and forced whenever their summed
probability beats every text token. Tokens are scored by the log-softmax of the processed
logits; avg_logprob is the sum over (tokens + 1), end-of-text included, as faster-whisper
recovers it; no_speech_prob is the softmax of the raw logits at <|startoftranscript|>.

All windows decode as ONE batch: prompts of different lengths padded (padding rows attend
to their first token), then one decoder step at a time for the unfinished rows, each with
its own cache length under one attention mask — the contract the Rust loop relies on.
"""

import base64
import json
import os
import re
import time

import numpy as np

MASKED = -1e9
INT8_MAX_WER = 0.10


def log(msg: str) -> None:
    print(f"export_whisper: {msg}", flush=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def pick(logits: np.ndarray, generated: list, desc: dict, timestamps: bool) -> tuple:
    """The greedy choice after faster-whisper's (CTranslate2's) logit rules: (token, log-prob)."""
    t = desc["tokens"]
    begin, end, eot = t["timestamp_begin"], t["timestamp_end"], t["eot"]
    logits = logits.astype(np.float32).copy()
    logits[desc["suppress_tokens"]] = -np.inf
    if not generated:
        logits[desc["suppress_blank"]] = -np.inf
    if timestamps:
        logits[t["no_timestamps"]] = -np.inf
        check = False
        if not generated:
            logits[:begin] = -np.inf
            logits[begin + 50 + 1:end + 1] = -np.inf  # max_initial_timestamp 1.0 s / 0.02 s
        else:
            last = generated[-1]
            penultimate = generated[-2] if len(generated) >= 2 else last
            if last >= begin and penultimate >= begin:
                logits[begin:] = -np.inf  # a pair is closed: text next
            elif last >= begin:
                logits[:eot] = -np.inf  # an opening timestamp: text cannot follow it directly
                check = True
            else:
                check = True
            previous = [tok for tok in generated if tok >= begin]
            if previous:
                logits[begin:previous[-1]] = -np.inf  # timestamps never decrease
        if check:
            lp = log_softmax(logits)
            if np.logaddexp.reduce(lp[begin:]) > lp[:begin].max():
                logits[:begin] = -np.inf
    lp = log_softmax(logits)
    token = int(np.argmax(lp))
    return token, float(lp[token])


def stack_past(caches, layer: int, which: int, width: int, d: dict) -> np.ndarray:
    out = np.zeros((len(caches), d["n_heads"], width, d["head_dim"]), np.float32)
    for b, cache in enumerate(caches):
        kv = cache[layer][which]
        out[b, :, :kv.shape[1]] = kv
    return out


def decode_windows(encoder, decoder, desc: dict, mels: list, windows: list) -> list:
    """Greedy decoding of windows [(index in mels, prompt, timestamps)], all as one batch;
    mels are [n_mels, 3000] each, encoded once."""
    d, t = desc, desc["tokens"]
    n_layers, batch = d["decoder_layers"], len(windows)
    encoded = dict(zip([o.name for o in encoder.get_outputs()], encoder.run(None, {"mel": np.stack(mels)})))
    cross = {name: value[[w[0] for w in windows]] for name, value in encoded.items()}
    empty = np.zeros((batch, d["n_heads"], 0, d["head_dim"]), np.float32)
    caches = [[[None, None] for _ in range(n_layers)] for _ in range(batch)]

    def run(rows, tokens, positions, mask, logit_positions, past_width):
        feeds = {"tokens": tokens, "positions": positions, "attention_mask": mask, "logit_positions": logit_positions}
        for i in range(n_layers):
            for which, name in ((0, "k"), (1, "v")):
                feeds[f"past_{name}_{i}"] = (stack_past([caches[r] for r in rows], i, which, past_width, d)
                                             if past_width else empty[:len(rows)])
                feeds[f"cross_{name}_{i}"] = cross[f"cross_{name}_{i}"][rows]
        names = [o.name for o in decoder.get_outputs()]
        return dict(zip(names, decoder.run(None, feeds)))

    # The prompts, padded to the longest: padding rows attend to their first token only.
    lengths = [len(w[1]) for w in windows]
    n = max(lengths)
    tokens = np.full((batch, n), t["eot"], np.int64)
    mask = np.full((batch, n, n), MASKED, np.float32)
    for b, (_, prompt, _) in enumerate(windows):
        tokens[b, :len(prompt)] = prompt
        mask[b][np.tril(np.ones((n, n), bool))] = 0
        mask[b, len(prompt):, :] = MASKED
        mask[b, len(prompt):, 0] = 0
    positions = np.tile(np.arange(n, dtype=np.int64), (batch, 1))
    sot = [w[1].index(t["sot"]) for w in windows]
    logit_positions = np.array([[s, length - 1] for s, length in zip(sot, lengths)], np.int64)
    out = run(list(range(batch)), tokens, positions, mask, logit_positions, 0)
    results = []
    for b, (_, prompt, timestamps) in enumerate(windows):
        for i in range(n_layers):
            caches[b][i] = [out[f"new_k_{i}"][b, :, :lengths[b]], out[f"new_v_{i}"][b, :, :lengths[b]]]
        probs = np.exp(log_softmax(out["logits"][b, 0].astype(np.float64)))
        token, lp = pick(out["logits"][b, 1], [], desc, timestamps)
        limit = min(d["n_text_ctx"] // 2, d["n_text_ctx"] - (lengths[b] - 1))
        results.append({"tokens": [token], "sum_logprob": lp, "no_speech_prob": float(probs[t["no_speech"]]),
                        "done": token == t["eot"] or limit == 1, "limit": limit})
    while True:
        rows = [b for b in range(batch) if not results[b]["done"]]
        if not rows:
            break
        past = [caches[b][0][0].shape[1] for b in rows]
        width = max(past)
        mask = np.full((len(rows), 1, width + 1), MASKED, np.float32)
        for j, p in enumerate(past):
            mask[j, 0, :p] = 0
            mask[j, 0, width] = 0
        tokens = np.array([[results[b]["tokens"][-1]] for b in rows], np.int64)
        positions = np.array([[p] for p in past], np.int64)
        out = run(rows, tokens, positions, mask, np.zeros((len(rows), 1), np.int64), width)
        for j, b in enumerate(rows):
            for i in range(n_layers):
                for which, name in ((0, "k"), (1, "v")):
                    caches[b][i][which] = np.concatenate([caches[b][i][which], out[f"new_{name}_{i}"][j]], axis=1)
            r = results[b]
            token, lp = pick(out["logits"][j, 0], r["tokens"], desc, windows[b][2])
            r["tokens"].append(token)
            r["sum_logprob"] += lp
            r["done"] = token == t["eot"] or len(r["tokens"]) >= r["limit"]
    for r in results:
        if r["tokens"][-1] == t["eot"]:
            r["tokens"].pop()
        r["avg_logprob"] = r["sum_logprob"] / (len(r["tokens"]) + 1)
    return results


def detect_languages(encoder, decoder, desc: dict, mels: list) -> list:
    d, t = desc, desc["tokens"]
    batch = len(mels)
    cross = dict(zip([o.name for o in encoder.get_outputs()], encoder.run(None, {"mel": np.stack(mels)})))
    feeds = {"tokens": np.full((batch, 1), t["sot"], np.int64), "positions": np.zeros((batch, 1), np.int64),
             "attention_mask": np.zeros((batch, 1, 1), np.float32), "logit_positions": np.zeros((batch, 1), np.int64)}
    for i in range(d["decoder_layers"]):
        for name in ("k", "v"):
            feeds[f"past_{name}_{i}"] = np.zeros((batch, d["n_heads"], 0, d["head_dim"]), np.float32)
            feeds[f"cross_{name}_{i}"] = cross[f"cross_{name}_{i}"]
    logits = decoder.run(["logits"], feeds)[0][:, 0]
    ids = [lang["token"] for lang in desc["languages"]]
    out = []
    for row in logits:
        probs = np.exp(log_softmax(row[ids].astype(np.float64)))
        best = int(np.argmax(probs))
        out.append((desc["languages"][best]["code"], float(probs[best])))
    return out


def words(text: str) -> list:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def edit_distance(a: list, b: list) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def fixture_mels(fixture_path: str, mel_path: str, names: list, n_mels: int) -> dict:
    with open(mel_path) as f:
        stored = json.load(f)["clips"]
    mels = {}
    for name in names:
        clip = stored[name]
        mel = np.frombuffer(base64.b64decode(clip["mel"]), dtype="<f2").astype(np.float32)
        mel = mel.reshape(n_mels, clip["frames"])
        window = np.zeros((n_mels, 3000), np.float32)
        content = min(3000, clip["frames"] - 1)  # faster-whisper drops the last frame
        window[:, :content] = mel[:, :content]
        mels[name] = window
    return mels


def check(name: str, folder: str, desc: dict, fixture: dict, mels: dict, threads: int, exact: bool) -> bool:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    encoder = ort.InferenceSession(os.path.join(folder, "encoder.onnx"), options, providers=["CPUExecutionProvider"])
    decoder = ort.InferenceSession(os.path.join(folder, "decoder.onnx"), options, providers=["CPUExecutionProvider"])
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    clips = list(fixture["clips"])
    ok = True
    if desc["multilingual"]:
        for clip, (lang, prob) in zip(clips, detect_languages(encoder, decoder, desc, [mels[c] for c in clips])):
            want, want_p = fixture["clips"][clip]["language"], fixture["clips"][clip]["language_probability"]
            good = lang == want and (abs(prob - want_p) < 0.01 or not exact)
            ok &= good
            if not good:
                log(f"{name}: {clip}: language {lang} ({prob:.4f}), faster-whisper {want} ({want_p:.4f})")
    windows, refs = [], []
    for index, clip in enumerate(clips):
        for mode, timestamps in (("no_timestamps", False), ("timestamps", True)):
            ref = fixture["clips"][clip]["greedy"][mode]
            windows.append((index, ref["prompt"], timestamps))
            refs.append((clip, mode, ref))
    t0 = time.time()
    results = decode_windows(encoder, decoder, desc, [mels[c] for c in clips], windows)
    same, errors, total = 0, 0, 0
    for (clip, mode, ref), got in zip(refs, results):
        text = tokenizer.decode([tok for tok in got["tokens"] if tok < desc["tokens"]["eot"]])
        errors += edit_distance(words(ref["text"]), words(text))
        total += len(words(ref["text"]))
        if got["tokens"] == ref["tokens"]:
            same += 1
            if abs(got["avg_logprob"] - ref["avg_logprob"]) > 1e-3 or abs(got["no_speech_prob"] - ref["no_speech_prob"]) > 1e-3:
                log(f"{name}: {clip} ({mode}): avg_logprob {got['avg_logprob']:.5f} vs {ref['avg_logprob']:.5f}, "
                    f"no_speech {got['no_speech_prob']:.5f} vs {ref['no_speech_prob']:.5f}")
                ok &= not exact
        else:
            first = next((i for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"])) if a != b),
                         min(len(got["tokens"]), len(ref["tokens"])))
            log(f"{name}: {clip} ({mode}): tokens differ from faster-whisper's at #{first}: {text!r}")
    wer = errors / max(total, 1)
    if exact:
        ok &= same == len(refs)
        log(f"{name}: {same}/{len(refs)} windows give faster-whisper's token ids exactly (word error rate "
            f"{wer:.3f}; {len(refs)} windows as one batch in {time.time() - t0:.1f}s): {'ok' if ok else 'FAILED'}")
    else:
        ok &= wer <= INT8_MAX_WER
        log(f"{name}: word error rate vs faster-whisper {wer:.3f} over {total} words (need <= {INT8_MAX_WER}); "
            f"{same}/{len(refs)} windows token-identical: {'ok' if ok else 'FAILED'}")
    return ok
