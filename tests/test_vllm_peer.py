"""vLLM's K3 kernel as the benchmarks' peer (``kimi_passes.vllm.peer``), on CPU.

Taken from the installed vLLM (its file unchanged, run with stand-ins for vLLM's imports,
interpreted), or from a folder prepared from it (``prepare``: byte-for-byte copies and a
MANIFEST.json, what ``tools/gpu_prepare.sh`` writes into ``.gpu_carry/vllm_k3``) through
``$KIMI_PASSES_VLLM_PEER``. A missing or damaged folder is an error naming the fix, and
``sys.modules`` holds no stand-in afterwards. The tests that read the installed vLLM skip
where it is not installed (tests/conftest.py, the ``vllm`` mark).
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from kimi_passes.bench.harness import op_args, rel_err
from kimi_passes.ops import attn_res_reference
from kimi_passes.vllm import peer as vp

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _vllm_entries() -> dict:
    return {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}


def _agrees(peer: vp.Peer, dtype=torch.float32, **kw) -> float:
    """The peer's ``attn_res`` against the reference on a tiny call (output, in place)."""
    args = op_args(3, 32, 2, dtype=dtype, delta=0.5, write=2, output_norm=True, seed=1, **kw)
    theirs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ours = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    got, want = peer.attn_res(*theirs), attn_res_reference(*ours)
    assert torch.equal(theirs[2], ours[2]), peer.source  # the block write
    return rel_err(got, want)


@pytest.fixture(name="prepared")
def prepared_fixture(tmp_path_factory):
    """A folder prepared from the installed vLLM, as tools/gpu_prepare.sh prepares it."""
    if vp.installed_root() is None:
        pytest.skip("vLLM is not installed (bash tools/install_vllm.sh)")
    dest = tmp_path_factory.mktemp("carry") / "vllm_k3"
    assert vp.main(["prepare", str(dest)]) == 0
    return dest


@pytest.mark.vllm
@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_vllm_peer_from_the_installed_vllm(vendor, monkeypatch):
    import importlib.metadata

    monkeypatch.delenv(vp.ENV_VAR, raising=False)
    peer = vp.load_peer(vendor)
    path = vp.installed_root() / vp.FILES[vendor]
    version = importlib.metadata.version("vllm")
    assert peer.source == (f"installed vLLM {version} at {path} (its file run with "
                           "stand-ins for vLLM's imports)")
    assert peer.module.__file__ == str(path) and peer.attn_res is peer.module.attn_res
    assert peer.attn_res.__code__.co_filename == str(path)  # the file itself, unchanged
    assert _agrees(peer) <= 1e-5
    assert vp.load_peer(vendor).module is peer.module  # loaded once: one triton.jit


@pytest.mark.vllm
def test_vllm_peer_from_a_prepared_folder(prepared, monkeypatch, capsys):
    root = vp.installed_root()
    manifest = json.loads((prepared / vp.MANIFEST).read_text())
    assert manifest["vllm_version"] == vp._vllm_version()
    for name in vp.FILES.values():  # byte for byte, and recorded so
        assert (prepared / name).read_bytes() == (root / name).read_bytes()
        assert manifest["files"][name] == {"source_path": str(root / name),
                                           "sha256": vp.sha256(root / name)}
    monkeypatch.setenv(vp.ENV_VAR, str(prepared))
    for vendor, name in vp.FILES.items():
        peer = vp.load_peer(vendor)
        digest = manifest["files"][name]["sha256"]
        assert peer.source == (f"prepared copy of vLLM {manifest['vllm_version']} (sha256 "
                               f"{digest[:16]}) at {prepared / name}")
        assert peer.module.__file__ == str(prepared / name)
    amd = vp.load_peer("amd")
    amd.module.QUANT_MAX = 224.0  # a caller emulating an fnuz platform
    try:
        data, scale = amd.attn_res(*op_args(2, 32, 1, delta=0.5, write=1, output_norm=True),
                                   quant_dtype=torch.float8_e4m3fnuz)
    finally:
        amd.module.QUANT_MAX = None
    assert data.float().abs().amax(1).tolist() == [224.0, 224.0] and scale.shape == (2, 1)
    assert vp.main(["verify", str(prepared)]) == 0  # what gpu_prepare.sh runs
    out = capsys.readouterr().out
    assert out.count("prepared copy of vLLM") == 2 and "<= 1e-05" in out


@pytest.mark.vllm
def test_vllm_peer_damaged_folder_names_the_fix(prepared, tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in [vp.MANIFEST, *vp.FILES.values()]:
        (bad / name).parent.mkdir(parents=True, exist_ok=True)
        (bad / name).write_bytes((prepared / name).read_bytes())
    monkeypatch.setenv(vp.ENV_VAR, str(bad))
    kernel = bad / vp.FILES["nvidia"]
    kernel.write_bytes(kernel.read_bytes().replace(b"num_warps = 4, 8", b"num_warps = 8, 8"))
    with pytest.raises(vp.PeerError, match=r"sha256 .*\(the copy was changed\); run "
                                           r"bash tools/gpu_prepare.sh again"):
        vp.load_peer("nvidia")
    vp.load_peer("amd")  # its own file is intact
    (bad / vp.FILES["amd"]).unlink()
    with pytest.raises(vp.PeerError, match="lacks amd/ops/attn_res.py"):
        vp.load_peer("amd")
    (bad / vp.MANIFEST).write_text("{not json")
    with pytest.raises(vp.PeerError, match="not a prepared vLLM K3 folder"):
        vp.load_peer("amd")


def test_missing_folder_names_the_fix(tmp_path, monkeypatch):
    """Where ``$KIMI_PASSES_VLLM_PEER`` points at nothing, and where there is no peer at all."""
    monkeypatch.setenv(vp.ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(vp.PeerError, match=r"\$KIMI_PASSES_VLLM_PEER=.*nowhere is not a "
                                           r"prepared vLLM K3 folder .*bash tools/gpu_prepare"):
        vp.load_peer("nvidia")
    monkeypatch.delenv(vp.ENV_VAR)
    monkeypatch.setattr(vp, "installed_root", lambda: None)
    monkeypatch.setattr(vp, "CARRY", tmp_path / ".gpu_carry" / "vllm_k3")
    with pytest.raises(vp.PeerError) as e:
        vp.load_peer("amd")
    assert "bash tools/install_vllm.sh" in str(e.value)
    assert "bash tools/gpu_prepare.sh" in str(e.value)
    with pytest.raises(ValueError, match="vendor 'intel'"):
        vp.load_peer("intel")


@pytest.mark.vllm
def test_vllm_peer_leaves_sys_modules_as_it_was(prepared, monkeypatch):
    """The stand-ins are gone after a load; a real vLLM's entries (here a marker module in
    their place) are back, and no vLLM module imported meanwhile stays."""
    marker = types.ModuleType("vllm.platforms")
    monkeypatch.setitem(sys.modules, "vllm.platforms", marker)
    before = _vllm_entries()
    monkeypatch.setenv(vp.ENV_VAR, str(prepared))
    vp._run_file.cache_clear()  # load again, not from the cache
    peer = vp.load_peer("nvidia")
    assert _vllm_entries() == before and sys.modules["vllm.platforms"] is marker
    stand_in = peer.module.__dict__["current_platform"]  # what vLLM's file imported
    assert not stand_in.is_device_capability_family(100)  # the SM100 native op: off
    assert not any("stand-in" in (m.__doc__ or "") for m in _vllm_entries().values())
