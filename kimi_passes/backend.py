"""``kimi_backend``: Inductor with the kimi_passes post-grad passes installed.

    torch.compile(model, backend=kimi_backend)                       # attn_res stream
    torch.compile(model, backend=make_kimi_backend(aux_stream="prefix"))
    torch.compile(model, backend="kimi", options={"aux_stream": "prefix"})

The options are ``KimiPassConfig``'s (``kimi_passes.config``); anything else given is an
Inductor config patch. Stacks that own their backend install ``kimi_passes.pass_manager``
(``kimi_passes.pipeline``) as ``post_grad_custom_post_pass`` instead.
"""

from __future__ import annotations

import torch
from torch._dynamo.exc import BackendCompilerFailed

from kimi_passes.config.drafter import DrafterTaps
from kimi_passes.config.pass_config import KimiPassConfig
from kimi_passes.errors import AuxCaptureError
from kimi_passes.fx.fx_toolkit import calls_to
from kimi_passes.fx.kimi_calls import AUX_TAP
from kimi_passes.pipeline import pass_manager, pre_autograd_manager, training_manager
from kimi_passes.taps.aux_stream import AuxStreamPass, GraphEnd
from kimi_passes.taps.unrouted import check_unrouted
from kimi_passes.training.pre_autograd import fuse_before_autograd, needs_autograd

BACKEND_NAME = "kimi"


def _has_taps(gm: torch.fx.GraphModule) -> bool:
    # Dynamo records the op packet (``torch.ops.kimi.aux_tap(...)``), ATen graphs .default.
    return bool(calls_to(gm.graph, AUX_TAP, torch.ops.kimi.aux_tap))


def graph_end(gm: torch.fx.GraphModule) -> GraphEnd:
    """Why Dynamo ended ``gm``: a graph break's reason and user frame, or the return."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return GraphEnd()
    stack = getattr(reason, "user_stack", None) or []
    where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "an unknown line"
    return GraphEnd(str(reason.reason).strip().splitlines()[0], where)


class KimiBackend:
    """A ``torch.compile`` backend: Inductor plus the kimi passes, options fixed at creation.

    ``KimiBackend(config)`` takes a ``KimiPassConfig``; ``KimiBackend(**options)`` builds
    one from the options, and any keyword that is not an option is an Inductor config patch.
    Graphs without a backward run ``passes`` post-grad (``pipeline.pass_manager``). Graphs
    that need a backward are fused by ``pre_autograd`` before AOTAutograd
    (``kimi_passes.training``) and run ``training_passes`` post-grad: the same aux-stream
    pass and lowering, no second fusion, the same observers.
    """

    def __init__(self, config: KimiPassConfig | None = None, /, **options):
        if config is None:
            config, options = KimiPassConfig.split(options)
        else:
            given = sorted(set(options) & set(KimiPassConfig.option_names()))
            if given:
                raise TypeError(f"KimiBackend: give a KimiPassConfig or the options {given}, "
                                "not both")
        self.config = config
        self.passes = pass_manager(config)
        self.training_passes = training_manager(self.passes)
        self.pre_autograd = pre_autograd_manager(config)
        self.inductor_config = options

    @property
    def aux_stream(self) -> str:
        return self.config.aux_stream

    @property
    def drafter(self) -> DrafterTaps | None:
        return self.config.drafter

    @property
    def aux_pass(self) -> AuxStreamPass:
        return self.passes.get(AuxStreamPass)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, mode: str | None = None):
        """Compile ``gm``; ``mode`` is ``torch.compile``'s (e.g. ``"reduce-overhead"``).

        A mode sets the Inductor options it sets for ``backend="inductor"``; explicit
        Inductor config patches given at construction win over it.
        """
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        try:
            mode_patches = list_mode_options(mode) if mode else {}
        except RuntimeError as e:
            raise ValueError(f"kimi_passes: unknown torch.compile mode {mode!r} ({e})") from None
        # Dynamo's graph, before AOTAutograd: vLLM's own K3 attn_res found here is refused
        # before any compile work (the aux-stream pass checks the post-grad form too).
        check_unrouted(gm.graph, self.aux_stream)
        passes, functorch_patches = self.passes, {}
        if needs_autograd(example_inputs):
            passes = self.training_passes
            if _has_taps(gm):
                # The aux-stream pass makes a tap return its consumer's mixture, which the
                # backward may also have saved. AOTAutograd chose the buffers the backward
                # may overwrite (donated) before that rewrite: it would overwrite the tap.
                functorch_patches["donated_buffer"] = False
            if self.pre_autograd is not None:
                gm = fuse_before_autograd(gm, example_inputs, self.pre_autograd)
        self.aux_pass.graph_end = graph_end(gm)
        patches = {**mode_patches, **self.inductor_config, "post_grad_custom_post_pass": passes}
        try:
            with torch._functorch.config.patch(functorch_patches):
                return compile_fx(gm, example_inputs, config_patches=patches)
        except BackendCompilerFailed as e:
            # Inductor wraps pass errors when the FX cache is off; hand ours on as they are.
            if isinstance(e.inner_exception, AuxCaptureError):
                raise e.inner_exception.with_traceback(None) from None
            raise

    def __repr__(self) -> str:
        return f"KimiBackend({self.config!r})"


def make_kimi_backend(aux_stream: str | None = None, **options) -> KimiBackend:
    """A backend for ``KimiPassConfig.build(aux_stream=aux_stream, **options)``.

    The options are ``KimiPassConfig``'s (README "Options"); every other keyword is an
    Inductor config patch for the compiles this backend runs.
    """
    return KimiBackend(aux_stream=aux_stream, **options)


def kimi_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                 mode: str | None = None):
    """Inductor with the kimi passes, built per compile from ``options``.

    ``torch.compile(m, backend="kimi", options={...})`` passes ``options`` here (the
    ``KimiPassConfig`` options and Inductor config patches); ``mode`` is ``torch.compile``'s
    (``"reduce-overhead"`` sets CUDA graphs, as for plain Inductor). Without a
    ``draft_config`` option, inside vLLM (``backend="kimi"`` under
    ``CompilationMode.STOCK_TORCH_COMPILE``) the drafter vLLM serves is checked.
    """
    backend = KimiBackend(**(options or {}))
    if backend.drafter is None:
        served = _vllm_served_drafter()
        if served is not None:
            backend = KimiBackend(backend.config.with_drafter(served), **backend.inductor_config)
    return backend(gm, example_inputs, mode=mode)


def _vllm_served_drafter() -> DrafterTaps | None:
    """The drafter vLLM serves, when this compile runs inside vLLM (its current config set).

    vLLM's ``CompilationMode.STOCK_TORCH_COMPILE`` hands ``torch.compile`` the backend's
    name, with no options; the first call (Dynamo compiles at the model's first forward,
    vLLM's profile run) happens under ``set_current_vllm_config``, so the speculative
    config is readable here. vLLM not imported: nothing to read (and nothing imported).
    """
    import sys

    if "vllm" not in sys.modules:
        return None
    from kimi_passes.vllm import served_drafter

    return served_drafter()


def register() -> None:
    """Register ``backend="kimi"`` unless the ``torch_dynamo_backends`` entry point will.

    When Dynamo resolves "kimi" through the entry point it imports this package and
    then registers the loaded function itself; registering here too would collide.
    """
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if BACKEND_NAME not in _COMPILER_FNS and _BACKENDS.get(BACKEND_NAME) is None:
        register_backend(kimi_backend, name=BACKEND_NAME)
