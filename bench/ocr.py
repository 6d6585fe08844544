#!/usr/bin/env python3
"""OCR images/s: the PP-OCR pipeline through SnoozeML vs rapidocr in-process, same machine,
same run, the same three ONNX files (PP-OCRv6 det and rec small, ch_ppocr_mobile_v2.0 cls).
One server (models/ocr-det, ocr-cls, ocr-rec, keep_alive -1, and `[pipelines.ocr]` over
them) answers every mode.

--mode service: the fixture pages (tests/fixtures/ocr_pages, PNG and JPEG) read by

    snooze-1  `POST /v1/ocr` (multipart, the file as is), one client: the server decodes,
              detects, classifies and recognises
    snooze-4  the same, four clients at once pulling from the same list of pages
    rapidocr  rapidocr 3.10.0's RapidOCR() in this process on the same file bytes, its
              default onnxruntime engine and config, one page after another (as its users
              run it); pages/s with 4 clients is set against this same figure

--mode kserve: a few rendered sentences read by

    snooze    examples/ocr_kserve.py's pipeline, every det/cls/rec inference sent to the
              server by tritonclient.http (KServe v2, binary tensors)
    rapidocr  as above, on the rendered image
    local     examples/ocr_kserve.py's pipeline with onnxruntime in this process: the same
              client-side work as `snooze` without the server, to tell the server's share
              from the pipeline's (ocr_kserve does its image steps in numpy, rapidocr in OpenCV)

--mode pdf: the memory of a 100-page A4 PDF at 150 DPI against one page batch's (see
bench/ocr_pdf.py).

Needs the bench venv with the OCR extras, and the release server:

    bench/.venv/bin/pip install -r bench/requirements-st.txt -r bench/requirements-ocr.txt
    make prepare && cargo build --release --bin snooze
    bench/.venv/bin/python bench/ocr.py                 # every mode; --mode service|kserve|pdf

Before anything is timed, the server's text of every page is compared with rapidocr's
(service mode: reported; kserve mode: every contender must read every rendered sentence
exactly). Then rounds of each contender are interleaved (the order rotating every round),
so background load hits all of them alike; pages/s is the median over the rounds.
"""

import argparse
import glob
import http.client
import json
import os
import statistics
import sys
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from embeddings import (MODELS, Background, contenders, interleaved, loadavg, machine_info, proc_cpu_seconds,  # noqa: E402
                        start_server, stop_server)

import embeddings  # noqa: E402
import ocr_kserve as oc  # noqa: E402
from ocr_pdf import pdf_bench  # noqa: E402

SENTENCES = [
    "SnoozeML reads this line",
    "The quick brown fox jumps over the lazy dog",
    "Invoice 2024-117: total 349.50 EUR",
    "Memory is the scarce resource on this machine",
]
CONTENDERS = ["snooze", "rapidocr", "local"]
OCR_MODELS = (oc.DET, oc.CLS, oc.REC)
PAGES = os.path.join(ROOT, "tests", "fixtures", "ocr_pages")
REFERENCE = os.path.join(ROOT, "tests", "fixtures", "ocr_reference.json")
MODES = ("service", "kserve", "pdf")


def rapidocr_engine(threads=None):
    """rapidocr on the server's three model files; `threads`: its sessions' intra-op
    threads (None: rapidocr's default, ONNX Runtime's)."""
    from rapidocr import RapidOCR

    params = {
        "Global.log_level": "warning",
        "Det.model_path": os.path.join(MODELS, oc.DET, "model.onnx"),
        "Cls.model_path": os.path.join(MODELS, oc.CLS, "model.onnx"),
        "Rec.model_path": os.path.join(MODELS, oc.REC, "model.onnx"),
    }
    if threads is not None:
        params["EngineConfig.onnxruntime.intra_op_num_threads"] = threads
    return RapidOCR(params=params)


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
    ap.add_argument("--mode", default="all", choices=[*MODES, "all"],
                    help="service (POST /v1/ocr on the fixture pages), kserve (the client-side pipeline "
                         "over KServe v2), pdf (the memory of a long PDF, bench/ocr_pdf.py) or all (default)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"kserve mode: comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5)")
    ap.add_argument("--passes", type=int, default=1,
                    help="kserve mode: passes over the images in one round (default 1)")
    ap.add_argument("--page-passes", type=int, default=2,
                    help="service mode: passes over the fixture pages in one round (default 2)")
    ap.add_argument("--clients", type=int, default=4, help="service mode: concurrent clients (default 4)")
    ap.add_argument("--pdf-pages", type=int, default=100, help="pdf mode: pages of the long PDF (default 100)")
    ap.add_argument("--size", type=int, default=32, help="font size of the rendered sentences (default 32)")
    args = ap.parse_args(argv)
    args.contenders = contenders(ap, args.contenders, CONTENDERS)
    args.modes = MODES if args.mode == "all" else (args.mode,)
    return args


def server_config():
    models = "".join(f'[models.{m}]\npath = "{os.path.join(MODELS, m)}"\nkeep_alive = "-1"\n\n' for m in OCR_MODELS)
    return models + f'[pipelines.ocr]\ndet = "{oc.DET}"\ncls = "{oc.CLS}"\nrec = "{oc.REC}"\n'


# --- service mode: POST /v1/ocr on the fixture pages -----------------------------------------

class OcrClient:
    """One keep-alive connection to the server's `POST /v1/ocr`, for one thread."""

    def __init__(self, base):
        self.host, self.conn = base.split("://", 1)[1], None

    def read(self, body, content_type):
        """The text of the page the multipart `body` uploads, lines joined by newlines."""
        return "\n".join(p["text"] for p in self.post(body, content_type)["pages"])

    def post(self, body, content_type):
        """The server's answer (parsed JSON) to the multipart `body`."""
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, timeout=300)
            try:
                self.conn.request("POST", "/v1/ocr", body=body, headers={"Content-Type": content_type})
                r = self.conn.getresponse()
                data = r.read()
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
                continue
            if r.status != 200:
                raise RuntimeError(f"POST /v1/ocr: {r.status} {data.decode(errors='replace')}")
            return json.loads(data)


def multipart(name, data):
    boundary = "bench-" + uuid.uuid4().hex
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n").encode()
    return head + data + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def fixture_pages():
    """(name, file bytes, the lines rapidocr 3.10 read when the fixture was made) per page."""
    with open(REFERENCE) as f:
        reference = {os.path.basename(p["file"]): [line["text"] for line in p["lines"]]
                     for p in json.load(f)["pages"]}
    pages = []
    for path in sorted(glob.glob(os.path.join(PAGES, "*"))):
        name = os.path.basename(path)
        if name.rsplit(".", 1)[-1].lower() in ("png", "jpg", "jpeg"):
            with open(path, "rb") as f:
                pages.append((name, f.read(), reference.get(name)))
    if not pages:
        sys.exit(f"no PNG or JPEG pages in {PAGES}")
    return pages


def service_bench(args, proc, base, engine):
    pages = fixture_pages()
    bodies = [multipart(name, data) for name, data, _ in pages]
    client = OcrClient(base)
    print(f"\n--- service mode: POST /v1/ocr vs rapidocr in-process; {len(pages)} fixture pages "
          f"({', '.join(n for n, _, _ in pages)}); {args.rounds} interleaved rounds of {args.page_passes} "
          f"pass(es) over them per contender, medians; {loadavg()}")

    # Warm-up and words: every page once each; the server's text against rapidocr's.
    t0 = time.perf_counter()
    texts = {"snooze": [client.read(*b) for b in bodies],
             "rapidocr": [rapidocr_text(engine, data) for _, data, _ in pages]}
    print(f"models loaded and every page read once by both in {time.perf_counter() - t0:.1f} s")
    same = sum(a == b for a, b in zip(texts["snooze"], texts["rapidocr"]))
    print(f"same text as rapidocr on {same}/{len(pages)} pages")
    for (name, _, ref), s, r in zip(pages, texts["snooze"], texts["rapidocr"]):
        if s != r:
            print(f"  {name}: snooze {s!r}\n  {' ' * len(name)}  rapidocr {r!r}")
        if ref is not None and r.split("\n") != ref:
            print(f"  {name}: rapidocr now reads other lines than the fixture recorded")

    jobs_per_round = len(pages) * args.page_passes
    me = os.getpid()
    changed = set()

    def sequential(read):
        for _ in range(args.page_passes):
            for i in range(len(pages)):
                yield i, read(i)

    def run_rapidocr():
        for i, text in sequential(lambda i: rapidocr_text(engine, pages[i][1])):
            if text != texts["rapidocr"][i]:
                changed.add(f"rapidocr {pages[i][0]}")

    def run_snooze_1():
        for i, text in sequential(lambda i: client.read(*bodies[i])):
            if text != texts["snooze"][i]:
                changed.add(f"snooze-1 {pages[i][0]}")

    clients = [OcrClient(base) for _ in range(args.clients)]

    def run_snooze_n():
        queue = [i for _ in range(args.page_passes) for i in range(len(pages))]
        lock, failures = threading.Lock(), []

        def worker(c):
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop()
                try:
                    text = c.read(*bodies[i])
                except Exception as e:  # reported after the round; the other clients go on
                    failures.append(f"{pages[i][0]}: {e}")
                    continue
                if text != texts["snooze"][i]:
                    changed.add(f"snooze-{args.clients} {pages[i][0]}")

        threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            sys.exit(f"{len(failures)} concurrent request(s) failed:\n  " + "\n  ".join(failures[:5]))

    both = lambda: proc_cpu_seconds(me) + proc_cpu_seconds(proc.pid)  # noqa: E731
    names = ["rapidocr", "snooze-1", f"snooze-{args.clients}"]
    fns = {"rapidocr": (run_rapidocr, jobs_per_round, lambda: proc_cpu_seconds(me)),
           "snooze-1": (run_snooze_1, jobs_per_round, both),
           names[2]: (run_snooze_n, jobs_per_round, both)}
    background = Background([me, proc.pid])
    res = interleaved(fns, 0.0, args.rounds)  # one call per round; its own warm-up pass first

    print(f"\n{'':>9} " + " ".join(f"{n + ' pages/s':>18}" for n in names))
    print(f"{'median':>9} " + " ".join(f"{res[n][0]:>18.2f}" for n in names))
    print(f"{'min-max':>9} " + " ".join(f"{f'{min(res[n][2]):.2f}-{max(res[n][2]):.2f}':>18}" for n in names))
    print(f"{'CPU cores':>9} " + " ".join(f"{res[n][1]:>18.2f}" for n in names))
    r = res["rapidocr"][0]
    print(f"snooze-1 / rapidocr: {res['snooze-1'][0] / r:.2f}x (target >= 1.2x); "
          f"{names[2]} / rapidocr: {res[names[2]][0] / r:.2f}x (target >= 1.5x)")
    print("(CPU cores: snooze counts the server and this process; rapidocr this process)")
    print(f"texts that changed after the first pass: {', '.join(sorted(changed)) if changed else 'none'}")
    print(f"{background.report()}; {loadavg()}")


# --- kserve mode: the client-side pipeline over KServe v2 -------------------------------------

def kserve_bench(args, proc, base, engine):
    import tritonclient.http as httpclient

    images = [oc.render(s, size=args.size) for s in SENTENCES]
    arrays = [oc.to_bgr(img) for img in images]  # what rapidocr gets (cv2's BGR)
    decoder = oc.default_decoder()
    funcs = {}
    if "snooze" in args.contenders:
        client = httpclient.InferenceServerClient(base.split("://", 1)[1])
        funcs["snooze"] = Timed(oc.triton_infer(client, binary=True))
    if "local" in args.contenders:
        funcs["local"] = Timed(oc.ort_infer(MODELS))

    def read(c, i):
        if c == "rapidocr":
            return rapidocr_text(engine, arrays[i])
        return oc.ocr(funcs[c], images[i], decoder=decoder)

    sizes = ", ".join(f"{im.width}x{im.height}" for im in images)
    print(f"\n--- kserve mode: examples/ocr_kserve.py over KServe v2 vs rapidocr; {len(images)} rendered "
          f"images ({sizes}), font size {args.size}; {args.rounds} interleaved rounds of {args.passes} "
          f"pass(es) over them per contender, medians; {loadavg()}")

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
    print(f"{'':>9} " + " ".join(f"{c + ' img/s':>16}" for c in args.contenders))
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
    print(f"{background.report()}; {loadavg()}")


def main(argv=None):
    args = parse_args(argv)
    # The release server of this checkout: $CARGO_TARGET_DIR if set, else target/.
    embeddings.BINARY = os.path.join(ROOT, os.environ.get("CARGO_TARGET_DIR") or "target", "release", "snooze")
    import numpy as np
    import onnxruntime
    from importlib.metadata import version

    for m in OCR_MODELS:
        if not os.path.isfile(os.path.join(MODELS, m, "model.onnx")):
            sys.exit(f"{os.path.join(MODELS, m, 'model.onnx')} missing: make prepare")
    t_begin = time.perf_counter()
    kserve = "kserve" in args.modes
    need_server = "service" in args.modes or "pdf" in args.modes or (kserve and "snooze" in args.contenders)
    need_rapidocr = "service" in args.modes or (kserve and "rapidocr" in args.contenders)
    proc = base = None
    try:
        if need_server:
            proc, base = start_server(server_config())
        engine = rapidocr_engine() if need_rapidocr else None
        print(machine_info())
        print(f"rapidocr {version('rapidocr')}, onnxruntime {onnxruntime.__version__} "
              f"(in-process, default threads: {os.cpu_count()}), numpy {np.__version__}; {loadavg()}")
        if "service" in args.modes:
            service_bench(args, proc, base, engine)
        if "kserve" in args.modes:
            kserve_bench(args, proc, base, engine)
        if "pdf" in args.modes:
            pdf_bench(args, proc, base, multipart)
        print(f"\ntotal {time.perf_counter() - t_begin:.0f} s")
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    main()
