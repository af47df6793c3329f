"""``dump(dir)``: depyf's ``prepare_debug`` made to work on torch 2.13, caches off.

    with kimi_passes.debug.dump("dump/"):
        torch.compile(model, backend=kimi_backend)(ids)
    # dump/ now holds full_code_for_*.py, __compiled_fn_N.*.py and, per kimi pass,
    # __compiled_fn_N.post_grad.<i>.<Pass>.before.0.py / ....after.0.py

Every kimi pass hands its graph to ``torch._dynamo.utils.lazy_format_graph_code``
(``post_grad.<i>.<Pass>.<stage>``), which depyf patches into a file per call.

The fix: depyf 0.20.0 (its last release) replaces ``PyCodeCache.load_by_key_path``
with a hook whose signature lacks the keyword-only ``set_sys_modules`` that
torch 2.13 passes, so loading Inductor's output under ``prepare_debug`` raises
``TypeError``. ``dump`` swaps in a wrapper that accepts any keywords, runs depyf's
hook and forwards the keywords to torch's own loader (vLLM carries the same fix
in ``vllm/compilation/depyf_compat.py``). A depyf whose hook already accepts the
keyword is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from pathlib import Path

import torch


def _accepts_keywords(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD or p.name == "set_sys_modules" for p in params)


def compat_load_by_key_path(hook, data: dict):
    """Wrap depyf's ``load_by_key_path`` hook so that it accepts torch 2.13's keywords.

    ``hook(key, path, linemap, attrs)`` ends by calling ``data["unpatched_load_by_key_path"]``
    (torch's loader) without keywords; during the call that entry is bound to them.
    """

    @functools.wraps(hook)
    def load_by_key_path(key, path, linemap=None, attrs=None, **kwargs):
        if not kwargs:
            return hook(key, path, linemap, attrs)
        unpatched = data["unpatched_load_by_key_path"]
        data["unpatched_load_by_key_path"] = functools.partial(unpatched, **kwargs)
        try:
            return hook(key, path, linemap, attrs)
        finally:
            data["unpatched_load_by_key_path"] = unpatched

    return load_by_key_path


@contextlib.contextmanager
def _depyf_compat():
    from depyf.explain import enable_debugging
    from depyf.explain.global_variables import data

    hook = enable_debugging.patched_load_by_key_path
    if _accepts_keywords(hook):
        yield
        return
    enable_debugging.patched_load_by_key_path = compat_load_by_key_path(hook, data)
    try:
        yield
    finally:
        enable_debugging.patched_load_by_key_path = hook


@contextlib.contextmanager
def dump(directory, *, disable_caches: bool = True):
    """Dump what ``torch.compile`` does inside the block into ``directory`` (depyf).

    ``disable_caches``: turn Inductor's caches off inside the block (default), so that
    the passes run and dump their before/after graphs instead of a cache hit serving
    the compiled graph without them.
    """
    import depyf

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    caches = (torch._inductor.config.patch(force_disable_caches=True) if disable_caches
              else contextlib.nullcontext())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*You are trying to debug `torch.compile`")
        warnings.filterwarnings("ignore", message=".*dynamo_pgo force disabled")
        with _depyf_compat(), caches, depyf.prepare_debug(os.fspath(path.resolve())):
            yield path


def pass_dumps(directory, pass_name: str | None = None) -> list[Path]:
    """The before/after graph files the kimi passes left in a dump, sorted by name."""
    files = sorted(Path(directory).glob("*post_grad.*"))
    return [f for f in files if pass_name is None or f".{pass_name}." in f.name]
