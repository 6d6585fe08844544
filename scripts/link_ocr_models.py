"""Links rapidocr's PP-OCR ONNX models into the model repository, one folder per model:

    models/ocr-det/model.onnx -> <rapidocr>/models/PP-OCRv6_det_small.onnx
    models/ocr-rec/model.onnx -> <rapidocr>/models/PP-OCRv6_rec_small.onnx
    models/ocr-cls/model.onnx -> <rapidocr>/models/ch_ppocr_mobile_v2.0_cls_mobile.onnx
    models/ocr-rec/keys.txt      the recognition dictionary, one character a line

The dictionary: the wheel ships no keys file (rapidocr's ppocr_keys_v1.txt is a download
fallback for engines other than onnxruntime); the rec model carries its characters in the
ONNX metadata_props entry `character`, which rapidocr reads with
`custom_metadata_map["character"].splitlines()`. KServe v2 model metadata does not expose
metadata_props, so the list is written out here as keys.txt for clients (the server only
looks at model.onnx in the folder).

rapidocr is installed with --no-deps (no opencv), so `import rapidocr` would fail: its
folder is found with importlib's finder, which does not run the package's __init__.
Idempotent: existing links are replaced, keys.txt rewritten only when it differs.
"""

import argparse
import importlib.util
import os
import sys

MODELS = {
    "ocr-det": "PP-OCRv6_det_small.onnx",
    "ocr-rec": "PP-OCRv6_rec_small.onnx",
    "ocr-cls": "ch_ppocr_mobile_v2.0_cls_mobile.onnx",
}
REC = "ocr-rec"
KEYS = "keys.txt"


def rapidocr_dir() -> str:
    spec = importlib.util.find_spec("rapidocr")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "link_ocr_models: the rapidocr package is not installed in this Python "
            f"({sys.executable}): run `make prepare` (it installs rapidocr==3.10.0 --no-deps into .venv)"
        )
    return list(spec.submodule_search_locations)[0]


def rec_characters(onnx_path: str) -> list:
    """The rec model's dictionary, as rapidocr reads it (metadata `character`, splitlines)."""
    import onnx

    model = onnx.load(onnx_path, load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == "character":
            return prop.value.splitlines()
    sys.exit(f"link_ocr_models: {onnx_path} has no `character` metadata (not a PP-OCR rec model?)")


def link(target: str, link_path: str) -> None:
    if os.path.islink(link_path) and os.readlink(link_path) == target:
        return
    if os.path.lexists(link_path):
        if os.path.isdir(link_path) and not os.path.islink(link_path):
            sys.exit(f"link_ocr_models: {link_path} is a directory, not a model file")
        os.remove(link_path)
    os.symlink(target, link_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="models", help="the model repository (default: models)")
    args = ap.parse_args()

    src = os.path.join(rapidocr_dir(), "models")
    for name, file in MODELS.items():
        target = os.path.abspath(os.path.join(src, file))
        if not os.path.isfile(target):
            sys.exit(f"link_ocr_models: {target} is missing from the rapidocr wheel: run `make prepare`")
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        link(target, os.path.join(folder, "model.onnx"))
        print(f"{folder}/model.onnx -> {target}")

    chars = rec_characters(os.path.join(src, MODELS[REC]))
    text = "".join(c + "\n" for c in chars)
    keys = os.path.join(args.out, REC, KEYS)
    old = None
    if os.path.isfile(keys):
        with open(keys, encoding="utf-8", newline="") as f:
            old = f.read()
    if old != text:
        tmp = keys + ".tmp"
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, keys)
    print(f"{keys}: {len(chars)} characters (from the rec model's `character` metadata)")


if __name__ == "__main__":
    main()
