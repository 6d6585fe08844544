#!/usr/bin/env python3
"""Export sentence-transformers all-MiniLM-L6-v2 to ONNX (fp32 and int8), without torch.

The BERT encoder is rebuilt op by op with `onnx.helper` from the weights in the source
folder's `model.safetensors` (read with numpy: the safetensors format is an 8-byte
little-endian header length, a JSON header, then raw little-endian tensor data), so
neither torch nor a model hub is needed.

    export_minilm_onnx.py --src models/minilm --out models \
        --fixture tests/fixtures/minilm_embeddings.json

writes two sentence-transformers model folders, laid out as the ONNX backend of
sentence-transformers and the Hub's ONNX repos ship them:

    OUT/minilm-onnx/        every file of SRC but model.safetensors (as symlinks),
                            plus onnx/model.onnx: the fp32 encoder
    OUT/minilm-onnx-int8/   the same, with onnx/model.onnx dynamic-quantized to int8

Graph contract (the one of Hugging Face / Optimum BERT exports): inputs `input_ids`,
`attention_mask`, `token_type_ids`, int64 [batch_size, sequence_length]; output
`last_hidden_state`, float32 [batch_size, sequence_length, 384]. Pooling and
normalisation are not in the graph: the server does them.

The fp32 graph uses standard ONNX ops only (opset 17: Gather, MatMul, LayerNormalization,
Softmax, Erf, ...). ONNX Runtime's transformer optimizer (Attention/SkipLayerNormalization
fusions) was measured and left out: ORT's own session-time fusions already make the plain
graph as fast on CPU, and the plain graph runs anywhere.

The int8 model is `onnxruntime.quantization.quantize_dynamic` (QInt8 weights per output
channel; activations quantized at run time) of the weight MatMuls and the word embedding
table, after an fp32-equivalent rewrite that keeps BERT's outlier channels from eating the
int8 range (see prepare_for_int8): without it short sentences fall to ~0.97 cosine.

Both models are checked against the sentence-transformers reference fixture (tokenizers
from tokenizer.json, mean pooling over the attention mask, L2 normalisation, cosine per
sentence, each sentence alone and all in one padded batch): the token counts must match,
fp32 must reach a minimum cosine of 0.9999 and int8 of 0.99. The script exits non-zero,
and removes the model that failed, when a check fails.

Idempotent: every file is written to a temporary name and renamed into place. Models
newer than this script and the source weights and config are not rebuilt, only checked
(--force rebuilds them).
"""

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from typing import NoReturn

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
FP32_MIN_COSINE = 0.9999
INT8_MIN_COSINE = 0.99
WEIGHTS = "model.safetensors"

# safetensors dtype names -> numpy dtypes (little-endian).
_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?",
}


def log(msg: str) -> None:
    print(f"export_minilm_onnx: {msg}", flush=True)


def fail(msg: str) -> NoReturn:
    print(f"export_minilm_onnx: FAILED: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


# --------------------------------------------------------------------------------------
# Weights


def read_safetensors(path: str) -> dict:
    """Every tensor of a .safetensors file as a numpy array (float32 for float tensors)."""
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype == "BF16":
            start, end = info["data_offsets"]
            raw = np.frombuffer(data, dtype="<u2", count=(end - start) // 2, offset=base + start)
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        elif dtype in _DTYPES:
            start, end = info["data_offsets"]
            dt = np.dtype(_DTYPES[dtype])
            arr = np.frombuffer(data, dtype=dt, count=(end - start) // dt.itemsize, offset=base + start)
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        arr = arr.reshape(info["shape"])
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float32)
        tensors[name] = arr
    # Checkpoints saved from BertForXxx carry a `bert.` prefix; BertModel's do not.
    if any(k.startswith("bert.") for k in tensors):
        tensors = {k[len("bert.") :]: v for k, v in tensors.items() if k.startswith("bert.")}
    return tensors


# --------------------------------------------------------------------------------------
# Graph


def build_bert(weights: dict, config: dict) -> onnx.ModelProto:
    """The BertModel encoder (no pooler) as a standard-ops ONNX graph."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    eps = float(config.get("layer_norm_eps", 1e-12))
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {config.get('hidden_act')!r}: only exact gelu is built")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings are built")
    head_dim = hidden // heads

    nodes, inits = [], []
    counter = [0]

    def w(name):
        if name not in weights:
            raise KeyError(f"weight {name} missing from {WEIGHTS}")
        return weights[name]

    def const(name, array):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op, inputs, name_hint, **attrs):
        counter[0] += 1
        out = f"/{name_hint}_{counter[0]}"
        nodes.append(helper.make_node(op, inputs, [out], name=f"{op}_{counter[0]}", **attrs))
        return out

    def linear(x, prefix):
        # torch Linear: y = x @ W^T + b, W stored [out, in].
        wt = const(f"{prefix}.weight.T", w(f"{prefix}.weight").T)
        b = const(f"{prefix}.bias", w(f"{prefix}.bias"))
        return node("Add", [node("MatMul", [x, wt], prefix + "/MatMul"), b], prefix + "/Add")

    def layer_norm(x, prefix):
        g = const(f"{prefix}.weight", w(f"{prefix}.weight"))
        b = const(f"{prefix}.bias", w(f"{prefix}.bias"))
        return node("LayerNormalization", [x, g, b], prefix, axis=-1, epsilon=eps)

    # Scalars and shapes.
    one_f = const("const_one_f", np.array(1.0, np.float32))
    half_f = const("const_half_f", np.array(0.5, np.float32))
    sqrt2_f = const("const_sqrt2_f", np.array(np.sqrt(2.0), np.float32))
    neg_f = const("const_mask_min_f", np.array(np.finfo(np.float32).min, np.float32))
    scale_f = const("const_attn_scale_f", np.array(np.sqrt(head_dim), np.float32))
    zero_i = const("const_zero_i", np.array([0], np.int64))
    one_i = const("const_one_i", np.array([1], np.int64))
    split_heads = const("const_split_heads", np.array([0, 0, heads, head_dim], np.int64))
    merge_heads = const("const_merge_heads", np.array([0, 0, hidden], np.int64))
    axis1 = const("const_axis1", np.array([1], np.int64))
    axis2 = const("const_axis2", np.array([2], np.int64))

    # Embeddings: word + position + token type, LayerNorm.
    word = const("embeddings.word_embeddings.weight", w("embeddings.word_embeddings.weight"))
    pos = const("embeddings.position_embeddings.weight", w("embeddings.position_embeddings.weight"))
    tok = const("embeddings.token_type_embeddings.weight", w("embeddings.token_type_embeddings.weight"))
    pos_ids_all = const("embeddings.position_ids", np.arange(config["max_position_embeddings"], dtype=np.int64)[None, :])
    shape = node("Shape", ["input_ids"], "embeddings/Shape")
    seq_len = node("Gather", [shape, one_i], "embeddings/SeqLen", axis=0)  # [1]
    pos_ids = node("Slice", [pos_ids_all, zero_i, seq_len, one_i], "embeddings/PosIds")  # [1, S]
    e = node("Gather", [word, "input_ids"], "embeddings/word")
    e = node("Add", [e, node("Gather", [tok, "token_type_ids"], "embeddings/token_type")], "embeddings/Add")
    e = node("Add", [e, node("Gather", [pos, pos_ids], "embeddings/position")], "embeddings/Add")
    x = layer_norm(e, "embeddings.LayerNorm")

    # Additive attention mask: (1 - mask) * float32.min, [B, 1, 1, S], broadcast over heads.
    # Two Unsqueezes then Cast, as torch exports `mask[:, None, None, :]`, so that tools
    # matching BERT patterns (ORT's transformer optimizer) recognise it.
    m = node("Unsqueeze", ["attention_mask", axis1], "mask/Unsqueeze")
    m = node("Unsqueeze", [m, axis2], "mask/Unsqueeze")
    m = node("Cast", [m], "mask/Cast", to=TensorProto.FLOAT)
    m = node("Sub", [one_f, m], "mask/Sub")
    mask = node("Mul", [m, neg_f], "mask/Mul")

    for i in range(layers):
        p = f"encoder.layer.{i}"
        q = node("Reshape", [linear(x, f"{p}.attention.self.query"), split_heads], f"{p}/q/Reshape")
        k = node("Reshape", [linear(x, f"{p}.attention.self.key"), split_heads], f"{p}/k/Reshape")
        v = node("Reshape", [linear(x, f"{p}.attention.self.value"), split_heads], f"{p}/v/Reshape")
        q = node("Transpose", [q], f"{p}/q/Transpose", perm=[0, 2, 1, 3])  # [B, H, S, D]
        k = node("Transpose", [k], f"{p}/k/Transpose", perm=[0, 2, 3, 1])  # [B, H, D, S]
        v = node("Transpose", [v], f"{p}/v/Transpose", perm=[0, 2, 1, 3])  # [B, H, S, D]
        s = node("MatMul", [q, k], f"{p}/scores")
        s = node("Div", [s, scale_f], f"{p}/scores/Div")
        s = node("Add", [s, mask], f"{p}/scores/Add")
        s = node("Softmax", [s], f"{p}/probs", axis=-1)
        c = node("MatMul", [s, v], f"{p}/context")
        c = node("Transpose", [c], f"{p}/context/Transpose", perm=[0, 2, 1, 3])
        c = node("Reshape", [c, merge_heads], f"{p}/context/Reshape")
        a = node("Add", [linear(c, f"{p}.attention.output.dense"), x], f"{p}/attention/residual")
        x = layer_norm(a, f"{p}.attention.output.LayerNorm")
        h = linear(x, f"{p}.intermediate.dense")
        # Exact GELU: x * 0.5 * (1 + erf(x / sqrt(2))).
        g = node("Erf", [node("Div", [h, sqrt2_f], f"{p}/gelu/Div")], f"{p}/gelu/Erf")
        g = node("Mul", [h, node("Add", [g, one_f], f"{p}/gelu/Add")], f"{p}/gelu/Mul")
        g = node("Mul", [g, half_f], f"{p}/gelu/Mul")
        o = node("Add", [linear(g, f"{p}.output.dense"), x], f"{p}/output/residual")
        x = layer_norm(o, f"{p}.output.LayerNorm")

    nodes[-1].output[0] = "last_hidden_state"
    dims = ["batch_size", "sequence_length"]
    graph = helper.make_graph(
        nodes,
        "main_graph",
        [helper.make_tensor_value_info(n, TensorProto.INT64, dims) for n in ("input_ids", "attention_mask", "token_type_ids")],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, dims + [hidden])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="snoozeml-export-minilm")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# --------------------------------------------------------------------------------------
# int8


# Calibration text for the int8 preparation (not the fixture's sentences, which check the
# result): what the activations' per-channel ranges are, padding included.
CALIBRATION = [
    "A quick brown fox jumps over the lazy dog.",
    "Machine learning models are deployed to production behind an inference server.",
    "The weather in Berlin is cold and rainy in November.",
    "She bought three apples, two bananas and a loaf of bread at the market.",
    "How do I reset my password if I no longer have access to my email?",
    "Die Katze schläft auf dem Sofa.",
    "La tour Eiffel est le monument le plus visité de Paris.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "今日はとても良い天気ですね。",
    "深度学习需要大量的数据和计算资源。",
    "OK",
    "?",
    "Error 404: the requested resource /api/v1/users/42 was not found.",
    "def main(): return sum(x * x for x in range(10))",
    "The stock market closed 2.3% higher on Friday after strong earnings reports from technology companies.",
    " ".join(["The committee reviewed the proposal in detail, discussed its budget, timeline and risks, "
              "and agreed to revisit it next quarter."] * 8),
]
SMOOTH_ALPHA = 0.6  # SmoothQuant migration strength for the LayerNorm-fed MatMuls
OUTLIER_CHANNELS = 2  # FFN-output input channels kept in fp32
PER_CHANNEL = True
REDUCE_RANGE = False  # retried with True if the check fails (7-bit weights, non-VNNI x86)


def weight_matmul_groups(model: onnx.ModelProto) -> dict:
    """Weight MatMuls (`*.weight.T`) grouped by their activation input, in graph order."""
    groups = {}
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.input[1].endswith(".weight.T"):
            groups.setdefault(n.input[0], []).append(n)
    return groups


def activation_ranges(model: onnx.ModelProto, encode) -> dict:
    """Per-channel max |x| of every weight MatMul's input over the calibration text, run
    one sentence at a time and in padded batches (padding rows count: dynamic quantization
    sees them too)."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = list(weight_matmul_groups(m))
    for name in names:
        m.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    encs = encode(CALIBRATION)
    batches = [[e] for e in encs] + [encs[i : i + 8] for i in range(0, len(encs), 8)]
    ranges = {}
    for batch in batches:
        for name, out in zip(names, sess.run(names, batch_inputs(batch))):
            amax = np.abs(out.reshape(-1, out.shape[-1])).max(0)
            ranges[name] = np.maximum(ranges.get(name, 0.0), amax)
    return ranges


def prepare_for_int8(model: onnx.ModelProto, ranges: dict):
    """An fp32 graph, equal to `model` up to rounding, whose MatMul inputs quantize well.

    BERT's hidden states have a few outlier channels (here ~30 against ~2 for the rest,
    mostly on [CLS] and padding rows), and dynamic quantization gives each activation tensor
    one range: quantized as they are, short sentences lose up to 3% cosine. So:
    - MatMuls fed by a LayerNorm (Q, K, V, FFN in): SmoothQuant, x @ W = (x / s) @ (s W),
      with s = amax(x)^a / amax(W)^(1-a) per input channel, x / s as one Mul;
    - FFN out (fed by GELU, a single channel far out): the top input channels go through a
      small fp32 MatMul, the rest (outliers zeroed, in x and in W) through the int8 one.
    Returns the graph and the names of the fp32 MatMuls to leave unquantized.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {i.name: i for i in m.graph.initializer}
    inserts, keep_fp32 = [], []
    for g, (x, matmuls) in enumerate(weight_matmul_groups(m).items()):
        wnames = [n.input[1] for n in matmuls]
        ln_fed = any(".intermediate.dense" in w or ".attention.self." in w for w in wnames)
        ffn_out = any(".output.dense" in w and ".attention." not in w for w in wnames)
        if not (ln_fed or ffn_out):
            continue  # attention output dense: its input (the context) has no outliers
        weights = [numpy_helper.to_array(inits[w]).copy() for w in wnames]
        amax = np.maximum(ranges[x], 1e-5)
        scale = np.ones_like(amax)
        outliers = np.zeros(0, np.int64)
        if ln_fed:
            wmax = np.maximum(np.max([np.abs(w).max(1) for w in weights], axis=0), 1e-5)
            scale = np.clip(amax**SMOOTH_ALPHA / wmax ** (1 - SMOOTH_ALPHA), 1e-2, 1e2).astype(np.float32)
        else:
            outliers = np.sort(np.argsort(amax)[::-1][:OUTLIER_CHANNELS]).astype(np.int64)
        mult = (1.0 / scale).astype(np.float32)
        mult[outliers] = 0.0
        xq = f"/int8prep_{g}/x"
        nodes = [helper.make_node("Mul", [x, f"int8prep_{g}.mult"], [xq], name=f"Int8PrepMul_{g}")]
        m.graph.initializer.append(numpy_helper.from_array(mult, f"int8prep_{g}.mult"))
        if len(outliers):
            m.graph.initializer.append(numpy_helper.from_array(outliers, f"int8prep_{g}.outliers"))
            nodes.append(helper.make_node("Gather", [x, f"int8prep_{g}.outliers"], [f"/int8prep_{g}/xo"],
                                          name=f"Int8PrepGather_{g}", axis=-1))
        for j, (n, w) in enumerate(zip(matmuls, weights)):
            w_int = (w * scale[:, None]).astype(np.float32)
            n.input[0] = xq
            if len(outliers):
                w_out = np.ascontiguousarray(w[outliers, :])
                w_int[outliers, :] = 0.0
                m.graph.initializer.append(numpy_helper.from_array(w_out, f"{n.input[1]}.outlier_rows"))
                out = n.output[0]
                n.output[0] = f"{out}/int8"
                fp = helper.make_node("MatMul", [f"/int8prep_{g}/xo", f"{n.input[1]}.outlier_rows"], [f"{out}/fp32"],
                                      name=f"Int8PrepOutlierMatMul_{g}_{j}")
                keep_fp32.append(fp.name)
                inserts.append((n, [fp, helper.make_node("Add", [f"{out}/int8", f"{out}/fp32"], [out],
                                                         name=f"Int8PrepAdd_{g}_{j}")], 1))
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(w_int, n.input[1]))
        inserts.append((matmuls[0], nodes, 0))
    order = list(m.graph.node)
    for anchor, new, after in inserts:
        i = order.index(anchor) + after
        order[i:i] = new
    del m.graph.node[:]
    m.graph.node.extend(order)
    onnx.checker.check_model(m)
    return m, keep_fp32


def quantize(prepared: onnx.ModelProto, keep_fp32, out_path: str, reduce_range: bool) -> None:
    """Dynamic int8: QInt8 weights (per output channel) for the weight MatMuls and the word
    embedding table; activations are quantized at run time (DynamicQuantizeLinear)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    targets = [n.name for n in prepared.graph.node
               if (n.op_type == "MatMul" and n.input[1].endswith(".weight.T"))
               or (n.op_type == "Gather" and n.input[0] == "embeddings.word_embeddings.weight")]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "prepared.onnx")
        onnx.save(prepared, src)
        logging.disable(logging.WARNING)  # "consider pre-processing": not for this graph
        try:
            quantize_dynamic(
                src,
                out_path,
                weight_type=QuantType.QInt8,
                per_channel=PER_CHANNEL,
                reduce_range=reduce_range,
                op_types_to_quantize=["MatMul", "Gather"],
                nodes_to_quantize=targets,
                nodes_to_exclude=list(keep_fp32),
            )
        finally:
            logging.disable(logging.NOTSET)


# --------------------------------------------------------------------------------------
# Tokenization and the check against the sentence-transformers fixture


def tokenizer(src: str, max_length: int):
    """encode(list of str) -> tokenizers Encodings: no padding, truncated to max_length
    (tokenizer.json itself pads and truncates to 128)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok.encode_batch


def batch_inputs(encs) -> dict:
    """The model's feeds for a list of encodings, right-padded with a 0/1 attention mask."""
    n, s = len(encs), max(len(e.ids) for e in encs)
    feeds = {k: np.zeros((n, s), np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    for i, e in enumerate(encs):
        feeds["input_ids"][i, : len(e.ids)] = e.ids
        feeds["attention_mask"][i, : len(e.ids)] = e.attention_mask
        feeds["token_type_ids"][i, : len(e.ids)] = e.type_ids
    return feeds


def session(path: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def sentence_embeddings(sess, feeds) -> np.ndarray:
    """sentence-transformers' pipeline after the Transformer: mean pooling over the
    attention mask, then L2 normalisation."""
    (hidden,) = sess.run(["last_hidden_state"], feeds)
    mask = feeds["attention_mask"][..., None].astype(np.float32)
    pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def check(name: str, model_path: str, encs, reference: np.ndarray, minimum: float) -> bool:
    """Cosine of each sentence's embedding with the reference, computed two ways: each
    sentence alone, and all in one batch padded to the longest (256 tokens). Dynamic int8
    quantization shares ranges across a batch, so the two differ a little."""
    sess = session(model_path)
    inputs = {i.name: (i.type, len(i.shape)) for i in sess.get_inputs()}
    want = {n: ("tensor(int64)", 2) for n in ("input_ids", "attention_mask", "token_type_ids")}
    outputs = [(o.name, o.type, len(o.shape)) for o in sess.get_outputs()]
    if inputs != want or outputs != [("last_hidden_state", "tensor(float)", 3)]:
        log(f"{name}: graph contract broken: inputs {inputs}, outputs {outputs}")
        return False
    ref = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    alone = np.concatenate([sentence_embeddings(sess, batch_inputs([e])) for e in encs])
    batched = sentence_embeddings(sess, batch_inputs(encs))
    ok = True
    for how, emb in (("alone", alone), ("batched", batched)):
        cos = (emb * ref).sum(1)
        good = bool(cos.min() >= minimum)
        ok = ok and good
        worst = int(cos.argmin())
        log(f"{name} ({how}): cosine vs sentence-transformers min {cos.min():.6f} mean {cos.mean():.6f} "
            f"over {len(cos)} sentences, need min >= {minimum}: {'ok' if good else 'FAILED'}"
            + ("" if good else f" (worst: #{worst}, {len(encs[worst].ids)} tokens)"))
    return ok


def op_summary(path: str) -> str:
    counts = {}
    for n in onnx.load(path).graph.node:
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


# --------------------------------------------------------------------------------------
# Folders


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


def link_source(src: str, folder: str) -> None:
    """Symlink every entry of src but the safetensors weights into folder (absolute links to
    the resolved source); drop links that src no longer has."""
    os.makedirs(folder, exist_ok=True)
    # An `onnx/` in the source would clash with ours; none ships with this model.
    wanted = {e for e in os.listdir(src) if e not in (WEIGHTS, "onnx")}
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if os.path.islink(path) and entry not in wanted:
            os.unlink(path)
    for entry in sorted(wanted):
        target = os.path.join(src, entry)
        path = os.path.join(folder, entry)
        if os.path.islink(path) and os.readlink(path) == target:
            continue
        if os.path.lexists(path) and not os.path.islink(path):
            fail(f"{path} exists and is not a symlink; remove it")
        tmp = os.path.join(folder, f".{entry}.tmp-{os.getpid()}")
        os.symlink(target, tmp)
        os.replace(tmp, path)


def newer_than(path: str, inputs) -> bool:
    return os.path.isfile(path) and os.path.getmtime(path) > max(os.path.getmtime(p) for p in inputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="sentence-transformers model folder with model.safetensors")
    parser.add_argument("--out", required=True, help="folder to write minilm-onnx/ and minilm-onnx-int8/ into")
    parser.add_argument("--fixture", required=True, help="reference embeddings (tests/fixtures/minilm_embeddings.json)")
    parser.add_argument("--name", default="minilm-onnx", help="name of the fp32 folder; the int8 one adds -int8")
    parser.add_argument("--force", action="store_true", help="rebuild even when the models are up to date")
    args = parser.parse_args()

    t0 = time.time()
    src = os.path.realpath(args.src)
    weights_path = os.path.join(src, WEIGHTS)
    config_path = os.path.join(src, "config.json")
    for path in (weights_path, config_path, os.path.join(src, "tokenizer.json"), args.fixture):
        if not os.path.isfile(path):
            fail(f"{path} not found")
    with open(config_path) as f:
        config = json.load(f)
    with open(args.fixture) as f:
        fixture = json.load(f)
    encode = tokenizer(src, int(fixture["max_seq_length"]))

    # The tokenizer first: the same token ids as sentence-transformers, or nothing else matters.
    encs = encode(fixture["sentences"])
    counts = [len(e.ids) for e in encs]
    if counts != list(fixture["token_counts"]):
        bad = [(i, c, r) for i, (c, r) in enumerate(zip(counts, fixture["token_counts"])) if c != r]
        fail(f"token counts differ from the fixture's, as (sentence, got, want): {bad}")
    log(f"tokenizer: token counts of the {len(encs)} fixture sentences match")

    fp32_dir = os.path.join(args.out, args.name)
    int8_dir = os.path.join(args.out, args.name + "-int8")
    fp32_path = os.path.join(fp32_dir, "onnx", "model.onnx")
    int8_path = os.path.join(int8_dir, "onnx", "model.onnx")
    link_source(src, fp32_dir)
    link_source(src, int8_dir)
    reference = np.asarray(fixture["embeddings"], np.float32)

    inputs = [weights_path, config_path, os.path.abspath(__file__)]
    if not args.force and newer_than(fp32_path, inputs) and newer_than(int8_path, inputs):
        log(f"{fp32_path} and {int8_path} are up to date (--force rebuilds them)")
        failed = [path for name, path, minimum in (("fp32", fp32_path, FP32_MIN_COSINE),
                                                   ("int8", int8_path, INT8_MIN_COSINE))
                  if not check(name, path, encs, reference, minimum)]
        for path in failed:
            os.unlink(path)  # so that the next run rebuilds it
        if failed:
            fail(f"{', '.join(failed)} do not match the sentence-transformers reference (removed; rerun to rebuild)")
        return 0

    model = build_bert(read_safetensors(weights_path), config)
    write_atomically(fp32_path, lambda tmp: onnx.save(model, tmp))
    log(f"wrote {fp32_path} ({time.time() - t0:.1f}s)")
    if not check("fp32", fp32_path, encs, reference, FP32_MIN_COSINE):
        os.unlink(fp32_path)
        fail("the fp32 export does not match the sentence-transformers reference embeddings")

    prepared, keep_fp32 = prepare_for_int8(model, activation_ranges(model, encode))
    for reduce_range in (REDUCE_RANGE, not REDUCE_RANGE):
        write_atomically(int8_path, lambda tmp: quantize(prepared, keep_fp32, tmp, reduce_range))
        log(f"wrote {int8_path} (QInt8, per_channel={PER_CHANNEL}, reduce_range={reduce_range}; "
            f"{time.time() - t0:.1f}s)")
        if check("int8", int8_path, encs, reference, INT8_MIN_COSINE):
            break
        # Without VNNI, x86 multiplies u8 x s8 pairs into saturating int16 lanes: 7-bit
        # weights (reduce_range) avoid that at a small cost in precision.
    else:
        os.unlink(int8_path)
        fail("the int8 model does not match the sentence-transformers reference embeddings")

    for path in (fp32_path, int8_path):
        log(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB; ops: {op_summary(path)}")
    log(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
