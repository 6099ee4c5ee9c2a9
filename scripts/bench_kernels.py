"""Benchmark paged attention, KV-cache writes and the layer ops at SmolLM2-135M engine shapes.

    python scripts/bench_kernels.py                  # CPU: the torch twin against naive baselines
    python scripts/bench_kernels.py --device cuda    # GPU: adds the Triton kernels and flex attention
    python scripts/bench_kernels.py --threads 1 --clock cpu --dtypes bf16 --ops attention,layer
    python scripts/bench_kernels.py --dtypes bf16 --ops attention --shapes prompt-1400,chunk-512 --no-flex

Shapes (num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, shuffled block tables):
  decode-64: 64 sequences, one new token each, contexts uniform in 50..600
  mixed-256: one 256-token prefill chunk after a 256-token cached prefix, plus 63 decodes as above
  prompt-1400, chunk-512 (--shapes): a whole 1,400-token prompt; 512 rows after 1,024 positions
  decode-128-long (--shapes): 128 decodes at 50..1,100 positions (long answers late in their run:
               56 MB of K/V a layer, read from DRAM where decode-64's 16 MB may sit in L3)
Implementations:
  twin         kernels.paged_attention_torch (the specification, and the CPU path without C++)
  cpp          kernels.paged_attention on CPU tensors: the C++ kernel (the CPU product path; cpu only), on
               the ISA the kernels picked at run time
  cpp-avx2     the same, pinned to its AVX2 path (kernels.cpu_isa.forced_isa), where another ISA is active
               (on AVX2 chunks of more than 128 rows go to torch's flash attention: that path's row)
Layer ops (--ops layer; CPU, 64 decode rows of hidden 576 / intermediate 1536, 9 + 3 heads of 64):
  rms_norm, add+rms_norm (torch's residual add then the kernel; `fused` is fused_add_rms_norm),
  silu_and_mul, rotary: twin (torch), cpp-avx2, cpp (the active ISA)
  triton       kernels.paged_attention on CUDA tensors (cuda only)
  naive-loop   per sequence: gather K/V through the block table, then one SDPA call
  sdpa-dense   SDPA on K/V already un-paged and padded (one call for the decodes, one per prefill
               chunk): what attention costs with no paging at all
  flex         flex_attention (compiled) on the packed, un-paged K/V with a document mask (cuda only)
Prints one table, ms per call (median); on the CPU every row of a table is timed interleaved (one
call of each implementation per round), so load from other processes falls on all of them alike.
On a shared CPU box use --threads 1 --clock cpu: with two OpenMP threads, a descheduled thread
stalls every op and wall times swing by 3-5x. The header names the CPU model and the active ISA.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import (  # noqa: E402
    cpu_isa,
    cpu_layer_ops,
    fused_add_rms_norm,
    paged_attention,
    paged_attention_torch,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
    write_kv_cache_torch,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence, un-paged: [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    query_lens: list[int]
    ctx_lens: list[int]

    @property
    def scale(self) -> float:
        return HEAD_DIM ** -0.5


def build_batch(query_lens: list[int], ctx_lens: list[int], dtype: torch.dtype, device: str, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = [-(-c // BLOCK_SIZE) for c in ctx_lens]
    num_blocks = sum(num_blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    block_tables = torch.zeros(len(ctx_lens), max(num_blocks_per_seq), dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, ctx in enumerate(ctx_lens):
        blocks = perm[used:used + num_blocks_per_seq[s]]
        used += num_blocks_per_seq[s]
        block_tables[s, :len(blocks)] = blocks.int()
        k = torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        slots = blocks.repeat_interleave(BLOCK_SIZE)[:ctx] * BLOCK_SIZE + torch.arange(ctx) % BLOCK_SIZE
        key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k
        value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v
        keys.append(k.to(device))
        values.append(v.to(device))
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return Batch(
        query.to(device), key_cache.to(device), value_cache.to(device), block_tables.to(device),
        torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device), keys, values, query_lens, ctx_lens,
    )


def shapes(seed: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    decode_ctx = torch.randint(50, 601, (64,), generator=gen).tolist()
    return {
        "decode-64": ([1] * 64, decode_ctx),
        "mixed-256": ([256] + [1] * 63, [512] + decode_ctx[:63]),
        # Long prefill chunks (--shapes): a whole 1,400-token prompt; 512 rows after 1,024 positions.
        "prompt-1400": ([1400], [1400]),
        "chunk-512": ([512], [1536]),
        "decode-128-long": ([1] * 128, torch.randint(50, 1101, (128,), generator=gen).tolist()),
    }


def _causal_mask(q_len: int, ctx: int, device: torch.device) -> torch.Tensor:
    return torch.arange(ctx, device=device)[None, :] <= torch.arange(ctx - q_len, ctx, device=device)[:, None]


def naive_loop(b: Batch) -> torch.Tensor:
    out = torch.empty_like(b.query)
    group = NUM_HEADS // NUM_KV_HEADS
    start = 0
    for s, (q_len, ctx) in enumerate(zip(b.query_lens, b.ctx_lens)):
        blocks = b.block_tables[s, :-(-ctx // BLOCK_SIZE)].long()
        slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=blocks.device)).flatten()[:ctx]
        k = b.key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(0, 1)
        v = b.value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(0, 1)
        q = b.query[start:start + q_len].transpose(0, 1)
        mask = _causal_mask(q_len, ctx, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=b.scale, enable_gqa=group > 1)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def _dense_call(b: Batch, seqs: list[int]) -> Callable[[], torch.Tensor]:
    """One padded SDPA call over `seqs` with K/V already un-paged and contiguous."""
    device = b.query.device
    starts = [sum(b.query_lens[:s]) for s in seqs]
    q_lens, ctxs = [b.query_lens[s] for s in seqs], [b.ctx_lens[s] for s in seqs]
    count, group, q_max, c_max = len(seqs), NUM_HEADS // NUM_KV_HEADS, max(q_lens), max(ctxs)
    k = torch.zeros(count, NUM_KV_HEADS, c_max, HEAD_DIM, dtype=b.query.dtype, device=device)
    v = torch.zeros_like(k)
    q = torch.zeros(count, NUM_KV_HEADS, group * q_max, HEAD_DIM, dtype=b.query.dtype, device=device)
    mask = torch.zeros(count, 1, group * q_max, c_max, dtype=torch.bool, device=device)
    for i, (s, start, q_len, ctx) in enumerate(zip(seqs, starts, q_lens, ctxs)):
        k[i, :, :ctx] = b.keys[s].transpose(0, 1)
        v[i, :, :ctx] = b.values[s].transpose(0, 1)
        rows = b.query[start:start + q_len].view(q_len, NUM_KV_HEADS, group, HEAD_DIM).permute(1, 2, 0, 3)
        q.view(count, NUM_KV_HEADS, group, q_max, HEAD_DIM)[i, :, :, :q_len] = rows
        m = mask.view(count, group, q_max, c_max)[i]
        m[:, :q_len, :ctx] = _causal_mask(q_len, ctx, device)
        m[:, q_len:, 0] = True  # padded rows attend somewhere, so they stay finite
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=b.scale)


def make_sdpa_dense(b: Batch) -> Callable[[], list[torch.Tensor]]:
    """The floor without paging: one padded call for all decode rows, one call per prefill chunk."""
    decode = [s for s, q in enumerate(b.query_lens) if q == 1]
    calls = ([_dense_call(b, decode)] if decode else []) + [
        _dense_call(b, [s]) for s, q in enumerate(b.query_lens) if q > 1]
    return lambda: [call() for call in calls]


def make_flex(b: Batch) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = b.query.device
    total_q, total_k = sum(b.query_lens), sum(b.ctx_lens)
    q_doc = torch.repeat_interleave(torch.arange(len(b.ctx_lens), device=device),
                                    torch.tensor(b.query_lens, device=device))
    k_doc = torch.repeat_interleave(torch.arange(len(b.ctx_lens), device=device),
                                    torch.tensor(b.ctx_lens, device=device))
    q_pos = torch.cat([torch.arange(c - q, c, device=device) for q, c in zip(b.query_lens, b.ctx_lens)])
    k_pos = torch.cat([torch.arange(c, device=device) for c in b.ctx_lens])

    def mask_mod(batch, head, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_doc[q_idx] == k_doc[kv_idx]) & (k_pos[kv_idx] <= q_pos[q_idx])

    block_mask = create_block_mask(mask_mod, 1, 1, total_q, total_k, device=device)
    q = b.query[:total_q].transpose(0, 1).unsqueeze(0).contiguous()
    k = torch.cat(b.keys).transpose(0, 1).unsqueeze(0).contiguous()
    v = torch.cat(b.values).transpose(0, 1).unsqueeze(0).contiguous()
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=block_mask, scale=b.scale, enable_gqa=True)


def time_ms(fn: Callable[[], object], device: str, reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median ms per call. On CUDA, calls are timed in back-to-back runs (launch overhead included)."""
    for _ in range(3):
        fn()
    if device != "cuda":
        samples = []
        for _ in range(reps):
            t0 = clock()
            fn()
            samples.append((clock() - t0) * 1e3)
        return statistics.median(samples)
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(runs)


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo; platform's guess elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def pinned(isa: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the C++ kernels pinned to `isa` for the call."""
    def call() -> object:
        with cpu_isa.forced_isa(isa):
            return fn()
    return call


def add_pinned_rows(impls: dict[str, Callable[[], object]], names: list[str]) -> None:
    """A `<name>-<isa>` row for each ISA the kernels can run here besides the active one. The
    active ISA's rows are pinned too (to it), so every C++ row pays the same few microseconds of
    switching: the layer ops take only tens of microseconds."""
    active = cpu_isa.active_isa()
    for name in names:
        fn = impls[name]
        impls[name] = pinned(active, fn)
        for isa in cpu_isa.supported_isas():
            if isa != active:
                impls[f"{name}-{isa}"] = pinned(isa, fn)


def candidates(b: Batch, device: str, with_flex: bool) -> dict[str, Callable[[], object]]:
    """name -> a no-argument call; flex is built lazily because building it compiles."""
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    hints = {"max_query_len": max(b.query_lens), "max_seq_len": max(b.ctx_lens)}
    impls: dict[str, Callable[[], object]] = {"twin": lambda: paged_attention_torch(*args, **hints)}
    impls["triton" if device == "cuda" else "cpp"] = lambda: paged_attention(*args, **hints)
    if device == "cpu":
        add_pinned_rows(impls, ["cpp"])
    impls["naive-loop"] = lambda: naive_loop(b)
    impls["sdpa-dense"] = make_sdpa_dense(b)
    if with_flex:
        impls["flex"] = LazyFlex(b)
    return impls


class LazyFlex:
    """flex_attention, built (and compiled) on first call so a failure lands in measure()."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.call: Callable[[], torch.Tensor] | None = None

    def __call__(self) -> torch.Tensor:
        if self.call is None:
            self.call = make_flex(self.batch)
        return self.call()


def write_candidates(b: Batch, device: str) -> dict[str, Callable[[], object]]:
    num_tokens = b.query.shape[0]
    slots = torch.randperm(b.key_cache.shape[0] * BLOCK_SIZE, device=device)[:num_tokens]
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device).to(b.key_cache.dtype)
    value = torch.randn_like(key)
    args = (key, value, b.key_cache, b.value_cache, slots)
    impls: dict[str, Callable[[], object]] = {"twin": lambda: write_kv_cache_torch(*args)}
    impls["triton" if device == "cuda" else "cpp"] = lambda: write_kv_cache(*args)
    return impls


def time_interleaved(impls: dict[str, Callable[[], object]], reps: int,
                     clock: Callable[[], float]) -> dict[str, str]:
    """Median ms per call of each CPU implementation, one call of each per round: a burst of load
    from another process slows every implementation alike instead of one row."""
    samples: dict[str, list[float]] = {name: [] for name in impls}
    failed: set[str] = set()
    for name, fn in impls.items():  # warm-up (and a failing implementation drops out here)
        try:
            for _ in range(3):
                fn()
        except Exception as exc:  # one failing implementation must not sink the table
            print(f"  {name} failed: {exc!r}"[:300], file=sys.stderr)
            failed.add(name)
    for _ in range(reps):
        for name, fn in impls.items():
            if name not in failed:
                t0 = clock()
                fn()
                samples[name].append((clock() - t0) * 1e3)
    return {name: "error" if name in failed else f"{statistics.median(samples[name]):.3f}" for name in impls}


def layer_op_candidates(dtype: torch.dtype, rows: int = 64) -> dict[str, dict[str, Callable[[], object]]]:
    """op -> impl -> call, at a decode step's shapes (SmolLM2: hidden 576, intermediate 1536)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen).to(dtype)
    qkv = torch.randn(rows, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    angles = torch.rand(rows, HEAD_DIM // 2, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    eps, heads = 1e-5, NUM_HEADS + NUM_KV_HEADS
    kernels_run = cpu_layer_ops.runs_here(x)
    ops: dict[str, dict[str, Callable[[], object]]] = {
        "rms_norm": {"twin": lambda: cpu_layer_ops.rms_norm_torch(x, weight, eps),
                     "cpp": lambda: rms_norm(x, weight, eps)},
        # The decoder layer's `residual + hidden` then the norm: torch's add and the kernel, or fused.
        "add+norm": {"twin": lambda: cpu_layer_ops.fused_add_rms_norm_torch(x, residual, weight, eps),
                     "cpp": lambda: rms_norm(residual.add_(x), weight, eps),
                     "fused": lambda: fused_add_rms_norm(x, residual, weight, eps)},
        "silu_mul": {"twin": lambda: cpu_layer_ops.silu_and_mul_torch(gate_up),
                     "cpp": lambda: silu_and_mul(gate_up)},
        "rotary": {"twin": lambda: cpu_layer_ops.rotary_embedding_torch(qkv, cos, sin, heads),
                   "cpp": lambda: rotary_embedding(qkv, cos, sin, heads)},
    }
    for impls in ops.values():
        if not kernels_run:
            impls.pop("cpp")
            impls.pop("fused", None)
            continue
        add_pinned_rows(impls, [n for n in impls if n != "twin"])
    return ops


def measure(fn: Callable[[], object], device: str, reps: int, clock: Callable[[], float]) -> str:
    try:
        return f"{time_ms(fn, device, reps, clock):.3f}"
    except Exception as exc:  # one failing implementation (flex needs a compiler) must not sink the table
        print(f"  failed: {exc!r}"[:300], file=sys.stderr)
        return "error"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32,bf16,fp16")
    parser.add_argument("--reps", type=int, default=0, help="timed calls per row (default: 20 cpu, 50 cuda)")
    parser.add_argument("--flex-dtypes", default="bf16", help="dtypes to run flex attention for (it compiles each)")
    parser.add_argument("--no-flex", action="store_true", help="skip flex attention")
    parser.add_argument("--check", action="store_true", help="also print max |impl - twin| per row")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--ops", default="attention,write_kv",
                        help="comma-separated: attention, write_kv, layer (the layer ops; cpu only)")
    parser.add_argument("--shapes", default="decode-64,mixed-256",
                        help=f"comma-separated, of {','.join(shapes())}")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time, steadier on a shared machine (use with --threads 1)")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    reps = args.reps or (50 if args.device == "cuda" else 20)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, median of {reps} calls, {args.clock} clock")
    if args.device == "cpu":
        print(f"{cpu_model()}; C++ kernels: active ISA {cpu_isa.active_isa()}, supported {cpu_isa.supported_isas()}")
    ops = set(args.ops.split(","))
    # Rows print as they finish, so a run cut short by a timeout still leaves its table so far.
    print(f"{'op':<10} {'shape':<10} {'dtype':<5} {'impl':<11} {'ms/call':>9} {'max err':>8}", flush=True)

    def row(op: str, name: str, dtype_name: str, impl: str, ms: str, err: str = "") -> None:
        print(f"{op:<10} {name:<10} {dtype_name:<5} {impl:<11} {ms:>9} {err:>8}", flush=True)

    for name, (query_lens, ctx_lens) in shapes().items():
        if not ops & {"attention", "write_kv"}:
            break
        if name not in args.shapes.split(","):
            continue
        for dtype_name in args.dtypes.split(","):
            b = build_batch(query_lens, ctx_lens, DTYPES[dtype_name], args.device)
            with_flex = args.device == "cuda" and not args.no_flex and dtype_name in args.flex_dtypes.split(",")
            reference = paged_attention_torch(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                              b.query_start_loc, b.scale) if args.check else None
            impls = candidates(b, args.device, with_flex) if "attention" in ops else {}
            times = time_interleaved(impls, reps, clock) if args.device == "cpu" else {}
            for impl, fn in impls.items():
                ms = times[impl] if impl in times else measure(fn, args.device, reps, clock)
                err = ""
                if reference is not None and impl.startswith(("triton", "naive-loop", "cpp")) and ms != "error":
                    err = f"{(fn().float() - reference.float()).abs().max().item():.1e}"  # type: ignore[union-attr]
                row("attention", name, dtype_name, impl, ms, err)
            for impl, fn in (write_candidates(b, args.device) if "write_kv" in ops else {}).items():
                row("write_kv", name, dtype_name, impl, measure(fn, args.device, reps, clock))
    if "layer" in ops and args.device == "cpu":
        for dtype_name in args.dtypes.split(","):
            for op, impls in layer_op_candidates(DTYPES[dtype_name]).items():
                for impl, ms in time_interleaved(impls, reps, clock).items():
                    row(op, "rows-64", dtype_name, impl, ms)


if __name__ == "__main__":
    main()
