"""Builds and loads Carpool's CPU kernels (C++ with AVX2 + FMA, in kernels/csrc/) as one extension.

The command-line flags target AVX2 + FMA only, so the build runs on any AVX2 CPU whatever CPU built
it; the AVX-512 and AMX paths are compiled in their own translation units (`#pragma GCC target`)
and picked at run time from CPUID (kernels.cpu_isa). CARPOOL_CPU_ISA=avx2 (or avx512_bf16) in the
environment pins the paths below the CPU's best.

Compiled on first use (10-20 s, once per machine and source version, cached under
~/.cache/carpool/kernels; torch rebuilds it when a source changes), loaded from that cache in
well under a second afterwards. Where it cannot be built (no compiler, no AVX2) `load()` returns
None after one warning, and callers keep using the pure-torch twins.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("bindings.cpp", "cpu_isa.cpp", "skinny_linear.cpp", "paged_attention_cpu.cpp",
                        "paged_attention_avx2.cpp", "paged_attention_avx512.cpp", "layer_ops_cpu.cpp",
                        "layer_ops_avx512.cpp", "amx_linear.cpp", "chunk_attention.cpp", "decoder_layer_cpu.cpp")]
ISA_ENV_VAR = "CARPOOL_CPU_ISA"  # "avx2": the AVX2 paths even on an AVX-512 CPU; unset or "auto": the best
EXTENSION_NAME = "carpool_cpu_kernels"
CPU_CAPABILITIES = ("AVX2", "AVX512")  # torch's names for CPUs that have AVX2 and FMA
STALE_LOCK_SECONDS = 180.0  # a build takes 10-25 s; 215 s was seen once on a saturated core
# One build per torch and Python version (an extension is tied to both); torch rebuilds on a source change.
BUILD_ROOT = Path.home() / ".cache" / "carpool" / "kernels"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None where it cannot run here (said once, in the log)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CPU_CAPABILITIES:
        log.warning("Carpool's CPU kernels need AVX2; this CPU offers %s: using the torch twins", capability)
        return None
    from torch.utils import cpp_extension  # slow to import; only needed here

    _put_ninja_on_path()
    build_dir = BUILD_ROOT / (f"{EXTENSION_NAME}-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
                              f"-{_source_tree_tag()}")
    started = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_build_lock(build_dir)
        module = cpp_extension.load(
            EXTENSION_NAME, [str(source) for source in SOURCES], extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_include_paths=[str(SOURCES[0].parent)],
            # -fopenmp: at::parallel_for runs serially without it. The extension binds to the
            # libgomp.so.1 torch has already loaded, so both share one thread pool.
            extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, a failed build
        log.warning("could not build Carpool's CPU kernels (%s): using the torch twins", exc)
        return None
    _apply_isa_override(module)
    log.info("Carpool's CPU kernels ready in %.1f s, running %s", time.perf_counter() - started, module.active_isa())
    return module


def _apply_isa_override(module: ModuleType) -> None:
    """CARPOOL_CPU_ISA: pin an ISA (tests and A/B benchmarks run the AVX2 paths on an AVX-512 box)."""
    wanted = os.environ.get(ISA_ENV_VAR, "auto").strip().lower()
    if wanted in ("", "auto"):
        return
    try:
        module.set_active_isa(wanted)
    except ValueError as exc:
        log.warning("%s=%s ignored (%s): running %s", ISA_ENV_VAR, wanted, exc, module.active_isa())


def _source_tree_tag() -> str:
    """A short tag of the csrc folder's path. Two checkouts (git worktrees) share ~/.cache: with one
    build folder, each would rebuild over the other's module, and a process could load the other
    checkout's kernels (seen: a module without a function its Python side called)."""
    return hashlib.sha1(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]


def _remove_stale_build_lock(build_dir: Path) -> None:
    """A build killed midway (SIGKILL) leaves torch's lock file behind, and every later load would
    wait on it forever; a real build takes well under STALE_LOCK_SECONDS."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing a %.0f s old build lock left by a killed build: %s", age, lock)
        lock.unlink(missing_ok=True)


def _put_ninja_on_path() -> None:
    """torch runs `ninja` by name; the PyPI package puts it beside this interpreter, maybe off PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        candidate = Path(sys.executable).parent
    else:
        candidate = Path(ninja.BIN_DIR)
    os.environ["PATH"] = f"{candidate}{os.pathsep}{os.environ.get('PATH', '')}"
