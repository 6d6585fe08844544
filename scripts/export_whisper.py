#!/usr/bin/env python3
"""Export a CTranslate2 Whisper model to two ONNX graphs (encoder, decoder step), without torch.

    export_whisper.py --src DIR [--src DIR2 ...] --out models/whisper-tiny-en \\
        --fixture tests/fixtures/whisper_tiny_en.json [--int8] [--force]

SRC is a CTranslate2 Whisper folder (faster-whisper's format: model.bin, config.json,
tokenizer.json, vocabulary.txt). A model.bin split as model.bin.part1, .part2, ... over
several --src folders is read as the parts joined in order; the other files are taken from
the first folder that has them.

model.bin (spec version 6): u32 version, u16-length name, u32 revision, u32 variable count;
per variable a u16-length name, u8 rank, u32 dims, u8 dtype (0 f32, 1 i8, 2 i16, 3 i32,
4 f16, 5 bf16), u32 byte count, data; then u32 alias count and (alias, target) name pairs
(decoder/projection/weight -> decoder/embeddings/weight). Whisper's layers map as
self_attention/linear_0 = q,k,v stacked [3D, D]; attention/linear_0 = cross q, linear_1 =
cross k,v stacked [2D, D] (the k bias is 0); linear_1 (self) / linear_2 (cross) = out
projection; ffn/linear_0, linear_1; pre-norm layer norms (eps 1e-5); exact (erf) GELU.

OUT receives (each written to a temporary name, then renamed):

  encoder.onnx  mel float32 [batch, n_mels, frames] (frames even, normally 3000; the
                positional table is sliced to frames/2) -> cross_k_{i}, cross_v_{i} float32
                [batch, heads, frames/2, head_dim] for every decoder layer i: the decoder's
                cross-attention keys and values, so a decoder step never recomputes them.
  decoder.onnx  one step over n_new tokens per sequence:
                  tokens int64 [batch, n_new], positions int64 [batch, n_new],
                  attention_mask float32 [batch, n_new, n_past + n_new] (additive: 0 attends,
                    -1e9 does not; the first n_past columns are the past, the rest the new
                    tokens; rows of padding must still attend somewhere),
                  logit_positions int64 [batch, n_logits]: the indices in [0, n_new) whose
                    logits are wanted (the last token of a step; also the <|startoftranscript|>
                    of a prompt, for the no-speech probability),
                  past_k_{i}, past_v_{i} float32 [batch, heads, n_past, head_dim] (n_past may
                    be 0; columns a sequence does not use are masked),
                  cross_k_{i}, cross_v_{i} float32 [batch, heads, frames/2, head_dim]
                -> logits float32 [batch, n_logits, vocab], new_k_{i}, new_v_{i} float32
                [batch, heads, n_new, head_dim]: only the new tokens' keys and values, which
                the host appends to its cache.
                Attention over the past and over the new tokens is two MatMuls whose scores
                are joined before one softmax: the past is never copied inside the graph
                (a Concat of past and new keys would copy the whole cache every step).
                Logits only at logit_positions: a 200-token prompt would otherwise cost
                200 x vocab x width multiply-adds for one row that is used. The token
                lookup reads a float16 copy of the embedding table (exact: the source is
                float16) so the float32 table serves only the output projection (Gemm
                transB), whose prepacked form then replaces it in memory.
  whisper.json  what the server needs: sizes, special token ids (read from tokenizer.json),
                languages and their token ids (config.json lang_ids), faster-whisper's
                default suppress list (its non_speech_tokens plus the task/sot/no-speech
                tokens), the begin-suppress list (config.json suppress_ids_begin), alignment
                heads, and the graph files.
  tokenizer.json, config.json, vocabulary.txt   symlinks to the source's.
  int8/         with --int8: encoder.onnx and decoder.onnx quantized by
                onnxruntime.quantization.quantize_dynamic (QUInt8 MatMul weights per channel),
                the same whisper.json and links. Unsigned weights: with signed ones, ONNX
                Runtime's u8 x s8 kernel on x86 CPUs without VNNI (AVX2 only) sums pairs of
                products in 16 bits and saturates; whisper-base then read 18.6% of the
                check's words differently from faster-whisper (French garbled), 11.5% with
                reduce_range (7-bit weights), 8.0% with u8 x u8 (no saturation).

Check (every run, also when nothing is rebuilt): the fixture written by
scripts/whisper_fixture.py holds faster-whisper's (CTranslate2, fp32) greedy token ids for
one window of real clips, without and with timestamps, decoded from a log-mel stored in
tests/fixtures/whisper_mel.json. A small numpy loop with faster-whisper's logit rules
(suppress lists, suppress-blank, timestamp pairs, non-decreasing timestamps, initial
timestamp <= 1 s, the timestamp-probability rule) decodes the same windows through the ONNX
graphs, all clips as ONE batch of sequences with different prompt lengths (so the masks and
positions of the contract are exercised), and must give: fp32, the same token ids on every
window; int8, a word error rate against faster-whisper's text of at most 10% over all
windows (whisper_reference.py holds the loop and the check). Multilingual models must also detect each clip's language. A failed check exits
1 and removes the graphs it judged.

Graphs newer than this script and the source are not rebuilt, only checked (--force rebuilds).
"""

import argparse
import json
import os
import re
import struct
import sys
import time
from typing import NoReturn

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from whisper_reference import check, fixture_mels

OPSET = 17
LN_EPS = 1e-5
CT2_DTYPES = {0: "<f4", 1: "i1", 2: "<i2", 3: "<i4", 4: "<f2"}
LINKED = ("tokenizer.json", "config.json", "vocabulary.txt")


def log(msg: str) -> None:
    print(f"export_whisper: {msg}", flush=True)


def fail(msg: str) -> NoReturn:
    print(f"export_whisper: FAILED: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


# --------------------------------------------------------------------------------------
# Source


def source_files(srcs: list) -> tuple:
    """(model.bin parts in order, {name: path} of the side files)."""
    parts, side = [], {}
    for src in srcs:
        for name in sorted(os.listdir(src)):
            path = os.path.realpath(os.path.join(src, name))
            if name == "model.bin":
                parts.append((0, path))
            elif name.startswith("model.bin.part") and name[len("model.bin.part"):].isdigit():
                parts.append((int(name[len("model.bin.part"):]), path))
            elif name in LINKED + ("preprocessor_config.json",):
                side.setdefault(name, path)
    if not parts:
        fail(f"no model.bin (nor model.bin.partN) in {', '.join(srcs)}")
    if len(parts) > 1 and any(n == 0 for n, _ in parts):
        fail("found both model.bin and model.bin.partN files: give one layout")
    for name in ("config.json", "tokenizer.json"):
        if name not in side:
            fail(f"{name} not found in {', '.join(srcs)}")
    return [p for _, p in sorted(parts)], side


def read_ct2(parts: list) -> dict:
    """Every variable of a CTranslate2 model.bin as a numpy array (floats as float32)."""
    data = b"".join(open(p, "rb").read() for p in parts)
    pos = 0

    def take(fmt):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value[0]

    def string():
        nonlocal pos
        n = take("H")
        s = data[pos:pos + n].rstrip(b"\0").decode()
        pos += n
        return s

    version = take("I")
    if version != 6:
        fail(f"model.bin has CTranslate2 spec version {version}; this script reads version 6")
    spec = string()
    take("I")  # revision
    if spec != "WhisperSpec":
        fail(f"model.bin holds a {spec}, not a WhisperSpec")
    variables = {}
    for _ in range(take("I")):
        name = string()
        shape = [take("I") for _ in range(take("B"))]
        dtype = take("B")
        nbytes = take("I")
        if dtype not in CT2_DTYPES:
            fail(f"variable {name}: unsupported dtype code {dtype}")
        array = np.frombuffer(data, dtype=CT2_DTYPES[dtype], count=nbytes // np.dtype(CT2_DTYPES[dtype]).itemsize,
                              offset=pos).reshape(shape)
        pos += nbytes
        variables[name] = array.astype(np.float32) if array.dtype.kind == "f" else array.copy()
    for _ in range(take("I")):
        alias, target = string(), string()
        variables[alias] = variables[target]
    if pos != len(data):
        fail(f"model.bin: {len(data) - pos} bytes left after the variables and aliases")
    return variables


def dims(v: dict) -> dict:
    count = lambda side: len({m.group(1) for k in v for m in [re.match(side + r"/layer_(\d+)/", k)] if m})
    d = {
        "n_mels": int(v["encoder/conv1/weight"].shape[1]),
        "d_model": int(v["encoder/conv1/weight"].shape[0]),
        "n_heads": int(v["encoder/num_heads"]),
        "encoder_layers": count("encoder"),
        "decoder_layers": count("decoder"),
        "vocab_size": int(v["decoder/embeddings/weight"].shape[0]),
        "n_audio_ctx": int(v["encoder/position_encodings/encodings"].shape[0]),
        "n_text_ctx": int(v["decoder/position_encodings/encodings"].shape[0]),
    }
    d["head_dim"] = d["d_model"] // d["n_heads"]
    flags = {k: int(v[k]) for k in ("decoder/activation", "decoder/pre_norm", "decoder/scale_embeddings",
                                    "decoder/alibi", "decoder/start_from_zero_embedding")}
    if flags != {"decoder/activation": 3, "decoder/pre_norm": 1, "decoder/scale_embeddings": 0,
                 "decoder/alibi": 0, "decoder/start_from_zero_embedding": 0}:
        fail(f"unexpected Whisper variant flags {flags} (built: exact GELU, pre-norm, unscaled embeddings)")
    if int(v["decoder/num_heads"]) != d["n_heads"]:
        fail("encoder and decoder head counts differ")
    return d


# --------------------------------------------------------------------------------------
# Graphs


class Graph:
    """A small builder: named initializers, uniquely named nodes."""

    def __init__(self, weights: dict):
        self.weights, self.nodes, self.inits, self.n = weights, [], {}, 0

    def const(self, name, array):
        if name not in self.inits:
            self.inits[name] = numpy_helper.from_array(np.ascontiguousarray(array), name)
        return name

    def w(self, name, transpose=False):
        return self.const(name + (".T" if transpose else ""), self.weights[name].T if transpose else self.weights[name])

    def op(self, op, inputs, hint, outputs=1, **attrs):
        self.n += 1
        outs = [f"/{hint}_{self.n}" + (f"_{i}" if outputs > 1 else "") for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"{op}_{self.n}", **attrs))
        return outs[0] if outputs == 1 else outs

    def rename(self, value, name):
        self.nodes.append(helper.make_node("Identity", [value], [name], name=f"out_{name}"))

    def linear(self, x, prefix, bias=True):
        y = self.op("MatMul", [x, self.w(prefix + "/weight", transpose=True)], prefix)
        return self.op("Add", [y, self.w(prefix + "/bias")], prefix) if bias else y

    def layer_norm(self, x, prefix):
        return self.op("LayerNormalization", [x, self.w(prefix + "/gamma"), self.w(prefix + "/beta")], prefix,
                       axis=-1, epsilon=LN_EPS)

    def gelu(self, x, hint):
        # Exact GELU from opset-17 ops; ONNX Runtime fuses the pattern into its Gelu kernel.
        half, one = self.const("c_half", np.array(0.5, np.float32)), self.const("c_one", np.array(1.0, np.float32))
        erf = self.op("Erf", [self.op("Div", [x, self.const("c_sqrt2", np.array(np.sqrt(2.0), np.float32))], hint)],
                      hint)
        return self.op("Mul", [self.op("Mul", [x, half], hint), self.op("Add", [erf, one], hint)], hint)

    def heads(self, x, d, hint):
        """[B, T, D] -> [B, H, T, hd]."""
        shape = self.const("c_split_heads", np.array([0, 0, d["n_heads"], d["head_dim"]], np.int64))
        return self.op("Transpose", [self.op("Reshape", [x, shape], hint)], hint, perm=[0, 2, 1, 3])

    def merge(self, x, d, hint):
        """[B, H, T, hd] -> [B, T, D]."""
        shape = self.const("c_merge_heads", np.array([0, 0, d["d_model"]], np.int64))
        return self.op("Reshape", [self.op("Transpose", [x], hint, perm=[0, 2, 1, 3]), shape], hint)

    def scores(self, q, k, hint):
        return self.op("MatMul", [q, self.op("Transpose", [k], hint, perm=[0, 1, 3, 2])], hint)

    def model(self, inputs, outputs, name):
        graph = helper.make_graph(self.nodes, name, inputs, outputs, list(self.inits.values()))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="snooze")
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


def float_input(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def build_encoder(v: dict, d: dict) -> onnx.ModelProto:
    g = Graph(v)
    scale = g.const("c_q_scale", np.array(1.0 / np.sqrt(d["head_dim"]), np.float32))
    x = g.op("Conv", ["mel", g.w("encoder/conv1/weight"), g.w("encoder/conv1/bias")], "conv1", kernel_shape=[3],
             pads=[1, 1])
    x = g.gelu(x, "conv1")
    x = g.op("Conv", [x, g.w("encoder/conv2/weight"), g.w("encoder/conv2/bias")], "conv2", kernel_shape=[3],
             pads=[1, 1], strides=[2])
    x = g.op("Transpose", [g.gelu(x, "conv2")], "conv2", perm=[0, 2, 1])  # [B, S, D]
    frames = g.op("Slice", [g.op("Shape", [x], "pos"), g.const("c_1", np.array([1], np.int64)),
                            g.const("c_2", np.array([2], np.int64))], "pos")
    pos = g.op("Slice", [g.w("encoder/position_encodings/encodings"), g.const("c_0", np.array([0], np.int64)),
                         frames], "pos")
    x = g.op("Add", [x, pos], "pos")
    for i in range(d["encoder_layers"]):
        p = f"encoder/layer_{i}"
        h = g.layer_norm(x, f"{p}/self_attention/layer_norm")
        q, k, val = g.op("Split", [g.linear(h, f"{p}/self_attention/linear_0")], f"{p}/qkv", outputs=3, axis=-1)
        q = g.heads(g.op("Mul", [q, scale], p), d, p)
        probs = g.op("Softmax", [g.scores(q, g.heads(k, d, p), p)], p, axis=-1)
        attn = g.merge(g.op("MatMul", [probs, g.heads(val, d, p)], p), d, p)
        x = g.op("Add", [x, g.linear(attn, f"{p}/self_attention/linear_1")], p)
        h = g.layer_norm(x, f"{p}/ffn/layer_norm")
        h = g.linear(g.gelu(g.linear(h, f"{p}/ffn/linear_0"), p), f"{p}/ffn/linear_1")
        x = g.op("Add", [x, h], p)
    x = g.layer_norm(x, "encoder/layer_norm")
    outputs = []
    for i in range(d["decoder_layers"]):
        p = f"decoder/layer_{i}/attention/linear_1"
        wk, wv = np.split(v[p + "/weight"], 2, axis=0)
        bk, bv = np.split(v[p + "/bias"], 2)
        if np.any(bk != 0):
            fail(f"{p}/bias: the cross-attention key bias is not zero")
        k = g.op("MatMul", [x, g.const(f"{p}/weight_k.T", wk.T)], p)
        val = g.op("Add", [g.op("MatMul", [x, g.const(f"{p}/weight_v.T", wv.T)], p), g.const(f"{p}/bias_v", bv)], p)
        for name, value in ((f"cross_k_{i}", k), (f"cross_v_{i}", val)):
            g.rename(g.heads(value, d, p), name)
            outputs.append(float_input(name, ["batch", d["n_heads"], "audio_ctx", d["head_dim"]]))
    return g.model([float_input("mel", ["batch", d["n_mels"], "frames"])], outputs, "whisper_encoder")


def build_decoder(v: dict, d: dict) -> onnx.ModelProto:
    g = Graph(v)
    scale = g.const("c_q_scale", np.array(1.0 / np.sqrt(d["head_dim"]), np.float32))
    emb = g.w("decoder/embeddings/weight")
    # The token lookup reads its own float16 copy of the table when that is exact (the
    # CTranslate2 weights are float16): the float32 table is the output projection's
    # alone, so ONNX Runtime keeps only its prepacked form instead of both.
    table = v["decoder/embeddings/weight"]
    if np.array_equal(table.astype(np.float16).astype(np.float32), table):
        lookup = g.op("Cast", [g.op("Gather", [g.const("decoder/embeddings/weight_f16", table.astype(np.float16)),
                                               "tokens"], "embed")], "embed", to=TensorProto.FLOAT)
    else:
        lookup = g.op("Gather", [emb, "tokens"], "embed")
    x = g.op("Add", [lookup, g.op("Gather", [g.w("decoder/position_encodings/encodings"), "positions"], "embed")],
             "embed")
    # The mask's past and new columns, [B, 1, n_new, .] to broadcast over heads.
    n_past = g.op("Slice", [g.op("Shape", ["past_k_0"], "mask"), g.const("c_2", np.array([2], np.int64)),
                            g.const("c_3", np.array([3], np.int64))], "mask")
    big = g.const("c_big", np.array([1 << 40], np.int64))
    axis_m1 = g.const("c_m1", np.array([-1], np.int64))
    mask = g.op("Unsqueeze", ["attention_mask", g.const("c_1", np.array([1], np.int64))], "mask")
    mask_past = g.op("Slice", [mask, g.const("c_0", np.array([0], np.int64)), n_past, axis_m1], "mask")
    mask_new = g.op("Slice", [mask, n_past, big, axis_m1], "mask")
    inputs = [
        helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "n_new"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["batch", "n_new"]),
        float_input("attention_mask", ["batch", "n_new", "n_total"]),
        helper.make_tensor_value_info("logit_positions", TensorProto.INT64, ["batch", "n_logits"]),
    ]
    outputs = []
    for i in range(d["decoder_layers"]):
        p = f"decoder/layer_{i}"
        kv_shape = ["batch", d["n_heads"], "n_past", d["head_dim"]]
        cross_shape = ["batch", d["n_heads"], "audio_ctx", d["head_dim"]]
        inputs += [float_input(f"past_k_{i}", kv_shape), float_input(f"past_v_{i}", kv_shape)]
        inputs += [float_input(f"cross_k_{i}", cross_shape), float_input(f"cross_v_{i}", cross_shape)]
        # Self-attention over the cached past and the new tokens.
        h = g.layer_norm(x, f"{p}/self_attention/layer_norm")
        q, k, val = g.op("Split", [g.linear(h, f"{p}/self_attention/linear_0")], f"{p}/qkv", outputs=3, axis=-1)
        q = g.heads(g.op("Mul", [q, scale], p), d, p)
        k, val = g.heads(k, d, p), g.heads(val, d, p)
        g.rename(k, f"new_k_{i}")
        g.rename(val, f"new_v_{i}")
        outputs += [float_input(f"new_k_{i}", ["batch", d["n_heads"], "n_new", d["head_dim"]]),
                    float_input(f"new_v_{i}", ["batch", d["n_heads"], "n_new", d["head_dim"]])]
        s_past = g.op("Add", [g.scores(q, f"past_k_{i}", p), mask_past], p)
        s_new = g.op("Add", [g.scores(q, k, p), mask_new], p)
        probs = g.op("Softmax", [g.op("Concat", [s_past, s_new], p, axis=-1)], p, axis=-1)
        p_past = g.op("Slice", [probs, g.const("c_0", np.array([0], np.int64)), n_past, axis_m1], p)
        p_new = g.op("Slice", [probs, n_past, big, axis_m1], p)
        attn = g.op("Add", [g.op("MatMul", [p_past, f"past_v_{i}"], p), g.op("MatMul", [p_new, val], p)], p)
        x = g.op("Add", [x, g.linear(g.merge(attn, d, p), f"{p}/self_attention/linear_1")], p)
        # Cross-attention over the encoder's keys and values.
        h = g.layer_norm(x, f"{p}/attention/layer_norm")
        q = g.heads(g.op("Mul", [g.linear(h, f"{p}/attention/linear_0"), scale], p), d, p)
        probs = g.op("Softmax", [g.scores(q, f"cross_k_{i}", p)], p, axis=-1)
        attn = g.merge(g.op("MatMul", [probs, f"cross_v_{i}"], p), d, p)
        x = g.op("Add", [x, g.linear(attn, f"{p}/attention/linear_2")], p)
        h = g.layer_norm(x, f"{p}/ffn/layer_norm")
        x = g.op("Add", [x, g.linear(g.gelu(g.linear(h, f"{p}/ffn/linear_0"), p), f"{p}/ffn/linear_1")], p)
    # Logits at the requested positions only; the output projection is the embedding table
    # (Gemm transB=1 shares the Gather's initializer instead of a transposed copy).
    picked = g.op("GatherND", [x, g.op("Unsqueeze", ["logit_positions", axis_m1], "logits")], "logits", batch_dims=1)
    picked = g.layer_norm(picked, "decoder/layer_norm")
    flat = g.op("Reshape", [picked, g.const("c_flat", np.array([-1, d["d_model"]], np.int64))], "logits")
    logits = g.op("Gemm", [flat, emb], "logits", transB=1)
    out_shape = g.op("Concat", [g.op("Shape", ["logit_positions"], "logits"),
                                g.const("c_vocab", np.array([d["vocab_size"]], np.int64))], "logits", axis=0)
    g.rename(g.op("Reshape", [logits, out_shape], "logits"), "logits")
    outputs.insert(0, float_input("logits", ["batch", "n_logits", d["vocab_size"]]))
    return g.model(inputs, outputs, "whisper_decoder")


# --------------------------------------------------------------------------------------
# Descriptor


def non_speech_tokens(tokenizer) -> list:
    """faster-whisper's (and Whisper's) default list of symbols that are not speech: each
    symbol's id when it is one token alone or after a space, hyphen and quote only inside
    words, and the first token of the musical symbols."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
    symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
    musical = set("♩♪♫♬♭♮♯")
    ids = {encode(" -")[0], encode(" '")[0]}
    for symbol in symbols + sorted(musical):
        for tokens in (encode(symbol), encode(" " + symbol)):
            if len(tokens) == 1 or symbol in musical:
                ids.add(tokens[0])
    return sorted(ids)


def descriptor(d: dict, v: dict, side: dict) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(side["tokenizer.json"])
    with open(side["config.json"]) as f:
        config = json.load(f)
    added = {t["content"]: t["id"] for t in json.load(open(side["tokenizer.json"]))["added_tokens"]}

    def special(*names):
        for name in names:
            if name in added:
                return added[name]
        fail(f"tokenizer.json has none of {names}")

    tokens = {
        "eot": special("<|endoftext|>"),
        "sot": special("<|startoftranscript|>"),
        "sot_prev": special("<|startofprev|>"),
        "sot_lm": special("<|startoflm|>"),
        "no_speech": special("<|nospeech|>", "<|nocaptions|>"),
        "no_timestamps": special("<|notimestamps|>"),
        "transcribe": special("<|transcribe|>"),
        "translate": special("<|translate|>"),
    }
    tokens["timestamp_begin"] = tokens["no_timestamps"] + 1
    tokens["timestamp_end"] = d["vocab_size"] - 1
    # CTranslate2's rule (whisper.cc): the multilingual vocabulary has 51865 tokens or more.
    multilingual = d["vocab_size"] >= 51865
    languages = []
    if multilingual:
        by_id = {i: name for name, i in added.items()}
        for token in config["lang_ids"]:
            name = by_id.get(token, "")
            if not (name.startswith("<|") and name.endswith("|>")):
                fail(f"config.json lang_ids names token {token}, which is not a language token")
            languages.append({"code": name[2:-2], "token": token})
    suppress = non_speech_tokens(tokenizer) + [tokens[k] for k in
                                                ("transcribe", "translate", "sot", "sot_prev", "sot_lm", "no_speech")]
    return {
        "format": 1,
        "architecture": "whisper",
        "encoder": "encoder.onnx",
        "decoder": "decoder.onnx",
        "sample_rate": 16000,
        "n_fft": 400,
        "hop_length": 160,
        "chunk_frames": 3000,
        **d,
        "multilingual": multilingual,
        "tokens": tokens,
        "languages": languages,
        "suppress_tokens": sorted(set(suppress)),
        "suppress_blank": list(config["suppress_ids_begin"]),
        "alignment_heads": config.get("alignment_heads", []),
    }


# --------------------------------------------------------------------------------------
# Files


def write_atomically(path: str, write) -> None:
    """write(tmp_path), then rename over path: a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def link(target: str, path: str) -> None:
    if os.path.islink(path) and os.readlink(path) == target:
        return
    if os.path.lexists(path) and not os.path.islink(path):
        fail(f"{path} exists and is not a symlink; remove it")
    tmp = f"{path}.tmp-{os.getpid()}"
    os.symlink(target, tmp)
    os.replace(tmp, path)


def write_side_files(folder: str, desc: dict, side: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    for name in LINKED:
        if name in side:
            link(side[name], os.path.join(folder, name))
    text = json.dumps(desc, indent=1) + "\n"
    path = os.path.join(folder, "whisper.json")
    if not (os.path.isfile(path) and open(path).read() == text):
        write_atomically(path, lambda tmp: open(tmp, "w").write(text))


def quantize(src: str, dst: str) -> None:
    """Dynamic int8, unsigned weights (u8 x u8: no int16 saturation on AVX2, see --int8)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    write_atomically(dst, lambda tmp: quantize_dynamic(src, tmp, weight_type=QuantType.QUInt8, per_channel=True,
                                                      op_types_to_quantize=["MatMul", "Gemm"]))


def newer_than(paths: list, inputs: list) -> bool:
    newest = max(os.path.getmtime(p) for p in inputs)
    return all(os.path.isfile(p) and os.path.getmtime(p) > newest for p in paths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", required=True, help="CTranslate2 Whisper folder (repeat for parts)")
    parser.add_argument("--out", required=True, help="model folder to write (models/whisper-tiny-en)")
    parser.add_argument("--fixture", required=True, help="faster-whisper's reference (tests/fixtures/whisper_*.json)")
    parser.add_argument("--mel", help="the fixture's log-mel (default: whisper_mel.json next to --fixture)")
    parser.add_argument("--int8", action="store_true", help="also write OUT/int8/ (dynamic int8 weights)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads for the check")
    parser.add_argument("--force", action="store_true", help="rebuild even when the graphs are up to date")
    args = parser.parse_args()

    t0 = time.time()
    parts, side = source_files(args.src)
    mel_path = args.mel or os.path.join(os.path.dirname(args.fixture), "whisper_mel.json")
    for path in (args.fixture, mel_path):
        if not os.path.isfile(path):
            fail(f"{path} not found")
    with open(args.fixture) as f:
        fixture = json.load(f)
    variables = read_ct2(parts)
    d = dims(variables)
    desc = descriptor(d, variables, side)
    log(f"{', '.join(parts)}: {d['encoder_layers']}+{d['decoder_layers']} layers, width {d['d_model']}, "
        f"{d['n_heads']} heads, vocabulary {d['vocab_size']}, multilingual {desc['multilingual']}")
    if fixture.get("multilingual") != desc["multilingual"]:
        fail(f"{args.fixture} was made for a {'multi' if fixture.get('multilingual') else 'mono'}lingual model")
    mels = fixture_mels(args.fixture, mel_path, list(fixture["clips"]), d["n_mels"])

    folders = [("fp32", args.out, True)] + ([("int8", os.path.join(args.out, "int8"), False)] if args.int8 else [])
    inputs = parts + [side["config.json"], side["tokenizer.json"], os.path.abspath(__file__)]
    for name, folder, exact in folders:
        graphs = [os.path.join(folder, "encoder.onnx"), os.path.join(folder, "decoder.onnx")]
        write_side_files(folder, desc, side)
        if not args.force and newer_than(graphs, inputs):
            log(f"{folder}: graphs up to date (--force rebuilds them)")
        elif name == "fp32":
            for path, build in zip(graphs, (build_encoder, build_decoder)):
                model = build(variables, d)
                write_atomically(path, lambda tmp: onnx.save(model, tmp))
                log(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB, {time.time() - t0:.1f}s)")
        else:
            for src, path in zip([os.path.join(args.out, "encoder.onnx"), os.path.join(args.out, "decoder.onnx")],
                                 graphs):
                quantize(src, path)
                log(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB, {time.time() - t0:.1f}s)")
        if not check(name, folder, desc, fixture, mels, args.threads, exact):
            for path in graphs:
                os.unlink(path)  # so that the next run rebuilds them
            fail(f"{folder} does not reproduce faster-whisper's reference (graphs removed; rerun to rebuild)")
    log(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
