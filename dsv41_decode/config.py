"""Model configuration and the per-layer plan of DeepSeek-V4.1's attention stack.

`ModelConfig` holds the fields of the official inference config (`inference/config*.json` key
names). It loads from a `config.json` in the official key style or in the Hugging Face style, or
from a preset (`PRESETS`). `LayerPlan` derives, once, every layer's kind and sources
(spec section 2).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"
KINDS = (SWA, FULL, REINDEX, REUSE)


class ConfigError(ValueError):
    """A configuration that cannot describe a V4.1 attention stack; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """The attention-side fields of a DeepSeek-V4.1 configuration (official key names)."""

    dim: int
    n_layers: int
    n_heads: int
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    norm_eps: float
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    compress_rope_theta: float
    original_seq_len: int
    rope_theta: float
    rope_factor: float
    beta_fast: float
    beta_slow: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    max_seq_len: int
    n_mtp_layers: int = 0
    vocab_size: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    # ----- derived sizes -----
    @property
    def heads_per_group(self) -> int:
        """Query heads per `wo_a` group: H / o_groups."""
        return self.n_heads // self.o_groups

    @property
    def nope_dim(self) -> int:
        """Leading non-rotated dims of each 512-vector (448 for V4.1)."""
        return self.head_dim - self.rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @functools.cached_property
    def plan(self) -> "LayerPlan":
        """Every layer's kind and sources, derived once."""
        return LayerPlan.from_config(self)

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless the heads and `wo_a` groups split evenly over `tp` ranks (a rank's
        `wo_a` rows and `wq_b` rows are then whole 32x32 scale blocks: o_lora_rank and head_dim are
        multiples of 32, `_validate`)."""
        if tp < 1:
            raise ConfigError(f"tp: must be >= 1, got {tp}")
        if self.n_heads % tp:
            raise ConfigError(f"n_heads: {self.n_heads} heads do not split over tp={tp} ranks")
        if self.o_groups % tp:
            raise ConfigError(f"o_groups: {self.o_groups} wo_a groups do not split over tp={tp} ranks")

    # ----- constructors -----
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from a dict in the official key style or the Hugging Face style."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a config must be a JSON object (keys and values), got {type(d).__name__}")
        d = _from_hf(d) if "hidden_size" in d else dict(d)
        names = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name != "candidate_source_layer"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config is missing key(s): {', '.join(missing)}")
        kw = {k: v for k, v in d.items() if k in names}
        kw.setdefault("candidate_source_layer", None)
        if not isinstance(kw["n_layers"], int) or isinstance(kw["n_layers"], bool):
            raise ConfigError(f"n_layers: expected an integer, got {kw['n_layers']!r}")
        n = kw["n_layers"]
        ratios = _int_list("compress_ratios", kw["compress_ratios"])
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios: {len(ratios)} entries for n_layers={n}")
        if "n_mtp_layers" not in d:
            kw["n_mtp_layers"] = len(ratios) - n
        kw["compress_ratios"] = ratios[:n]  # the draft blocks are not part of the attention stack
        for k in ("kv_source_layers", "index_source_layers"):
            kw[k] = _int_list(k, kw[k])
        for f in dataclasses.fields(cls):
            v = kw.get(f.name)
            if f.type == "float" and not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConfigError(f"{f.name}: expected a number, got {v!r}")
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """Load `config.json` (or a directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"no config file at {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a text file (a config.json, its folder or a preset is expected)") from None
        return cls.from_dict(d)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return cls.from_dict(PRESETS[name])

    @classmethod
    def load(cls, spec: str | Path) -> "ModelConfig":
        """A preset name, a config.json path, or a directory holding a config.json (ConfigError for
        an empty spec)."""
        if not str(spec).strip():
            raise ConfigError(f"config: empty; give a preset ({', '.join(PRESETS)}), a config.json or its folder")
        if str(spec) in PRESETS:
            return cls.preset(str(spec))
        if not Path(spec).exists():
            raise ConfigError(f"config {str(spec)!r}: not a preset ({', '.join(PRESETS)}) and no such file or folder")
        return cls.from_json(spec)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios) + [0] * self.n_mtp_layers
        d["kv_source_layers"] = list(self.kv_source_layers)
        d["index_source_layers"] = list(self.index_source_layers)
        return d

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's role in the stack (spec section 2).

    kind: "swa" | "full" | "reindex" | "reuse". kv_source / index_source: layer ids (None for SWA).
    candidate_role: "source" (the Full layer that selects candidate blocks), "consumer" (a Reindex
    layer masked to those blocks) or None.
    """

    layer: int
    kind: str
    ratio: int
    kv_source: int | None
    index_source: int | None
    candidate_role: str | None

    @property
    def owns_compressor(self) -> bool:
        return self.kind == FULL

    @property
    def runs_indexer(self) -> bool:
        return self.kind in (FULL, REINDEX)

    @property
    def label(self) -> str:
        if self.candidate_role == "source":
            return "full+cand"
        return self.kind


@dataclass(frozen=True)
class LayerPlan:
    """Every layer's `LayerSpec`, derived once from a `ModelConfig`."""

    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "LayerPlan":
        out = []
        kv_src, idx_src = set(cfg.kv_source_layers), set(cfg.index_source_layers)
        for i, r in enumerate(cfg.compress_ratios):
            if r == 0:
                out.append(LayerSpec(i, SWA, 0, None, None, None))
                continue
            kv = max(s for s in cfg.kv_source_layers if s <= i)
            ix = max(s for s in cfg.index_source_layers if s <= i)
            if i in kv_src:
                kind = FULL
            elif i in idx_src:
                kind = REINDEX
            else:
                kind = REUSE
            role = None
            if cfg.candidate_source_layer is not None:
                if i == cfg.candidate_source_layer:
                    role = "source"
                elif kind == REINDEX and kv == cfg.candidate_source_layer:
                    role = "consumer"
            out.append(LayerSpec(i, kind, r, kv, ix, role))
        return cls(tuple(out))

    def __getitem__(self, i: int) -> LayerSpec:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def summary(self) -> str:
        """One line per run of consecutive layers of the same kind and sources."""
        lines = []
        for s in self.layers:
            lines.append(f"{s.layer:3d} {s.label:9s} r={s.ratio} kv_src={s.kv_source} "
                         f"idx_src={s.index_source}")
        return "\n".join(lines)


def _int_list(field: str, v: Any) -> tuple[int, ...]:
    """v (a list or tuple of integers) as a tuple; ConfigError naming the field otherwise (a
    fraction is not truncated, a string not parsed)."""
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"{field}: expected a list of integers, got {v!r}")
    return tuple(v)


def _validate(c: ModelConfig) -> None:
    def need(cond: bool, field: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{field}: {msg}")

    for f in ("compress_ratios", "kv_source_layers", "index_source_layers"):
        _int_list(f, getattr(c, f))

    for f in ("dim", "n_layers", "n_heads", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups",
              "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
              "hc_mult", "hc_sinkhorn_iters", "candidate_block_size", "candidate_topk_blocks",
              "max_seq_len"):
        v = getattr(c, f)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f,
             f"must be a positive integer, got {v!r}")
    need(c.hc_mult == 4, "hc_mult", f"the mHC mixer layout [24] assumes 4 streams, got {c.hc_mult}")
    need(c.head_dim % 32 == 0, "head_dim", f"must be a multiple of 32 (MXFP8 blocks), got {c.head_dim}")
    need(c.head_dim == 512, "head_dim", f"the V4.1 cache records assume 512, got {c.head_dim}")
    need(c.rope_head_dim == 64, "rope_head_dim", f"the V4.1 layout assumes 64, got {c.rope_head_dim}")
    need(c.index_head_dim == 128, "index_head_dim",
         f"the 68-byte index-key record assumes 128, got {c.index_head_dim}")
    need(c.dim % 32 == 0, "dim", f"must be a multiple of 32 (MXFP8 input blocks), got {c.dim}")
    need(c.q_lora_rank % 32 == 0, "q_lora_rank", f"must be a multiple of 32, got {c.q_lora_rank}")
    need(c.o_lora_rank % 32 == 0, "o_lora_rank",
         f"must be a multiple of 32 (a wo_a group's rows are whole 32x32 scale blocks), got {c.o_lora_rank}")
    need(c.candidate_block_size >= 2, "candidate_block_size",
         f"must be >= 2 (the candidate pool ranks blocks of entries), got {c.candidate_block_size}")
    need(c.n_heads % c.o_groups == 0, "n_heads",
         f"{c.n_heads} heads are not divisible into o_groups={c.o_groups}")
    need(len(c.compress_ratios) == c.n_layers, "compress_ratios",
         f"{len(c.compress_ratios)} entries for n_layers={c.n_layers}")
    bad = [r for r in c.compress_ratios if r not in (0, 1, 2)]
    need(not bad, "compress_ratios", f"unknown ratio(s) {sorted(set(bad))}; V4.1 has 0, 1 and 2")
    for field in ("kv_source_layers", "index_source_layers"):
        ids = getattr(c, field)
        need(list(ids) == sorted(set(ids)), field, f"must be strictly increasing, got {list(ids)}")
        for s in ids:
            need(0 <= s < c.n_layers, field, f"layer {s} out of range [0, {c.n_layers})")
            need(c.compress_ratios[s] > 0, field, f"layer {s} has compress ratio 0 (an SWA layer)")
    for s in c.kv_source_layers:
        need(s in c.index_source_layers, "index_source_layers",
             f"KV source layer {s} owns index keys and runs its indexer, so it must be listed")
    for i, r in enumerate(c.compress_ratios):
        if r == 0:
            continue
        srcs = [s for s in c.kv_source_layers if s <= i]
        need(bool(srcs), "kv_source_layers", f"layer {i} (ratio {r}) has no KV source at or before it")
        need(c.compress_ratios[srcs[-1]] == r, "kv_source_layers",
             f"layer {i} has ratio {r} but its KV source {srcs[-1]} has ratio "
             f"{c.compress_ratios[srcs[-1]]}")
    cs = c.candidate_source_layer
    need(cs is None or isinstance(cs, int) and not isinstance(cs, bool), "candidate_source_layer",
         f"must be a layer id or null, got {cs!r}")
    if cs is not None:
        need(cs in c.kv_source_layers, "candidate_source_layer",
             f"layer {cs} is not a KV source layer")
    for s in c.index_source_layers:
        if s in c.kv_source_layers:
            continue
        kv = max(k for k in c.kv_source_layers if k <= s)
        need(cs is not None and kv == cs and s > cs, "index_source_layers",
             f"Reindex layer {s} must follow the candidate source and share its KV source "
             f"(its KV source is {kv}, candidate source {cs})")
    for f in ("norm_eps", "hc_eps", "rope_theta", "compress_rope_theta"):
        need(getattr(c, f) > 0, f, f"must be positive, got {getattr(c, f)!r}")
    v = c.original_seq_len
    need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "original_seq_len",
         f"must be a non-negative integer (0: no YaRN), got {v!r}")
    for f in ("beta_fast", "beta_slow"):
        v = getattr(c, f)
        need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), f,
             f"must be a finite number, got {v!r}")
    need(not math.isnan(c.rope_factor) and c.rope_factor >= 1, "rope_factor",
         f"must be >= 1, got {c.rope_factor}")


_HF_KEYS = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "q_lora_rank": "q_lora_rank", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size", "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
    "index_topk": "index_topk", "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks", "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "max_position_embeddings": "max_seq_len", "vocab_size": "vocab_size",
    "num_nextn_predict_layers": "n_mtp_layers",
}
_HF_YARN = {"factor": "rope_factor", "original_max_position_embeddings": "original_seq_len",
            "beta_fast": "beta_fast", "beta_slow": "beta_slow"}


def _from_hf(d: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hf, ours in _HF_KEYS.items():
        if hf in d:
            out[ours] = d[hf]
    rs = d.get("rope_scaling")
    if rs is None:
        raise ConfigError("config is missing key(s): rope_scaling (Hugging Face style)")
    for hf, ours in _HF_YARN.items():
        if hf not in rs:
            raise ConfigError(f"config is missing key(s): rope_scaling.{hf}")
        out[ours] = rs[hf]
    return out


_FLASH = {
    "vocab_size": 129280, "dim": 5120, "n_layers": 40, "n_mtp_layers": 3, "n_heads": 64,
    "q_lora_rank": 1280, "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8,
    "o_lora_rank": 1024, "window_size": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layers": [2, 8, 14, 20], "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
    "compress_rope_theta": 160000.0, "original_seq_len": 65536, "rope_theta": 10000.0,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "candidate_source_layer": 20, "candidate_topk_blocks": 2048,
    "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "max_seq_len": 1048576,
}
# The golden trace's configuration (shared/oracle/official-tiny): one layer of each kind.
_TINY = dict(_FLASH, vocab_size=256, dim=128, n_layers=7, n_mtp_layers=0, n_heads=4, q_lora_rank=128,
             o_groups=2, o_lora_rank=64, window_size=16, compress_ratios=[0, 2, 2, 1, 1, 1, 1],
             kv_source_layers=[1, 3], index_source_layers=[1, 3, 5], index_n_heads=16, index_topk=8,
             candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=4, max_seq_len=64)
# The demo's default: the full Flash structure (2 SWA, ratio-2 Full + Reuse, ratio-1 Full as the
# candidate source, Reuse, Reindex consumers) at small dims, with a window and top-k that bite.
_SMALL = dict(_FLASH, vocab_size=256, dim=256, n_layers=12, n_mtp_layers=0, n_heads=8,
              q_lora_rank=128, o_groups=4, o_lora_rank=128, window_size=32,
              compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1], kv_source_layers=[2, 4, 6],
              index_source_layers=[2, 4, 6, 8, 10], index_n_heads=8, index_topk=16,
              candidate_source_layer=6, candidate_topk_blocks=4, candidate_block_size=4,
              max_seq_len=4096)

PRESETS: dict[str, dict[str, Any]] = {"v41-flash": _FLASH, "tiny": _TINY, "small": _SMALL}
