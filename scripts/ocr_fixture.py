"""The OCR reference: test pages rendered with Pillow, read by rapidocr 3.10 in-process.

    bench/.venv/bin/python scripts/ocr_fixture.py        # rewrites tests/fixtures/ocr_*

Writes, under tests/fixtures/:
  ocr_pages/*.png, *.jpg   the pages (grey PNGs where the page is black on white)
  ocr_pages/text.pdf       a hand-written PDF (standard fonts, one turned line): ground truth only
  ocr_pages/locked.pdf     the same, password-protected (user password "secret")
  ocr_reference.json       per page: how it was drawn, the text drawn, and what rapidocr found
                           (detector boxes on its padded image, classifier and recogniser
                           results per box, the final lines); plus OpenCV / pyclipper numbers
                           for the geometry unit tests (resize, warp, unclip)

Why the pages are committed rather than drawn at test time: CI has the project .venv
(Pillow, no OpenCV, no rapidocr dependencies) and whatever FreeType the distribution ships;
glyphs rasterised by another FreeType differ by a grey level here and there, and the
reference must be rapidocr's reading of the very pixels the Rust test reads. Committing
~0.5 MB of grey PNGs makes the comparison exact and CI needs neither fonts nor Python.

Needs bench/.venv (make bench/.venv/.ocr-stamp): rapidocr 3.10.0, opencv-python-headless,
pyclipper; the fonts of Debian's fonts-dejavu-core and fonts-liberation.
"""

import hashlib
import io
import json
import math
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFont

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
PAGES = os.path.join(FIXTURES, "ocr_pages")
DEJAVU = "/usr/share/fonts/truetype/dejavu"
LIBERATION = "/usr/share/fonts/truetype/liberation"
FONTS = {
    "DejaVuSans": f"{DEJAVU}/DejaVuSans.ttf",
    "DejaVuSerif": f"{DEJAVU}/DejaVuSerif.ttf",
    "DejaVuSansMono": f"{DEJAVU}/DejaVuSansMono.ttf",
    "LiberationSans": f"{LIBERATION}/LiberationSans-Regular.ttf",
    "LiberationSerif": f"{LIBERATION}/LiberationSerif-Regular.ttf",
    "LiberationMono": f"{LIBERATION}/LiberationMono-Regular.ttf",
}

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Invoice 2024-117: total due 1,284.50 EUR",
    "Meeting moved to Thursday at 14:30 in room B",
    "Please keep this receipt for your records.",
    "SnoozeML loads models when they are asked for",
    "Order #88412 shipped on 12 March via parcel post",
    "Temperature range: -20 to +45 degrees Celsius",
    "Contact support@example.com or call 555-0199",
    "All sales are final after thirty days.",
    "Chapter 7: The night train to Vienna",
    "Batch size 6, threshold 0.5, ratio 1.6",
    "Read the manual before first use!",
]

COLUMN_TEXT = [
    "Idle models are put to sleep", "after their keep-alive ends,", "and loaded again on the next",
    "request. When memory runs low", "the least recently used idle", "model is evicted first.",
    "Requests that cannot wait are", "answered with 503 and a", "Retry-After header instead.",
    "Each model has a queue with", "a bound on its length and", "on how long a request waits.",
]
COLUMN_TEXT_RIGHT = [
    "The detector finds text lines", "as rotated boxes on a map", "of probabilities; each box", "is cut out and straightened,",
    "turned if it reads upside", "down, and recognised by a", "model that spells it out one", "position at a time.",
    "Scores under one half are", "dropped from the result.", "Lines come back in reading", "order with their boxes.",
]


def font(name, size):
    return ImageFont.truetype(FONTS[name], size)


def text_mask(text, fnt):
    """The text's coverage (0..255) on a tight canvas with a small margin."""
    left, top, right, bottom = fnt.getbbox(text)
    pad = 4
    mask = Image.new("L", (right - left + 2 * pad, bottom - top + 2 * pad), 0)
    ImageDraw.Draw(mask).text((pad - left, pad - top), text, fill=255, font=fnt)
    return mask


def page_fonts():
    lines = [
        ("DejaVuSans", 16), ("DejaVuSans", 24), ("DejaVuSans", 34), ("DejaVuSerif", 20), ("DejaVuSansMono", 18),
        ("LiberationSans", 22), ("LiberationSerif", 28), ("LiberationMono", 20), ("DejaVuSerif", 14),
        ("LiberationSans", 40),
    ]
    img = Image.new("L", (1000, 720), 255)
    draw = ImageDraw.Draw(img)
    y, drawn, params = 30, [], []
    for (name, size), text in zip(lines, SENTENCES):
        fnt = font(name, size)
        if draw.textlength(text, font=fnt) > 930:
            text = text[: len(text) * 2 // 3].rstrip()
        draw.text((40, y), text, fill=0, font=fnt)
        drawn.append(text)
        params.append({"font": name, "size": size, "x": 40, "y": y, "angle": 0})
        y += int(size * 1.7)
    return img, drawn, params


def paste_turned(img, text, fnt, angle, center, params, ink=0):
    mask = text_mask(text, fnt).rotate(angle, resample=Image.BICUBIC, expand=True, fillcolor=0)
    x, y = int(center[0] - mask.width / 2), int(center[1] - mask.height / 2)
    img.paste(ink, (x, y, x + mask.width, y + mask.height), mask)
    params.append({"text": text, "size": fnt.size, "angle": angle, "center": list(center)})


def page_rotated():
    img = Image.new("L", (1100, 900), 255)
    drawn, params = [], []
    rows = [(5, SENTENCES[0]), (-5, SENTENCES[1]), (12, SENTENCES[2]), (-12, SENTENCES[3]),
            (20, SENTENCES[4]), (-20, SENTENCES[5]), (30, SENTENCES[10]), (-30, SENTENCES[11])]
    for i, (angle, text) in enumerate(rows):
        fnt = font("DejaVuSans" if i % 2 == 0 else "LiberationSerif", 24)
        center = (300 if i % 2 == 0 else 800, 90 + (i // 2) * 210)
        text = text[:28].rstrip() if abs(angle) >= 20 else text[:36].rstrip()
        paste_turned(img, text, fnt, angle, center, params)
        drawn.append(text)
    return img, drawn, params


def page_columns():
    img = Image.new("L", (960, 640), 255)
    draw = ImageDraw.Draw(img)
    fnt = font("LiberationSans", 20)
    drawn, params = [], []
    for col, (x, lines) in enumerate([(40, COLUMN_TEXT), (510, COLUMN_TEXT_RIGHT)]):
        for i, text in enumerate(lines):
            y = 40 + i * 46
            draw.text((x, y), text, fill=0, font=fnt)
            drawn.append(text)
            params.append({"font": "LiberationSans", "size": 20, "x": x, "y": y, "column": col})
    return img, drawn, params


def page_upside_down():
    img = Image.new("L", (900, 560), 255)
    drawn, params = [], []
    for i, text in enumerate(SENTENCES[:6]):
        angle = 180 if i in (1, 4) else 0
        paste_turned(img, text[:40].rstrip(), font("DejaVuSerif", 24), angle, (450, 60 + i * 85), params)
        drawn.append(text[:40].rstrip())
    return img, drawn, params


def page_color():
    """Coloured text on coloured bands: a page whose channels differ, to catch BGR/RGB mix-ups."""
    img = Image.new("RGB", (820, 420), (235, 245, 255))
    draw = ImageDraw.Draw(img)
    rows = [((200, 20, 20), (255, 250, 220)), ((20, 90, 200), (240, 240, 240)), ((20, 130, 40), (250, 235, 245)),
            ((255, 255, 255), (40, 40, 90)), ((120, 0, 160), (225, 250, 230))]
    drawn, params = [], []
    fnt = font("DejaVuSans", 26)
    for i, ((ink, band), text) in enumerate(zip(rows, SENTENCES[6:])):
        y = 25 + i * 78
        draw.rectangle((20, y - 12, 800, y + 52), fill=band)
        text = text[:40].rstrip()
        draw.text((40, y), text, fill=ink, font=fnt)
        drawn.append(text)
        params.append({"font": "DejaVuSans", "size": 26, "ink": ink, "band": band, "y": y})
    return img, drawn, params


def page_small():
    """One short word on a small image: rapidocr's size bounds and vertical padding."""
    fnt = font("LiberationSans", 22)
    img = Image.new("L", (190, 34), 255)
    ImageDraw.Draw(img).text((8, 4), "Receipt 4417", fill=0, font=fnt)
    return img, ["Receipt 4417"], [{"font": "LiberationSans", "size": 22}]


# --- PDF written by hand: standard fonts, no embedding -----------------------------------

PDF_LINES = [  # (font resource, size, x, y, angle, text)
    ("F1", 24, 72, 760, 0, "Quarterly report, third quarter"),
    ("F1", 14, 72, 720, 0, "Revenue grew 12 percent to 4.2 million."),
    ("F2", 16, 72, 680, 0, "Costs were flat at 3.1 million."),
    ("F3", 12, 72, 645, 0, "Table 3: units shipped per region"),
    ("F1", 12, 72, 610, 0, "North 1,204  South 988  East 1,577"),
    ("F2", 20, 72, 540, 10, "Approved by the board"),
    ("F1", 10, 72, 480, 0, "Questions go to the finance team."),
]


def pdf_string(text):
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def write_pdf(lines, encrypt=None):
    """A one-page A4 PDF; `encrypt` = (user, owner) passwords for the 40-bit RC4 handler."""
    ops = []
    for res, size, x, y, angle, text in lines:
        c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        ops.append(f"BT /{res} {size} Tf {c:.5f} {s:.5f} {-s:.5f} {c:.5f} {x} {y} Tm ({pdf_string(text)}) Tj ET")
    content = "\n".join(ops).encode("latin-1")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R /F2 6 0 R /F3 7 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Times-Roman >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Courier >>",
    ]
    file_id = hashlib.md5(b"snooze-ocr-fixture").digest()
    trailer_extra = b""
    if encrypt:
        objects.append(rc4_encrypt_dict(*encrypt, file_id))
        trailer_extra = b" /Encrypt %d 0 R" % len(objects)
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R /ID [<%s> <%s>]%s >>\nstartxref\n%d\n%%%%EOF\n"
              % (len(objects) + 1, file_id.hex().encode(), file_id.hex().encode(), trailer_extra, xref))
    return out.getvalue()


PAD = bytes.fromhex("28BF4E5E4E758A4164004E56FFFA01082E2E00B6D0683E802F0CA9FE6453697A")


def rc4(key, data):
    s, j, out = list(range(256)), 0, bytearray()
    for i in range(256):
        j = (j + s[i] + key[i % len(key)]) % 256
        s[i], s[j] = s[j], s[i]
    i = j = 0
    for b in data:
        i = (i + 1) % 256
        j = (j + s[i]) % 256
        s[i], s[j] = s[j], s[i]
        out.append(b ^ s[(s[i] + s[j]) % 256])
    return bytes(out)


def rc4_encrypt_dict(user, owner, file_id):
    """Standard security handler, revision 2 (PDF 1.7 algorithms 3 and 4)."""
    padded = lambda pw: (pw.encode() + PAD)[:32]
    o = rc4(hashlib.md5(padded(owner)).digest()[:5], padded(user))
    p = -44
    key = hashlib.md5(padded(user) + o + p.to_bytes(4, "little", signed=True) + file_id).digest()[:5]
    u = rc4(key, PAD)
    return b"<< /Filter /Standard /V 1 /R 2 /O <%s> /U <%s> /P %d >>" % (o.hex().encode(), u.hex().encode(), p)


# --- rapidocr ------------------------------------------------------------------------------

def check_models(rapidocr_dir):
    """The models rapidocr runs here must be the ones models/ links (same bytes)."""
    for folder, name in [("ocr-det", "PP-OCRv6_det_small.onnx"), ("ocr-rec", "PP-OCRv6_rec_small.onnx"),
                         ("ocr-cls", "ch_ppocr_mobile_v2.0_cls_mobile.onnx")]:
        ours = os.path.join(ROOT, "models", folder, "model.onnx")
        theirs = os.path.join(rapidocr_dir, "models", name)
        if os.path.exists(ours) and open(ours, "rb").read() != open(theirs, "rb").read():
            sys.exit(f"ocr_fixture: {ours} is not rapidocr's {name}")


def read_with_rapidocr(engine, path):
    """rapidocr's steps one by one, keeping what each gave."""
    import copy

    ori = engine.load_img(path)
    img, op_record = engine.preprocess_img(ori)
    det_res, cls_res, rec_res, crops = engine.run_ocr_steps(img, copy.deepcopy(op_record))
    det_boxes = [] if det_res.boxes is None else np.asarray(det_res.boxes, dtype=np.float64).tolist()
    pad_top = 0
    if det_res.boxes is not None:
        h, w = img.shape[:2]
        if h <= engine.min_height or w / h > engine.width_height_ratio:
            from rapidocr.utils.process_img import get_padding_h
            pad_top = get_padding_h(h, w, engine.width_height_ratio, engine.min_height)
    final = engine.build_final_output(ori, det_res, cls_res, rec_res, crops, op_record)
    lines = []
    if getattr(final, "txts", None):
        for box, text, score in zip(final.boxes, final.txts, final.scores):
            lines.append({"text": text, "score": float(score), "box": np.asarray(box, dtype=np.float64).tolist()})
    return {
        "det_image": [int(img.shape[1]), int(img.shape[0] + 2 * pad_top)],
        "det_boxes": det_boxes,
        "cls": [] if cls_res.cls_res is None else [[str(l), float(s)] for l, s in cls_res.cls_res],
        "rec": [] if rec_res.txts is None else [[t, float(s)] for t, s in zip(rec_res.txts, rec_res.scores)],
        "lines": lines,
    }


# --- OpenCV / pyclipper numbers for the Rust unit tests -----------------------------------

def geometry_numbers():
    import cv2
    import pyclipper
    from shapely.geometry import Polygon

    rng = np.random.default_rng(7)
    src = cv2.GaussianBlur(rng.integers(0, 256, (31, 45, 3), dtype=np.uint8), (3, 3), 0)
    resize = [{"width": w, "height": h, "bgr": cv2.resize(src, (w, h)).tobytes().hex()}
              for w, h in [(90, 62), (23, 16), (45, 31 * 3), (17, 48), (64, 40), (100, 13)]]
    warps = []
    for quad in ([[3.0, 2.0], [40.0, 6.0], [38.0, 25.0], [2.0, 21.0]], [[10.0, 4.0], [30.0, 4.0], [30.0, 28.0], [10.0, 28.0]],
                 [[-2.0, 1.0], [44.0, -3.0], [46.0, 33.0], [0.0, 30.0]], [[5.0, 12.0], [20.0, 3.0], [28.0, 16.0], [13.0, 25.0]]):
        pts = np.array(quad, np.float32)
        cw = int(max(np.linalg.norm(pts[0] - pts[1]), np.linalg.norm(pts[2] - pts[3])))
        ch = int(max(np.linalg.norm(pts[0] - pts[3]), np.linalg.norm(pts[1] - pts[2])))
        std = np.array([[0, 0], [cw, 0], [cw, ch], [0, ch]], np.float32)
        m = cv2.getPerspectiveTransform(pts, std)
        out = cv2.warpPerspective(src, m, (cw, ch), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC)
        warps.append({"quad": quad, "width": cw, "height": ch, "bgr": out.tobytes().hex()})
    unclips = []
    for center, size, angle in [((50.5, 20.0), (80.0, 12.0), 0.0), ((200.0, 90.0), (150.0, 24.0), 7.5),
                                ((300.0, 300.0), (40.0, 9.0), -33.0), ((64.0, 64.0), (30.0, 30.0), 45.0),
                                ((120.2, 40.7), (311.3, 17.9), -2.2)]:
        box = cv2.boxPoints((center, size, angle)).astype(np.float32)
        poly = Polygon(box)
        distance = poly.area * 1.6 / poly.length
        off = pyclipper.PyclipperOffset()
        off.AddPath(box, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
        grown = np.array(off.Execute(distance)).reshape(-1, 2)
        rect = cv2.minAreaRect(grown.reshape(-1, 1, 2).astype(np.float32))
        unclips.append({"box": box.astype(np.float64).tolist(), "distance": distance,
                        "offset": grown.tolist(), "rect_short_side": float(min(rect[1]))})
    return {"source": {"width": 45, "height": 31, "bgr": src.tobytes().hex()}, "resize": resize,
            "warp": warps, "unclip": unclips}


def main():
    from rapidocr import RapidOCR
    import rapidocr

    check_models(os.path.dirname(rapidocr.__file__))
    os.makedirs(PAGES, exist_ok=True)
    engine = RapidOCR(params={"Global.log_level": "error"})
    pages = []
    for name, make, fmt in [("fonts", page_fonts, "png"), ("rotated", page_rotated, "png"),
                            ("columns", page_columns, "png"), ("upside_down", page_upside_down, "png"),
                            ("color", page_color, "png"), ("small", page_small, "png"),
                            ("fonts_jpeg", page_fonts, "jpg")]:
        img, drawn, params = make()
        path = os.path.join(PAGES, f"{name}.{fmt}")
        if fmt == "jpg":
            img.save(path, quality=88)
        else:
            img.save(path, optimize=True)
        ref = read_with_rapidocr(engine, path)
        pages.append({"file": f"ocr_pages/{name}.{fmt}", "width": img.width, "height": img.height,
                      "drawn": drawn, "params": params, **ref})
        print(f"{name}: {len(ref['lines'])} lines, {os.path.getsize(path)} bytes", file=sys.stderr)
    with open(os.path.join(PAGES, "text.pdf"), "wb") as f:
        f.write(write_pdf(PDF_LINES))
    with open(os.path.join(PAGES, "locked.pdf"), "wb") as f:
        f.write(write_pdf(PDF_LINES[:1], encrypt=("secret", "owner")))
    out = {
        "rapidocr": rapidocr.__version__ if hasattr(rapidocr, "__version__") else "3.10.0",
        "pages": pages,
        "pdf": {"file": "ocr_pages/text.pdf", "locked": "ocr_pages/locked.pdf",
                "lines": [{"font": r, "size": s, "x": x, "y": y, "angle": a, "text": t} for r, s, x, y, a, t in PDF_LINES]},
        "geometry": geometry_numbers(),
    }
    with open(os.path.join(FIXTURES, "ocr_reference.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
