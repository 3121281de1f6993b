"""Building tierlm's small C kernels for this CPU (cpu_paged_decode.py, cpu_int8_gemv.py): compiled once per CPU
instruction level with the system C compiler into the user cache folder, loaded with ctypes.

Each source is compiled for the level's explicit target flags (platforms/cpu_features.py; never -march=native)
plus -mtune=native, which only schedules instructions for this CPU model: x86-64-v4's generic tuning kept 256-bit
vectors and ran ~10 % slower here. The file name carries the kernel's name, the level and a hash of the source,
the compiler's identity, the CPU model and the flags, so a cache folder shared between machines never hands one CPU
a kernel built for another. A build for the level that fails (an old compiler without the level's flags) is
retried once as a plain baseline build; if that fails too the caller keeps its torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierlm.platforms.cpu_features import CpuFeatures, find_c_compiler, this_cpu

log = logging.getLogger(__name__)


# What every kernel source starts with: bfloat16 <-> float32 as torch converts them (bf16 is the top half of a
# float32; float32 -> bf16 rounds to nearest even).
BF16_C = r"""
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t b) { uint32_t x = (uint32_t)b << 16; float f; memcpy(&f, &x, 4); return f; }
static inline uint16_t to_bf(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  /* NaN stays NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
"""
# 16 float32 -> bf16 in AVX-512 (after #include <immintrin.h>, in a build with AVX-512): to_bf's bits, 16 at a time.
TO_BF16X16_C = r"""
/* 16 float32 -> bf16, round to nearest even, NaN kept a quiet NaN: to_bf's bits, 16 at a time */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m256i to_bf16x16(__m512 f) {
    const __m512i x = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1))));
    /* NaN found on the bits (a float compare may be folded away under -ffast-math) */
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, x, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
"""
# Vectorized sums need reassociated float arithmetic (-ffast-math; each kernel's roundings are its explicit to_bf
# calls). -fno-semantic-interposition: with plain -fPIC gcc kept a kernel's per-item function behind the
# PLT-interposable ABI and the call ran 2.5x slower (paged decode at 3.9k keys, 8 heads, float32: 6.1 -> 2.0 ms).
CFLAGS = ("-O3", "-fPIC", "-fno-semantic-interposition", "-ffast-math")


@dataclass(frozen=True)
class KernelBuild:
    """What a load built or found: the library, the level its instructions belong to, and why."""
    lib: ctypes.CDLL | None
    level: str | None  # the CPU level the code was compiled for; "baseline" for the plain fallback build
    why: str


def compiler_identity(cc: str) -> str:
    """The resolved compiler and its version line: a different compiler is a different build."""
    path = shutil.which(cc) or cc
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else ""
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(path)} {version}"


def default_cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tierlm")) / "kernels"


def library_name(name: str, source: str, cflags: tuple[str, ...], level: str, cc_identity: str,
                 target_flags: tuple[str, ...]) -> str:
    """The cached file's name: the kernel, the level, then a hash of everything the machine code depends on."""
    key = "\0".join((source, cc_identity, " ".join(cflags), " ".join(target_flags), os.uname().machine, level))
    return f"{name}_{level}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build_into_cache(lib_path: Path, build: Callable[[Path, Path], None]) -> Path:
    """``lib_path``, made first by ``build(folder, output)`` when the cache does not hold it: built in a temporary
    folder beside the cache (os.replace cannot move a file across filesystems, and /tmp is often its own), then
    moved into place atomically, so a concurrent server never loads half a file."""
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            built = Path(tmp) / lib_path.name
            build(Path(tmp), built)
            os.replace(built, lib_path)
    return lib_path


def build_library(name: str, source: str, cflags: tuple[str, ...], cc: str, cc_identity: str, level: str,
                  target_flags: tuple[str, ...], cache_dir: Path) -> Path:
    """The compiled library's path, compiling it first when the cache does not hold it."""
    def build(folder: Path, built: Path) -> None:
        src, obj = folder / f"{name}.c", folder / f"{name}.o"
        src.write_text(source)
        subprocess.run([cc, *cflags, *target_flags, "-c", "-o", str(obj), str(src)], check=True,
                       capture_output=True, timeout=120)
        # Linked without -ffast-math: gcc < 13 would otherwise add crtfastmath.o, whose constructor turns on
        # flush-to-zero for the whole process (torch's float32 included) when the library loads.
        vector_math = ["-lmvec"] if b"_ZGV" in obj.read_bytes() else []  # glibc's vector expf
        subprocess.run([cc, "-shared", "-o", str(built), str(obj), *vector_math, "-lm"], check=True,
                       capture_output=True, timeout=120)

    return build_into_cache(cache_dir / library_name(name, source, cflags, level, cc_identity, target_flags), build)


def build_for_cpu(name: str, source: str, cflags: tuple[str, ...], bind: Callable[[ctypes.CDLL], None],
                  cpu: CpuFeatures, cc: str, cache_dir: Path, fallback: str) -> KernelBuild:
    """Build (or find) and load ``source`` for ``cpu``'s level, else a baseline build; ``bind`` sets the
    functions' ctypes signatures (an AttributeError there counts as a failed build). ``fallback`` ends the reason
    when nothing loads (what runs instead)."""
    # the CPU model too: -mtune=native tunes for it, so another model of the same level builds its own
    identity = f"{compiler_identity(cc)}\0{cpu.model_name}"
    errors: list[str] = []
    attempts = ((cpu.level, (*cpu.compile_flags, "-mtune=native")), ("baseline", ()))
    for level, flags in attempts:
        try:
            path = build_library(name, source, cflags, cc, identity, level, flags, cache_dir)
            lib = ctypes.CDLL(str(path))
            bind(lib)
            note = f" after {len(errors)} failed build(s)" if errors else ""
            return KernelBuild(lib, level, f"built with {cc} for {level} ({' '.join(flags) or 'no target flags'})"
                                           f"{note}: {path}")
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-300:]
            errors.append(f"{level} {' '.join(flags)}: {e} {detail}".strip())
    return KernelBuild(None, None, "could not build or load it (" + "; ".join(errors) + f"); {fallback}")


def build_x86_vector_kernel(name: str, source: str, cflags: tuple[str, ...], bind: Callable[[ctypes.CDLL], None],
                            cpu: CpuFeatures, cache_dir: Path, switch_env: str, fallback: str,
                            simd_bits: Callable[[ctypes.CDLL], int]) -> KernelBuild:
    """``build_for_cpu`` for a kernel whose C has AVX-512 and AVX2 code and a plain-C rest (cpu_int8_gemv.py,
    cpu_f32_gemv.py): off with ``switch_env``=0, nothing on other architectures or without a C compiler, and a
    build whose ``simd_bits`` is 0 (a baseline build: plain C, which torch's own kernel outruns) not used."""
    if os.environ.get(switch_env, "1") == "0":
        return KernelBuild(None, None, f"off ({switch_env}=0); {fallback}")
    if cpu.arch != "x86_64":
        return KernelBuild(None, None, f"{cpu.arch}: the kernel has AVX-512 and AVX2 code only; {fallback}")
    cc = find_c_compiler(os.environ)
    if cc is None:
        return KernelBuild(None, None, f"no C compiler (cc/gcc/clang); {fallback}")
    build = build_for_cpu(name, source, cflags, bind, cpu, cc, cache_dir, fallback)
    if build.lib is not None and simd_bits(build.lib) == 0:
        return KernelBuild(None, None, f"{build.level} build has no AVX2/AVX-512 code; {fallback}")
    return build


class LoadOnce:
    """A kernel library set up once per process, on first use, under a lock: ``load(cpu)`` builds or finds it, and
    an exception there counts as "not here" (``fallback`` says what serves instead), so a failure is met once, not
    on every call. ``build`` keeps the reason for /server_info and doctor."""

    def __init__(self, load: Callable[[CpuFeatures], KernelBuild], label: str, fallback: str,
                 warn_when_missing: bool = True) -> None:
        self._load, self._label, self._fallback, self._warn = load, label, fallback, warn_when_missing
        self._lock = threading.Lock()
        self._done = False
        self.build = KernelBuild(None, None, "not loaded yet")
        self.lib: ctypes.CDLL | None = None

    def __call__(self, cpu: CpuFeatures | None = None) -> ctypes.CDLL | None:
        if self._done:
            return self.lib
        with self._lock:
            if not self._done:
                try:
                    build = self._load(cpu or this_cpu())
                except Exception as e:  # noqa: BLE001 - the caller's fallback serves; the reason is logged
                    build = KernelBuild(None, None, f"could not set it up ({type(e).__name__}: {e}); "
                                                    f"{self._fallback}")
                self.build, self.lib = build, build.lib
                self._done = True  # after lib: a thread reading _done without the lock then finds the library too
                (log.warning if self.lib is None and self._warn else log.info)("%s: %s", self._label, build.why)
        return self.lib

    def fresh(self) -> "LoadOnce":
        """An unloaded twin (tests: the next call sets the kernel up again)."""
        return LoadOnce(self._load, self._label, self._fallback, self._warn)

    def describe(self) -> dict[str, str | None]:
        """The kernel as loaded (for /server_info and doctor): the level built for and why, or why not."""
        return {"level": self.build.level, "why": self.build.why}
