"""The attn_res stream in vLLM's eager K3: each capture read out of its consumer's call.

vLLM 0.33.0 runs K3 eagerly (breakable CUDA graphs force mode NONE). Under
``$KIMI_PASSES_AUX_STREAM=attn_res`` the plugin rebinds, class-level, the method vLLM's
forward captures through (NVIDIA ``_capture_aux_hidden_stream``, ROCm
``_maybe_add_hidden_state``); capture ``k``'s consumer is the call mixing with layer ``k``'s
``self_attention_res_norm`` weight (the output aggregation's for ``k == L``).

Before (vLLM, flag on; flag off returns ``prefix + pending`` instead)::

    aux = attn_res(prefix + pending, None, bank, w_k, ...)       # a second read of bank
    x = attn_res(prefix, pending, bank, w_k, ..., input_norm)     # layer k, pre-attention

After::

    aux = prefix.new_empty(0); expect[w_k] = aux                 # the capture: no kernel
    x, m = kimi::attn_res_capture(prefix, pending, bank, w_k, ...); aux.set_(m)

Invariants: in eager, only a capture's consumer runs a kimi op; every other AttnRes
call is vLLM's own ``attn_res`` (``k3_route``). The decisions are Python, made while the
forward runs, so a CUDA-graph capture records them once and every replay writes the
same buffers; nothing syncs with the host. Under Dynamo the captures are vLLM's own
(the compiled route's pass rewrites them); a forward that ends with a capture
unconsumed raises. docs/design.md section 11.
"""

from __future__ import annotations

import sys

import torch

from kimi_passes.config.stream import ENV_VAR
from kimi_passes.ops.attn_res_args import AttnResArgs

#: Captures waiting for their consumer: ``id(norm weight) -> (weight, buffer)``.
_expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
#: The stream the route serves (set by ``install``); ``None``: not installed.
_stream: list[str | None] = [None]


def fused() -> bool:
    """Whether this call runs the eager route's fused capture (eager, attn_res stream)."""
    return _stream[0] == "attn_res" and not torch.compiler.is_compiling()


def claim(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The capture buffer this ``attn_res`` call fills, if it is a capture's consumer."""
    if not _expected:
        return None
    weight = args[3] if len(args) > 3 else kwargs["norm_weight"]
    entry = _expected.pop(id(weight), None)
    return None if entry is None else entry[1]


def capture_call(args: tuple, kwargs: dict) -> AttnResArgs:
    """The call vLLM's flag-on capture makes for this consumer call (its pure mixing of
    ``prefix + delta`` over the same bank, weights and ``num_blocks``): the reference the
    fused capture is checked against (tests, tools/gpu/eager_route.py)."""
    a = AttnResArgs(*args, **kwargs)
    prefix = a.prefix if a.delta is None else a.prefix + a.delta
    return a._replace(prefix=prefix, delta=None, output_norm_weight=None, block_write_idx=-1,
                      output_norm_eps=0.0)


def expect(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A buffer that the consumer mixing with ``weight`` fills (``Tensor.set_``)."""
    if id(weight) in _expected:
        raise RuntimeError(
            "kimi_passes: two aux captures wait on one consumer call: vLLM's K3 forward "
            f"is not the one the route was written for (vLLM 0.33.0); unset ${ENV_VAR}")
    buffer = like.new_empty(0)
    _expected[id(weight)] = (weight, buffer)
    return buffer


def _pp_group(model):
    return sys.modules[type(model).__module__].get_pp_group()


def consumer_weight(model, capture_id: int) -> torch.Tensor:
    """The norm weight of capture ``capture_id``'s consumer call on this stage."""
    if capture_id < model.end_layer:
        return model.layers[capture_id].self_attention_res_norm.weight
    if _pp_group(model).is_last_rank:
        return model.output_attn_res_norm.weight
    raise RuntimeError(crossing(capture_id, model))


def crossing(capture_id: int, model) -> str:
    return (f"kimi_passes: aux capture id {capture_id} is this pipeline stage's last layer "
            f"(layers [{model.start_layer}, {model.end_layer})): its consumer runs on the next "
            "stage, so the attn_res stream cannot be read here and vLLM would hand the "
            "drafter the running prefix. Serve a drafter whose capture ids are not a "
            "non-final stage's end, or move the stage boundary (VLLM_PP_LAYER_PARTITION)")


def check_capture_ids(model) -> None:
    """Refuse capture ids the route cannot serve on this stage (a stage-crossing id)."""
    if _stream[0] != "attn_res":
        return
    pp = _pp_group(model)
    ids = set(model.aux_hidden_state_layers)
    if not pp.is_last_rank and model.end_layer in ids:
        raise RuntimeError(crossing(model.end_layer, model))
    if not pp.is_first_rank and model.start_layer in ids \
            and not getattr(type(model), "supports_aux_hidden_states_over_pp", False):
        raise RuntimeError(
            f"kimi_passes: aux capture id {model.start_layer} is this pipeline stage's first "
            "layer, and this vLLM K3 (ROCm) returns no aux states over pipeline stages: "
            "serve the drafter with pipeline_parallel_size 1, or unset "
            f"${ENV_VAR}")


def _check_compile_state(model) -> None:
    plan = getattr(model, "_kimi_passes_plan", None)
    if plan is not None and plan.route == "eager" and torch.compiler.is_compiling():
        raise RuntimeError(
            f"kimi_passes: vLLM's K3 forward is being traced by Dynamo though vLLM's config "
            f"runs it eagerly ({plan.why}); the eager route cannot serve a traced forward. "
            "Compile it with backend='kimi' (the pass serves the stream there) or run it "
            "eagerly")


def nvidia_capture(own):
    """NVIDIA ``_capture_aux_hidden_stream``: fused in eager, ``own`` under Dynamo."""

    def _capture_aux_hidden_stream(self, layer_idx, prefix_sum, pending_mlp_out,
                                   block_residual):
        _check_compile_state(self)
        if not (fused() and self.use_attn_res):
            return own(self, layer_idx, prefix_sum, pending_mlp_out, block_residual)
        return expect(consumer_weight(self, layer_idx + 1), prefix_sum)

    return _capture_aux_hidden_stream


def amd_capture(own):
    """ROCm ``_maybe_add_hidden_state``: fused in eager, ``own`` under Dynamo.

    The first call (``start_layer``) is the embedding on the first stage (zero blocks mix
    to it: vLLM's value is the stream's); ``own`` is K3's method object, so its
    zero-argument ``super()`` still works.
    """

    def _maybe_add_hidden_state(self, aux_hidden_states, layer_idx, hidden_states, residual):
        _check_compile_state(self)
        if not fused() or self.config.attn_res_block_size is None \
                or layer_idx not in self.aux_hidden_state_layers \
                or layer_idx == self.start_layer:
            return own(self, aux_hidden_states, layer_idx, hidden_states, residual)
        aux_hidden_states.append(expect(consumer_weight(self, layer_idx), hidden_states))
        return aux_hidden_states

    return _maybe_add_hidden_state


def checked_forward(own):
    """``KimiLinearModel.forward``, then: every capture's consumer ran."""

    def forward(self, *args, **kwargs):
        _expected.clear()  # a forward that raised may have left some
        out = own(self, *args, **kwargs)
        if _expected:
            left = len(_expected)
            _expected.clear()
            raise RuntimeError(
                f"kimi_passes: {left} aux capture(s) of vLLM's K3 forward found no consumer "
                "call (the next layer's AttnRes or the output aggregation): this vLLM is not "
                f"the one the route was written for (vLLM 0.33.0); unset ${ENV_VAR}")
        return out

    return forward


def checked_set_layers(own):
    """``_set_aux_hidden_state_layers``, then the ids checked (``check_capture_ids``)."""

    def _set_aux_hidden_state_layers(self, layers):
        own(self, layers)
        check_capture_ids(self)

    return _set_aux_hidden_state_layers
