"""``drafter_capture_ids``: every spelling of a drafter's layer list, against vLLM's readers.

The resolver's own cases (each spelling, its convention, the errors), then a differential
test against the real vLLM code where vLLM is installed (CI installs it): each of the
installed vLLM's readers (``eagle3_utils.get_eagle3_aux_layers_from_config``; on vLLM
0.33.0 also ``GPUModelRunner._get_eagle3_aux_layers_from_config``, whose module 0.34.0
removed) and its speculators converter (``algos.py``), on configs holding one spelling and
on configs holding two.
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

#: vLLM's readers of a drafter's layer list, by the vLLM releases that have them: the
#: V1 runner (``gpu_model_runner``, a module vLLM 0.34.0 removed) is 0.33.0's only.
READERS = {"eagle3_utils": ((0, 33), (0, 34)), "gpu_model_runner": ((0, 33),)}
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def _installed_readers() -> tuple[str, ...]:
    """The readers the installed vLLM has (``READERS``, by its release)."""
    from kimi_passes.vllm.versions import installed_version, release

    minor = release(installed_version())[:2]
    return tuple(name for name, releases in READERS.items() if minor in releases)


def _vllm_readers(config: dict) -> dict[str, tuple[int, ...] | None]:
    """The ids each of the installed vLLM's readers takes from a drafter whose hf_config
    is ``config``."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    hf = types.SimpleNamespace(**copy.deepcopy(config))
    spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf))
    read = {"eagle3_utils": get_eagle3_aux_layers_from_config(spec)}
    if "gpu_model_runner" in _installed_readers():
        runner = importlib.import_module(RUNNER_MODULE).GPUModelRunner
        read["gpu_model_runner"] = runner._get_eagle3_aux_layers_from_config(
            types.SimpleNamespace(speculative_config=spec))
    return read


@pytest.mark.vllm
def test_the_installed_vllms_readers():
    """The V1 runner's module exists exactly where ``READERS`` says it reads."""
    has_runner = importlib.util.find_spec(RUNNER_MODULE) is not None
    assert has_runner == ("gpu_model_runner" in _installed_readers())


@pytest.mark.vllm
@pytest.mark.parametrize("config", [s[0] for s in SPELLINGS if "speculators_model_type"
                                    not in s[0]], ids=lambda c: next(iter(c)))
def test_one_spelling_matches_vllm(config):
    """Every vLLM reader that reads the spelling reads the resolver's ids; one that does
    not (it falls back to the model's default layers; which read which is
    ``VLLM_KNOWS``) leaves the compile-time check to name the mismatch."""
    read = set(_vllm_readers(config).values())
    ours = drafter_capture_ids(config).capture_ids
    assert read - {None} <= {ours}, (read, ours)


# Which spellings each reader knows (vLLM 0.33.0 and 0.34.0, read from their code): the
# record the closing note and README give. A change in vLLM shows here.
VLLM_KNOWS = {
    "eagle3_utils": {"eagle_aux_hidden_state_layer_ids", "eagle_config.layer_ids",
                     "dflash_config.target_layer_ids", "dflash_config.layer_ids",
                     "dspark_target_layer_ids", "target_layer_ids"},
    "gpu_model_runner": {"eagle_aux_hidden_state_layer_ids",
                         "eagle_config.eagle_aux_hidden_state_layer_ids",
                         "dflash_config.target_layer_ids"},
}


@pytest.mark.vllm
def test_which_vllm_reader_knows_which_spelling():
    seen: dict[str, set[str]] = {name: set() for name in _installed_readers()}
    for config, ids, key, *_ in SPELLINGS:
        if "speculators_model_type" in config or "model_type" in config:
            continue
        for name, got in _vllm_readers(config).items():
            if got == ids:
                seen[name].add(key)
    assert seen == {name: VLLM_KNOWS[name] for name in _installed_readers()}


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
    read = _vllm_readers(config)
    try:
        ours = drafter_capture_ids(config).capture_ids
    except ValueError as e:
        assert "disagree" in str(e)
        return
    # Resolved: every reader that read a list read these ids.
    assert all(r == ours for r in read.values() if r is not None), (read, ours)


@pytest.mark.vllm
@pytest.mark.parametrize("kind,raw_key", [("eagle3", "eagle_aux_hidden_state_layer_ids"),
                                          ("peagle", "eagle_aux_hidden_state_layer_ids"),
                                          ("dflash", "aux_hidden_state_layer_ids"),
                                          ("dflash2", "aux_hidden_state_layer_ids"),
                                          ("dspark", "aux_hidden_state_layer_ids")])
def test_speculators_raw_as_vllm_converts_it(kind, raw_key):
    """A raw speculators config reads as vLLM's algos.py converts it, and every reader
    agrees; P-EAGLE, which vLLM 0.34.0 refuses, is refused there."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    raw = {"speculators_model_type": kind, raw_key: [1, 4, 8], "mask_token_id": 0,
           "transformer_layer_config": {"model_type": "llama"}}
    converted = copy.deepcopy(raw["transformer_layer_config"])
    with _refused_where_vllm_refuses(kind):
        SUPPORTED_SPECULATORS_TYPES[kind](copy.deepcopy(raw), converted)
    if not _vllm_serves(kind):
        return
    read = _vllm_readers(converted)
    assert drafter_capture_ids(raw).capture_ids == drafter_capture_ids(converted).capture_ids
    assert drafter_capture_ids(converted).capture_ids == (1, 4, 8)
    assert set(read.values()) == {(1, 4, 8)}, read


#: The first vLLM release that refuses P-EAGLE speculators configs (0.33.0 converts them).
PEAGLE_REFUSED_FROM = (0, 34)


def _vllm_serves(kind: str) -> bool:
    """Whether the installed vLLM converts speculators format ``kind``."""
    from kimi_passes.vllm.versions import installed_version, release

    return kind != "peagle" or release(installed_version())[:2] < PEAGLE_REFUSED_FROM


def _refused_where_vllm_refuses(kind: str):
    """A context expecting vLLM's refusal of ``kind`` where it refuses it (else none)."""
    import contextlib

    if _vllm_serves(kind):
        return contextlib.nullcontext()
    return pytest.raises(ValueError, match=r"P-EAGLE \(parallel drafting EAGLE-3\) is not "
                                           "supported")


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
    with _refused_where_vllm_refuses(fmt):
        converted = SpeculatorsConfig.extract_transformers_pre_trained_config(
            copy.deepcopy(raw))
    if not _vllm_serves(fmt):
        return
    assert set(_vllm_readers(converted).values()) == {SPECULATORS_IDS[fmt]}
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
