"""Checkpoint layout, loading with validation, and synthetic checkpoints (dsv41_decode.weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41_decode.config import ModelConfig
from dsv41_decode.weights import (
    INDEX_FILE, SINGLE_FILE, Checkpoint, CheckpointError, LayerNotLoadedError, dequantized,
    expected_tensors, load_checkpoint, write_synthetic_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]


def official_tiny_dir() -> Path | None:
    """The official-tiny oracle: `tests/data/official-tiny` if present, else `../shared/oracle/...`."""
    for p in (REPO / "tests" / "data" / "official-tiny",
              REPO.parent / "shared" / "oracle" / "official-tiny"):
        if (p / "model.safetensors").is_file() and (p / "config.json").is_file():
            return p
    return None


def _read_all(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:  # FP8 / UE8M0: compare the bytes
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny_cfg() -> ModelConfig:
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_cfg) -> Path:
    return write_synthetic_checkpoint(tiny_cfg, tmp_path_factory.mktemp("tiny"), seed=0)


def _mutated(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a single-file checkpoint, applying `edit` to its tensors."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = _read_all(src)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / SINGLE_FILE))
    return dst


# ----------------------------------------------------------------------------- layout


def test_expected_tensors_match_official_tiny():
    root = official_tiny_dir()
    if root is None:
        pytest.skip("official-tiny checkpoint not found (tests/data or ../shared/oracle)")
    cfg = ModelConfig.from_json(root)
    want = {}
    for i in range(cfg.n_layers):
        want.update(expected_tensors(cfg, i))
    with safe_open(str(root / "model.safetensors"), framework="pt") as h:
        got = {k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape())) for k in h.keys()}
    codes = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0",
             torch.bfloat16: "BF16", torch.float32: "F32"}
    assert sorted(got) == sorted(want)
    for k, (dt, shape) in want.items():
        assert got[k] == (codes[dt], shape), k


def test_expected_tensors_by_kind(tiny_cfg):
    # tiny: 0 swa, 1 full r2, 2 reuse, 3 full r1 (candidate source), 4 reuse, 5 reindex, 6 reuse
    names = {i: {k.split(".", 2)[2] for k in expected_tensors(tiny_cfg, i)} for i in range(7)}
    comp, idx_q = "attn.compressor.wkv.weight", "attn.indexer.wq_b.weight"
    assert [comp in names[i] for i in range(7)] == [False, True, False, True, False, False, False]
    assert [idx_q in names[i] for i in range(7)] == [False, True, False, True, False, True, False]
    assert "attn.compressor.wgate.weight" in names[1] and "attn.compressor.wgate.weight" not in names[3]
    assert expected_tensors(tiny_cfg, 1)["layers.1.attn.compressor.wkv.weight"][0] == torch.float32
    assert expected_tensors(tiny_cfg, 3)["layers.3.attn.compressor.wkv.weight"][0] == torch.bfloat16
    fp8 = expected_tensors(tiny_cfg, 0, wo_a_fp8=True)
    assert fp8["layers.0.attn.wo_a.weight"] == (torch.float8_e4m3fn, (128, 1024))
    assert fp8["layers.0.attn.wo_a.scale"] == (torch.float8_e8m0fnu, (4, 32))
    with pytest.raises(ValueError, match="layer 7"):
        expected_tensors(tiny_cfg, 7)


def test_official_tiny_loads_and_validates():
    root = official_tiny_dir()
    if root is None:
        pytest.skip("official-tiny checkpoint not found (tests/data or ../shared/oracle)")
    ck = load_checkpoint(root)
    assert sorted(ck.layers) == list(range(7))
    assert ck.layer(5)["attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    w = dequantized(ck.layer(0), "attn.wq_a")
    assert w.dtype == torch.float32 and w.shape == (128, 128)
    assert 0.07 < w.std().item() < 0.11  # N(0, 1/dim), dim = 128
    assert torch.equal(dequantized(ck.layer(0), "attn.wo_a.weight"),
                       ck.layer(0)["attn.wo_a.weight"].float())


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("layout", ["single", "index", "no-index"])
def test_round_trip(tmp_path, preset, layout):
    cfg = ModelConfig.preset(preset)
    shards = 1 if layout == "single" else 3
    root = write_synthetic_checkpoint(cfg, tmp_path / "ck", seed=3, shards=shards)
    if layout == "single":
        assert (root / SINGLE_FILE).exists() and not (root / INDEX_FILE).exists()
    else:
        assert len(list(root.glob("model-*-of-00003.safetensors"))) == 3
        index = json.loads((root / INDEX_FILE).read_text())
        assert set(index["weight_map"].values()) == {f"model-0000{k}-of-00003.safetensors"
                                                     for k in (1, 2, 3)}
        if layout == "no-index":
            (root / INDEX_FILE).unlink()
    on_disk = _read_all(root)
    ck = load_checkpoint(root)
    assert ck.config == cfg
    assert sorted(ck.layers) == list(range(cfg.n_layers))
    n = 0
    for i in range(cfg.n_layers):
        want = expected_tensors(cfg, i)
        got = ck.layer(i)
        assert sorted(f"layers.{i}.{k}" for k in got) == sorted(want)
        for k, t in got.items():
            full = f"layers.{i}.{k}"
            assert (t.dtype, tuple(t.shape)) == want[full], full
            assert _same(t, on_disk[full]), full
            n += 1
    assert n == len(on_disk)


def test_shard_layouts_hold_the_same_tensors(tmp_path, tiny_cfg, tiny_ckpt):
    one = load_checkpoint(tiny_ckpt)
    three = load_checkpoint(write_synthetic_checkpoint(tiny_cfg, tmp_path / "s3", seed=0, shards=3))
    for i in range(tiny_cfg.n_layers):
        for k, t in one.layer(i).items():
            assert _same(t, three.layer(i)[k]), (i, k)


def test_wo_a_fp8_accepted(tmp_path, tiny_cfg, tiny_ckpt):
    root = write_synthetic_checkpoint(tiny_cfg, tmp_path / "fp8", seed=0, wo_a_fp8=True)
    ck = load_checkpoint(root, layers=[2])
    t = ck.layer(2)
    assert t["attn.wo_a.weight"].dtype == torch.float8_e4m3fn
    assert t["attn.wo_a.scale"].shape == (4, 32)
    ref = load_checkpoint(tiny_ckpt, layers=[2]).layer(2)["attn.wo_a.weight"].float()
    w = dequantized(t, "attn.wo_a")
    assert (w - ref).abs().max().item() < 0.07 * ref.abs().max().item()  # E4M3 vs BF16 rounding


def test_layer_subset(tmp_path, tiny_cfg, tiny_ckpt):
    ck = load_checkpoint(tiny_ckpt, layers=[5, 1])
    assert sorted(ck.layers) == [1, 5]
    with pytest.raises(LayerNotLoadedError, match="layer 2 is not loaded") as e:
        ck.layer(2)
    assert isinstance(e.value, KeyError)
    with pytest.raises(ValueError, match=r"\[9\]"):
        load_checkpoint(tiny_ckpt, layers=[9])
    # a layer written alone equals the same layer written with all the others
    alone = load_checkpoint(write_synthetic_checkpoint(tiny_cfg, tmp_path / "l5", seed=0, layers=[5]),
                            layers=[5])
    for k, t in ck.layer(5).items():
        assert _same(t, alone.layer(5)[k]), k


def test_load_arguments_are_checked(tiny_ckpt):
    for kw, match in (({"layers": "12"}, "layers: expected layer ids"), ({"layers": [1.7]}, "layers: expected"),
                      ({"layers": [True]}, "layers: expected"), ({"tp": 0}, "tp: must be >= 1"),
                      ({"tp": -1}, "tp: must be >= 1"), ({"tp": 1, "rank": 3}, r"rank must lie in \[0, 1\)"),
                      ({"tp": 2, "rank": 2}, r"rank must lie in \[0, 2\)"), ({"tp": 2.0}, "tp must be an integer")):
        with pytest.raises(ValueError, match=match):
            load_checkpoint(tiny_ckpt, **kw)
    assert sorted(load_checkpoint(tiny_ckpt, layers=(i for i in (3, 1))).layers) == [1, 3]    # any iterable


def test_unselected_layers_are_not_read(tmp_path, tiny_cfg, tiny_ckpt):
    def poison(t):
        t["layers.0.attn.q_norm.weight"][0] = float("nan")
        del t["layers.6.attn.wq_b.scale"]
    root = _mutated(tiny_ckpt, tmp_path / "p", poison)
    ck = load_checkpoint(root, layers=[1, 2, 3, 4, 5])
    assert sorted(ck.layers) == [1, 2, 3, 4, 5]
    with pytest.raises(CheckpointError):
        load_checkpoint(root)


def _metadata(root: Path) -> dict[str, dict[str, str] | None]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out[f.name] = h.metadata()
    return out


@pytest.mark.parametrize("shards", [1, 3])
def test_synthetic_is_deterministic(tmp_path, tiny_cfg, shards):
    # safetensors 0.8 writes a metadata map of several keys in a random order, so the writer keeps a
    # single key; several writes give several chances to catch a reordering.
    first = write_synthetic_checkpoint(tiny_cfg, tmp_path / "a", seed=7, shards=shards)
    shard_files = sorted(p.name for p in first.glob("*.safetensors"))
    assert len(shard_files) == shards
    files = sorted(p.name for p in first.iterdir())  # + config.json (+ the index)
    want = {f: (first / f).read_bytes() for f in files}
    ta = _read_all(first)
    for k in range(3):
        again = write_synthetic_checkpoint(tiny_cfg, tmp_path / f"b{k}", seed=7, shards=shards)
        assert sorted(p.name for p in again.iterdir()) == files
        tb = _read_all(again)
        assert sorted(tb) == sorted(ta)
        assert all(_same(ta[n], tb[n]) for n in ta)
        assert _metadata(again) == _metadata(first) == {f: {"format": "pt"} for f in shard_files}
        for f in files:
            assert (again / f).read_bytes() == want[f], f"{f} differs in bytes on write {k + 1}"
    tc = _read_all(write_synthetic_checkpoint(tiny_cfg, tmp_path / "c", seed=8, shards=shards))
    assert sorted(tc) == sorted(ta)
    assert not torch.equal(ta["layers.0.attn.wo_a.weight"], tc["layers.0.attn.wo_a.weight"])
    # a new seed changes every tensor but the FP8 scales (mostly the same power of two)
    assert [n for n in ta if not n.endswith(".scale") and _same(ta[n], tc[n])] == []


def test_synthetic_magnitudes_resemble_official_tiny(tiny_ckpt):
    t = load_checkpoint(tiny_ckpt).layer(1)
    # N(0, 1/in) linears: std in^-0.5; FP8 scale 2^-10 (byte 117) for in = 128, as in official-tiny
    for name, n_in in [("attn.wq_a", 128), ("attn.wq_b", 128), ("attn.wo_a", 1024),
                       ("attn.compressor.wkv", 128), ("attn.indexer.wk", 512)]:
        assert abs(dequantized(t, name).std().item() * n_in ** 0.5 - 1) < 0.1, name
    scales = t["attn.wq_b.scale"].view(torch.uint8)
    assert (scales == 117).float().mean().item() > 0.9 and scales.min().item() >= 116
    norm = t["attn.kv_norm.weight"].float()
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.15
    sc = t["hc_attn_scale"]
    assert ((sc >= 0.5) & (sc <= 1)).all() and torch.equal(sc.bfloat16().float(), sc)


# ----------------------------------------------------------------------------- one test per fault


def test_fault_missing_tensor(tmp_path, tiny_ckpt):
    root = _mutated(tiny_ckpt, tmp_path / "m", lambda t: t.pop("layers.2.attn.wq_b.scale"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) layers\.2\.attn\.wq_b\.scale"):
        load_checkpoint(root)


def test_fault_wrong_shape(tmp_path, tiny_ckpt):
    def edit(t):
        t["layers.0.attn.wkv.weight"] = t["layers.0.attn.wkv.weight"][:480]
    root = _mutated(tiny_ckpt, tmp_path / "s", edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root)
    msg = str(e.value)
    assert "layers.0.attn.wkv.weight" in msg and SINGLE_FILE in msg
    assert "[512, 128]" in msg and "[480, 128]" in msg


def test_fault_wrong_dtype(tmp_path, tiny_ckpt):
    def edit(t):
        t["layers.1.attn.compressor.wkv.weight"] = t["layers.1.attn.compressor.wkv.weight"].bfloat16()
    root = _mutated(tiny_ckpt, tmp_path / "d", edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root)
    msg = str(e.value)
    assert "layers.1.attn.compressor.wkv.weight" in msg
    assert "torch.float32" in msg and "torch.bfloat16" in msg and "ratio 2" in msg


def test_fault_nan_scale_byte(tmp_path, tiny_ckpt):
    def edit(t):
        s = t["layers.3.attn.wq_a.scale"].view(torch.uint8).clone()
        s[2, 1] = 0xFF
        t["layers.3.attn.wq_a.scale"] = s.view(torch.float8_e8m0fnu)
    root = _mutated(tiny_ckpt, tmp_path / "f", edit)
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_a\.scale.*0xFF.*\[2, 1\]"):
        load_checkpoint(root)


def test_fault_nan_in_bf16_weight(tmp_path, tiny_ckpt):
    def edit(t):
        t["layers.4.attn.wo_a.weight"][1, 2] = float("nan")
    root = _mutated(tiny_ckpt, tmp_path / "n", edit)
    with pytest.raises(CheckpointError, match=r"layers\.4\.attn\.wo_a\.weight.*NaN.*\[1, 2\]"):
        load_checkpoint(root)


def test_fault_nan_in_fp8_weight(tmp_path, tiny_ckpt):
    def edit(t):
        w = t["layers.5.attn.indexer.wq_b.weight"].view(torch.uint8).clone()
        w[7, 3] = 0x7F  # E4M3FN NaN
        t["layers.5.attn.indexer.wq_b.weight"] = w.view(torch.float8_e4m3fn)
    root = _mutated(tiny_ckpt, tmp_path / "n8", edit)
    with pytest.raises(CheckpointError, match=r"layers\.5\.attn\.indexer\.wq_b\.weight.*NaN.*\[7, 3\]"):
        load_checkpoint(root)


def test_fault_truncated_file(tmp_path, tiny_cfg):
    root = write_synthetic_checkpoint(tiny_cfg, tmp_path / "t", seed=0, shards=3)
    shard = root / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root)
    assert str(shard) in str(e.value)


def test_fault_config_does_not_match_layers(tmp_path, tiny_cfg, tiny_ckpt):
    # the same stack with layer 2 (a reuse layer of the checkpoint) made a KV source
    other = tiny_cfg.replace(kv_source_layers=(1, 2, 3), index_source_layers=(1, 2, 3, 5))
    assert other.plan[2].kind == "full" and tiny_cfg.plan[2].kind == "reuse"
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tiny_ckpt, config=other)
    msg = str(e.value)
    assert "layers.2.attn.compressor.wkv.weight" in msg and "layer 2 (full" in msg
    # reuse layers are accepted when nothing is missing for them
    assert sorted(load_checkpoint(tiny_ckpt, layers=[0, 1, 3, 4], config=other).layers) == [0, 1, 3, 4]
    # and the other way round: compressor tensors on a layer the config calls reuse
    root = write_synthetic_checkpoint(other, tmp_path / "o", seed=0)
    with pytest.raises(CheckpointError,
                       match=r"unexpected tensor layers\.2\.attn\.compressor\..*layer 2 \(reuse"):
        load_checkpoint(root, config=tiny_cfg)


def test_checkpoint_is_frozen(tiny_ckpt):
    ck = load_checkpoint(tiny_ckpt, layers=[0])
    assert isinstance(ck, Checkpoint)
    with pytest.raises(AttributeError):
        ck.config = None  # type: ignore[misc]


# ----- other namings: a `model.` prefix is read through; other names get a hint -----

def _renamed_shards(src: Path, dst: Path, rename: Callable[[str], str]) -> Path:
    """A copy of the sharded checkpoint `src` with every tensor name passed through `rename`."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(src / f), framework="pt") as h:
            save_file({rename(k): h.get_tensor(k) for k in h.keys()}, str(dst / f))
    index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_model_prefix_is_mapped_in_a_sharded_folder(tmp_path):
    cfg = ModelConfig.preset("tiny")
    src = write_synthetic_checkpoint(cfg, tmp_path / "official", seed=1, shards=3)
    hf = _renamed_shards(src, tmp_path / "hf", lambda k: f"model.{k}")
    a, b = load_checkpoint(src), load_checkpoint(hf)
    for i in range(cfg.n_layers):
        assert a.layer(i).keys() == b.layer(i).keys()
        for k in a.layer(i):
            assert torch.equal(a.layer(i)[k].view(torch.uint8), b.layer(i)[k].view(torch.uint8)), (i, k)


def test_other_namings_get_a_hint(tmp_path):
    cfg = ModelConfig.preset("tiny")
    src = write_synthetic_checkpoint(cfg, tmp_path / "official", seed=1, shards=2)
    hf = _renamed_shards(src, tmp_path / "hf", lambda k: "model." + k.replace(".attn.", ".self_attn.")
                         .replace("wq_a.weight", "q_a_proj.weight").replace(".scale", ".weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) layers\.0\.\S+, .* and \d+ more for .*prefix\) \(its names, e\.g\. model\.layers\.0\.self_attn.*"
                       r"Hugging Face transformers naming.*self_attn\.q_a_proj\.weight -> layers\.N\.attn\.wq_a"):
        load_checkpoint(hf)
    odd = _renamed_shards(src, tmp_path / "odd", lambda k: k.replace("layers.", "blocks."))
    with pytest.raises(CheckpointError, match=r"no layers\.0\.\* tensors; its names look like blocks\.0\..*rename"):
        load_checkpoint(odd)
