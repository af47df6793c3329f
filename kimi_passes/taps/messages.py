"""The words of the tap passes: each refusal, warning and log line, built from its facts.

The other ``taps/`` modules decide what is wrong; the functions here only say it. Every
refusal (raised as ``AuxCaptureError`` by the caller) names what is wrong and the remedy;
``stage`` arguments are ``_Geometry.stage()`` texts ("pipeline final stage owning layers
[0, 4)"). docs/design.md section 4, "Refusals", lists when each one is raised.
"""

from __future__ import annotations

from kimi_passes.config.drafter import PLUS_ONE, DrafterTaps
from kimi_passes.config.stream import ENV_VAR

# -- the aux-stream pass -------------------------------------------------------------------


def unknown_stream(stream: str, streams) -> str:
    return f"AuxStreamPass: unknown stream {stream!r}; use one of {list(streams)}"


def summary(stream: str, rewrites) -> str:
    """The pass's first log line: each ``TapRewrite``, its id, consumer and how."""
    return f"AuxStreamPass(stream={stream}): rewrote {len(rewrites)} tap(s): " + (
        "; ".join(f"id {r.capture_id} <- {r.consumer} ({r.how()})" for r in rewrites))


def separate_read(capture_id) -> str:
    return (f"AuxStreamPass: capture id {capture_id} is a separate attn_res_mix read of the "
            "bank (nothing to fuse it into)")


def pure_call_kept(capture_id, name: str) -> str:
    return (f"AuxStreamPass: capture id {capture_id}: the pure attn_res call "
            f"{name} stays (its mixture has readers other than the returned "
            "value); the returned value reads the consumer's fused mixture")


def installed_alone() -> str:
    return (
        "kimi_passes: AuxStreamPass installed alone as post_grad_custom_post_pass rewrites "
        "the aux taps only: this CPU graph's kimi op calls stay op calls instead of "
        "generated code, and AttnRes mixing written in plain torch is not fused. Install "
        "the pass manager instead: post_grad_custom_post_pass = kimi_passes.pass_manager("
        "aux_stream=..., draft_config=...) (the same options as make_kimi_backend)")


# -- unmarked captures and markers ---------------------------------------------------------


def returned_value(name: str, pure: str | None = None) -> str:
    """A returned value, in words; ``pure``: the pure mixing call it is the output of."""
    if pure is None:
        return f"returned value {name}"
    return f"returned value {name} (a pure attn_res mixing call {pure})"


def ambiguous(what: str, consumers: list[str], stage: str) -> str:
    return (
        f"{what} is the legacy input of {len(consumers)} AttnRes calls in the "
        f"{stage} ({'; '.join(consumers)}): an unmarked aux capture must have one consumer, "
        "whose pre-norm mixture it then reads, and serving either one could feed the "
        "drafter the wrong layer's state. Remedy: mark the tap with "
        "kimi_passes.aux_tap(x, capture_id) right before the layer that reads it, or "
        "compile with aux_stream='prefix' if the drafter was trained on the prefix stream")


def contradiction(tap: str, k: int, capture: str, capture_id, stage: str) -> str:
    return (
        f"the aux tap marker {tap} (capture id {k}) contradicts the unmarked capture "
        f"{capture} (capture id {capture_id}) in the {stage}: "
        "one graph names two capture ids for one consumer, or one capture id for two "
        "consumers, and the drafter would be fed one of them silently. Remedy: give the "
        "marker the capture id of the layer that reads its value, or return the value "
        "the marker marks (not another layer's input)")


def duplicate_id(k: int, first: str, second: str, stage: str) -> str:
    return (
        f"capture id {k} is claimed by two aux taps ({first} and {second}) "
        f"in the {stage}; each capture id must be tapped once: remove the "
        "duplicate from the model's aux layer ids")


# -- a tap's consumer ----------------------------------------------------------------------

#: Appended where the graph's end is not known (the pass installed alone): a break may be.
MAYBE_BREAK = (
    ". Or the graph ends at a graph break before the tap's consumer: "
    "torch.compile(..., fullgraph=True) raises at a break, TORCH_LOGS=graph_breaks lists "
    "them; remove it")


def no_attn_res(k: int, maybe_break: str) -> str:
    return (
        f"capture id {k}: the aux tap marker has no AttnRes op to mix with in this graph "
        "(no kimi.attn_res / attn_res_mix call); the aux-stream pass only applies to "
        "AttnRes models: call the mixing through torch.ops.kimi.attn_res, or compile "
        "with aux_stream='prefix' if the legacy value is what the drafter wants" +
        maybe_break)


def next_stage(k: int, stage: str, end, maybe_break: str) -> str:
    """No consumer: it lives on the next pipeline stage (``end``: that stage's first layer)."""
    return (
        f"capture id {k} has no consumer in this graph ({stage}): the layer "
        f"that reads it lives on the next pipeline stage (the tap at layer {end}). Its "
        "mixture cannot be computed here and falling back to the running prefix would "
        "silently feed the drafter a different value. Remedy: drop capture id "
        f"{k} on this stage and tap it on the stage that owns layer {k} (as its first "
        "layer's capture id), or compile with aux_stream='prefix' if the drafter was "
        "trained on the prefix stream" + maybe_break)


def many_consumers(k: int, names: list[str], stage: str) -> str:
    return (
        f"capture id {k}: the tapped value is mixed by {len(names)} AttnRes calls "
        f"({', '.join(names)}) in the {stage}; a tap must have one consumer: tap the "
        "value right before the layer that reads it")


def graph_break(k: int, reason: str | None, where: str | None) -> str:
    """No consumer: a graph break (``reason`` at ``where``; None: not known) cut it off."""
    at = (f", at a Dynamo graph break ({reason}; at {where})" if reason is not None else
          ": this graph only hands the tapped value on, so a graph break (here or in the "
          "function that calls this one) put the tap and its consumer in different graphs")
    return (
        f"capture id {k} has no consumer in this graph: the graph ends before the tap's "
        f"consumer{at}. The AttnRes call that reads the tap runs in another graph, and "
        "the tap's mixture cannot be computed here. Remedy: remove the graph break "
        "(torch.compile(..., fullgraph=True) raises at it; TORCH_LOGS=graph_breaks lists "
        "every break); if the model has no AttnRes op, compile with aux_stream='prefix'")


def wrong_layer(k: int, layer: int, role: str, stage: str) -> str:
    return (
        f"capture id {k} contradicts its consumer: the tapped value is read by layer "
        f"{layer}'s {role} mixing in the {stage}, so it is what layer {layer} "
        f"reads, not layer {k}. Remedy: place the tap right before layer {k}'s "
        f"pre-attention AttnRes call, or use capture id {layer}")


def wrong_aggregation_id(k: int, stage: str, num_layers: int) -> str:
    return (
        f"capture id {k} contradicts its consumer: the tapped value is read by the output "
        f"aggregation of the {stage}, which is capture id {num_layers}. "
        "Remedy: tap the output aggregation with capture id num_layers")


def wrong_num_blocks(k: int, consumer: str, stage: str, S: int, blocks: int, nb) -> str:
    """``blocks``: ``cdiv(k, S)``, what layer ``k`` mixes; ``nb``: what the consumer mixes."""
    return (
        f"capture id {k} contradicts its consumer {consumer} in the {stage}: "
        f"with block size {S}, what layer {k} reads mixes cdiv({k}, {S}) = {blocks} "
        f"completed blocks, but the consumer mixes num_blocks={nb}. Remedy: pass "
        f"num_blocks=cdiv(i, block_size) for layer i, or fix the tap's capture id")


def split_at_kimi_ops(k: int, split_ops, kimi_ops: list[str]) -> str:
    return (
        f"capture id {k} has no consumer in this graph: vLLM's piecewise compilation "
        f"split the model at splitting_ops {list(split_ops)}, and {kimi_ops} puts each "
        "AttnRes call in a piece of its own that Inductor does not compile, away from "
        "the tap that reads its mixture. Remedy: do not split at kimi AttnRes ops: "
        f"remove {kimi_ops} from CompilationConfig.splitting_ops (vLLM's default, its "
        "attention ops, keeps each tap with its consumer)")


def split_piece(k: int, holds: str, split_ops) -> str:
    """No consumer in one piece of vLLM's split; ``holds``: the piece's AttnRes calls."""
    return (
        f"capture id {k} has no consumer in this graph (it holds {holds}), one piece of vLLM's "
        f"piecewise split at splitting_ops {list(split_ops)}. Either a splitting op sits "
        "between the tap and the AttnRes call that reads it (remedy: tap right before that "
        "call, with no splitting op in between), or the consumer runs on the next "
        f"pipeline stage (remedy: tap capture id {k} on the stage that owns layer {k}); "
        "or compile with aux_stream='prefix' if the drafter was trained on the prefix stream")


# -- the drafter's declared ids (taps/served.py) -------------------------------------------


def beyond_num_layers(d: DrafterTaps, beyond: list[int], num_layers: int, stage: str) -> str:
    return (
        f"the drafter declares capture ids {beyond} ({d.describe()}) "
        f"but the model has num_layers={num_layers} (the {stage}): "
        f"capture ids run from 0 (the embedding) to {num_layers} (what the final "
        "norm reads). The drafter was trained on another target model: serve it "
        "with that model, or use a drafter trained on this one")


def not_served(d: DrafterTaps, missing: list[int], earlier: list[int], extra: list[int],
               here: set[int], exempt: set, holds: str) -> str:
    """The graph's taps ``here`` are not the declared ids it owns (``holds``: what it holds)."""
    parts = []
    if missing:
        parts.append(f"declared but not tapped: {missing} (this graph holds the AttnRes "
                     "call that reads each of them)")
    if earlier:
        parts.append(f"declared but not tapped: {earlier} (read by the graph compiled "
                     "just before this one, which did not tap it)")
    if extra:
        parts.append(f"tapped but not declared: {extra}")
    hint = _shift_hint(d, missing, sorted(here - exempt))
    final = (f" ({d.format} drafters take capture id num_layers separately: a tap there "
             "need not be declared.)") if d.final_state_separate else ""
    return (
        f"the compiled graph does not serve the drafter's inputs: the drafter declares "
        f"capture ids {list(d.capture_ids)} ({d.describe()}); this graph "
        f"({holds}) taps {sorted(here)}: " + "; ".join(parts) + "." + hint +
        final + " A drafter fed other layers than it was trained on runs and silently "
        "loses acceptance. Remedy: give the model the drafter's capture ids as its aux "
        "layer ids (vLLM sets them from the drafter config), or serve the drafter trained "
        "on this model's taps")


def graph_holds(first: int | None, last: int | None, has_output_aggregation: bool) -> str:
    """What a graph holds, in words (a whole stage, a piece of a split, a fragment)."""
    if first is None:
        return ("the output aggregation" if has_output_aggregation
                else "no AttnRes call with a layer index")
    span = f"layer {first}" if first == last else f"layers {first} to {last}"
    tail = " and the output aggregation" if has_output_aggregation else ""
    return f"AttnRes calls of {span}{tail}"


def _shift_hint(d: DrafterTaps, missing: list[int], taps: list[int]) -> str:
    """Name an off-by-one: the graph's taps are the declared ids shifted by one."""
    if not missing:
        return ""
    for shift in (-1, 1):
        shifted = sorted(k + shift for k in d.capture_ids)
        if taps and all(k in shifted for k in taps) and sorted(taps) != sorted(d.capture_ids):
            if shift == 1:
                why = "the model was given capture ids + 1: a layer id list converted twice"
            elif d.convention == PLUS_ONE:
                why = (f"{d.key} holds layer ids, capture id = layer id + 1, and the model "
                       "was given the layer ids as capture ids")
            else:
                why = ("the model was given layer ids (capture id - 1) where the drafter "
                       "names capture ids")
            return f" The taps are the declared ids {shift:+d}: off by one ({why})."
    return ""


# -- vLLM's own K3 attn_res (taps/unrouted.py) ---------------------------------------------


def unrouted(found: list[str]) -> str:
    """vLLM's K3 ``attn_res`` calls ``found`` (described) under the attn_res stream."""
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (
        f"kimi_passes: the compiled graph calls vLLM's Kimi K3 attn_res as vLLM ships it "
        f"({len(found)} call(s): {shown}), not kimi::attn_res. The kimi passes see only "
        "kimi::attn_res, so this K3 forward's aux captures would stay vLLM's running prefix "
        "(the legacy stream) although the attn_res stream is requested, and the drafter "
        f"would silently lose acceptance. Remedy: start vLLM with ${ENV_VAR}=attn_res set "
        "(kimi_passes' vllm.general_plugins entry point then routes vLLM's attn_res to "
        "kimi::attn_res at the model's init, before it is compiled; if $VLLM_PLUGINS is set, "
        "it must list "
        "kimi_passes; without the package metadata call kimi_passes.vllm.k3.route.register() "
        "after importing vLLM), or request aux_stream='prefix' to serve vLLM's own values. "
        "Serving no drafter, the kimi passes have nothing to do in this graph: compile with "
        "backend='inductor'. docs/reference.md, \"vLLM's Kimi K3\"")
