#!/usr/bin/env python3
"""Where the OCR pipeline's time goes, set against this machine's arithmetic: how close to
the cores' peak the three models already run, and so how much faster than rapidocr any
implementation of the same arithmetic could read the fixture pages.

    bench/.venv/bin/python bench/ocr_arith.py      # bench/.venv with requirements-ocr.txt;
                                                   # --server also reads the pages through
                                                   # target/release/snooze's /v1/ocr

1. The peak: ONNX Runtime's own SGEMM (a 2048 x 2048 x 2048 MatMul) on the same threads as
   the pipeline's sessions (2 by default: `--threads`), best of 10.
2. rapidocr 3.10 in-process reads the fixture pages (tests/fixtures/ocr_pages), every ONNX
   Runtime call recorded: the model, its input's shape, its seconds. The server's text
   equals rapidocr's on these pages (bench/ocr.py checks it), so the server feeds its
   sessions the same shapes: the same arithmetic.
3. Each model's arithmetic: the multiply-adds of its convolutions (ONNX shape inference on
   the model at each recorded shape) and of its matrix products (the shapes ONNX Runtime's
   profiler records), counted as 2 FLOP each; the recorded inputs are replayed in a
   profiled session to split the time between those kernels and everything else (layout
   reorders, activations, element-wise adds, resizes). `--rounds` rounds alternate
   rapidocr's pass, the replay and (`--server`) the server's pass; medians.

The last two lines bound what a server can do against rapidocr here. The first: the time
of ONNX Runtime's kernels alone on the recorded inputs — a server that runs the same
sessions (as SnoozeML does) and spends nothing else reads the pages that much faster than
rapidocr, no more. The second: every FLOP at the SGEMM peak and nothing else (no layout
reorders, no activation passes) — the ceiling for any runtime doing the same arithmetic.
"""

import argparse
import collections
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import ocr as bench_ocr  # noqa: E402
from embeddings import MODELS, start_server, stop_server  # noqa: E402

STAGES = {"ocr-det": "det", "ocr-cls": "cls", "ocr-rec": "rec"}
GEMM_OPS = ("Conv", "ConvTranspose", "MatMul", "FusedMatMul", "Gemm")


def sgemm_peak(threads):
    """GFLOP/s of ONNX Runtime's MatMul at 2048^3 on `threads` intra-op threads."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n = 2048
    w = numpy_helper.from_array(np.random.rand(n, n).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "sgemm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.rand(n, n).astype(np.float32)
    sess.run(None, {"x": x})
    best = math.inf
    for _ in range(10):
        t = time.perf_counter()
        sess.run(None, {"x": x})
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


class Rapidocr:
    """rapidocr 3.10 in this process, every ONNX Runtime call of a pass recorded as
    (stage, input shape, seconds)."""

    def __init__(self, threads):
        import onnxruntime as ort

        self.calls = None
        run = ort.InferenceSession.run

        def recorded(session, output_names, input_feed, *args, **kwargs):
            t = time.perf_counter()
            out = run(session, output_names, input_feed, *args, **kwargs)
            if self.calls is not None:
                stage = STAGES[os.path.basename(os.path.dirname(session._model_path))]
                shape = tuple(next(iter(input_feed.values())).shape)
                self.calls.append((stage, shape, time.perf_counter() - t))
            return out

        ort.InferenceSession.run = recorded  # this process runs no other sessions meanwhile
        self.engine = bench_ocr.rapidocr_engine(threads)

    def read(self, pages):
        """Seconds to read every page once, and the pass's calls."""
        self.calls = []
        t = time.perf_counter()
        for data in pages.values():
            self.engine(data)
        seconds, calls, self.calls = time.perf_counter() - t, self.calls, None
        return seconds, calls


@functools.lru_cache(maxsize=None)
def conv_flops(path, shape):
    """2 x the multiply-adds of the model's Conv and ConvTranspose nodes at input `shape`."""
    import onnx
    from onnx import shape_inference

    model = onnx.load(path)
    for dim, v in zip(model.graph.input[0].type.tensor_type.shape.dim, shape):
        dim.ClearField("dim_param")
        dim.dim_value = v
    model = shape_inference.infer_shapes(model, data_prop=True)
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.value_info, *model.graph.output, *model.graph.input]}
    weights = {i.name: list(i.dims) for i in model.graph.initializer}
    weights.update((n.output[0], list(a.t.dims)) for n in model.graph.node if n.op_type == "Constant"
                   for a in n.attribute if a.name == "value")
    weights.update(dims)  # weights given as graph inputs
    total = 0
    for node in model.graph.node:
        if node.op_type in ("Conv", "ConvTranspose"):
            w = weights[node.input[1]]
            # Conv: every output element sums C_in/group x kH x kW products; ConvTranspose:
            # every input element spreads over C_out/group x kH x kW (w is C_in x C_out/g x k).
            per = dims[node.output[0]] if node.op_type == "Conv" else dims[node.input[0]]
            total += 2 * math.prod(per) * math.prod(w[1:])
    return total


def replay(stage, shapes, threads):
    """Runs `shapes` through a profiled session of the stage's model; returns (seconds in
    GEMM-like kernels, seconds in the rest, matrix-product FLOPs, the rest's ops by time)."""
    import numpy as np
    import onnxruntime as ort

    path = stage_path(stage)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    inputs = [np.random.rand(*s).astype(np.float32) for s in shapes]
    with tempfile.TemporaryDirectory(prefix="ocr-arith-") as tmp:
        so.profile_file_prefix = os.path.join(tmp, stage)
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        for x in [inputs[0], *inputs]:  # the first run warms up and is left out below
            sess.run(None, {name: x})
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    timed_from = sorted(e["ts"] for e in events if e["name"] == "model_run")[1]
    events = [e for e in events if e.get("cat") == "Node" and e["ts"] >= timed_from]
    gemm = rest = mm_flops = 0.0
    others = collections.Counter()
    for e in events:
        if not e["name"].endswith("_kernel_time"):
            continue
        op, secs = e["args"]["op_name"], e["dur"] / 1e6
        if op in GEMM_OPS:
            gemm += secs
            if op in ("MatMul", "FusedMatMul", "Gemm"):  # K: A's last axis (no transA here)
                a = e["args"]["input_type_shape"][0]
                out = e["args"]["output_type_shape"][0]
                k = next(iter(a.values()))[-1]
                mm_flops += 2 * math.prod(next(iter(out.values()))) * k
        else:
            rest += secs
            others[op] += secs
    return gemm, rest, mm_flops, others


class Server:
    """target/release/snooze serving bench/ocr.py's pipeline; `read` is one client's pass."""

    def __init__(self, pages):
        self.proc, base = start_server(bench_ocr.server_config())
        self.client = bench_ocr.OcrClient(base)
        self.bodies = [bench_ocr.multipart(n, d) for n, d in pages.items()]

    def read(self):
        """Seconds to read every page once (`POST /v1/ocr`), and seconds per stage as the
        answers' usage reports them."""
        stages, t = collections.Counter(), time.perf_counter()
        for body in self.bodies:
            usage = self.client.post(*body)["usage"]
            for s in STAGES.values():
                stages[s] += usage[f"{s}_ms"] / 1e3
        return time.perf_counter() - t, stages


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every session (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every contender (default 3)")
    ap.add_argument("--server", action="store_true", help="also read the pages through the release server")
    args = ap.parse_args()
    pages = {name: data for name, data, _ in bench_ocr.fixture_pages()}

    peak = sgemm_peak(args.threads)
    rapidocr = Rapidocr(args.threads)
    rapidocr.read(pages)  # warm-up
    _, calls = rapidocr.read(pages)
    shapes = {stage: [c[1] for c in calls if c[0] == stage] for stage in STAGES.values()}
    conv = {stage: sum(conv_flops(stage_path(stage), s) for s in shapes[stage]) for stage in STAGES.values()}
    matmul = {}  # from the replay's profile: the same shapes, so the same count every round
    server = Server(pages) if args.server else None
    # Rounds alternate the contenders, so the machine's drift hits all of them alike.
    rounds = collections.defaultdict(list)
    try:
        if server:
            server.read()  # warm-up
        for _ in range(args.rounds):
            wall, calls = rapidocr.read(pages)
            rounds["rapidocr"].append(wall)
            for stage in STAGES.values():
                rounds[f"rapidocr {stage}"].append(sum(c[2] for c in calls if c[0] == stage))
                gemm, rest, mm_flops, others = replay(stage, shapes[stage], args.threads)
                rounds[f"gemm {stage}"].append(gemm)
                rounds[f"rest {stage}"].append(rest)
                rounds[f"others {stage}"].append(others)
                matmul[stage] = mm_flops
            if server:
                wall, stages = server.read()
                rounds["server"].append(wall)
                for stage in STAGES.values():
                    rounds[f"server {stage}"].append(stages[stage])
    finally:
        if server:
            stop_server(server.proc)

    def med(key):
        return statistics.median(rounds[key])

    n = len(pages)
    print(f"{n} fixture pages; {args.threads} intra-op threads; ONNX Runtime's SGEMM peak here: {peak:.0f} GFLOP/s; "
          f"medians of {args.rounds} rounds\n")
    print(f"{'stage':>5} {'runs':>5} {'GFLOP':>7} {'rapidocr s':>11} {'GFLOP/s':>8} {'GEMM-like s':>12} "
          f"{'their GFLOP/s':>14} {'other ops s':>12} {'server s':>9}  largest other ops")
    total_flops = kernels = 0.0
    for stage in STAGES.values():
        gflop = (conv[stage] + matmul[stage]) / 1e9
        total_flops += gflop
        kernels += med(f"gemm {stage}") + med(f"rest {stage}")
        others = sum(rounds[f"others {stage}"], collections.Counter())
        top = ", ".join(f"{op} {s / args.rounds:.2f}" for op, s in others.most_common(3))
        served = f"{med(f'server {stage}'):>9.2f}" if server else f"{'-':>9}"
        print(f"{stage:>5} {len(shapes[stage]):>5} {gflop:>7.1f} {med(f'rapidocr {stage}'):>11.2f} "
              f"{gflop / med(f'rapidocr {stage}'):>8.0f} {med(f'gemm {stage}'):>12.2f} "
              f"{gflop / med(f'gemm {stage}'):>14.0f} {med(f'rest {stage}'):>12.2f} {served}  {top}")
    wall, at_peak = med("rapidocr"), total_flops / peak
    print(f"\nrapidocr: {wall:.2f} s for the pages ({n / wall:.2f} pages/s)")
    if server:
        print(f"server, one client: {med('server'):.2f} s ({n / med('server'):.2f} pages/s) = "
              f"{wall / med('server'):.2f}x rapidocr")
    print(f"ONNX Runtime's kernels alone (the profiled replay: no pre- or post-processing, no waits): "
          f"{kernels:.2f} s ({n / kernels:.2f} pages/s) = {wall / kernels:.2f}x rapidocr at most with this runtime")
    print(f"every FLOP at the SGEMM peak, nothing else: {at_peak:.2f} s ({n / at_peak:.2f} pages/s) = "
          f"{wall / at_peak:.2f}x rapidocr at most for the same arithmetic")


def stage_path(stage):
    return os.path.join(MODELS, next(m for m, s in STAGES.items() if s == stage), "model.onnx")


if __name__ == "__main__":
    main()
