"""--mode pdf of bench/ocr.py: what a long PDF costs the server in memory.

Issue 20's target: a 100-page PDF at 150 DPI peaks at no more than the pipeline's models plus
a bounded number of pages. A document like a scan is made here with Pillow: A4 pages at
150 DPI (1240 x 1754 px, what the server's default `dpi` renders them back to), each 24 lines
of seeded words in DejaVu and Liberation faces of several sizes, one grayscale bitmap per page.
The server (the three OCR models resident, no budget) then reads, each while its RSS is
sampled every 50 ms:

    warm-up   one page: models loaded, their arenas grown to an A4 page
    batch     a document of `page_batch` pages (the pipeline's default: 4), one batch
    long      the N-page document (--pdf-pages, default 100)

and the table sets the long document's peak against the batch's: if pages are rendered and read
in bounded batches, the two peaks differ by the upload (the one thing that grows with the
document) and noise, and the peak over the idle server is one batch of pages' bitmaps plus the
detector's working set, whatever N.
"""

import http.client
import json
import os
import random
import time

from embeddings import PeakSampler, loadavg, status_bytes

MIB = 1 << 20
DPI = 150
A4 = (1240, 1754)  # 210 x 297 mm at 150 DPI
LINES = 24
FONTS = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
         "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
         "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
         "/usr/share/fonts/truetype/liberation/LiberationSerif-Regular.ttf"]
WORDS = ("memory budget model request server page line text scan invoice total amount date "
         "report section figure table reading order column margin detector recogniser batch "
         "eviction warm cold load queue answer number account payment delivery address").split()
PAGE_BATCH = 4  # the server's default page_batch (crates/server/src/config/pipelines.rs)


def make_pdf(n_pages, seed=20):
    """A PDF of `n_pages` A4 bitmaps at 150 DPI, and how many lines were drawn."""
    import io

    from PIL import Image, ImageDraw, ImageFont

    fonts = [f for f in FONTS if os.path.isfile(f)]
    if not fonts:
        raise SystemExit(f"none of {FONTS}: make system-packages")
    rng = random.Random(seed)
    pages, drawn = [], 0
    for _ in range(n_pages):
        img = Image.new("L", A4, 255)
        draw = ImageDraw.Draw(img)
        y = 90
        for _ in range(LINES):
            size = rng.choice((24, 28, 32, 36))
            font = ImageFont.truetype(rng.choice(fonts), size)
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
            draw.text((110, y), f"{rng.randint(1, 999)} {words}", font=font, fill=0)
            y += int(size * 1.9)
            drawn += 1
        pages.append(img)
    out = io.BytesIO()
    pages[0].save(out, "PDF", resolution=DPI, save_all=True, append_images=pages[1:])
    return out.getvalue(), drawn


def post(host, body, content_type):
    """The JSON answer of one `POST /v1/ocr`; exits on anything but 200."""
    conn = http.client.HTTPConnection(host, timeout=3600)
    try:
        conn.request("POST", "/v1/ocr", body=body, headers={"Content-Type": content_type})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    if r.status != 200:
        raise SystemExit(f"POST /v1/ocr: {r.status} {data.decode(errors='replace')[:400]}")
    return json.loads(data)


def read_pdf(host, upload, pid, settle=2.0):
    """(seconds, RSS before, peak RSS, answer) of one `POST /v1/ocr` of a multipart `upload`."""
    time.sleep(settle)  # the last request's memory goes back first
    before = status_bytes(pid, "VmRSS")
    sampler = PeakSampler(pid)
    t0 = time.perf_counter()
    try:
        answer = post(host, *upload)
    finally:
        peak = sampler.finish()
    return time.perf_counter() - t0, before, peak, answer


def pdf_bench(args, proc, base, multipart):
    host = base.split("://", 1)[1]
    t0 = time.perf_counter()
    docs = {name: make_pdf(n) for name, n in (("warm-up", 1), ("batch", PAGE_BATCH), ("long", args.pdf_pages))}
    print(f"\n--- pdf mode: memory of a {args.pdf_pages}-page PDF through POST /v1/ocr; A4 pages at {DPI} DPI "
          f"({A4[0]} x {A4[1]} px, {LINES} lines each), made in {time.perf_counter() - t0:.1f} s; {loadavg()}")
    rows = []
    for name, (pdf, drawn) in docs.items():
        seconds, before, peak, answer = read_pdf(host, multipart(f"{name}.pdf", pdf), proc.pid)
        pages = answer["pages"]
        read = sum(len(p["lines"]) for p in pages)
        sizes = {(p["width"], p["height"]) for p in pages}
        rows.append((name, len(pages), len(pdf), seconds, before, peak, read, drawn, sizes))
    idle = status_bytes(proc.pid, "VmRSS")
    print(f"\n{'document':>9} {'pages':>6} {'upload MiB':>11} {'s':>7} {'pages/s':>8} {'RSS before':>11} "
          f"{'peak RSS':>9} {'peak - before':>14} {'lines read/drawn':>17}  page size")
    for name, n, size, seconds, before, peak, read, drawn, sizes in rows:
        print(f"{name:>9} {n:>6} {size / MIB:>11.1f} {seconds:>7.1f} {n / seconds:>8.2f} {before / MIB:>11.0f} "
              f"{peak / MIB:>9.0f} {(peak - before) / MIB:>14.0f} {f'{read}/{drawn}':>17}  "
              f"{', '.join(f'{w}x{h}' for w, h in sorted(sizes))}")
    batch, long = rows[1], rows[2]
    bitmap = A4[0] * A4[1] * 3  # one page rendered as RGB
    print(f"long - batch peak: {(long[5] - batch[5]) / MIB:+.0f} MiB for {long[1] - batch[1]} more pages "
          f"({(long[2] - batch[2]) / MIB:+.1f} MiB more upload); one rendered page is {bitmap / MIB:.1f} MiB "
          f"(RGB), a batch of {PAGE_BATCH} {PAGE_BATCH * bitmap / MIB:.0f} MiB; RSS after all {idle / MIB:.0f} MiB")
    print(f"(no budget: the three models stay resident; {loadavg()})")
