"""kimi_passes.debug.dump: depyf's prepare_debug on torch 2.13, with the pass's graphs."""

from __future__ import annotations

import inspect

import depyf
import pytest
import torch
from torch._inductor.codecache import PyCodeCache

from kimi_passes import make_kimi_backend
from kimi_passes.debug import compat_load_by_key_path, dump, pass_dumps
from kimi_passes.graphs import K3Config, K3Model

# torch 2.13 added PyCodeCache.load(..., set_sys_modules=); depyf's hook lacks it (what
# dump() works around). Earlier torch has no such keyword: nothing to work around.
HAS_SET_SYS_MODULES = "set_sys_modules" in inspect.signature(PyCodeCache.load).parameters
needs_set_sys_modules = pytest.mark.skipif(
    not HAS_SET_SYS_MODULES, reason=f"torch {torch.__version__}: PyCodeCache.load takes no "
    "set_sys_modules (added in 2.13)")


@needs_set_sys_modules
def test_plain_depyf_hook_lacks_set_sys_modules(tmp_path):
    """The bug dump() works around (if depyf ever fixes it, this test says so)."""
    with pytest.warns(UserWarning), depyf.prepare_debug(str(tmp_path)):
        with pytest.raises(TypeError, match="set_sys_modules"):
            PyCodeCache.load("x = 1\n", set_sys_modules=False)


@needs_set_sys_modules
def test_dump_accepts_set_sys_modules(tmp_path):
    with dump(tmp_path):
        mod = PyCodeCache.load("x = 2\n", set_sys_modules=False)
    assert mod.x == 2
    # depyf's hook ran: the module was written into the dump
    assert any(p.name.endswith(".py") and "kernel" in p.name for p in tmp_path.iterdir())


def test_compat_wrapper_forwards_keywords():
    calls = []
    data = {"unpatched_load_by_key_path": lambda *a, **kw: calls.append((a, kw)) or "mod"}

    def hook(key, path, linemap=None, attrs=None):  # depyf's shape: no **kwargs
        return data["unpatched_load_by_key_path"](key, path, linemap, attrs)

    wrapped = compat_load_by_key_path(hook, data)
    assert wrapped("k", "p", set_sys_modules=False) == "mod"
    assert wrapped("k", "p", [], {"a": 1}) == "mod"
    assert calls == [(("k", "p", None, None), {"set_sys_modules": False}),
                     (("k", "p", [], {"a": 1}), {})]
    assert "partial" not in repr(data["unpatched_load_by_key_path"])  # restored


def test_dump_holds_the_pass_before_and_after(tmp_path):
    cfg = K3Config(num_layers=2, hidden_size=16, attn_res_block_size=1, num_heads=2,
                   intermediate_size=32, vocab_size=64, aux_layer_ids=(0, 1, 2))
    model = K3Model(cfg)
    torch._dynamo.reset()
    backend = make_kimi_backend(fallback_by_default=True)  # no C++ kernels: a fast compile
    with torch.no_grad(), dump(tmp_path / "d") as d:
        torch.compile(model, backend=backend, fullgraph=True)(torch.arange(5))
    names = [p.name for p in pass_dumps(d, "AuxStreamPass")]
    assert any("AuxStreamPass" in n and "before" in n for n in names), names
    assert any("AuxStreamPass" in n and "after" in n for n in names), names
    after = next(p for p in pass_dumps(d, "AuxStreamPass") if ".after." in p.name).read_text()
    assert "kimi.attn_res_capture" in after and "kimi.aux_tap" not in after
    before = next(p for p in pass_dumps(d, "AuxStreamPass") if ".before." in p.name)
    before = before.read_text()
    assert before.count("= torch.ops.kimi.aux_tap.default(") == 3
    assert len(backend.aux_pass.last_rewrites) == 3
    # depyf's own files are there too, and Inductor's output went through the patched loader
    files = [p.name for p in d.iterdir()]
    assert any(n.startswith("full_code_for_") for n in files), files
    assert any(".kernel_" in n for n in files), files
