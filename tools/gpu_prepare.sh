#!/usr/bin/env bash
# Prepare, on the CPU machine, the one folder a GPU check carries: .gpu_carry/ (git-ignored).
#   vllm_k3/  vLLM's K3 AttnRes kernel files copied from the installed vLLM, byte for byte,
#             with a MANIFEST.json (kimi_passes/vllm/peer.py loads them there through
#             $KIMI_PASSES_VLLM_PEER); checked here: equal to the installed files and a tiny
#             call within 1e-5 of the reference under the interpreter.
#   site/     the pure-Python packages the GPU image lacks (expecttest, depyf and what depyf
#             requires; never torch, triton or numpy), installed from wheels for its
#             Python 3.12 at constraints.txt's versions.
#   MANIFEST.json  what was prepared, when, and the sizes.
# Run after .ci/run (or the README's set-up and bash tools/install_vllm.sh) made .venv:
#   bash tools/gpu_prepare.sh            # PYTHON=.venv/bin/python unless set
# Then tools/gpu_check.sh on the GPU (docs/testing.md, "On a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
CARRY=.gpu_carry
IMAGE_PYTHON=3.12                 # the GPU image's Python
WANT=(expecttest depyf)           # imported by CUDA tests, absent from the GPU image
NEVER="torch triton numpy"        # the GPU image's own; a wheel of these must not shadow them
LIMIT_MIB=16                      # the device call carries at most 64 MiB with the tree

die() { echo "gpu_prepare: $*" >&2; exit 1; }
[[ -x $PYTHON ]] || die "no $PYTHON: run .ci/run first (it makes .venv), or set PYTHON"
rm -rf "$CARRY"
mkdir -p "$CARRY/site"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT

# vLLM's kernel files, from the installed vLLM, then loaded from the copy and checked.
"$PYTHON" -m kimi_passes.vllm.peer prepare "$CARRY/vllm_k3" \
    || die "copying vLLM's K3 kernel failed (above); bash tools/install_vllm.sh installs vLLM"
TRITON_INTERPRET=1 "$PYTHON" -m kimi_passes.vllm.peer verify "$CARRY/vllm_k3" \
    || die "the prepared copy did not load or compute right (above); reinstall vLLM 0.33.0 \
(bash tools/install_vllm.sh) and run this again"

# Wheels: the wanted packages, then whatever their metadata requires for Python 3.12 on
# Linux, until nothing new is required.
todo=("${WANT[@]}")
while ((${#todo[@]})); do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$IMAGE_PYTHON" \
        -c constraints.txt -d "$wheels" "${todo[@]}" \
        || die "pip download of ${todo[*]} failed: needs PyPI (network) and wheels at \
constraints.txt's versions"
    mapfile -t todo < <("$PYTHON" - "$wheels" "$IMAGE_PYTHON" "$NEVER" <<'EOF'
import sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a venv without packaging: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
folder, version, never = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split()
env = {"python_version": version, "python_full_version": version + ".0", "extra": "",
       "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "platform_machine": "x86_64"}
have = {canonicalize_name(w.name.split("-")[0]) for w in folder.glob("*.whl")}
need = set()
for w in folder.glob("*.whl"):
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                r = Requirement(line.split(":", 1)[1].strip())
                name = canonicalize_name(r.name)
                if (r.marker is None or r.marker.evaluate(env)) and name not in have \
                        and name not in never:
                    need.add(name)
for name in sorted(need):
    print(name)
EOF
)
done
for w in "$wheels"/*.whl; do
    IFS=- read -r -a tag <<< "$(basename "$w" .whl)"
    n=${#tag[@]}
    [[ ${tag[n-3]} == *py3* && ${tag[n-2]} == none && ${tag[n-1]} == any ]] \
        || die "$(basename "$w") is not pure Python (py3-none-any): drop it from WANT or \
find a pure-Python release"
    case " $NEVER " in *" ${tag[0]} "*) die "$(basename "$w"): $NEVER come from the GPU image";;
    esac
done
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: \
    --python-version "$IMAGE_PYTHON" --target "$CARRY/site" "$wheels"/*.whl \
    || die "pip install --target $CARRY/site failed (above)"
PYTHONPATH="$CARRY/site" "$PYTHON" -c "
import sys, expecttest, depyf
for m in (expecttest, depyf):
    assert '$CARRY/site' in m.__file__, f'{m.__name__} came from {m.__file__}, not $CARRY/site'
" || die "the packages in $CARRY/site do not import from there (above)"

"$PYTHON" - "$CARRY" "$wheels" "$LIMIT_MIB" <<'EOF' || die "$CARRY is over its size limit"
import datetime, hashlib, json, sys
from pathlib import Path
carry, wheels, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
manifest = {
    "prepared": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "python": sys.version.split()[0], "image_python": "3.12",
    "vllm_k3": json.loads((carry / "vllm_k3" / "MANIFEST.json").read_text()),
    "wheels": {w.name: hashlib.sha256(w.read_bytes()).hexdigest()
               for w in sorted(wheels.glob("*.whl"))},
    "bytes": {p.name: size(p) for p in (carry / "site", carry / "vllm_k3")},
}
manifest["bytes"]["total"] = sum(manifest["bytes"].values())
(carry / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
mib = manifest["bytes"]["total"] / 2**20
print(f"{carry}: {mib:.2f} MiB (limit {limit} MiB)")
print(f"  vllm_k3/: vLLM {manifest['vllm_k3']['vllm_version']}'s "
      + ", ".join(manifest["vllm_k3"]["files"]) + f" ({manifest['bytes']['vllm_k3']} bytes)")
print(f"  site/: {', '.join(manifest['wheels'])} ({manifest['bytes']['site']} bytes)")
sys.exit(0 if mib < limit else 1)
EOF
du -sh "$CARRY"
