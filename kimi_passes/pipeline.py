"""Which kimi passes a ``KimiPassConfig`` asks for, and in what order.

The one place that turns the options record into passes; ``kimi_backend``, the vLLM
pass and users installing the passes on their own stack (AOTInductor, a backend of their
own) all take their managers from here::

    post_grad (inference)   AttnResFusionPass        (fuse_torch_mixing)
                            AuxStreamPass            (aux_stream, fuse_capture, drafter)
                            FuseQuantPass            (fuse_quant)
                            LowerKimiOps             (lower_kimi_ops; CPU calls only)
    pre_autograd (training) AttnResFusionPass(differentiable=True)   (fuse_torch_mixing)
    post_grad (training)    AuxStreamPass, LowerKimiOps: the inference manager's objects

The training graphs' mixing is fused before AOTAutograd (docs/design.md section 7), so
their post-grad manager runs no second fusion; it shares the inference manager's aux
pass, lowering and observers.
"""

from __future__ import annotations

from kimi_passes.config.pass_config import KimiPassConfig
from kimi_passes.fusion import AttnResFusionPass
from kimi_passes.fx.manager import KimiPassManager, PassObserver
from kimi_passes.lowering import LowerKimiOps
from kimi_passes.quant import FuseQuantPass
from kimi_passes.taps.aux_stream import AuxStreamPass


def pass_manager(config: KimiPassConfig | None = None, /, *,
                 observers: tuple[PassObserver, ...] = (), **options) -> KimiPassManager:
    """The post-grad kimi passes for ``config`` (or ``KimiPassConfig.build(**options)``).

    One ``CustomGraphPass`` with a ``uuid()`` over every option and pass source: install it
    as Inductor's ``post_grad_custom_post_pass`` (AOTInductor: ``inductor_configs=``), and
    Inductor's FX graph cache stays on and never serves a graph built under other options.
    """
    if config is None:
        config = KimiPassConfig.build(**options)
    elif not isinstance(config, KimiPassConfig):
        raise TypeError(f"kimi_passes: expected a KimiPassConfig, got {config!r}; pass options "
                        "by name (aux_stream='prefix', ...) or KimiPassConfig.build(...)")
    elif options:
        raise TypeError(f"pass_manager: give a KimiPassConfig or options, not both "
                        f"({sorted(options)})")
    fusion = [AttnResFusionPass()] if config.fuse_torch_mixing else []
    aux = AuxStreamPass(config.aux_stream, fuse=config.fuse_capture, drafter=config.drafter)
    # After the aux pass: a call it turned into attn_res_capture fuses as
    # attn_res_quant_capture; before the lowering, which lowers the quantizing ops too.
    quant = [FuseQuantPass()] if config.fuse_quant else []
    return KimiPassManager([*fusion, aux, *quant], observers,
                           lowering=LowerKimiOps() if config.lower_kimi_ops else None,
                           config=config)


def training_manager(inference: KimiPassManager) -> KimiPassManager:
    """The post-grad passes of graphs that need a backward: ``inference``'s aux pass and
    lowering (fused before autograd already), sharing its observers."""
    manager = KimiPassManager([inference.get(AuxStreamPass)], lowering=inference.lowering,
                              config=inference.config)
    manager.observers = inference.observers
    return manager


def pre_autograd_manager(config: KimiPassConfig) -> KimiPassManager | None:
    """The fusion run on training graphs before AOTAutograd (None: ``fuse_torch_mixing`` off)."""
    if not config.fuse_torch_mixing:
        return None
    return KimiPassManager([AttnResFusionPass(differentiable=True)], phase="pre_autograd",
                           config=config)
