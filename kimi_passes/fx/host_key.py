"""Refuse to run under a host wrapper whose cache key is not the pass's own.

vLLM wraps any post-grad pass that is not its own ``InductorPass`` in
``CallableInductorPass`` (``CompilationConfig(inductor_passes={...: "pkg.attr"})``),
whose ``uuid()`` hashes the wrapped object's class source only. Two kimi passes
with different streams then share one cache key, and vLLM's compile cache (or
Inductor's FX graph cache) serves one stream's graph to the other with no error.
A compile under such a key is refused, so no graph is ever stored under it.
"""

from __future__ import annotations

import torch

from kimi_passes.errors import AuxCaptureError


def check_host_key(pass_) -> None:
    """Raise if the installed post-grad pass wraps ``pass_`` under another cache key."""
    host = torch._inductor.config.post_grad_custom_post_pass
    wrappers: list = list(getattr(host, "passes", None) or ())
    ours = pass_  # compared by identity below (which narrows the compared name's type)
    for wrapper in wrappers:
        if getattr(wrapper, "callable", None) is ours and wrapper.uuid() != pass_.uuid():
            raise AuxCaptureError(
                f"kimi_passes: {type(pass_).__name__} reached the compiler wrapped in "
                f"{type(wrapper).__name__}, whose cache key hashes the class source only, "
                "not the aux stream or the options: vLLM's compile cache would serve one "
                "stream's graph to another. This is what CompilationConfig(inductor_passes="
                "{'post_grad_custom_post_pass': 'pkg.attr'}) does with a plain kimi pass. "
                "Remedy: inductor_compile_config=kimi_passes.vllm.compile_config_entries("
                "aux_stream=...), a KimiVllmPass keyed by the stream and options; or, by "
                "name, 'kimi_passes.attn_res_stream_pass.attn_res_stream_pass' (or "
                "'kimi_passes.prefix_stream_pass.prefix_stream_pass'), which vLLM resolves "
                "to such a pass"
            )
