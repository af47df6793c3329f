"""vLLM's own Kimi K3 forward through ``kimi::attn_res``: the ``vllm.general_plugins`` route.

vLLM (0.33.0, 0.34.0) serves K3 with a module-level function ``attn_res``, imported by name
into ``vllm/models/kimi_k3/nvidia/model.py`` (and ``nvidia/ops.py``) and, with a
``quant_dtype=`` keyword, the ROCm path's ``amd/linear.py``. Its arguments and semantics are
``kimi::attn_res``'s (``AttnResArgs``): the kimi passes see only kimi ops, so the K3 forward
must call the op for the aux captures to be found.

Invariant: a process holds at most one route, an ``EagerRoute``, built by ``_process_route``
alone (for ``register``, ``route_attn_res`` and ``serve_eager``). ``register`` (the entry
point ``kimi_passes``, which vLLM calls in every process) checks the two variables (a bad
value raises), builds the route and arms an import hook (``hook``); nothing else. Only when
vLLM imports its K3 model module is ``KimiLinearModel.__init__`` wrapped (``checked_init``):
it resolves the stream (``stream``: our variable, vLLM's flag, the drafter) and, when a source
asks, rebinds ``attn_res`` and wraps the capture method, ``forward`` and
``_set_aux_hidden_state_layers`` (``eager``); then ``plan`` serves or refuses. vLLM's files
are never edited; ``unroute_attn_res`` puts every name the route recorded back.

Traced by Dynamo, every call is a kimi op (the pass needs them). Eager, only a capture's
consumer is (``kimi::attn_res_capture``, the same arithmetic as vLLM's kernel, not bit for
bit); every other call is vLLM's own ``attn_res``; the ROCm quant keeps vLLM's FP8 bound
(``vllm_attn_res_amd``). Left unrouted, vLLM's own ``attn_res`` in a graph compiled under the
attn_res stream is an ``AuxCaptureError`` (``taps/unrouted.py``). docs/design.md section 11.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import kimi_passes.ops  # noqa: F401  (registers torch.ops.kimi)
from kimi_passes.ops.attn_res_args import AttnResArgs, record_signature
from kimi_passes.vllm import versions
from kimi_passes.vllm.k3 import eager, hook, plan, stream, surface
from kimi_passes.vllm.k3.eager import TURN_OFF

log = logging.getLogger(__name__)

#: vLLM's K3 modules that import ``attn_res`` by name, and the function each gets.
NVIDIA_MODULES = ("vllm.models.kimi_k3.nvidia.model", "vllm.models.kimi_k3.nvidia.ops")
AMD_MODULES = ("vllm.models.kimi_k3.amd.linear",)


@record_signature(AttnResArgs, returns=torch.Tensor)
def vllm_attn_res(*args, **kwargs):
    """vLLM's NVIDIA ``attn_res`` (same signature, ``AttnResArgs``, and effects).

    Traced by Dynamo: ``kimi::attn_res`` (the pass recognises the captures around it).
    Eager: a capture's consumer runs ``kimi::attn_res_capture`` and fills the capture's
    buffer (``eager``); every other call is vLLM's own ``attn_res``.
    """
    if not torch.compiler.is_compiling():
        fill = _active().claim(args, kwargs)
        if fill is None:
            return _active().own["nvidia"](*args, **kwargs)
        out, mixed = torch.ops.kimi.attn_res_capture(*AttnResArgs(*args, **kwargs))
        fill(mixed)
        return out
    return torch.ops.kimi.attn_res(*AttnResArgs(*args, **kwargs))


def vllm_attn_res_amd(*args, quant_dtype=None, **kwargs):
    """vLLM's ROCm ``attn_res`` (``AttnResArgs``, then a keyword ``quant_dtype=None``: same
    signature, effects and returns), routed as ``vllm_attn_res`` is.

    ``quant_dtype=None``: the mixture. Otherwise ``(data, scale)``, in kimi ops
    ``kimi::attn_res_quant(_capture)`` with vLLM's kernel's quant: its defaults, and the
    bound vLLM's kernel takes, ``get_fp8_min_max()[1]`` of the platform, read at each call
    as vLLM's function reads it (224 on fnuz platforms, else 448), not the dtype's.
    """
    fill = None
    if not torch.compiler.is_compiling():
        fill = _active().claim(args, kwargs)
        if fill is None:
            return _active().own["amd"](*args, quant_dtype=quant_dtype, **kwargs)
    a = AttnResArgs(*args, **kwargs)
    if quant_dtype is None:
        if fill is None:
            return torch.ops.kimi.attn_res(*a)
        out, mixed = torch.ops.kimi.attn_res_capture(*a)
        fill(mixed)
        return out
    qmax = _platform_quant_max(quant_dtype)
    if fill is None:
        return torch.ops.kimi.attn_res_quant(*a, quant_dtype, quant_max=qmax)
    data, scale, mixed = torch.ops.kimi.attn_res_quant_capture(*a, quant_dtype, quant_max=qmax)
    fill(mixed)
    return data, scale


vllm_attn_res_amd.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [*inspect.signature(vllm_attn_res).parameters.values(),
     inspect.Parameter("quant_dtype", inspect.Parameter.KEYWORD_ONLY, default=None)])


def _platform_quant_max(quant_dtype: torch.dtype) -> float:
    """vLLM's FP8 bound on this platform (``get_fp8_min_max()[1]``), the ``QUANT_MAX`` its
    ROCm K3 kernel clamps to; an error where the dtype cannot hold it (an e4m3fnuz quant
    on a platform whose FP8 is e4m3fn, bound 448: e4m3fnuz's largest is 240)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max

    qmax = float(get_fp8_min_max()[1])
    if quant_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) \
            and qmax > torch.finfo(quant_dtype).max:
        raise ValueError(
            f"kimi_passes: vLLM's ROCm K3 attn_res was called with quant_dtype={quant_dtype} "
            f"on a platform whose FP8 bound is {qmax} (vLLM's get_fp8_min_max), beyond the "
            f"largest {quant_dtype}: pass the platform's FP8 dtype "
            f"(current_platform.fp8_dtype()), as vLLM's K3 does")
    return qmax


#: The functions the route installs, by module.
ROUTES = {**dict.fromkeys(NVIDIA_MODULES, vllm_attn_res),
          **dict.fromkeys(AMD_MODULES, vllm_attn_res_amd)}
#: The K3 model class of each vendor's model module.
MODEL_CLASSES = {name: vendor for vendor, name in surface.MODEL_MODULES.items()}


class EagerRoute(eager.Captures):
    """The process's route: the stream it serves, vLLM's own ``attn_res``, and every name
    it replaced, so that ``unroute_attn_res`` can put each back.

    Every field is filled in this module (the per-thread capture mechanics, ``expect``,
    ``claim``, ``watch`` and a forward's bracket, are ``eager.Captures``'). One per
    process, built by ``_process_route`` alone; each K3 model it serves holds it as
    ``_kimi_passes_route``.
    """

    def __init__(self) -> None:
        super().__init__()
        #: The stream and its sources, resolved at the first K3 model init (None before).
        self.choice: stream.StreamChoice | None = None
        #: vLLM's own ``attn_res`` by vendor: what a call that is no consumer runs.
        self.own: dict[str, Callable[..., Any]] = {}
        #: vLLM's ``attn_res`` of each module the route rebound, by module name.
        self.originals: dict[str, Any] = {}
        #: The class attributes the route replaced: ``(class, name) -> own value or None``.
        self.class_originals: dict[tuple[type, str], Any] = {}
        #: The K3 import hook ``register`` armed, if any.
        self.hook: hook.K3ImportHook | None = None

    @property
    def stream(self) -> str | None:
        return None if self.choice is None else self.choice.stream


#: The process's route (``_process_route`` builds it; ``unroute_attn_res`` drops it): the
#: one object holding every piece of the route's state.
_route: EagerRoute | None = None


def _process_route(*, arm: bool = False) -> EagerRoute:
    """The process's route: the one built, else a new one, which with ``arm`` arms the K3
    import hook (``register``). The one place a route is built: ``register``,
    ``route_attn_res`` and ``serve_eager`` all come here, so a process never holds two."""
    global _route
    if _route is None:
        _route = EagerRoute()
        if arm:  # with _route set: arm() runs _on_k3_import at once for a K3 imported
            _route.hook = hook.arm(MODEL_CLASSES, _on_k3_import)
    return _route


def current() -> EagerRoute | None:
    """The process's ``EagerRoute`` (each K3 model it serves holds it too)."""
    return _route


def _active() -> EagerRoute:
    if _route is None:
        raise RuntimeError(
            "kimi_passes: vLLM's K3 attn_res was called through the route after "
            "unroute_attn_res(); call register() (vLLM's plugin loader does) first")
    return _route


def _methods(route: EagerRoute, vendor: str) -> dict[str, Callable[[Any], Any]]:
    """The K3 model methods the route wraps once a stream is asked, ``name -> (vLLM's own
    -> ours)``."""
    capture = eager.nvidia_capture if vendor == "nvidia" else eager.amd_capture
    return {surface.CAPTURE[vendor]: functools.partial(capture, route),
            "forward": functools.partial(eager.checked_forward, route),
            "_set_aux_hidden_state_layers": functools.partial(eager.checked_set_layers,
                                                              route)}


def _wrap(route: EagerRoute, cls: type, attr: str, wrap) -> None:
    if (cls, attr) in route.class_originals:
        return
    route.class_originals[cls, attr] = cls.__dict__.get(attr)
    setattr(cls, attr, functools.wraps(getattr(cls, attr))(wrap(getattr(cls, attr))))


def route_attn_res() -> list[str]:
    """Rebind ``attn_res`` in every imported vLLM K3 module, and wrap the imported K3
    model classes' methods (``_methods``); returns the modules routed. Without a route
    (no ``register``), one is built; its stream unresolved, eager calls stay vLLM's."""
    route = _process_route()
    routed = []
    for name, fn in ROUTES.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        current_fn = getattr(module, "attn_res", None)
        if current_fn is None:
            raise RuntimeError(
                f"kimi_passes: {name} has no module-level attn_res: this vLLM's K3 is not "
                f"the one the route was written for ({eager.written_for()}); {TURN_OFF}")
        if current_fn is not fn:
            route.originals.setdefault(name, current_fn)
            vars(module)["attn_res"] = fn
        routed.append(name)
    for name, vendor in MODEL_CLASSES.items():
        if name in route.originals:
            route.own[vendor] = route.originals[name]
        if name in sys.modules:
            for attr, wrap in _methods(route, vendor).items():
                _wrap(route, sys.modules[name].KimiLinearModel, attr, wrap)
    return routed


def activate(route: EagerRoute, vllm_config) -> stream.StreamChoice:
    """The stream for this process, resolved once (the first K3 model's init), an
    untested vLLM named (``versions``); when a source asks for one, a changed K3 is
    refused (``surface``), else ``attn_res`` is routed and the model methods wrapped."""
    if route.choice is None:
        versions.warn_if_untested()
        choice = stream.resolve(os.environ, vllm_config)
        if choice.asked:
            surface.check(ROUTES)  # a changed K3 is refused before anything is routed
            routed = route_attn_res()
            if not routed:
                raise RuntimeError(
                    f"kimi_passes: the aux stream is asked for ({choice.source}) but no vLLM "
                    f"K3 module with attn_res was imported (looked for {list(ROUTES)})")
            log.info("kimi_passes: vLLM's K3 attn_res routed in %s (%s)", routed,
                     choice.source)
        route.choice = choice
    return route.choice


def checked_init(route: EagerRoute, own):
    """``KimiLinearModel.__init__``: the stream resolved (``activate``), vLLM's own init,
    then ``plan.startup`` with the config it was built from."""

    def __init__(self, *args, **kwargs):
        config = kwargs.get("vllm_config", args[0] if args else None)
        if config is None:
            from vllm.config import get_current_vllm_config

            config = get_current_vllm_config()
        choice = activate(route, config)
        own(self, *args, **kwargs)
        self._kimi_passes_route = route
        plan.startup(self, config, choice)

    return __init__


def _on_k3_import(module) -> None:
    """A K3 model module was imported: its ``KimiLinearModel.__init__`` is wrapped."""
    route = _route
    if route is not None and module.__name__ in MODEL_CLASSES:
        _wrap(route, module.KimiLinearModel, "__init__",
              functools.partial(checked_init, route))


def unroute_attn_res() -> None:
    """Put back every name the route replaced; the hook and the route are dropped."""
    global _route
    route, _route = _route, None
    if route is None:
        return
    hook.disarm(route.hook)
    for name, fn in route.originals.items():
        vars(sys.modules[name])["attn_res"] = fn
    for (cls, attr), own in route.class_originals.items():
        if own is None:
            delattr(cls, attr)
        else:
            setattr(cls, attr, own)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: the variables checked, the route built,
    the K3 import hook armed (see the module docstring); imports no vLLM module."""
    stream.from_environment(os.environ)  # a bad value raises, before vLLM builds anything
    # vLLM loads general plugins once a process; a route already built is kept as it is.
    _process_route(arm=True)


def serve_eager(own: Callable[..., Any], vendor: str = "nvidia") -> EagerRoute:
    """The route serving the attn_res stream with ``own`` as vLLM's ``attn_res``, without
    vLLM (tools/gpu/eager_route.py): ``vllm_attn_res`` then runs as vLLM's K3 would call
    it, and ``current().expect`` makes captures. ``unroute_attn_res`` drops it."""
    route = _process_route()
    route.own[vendor] = own
    route.choice = stream.StreamChoice.given("attn_res")
    return route


__all__ = ["EagerRoute", "current", "register", "route_attn_res", "serve_eager",
           "unroute_attn_res", "vllm_attn_res", "vllm_attn_res_amd"]
