"""``kimi_backend``: Inductor with the kimi_passes post-grad passes installed.

    torch.compile(model, backend=kimi_backend)                       # attn_res stream
    torch.compile(model, backend=make_kimi_backend(aux_stream="prefix"))
    torch.compile(model, backend="kimi", options={"aux_stream": "prefix"})

Stacks that own their backend (vLLM style) install the pass alone:
``torch._inductor.config.post_grad_custom_post_pass = AuxStreamPass("attn_res")``.
"""

from __future__ import annotations

import torch
from torch._dynamo.exc import BackendCompilerFailed

from kimi_passes.errors import AuxCaptureError
from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.lowering import LowerKimiOps
from kimi_passes.passes.fx_toolkit import calls_to
from kimi_passes.passes.manager import KimiPassManager
from kimi_passes.taps.aux_stream import AuxStreamPass, GraphEnd
from kimi_passes.taps.consumer import AUX_TAP
from kimi_passes.taps.drafter import DrafterTaps, drafter_capture_ids
from kimi_passes.taps.stream import resolve_aux_stream
from kimi_passes.training.pre_autograd import fuse_before_autograd, needs_autograd

BACKEND_NAME = "kimi"


def _has_taps(gm: torch.fx.GraphModule) -> bool:
    # Dynamo records the op packet (``torch.ops.kimi.aux_tap(...)``), ATen graphs .default.
    return bool(calls_to(gm.graph, AUX_TAP, torch.ops.kimi.aux_tap))


def build_passes(aux_stream: str, fuse_capture: bool = True, fuse_torch_mixing: bool = True,
                 observers=(), drafter: DrafterTaps | None = None,
                 lower_kimi_ops: bool = True) -> KimiPassManager:
    """The pass list: AttnRes mixing fusion (``fuse_torch_mixing``), then the aux stream;
    then, on CPU, the kimi ops lowered to generated code (``lower_kimi_ops``).

    ``drafter``: the capture ids the drafter declares (``drafter_capture_ids``); every
    compiled graph must tap exactly those it owns.
    """
    passes = [AttnResFusionPass()] if fuse_torch_mixing else []
    aux = AuxStreamPass(aux_stream, fuse=fuse_capture, drafter=drafter, lower=False)
    return KimiPassManager([*passes, aux], observers,
                           lowering=LowerKimiOps() if lower_kimi_ops else None)


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

    Graphs without a backward run ``passes`` post-grad (mixing fusion, then the aux
    stream). Graphs that need a backward are fused by ``pre_autograd`` before AOTAutograd
    (``kimi_passes.training``: a fused forward and a fused backward) and run ``training_passes``
    post-grad: the same aux-stream pass, no second fusion. The two post-grad managers share
    their observers.
    """

    def __init__(self, aux_stream=None, draft_config=None, fuse_capture=True,
                 fuse_torch_mixing=True, lower_kimi_ops=True, **inductor_config):
        self.aux_stream = resolve_aux_stream(aux_stream, draft_config)
        self.drafter = drafter_capture_ids(draft_config)
        self.passes = build_passes(self.aux_stream, fuse_capture, fuse_torch_mixing,
                                   drafter=self.drafter, lower_kimi_ops=lower_kimi_ops)
        self.training_passes = KimiPassManager([self.aux_pass],
                                               lowering=self.passes.lowering)
        self.training_passes.observers = self.passes.observers
        self.pre_autograd = KimiPassManager(
            [AttnResFusionPass(differentiable=True)], phase="pre_autograd") if (
            fuse_torch_mixing) else None
        self.inductor_config = inductor_config

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
        drafter = "" if self.drafter is None else (
            f", drafter_capture_ids={list(self.drafter.capture_ids)}")
        return f"KimiBackend(aux_stream={self.aux_stream!r}{drafter})"


def make_kimi_backend(aux_stream: str | None = None, draft_config=None, **inductor_config):
    """A backend serving ``aux_stream`` (argument > $KIMI_PASSES_AUX_STREAM > drafter > attn_res).

    ``draft_config``: a drafter config dict, or the path of its config.json (or folder),
    whose ``aux_hidden_stream`` names the stream it was trained on and whose layer list
    (any spelling ``drafter_capture_ids`` reads) names the capture ids it reads: every
    compiled graph must then tap exactly those, or ``AuxCaptureError``. Extra keyword
    arguments are Inductor config patches (plus ``fuse_capture``, the aux-stream
    pass's switch: False captures with a separate ``attn_res_mix`` read;
    ``fuse_torch_mixing``: False leaves AttnRes mixing written in plain torch unfused; and
    ``lower_kimi_ops``: False keeps CPU kimi ops as op calls instead of generated code).
    """
    return KimiBackend(aux_stream, draft_config, **inductor_config)


def kimi_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                 mode: str | None = None):
    """Inductor with the aux-stream pass; stream resolved per compile (see ``make_kimi_backend``).

    ``torch.compile(m, backend="kimi", options={...})`` passes ``options`` here:
    ``aux_stream``, ``draft_config``, ``fuse_capture``, ``fuse_torch_mixing`` and Inductor
    config patches. ``torch.compile(m, backend=kimi_backend, mode="reduce-overhead")``
    passes ``mode``: it sets the Inductor options it sets for plain Inductor (CUDA graphs
    for ``"reduce-overhead"``).
    """
    return KimiBackend(**(options or {}))(gm, example_inputs, mode=mode)


def register() -> None:
    """Register ``backend="kimi"`` unless the ``torch_dynamo_backends`` entry point will.

    When Dynamo resolves "kimi" through the entry point it imports this package and
    then registers the loaded function itself; registering here too would collide.
    """
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if BACKEND_NAME not in _COMPILER_FNS and _BACKENDS.get(BACKEND_NAME) is None:
        register_backend(kimi_backend, name=BACKEND_NAME)
