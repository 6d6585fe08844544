#!/usr/bin/env python3
"""Generate SnoozeML's demo and test ONNX models, deterministically.

Each model is a seeded float32 MLP: y = relu(x @ W1 + b1) @ W2 + b2, input `x` FP32
[batch, 256], output `y` FP32 [batch, 256]. The hidden width sets the file size.
Every model is run through ONNX Runtime once here and checked against numpy, and a
`reference.json` (a fixed input and the numpy output) is written next to it so tests
can check what the server answers without re-deriving the weights.

Layout is a model repository: OUT/NAME/model.onnx (the 400 MB model keeps its weights
in an external-data file, model.onnx.data, as large exported models do). A few test-only
models live under OUT/test/: a corrupt file, and a model of every tensor type.

Idempotent: a model whose files and reference already exist is left alone.
"""

import argparse
import json
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DIM = 256


def hidden_for(size_mb: float) -> int:
    # parameters ~ 2*DIM*H floats of 4 bytes
    return max(8, int(size_mb * 1024 * 1024 / (4 * 2 * DIM)))


def mlp(name: str, hidden: int, seed: int):
    rng = np.random.default_rng(seed)
    scale1 = 1.0 / np.sqrt(DIM)
    scale2 = 1.0 / np.sqrt(hidden)
    w1 = (rng.standard_normal((DIM, hidden), dtype=np.float32) * scale1).astype(np.float32)
    b1 = (rng.standard_normal((hidden,), dtype=np.float32) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((hidden, DIM), dtype=np.float32) * scale2).astype(np.float32)
    b2 = (rng.standard_normal((DIM,), dtype=np.float32) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "B1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "W2"], ["h3"]),
        helper.make_node("Add", ["h3", "B2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", DIM])],
        initializer=[
            numpy_helper.from_array(w1, "W1"),
            numpy_helper.from_array(b1, "B1"),
            numpy_helper.from_array(w2, "W2"),
            numpy_helper.from_array(b2, "B2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8

    def reference(x):
        return np.maximum(x @ w1 + b1, 0.0) @ w2 + b2

    return model, reference


def check_with_ort(path: str, feeds: dict, expected: dict, atol=1e-4):
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(list(expected.keys()), feeds)
    for (name, want), have in zip(expected.items(), got):
        if want.dtype.kind == "f":
            err = float(np.max(np.abs(have.astype(np.float64) - want.astype(np.float64))))
            if err > atol:
                sys.exit(f"{path}: output {name} differs from numpy by {err}")
        elif not np.array_equal(have, want):
            sys.exit(f"{path}: output {name} differs from numpy")


def write_mlp(out: str, name: str, size_mb: float, seed: int, external: bool = False):
    folder = os.path.join(out, name)
    path = os.path.join(folder, "model.onnx")
    ref_path = os.path.join(folder, "reference.json")
    if os.path.exists(path) and os.path.exists(ref_path):
        return
    os.makedirs(folder, exist_ok=True)
    model, reference = mlp(name, hidden_for(size_mb), seed)
    if external:
        onnx.save_model(
            model,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx.data",
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, path)
    x = np.random.default_rng(1000 + seed).standard_normal((2, DIM), dtype=np.float32)
    y = reference(x).astype(np.float32)
    check_with_ort(path, {"x": x}, {"y": y})
    with open(ref_path + ".tmp", "w") as f:
        json.dump({"input": {"x": x.ravel().tolist()}, "shape": [2, DIM],
                   "output": {"y": y.ravel().tolist()}}, f)
    os.replace(ref_path + ".tmp", ref_path)
    total = sum(os.path.getsize(os.path.join(folder, p)) for p in os.listdir(folder))
    print(f"generated {name}: {total / 2**20:.1f} MiB (checked against numpy)")


# ONNX element type, numpy dtype, KServe datatype of every tensor type the
# all-types test model passes through an Identity node.
ALL_TYPES = [
    (TensorProto.BOOL, np.bool_, "BOOL"),
    (TensorProto.UINT8, np.uint8, "UINT8"),
    (TensorProto.UINT16, np.uint16, "UINT16"),
    (TensorProto.UINT32, np.uint32, "UINT32"),
    (TensorProto.UINT64, np.uint64, "UINT64"),
    (TensorProto.INT8, np.int8, "INT8"),
    (TensorProto.INT16, np.int16, "INT16"),
    (TensorProto.INT32, np.int32, "INT32"),
    (TensorProto.INT64, np.int64, "INT64"),
    (TensorProto.FLOAT16, np.float16, "FP16"),
    (TensorProto.FLOAT, np.float32, "FP32"),
    (TensorProto.DOUBLE, np.float64, "FP64"),
    (TensorProto.STRING, np.object_, "BYTES"),
]


def write_all_types(out: str, name: str = "identity-all-types", skip: tuple = ()):
    """Identity for every KServe datatype ORT supports: in_<T> [-1, 3] -> out_<T>
    (`skip`: datatypes left out, e.g. FP16, which gRPC's typed contents cannot carry)."""
    folder = os.path.join(out, "test", name)
    path = os.path.join(folder, "model.onnx")
    if os.path.exists(path):
        return
    os.makedirs(folder, exist_ok=True)
    inputs, outputs, nodes = [], [], []
    types = [t for t in ALL_TYPES if t[2] not in skip]
    for elem, _, kserve in types:
        t = kserve.lower()
        inputs.append(helper.make_tensor_value_info(f"in_{t}", elem, ["batch", 3]))
        outputs.append(helper.make_tensor_value_info(f"out_{t}", elem, ["batch", 3]))
        nodes.append(helper.make_node("Identity", [f"in_{t}"], [f"out_{t}"]))
    graph = helper.make_graph(nodes, "identity_all_types", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save_model(model, path)
    feeds, expected = {}, {}
    for _, dtype, kserve in types:
        t = kserve.lower()
        if dtype is np.object_:
            arr = np.array([["a", "bc", ""], ["déjà", "x", "yz"]], dtype=object)
        elif dtype is np.bool_:
            arr = np.array([[True, False, True], [False, False, True]])
        else:
            arr = np.arange(6).reshape(2, 3).astype(dtype)
        feeds[f"in_{t}"] = arr
        expected[f"out_{t}"] = arr
    check_with_ort(path, feeds, expected)
    print(f"generated test/{name} (checked with onnxruntime)")


def write_corrupt(out: str):
    folder = os.path.join(out, "test", "corrupt")
    path = os.path.join(folder, "model.onnx")
    if os.path.exists(path):
        return
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(7)
    with open(path, "wb") as f:
        f.write(b"\x08\x07this is not an onnx model" + rng.bytes(4096))
    print("generated test/corrupt")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models")
    args = ap.parse_args()
    write_mlp(args.out, "mlp-10m", 10, seed=10)
    for i in range(1, 7):
        write_mlp(args.out, f"mlp-100m-{i}", 100, seed=100 + i)
    write_mlp(args.out, "mlp-400m", 400, seed=400, external=True)
    write_all_types(args.out)
    write_all_types(args.out, "identity-typed", skip=("FP16",))
    write_corrupt(args.out)


if __name__ == "__main__":
    main()
