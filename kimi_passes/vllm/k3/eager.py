"""The attn_res stream in vLLM's eager K3: each capture read out of its consumer's call.

vLLM (0.33.0, 0.34.0) runs K3 eagerly (breakable CUDA graphs force mode NONE). When the
stream resolved at the model's init is attn_res (``stream.resolve``), the route rebinds,
class-level, the method vLLM's forward captures through (NVIDIA
``_capture_aux_hidden_stream``, ROCm ``_maybe_add_hidden_state``) to the wrappers here;
capture ``k``'s consumer is the call mixing with layer ``k``'s ``self_attention_res_norm``
weight (the output aggregation's for ``k == L``).

Before (vLLM, flag on; flag off returns ``prefix + pending`` instead)::

    aux = attn_res(prefix + pending, None, bank, w_k, ...)       # a second read of bank
    x = attn_res(prefix, pending, bank, w_k, ..., input_norm)     # layer k, pre-attention

After::

    aux = prefix.new_empty(0); pending[w_k] = aux                # the capture: no kernel
    x, m = kimi::attn_res_capture(prefix, pending, bank, w_k, ...); aux.set_(m)

A capture id at a non-final stage's end is filled by the next stage's first consumer call,
in the slot vLLM relays (``boundary``).

Invariants: in eager, only a capture's consumer runs a kimi op; every other AttnRes call
is vLLM's own ``attn_res``. The decisions are Python, taken as the forward runs (a CUDA
graph records them once; nothing syncs). Pending captures are per thread (``Captures``);
a forward ending with one unconsumed raises. Under Dynamo the captures are vLLM's own
(``kimi_passes.vllm.compile_pass`` rewrites them). docs/design.md section 11.
"""

from __future__ import annotations

import abc
import contextlib
import sys
import threading
from collections.abc import Callable

import torch

from kimi_passes.ops.attn_res_args import AttnResArgs
from kimi_passes.vllm.k3 import boundary

#: How a consumer call hands on its pre-norm mixture (``buffer.set_`` or ``slot.copy_``).
Fill = Callable[[torch.Tensor], object]

#: How the route's errors end: what turns it off.
TURN_OFF = ("serve without the attn_res stream (unset $KIMI_PASSES_AUX_STREAM and "
            "$VLLM_KIMI_K3_AUX_ATTN_RES_STREAM, or serve a drafter that declares no stream)")


def written_for() -> str:
    """The vLLM versions the route was written for, for an error message."""
    from kimi_passes.vllm import versions

    return "vLLM " + " and ".join(versions.TESTED)


class Captures(abc.ABC):
    """The eager capture mechanics: this thread's pending captures, and who watches them.

    A capture (``expect``, or ``expect_into`` a received slot) waits, keyed by its
    consumer's norm weight, until that consumer's ``attn_res`` call ``claim``s it;
    ``begin_forward`` / ``end_forward`` bracket a forward, which must leave none waiting.
    Pending captures are per thread (``threading.local``): a forward in one thread never
    sees, clears or fills another's. Which stream is served is
    the route's (``stream``: ``route.EagerRoute``, the one subclass, which also records
    what the route replaced); the captures fuse only under attn_res, in eager.
    """

    def __init__(self) -> None:
        self._watchers: list[Callable[[tuple, dict], None]] = []
        self._local = threading.local()

    @property
    @abc.abstractmethod
    def stream(self) -> str | None:
        """The stream served (None: not resolved yet)."""

    def fused(self) -> bool:
        """Whether this call runs the fused capture (eager, attn_res stream)."""
        return self.stream == "attn_res" and not torch.compiler.is_compiling()

    def pending(self) -> dict[int, tuple[torch.Tensor, Fill]]:
        """This thread's captures waiting for their consumer: ``id(weight) -> (weight,
        fill)``."""
        found = getattr(self._local, "pending", None)
        if found is None:
            found = self._local.pending = {}
        return found

    def _wait(self, weight: torch.Tensor, fill: Fill) -> None:
        pending = self.pending()
        if id(weight) in pending:
            raise RuntimeError(
                "kimi_passes: two aux captures wait on one consumer call: vLLM's K3 forward "
                f"is not the one the route was written for ({written_for()}); {TURN_OFF}")
        pending[id(weight)] = (weight, fill)

    def expect(self, weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A buffer that the consumer mixing with ``weight`` fills (``Tensor.set_``)."""
        buffer = like.new_empty(0)
        # torch's stubs list set_'s storage overloads only; set_(Tensor) is the one used.
        self._wait(weight, buffer.set_)  # type: ignore[arg-type]
        return buffer

    def expect_into(self, weight: torch.Tensor, slot: torch.Tensor) -> None:
        """The consumer mixing with ``weight`` writes its mixture into ``slot`` (``copy_``:
        a received PP slot, whose memory the runner and its CUDA graphs keep)."""
        self._wait(weight, slot.copy_)

    def claim(self, args: tuple, kwargs: dict) -> Fill | None:
        """How this ``attn_res`` call hands on its mixture, if it is a capture's consumer
        (each watcher is first told the call: ``watch``)."""
        pending = self.pending()
        if not pending:
            return None
        weight = args[3] if len(args) > 3 else kwargs["norm_weight"]
        entry = pending.pop(id(weight), None)
        if entry is None:
            return None
        for watcher in self._watchers:
            watcher(args, kwargs)
        return entry[1]

    @contextlib.contextmanager
    def watch(self, watcher: Callable[[tuple, dict], None]):
        """Call ``watcher(args, kwargs)`` at each capture's consumer call, before it runs
        (tests and tools/gpu/eager_route.py compute vLLM's flag-on capture there)."""
        self._watchers.append(watcher)
        try:
            yield
        finally:
            self._watchers.remove(watcher)

    def begin_forward(self) -> None:
        self.pending().clear()  # this thread's: a forward that raised may have left some

    def end_forward(self) -> None:
        pending = self.pending()
        if pending:
            left = len(pending)
            pending.clear()
            raise RuntimeError(
                f"kimi_passes: {left} aux capture(s) of vLLM's K3 forward found no consumer "
                "call (the next layer's AttnRes or the output aggregation): this vLLM is not "
                f"the one the route was written for ({written_for()}); {TURN_OFF}")


def capture_call(args: tuple, kwargs: dict) -> AttnResArgs:
    """The call vLLM's flag-on capture makes for this consumer call (its pure mixing of
    ``prefix + delta`` over the same bank, weights and ``num_blocks``): the reference the
    fused capture is checked against (tests, tools/gpu/eager_route.py)."""
    a = AttnResArgs(*args, **kwargs)
    prefix = a.prefix if a.delta is None else a.prefix + a.delta
    return a._replace(prefix=prefix, delta=None, output_norm_weight=None, block_write_idx=-1,
                      output_norm_eps=0.0)


def _pp_group(model):
    return sys.modules[type(model).__module__].get_pp_group()


def consumer_weight(model, capture_id: int) -> torch.Tensor:
    """The norm weight of capture ``capture_id``'s consumer call on this stage."""
    if capture_id < model.end_layer:
        return model.layers[capture_id].self_attention_res_norm.weight
    if _pp_group(model).is_last_rank:
        return model.output_attn_res_norm.weight
    raise RuntimeError(boundary.refused_text(capture_id, model.start_layer, model.end_layer,
                                             boundary.refusal(model)
                                             or "its consumer runs on the next stage"))


def check_capture_ids(route: Captures, model) -> None:
    """Refuse capture ids the route cannot serve on this stage; a stage-end id is served
    (logged) or refused naming why (``boundary.refusal``)."""
    if route.stream != "attn_res":
        return
    pp = _pp_group(model)
    ids = set(model.aux_hidden_state_layers)
    if not pp.is_last_rank and model.end_layer in ids:
        why = boundary.refusal(model)
        if why is not None:
            raise RuntimeError(boundary.refused_text(model.end_layer, model.start_layer,
                                                     model.end_layer, why))
        boundary.log_served(model)
    if not pp.is_first_rank and model.start_layer in ids \
            and not getattr(type(model), "supports_aux_hidden_states_over_pp", False):
        raise RuntimeError(
            f"kimi_passes: aux capture id {model.start_layer} is this pipeline stage's first "
            "layer, and this vLLM K3 (ROCm) returns no aux states over pipeline stages: "
            f"serve the drafter with pipeline_parallel_size 1, or {TURN_OFF}")


def _check_compile_state(model) -> None:
    plan = getattr(model, "_kimi_passes_plan", None)
    if plan is not None and plan.route == "eager" and torch.compiler.is_compiling():
        raise RuntimeError(
            f"kimi_passes: vLLM's K3 forward is being traced by Dynamo though vLLM's config "
            f"runs it eagerly ({plan.why}); the eager route cannot serve a traced forward. "
            "Compile it with backend='kimi' (the pass serves the stream there) or run it "
            "eagerly")


def nvidia_capture(route: Captures, own):
    """NVIDIA ``_capture_aux_hidden_stream``: fused in eager, ``own`` under Dynamo."""

    def _capture_aux_hidden_stream(self, layer_idx, prefix_sum, pending_mlp_out,
                                   block_residual):
        _check_compile_state(self)
        if route.stream == "attn_res" and self.use_attn_res \
                and boundary.crosses(self, layer_idx + 1, _pp_group(self).is_last_rank):
            return boundary.placeholder(self, layer_idx + 1, prefix_sum)
        if not (route.fused() and self.use_attn_res):
            return own(self, layer_idx, prefix_sum, pending_mlp_out, block_residual)
        return route.expect(consumer_weight(self, layer_idx + 1), prefix_sum)

    return _capture_aux_hidden_stream


def amd_capture(route: Captures, own):
    """ROCm ``_maybe_add_hidden_state``: fused in eager, ``own`` under Dynamo.

    The first call (``start_layer``) is the embedding on the first stage (zero blocks mix
    to it: vLLM's value is the stream's); ``own`` is K3's method object, so its
    zero-argument ``super()`` still works.
    """

    def _maybe_add_hidden_state(self, aux_hidden_states, layer_idx, hidden_states, residual):
        _check_compile_state(self)
        if not route.fused() or self.config.attn_res_block_size is None \
                or layer_idx not in self.aux_hidden_state_layers \
                or layer_idx == self.start_layer:
            return own(self, aux_hidden_states, layer_idx, hidden_states, residual)
        aux_hidden_states.append(route.expect(consumer_weight(self, layer_idx), hidden_states))
        return aux_hidden_states

    return _maybe_add_hidden_state


def checked_forward(route: Captures, own):
    """``KimiLinearModel.forward``, then: every capture this thread made was consumed
    (traced by Dynamo, vLLM's own: the captures there are vLLM's). A received boundary
    slot is expected first (``boundary.expect_received``)."""

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return own(self, *args, **kwargs)
        route.begin_forward()
        boundary.expect_received(route, self, args[2] if len(args) > 2
                                 else kwargs.get("intermediate_tensors"))
        out = own(self, *args, **kwargs)
        route.end_forward()
        return out

    return forward


def checked_set_layers(route: Captures, own):
    """``_set_aux_hidden_state_layers``, then the ids checked (``check_capture_ids``).

    vLLM's own refusal of a stage-end id (flag on; raised after its mixin has set the ids
    and their PP slot layout) is taken over under the attn_res stream (``boundary.lifts``):
    ``check_capture_ids`` then serves it or refuses naming why. Any other error is vLLM's."""

    def _set_aux_hidden_state_layers(self, layers):
        try:
            own(self, layers)
        except ValueError as e:
            if not boundary.lifts(route, self, e):
                raise
        check_capture_ids(route, self)

    return _set_aux_hidden_state_layers
