"""The libraries the worker process loads before any other: its memory allocator and its OpenMP
runtime. Both must be in place when the process starts (LD_PRELOAD), so the worker re-executes
itself once with them set, as vLLM's CPU backend asks its users to do by hand.

Allocator: tcmalloc (Debian's libtcmalloc-minimal4) where it is installed, the default. A step
allocates and frees the same activation, logits and metadata tensors again and again; glibc's
malloc hands the large ones back to the kernel and faults them in anew at the next step, tcmalloc
keeps them. On a 2-vCPU EPYC (Zen 4, AVX512-BF16), the engine alone, 128 chat requests, three
pairs run alternately: 558.8/518.4/519.0 tok/s with tcmalloc against 478.2/488.0/511.5 without
(`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python scripts/bench_engine.py
--num-requests 128 --modes continuous --baselines none --no-profile --threads 2`). Setting
glibc's own thresholds instead (GLIBC_TUNABLES mmap_threshold/trim_threshold) gave no steady
gain (480.8/528.2/484.4). vLLM's own figure on the same workload moved from 316.5 to 426.0 tok/s
with tcmalloc installed (two runs an hour apart; README, engine throughput).

OpenMP: torch's CPU build links GNU OpenMP. Intel's runtime (libiomp5, the PyPI package
`intel-openmp`) implements the same GOMP entry points and, loaded first, serves every parallel
region instead: torch's, oneDNN's and the C++ kernels'. On a 2-core Sapphire Rapids shared with
other work it gave Carpool 406/339 tok/s against 377/303 on GNU OpenMP, pair by pair. Opt-in
(CARPOOL_OPENMP=intel), not the default: with it on, one run of the integration suite saw two
workers stop serving without a word in their logs, which no later run reproduced; two OpenMP
runtimes in one process (libtorch still links GNU's) is the suspect until that is understood.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

_PRELOADED = "CARPOOL_PRELOADED"  # set on the re-executed process: never twice

# Where Debian/Ubuntu (x86-64, arm64) and Fedora put tcmalloc's minimal build, then the full one
# (gperftools' libtcmalloc, the same allocator with its profilers) where only that is installed.
TCMALLOC_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
    Path("/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4"),
    Path("/usr/lib64/libtcmalloc_minimal.so.4"),
    Path("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"),
)


def tcmalloc_library(candidates: Sequence[Path] = TCMALLOC_PATHS) -> Path | None:
    """The first tcmalloc (minimal) installed here, if any."""
    return next((path for path in candidates if path.is_file()), None)


def intel_openmp_library(prefix: str = sys.prefix) -> Path | None:
    """libiomp5.so as the intel-openmp wheel installs it into this environment, if it does."""
    candidate = Path(prefix) / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def wanted_libraries(allocator: str, openmp: str, tcmalloc: Path | None,
                     intel_openmp: Path | None) -> list[Path]:
    """What the settings ask to preload, of what is installed (a missing library is skipped:
    the process runs on glibc's malloc or GNU OpenMP, as without the setting)."""
    wanted = [tcmalloc if allocator == "tcmalloc" else None,
              intel_openmp if openmp == "intel" else None]
    return [path for path in wanted if path is not None]


def preload_environment(environ: Mapping[str, str], libraries: Sequence[Path]) -> dict[str, str] | None:
    """The environment to re-execute with so that `libraries` load first; None when the
    process should run as it is (nothing to add, or already re-executed once)."""
    preload = environ.get("LD_PRELOAD", "")
    missing = [str(path) for path in libraries if path.name not in preload]
    if not missing or environ.get(_PRELOADED):
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join([*missing, *([preload] if preload else [])])
    env[_PRELOADED] = "1"
    return env
