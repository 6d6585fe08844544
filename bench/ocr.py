#!/usr/bin/env python3
"""OCR images/s: the PP-OCR pipeline through SnoozeML vs rapidocr in-process, same machine,
same run, the same three ONNX files (PP-OCRv6 det and rec small, ch_ppocr_mobile_v2.0 cls).

    snooze    examples/ocr_client.py's pipeline, every det/cls/rec inference sent to the
              server (models/ocr-det, ocr-cls, ocr-rec, keep_alive -1) by tritonclient.http
              (KServe v2, binary tensors)
    rapidocr  rapidocr 3.10.0's RapidOCR() in this process, its default onnxruntime engine
              and config, pointed at the same model files
    local     examples/ocr_client.py's pipeline with onnxruntime in this process: the same
              client-side work as `snooze` without the server, to tell the server's share
              from the pipeline's (ocr_client does its image steps in numpy, rapidocr in OpenCV)

Needs the bench venv with the OCR extras, and the release server:

    bench/.venv/bin/pip install -r bench/requirements-st.txt -r bench/requirements-ocr.txt
    make prepare && cargo build --release --bin snooze
    bench/.venv/bin/python bench/ocr.py

A few sentences are rendered as images (ocr_client.render); every contender must read
each of them back exactly before anything is timed. Then each contender is warmed up and
rounds of one pass over all the images are interleaved (the order rotating every round),
so background load hits all of them alike; images/s is the median over the rounds.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from embeddings import (MODELS, Background, contenders, interleaved, loadavg, machine_info, proc_cpu_seconds,  # noqa: E402
                        start_server, stop_server)

import ocr_client as oc  # noqa: E402

SENTENCES = [
    "SnoozeML reads this line",
    "The quick brown fox jumps over the lazy dog",
    "Invoice 2024-117: total 349.50 EUR",
    "Memory is the scarce resource on this machine",
]
CONTENDERS = ["snooze", "rapidocr", "local"]
OCR_MODELS = (oc.DET, oc.CLS, oc.REC)


def rapidocr_engine():
    from rapidocr import RapidOCR

    return RapidOCR(params={
        "Global.log_level": "warning",
        "Det.model_path": os.path.join(MODELS, oc.DET, "model.onnx"),
        "Cls.model_path": os.path.join(MODELS, oc.CLS, "model.onnx"),
        "Rec.model_path": os.path.join(MODELS, oc.REC, "model.onnx"),
    })


def rapidocr_text(engine, img):
    out = engine(img)
    return "\n".join(out.txts or ())


class Timed:
    """An infer_fn that adds up the seconds spent in each model's calls."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, {m: 0.0 for m in OCR_MODELS}

    def __call__(self, model, x):
        t = time.perf_counter()
        y = self.fn(model, x)
        self.seconds[model] += time.perf_counter() - t
        return y


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5)")
    ap.add_argument("--passes", type=int, default=1,
                    help="passes over the images in one round (default 1)")
    ap.add_argument("--size", type=int, default=32, help="font size of the rendered sentences (default 32)")
    args = ap.parse_args(argv)
    args.contenders = contenders(ap, args.contenders, CONTENDERS)
    return args


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import onnxruntime
    from importlib.metadata import version

    import tritonclient.http as httpclient

    for m in OCR_MODELS:
        if not os.path.isfile(os.path.join(MODELS, m, "model.onnx")):
            sys.exit(f"{os.path.join(MODELS, m, 'model.onnx')} missing: make prepare")
    t_begin = time.perf_counter()

    images = [oc.render(s, size=args.size) for s in SENTENCES]
    arrays = [oc.to_bgr(img) for img in images]  # what rapidocr gets (cv2's BGR)
    decoder = oc.default_decoder()

    proc = client = None
    funcs = {}
    if "snooze" in args.contenders:
        config = "".join(f'[models.{m}]\npath = "{os.path.join(MODELS, m)}"\nkeep_alive = "-1"\n\n'
                         for m in OCR_MODELS)
        proc, base = start_server(config)
        client = httpclient.InferenceServerClient(base.split("://", 1)[1])
        funcs["snooze"] = Timed(oc.triton_infer(client, binary=True))
    if "local" in args.contenders:
        funcs["local"] = Timed(oc.ort_infer(MODELS))
    engine = rapidocr_engine() if "rapidocr" in args.contenders else None

    def read(c, i):
        if c == "rapidocr":
            return rapidocr_text(engine, arrays[i])
        return oc.ocr(funcs[c], images[i], decoder=decoder)

    try:
        print(machine_info())
        print(f"rapidocr {version('rapidocr')}, onnxruntime {onnxruntime.__version__} "
              f"(in-process, default threads: {os.cpu_count()}), numpy {np.__version__}")
        sizes = ", ".join(f"{im.width}x{im.height}" for im in images)
        print(f"{len(images)} rendered images ({sizes}), font size {args.size}; {args.rounds} interleaved "
              f"rounds of {args.passes} pass(es) over them per contender, medians; {loadavg()}")

        # Load the models (first call) and check every contender reads every image.
        t0 = time.perf_counter()
        for c in args.contenders:
            read(c, 0)
        print(f"models loaded and warmed in {time.perf_counter() - t0:.1f} s")
        wrong = []
        for c in args.contenders:
            for i, want in enumerate(SENTENCES):
                got = read(c, i)
                if got != want:
                    wrong.append(f"  {c}: read {got!r}, rendered {want!r}")
        if wrong:
            sys.exit("misread, nothing timed:\n" + "\n".join(wrong))
        print(f"all {len(args.contenders)} contenders read all {len(images)} images exactly")

        for f in funcs.values():
            f.seconds = dict.fromkeys(OCR_MODELS, 0.0)
        me = os.getpid()
        busy = {c: 0.0 for c in args.contenders}

        def one_pass(c):
            t = time.perf_counter()
            for _ in range(args.passes):
                for i in range(len(images)):
                    read(c, i)
            busy[c] += time.perf_counter() - t

        def cpu(c):
            if c == "snooze":
                return lambda: proc_cpu_seconds(me) + proc_cpu_seconds(proc.pid)
            return lambda: proc_cpu_seconds(me)

        fns = {c: (lambda c=c: one_pass(c), len(images) * args.passes, cpu(c)) for c in args.contenders}
        background = Background([me, proc.pid if proc else None])
        res = interleaved(fns, 0.0, args.rounds)  # its warm-up pass counts in `busy` and the sums alike

        print()
        head = f"{'':>9} " + " ".join(f"{c + ' img/s':>16}" for c in args.contenders)
        print(head)
        print(f"{'median':>9} " + " ".join(f"{res[c][0]:>16.2f}" for c in args.contenders))
        print(f"{'min-max':>9} " + " ".join(f"{min(res[c][2]):>10.2f}-{max(res[c][2]):<5.2f}" for c in args.contenders))
        print(f"{'CPU cores':>9} " + " ".join(f"{res[c][1]:>16.2f}" for c in args.contenders))
        if "snooze" in args.contenders:
            for c in args.contenders:
                if c != "snooze":
                    print(f"snooze / {c}: {res['snooze'][0] / res[c][0]:.2f}x")
        for c, f in funcs.items():
            total = busy[c]
            parts = ", ".join(f"{m} {f.seconds[m] / total:.0%}" for m in OCR_MODELS)
            rest = 1 - sum(f.seconds.values()) / total
            print(f"{c}: share of wall time in inference calls: {parts}; pre/post-processing {rest:.0%}")
        print("(CPU cores: snooze counts the server and this process; the others this process)")
        print(f"\n{background.report()}; {loadavg()}; total {time.perf_counter() - t_begin:.0f} s")
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    main()
