"""vLLM's own Kimi K3 forward through ``kimi::attn_res``: the ``vllm.general_plugins`` route.

vLLM 0.33.0 serves K3 with a module-level function ``attn_res``, imported by name into
``vllm/models/kimi_k3/nvidia/model.py`` (and ``nvidia/ops.py``) and, with a
``quant_dtype=`` keyword, the ROCm path's ``amd/linear.py``. Its arguments and semantics
are ``kimi::attn_res``'s (``AttnResArgs``): the kimi passes see only kimi ops, so the K3
forward must call the op for the aux captures to be found.

Invariant: ``register`` (the entry point ``kimi_passes``, which vLLM calls in every
process) acts **only when ``$KIMI_PASSES_AUX_STREAM`` is set** (a bad value raises); unset,
it imports nothing and changes nothing. Set, it rebinds those names to ``vllm_attn_res`` /
``vllm_attn_res_amd`` and wraps four methods of each imported ``KimiLinearModel``
(``_install``): the capture method and ``forward`` (``k3_eager``: the eager route),
``_set_aux_hidden_state_layers`` (a stage-crossing capture id refused) and ``__init__``
(``k3_plan``: served or refused at startup). vLLM's files are never edited;
``unroute_attn_res`` puts everything back.

Traced by Dynamo, every call is a kimi op (the pass needs them). Eager, only a capture's
consumer is (``kimi::attn_res_capture``, the same arithmetic as vLLM's kernel, not bit for
bit); every other call is vLLM's own ``attn_res``. The FP8 quant is vLLM's AMD kernel's,
bound included: the route reads vLLM's ``get_fp8_min_max`` at each call (224 on fnuz
platforms, else 448) and passes it as ``quant_max``. Left unrouted, vLLM's own
``attn_res`` in a graph compiled under the attn_res stream is an ``AuxCaptureError``
(``taps/unrouted.py``). docs/design.md section 11.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import kimi_passes.ops  # noqa: F401  (registers torch.ops.kimi)
from kimi_passes.config.stream import ENV_VAR, resolve_aux_stream
from kimi_passes.ops.attn_res_args import AttnResArgs, record_signature
from kimi_passes.vllm import k3_eager, k3_plan, k3_surface, versions

log = logging.getLogger(__name__)

#: vLLM's K3 modules that import ``attn_res`` by name, and the function each gets.
NVIDIA_MODULES = ("vllm.models.kimi_k3.nvidia.model", "vllm.models.kimi_k3.nvidia.ops")
AMD_MODULES = ("vllm.models.kimi_k3.amd.linear",)


@record_signature(AttnResArgs, returns=torch.Tensor)
def vllm_attn_res(*args, **kwargs):
    """vLLM's NVIDIA ``attn_res`` (same signature, ``AttnResArgs``, and effects).

    Traced by Dynamo: ``kimi::attn_res`` (the pass recognises the captures around it).
    Eager: a capture's consumer runs ``kimi::attn_res_capture`` and fills the capture's
    buffer (``k3_eager``); every other call is vLLM's own ``attn_res``.
    """
    if not torch.compiler.is_compiling():
        aux = k3_eager.claim(args, kwargs)
        if aux is None:
            return _own["nvidia"](*args, **kwargs)
        out, mixed = torch.ops.kimi.attn_res_capture(*AttnResArgs(*args, **kwargs))
        aux.set_(mixed)
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
    aux = None
    if not torch.compiler.is_compiling():
        aux = k3_eager.claim(args, kwargs)
        if aux is None:
            return _own["amd"](*args, quant_dtype=quant_dtype, **kwargs)
    a = AttnResArgs(*args, **kwargs)
    if quant_dtype is None:
        if aux is None:
            return torch.ops.kimi.attn_res(*a)
        out, mixed = torch.ops.kimi.attn_res_capture(*a)
        aux.set_(mixed)
        return out
    qmax = _platform_quant_max(quant_dtype)
    if aux is None:
        return torch.ops.kimi.attn_res_quant(*a, quant_dtype, quant_max=qmax)
    data, scale, mixed = torch.ops.kimi.attn_res_quant_capture(*a, quant_dtype, quant_max=qmax)
    aux.set_(mixed)
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
#: vLLM's own functions, by module, while routed (``unroute_attn_res`` puts them back).
_originals: dict[str, object] = {}
#: vLLM's own ``attn_res`` by vendor, which non-consumer calls run in eager.
_own: dict[str, Any] = {}
#: The K3 model class of each vendor's model module.
MODEL_CLASSES = {"vllm.models.kimi_k3.nvidia.model": "nvidia",
                 "vllm.models.kimi_k3.amd.linear": "amd"}
#: The class attributes the route replaced: ``(class, name) -> own value or None``.
_class_originals: dict[tuple[type, str], Any] = {}


def _methods(vendor: str, stream: str) -> dict[str, Callable[[Any], Any]]:
    """The K3 model methods the route wraps, each ``name -> (vLLM's own -> ours)``."""
    capture = ("_capture_aux_hidden_stream", k3_eager.nvidia_capture) if vendor == "nvidia" \
        else ("_maybe_add_hidden_state", k3_eager.amd_capture)
    return {capture[0]: capture[1], "forward": k3_eager.checked_forward,
            "_set_aux_hidden_state_layers": k3_eager.checked_set_layers,
            "__init__": lambda own: k3_plan.checked_init(own, stream)}


def _install(stream: str) -> None:
    """Wrap the imported K3 model classes' methods (``_methods``); ``_own`` from the
    routed modules."""
    k3_eager._stream[0] = stream
    for name, vendor in MODEL_CLASSES.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        cls = module.KimiLinearModel
        for attr, wrap in _methods(vendor, stream).items():
            if (cls, attr) in _class_originals:
                continue
            _class_originals[cls, attr] = cls.__dict__.get(attr)
            setattr(cls, attr, functools.wraps(getattr(cls, attr))(wrap(getattr(cls, attr))))


def route_attn_res() -> list[str]:
    """Rebind ``attn_res`` in every imported vLLM K3 module; returns the modules routed.

    A module imported later is not routed: ``register`` imports the platform's K3
    package first.
    """
    routed = []
    for name, fn in ROUTES.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        current = getattr(module, "attn_res", None)
        if current is None:
            raise RuntimeError(
                f"kimi_passes: {name} has no module-level attn_res: this vLLM's K3 is not "
                "the one the route was written for (vLLM 0.33.0); unset "
                f"${ENV_VAR} to serve it without kimi_passes")
        if current is not fn:
            _originals.setdefault(name, current)
            vars(module)["attn_res"] = fn
        routed.append(name)
    for name, vendor in MODEL_CLASSES.items():
        if name in _originals:
            _own[vendor] = _originals[name]
    return routed


def unroute_attn_res() -> None:
    """Put vLLM's own ``attn_res`` back wherever ``route_attn_res`` replaced it."""
    for name, fn in list(_originals.items()):
        vars(sys.modules[name])["attn_res"] = fn
        del _originals[name]
    for (cls, attr), own in list(_class_originals.items()):
        if own is None:
            delattr(cls, attr)
        else:
            setattr(cls, attr, own)
        del _class_originals[cls, attr]
    _own.clear()
    k3_eager._stream[0] = None


def enabled() -> bool:
    """Whether kimi_passes is enabled for vLLM in this process: ``$KIMI_PASSES_AUX_STREAM``."""
    if not os.environ.get(ENV_VAR):
        return False
    resolve_aux_stream()  # a bad value is an error here, before vLLM builds anything
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: route K3's ``attn_res`` when enabled, once
    an untested vLLM is named (``versions``) and a changed K3 refused (``k3_surface``)."""
    if not enabled():
        return
    versions.warn_if_untested()
    # The package picks the platform's implementation (NVIDIA, or ROCm's amd.linear).
    importlib.import_module("vllm.models.kimi_k3")
    k3_surface.check(ROUTES)  # a changed K3 is refused before anything is routed
    routed = route_attn_res()
    _install(resolve_aux_stream())
    if not routed:
        raise RuntimeError(
            f"kimi_passes: ${ENV_VAR} is set but no vLLM K3 module with attn_res was "
            f"imported (looked for {list(ROUTES)}); unset ${ENV_VAR} on a platform "
            "without vLLM's K3 (TPU)")
    log.info("kimi_passes: vLLM's K3 attn_res runs as kimi::attn_res in %s (%s=%s)",
             routed, ENV_VAR, os.environ[ENV_VAR])


__all__ = ["register", "route_attn_res", "unroute_attn_res", "vllm_attn_res",
           "vllm_attn_res_amd"]
