"""``drafter_capture_ids``: every spelling of a drafter's layer list, against vLLM's readers.

The resolver's own cases (each spelling, its convention, the errors), then a differential
test against the real vLLM code where vLLM is installed (CI installs it): both of vLLM's
readers (``eagle3_utils.get_eagle3_aux_layers_from_config`` and
``GPUModelRunner._get_eagle3_aux_layers_from_config``) and its speculators converter
(``algos.py``), on configs holding one spelling and on configs holding two.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from kimi_passes import drafter_capture_ids
from kimi_passes.config.drafter import AS_IS, PLUS_ONE

# (config, capture ids, key, convention, format): one spelling each.
SPELLINGS = [
    ({"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}, (1, 4, 7),
     "eagle_aux_hidden_state_layer_ids", AS_IS, "eagle3"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5]}}, (2, 5),
     "eagle_config.eagle_aux_hidden_state_layer_ids", AS_IS, "eagle3"),
    ({"eagle_config": {"layer_ids": [0, 3]}}, (0, 3), "eagle_config.layer_ids", AS_IS,
     "eagle3"),
    ({"dflash_config": {"target_layer_ids": [1, 4, 7]}}, (2, 5, 8),
     "dflash_config.target_layer_ids", PLUS_ONE, "dflash"),
    ({"dflash_config": {"layer_ids": [2, 6]}}, (2, 6), "dflash_config.layer_ids", AS_IS,
     "dflash"),
    ({"dspark_target_layer_ids": [0, 3, 6]}, (1, 4, 7), "dspark_target_layer_ids", PLUS_ONE,
     "dspark"),
    ({"dspark_target_layer_ids": [1, 3, 6], "model_type": "deepseek_v41"}, (1, 3, 6),
     "dspark_target_layer_ids", AS_IS, "dspark"),
    ({"target_layer_ids": [1, 2]}, (2, 3), "target_layer_ids", PLUS_ONE, "dspark"),
    ({"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 5, 8]},
     (2, 5, 8), "aux_hidden_state_layer_ids (speculators dflash)", AS_IS, "dflash"),
    ({"speculators_model_type": "dflash2", "aux_hidden_state_layer_ids": [1, 5]},
     (1, 5), "aux_hidden_state_layer_ids (speculators dflash2)", AS_IS, "dflash"),
    ({"speculators_model_type": "dspark", "aux_hidden_state_layer_ids": [1, 3, 6]},
     (1, 3, 6), "aux_hidden_state_layer_ids (speculators dspark)", AS_IS, "dspark"),
]


@pytest.mark.parametrize("config,ids,key,convention,fmt", SPELLINGS,
                         ids=[s[2] + ("/v41" if "model_type" in s[0] else "") for s in SPELLINGS])
def test_each_spelling(config, ids, key, convention, fmt):
    got = drafter_capture_ids(config)
    assert (got.capture_ids, got.key, got.convention, got.format) == (ids, key, convention, fmt)
    assert got.final_state_separate == (fmt == "dflash")


def test_no_layer_list_declares_nothing():
    assert drafter_capture_ids(None) is None
    assert drafter_capture_ids({"aux_hidden_stream": "attn_res"}) is None
    # vLLM reads an empty list or null as absent (`if not layer_ids`): so does the resolver.
    assert drafter_capture_ids({"eagle_aux_hidden_state_layer_ids": []}) is None
    got = drafter_capture_ids({"eagle_aux_hidden_state_layer_ids": None,
                               "dflash_config": {"target_layer_ids": [0]}})
    assert got.capture_ids == (1,)


def test_order_is_kept():
    # The drafter concatenates its aux states in the config's order.
    assert drafter_capture_ids({"eagle_aux_hidden_state_layer_ids": [7, 1, 4]}).capture_ids == (
        7, 1, 4)


def test_agreeing_spellings_name_every_key():
    # What vLLM's algos.py writes for a speculators DFlash: both spellings, which agree.
    got = drafter_capture_ids({"eagle_aux_hidden_state_layer_ids": [2, 5],
                               "dflash_config": {"target_layer_ids": [1, 4]}})
    assert got.capture_ids == (2, 5)
    assert got.key == "eagle_aux_hidden_state_layer_ids = dflash_config.target_layer_ids"
    assert got.format == "dflash"


def test_file_folder_and_config_object(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"target_layer_ids": [0, 2]}))
    for where in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        got = drafter_capture_ids(where)
        assert got.capture_ids == (1, 3) and str(tmp_path) in got.source
    hf = types.SimpleNamespace(to_dict=lambda: {"eagle_aux_hidden_state_layer_ids": [3]})
    assert drafter_capture_ids(hf).capture_ids == (3,)


ERRORS = [
    ({"eagle_aux_hidden_state_layer_ids": [2, 5], "dflash_config": {"target_layer_ids": [2, 5]}},
     r"spells its layer list twice and the two disagree: eagle_aux_hidden_state_layer_ids "
     r"\(capture ids, used as they are\) gives capture ids \[2, 5\], "
     r"dflash_config.target_layer_ids \(layer ids, capture id = layer id \+ 1\) gives \[3, 6\]"),
    # gpu_model_runner lets eagle_config override dflash_config; here it is an error.
    ({"dflash_config": {"target_layer_ids": [1]},
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1]}}, r"disagree"),
    ({"eagle_aux_hidden_state_layer_ids": "1,2"},
     r"eagle_aux_hidden_state_layer_ids in the drafter config a dict must be a list of ints, "
     r"got '1,2'"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2.0]}, r"must be a list of ints, got \[1, 2\.0\]"),
    ({"eagle_aux_hidden_state_layer_ids": [True]}, r"must be a list of ints, got \[True\]"),
    ({"target_layer_ids": [3, 1, 3]}, r"target_layer_ids .* names \[3\] more than once"),
    ({"eagle_aux_hidden_state_layer_ids": [-1, 2]},
     r"holds \[-1\], below 0 \(capture ids, used as they are: capture id 0 is the embedding\)"),
    ({"dflash_config": {"target_layer_ids": [-2]}},
     r"dflash_config.target_layer_ids .* holds \[-2\], below -1 \(layer ids"),
    ({"dflash_config": [1, 2]}, r"dflash_config in the drafter config a dict must be a JSON "
     r"object, got list"),
    ({"aux_hidden_state_layer_ids": [1, 2]},
     r"has aux_hidden_state_layer_ids but no speculators_model_type, so its id convention is "
     r"unknown"),
    ({"aux_hidden_state_layer_ids": [1], "speculators_model_type": "eagle3"},
     r"speculators_model_type='eagle3', so its id convention is unknown"),
]


@pytest.mark.parametrize("config,match", ERRORS, ids=range(len(ERRORS)))
def test_errors_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        drafter_capture_ids(config)


def test_above_num_layers():
    with pytest.raises(ValueError, match=r"gives capture ids \[9\] beyond the target's "
                                         r"num_layers=8"):
        drafter_capture_ids({"dflash_config": {"target_layer_ids": [1, 8]}}, num_layers=8)
    assert drafter_capture_ids({"eagle_aux_hidden_state_layer_ids": [8]}, 8).capture_ids == (8,)


# --------------------------------------------------------------------------- vLLM's readers

def _vllm_readers(config: dict):
    """The ids vLLM 0.33.0's two readers take from a drafter whose hf_config is ``config``."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hf = types.SimpleNamespace(**copy.deepcopy(config))
    spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf))
    runner = types.SimpleNamespace(speculative_config=spec)
    return (get_eagle3_aux_layers_from_config(spec),
            GPUModelRunner._get_eagle3_aux_layers_from_config(runner))


@pytest.mark.vllm
@pytest.mark.parametrize("config", [s[0] for s in SPELLINGS if "speculators_model_type"
                                    not in s[0]], ids=lambda c: next(iter(c)))
def test_one_spelling_matches_vllm(config):
    """Where vLLM's two readers agree, the resolver gives their ids; where one of them does
    not read the spelling (it falls back to the model's default layers), the resolver gives
    the ids of the one that does, and the compile-time check then names the mismatch."""
    utils, runner = _vllm_readers(config)
    ours = drafter_capture_ids(config).capture_ids
    if utils == runner:
        assert ours == utils
    else:
        read = [r for r in (utils, runner) if r is not None]
        assert read == [ours], (utils, runner, ours)


# Which spellings each reader knows (vLLM 0.33.0, read from its code): the record the
# closing note and README give. A change in vLLM shows here.
VLLM_KNOWS = {
    "eagle_aux_hidden_state_layer_ids": (True, True),
    "eagle_config.eagle_aux_hidden_state_layer_ids": (False, True),
    "eagle_config.layer_ids": (True, False),
    "dflash_config.target_layer_ids": (True, True),
    "dflash_config.layer_ids": (True, False),
    "dspark_target_layer_ids": (True, False),
    "target_layer_ids": (True, False),
}


@pytest.mark.vllm
def test_which_vllm_reader_knows_which_spelling():
    seen = {}
    for config, ids, key, *_ in SPELLINGS:
        if "speculators_model_type" in config or "model_type" in config:
            continue
        utils, runner = _vllm_readers(config)
        seen[key] = (utils == ids, runner == ids)
    assert seen == VLLM_KNOWS


TWO_SPELLINGS = [
    # The same ids twice (what algos.py writes): one answer everywhere.
    {"eagle_aux_hidden_state_layer_ids": [2, 5], "dflash_config": {"target_layer_ids": [1, 4]}},
    {"eagle_aux_hidden_state_layer_ids": [2, 5], "target_layer_ids": [1, 4]},
    # Disagreeing: vLLM takes one silently (and its two readers may take different ones).
    {"eagle_aux_hidden_state_layer_ids": [2, 5], "dflash_config": {"target_layer_ids": [2, 5]}},
    {"dflash_config": {"target_layer_ids": [1, 4]},
     "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4]}},
    {"dflash_config": {"target_layer_ids": [1, 4]}, "eagle_config": {"use_aux_hidden_state": True}},
    {"dspark_target_layer_ids": [1], "target_layer_ids": [2]},
]


@pytest.mark.vllm
@pytest.mark.parametrize("config", TWO_SPELLINGS, ids=range(len(TWO_SPELLINGS)))
def test_two_spellings_against_vllm(config):
    """Agreeing spellings give vLLM's ids; disagreeing ones are an error, never a pick."""
    utils, runner = _vllm_readers(config)
    try:
        ours = drafter_capture_ids(config).capture_ids
    except ValueError as e:
        assert "disagree" in str(e)
        return
    # Resolved: every reader that read a list read these ids.
    assert all(r == ours for r in (utils, runner) if r is not None), (utils, runner, ours)


@pytest.mark.vllm
@pytest.mark.parametrize("kind,raw_key", [("eagle3", "eagle_aux_hidden_state_layer_ids"),
                                          ("peagle", "eagle_aux_hidden_state_layer_ids"),
                                          ("dflash", "aux_hidden_state_layer_ids"),
                                          ("dflash2", "aux_hidden_state_layer_ids"),
                                          ("dspark", "aux_hidden_state_layer_ids")])
def test_speculators_raw_as_vllm_converts_it(kind, raw_key):
    """A raw speculators config reads as vLLM's algos.py converts it, and both readers agree."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    raw = {"speculators_model_type": kind, raw_key: [1, 4, 8], "mask_token_id": 0,
           "transformer_layer_config": {"model_type": "llama"}}
    converted = copy.deepcopy(raw["transformer_layer_config"])
    SUPPORTED_SPECULATORS_TYPES[kind](copy.deepcopy(raw), converted)
    utils, runner = _vllm_readers(converted)
    assert drafter_capture_ids(raw).capture_ids == drafter_capture_ids(converted).capture_ids
    assert drafter_capture_ids(converted).capture_ids == (1, 4, 8)
    if kind in ("eagle3", "peagle", "dflash", "dflash2"):
        assert utils == runner == (1, 4, 8)
    else:  # dspark: the runner vLLM's CPU path inherits does read eagle_aux... too
        assert utils == (1, 4, 8) and runner == (1, 4, 8)


# --------------------------------------------------------------------------- speculators

SPECULATORS = Path(__file__).resolve().parent / "data" / "speculators"
# The ids each checked-in file declares (tools/make_speculators_configs.py wrote them with
# speculators 0.9.0's own classes, for an 8-layer verifier).
SPECULATORS_IDS = {"eagle3": (1, 4, 7), "peagle": (2, 4, 6), "dflash": (2, 5, 8),
                   "dflash2": (1, 5), "dspark": (1, 3, 6)}


@pytest.mark.parametrize("fmt", sorted(SPECULATORS_IDS))
def test_speculators_written_configs(fmt):
    got = drafter_capture_ids(SPECULATORS / fmt, num_layers=8)
    assert got.capture_ids == SPECULATORS_IDS[fmt]
    assert got.final_state_separate == fmt.startswith("dflash")


@pytest.mark.vllm
@pytest.mark.parametrize("fmt", sorted(SPECULATORS_IDS))
def test_speculators_written_configs_as_vllm_loads_them(fmt):
    """vLLM's SpeculatorsConfig conversion, then its readers: the same ids as the raw file."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = json.loads((SPECULATORS / fmt / "config.json").read_text())
    converted = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(raw))
    utils, runner = _vllm_readers(converted)
    assert utils == runner == SPECULATORS_IDS[fmt]
    assert drafter_capture_ids(converted).capture_ids == SPECULATORS_IDS[fmt]


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                    reason="speculators is not installed: its full install brings CUDA builds "
                           "of torchvision/torchaudio that do not load next to CPU torch; "
                           "tools/make_speculators_configs.py says how to install it to "
                           "regenerate the files")
def test_speculators_files_regenerate(tmp_path):
    """With speculators importable, its classes write the checked-in files again."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        import make_speculators_configs as make
    finally:
        sys.path.pop(0)
    written = make.main(tmp_path)
    for fmt, path in written.items():
        new = make.strip_volatile(json.loads(Path(path).read_text()))
        old = make.strip_volatile(json.loads((SPECULATORS / fmt / "config.json").read_text()))
        assert new == old, fmt
