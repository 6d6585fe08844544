"""OCR through SnoozeML: the PP-OCR pipeline (detection, direction classification,
recognition) with every inference served over KServe v2 by `tritonclient.http`.

    .venv/bin/python examples/ocr_kserve.py                       # renders and reads a sentence
    .venv/bin/python examples/ocr_kserve.py --text "Hello there"
    .venv/bin/python examples/ocr_kserve.py --image photo.png     # reads an image file
    .venv/bin/python examples/ocr_kserve.py --local               # onnxruntime in-process instead

The server must serve the three models `make prepare` links (scripts/link_ocr_models.py):
ocr-det, ocr-cls and ocr-rec; the default config serves every folder of models/.

Pre- and post-processing follow rapidocr 3.10.0 (its ch_ppocr_det/cls/rec and config.yaml)
with numpy and Pillow only, no OpenCV: cv2.resize's INTER_LINEAR is redone in numpy; the DB
post-processing labels connected regions of the thresholded probability map and keeps their
axis-aligned boxes (rapidocr takes cv2.minAreaRect of each contour, the same box for
horizontal text), expanded by rapidocr's unclip distance (area * unclip_ratio / perimeter).

The pipeline only needs an `infer_fn(model, x) -> y` (first input in, first output out):
`triton_infer(client)` sends it to the server, `ort_infer(models_dir)` runs onnxruntime
in-process, `recording(fn, log)` keeps every (model, x, y) for comparisons.
"""

import argparse
import math
import os
import sys
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageFont

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODELS = os.path.join(ROOT, "models")
DET, CLS, REC = "ocr-det", "ocr-cls", "ocr-rec"
DEFAULT_TEXT = "SnoozeML reads this line"

# rapidocr 3.10.0 config.yaml (Global, Det, Cls, Rec) and the constants in its sources.
MIN_SIDE_LEN, MAX_SIDE_LEN = 30, 2000  # Global: resize_image_within_bounds
MIN_HEIGHT, WIDTH_HEIGHT_RATIO = 30, 8  # Global: use_vertical_padding
TEXT_SCORE = 0.5  # Global.text_score: recognised lines below are dropped
DET_LIMIT_SIDE_LEN, DET_LIMIT_TYPE = 736, "min"
DET_MEAN, DET_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
DET_THRESH, DET_BOX_THRESH, DET_UNCLIP_RATIO, DET_MIN_SIZE = 0.3, 0.5, 1.6, 3
DET_MAX_CANDIDATES = 1000
BOX_SORT_Y_THRESHOLD = 10
CLS_SHAPE = (3, 48, 192)  # PP-OCRv4 cls shape (the mobile v2.0 cls model rapidocr pairs it with)
CLS_THRESH, CLS_LABELS = 0.9, ("0", "180")
REC_SHAPE = (3, 48, 320)  # width is a minimum: wider lines keep their aspect ratio

InferFn = Callable[[str, np.ndarray], np.ndarray]


# --- inference back-ends -------------------------------------------------------------------

def triton_infer(client, binary: bool = True) -> InferFn:
    """Inference by SnoozeML through a `tritonclient.http.InferenceServerClient`; the input
    and output names come from each model's KServe v2 metadata."""
    import tritonclient.http as httpclient

    names = {}

    def infer(model: str, x: np.ndarray) -> np.ndarray:
        if model not in names:
            meta = client.get_model_metadata(model)
            names[model] = (meta["inputs"][0]["name"], meta["outputs"][0]["name"])
        in_name, out_name = names[model]
        inp = httpclient.InferInput(in_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(np.ascontiguousarray(x, dtype=np.float32), binary_data=binary)
        out = httpclient.InferRequestedOutput(out_name, binary_data=binary)
        return client.infer(model, [inp], outputs=[out]).as_numpy(out_name)

    return infer


def ort_infer(models_dir: str = MODELS, **session_options) -> InferFn:
    """The same models run by onnxruntime in this process (for comparisons)."""
    import onnxruntime as ort

    sessions = {}

    def infer(model: str, x: np.ndarray) -> np.ndarray:
        if model not in sessions:
            opts = ort.SessionOptions()
            for k, v in session_options.items():
                setattr(opts, k, v)
            sessions[model] = ort.InferenceSession(
                os.path.join(models_dir, model, "model.onnx"), opts, providers=["CPUExecutionProvider"])
        s = sessions[model]
        return s.run([s.get_outputs()[0].name], {s.get_inputs()[0].name: x})[0]

    return infer


def recording(fn: InferFn, log: list) -> InferFn:
    """`fn`, appending (model, x, y) to `log` for every call."""

    def infer(model: str, x: np.ndarray) -> np.ndarray:
        y = fn(model, x)
        log.append((model, x, y))
        return y

    return infer


# --- the dictionary ------------------------------------------------------------------------

def load_characters(models_dir: str = MODELS) -> List[str]:
    """The rec model's characters: models/ocr-rec/keys.txt (written by link_ocr_models.py
    from the model's `character` metadata), or that metadata read from the ONNX file."""
    keys = os.path.join(models_dir, REC, "keys.txt")
    if os.path.isfile(keys):
        with open(keys, encoding="utf-8", newline="") as f:
            chars = f.read().split("\n")
        return chars[:-1] if chars and chars[-1] == "" else chars
    import onnx

    m = onnx.load(os.path.join(models_dir, REC, "model.onnx"), load_external_data=False)
    for p in m.metadata_props:
        if p.key == "character":
            return p.value.splitlines()  # as rapidocr's onnxruntime engine reads it
    raise RuntimeError(f"no dictionary: neither {keys} nor a `character` entry in the rec model's metadata")


class CTCDecoder:
    """rapidocr's CTCLabelDecode: index 0 is the CTC blank, the dictionary follows, and
    a space is appended as the last class; repeats collapse, blanks drop."""

    def __init__(self, characters: Sequence[str]):
        self.character = ["blank", *characters, " "]

    def __call__(self, preds: np.ndarray) -> List[Tuple[str, float]]:
        idx, prob = preds.argmax(axis=2), preds.max(axis=2)
        results = []
        for tokens, probs in zip(idx, prob):
            keep = np.ones(len(tokens), dtype=bool)
            keep[1:] = tokens[1:] != tokens[:-1]
            keep &= tokens != 0
            conf = [round(float(c), 5) for c in probs[keep]] or [0.0]
            text = "".join(self.character[t] for t in tokens[keep])
            results.append((text, round(float(np.mean(conf)), 5)))
        return results


# --- image helpers (numpy stand-ins for the cv2 calls rapidocr makes) ----------------------

def resize_linear(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """cv2.resize(img, (width, height)) with INTER_LINEAR: half-pixel centres, edge clamp,
    no anti-aliasing (OpenCV rounds in fixed point, this in float: +-1 at most)."""
    h, w = img.shape[:2]

    def axis(n_out, n_in):
        s = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        s = np.maximum(s, 0.0)
        i0 = np.minimum(np.floor(s).astype(np.int64), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, (s - i0).astype(np.float32)

    y0, y1, fy = axis(height, h)
    x0, x1, fx = axis(width, w)
    src = img.astype(np.float32)
    fx = fx[None, :, None] if img.ndim == 3 else fx[None, :]
    fy = fy[:, None, None] if img.ndim == 3 else fy[:, None]
    top = src[y0][:, x0] * (1 - fx) + src[y0][:, x1] * fx
    bottom = src[y1][:, x0] * (1 - fx) + src[y1][:, x1] * fx
    out = top * (1 - fy) + bottom * fy
    return np.clip(np.rint(out), 0, 255).astype(img.dtype)


def to_bgr(image) -> np.ndarray:
    """A PIL image or an RGB array as the HxWx3 uint8 BGR array rapidocr works on."""
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    return np.ascontiguousarray(arr[:, :, 2::-1]).astype(np.uint8)


def render(text: str = DEFAULT_TEXT, size: int = 32, height: Optional[int] = None) -> Image.Image:
    """Black `text` on a white page in Pillow's bundled font (FreeType, Pillow >= 10.1):
    one font size of margin left and right, the line centred in a page 10 sizes tall.
    A page rather than a tight strip: rapidocr's detector scales the short side up to
    736 px, and a strip's text, magnified ~13x, comes out as word boxes that overlap."""
    font = ImageFont.load_default(size=size)
    left, top, right, bottom = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), text, font=font)
    w, h = right - left + 2 * size, max(height or 10 * size, bottom - top + 2 * size)
    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).text((size - left, (h - (bottom - top)) // 2 - top), text, fill="black", font=font)
    return img


# --- rapidocr's whole-image steps ----------------------------------------------------------

def _round32(n: float) -> int:
    return int(round(n / 32) * 32)


def within_bounds(img: np.ndarray) -> np.ndarray:
    """RapidOCR.preprocess_img: max side <= 2000, min side >= 30 (multiples of 32 if resized)."""
    h, w = img.shape[:2]
    if max(h, w) > MAX_SIDE_LEN:
        r = MAX_SIDE_LEN / max(h, w)
        img = resize_linear(img, _round32(int(w * r)), _round32(int(h * r)))
    h, w = img.shape[:2]
    if min(h, w) < MIN_SIDE_LEN:
        r = MIN_SIDE_LEN / min(h, w)
        img = resize_linear(img, _round32(int(w * r)), _round32(int(h * r)))
    return img


def vertical_padding(img: np.ndarray) -> np.ndarray:
    """apply_vertical_padding: very flat or short images get black bands above and below."""
    h, w = img.shape[:2]
    if h <= MIN_HEIGHT or w / h > WIDTH_HEIGHT_RATIO:
        new_h = max(int(w / WIDTH_HEIGHT_RATIO), MIN_HEIGHT) * 2
        pad = int(abs(new_h - h) / 2)
        img = np.pad(img, ((pad, pad), (0, 0), (0, 0)))
    return img


# --- detection -----------------------------------------------------------------------------

def det_preprocess(img: np.ndarray, limit_side_len: int = DET_LIMIT_SIDE_LEN,
                   limit_type: str = DET_LIMIT_TYPE) -> Optional[np.ndarray]:
    """DetPreProcess: resize to multiples of 32 under the limit, (x/255 - mean)/std, NCHW."""
    h, w = img.shape[:2]
    ratio = 1.0
    if limit_type == "max":
        if max(h, w) > limit_side_len:
            ratio = limit_side_len / max(h, w)
    elif min(h, w) < limit_side_len:
        ratio = limit_side_len / min(h, w)
    rh, rw = _round32(int(h * ratio)), _round32(int(w * ratio))
    if rh <= 0 or rw <= 0:
        return None
    x = resize_linear(img, rw, rh).astype(np.float32) * np.float32(1 / 255.0)
    x = (x - np.array(DET_MEAN)) / np.array(DET_STD)  # float64 like rapidocr, cast below
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None]).astype(np.float32)


def _components(mask: np.ndarray) -> List[Tuple[int, int, int, int]]:
    """Bounding boxes (x0, y0, x1, y1, inclusive) of the 8-connected regions of `mask`,
    by runs of each row joined to the overlapping runs of the row above (union-find)."""
    runs = []  # (y, start, end) inclusive
    row_runs = []
    padded = np.zeros((mask.shape[0], mask.shape[1] + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)
    for y in range(mask.shape[0]):
        starts = np.flatnonzero(edges[y] == 1)
        ends = np.flatnonzero(edges[y] == -1) - 1
        first = len(runs)
        runs.extend((y, int(s), int(e)) for s, e in zip(starts, ends))
        row_runs.append(range(first, len(runs)))
    parent = list(range(len(runs)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for y in range(1, mask.shape[0]):
        above = row_runs[y - 1]
        for i in row_runs[y]:
            _, s, e = runs[i]
            for j in above:
                _, s2, e2 = runs[j]
                if s <= e2 + 1 and s2 <= e + 1:  # touching, diagonals included
                    parent[find(i)] = find(j)
    boxes = {}
    for i, (y, s, e) in enumerate(runs):
        r = find(i)
        b = boxes.get(r)
        boxes[r] = (s, y, e, y) if b is None else (min(b[0], s), min(b[1], y), max(b[2], e), max(b[3], y))
    return list(boxes.values())


def db_postprocess(pred: np.ndarray, src_h: int, src_w: int, thresh: float = DET_THRESH,
                   box_thresh: float = DET_BOX_THRESH, unclip_ratio: float = DET_UNCLIP_RATIO
                   ) -> List[Tuple[np.ndarray, float]]:
    """DBPostProcess on an [1, 1, H, W] probability map: boxes (4 points, tl tr br bl, in
    the source image's pixels) with their mean probability, sorted top-down, left-right."""
    prob = pred[0, 0]
    height, width = prob.shape
    mask = (prob > thresh).astype(np.uint8)
    # cv2.dilate with the 2x2 kernel of use_dilation (anchor 1,1): max over the pixel,
    # its left, upper and upper-left neighbours.
    d = mask.copy()
    d[:, 1:] |= mask[:, :-1]
    d[1:, :] |= mask[:-1, :]
    d[1:, 1:] |= mask[:-1, :-1]
    out = []
    for x0, y0, x1, y1 in _components(d)[:DET_MAX_CANDIDATES]:
        w, h = x1 - x0, y1 - y0  # the contour's rectangle, through pixel centres
        if min(w, h) < DET_MIN_SIZE:
            continue
        score = float(prob[y0:y1 + 1, x0:x1 + 1].mean())  # box_score_fast
        if score < box_thresh:
            continue
        # unclip: pyclipper's rounded offset by area * ratio / perimeter; its min-area
        # rectangle is the box grown by that distance on every side.
        dist = (w * h) * unclip_ratio / (2 * (w + h))
        bx0, by0, bx1, by1 = x0 - dist, y0 - dist, x1 + dist, y1 + dist
        if min(bx1 - bx0, by1 - by0) < DET_MIN_SIZE + 2:
            continue
        xs = np.clip(np.round(np.array([bx0, bx1]) / width * src_w), 0, src_w)
        ys = np.clip(np.round(np.array([by0, by1]) / height * src_h), 0, src_h)
        # filter_det_res: clip to the last pixel, drop slivers.
        xs = np.minimum(xs, src_w - 1)
        ys = np.minimum(ys, src_h - 1)
        if xs[1] - xs[0] <= 3 or ys[1] - ys[0] <= 3:
            continue
        box = np.array([[xs[0], ys[0]], [xs[1], ys[0]], [xs[1], ys[1]], [xs[0], ys[1]]], dtype=np.float32)
        out.append((box, score))
    return sort_boxes(out)


def sort_boxes(boxes: List[Tuple[np.ndarray, float]]) -> List[Tuple[np.ndarray, float]]:
    """TextDetector.sorted_boxes: by top, boxes within 10 px of the previous one on a line,
    each line by left edge."""
    if not boxes:
        return boxes
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0, 1])
    line, prev, keyed = 0, None, []
    for i in order:
        y = boxes[i][0][0, 1]
        if prev is not None and y - prev >= BOX_SORT_Y_THRESHOLD:
            line += 1
        prev = y
        keyed.append((line, boxes[i][0][0, 0], i))
    return [boxes[i] for _, _, i in sorted(keyed, key=lambda k: (k[0], k[1]))]


def crop(img: np.ndarray, box: np.ndarray) -> np.ndarray:
    """get_rotate_crop_image for an axis-aligned box (the perspective warp is then a plain
    crop); tall crops are turned 90 degrees as rapidocr does."""
    x0, y0 = int(box[0, 0]), int(box[0, 1])
    w = int(np.linalg.norm(box[0] - box[1]))
    h = int(np.linalg.norm(box[0] - box[3]))
    out = img[y0:y0 + h, x0:x0 + w]
    if out.shape[0] / out.shape[1] >= 1.5:
        out = np.rot90(out)
    return np.ascontiguousarray(out)


def detect(infer: InferFn, img: np.ndarray, **det_options) -> List[Tuple[np.ndarray, float]]:
    x = det_preprocess(img, **det_options)
    if x is None:
        return []
    return db_postprocess(infer(DET, x), img.shape[0], img.shape[1])


# --- classification and recognition --------------------------------------------------------

def _resize_norm(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """Both cls and rec: keep the aspect ratio at `height` (up to `width`), x/255 then
    (x - 0.5)/0.5, zero-pad on the right to `width`; [3, height, width] float32."""
    h, w = img.shape[:2]
    resized_w = min(width, int(math.ceil(height * w / float(h))))
    r = resize_linear(img, resized_w, height).astype(np.float32).transpose(2, 0, 1) / 255
    r -= 0.5
    r /= 0.5
    out = np.zeros((3, height, width), dtype=np.float32)
    out[:, :, :resized_w] = r
    return out


def cls_input(img: np.ndarray) -> np.ndarray:
    return _resize_norm(img, CLS_SHAPE[1], CLS_SHAPE[2])[None]


def rec_input(img: np.ndarray) -> np.ndarray:
    """[1, 3, 48, W]: W = 48 * max(320/48, the crop's w/h), as rapidocr sizes a batch of one."""
    _, h, w = REC_SHAPE
    max_wh_ratio = max(w / h, img.shape[1] / img.shape[0])
    return _resize_norm(img, h, int(h * max_wh_ratio))[None]


def classify(infer: InferFn, img: np.ndarray) -> Tuple[np.ndarray, str, float]:
    """The crop turned upright if cls says 180 with more than CLS_THRESH; label, score."""
    probs = infer(CLS, cls_input(img))[0]
    i = int(probs.argmax())
    label, score = CLS_LABELS[i], float(probs[i])
    if "180" in label and score > CLS_THRESH:
        img = np.ascontiguousarray(img[::-1, ::-1])
    return img, label, score


def recognize(infer: InferFn, img: np.ndarray, decoder: CTCDecoder) -> Tuple[str, float]:
    return decoder(infer(REC, rec_input(img)))[0]


# --- the pipeline --------------------------------------------------------------------------

_decoder: Optional[CTCDecoder] = None


def default_decoder() -> CTCDecoder:
    """The decoder for models/ocr-rec's dictionary, read once."""
    global _decoder
    if _decoder is None:
        _decoder = CTCDecoder(load_characters(MODELS))
    return _decoder


def ocr_lines(client_or_infer, image, decoder: Optional[CTCDecoder] = None,
              **det_options) -> List[Tuple[str, float, np.ndarray]]:
    """(text, score, box) for every line read in `image` (a PIL image, or an HxWx3 RGB
    array), in reading order; boxes are in the coordinates of the detector's input image
    (after rapidocr's bounds and padding steps)."""
    infer = client_or_infer if callable(client_or_infer) else triton_infer(client_or_infer)
    decoder = decoder or default_decoder()
    img = vertical_padding(within_bounds(to_bgr(image)))
    lines = []
    for box, _ in detect(infer, img, **det_options):
        piece, _, _ = classify(infer, crop(img, box))
        text, score = recognize(infer, piece, decoder)
        if text.strip() and score >= TEXT_SCORE:
            lines.append((text, score, box))
    return lines


def ocr(client_or_infer, image, **options) -> str:
    """The text in `image`: lines in reading order, one a line. `client_or_infer` is a
    tritonclient.http.InferenceServerClient or an `infer_fn(model, x) -> y`."""
    return "\n".join(text for text, _, _ in ocr_lines(client_or_infer, image, **options))


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description="PP-OCR over KServe v2: det, cls and rec served by SnoozeML")
    ap.add_argument("words", nargs="*", help="the sentence to render (default: %r)" % DEFAULT_TEXT)
    ap.add_argument("--text", help="the sentence to render (same as the positional words)")
    ap.add_argument("--image", help="read this image file instead of rendering a sentence")
    ap.add_argument("--size", type=int, default=32, help="font size of the rendered sentence")
    ap.add_argument("--save", help="save the rendered image here")
    ap.add_argument("--url", default="localhost:8080", help="SnoozeML's HTTP address (default localhost:8080)")
    ap.add_argument("--local", action="store_true", help="run the models with onnxruntime in-process instead")
    ap.add_argument("--models", default=MODELS,
                    help="where ocr-rec/keys.txt (or ocr-rec/model.onnx) gives the dictionary; --local's models")
    args = ap.parse_args(argv)

    if args.image:
        image = Image.open(args.image)
        expected = None
    else:
        expected = args.text or " ".join(args.words) or DEFAULT_TEXT
        image = render(expected, size=args.size)
        if args.save:
            image.save(args.save)
    if args.local:
        infer = ort_infer(args.models)
    else:
        import tritonclient.http as httpclient

        url = args.url.split("://", 1)[-1]
        infer = triton_infer(httpclient.InferenceServerClient(url))
    lines = ocr_lines(infer, image, decoder=CTCDecoder(load_characters(args.models)))
    for line, score, box in lines:
        (x0, y0), (x1, y1) = box[0].astype(int), box[2].astype(int)
        print(f"[{x0},{y0} {x1},{y1}] score {score:.3f}: {line}", file=sys.stderr)
    text = "\n".join(line for line, _, _ in lines)
    print(text)
    if expected is not None and text != expected:
        print(f"(rendered: {expected!r})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
