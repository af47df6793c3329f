"""Write speculators-format drafter ``config.json`` fixtures with speculators' own classes.

Each ``tests/data/speculators/<format>/config.json`` (eagle3, peagle, dflash, dflash2,
dspark) is what ``speculators==0.9.0`` writes into a drafter checkpoint: the format's config
class built as ``speculators.train.cli`` and each model's ``from_training_args`` build it
(the CLI's defaults), the draft model class instantiated on it (tiny, random weights) and
``model.save_pretrained`` run; only config.json is kept, byte for byte (the model's save
sets ``architectures`` to the model class and adds ``dtype`` and ``tie_word_embeddings``).
The verifier is a tiny 8-layer Qwen3 named ``kimi-k3-tiny``, read from a local folder of
that name (nothing is fetched): the draft ``transformer_layer_config`` is speculators'
``create_transformer_layer_config`` of it (its ``num_hidden_layers`` is the DRAFT's depth),
and the aux layer ids pass ``resolve_target_layer_ids`` (id 8 == num_layers: dflash).
``transformers_version`` changes with the environment: comparisons drop ``VOLATILE_KEYS``.

Made with speculators 0.9.0 and transformers 5.24.0 (the project venv), speculators and
the modules it imports installed without their dependencies (its full install pins
transformers<=5.19.0 and brings CUDA torchvision/torchaudio that do not load here)::

    pip install --no-deps --target /tmp/spectarget speculators==0.9.0 datasets==5.1.0 \\
        pyarrow pandas python-dateutil xxhash multiprocess hs-connectors==0.9.0 \\
        pydantic-settings python-dotenv rich httpx loguru
    PYTHONPATH=/tmp/spectarget .venv/bin/python tools/make_speculators_configs.py [OUT_DIR]

``OUT_DIR`` defaults to ``tests/data/speculators``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

SPECULATORS_VERSION = "0.9.0"
VERIFIER_NAME = "kimi-k3-tiny"
VERIFIER_NUM_LAYERS = 8
FORMATS = ("eagle3", "peagle", "dflash", "dflash2", "dspark")
# aux (target) layer ids per format; dflash has one equal to VERIFIER_NUM_LAYERS.
LAYER_IDS = {
    "eagle3": [1, 4, 7],
    "peagle": [2, 4, 6],
    "dflash": [2, 5, 8],
    "dflash2": [1, 5],
    "dspark": [1, 3, 6],
}
VERIFIER_VOCAB_SIZE = 256
# a reduced draft vocab where speculators allows one; DFlash2DraftModel refuses any but the
# verifier's full vocab.
DRAFT_VOCAB_SIZE = {"eagle3": 128, "peagle": 128, "dflash": 128, "dflash2": 256, "dspark": 128}
MASK_TOKEN_ID = 255
VOLATILE_KEYS = ("transformers_version",)
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "speculators"


def strip_volatile(config: Any) -> Any:
    """``config`` (a loaded config.json) without the keys in ``VOLATILE_KEYS``, at any
    depth."""
    if isinstance(config, dict):
        return {k: strip_volatile(v) for k, v in config.items() if k not in VOLATILE_KEYS}
    if isinstance(config, list):
        return [strip_volatile(v) for v in config]
    return config


def _write_verifier(folder: Path) -> None:
    """A tiny 8-layer Qwen3 verifier config.json (what a hub id would resolve to)."""
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=VERIFIER_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=VERIFIER_NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(folder)


def _draft_layer_config(fmt: str):
    """The draft decoder config, as ``speculators train`` builds it with its defaults."""
    from speculators.train.cli import create_transformer_layer_config

    config = create_transformer_layer_config(
        verifier_name_or_path=VERIFIER_NAME,
        num_layers=1 if fmt in ("eagle3", "peagle") else 5,
        draft_arch="llama" if fmt == "eagle3" else "qwen3",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=[],
    )
    config._attn_implementation = "simple_flex_attention"  # as from_training_args does
    return config


def _build(fmt: str):
    """One speculators config object for ``fmt``, mirroring ``from_training_args``."""
    from speculators.models.utils import resolve_target_layer_ids

    layer_config = _draft_layer_config(fmt)
    layer_ids = resolve_target_layer_ids(LAYER_IDS[fmt], VERIFIER_NAME)
    if fmt in ("eagle3", "peagle"):
        return _eagle_config(fmt, layer_config, layer_ids)
    return _dflash_config(fmt, layer_config, layer_ids)


def _eagle_config(fmt: str, layer_config, layer_ids):
    """Eagle3 / PEagle: their ``DraftModel.from_training_args`` with the CLI's defaults."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3.config import Eagle3SpeculatorConfig
    from speculators.models.peagle.config import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    def speculators_config(speculative_tokens: int) -> SpeculatorsConfig:
        return SpeculatorsConfig(
            algorithm=fmt,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(VERIFIER_NAME),
        )

    if fmt == "eagle3":
        return Eagle3SpeculatorConfig(
            transformer_layer_config=layer_config,
            draft_vocab_size=DRAFT_VOCAB_SIZE[fmt],
            norm_before_residual=True,
            norm_before_fc=True,
            fc_norm=False,
            norm_output=True,
            embed_requires_grad=False,
            eagle_aux_hidden_state_layer_ids=layer_ids,
            speculators_config=speculators_config(3),  # ttt_steps
        )
    return PEagleSpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=DRAFT_VOCAB_SIZE[fmt],
        norm_before_residual=True,
        norm_before_fc=False,
        fc_norm=False,
        norm_output=False,
        eagle_aux_hidden_state_layer_ids=layer_ids,
        mask_token_id=MASK_TOKEN_ID,
        speculators_config=speculators_config(8),  # num_depths
    )


def _dflash_config(fmt: str, layer_config, layer_ids):
    """The dflash family: ``DFlashDraftModel._build_base_config_kwargs`` is the shared
    builder that DFlash, DFlash2 and DSpark's ``from_training_args`` use."""
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig
    from speculators.models.dspark.config import DSparkSpeculatorConfig

    base = DFlashDraftModel._build_base_config_kwargs(
        fmt,
        layer_config,
        verifier_name_or_path=VERIFIER_NAME,
        target_layer_ids=layer_ids,
        draft_vocab_size=DRAFT_VOCAB_SIZE[fmt],
        block_size=16 if fmt == "dflash" else 8,
        mask_token_id=MASK_TOKEN_ID,
        draft_attn_impl="simple_flex_attention",
    )
    if fmt == "dflash":
        return DFlashSpeculatorConfig(**base)
    if fmt == "dflash2":
        return DFlash2SpeculatorConfig(
            **base, conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16
        )
    if fmt == "dspark":
        return DSparkSpeculatorConfig(
            **base,
            markov_rank=256,
            markov_head_type="vanilla",
            enable_confidence_head=True,
            confidence_head_with_markov=True,
        )
    raise ValueError(f"make_speculators_configs: unknown format {fmt!r}; the formats: "
                     f"{FORMATS}")


def _model_class(fmt: str):
    """The speculators draft model class whose checkpoints carry ``fmt`` configs."""
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dflash2.core import DFlash2DraftModel
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.peagle.core import PEagleDraftModel

    return {
        "eagle3": Eagle3DraftModel,
        "peagle": PEagleDraftModel,
        "dflash": DFlashDraftModel,
        "dflash2": DFlash2DraftModel,
        "dspark": DSparkDraftModel,
    }[fmt]


def main(out_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write ``<out_dir>/<format>/config.json`` for every format; return their paths."""
    from importlib.metadata import version

    found = version("speculators")
    if found != SPECULATORS_VERSION:
        raise RuntimeError(f"speculators {SPECULATORS_VERSION} is needed, found {found}")
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT_DIR
    out = out.resolve()
    written: dict[str, Path] = {}
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        _write_verifier(Path(tmp) / VERIFIER_NAME)
        # speculators resolves the verifier by name: a folder of that name in the working
        # directory stands in for the hub id.
        os.chdir(tmp)
        try:
            for fmt in FORMATS:
                checkpoint = Path(tmp) / "checkpoints" / fmt
                _model_class(fmt)(config=_build(fmt)).save_pretrained(checkpoint)
                (out / fmt).mkdir(parents=True, exist_ok=True)
                written[fmt] = out / fmt / "config.json"
                shutil.copyfile(checkpoint / "config.json", written[fmt])
        finally:
            os.chdir(cwd)
    return written


if __name__ == "__main__":
    paths = main(sys.argv[1] if len(sys.argv) > 1 else None)
    for fmt, path in paths.items():
        data = json.loads(path.read_text())
        key = "eagle_aux_hidden_state_layer_ids" if "eagle" in fmt else "aux_hidden_state_layer_ids"
        print(f"{fmt}: {path} {key}={data.get(key)}")
