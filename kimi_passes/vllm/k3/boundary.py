"""A capture id at a pipeline stage boundary: the stage that owns its consumer fills it.

Capture ``k == end_layer`` of a non-final stage is the pre-norm mixture that layer ``k``,
the next stage's first layer, reads. That stage receives exactly the inputs of that AttnRes
call through vLLM's ``IntermediateTensors`` (``hidden_states``, the earlier stage's
``prefix + pending``, as its prefix, and the block bank as ``residual``), so its first
layer's consumer call, routed to ``kimi::attn_res_capture``, computes the one-stage value
bit for bit: the same op from the same inputs (``prefix + delta`` rounds to the dtype
before mixing, exactly what the earlier stage sends).

Path chosen: the next stage fills the received slot in place. The alternative, the earlier
stage keeping the consumer's two score vectors (``self_attention_res_norm``,
``self_attention_res_proj``), needs vLLM's weight loader to load layer ``k``'s weights on a
stage that does not own layer ``k``, and a second read of the bank there; this path touches
no loader and adds no AttnRes call.

Invariants (vLLM 0.33.0, 0.34.0, NVIDIA: ``supports_aux_hidden_states_over_pp``):

- the earlier stage packs, at the slot vLLM's mixin gives id ``k`` (``_aux_slot_base_cached``
  counts ids ``<= start_layer`` upstream, ``bisect_right``; the runner's slot reservation
  and relay keys count it the same way), a ``[T, H]`` of NaN (one fill kernel): a slot no
  next stage fills (that node without the route) reaches the drafter as NaN, never as a
  plausible stream;
- the stage owning layer ``k`` expects its first layer's consumer call
  (``Captures.expect_into``) to write the mixture into the received slot
  (``copy_``, one ``[T, H]`` write, CUDA-graph safe: the runner's persistent buffer).
  The runner hands the forward views of its persistent buffers and relays the same view
  object (``PPHandler.relay_aux_hidden_states``); the last rank's
  ``collect_remote_aux_hidden_states`` returns that object: the filled value reaches the
  drafter in vLLM's slot order. A forward that leaves the slot unfilled raises
  (``Captures.end_forward``);
- served only where the route reads captures out of consumer calls: stream ``attn_res``,
  eager, NVIDIA. ROCm's K3 returns no aux states over pipeline stages
  (``supports_aux_hidden_states_over_pp`` is False, and vLLM's runner refuses a drafter
  with pipeline parallelism there); a compiled route (``STOCK_TORCH_COMPILE`` with
  ``backend='kimi'``, or ``kimi_backend`` over vLLM's K3 stages) compiles each stage's graph
  alone, and the pass would have to write a graph input of the next stage's graph: both
  refused naming why (``refusal``).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

log = logging.getLogger("vllm.kimi_passes")  # plan.py's startup logger: vLLM prints it

ROCM_WHY = ("vLLM's ROCm K3 returns no aux states over pipeline stages "
            "(its KimiLinearModel.supports_aux_hidden_states_over_pp is False; vLLM's runner "
            "refuses a drafter with pipeline parallelism there)")
COMPILED_WHY = ("the compiled route compiles each stage's graph alone: the capture's "
                "consumer is the next stage's graph, and the kimi pass cannot write the "
                "slot that graph receives (a graph input); drop the -cc mode (the eager "
                "route serves it)")


class Captures(Protocol):
    """What this module uses of ``eager.Captures`` (which imports this module)."""

    @property
    def stream(self) -> str | None: ...

    def fused(self) -> bool: ...

    def expect_into(self, weight: torch.Tensor, slot: torch.Tensor) -> None: ...


#: How vLLM 0.33.0 / 0.34.0 refuses the id (``_set_aux_hidden_state_layers``, flag on).
VLLMS_REFUSAL = "Auxiliary layer {k} cannot end a non-final PP stage"


def refusal_for(*, over_pp: bool, compiled: bool) -> str | None:
    """Why a stage-boundary capture id cannot be served (None: served); the one rule,
    for the model's check and ``vllm-plan``."""
    if not over_pp:
        return ROCM_WHY
    if compiled:
        return COMPILED_WHY
    return None


def refusal(model) -> str | None:
    """``refusal_for`` this K3 stage (its vendor; its plan, when the init made one)."""
    plan = getattr(model, "_kimi_passes_plan", None)
    return refusal_for(over_pp=getattr(type(model), "supports_aux_hidden_states_over_pp", False),
                       compiled=plan is not None and plan.route == "compiled")


def served_text(capture_id: int, start: int, end: int) -> str:
    """How a served boundary id is served (the model's log line, ``vllm-plan``'s row)."""
    return (f"aux capture id {capture_id} ends pipeline stage [{start}, {end}): served, the "
            f"next stage's layer {capture_id} fills the slot it receives (its first AttnRes "
            "call, kimi::attn_res_capture; one [T, H] copy, no extra AttnRes call)")


def crosses(model, capture_id: int, is_last_rank: bool) -> bool:
    """Is ``capture_id`` this non-final stage's end (its consumer on the next stage)?"""
    return capture_id == model.end_layer and not is_last_rank


def placeholder(model, capture_id: int, prefix_sum: torch.Tensor) -> torch.Tensor:
    """The earlier stage's slot for boundary id ``capture_id``: ``[T, H]`` of NaN, which
    the next stage overwrites (unfilled, it is loud). Traced by Dynamo (a compiled route)
    or on a refused stage: the refusal."""
    # A RuntimeError, not AuxCaptureError: Dynamo cannot construct the latter in a trace.
    why = COMPILED_WHY if torch.compiler.is_compiling() else refusal(model)
    if why is not None:
        raise RuntimeError(refused_text(capture_id, model.start_layer, model.end_layer, why))
    return prefix_sum.new_full(prefix_sum.shape, float("nan"))


def refused_text(capture_id: int, start: int, end: int, why: str) -> str:
    return (f"kimi_passes: aux capture id {capture_id} ends pipeline stage [{start}, {end}) "
            f"(its consumer runs on the next stage) and cannot be served: {why}. Serve a "
            "drafter whose capture ids are not a non-final stage's end, or move the stage "
            "boundary (VLLM_PP_LAYER_PARTITION)")


def received_slot(model, intermediate_tensors) -> torch.Tensor | None:
    """The slot this stage received for capture id ``start_layer`` (vLLM's key: the last
    upstream slot, ``_aux_slot_base_cached - 1``), None where it owns no boundary id."""
    if intermediate_tensors is None or model.start_layer not in model.aux_hidden_state_layers \
            or not getattr(type(model), "supports_aux_hidden_states_over_pp", False):
        return None
    base = model._aux_slot_base_cached
    if base == 0 or model.aux_hidden_state_layers[base - 1] != model.start_layer:
        raise RuntimeError(
            f"kimi_passes: capture id {model.start_layer} starts this stage but vLLM's PP "
            f"slot layout (base {base}, ids {model.aux_hidden_state_layers}) does not put it "
            "last upstream: this vLLM is not the one the route was written for")
    return intermediate_tensors[f"{model.AUX_HIDDEN_STATE_KEY}{base - 1}"]


def expect_received(route: Captures, model, intermediate_tensors) -> None:
    """Make this stage's first consumer call fill the received boundary slot, if any."""
    slot = received_slot(model, intermediate_tensors)
    if slot is not None and route.fused() and refusal(model) is None:
        route.expect_into(model.layers[model.start_layer].self_attention_res_norm.weight, slot)


def lifts(route: Captures, model, error: ValueError) -> bool:
    """Is ``error`` vLLM's flag-on refusal of this stage's end id, which the route takes
    over (``check_capture_ids`` then serves or refuses it)? Only under the attn_res stream."""
    return route.stream == "attn_res" \
        and str(error).startswith(VLLMS_REFUSAL.format(k=model.end_layer)) \
        and model.end_layer in model.aux_hidden_state_layers


def log_served(model) -> None:
    log.info("kimi_passes: %s", served_text(model.end_layer, model.start_layer, model.end_layer))
