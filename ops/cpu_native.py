"""The small-shape CPU kernel (``cpu_rows.c``): built once with the machine's C compiler,
called through ``ctypes``.

At decode sizes the torch path of ``cpu.py`` is a dozen ATen calls whose dispatch costs
more than the arithmetic; ``cpu_rows.c`` does the whole call in one C function (docs/design.md
section 9 has the figures). It runs on one thread, so it serves a call when torch runs one
thread (where it beats the torch path at every size) or when the call's elements (sources
plus outputs) times torch's thread count are at most ``PARALLEL_ELEMENTS`` (2^20 elements
at 2 threads, below the sizes where the torch path's threads win). The scaling by thread
count is a model: the more threads, the smaller the calls the torch path wins.

The build: ``$CC`` (default ``cc``, the compiler Inductor's CPU backend needs anyway) with
``-O3 -shared -fPIC``, no ``-march=native`` (a cache on a shared home directory may serve
other machines), into ``$KIMI_PASSES_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kimi_passes``,
else ``~/.cache/kimi_passes``) under a name keyed by the source, the flags and the machine
type; written to a temporary file and renamed, so concurrent processes share one build.
Where it cannot build or load, the ops warn once (``KimiNativeWarning``, naming the reason
and what to do) and use the torch path. ``KIMI_PASSES_NATIVE_CPU=0`` (read at import) turns
it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import struct
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .attn_res_args import AttnResArgs

SOURCE = Path(__file__).with_name("cpu_rows.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
#: Elements of a call (sources plus outputs) times torch's threads that the C kernel serves.
PARALLEL_ELEMENTS = 1 << 21
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: ``kimi_rows_call`` in cpu_rows.c: 15 int64 (dtype, sizes, addresses, strides), the two
#: epsilons, 4 int64 (the outputs). One packed buffer: ctypes converts each argument apart.
_CALL = struct.Struct("=15q2d4q")


class KimiNativeWarning(RuntimeWarning):
    """The small-shape CPU kernel could not be built or loaded; the torch path serves."""


def cache_dir() -> Path:
    root = os.environ.get("KIMI_PASSES_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kimi_passes"


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((_compiler(), *FLAGS)).encode())
    return cache_dir() / f"cpu_rows-{platform.machine()}-{key.hexdigest()[:16]}.so"


def build(path: Path, defines: tuple[str, ...] = ()) -> None:
    """Compile ``cpu_rows.c`` into ``path`` (atomically), with ``defines`` (``-DNAME``) added
    to the flags; raise naming what failed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [_compiler(), *FLAGS, *defines, str(SOURCE), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_LIB: ctypes.CDLL | None = None
_FAILED: str | None = None


def _load() -> ctypes.CDLL | None:
    global _LIB, _FAILED
    if _LIB is not None or _FAILED is not None:
        return _LIB
    try:
        path = library_path()
        if not path.exists():
            build(path)
        lib = open_library(path)
    except (OSError, RuntimeError) as e:
        _FAILED = str(e)
        warnings.warn(
            f"kimi_passes: the small-shape CPU kernel of the kimi ops could not be built or "
            f"loaded ({_FAILED}); the CPU ops use the torch path, which is slower at decode "
            f"sizes. Install a C compiler (or set CC), or set KIMI_PASSES_CACHE_DIR to a "
            f"writable directory; KIMI_PASSES_NATIVE_CPU=0 turns the kernel off quietly.",
            KimiNativeWarning, stacklevel=4)
        return None
    _LIB = lib
    return lib


def open_library(path: Path) -> ctypes.CDLL:
    """Load a build of ``cpu_rows.c``, its one entry point typed for ``attn_res_rows``."""
    lib = ctypes.CDLL(str(path))
    lib.kimi_attn_res_rows_call.argtypes = [ctypes.c_char_p]
    lib.kimi_attn_res_rows_call.restype = ctypes.c_int
    return lib


#: Read once at import: ``KIMI_PASSES_NATIVE_CPU=0`` keeps every call on the torch path.
ENABLED = os.environ.get("KIMI_PASSES_NATIVE_CPU", "1") != "0"


def serves(a: AttnResArgs, outputs: int) -> bool:
    """Whether the C kernel takes this call (``outputs`` ``[T, H]`` tensors written): one
    thread or a small call, a supported dtype, every tensor's last dimension contiguous,
    no written tensor whose elements share memory (an expanded ``prefix``: the torch path
    then raises torch's error, where the C kernel would write one row many times)."""
    T, H = a.prefix.shape
    threads = torch.get_num_threads()
    return (ENABLED and a.prefix.dtype in _DTYPE_CODE
            and (threads == 1
                 or T * H * (a.num_blocks + 1 + outputs) * threads <= PARALLEL_ELEMENTS)
            and (H <= 1 or _rows_contiguous(a))
            and not (a.delta is not None and _shares_memory(a.prefix))
            and not (a.block_write_idx >= 0 and _shares_memory(a.blocks)))


def _rows_contiguous(a: AttnResArgs) -> bool:
    # is_contiguous() reads a cached flag: the common case skips stride()'s tuple. A loop,
    # not all() over a generator: no generator frame on every call.
    for t in a[:6]:
        if t is not None and not t.is_contiguous() and t.stride()[-1] != 1:
            return False
    return True


def _shares_memory(t: torch.Tensor) -> bool:
    return torch._debug_has_internal_overlap(t) == 1  # 1: yes; 0: no; 2: too hard to tell


def attn_res_rows(a: AttnResArgs, out: torch.Tensor, mixed: torch.Tensor | None) -> bool:
    """Run the call in C, filling ``out`` (and ``mixed``); False where the C kernel is not
    available (the caller then runs the torch path)."""
    lib = _load()
    if lib is None:
        return False
    prefix, delta, blocks, onw = a.prefix, a.delta, a.blocks, a.output_norm_weight
    T, H = prefix.shape
    blocks_rs, blocks_ss, _ = blocks.stride()
    # stride()[0], not stride(0): the tuple is built in C, the indexed form parses its
    # argument in Python, which costs more.
    rc = lib.kimi_attn_res_rows_call(_CALL.pack(
        _DTYPE_CODE[prefix.dtype], T, H, a.num_blocks, a.block_write_idx,
        prefix.data_ptr(), prefix.stride()[0],
        0 if delta is None else delta.data_ptr(), 0 if delta is None else delta.stride()[0],
        blocks.data_ptr(), blocks_rs, blocks_ss,
        a.norm_weight.data_ptr(), a.qk_weight.data_ptr(), 0 if onw is None else onw.data_ptr(),
        a.eps, a.output_norm_eps,
        out.data_ptr(), out.stride()[0],
        0 if mixed is None else mixed.data_ptr(), 0 if mixed is None else mixed.stride()[0]))
    if rc != 0:
        raise MemoryError(f"kimi attn_res: the CPU kernel could not allocate "
                          f"{(H * (a.num_blocks + 3)) * 4} bytes of scratch")
    return True
