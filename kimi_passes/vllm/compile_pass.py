"""kimi_passes inside vLLM's compile pipeline: the pass manager as a vLLM ``InductorPass``.

vLLM compiles with its own backend and accepts one user post-grad pass, which
must be an instance of its ``InductorPass``::

    from kimi_passes.vllm import compile_config_entries
    CompilationConfig(inductor_compile_config=compile_config_entries(aux_stream="attn_res"))

Invariant: the pass vLLM runs is a ``KimiVllmPass`` whose ``uuid()`` is its manager's, so
vLLM keeps it unwrapped (no ``CallableInductorPass``, whose key hashes the class only) and
its caches key each stream, option and served drafter apart. ``attn_res_stream_pass`` and
``prefix_stream_pass`` are two such passes (fixed stream, default options), given to vLLM
as objects in ``inductor_compile_config`` or by name in ``inductor_passes``.

Names vLLM resolves. ``CompilationConfig(inductor_passes={PASS_KEY: "a.b.name"})`` (what
``vllm serve -cc '{"inductor_passes": ...}'`` builds) reads ``__import__("a.b").__dict__
["name"]``: it imports ``a.b``, then reads the last word from the *top* package's
``__dict__`` (``__import__`` returns the top package). ``import kimi_passes`` imports no
vLLM, and no module of ours writes into another's namespace, so the only names importing
``kimi_passes.<m>`` binds there are direct submodules: ``"kimi_passes.vllm.<name>"`` raises
``KeyError`` in a fresh process. Hence one top-level module per stream,
``kimi_passes.attn_res_stream_pass`` and ``kimi_passes.prefix_stream_pass``, each of which
puts the pass in its own place in ``sys.modules``. CPython's import returns, and binds on
the parent, what ``sys.modules`` holds for the name once the module has run
(``importlib._bootstrap._load_unlocked`` since 3.4; the language reference, "Loaders"),
so ``kimi_passes.attn_res_stream_pass`` is the pass itself and the name vLLM resolves is
``"kimi_passes.attn_res_stream_pass.attn_res_stream_pass"``: the module to import, then the
binding to read. (A module merely holding the pass would be read as the module, which vLLM
wraps in ``CallableInductorPass``.)

This module imports vLLM; ``import kimi_passes`` never imports it.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a process without vLLM
    raise ImportError(
        "kimi_passes.vllm needs vLLM: install it (`pip install vllm`; on this project's CPU "
        "CI `bash tools/install_vllm.sh`), or use kimi_passes.kimi_backend / "
        "kimi_passes.AuxStreamPass without vLLM"
    ) from e

import torch
from vllm.compilation.passes.inductor_pass import InductorPass
from vllm.config import get_current_vllm_config_or_none

from kimi_passes.config.drafter import DrafterTaps, drafter_capture_ids
from kimi_passes.config.pass_config import KimiPassConfig
from kimi_passes.config.stream import check_fixed
from kimi_passes.errors import AuxCaptureError
from kimi_passes.fx.manager import KimiPassManager
from kimi_passes.pipeline import pass_manager
from kimi_passes.taps.aux_stream import AuxStreamPass
from kimi_passes.vllm import versions
from kimi_passes.vllm.k3 import stream as k3_stream

log = logging.getLogger("vllm.kimi_passes")

#: The key vLLM reads the user's post-grad pass from.
PASS_KEY = "post_grad_custom_post_pass"

versions.warn_if_untested()  # the adapter's users never reach the route's register


class KimiVllmPass(InductorPass):
    """vLLM's ``InductorPass`` running the kimi pass manager for a ``KimiPassConfig``.

    ``uuid()`` is the manager's (every pass source and every option of the record, the
    drafter's capture ids included), so vLLM's compile cache and Inductor's FX graph cache
    never serve one stream's or one drafter's graph to another.

    The drafter: the record's when it was built from a ``draft_config``; else, with
    ``serve_drafter`` (the default), the one vLLM serves
    (``speculative_config.draft_model_config.hf_config``, read when vLLM compiles, when
    vLLM feeds that drafter aux hidden states), so the string route checks it too.
    """

    def __init__(self, config: KimiPassConfig | None = None, serve_drafter: bool = True):
        self.config = KimiPassConfig() if config is None else config
        self.serve_drafter = serve_drafter
        self.manager: KimiPassManager = pass_manager(self.config)
        #: The speculative config whose drafter's declaration was last checked (read once
        #: per config, not at each of vLLM's ``uuid()`` and piece calls).
        self._declaration_checked: object = _UNCHECKED

    @property
    def aux_stream(self) -> str:
        return self.config.aux_stream

    def _sync_drafter(self) -> None:
        """With ``serve_drafter``, check against the drafter vLLM serves now."""
        if not self.serve_drafter:
            return
        drafter = served_drafter()
        if drafter != getattr(self.manager.config, "drafter", None):
            self.manager = pass_manager(self.config.with_drafter(drafter))
        spec = getattr(get_current_vllm_config_or_none(), "speculative_config", None)
        if spec is not self._declaration_checked:
            _check_declaration(self.aux_stream, spec)
            self._declaration_checked = spec

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._sync_drafter()
        split_ops = _splitting_ops()
        marker_ops = [op for op in split_ops or () if op.split(".")[0] == "kimi::aux_tap"]
        if marker_ops:
            # The marker would run uncompiled in a piece of its own: the identity, so the
            # pass never sees it and every tap silently reads the running prefix.
            raise AuxCaptureError(
                f"kimi_passes: CompilationConfig.splitting_ops lists {marker_ops}: every "
                "aux tap marker then runs uncompiled in a piece of its own, where the pass "
                "never sees it, and the taps would silently read the running prefix "
                "(aliasing it as the next AttnRes call updates it in place). Remedy: "
                f"remove {marker_ops} from splitting_ops")
        self.manager.get(AuxStreamPass).split_ops = split_ops
        self.manager(graph)

    def uuid(self) -> str:
        self._sync_drafter()
        return self.manager.uuid()

    def is_applicable_for_range(self, compile_range) -> bool:
        return True

    def __deepcopy__(self, memo):
        # vLLM deep-copies its config; a fresh manager for the same record is equal.
        return KimiVllmPass(self.config, self.serve_drafter)

    def __repr__(self) -> str:
        served = ", serve_drafter=True" if self.serve_drafter else ""
        return f"KimiVllmPass({self.manager.config!r}{served})"


def served_drafter() -> DrafterTaps | None:
    """The capture ids of the drafter vLLM's current config serves, if it reads aux hidden
    states (as vLLM decides it: ``versions.drafter_reads_aux``)."""
    config = get_current_vllm_config_or_none()
    spec = getattr(config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    method = getattr(spec, "method", None)
    if draft is None or not versions.drafter_reads_aux(spec):
        return None
    target = getattr(getattr(config, "model_config", None), "hf_config", None)
    num_layers = getattr(target, "num_hidden_layers", None)
    return drafter_capture_ids(
        draft.hf_config, num_layers if isinstance(num_layers, int) else None,
        source=f"vLLM serves ({method}: speculative_config.draft_model_config.hf_config)")


def _check_declaration(stream: str, spec) -> None:
    """The declared stream of ``spec``'s drafter (read from its checkpoint, as the K3 route
    reads it) against ``stream``: refused unless an A/B run, which is warned."""
    warning = check_fixed(stream, "this KimiVllmPass", k3_stream.drafter(spec))
    if warning:
        log.warning("%s", warning)


_UNCHECKED = object()


def _splitting_ops() -> tuple[str, ...] | None:
    """The ops vLLM split the graph at, when it compiles it piecewise (None: one graph)."""
    config = get_current_vllm_config_or_none()  # None outside a vLLM compile
    if config is None:
        return None
    cc = config.compilation_config
    if cc.use_inductor_graph_partition or not cc.splitting_ops:
        return None
    return tuple(cc.splitting_ops)


def make_vllm_pass(aux_stream: str | None = None, **options) -> KimiVllmPass:
    """The kimi passes as vLLM's ``post_grad_custom_post_pass``.

    The options are ``KimiPassConfig``'s, resolved once, here (the stream as for
    ``make_kimi_backend``). Without a ``draft_config`` the pass checks the drafter vLLM
    serves.
    """
    config = KimiPassConfig.build(aux_stream=aux_stream, **options)
    return KimiVllmPass(config, serve_drafter=options.get("draft_config") is None)


def compile_config_entries(aux_stream: str | None = None, **options) -> dict[str, Any]:
    """The ``CompilationConfig.inductor_compile_config`` entries to add, as a dict."""
    return {PASS_KEY: make_vllm_pass(aux_stream, **options)}


#: The pass for each stream with default options (see the module docstring).
attn_res_stream_pass = KimiVllmPass(KimiPassConfig(aux_stream="attn_res"))
prefix_stream_pass = KimiVllmPass(KimiPassConfig(aux_stream="prefix"))
