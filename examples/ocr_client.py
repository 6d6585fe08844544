"""Read a scanned page, a photo of text or a PDF with SnoozeML's `POST /v1/ocr`.

    .venv/bin/python examples/ocr_client.py page.png
    .venv/bin/python examples/ocr_client.py report.pdf --pages 1-3 --json
    .venv/bin/python examples/ocr_client.py photo.jpg --url http://gpu-box:8080 --api-key "$KEY"

The server runs the whole pipeline (detection, direction classification, recognition,
PDF rendering); this client only uploads the file and prints the text, page by page.
examples/ocr_kserve.py is the same job done client-side over KServe v2, one model at a time.
"""

import argparse
import json
import os
import sys

import requests


def read(url: str, path: str, api_key: str = "", **options) -> dict:
    """The server's answer for one document: {"pages": [{"page", "text", "lines"}], "usage"}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    fields = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items() if v is not None}
    with open(path, "rb") as f:
        resp = requests.post(f"{url}/v1/ocr", files={"file": (os.path.basename(path), f)}, data=fields,
                             headers=headers, timeout=600)
    if resp.status_code != 200:
        raise SystemExit(f"{resp.status_code}: {resp.json()['error']['message']}")
    return resp.json()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="an image (PNG, JPEG, WebP, TIFF, BMP) or a PDF")
    p.add_argument("--url", default=os.environ.get("SNOOZE_URL", "http://127.0.0.1:8080"))
    p.add_argument("--api-key", default=os.environ.get("SNOOZE_API_KEY", ""))
    p.add_argument("--pipeline", help="a [pipelines.NAME] of the server's config (default: ocr)")
    p.add_argument("--pages", help='pages of a PDF or TIFF, e.g. "1-3,7" (default: all)')
    p.add_argument("--dpi", type=float, help="resolution PDF pages are rendered at (default: 150)")
    p.add_argument("--no-cls", action="store_true", help="skip the direction classifier")
    p.add_argument("--json", action="store_true", help="print the whole answer (lines, boxes, scores)")
    args = p.parse_args()
    answer = read(args.url, args.file, args.api_key, pipeline=args.pipeline, pages=args.pages, dpi=args.dpi,
                  use_cls=False if args.no_cls else None)
    if args.json:
        json.dump(answer, sys.stdout, indent=1)
        print()
        return
    for page in answer["pages"]:
        if len(answer["pages"]) > 1:
            print(f"--- page {page['page']}")
        print(page["text"])


if __name__ == "__main__":
    main()
