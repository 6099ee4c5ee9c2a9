"""Which instruction set the C++ CPU kernels run with, probed at run time, and a switch to pin it.

The extension is built with AVX2 + FMA flags only (so it runs on any AVX2 CPU, whichever machine
built it); kernels that pay for it also have an AVX-512 path (F/BW/VL/DQ and AVX512_BF16), in its
own translation unit, taken where CPUID reports those features. Where the CPU has AMX and the OS
grants it, bf16 linear layers also run on AMX tiles (ISA "amx", which includes the AVX-512 paths).
Benchmarks print `active_isa()`; tests run every path on the best machine with `forced_isa(...)`,
so smaller CPUs stay covered. CARPOOL_CPU_ISA=avx2 (or avx512_bf16) in the environment pins the
paths below the CPU's best for a whole process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kernels import cpu_extension

AVX2 = "avx2"
AVX512_BF16 = "avx512_bf16"
AMX = "amx"  # the AVX-512 paths, and bf16 linear layers on AMX tiles (kernels.cpu_amx_linear)
ISAS = (AVX2, AVX512_BF16, AMX)


def cpu_features() -> dict[str, bool]:
    """The CPU features the kernels probe (CPUID), plus built_avx512: whether the compiler built
    the AVX-512 paths at all. Empty where the extension is not built."""
    module = cpu_extension.load()
    return {} if module is None else dict(module.cpu_features())


def cpu_family(cpuinfo: str | None = None) -> tuple[str, int] | None:
    """The CPU's vendor and family as Linux names them (`vendor_id`, `cpu family` in /proc/cpuinfo:
    ("AuthenticAMD", 25) on a Zen 3 or Zen 4, 26 on a Zen 5; ("GenuineIntel", 6) on Xeons), for
    the tuning choices a feature flag does not tell; None where they cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough: every core of a VM is the same
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    vendor, family = fields.get("vendor_id"), fields.get("cpu family", "")
    return (vendor, int(family)) if vendor and family.isdigit() else None


def active_isa() -> str:
    """'amx', 'avx512_bf16' or 'avx2' for the C++ kernels; 'none' where they are not built (torch twins)."""
    module = cpu_extension.load()
    return "none" if module is None else str(module.active_isa())


def supported_isas() -> list[str]:
    """The ISAs the kernels can run with on this CPU (AVX2 first, the best last)."""
    features = cpu_features()
    if not features:
        return []
    avx512 = features.get("built_avx512", False) and all(
        features.get(name, False) for name in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16"))
    if not avx512:
        return [AVX2]
    return [AVX2, AVX512_BF16, AMX] if features.get("amx", False) else [AVX2, AVX512_BF16]


def set_isa(name: str) -> None:
    """Run the kernels with `name` from now on, process-wide; ValueError where this CPU lacks it."""
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}: expected one of {ISAS}")
    module = cpu_extension.load()
    if module is None:
        raise ValueError("the CPU kernels are not built here")
    module.set_active_isa(name)


@contextmanager
def forced_isa(name: str) -> Iterator[None]:
    """The kernels run with `name` inside the block, then with what ran before."""
    previous = active_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)
