"""vLLM's K3 AttnRes kernel as the benchmarks' and tests' peer, never copied into the repository.

``load_peer(vendor)`` ("nvidia": vLLM's ``models/kimi_k3/nvidia/ops/attn_res.py``; "amd":
its ROCm twin) returns a ``Peer``: the kernel module, its launcher ``attn_res`` and
``source``, the line every row and test that uses it prints. Where it comes from, in order:
``$KIMI_PASSES_VLLM_PEER`` (a prepared ``vllm_k3/`` folder); an installed vLLM (imported as
vLLM imports it where Triton compiles for a GPU, else its installed file run with
stand-ins); the checkout's ``.gpu_carry/vllm_k3``; else a ``PeerError`` naming
``bash tools/install_vllm.sh`` and ``bash tools/gpu_prepare.sh``.

vLLM's file always runs unchanged. Only while it runs does ``sys.modules`` hold stand-ins
for the vLLM names it imports (restored afterwards): ``vllm.triton_utils`` hands out
triton's own ``triton`` / ``tl``; ``vllm.platforms.current_platform`` reports no SM100
family, so vLLM's native ``_C`` op is never taken and its Triton path runs, and decides PDL
as vLLM's CUDA platform does; ``vllm._custom_ops`` is empty; ``get_fp8_min_max`` gives the
module's ``QUANT_MAX`` where a caller set one, else vLLM's bound for this platform. The
kernel is decorated in the mode triton.language was built in (``ops/triton_mode.py``). A
file is loaded once per process and place: a new load is a new ``triton.jit`` function.

``python -m kimi_passes.vllm.peer prepare DIR`` copies the installed files into DIR
byte for byte with a MANIFEST.json; ``verify DIR`` loads them from there and checks a tiny
call against the reference (``tools/gpu_prepare.sh`` runs both; docs/testing.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_VAR = "KIMI_PASSES_VLLM_PEER"
#: Each vendor's kernel file, under vLLM's ``models/kimi_k3/`` and under a prepared folder.
FILES = {"nvidia": "nvidia/ops/attn_res.py", "amd": "amd/ops/attn_res.py"}
#: The checkout's prepared folder (tools/gpu_prepare.sh writes it; git-ignored).
CARRY = Path(__file__).resolve().parents[2] / ".gpu_carry" / "vllm_k3"
MANIFEST = "MANIFEST.json"
INSTALL, PREPARE = "bash tools/install_vllm.sh", "bash tools/gpu_prepare.sh"
#: The vLLM modules the files import, each given a stand-in while a file runs.
STAND_INS = ("vllm._custom_ops", "vllm.platforms", "vllm.triton_utils",
             "vllm.model_executor.layers.quantization.utils.quant_utils")
#: verify's tiny call: fp32, against the reference at the op's fp32 tolerance.
VERIFY_TOL = 1e-5


class PeerError(RuntimeError):
    """vLLM's K3 kernel cannot be loaded from anywhere; the message names the fix."""


@dataclass(frozen=True)
class Peer:
    """vLLM's kernel module, its ``attn_res`` launcher, and where it came from."""

    module: types.ModuleType
    attn_res: Callable[..., Any]
    source: str


def load_peer(vendor: str = "nvidia") -> Peer:
    """vLLM's K3 kernel for ``vendor`` ("nvidia" or "amd"), from the first place that has it
    (see the module docstring); ``PeerError`` when none does or a prepared copy is damaged."""
    if vendor not in FILES:
        raise ValueError(f"load_peer: vendor {vendor!r}; choose from {sorted(FILES)}")
    env = os.environ.get(ENV_VAR)
    if env:
        return _prepared(vendor, Path(env).resolve(), f"${ENV_VAR}={env}")
    root = installed_root()
    if root is not None:
        return _installed(vendor, root / FILES[vendor])
    if (CARRY / MANIFEST).is_file():
        return _prepared(vendor, CARRY, "the checkout's prepared folder")
    raise PeerError(f"vLLM's K3 kernel ({FILES[vendor]}) is not available: vLLM is not "
                    f"installed ({INSTALL} installs it), ${ENV_VAR} is unset and {CARRY} "
                    f"does not exist ({PREPARE} writes it, from an installed vLLM)")


def installed_root() -> Path | None:
    """The installed vLLM's ``models/kimi_k3`` folder (found without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "models" / "kimi_k3"


def _vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _installed(vendor: str, path: Path) -> Peer:
    version = _vllm_version()
    if not path.is_file():
        raise PeerError(f"the installed vLLM {version} has no {path}: kimi_passes reads vLLM "
                        f"0.33.0's or 0.34.0's K3 kernel (the same file; {INSTALL} installs it)")
    if _triton_compiles_for_a_gpu():
        module = importlib.import_module(f"vllm.models.kimi_k3.{vendor}.ops.attn_res")
        from vllm.triton_utils import HAS_TRITON

        if HAS_TRITON:  # vLLM's own dispatch (its SM100 native op where it has one)
            return Peer(module, module.attn_res,
                        f"installed vLLM {version} at {path} (imported as vLLM imports it)")
    module = _run_file(path, vendor)
    return Peer(module, module.attn_res, f"installed vLLM {version} at {path} (its file run "
                                         "with stand-ins for vLLM's imports)")


def _triton_compiles_for_a_gpu() -> bool:
    import torch

    from kimi_passes.ops.triton_mode import INTERPRETED

    return torch.cuda.is_available() and not INTERPRETED


def _prepared(vendor: str, root: Path, what: str) -> Peer:
    """The prepared copy at ``root``, checked against its MANIFEST.json before it runs."""
    manifest = read_manifest(root, what)
    name = FILES[vendor]
    entry, path = manifest["files"].get(name), root / name
    if not isinstance(entry, dict) or "sha256" not in entry or not path.is_file():
        raise PeerError(f"{what}: {root} lacks {name} or its {MANIFEST} entry; run {PREPARE} "
                        "again")
    digest = sha256(path)
    if digest != entry["sha256"]:
        raise PeerError(f"{what}: {path} has sha256 {digest[:16]}, not the {entry['sha256'][:16]}"
                        f" its {MANIFEST} records (the copy was changed); run {PREPARE} again")
    module = _run_file(path, vendor, digest)
    return Peer(module, module.attn_res, f"prepared copy of vLLM {manifest['vllm_version']} "
                                         f"(sha256 {digest[:16]}) at {path}")


def read_manifest(root: Path, what: str = "the prepared folder") -> dict:
    """A prepared folder's MANIFEST.json; ``PeerError`` naming the fix when it is not one."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        ok = isinstance(manifest.get("files"), dict) and "vllm_version" in manifest
    except (OSError, ValueError, AttributeError) as e:
        raise PeerError(f"{what}: {root} is not a prepared vLLM K3 folder ({MANIFEST}: "
                        f"{type(e).__name__}); run {PREPARE} (it writes .gpu_carry/vllm_k3)") from e
    if not ok:
        raise PeerError(f"{what}: {root / MANIFEST} lacks 'files' or 'vllm_version'; run "
                        f"{PREPARE} again")
    return manifest


@functools.cache
def _run_file(path: Path, vendor: str, digest: str = "") -> types.ModuleType:
    """vLLM's file executed unchanged as a module of its own, the stand-ins in ``sys.modules``
    only meanwhile. Cached by place and content: a new load is a new ``triton.jit``."""
    import triton

    from kimi_passes.ops.triton_mode import INTERPRETED

    code = compile(path.read_bytes(), str(path), "exec")
    module = types.ModuleType(f"kimi_passes_vllm_peer_{vendor}")
    module.__file__ = str(path)
    module.QUANT_MAX = None  # type: ignore[attr-defined]  # get_fp8_min_max's override
    with _stand_ins(module), triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = INTERPRETED
        exec(code, module.__dict__)
    return module


@contextlib.contextmanager
def _stand_ins(module: types.ModuleType) -> Iterator[None]:
    """``sys.modules`` with the stand-ins, then as it was (a real vLLM's entries back)."""
    made = _stand_in_modules(module)
    before = dict(sys.modules)
    sys.modules.update(made)
    try:
        yield
    finally:
        for name in list(sys.modules):
            if name == "vllm" or name.startswith("vllm."):
                del sys.modules[name]
        sys.modules.update({k: v for k, v in before.items()
                            if k == "vllm" or k.startswith("vllm.")})


def _stand_in_modules(module: types.ModuleType) -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    attrs: dict[str, dict[str, Any]] = {
        "vllm._custom_ops": {"__getattr__": _no_native_op},
        "vllm.platforms": {"current_platform": _Platform()},
        "vllm.triton_utils": {"triton": triton, "tl": tl},
        "vllm.model_executor.layers.quantization.utils.quant_utils":
            {"get_fp8_min_max": functools.partial(_fp8_min_max, module)},
    }
    made: dict[str, types.ModuleType] = {}
    for name in STAND_INS:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            made.setdefault(sub, types.ModuleType(sub, "kimi_passes.vllm.peer stand-in"))
        made[name].__dict__.update(attrs[name])
    for name, m in made.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(made[parent], child, m)
    return made


def _no_native_op(name: str):
    raise AttributeError(f"vllm._custom_ops.{name}: vLLM's compiled ops are not available to "
                         "the peer (kimi_passes.vllm.peer times vLLM's Triton path)")


class _Platform:
    """vLLM's ``current_platform``, as far as the kernel files ask it."""

    @staticmethod
    def is_device_capability_family(capability: int, device_id: int = 0) -> bool:
        return False  # no SM100 native op: vLLM's compiled extension is not here

    @staticmethod
    def is_arch_support_pdl() -> bool:
        import torch  # vLLM's CUDA platform: sm_90 and later; ROCm and CPU: never

        if torch.version.hip or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def is_fp8_fnuz() -> bool:
        import torch  # vLLM's ROCm platform: the MI300 series (gfx94x)

        return bool(torch.version.hip) and torch.cuda.is_available() and (
            "gfx94" in torch.cuda.get_device_properties(0).gcnArchName)


def _fp8_min_max(module: types.ModuleType) -> tuple[float, float]:
    """vLLM's ``get_fp8_min_max``: 224 on fnuz platforms, else e4m3fn's 448; a caller
    emulating another platform sets ``QUANT_MAX`` on the peer's module."""
    import torch

    bound = module.__dict__.get("QUANT_MAX")
    if bound is None:
        bound = 224.0 if _Platform.is_fp8_fnuz() else torch.finfo(torch.float8_e4m3fn).max
    return -float(bound), float(bound)


# ----------------------------------------------------------------------------- prepare


def prepare(dest: Path) -> dict:
    """Copy the installed vLLM's K3 kernel files into ``dest`` byte for byte, with a
    MANIFEST.json ``{vllm_version, files: {name: {source_path, sha256}}, ...}``."""
    root = installed_root()
    if root is None:
        raise PeerError(f"prepare: vLLM is not installed in {sys.executable}'s environment; "
                        f"{INSTALL} installs it (or set PYTHON to the CI venv's python)")
    files = {}
    for name in FILES.values():
        src = root / name
        if not src.is_file():
            raise PeerError(f"prepare: the installed vLLM {_vllm_version()} has no {src}; "
                            f"kimi_passes reads vLLM 0.33.0's or 0.34.0's ({INSTALL})")
        data = src.read_bytes()
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
        files[name] = {"source_path": str(src), "sha256": hashlib.sha256(data).hexdigest()}
    now = datetime.datetime.now(datetime.timezone.utc)
    manifest = {"vllm_version": _vllm_version(), "files": files,
                "prepared": now.isoformat(timespec="seconds"),
                "loader": "kimi_passes.vllm.peer", "stand_ins": list(STAND_INS)}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def verify(dest: Path) -> list[str]:
    """Check a prepared folder: each file equal to the installed one, loaded through
    ``load_peer`` with ``$KIMI_PASSES_VLLM_PEER`` at ``dest``, and a tiny fp32 call within
    ``VERIFY_TOL`` of the reference. Lines for the log; ``PeerError`` on any failure."""
    root = installed_root()
    lines = []
    for name, entry in read_manifest(dest)["files"].items():
        if root is not None and sha256(root / name) != entry["sha256"]:
            raise PeerError(f"verify: {dest / name} is not the installed {root / name}; run "
                            f"{PREPARE} again")
    with _env(ENV_VAR, str(dest)):
        for vendor in FILES:
            peer = load_peer(vendor)
            if not peer.source.startswith("prepared copy"):
                raise PeerError(f"verify: ${ENV_VAR} was not honoured ({peer.source})")
            err = tiny_call_error(peer)
            if not err <= VERIFY_TOL:
                raise PeerError(f"verify: {vendor}: {peer.source} is off the reference by "
                                f"{err:.3g} > {VERIFY_TOL} (fp32); is vLLM 0.33.0 or 0.34.0 "
                                "installed?")
            lines.append(f"{vendor}: {peer.source}: error {err:.2e} <= {VERIFY_TOL}")
    return lines


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def tiny_call_error(peer: Peer) -> float:
    """``rel_err`` of the peer's ``attn_res`` on a tiny fp32 call (delta, block write,
    output norm) against the reference, on the GPU where Triton compiles for one."""
    import torch

    from kimi_passes.ops.reference import attn_res_reference, op_args, rel_err
    from kimi_passes.ops.triton_mode import INTERPRETED

    if not INTERPRETED and not torch.cuda.is_available():
        raise PeerError("a tiny call needs a GPU or the interpreter: set TRITON_INTERPRET=1")
    device = "cpu" if INTERPRETED else "cuda"
    args = op_args(3, 32, 2, device=device, delta=0.5, write=2, output_norm=True, seed=3)
    want = attn_res_reference(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    got = peer.attn_res(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    return rel_err(got, want)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_passes.vllm.peer",
                                description="vLLM's K3 kernel: prepare a copy, verify it, or "
                                            "say where load_peer takes it from")
    p.add_argument("command", choices=("prepare", "verify", "show"))
    p.add_argument("dir", type=Path, nargs="?", help="the vllm_k3 folder (prepare, verify)")
    a = p.parse_args(argv)
    if a.command != "show" and a.dir is None:
        p.error(f"{a.command} needs DIR (e.g. .gpu_carry/vllm_k3)")
    try:
        if a.command == "prepare":
            m = prepare(a.dir)
            print(f"vllm_k3: vLLM {m['vllm_version']}: " + ", ".join(
                f"{n} (sha256 {f['sha256'][:16]})" for n, f in m["files"].items()))
        elif a.command == "verify":
            print("\n".join(verify(a.dir)))
        else:
            print("\n".join(f"{v}: {load_peer(v).source}" for v in FILES))
    except PeerError as e:
        print(f"kimi_passes.vllm.peer: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
