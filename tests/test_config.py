"""ModelConfig and LayerPlan (dsv41_decode.config): the V4.1-Flash plan, presets, key styles, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv41_decode.config import (
    FULL, KINDS, PRESETS, REINDEX, REUSE, SWA, ConfigError, LayerPlan, ModelConfig,
)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FLASH_OFFICIAL = SHARED / "configs" / "deepseek-v4.1-flash.inference.json"
FLASH_HF = SHARED / "configs" / "deepseek-v4.1-flash.config.json"


def _needs(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"{path} not found (../shared is absent)")
    return path


def _official_tiny_config() -> Path:
    for p in (REPO / "tests" / "data" / "official-tiny" / "config.json",
              SHARED / "oracle" / "official-tiny" / "config.json"):
        if p.is_file():
            return p
    pytest.skip("official-tiny config.json not found (tests/data or ../shared/oracle)")


# The V4.1-Flash plan written out by hand (spec section 2), one tuple per layer:
# (layer, kind, ratio, kv_source, index_source, candidate_role).
def _flash_expected() -> list[tuple]:
    rows: list[tuple] = [(0, SWA, 0, None, None, None), (1, SWA, 0, None, None, None)]
    for src in (2, 8, 14):  # ratio-2 Full layers, each followed by five Reuse layers
        rows.append((src, FULL, 2, src, src, None))
        rows += [(i, REUSE, 2, src, src, None) for i in range(src + 1, src + 6)]
    rows.append((20, FULL, 1, 20, 20, "source"))  # ratio-1 Full: the candidate source
    rows += [(i, REUSE, 1, 20, 20, None) for i in (21, 22, 23)]
    for c in (24, 28, 32, 36):  # Reindex consumers, each followed by three Reuse layers
        rows.append((c, REINDEX, 1, 20, c, "consumer"))
        rows += [(i, REUSE, 1, 20, c, None) for i in range(c + 1, c + 4)]
    return rows


def _plan_rows(cfg: ModelConfig) -> list[tuple]:
    return [(s.layer, s.kind, s.ratio, s.kv_source, s.index_source, s.candidate_role)
            for s in cfg.plan]


def _flash_hf_dict() -> dict:
    """The V4.1-Flash config in the Hugging Face key style, written out here (no file needed)."""
    return {
        "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "index_n_heads": 32,
        "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-20, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-06,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    }


def _raises(field: str, fn, *args, **kw) -> str:
    """Call fn, expect a ConfigError whose message starts with (names) `field`; return the message."""
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert msg.startswith(f"{field}:"), f"message does not start with {field!r}: {msg}"
    return msg


def _raises_saying(text: str, fn, *args, **kw) -> str:
    """Call fn, expect a ConfigError whose message holds `text` (a config-wide error: an unknown
    preset, missing keys); return the message."""
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert text in msg, f"message does not say {text!r}: {msg}"
    return msg


# ----- the V4.1-Flash plan -----

def _check_flash(cfg: ModelConfig) -> None:
    assert cfg.n_layers == 40
    assert len(cfg.compress_ratios) == 40  # the 3 MTP entries are not part of the attention stack
    assert cfg.n_mtp_layers == 3
    assert len(cfg.plan) == 40
    assert _plan_rows(cfg) == _flash_expected()


def test_flash_preset_plan():
    _check_flash(ModelConfig.preset("v41-flash"))


def test_flash_plan_spot_checks():
    plan = ModelConfig.preset("v41-flash").plan
    for layer, kv, idx in ((9, 8, 8), (25, 20, 24), (39, 20, 36), (19, 14, 14), (23, 20, 20)):
        assert (plan[layer].kind, plan[layer].kv_source, plan[layer].index_source) == \
            (REUSE, kv, idx), layer
    assert [s.layer for s in plan if s.kind == SWA] == [0, 1]
    assert [s.layer for s in plan if s.kind == FULL] == [2, 8, 14, 20]
    assert [s.layer for s in plan if s.kind == REINDEX] == [24, 28, 32, 36]
    assert [s.layer for s in plan if s.candidate_role == "consumer"] == [24, 28, 32, 36]
    assert [s.layer for s in plan if s.candidate_role == "source"] == [20]
    assert [s.ratio for s in plan if s.kind == FULL] == [2, 2, 2, 1]


def test_layer_spec_roles():
    plan = ModelConfig.preset("v41-flash").plan
    assert [s.layer for s in plan if s.owns_compressor] == [2, 8, 14, 20]
    assert [s.layer for s in plan if s.runs_indexer] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert plan[20].label == "full+cand" and plan[24].label == "reindex" and plan[0].label == "swa"
    assert len(plan.summary().splitlines()) == 40


def test_flash_official_file_plan():
    cfg = ModelConfig.from_json(_needs(FLASH_OFFICIAL))
    _check_flash(cfg)
    assert cfg == ModelConfig.preset("v41-flash")
    assert cfg.vocab_size == 129280


def test_flash_hf_file_equals_official_except_vocab():
    off = ModelConfig.from_json(_needs(FLASH_OFFICIAL))
    hf = ModelConfig.from_json(_needs(FLASH_HF))
    _check_flash(hf)
    assert hf.vocab_size != off.vocab_size  # the HF file carries no vocab_size
    assert hf.replace(vocab_size=off.vocab_size) == off


def test_flash_hf_dict_equals_preset_except_vocab():
    hf = ModelConfig.from_dict(_flash_hf_dict())
    _check_flash(hf)
    flash = ModelConfig.preset("v41-flash")
    assert hf.replace(vocab_size=flash.vocab_size) == flash
    assert ModelConfig.from_dict(dict(_flash_hf_dict(), vocab_size=129280)) == flash


def test_flash_derived_sizes():
    cfg = ModelConfig.preset("v41-flash")
    assert cfg.heads_per_group == 8
    assert cfg.nope_dim == 448
    assert cfg.softmax_scale == 512 ** -0.5
    assert cfg.ratio(2) == 2 and cfg.ratio(20) == 1 and cfg.ratio(0) == 0


# ----- presets and loading -----

def test_tiny_preset_equals_official_tiny_config():
    assert ModelConfig.preset("tiny") == ModelConfig.from_json(_official_tiny_config())


def test_tiny_preset_has_one_layer_of_each_kind():
    plan = ModelConfig.preset("tiny").plan
    assert {s.kind for s in plan} == set(KINDS)
    assert {s.candidate_role for s in plan} == {None, "source", "consumer"}


def test_small_preset_has_every_kind():
    cfg = ModelConfig.preset("small")
    plan = cfg.plan
    assert {s.kind for s in plan} == set(KINDS)
    kinds_by_ratio = {(s.kind, s.ratio) for s in plan}
    for need in ((SWA, 0), (FULL, 2), (REUSE, 2), (FULL, 1), (REUSE, 1), (REINDEX, 1)):
        assert need in kinds_by_ratio, need
    sources = [s for s in plan if s.candidate_role == "source"]
    assert len(sources) == 1 and sources[0].kind == FULL and sources[0].ratio == 1
    consumers = [s for s in plan if s.candidate_role == "consumer"]
    assert len(consumers) >= 2 and all(s.kv_source == sources[0].layer for s in consumers)
    # Reuse layers that read a Reindex layer's top-k, not only a Full layer's
    assert any(s.kind == REUSE and plan[s.index_source].kind == REINDEX for s in plan)
    assert cfg.window_size < cfg.max_seq_len and cfg.index_topk < cfg.max_seq_len


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_dict_and_json(name, tmp_path):
    cfg = ModelConfig.preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert ModelConfig.from_json(tmp_path / "config.json") == cfg
    assert ModelConfig.load(tmp_path) == cfg  # a directory holding a config.json
    assert ModelConfig.load(name) == cfg
    assert isinstance(cfg.plan, LayerPlan)


def test_load_errors(tmp_path):
    _raises_saying("unknown preset 'nope'", ModelConfig.preset, "nope")
    _raises_saying("no config file at", ModelConfig.from_json, tmp_path / "absent.json")
    (tmp_path / "config.json").write_text("{not json")
    _raises_saying("config.json: not valid JSON", ModelConfig.from_json, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xa0\x01\xff\xfe binary")
    _raises_saying("model.safetensors: not a text file", ModelConfig.load, tmp_path / "model.safetensors")
    _raises_saying("config 'smal': not a preset (v41-flash, tiny, small) and no such file or folder",
                   ModelConfig.load, "smal")
    assert issubclass(ConfigError, ValueError)


# ----- invalid configs name the field -----

@pytest.fixture
def flash() -> ModelConfig:
    return ModelConfig.preset("v41-flash")


def _ratios(flash: ModelConfig, **at: int) -> tuple[int, ...]:
    r = list(flash.compress_ratios)
    for k, v in at.items():
        r[int(k.lstrip("l"))] = v
    return tuple(r)


def test_unknown_ratio(flash):
    msg = _raises("compress_ratios", flash.replace, compress_ratios=_ratios(flash, l5=3))
    assert "3" in msg


def test_compress_ratios_length(flash):
    _raises("compress_ratios", flash.replace, compress_ratios=flash.compress_ratios[:39])
    d = flash.to_dict()
    d["compress_ratios"] = d["compress_ratios"][:39]
    _raises("compress_ratios", ModelConfig.from_dict, d)


@pytest.mark.parametrize("bad", [40, 57, -1])
def test_kv_source_out_of_range(flash, bad):
    ids = tuple(sorted((2, 8, 14, 20, bad)))
    msg = _raises("kv_source_layers", flash.replace, kv_source_layers=ids)
    assert str(bad) in msg


def test_index_source_out_of_range(flash):
    _raises("index_source_layers", flash.replace,
            index_source_layers=flash.index_source_layers + (40,))


def test_kv_source_on_swa_layer(flash):
    msg = _raises("kv_source_layers", flash.replace, kv_source_layers=(1, 2, 8, 14, 20),
                  index_source_layers=(1,) + flash.index_source_layers)
    assert "layer 1" in msg


def test_kv_sources_not_increasing(flash):
    _raises("kv_source_layers", flash.replace, kv_source_layers=(2, 14, 8, 20))


def test_layer_ratio_differs_from_its_kv_source(flash):
    msg = _raises("kv_source_layers", flash.replace, compress_ratios=_ratios(flash, l9=1))
    assert "layer 9" in msg and "8" in msg
    # a ratio-1 layer whose nearest KV source is a ratio-2 one
    msg = _raises("kv_source_layers", flash.replace, kv_source_layers=(2, 8, 14),
                  index_source_layers=(2, 8, 14), candidate_source_layer=None)
    assert "layer 20" in msg


def test_compressed_layer_without_kv_source(flash):
    _raises("kv_source_layers", flash.replace, compress_ratios=_ratios(flash, l1=2))


def test_kv_source_must_be_an_index_source(flash):
    _raises("index_source_layers", flash.replace, index_source_layers=(2, 8, 20, 24, 28, 32, 36))


def test_candidate_source_must_be_a_kv_source(flash):
    _raises("candidate_source_layer", flash.replace, candidate_source_layer=21)


def test_reindex_layer_needs_the_candidate_source(flash):
    # a Reindex layer in a ratio-2 run (its KV source is not the candidate source)
    _raises("index_source_layers", flash.replace,
            index_source_layers=(2, 8, 10, 14, 20, 24, 28, 32, 36))
    _raises("index_source_layers", flash.replace, candidate_source_layer=None)


def test_heads_not_divisible_by_groups(flash):
    msg = _raises("n_heads", flash.replace, o_groups=6)
    assert "o_groups" in msg


def test_check_tp(flash):
    flash.check_tp(1)
    flash.check_tp(8)
    msg = _raises("n_heads", flash.check_tp, 3)
    assert "tp=3" in msg
    _raises("o_groups", flash.check_tp, 16)  # 64 heads split over 16 ranks, 8 groups do not
    _raises("tp", flash.check_tp, 0)


@pytest.mark.parametrize("field,value,rule", [
    ("dim", 0, "must be a positive integer"), ("n_heads", -4, "must be a positive integer"),
    ("index_topk", 0, "must be a positive integer"), ("window_size", 0, "must be a positive integer"),
    ("hc_mult", 3, "assumes 4 streams"), ("head_dim", 256, "assume 512"), ("rope_head_dim", 32, "assumes 64"),
    ("index_head_dim", 64, "assumes 128"), ("dim", 5121, "must be a multiple of 32"),
    ("q_lora_rank", 1290, "must be a multiple of 32"), ("rope_factor", 0.5, "must be >= 1"),
    ("n_layers", True, "must be a positive integer"),
    ("original_seq_len", "65536", "must be a non-negative integer"), ("original_seq_len", -1, "non-negative"),
    ("beta_fast", float("nan"), "must be a finite number"), ("beta_slow", float("inf"), "finite"),
    ("candidate_source_layer", 20.0, "must be a layer id or null"),
    ("o_lora_rank", 48, "must be a multiple of 32"), ("candidate_block_size", 1, "must be >= 2"),
])
def test_bad_scalar_fields(flash, field, value, rule):
    assert rule in _raises(field, flash.replace, **{field: value})


@pytest.mark.parametrize("field,value", [
    ("compress_ratios", 2), ("compress_ratios", [0, 2.5, 2, 1, 1, 1, 1]), ("compress_ratios", ["0"] * 7),
    ("kv_source_layers", 1), ("kv_source_layers", [1.5, 3]), ("index_source_layers", [1, 3, True]),
])
def test_layer_lists_must_hold_integers(field, value):
    """A layer list that is not a list of integers names its key (a fraction is not truncated, a
    string not parsed), from a dict and through replace."""
    d = ModelConfig.preset("tiny").to_dict()
    d[field] = value
    assert "expected a list of integers" in _raises(field, ModelConfig.from_dict, d)
    assert "expected a list of integers" in _raises(field, ModelConfig.preset("tiny").replace, **{field: value})


def test_a_config_must_be_an_object(tmp_path):
    for text in ("[1, 2]", "null", "7"):
        (tmp_path / "config.json").write_text(text)
        _raises_saying("a config must be a JSON object", ModelConfig.from_json, tmp_path)


def test_missing_keys_are_listed(flash):
    d = flash.to_dict()
    del d["index_topk"], d["window_size"]
    msg = _raises_saying("config is missing key(s):", ModelConfig.from_dict, d)
    assert "index_topk" in msg and "window_size" in msg


def test_candidate_source_may_be_absent():
    d = ModelConfig.preset("v41-flash").to_dict()
    del d["candidate_source_layer"]
    d["index_source_layers"] = [2, 8, 14, 20]
    cfg = ModelConfig.from_dict(d)
    assert cfg.candidate_source_layer is None
    assert all(s.candidate_role is None for s in cfg.plan)
    assert [s.layer for s in cfg.plan if s.kind == REINDEX] == []


def test_hf_missing_rope_scaling():
    d = _flash_hf_dict()
    del d["rope_scaling"]
    _raises_saying("missing key(s): rope_scaling", ModelConfig.from_dict, d)
    d = _flash_hf_dict()
    del d["rope_scaling"]["beta_fast"]
    _raises_saying("missing key(s): rope_scaling.beta_fast", ModelConfig.from_dict, d)


def test_hf_file_missing_rope_scaling(tmp_path):
    d = json.loads(_needs(FLASH_HF).read_text())
    del d["rope_scaling"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    _raises_saying("missing key(s): rope_scaling", ModelConfig.from_json, tmp_path)


def test_hf_missing_key_is_listed_by_our_name():
    d = _flash_hf_dict()
    del d["index_topk"]
    _raises_saying("missing key(s): index_topk", ModelConfig.from_dict, d)
