"""bf16 and fp32 linear layers through oneDNN with each weight reordered once, not on every call.

`F.linear` on bf16 CPU tensors hands the weight to oneDNN in torch's row-major layout, and oneDNN
reorders it into its blocked layout for the bf16 dot-product instructions on every call: a decode
step rewrites every weight of the model before it multiplies by it. Reordered once
(`pack_weight`), the same GEMM runs 1.1-2.7x faster at 1-64 rows on an AVX512-BF16 EPYC, with
bit-identical results (`python scripts/bench_cpu_linear.py --bf16 --packed --threads 2`).

The packed copy is an opaque oneDNN tensor beside the original weight (the weight stays for
everything else that reads it, such as a tied embedding): it costs one more copy of the linear
weights, and it goes stale if the weight is changed in place afterwards. Where every product reads
the packed copy (bf16 here), the engine releases the plain weights it stands in for
(worker/model/plain_weights.py).

oneDNN builds a primitive per input row count (the first call at a new count cost 0.7 ms more
than the next, on a 960 x 576 weight) and caches 1,024 of them. A step's row count is anything up
to the token budget, so above PAD_ABOVE_ROWS rows the input is padded to a multiple of
ROW_MULTIPLE (at most 7 wasted rows where a step is compute-bound anyway), and above
COARSE_ABOVE_ROWS (a prefill chunk of a large budget) to a multiple of COARSE_ROW_MULTIPLE (at most
12 % more rows): a 4,096-token budget then needs 176 counts per weight shape, and a model's five
shapes stay inside the cache. On a Zen 4 a decoder layer in one C++ call also pads fewer rows than
MIN_LAYER_ROWS up to it, where oneDNN is faster (`layer_min_rows`; MIN_LAYER_ROWS says where it
was measured, and where it was not faster). Padding never changes a row's result (the tests compare
with F.linear, and the layer in one call with the layer op by op, bit for bit). `row_buckets` lists
the counts a warm-up should visit so that no step pays for a primitive.

Where the kernels run AMX (kernels.cpu_amx_linear), `pack_weight` packs bf16 weights into AMX
tile order instead, and `packed_linear` runs Carpool's AMX kernel: faster than oneDNN at every row
count a step brings on the Xeons measured, with no primitives to build and no padding.

fp32 (the dtype where bf16 does not run fast: AVX2 CPUs): `F.linear` goes to MKL's sgemm, which
packs the weight into its own panels on every call too. Between the skinny kernel's rows and a
long prefill chunk's, oneDNN on a weight reordered once is faster: on a 2-vCPU Zen 3 EPYC, all
30 of SmolLM2's fused layers 1.01-1.09x at 96-192 rows and even at 256 (0.97-1.00x), its
49,152-wide lm_head 1.3-1.8x at 96-256 rows (`python scripts/bench_cpu_linear.py --fp32-packed
--weights fused_layers|lm_head --rows 96,128,192,256 --threads 2`). Its sums run in another order
than MKL's: results agree to fp32 rounding, not to the bit.
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_amx_linear, cpu_extension, cpu_isa


@functools.cache
def runs_fast_here() -> bool:
    """AMX or AVX512-BF16 (oneDNN then multiplies bf16 natively) and torch built with oneDNN.
    Without them, bf16 GEMMs run through conversions: on an AVX2-only box 5x slower than fp32."""
    return torch.backends.mkldnn.is_available() and (
        torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


@functools.cache
def packs_fp32_here() -> bool:
    """torch built with oneDNN on an x86 CPU with AVX2 or better: where fp32 weights are reordered
    once for oneDNN (measured on AVX2; the gain is the per-call reorder saved, on any x86 ISA)."""
    return (torch.backends.mkldnn.is_available()
            and torch.backends.cpu.get_cpu_capability() in cpu_extension.CPU_CAPABILITIES)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out_features, in_features] bf16 or fp32 CPU -> its copy packed for packed_linear:
    AMX tiles for bf16 where the kernels run AMX and the shape fits, else oneDNN's blocked copy."""
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_weight needs a 2-D bf16 or fp32 CPU weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if weight.dtype == torch.bfloat16 and cpu_amx_linear.is_available() and cpu_amx_linear.fits(weight):
        return cpu_amx_linear.pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


# The C++ decoder layer (kernels/cpu_step_ops.py) pads a step of fewer rows to MIN_LAYER_ROWS on a
# Zen 4 (layer_min_rows): on a 2-vCPU one (family 25 model 17; AVX512-BF16, no AMX) oneDNN's bf16
# GEMMs over SmolLM2's 30 layers took 15.2, 13.3, 11.3, 11.3 and 10.7 ms at 1, 2, 4, 5 and 6 rows
# (`python scripts/bench_cpu_linear.py --weights fused_layers --bf16 --packed --rows 1,2,4,5,6
# --threads 2 --repeats 11`): its few-row kernels stream the weights slower, and the zero rows cost
# nothing while that stream bounds the step. Decode steps of one, two, three and four sequences took
# 3-10 % and 6-14 % less, 4 % less to 1 % more, and 1 % less to 6 % more (`python
# scripts/bench_step_rows.py --sequences 1,2,3,4 --rounds 60`, four runs, one shorter; a minimum of
# 4 instead: 3 % and 11 % less at one and two, nothing at three and four). On a Zen 5 (family 26
# model 2: 512-bit units where Zen 4 runs each 512-bit op as two halves) the padding did not pay:
# one sequence's steps 3, 6 and 11 % longer in three runs of the same command, two within 1 %,
# three and four 2 % shorter to 5 % longer, and minimums of 3 and 4 no better; so it pads only
# where it was measured to gain. Not packed_linear: from Python the padding itself (a zeros tensor
# and a copy, some 25 us a call) costs more than it saves.
MIN_LAYER_ROWS = 5
ZEN4_FAMILY = ("AuthenticAMD", 25)  # Zen 3 too, which has no AVX-512: then bf16 does not run fast
PAD_ABOVE_ROWS = 64
ROW_MULTIPLE = 8
COARSE_ABOVE_ROWS = 512
COARSE_ROW_MULTIPLE = 64


@functools.cache
def layer_min_rows() -> int:
    """The row minimum of the C++ decoder layer's oneDNN GEMMs on this CPU: MIN_LAYER_ROWS on a Zen 4
    (oneDNN's bf16 GEMMs, no AMX tiles), 1 (no padding) elsewhere."""
    zen4 = (cpu_isa.cpu_family() == ZEN4_FAMILY and runs_fast_here()
            and not torch.cpu._is_amx_tile_supported())
    return MIN_LAYER_ROWS if zen4 else 1


def padded_rows(rows: int, min_rows: int = 1) -> int:
    """The row count packed_linear hands oneDNN for an input of `rows` rows (the C++ decoder
    layer: at least min_rows = layer_min_rows())."""
    if rows < min_rows:
        return min_rows
    if rows <= PAD_ABOVE_ROWS:
        return rows
    multiple = ROW_MULTIPLE if rows <= COARSE_ABOVE_ROWS else COARSE_ROW_MULTIPLE
    return -(-rows // multiple) * multiple


def row_buckets(max_rows: int) -> list[int]:
    """Every row count packed_linear hands oneDNN for inputs of 1..max_rows rows."""
    return sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x: [..., in_features] of the weight's dtype (bf16 or fp32),
    packed = pack_weight(weight)."""
    if cpu_amx_linear.is_packed(packed):
        return cpu_amx_linear.amx_linear(x, packed, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    target = padded_rows(rows)
    if target == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    padded = x.new_zeros(target, x.shape[-1])
    padded[:rows] = x.reshape(rows, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def warm_up(packed: torch.Tensor, max_rows: int) -> bool:
    """Build (and cache) oneDNN's primitive for every row count up to max_rows, for this weight's
    shape (a packed tensor keeps its [out_features, in_features]): a step then never waits for one.
    True if it did. AMX tiles need none. An fp32 copy is left to build its primitives as steps
    come: it serves only row counts past the skinny kernel's (a few dozen buckets), where the
    first call at a count cost about 1 ms more on a 3072 x 576 weight against a 4-17 ms GEMM,
    while warming the 49,152-wide lm_head at those counts would take seconds of GEMMs at start."""
    if cpu_amx_linear.is_packed(packed) or packed.dtype == torch.float32:
        return False
    buckets = row_buckets(max_rows)
    inputs = torch.zeros(buckets[-1], packed.shape[1], dtype=torch.bfloat16)
    for rows in buckets:
        packed_linear(inputs[:rows], packed)
    return True
