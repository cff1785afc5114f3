"""Attention-side checkpoint tensors: the expected layout, loading with validation, synthetic files.

The layout is the official inference naming of spec section 7 (`layers.N.attn.wq_a.weight`; a
folder whose layer tensors all carry one prefix, such as `model.`, is read through it); which
tensors a layer holds follows its kind in `cfg.plan` (spec section 2). FP8
linears store an E4M3 `weight` [out, in] and a UE8M0 `scale` [ceil(out/32), ceil(in/32)]; the value
of element (r, c) is `weight[r, c] * scale[r // 32, c // 32]`.

Files are read with `safetensors.safe_open` only (never pickle). Every expected tensor is checked
for presence, dtype, shape and finite values before it is handed out, and each fault raises a
`CheckpointError` that names the tensor, the file, what was expected and what was found.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
from rich.console import Console
from rich.progress import Progress
from safetensors import safe_open
from safetensors.torch import save_file

from .config import FULL, REINDEX, ModelConfig
from .formats import fp8_block_dequantize, fp8_block_quantize
from .ops.checks import require_device
from .sharding import shard_ranges

FP8 = torch.float8_e4m3fn
UE8M0 = torch.float8_e8m0fnu
BF16 = torch.bfloat16
F32 = torch.float32

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
QUANT_BLOCK = 32  # FP8 weight scales cover 32x32 blocks

# Every per-layer name (without `layers.N.`) that some layer kind holds. A selected layer that holds
# one of these without its kind expecting it means the checkpoint and config disagree on the plan.
KNOWN_SUFFIXES = frozenset({
    "attn_norm.weight", "ffn_norm.weight",
    "attn.wq_a.weight", "attn.wq_a.scale", "attn.q_norm.weight",
    "attn.wkv.weight", "attn.wkv.scale", "attn.kv_norm.weight",
    "attn.wq_b.weight", "attn.wq_b.scale",
    "attn.wo_a.weight", "attn.wo_a.scale", "attn.wo_b.weight", "attn.wo_b.scale",
    "attn.attn_sink",
    "attn.compressor.wkv.weight", "attn.compressor.wgate.weight", "attn.compressor.norm.weight",
    "attn.indexer.wk.weight", "attn.indexer.k_norm.weight",
    "attn.indexer.wq_b.weight", "attn.indexer.wq_b.scale", "attn.indexer.weights_proj.weight",
    "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
})

_LAYER_NAME = re.compile(r"layers\.(\d+)\.")
_PREFIXED_LAYER = re.compile(r"(.+?)layers\.\d+\.")
_HF_MARKERS = ("self_attn.", "q_a_proj", "kv_a_proj", "o_proj", "weight_scale_inv")

TensorSpec = tuple[torch.dtype, tuple[int, ...]]


class CheckpointError(ValueError):
    """A checkpoint that does not match the expected layout; the message names the tensor and file."""


class LayerNotLoadedError(KeyError):
    """`Checkpoint.layer(i)` for a layer that was not selected when loading."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


# ----------------------------------------------------------------------------- expected layout


def _layer_spec(cfg: ModelConfig, layer: int, wo_a_fp8: bool) -> dict[str, TensorSpec]:
    """The tensors of layer `layer`, keyed by name without the `layers.N.` prefix."""
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer} out of range [0, {cfg.n_layers})")
    spec = cfg.plan[layer]
    d, hd, ql = cfg.dim, cfg.head_dim, cfg.q_lora_rank
    wo_rank = cfg.o_groups * cfg.o_lora_rank
    n_mix = (2 + cfg.hc_mult) * cfg.hc_mult  # pre (hc) + post (hc) + comb (hc*hc) = 24
    out: dict[str, TensorSpec] = {}

    def fp8_linear(name: str, n_out: int, n_in: int) -> None:
        out[f"{name}.weight"] = (FP8, (n_out, n_in))
        out[f"{name}.scale"] = (UE8M0, (-(-n_out // QUANT_BLOCK), -(-n_in // QUANT_BLOCK)))

    out["attn_norm.weight"] = (BF16, (d,))
    out["ffn_norm.weight"] = (BF16, (d,))
    fp8_linear("attn.wq_a", ql, d)
    out["attn.q_norm.weight"] = (BF16, (ql,))
    fp8_linear("attn.wkv", hd, d)
    out["attn.kv_norm.weight"] = (BF16, (hd,))
    fp8_linear("attn.wq_b", cfg.n_heads * hd, ql)
    wo_a_shape = (wo_rank, cfg.heads_per_group * hd)
    if wo_a_fp8:
        fp8_linear("attn.wo_a", *wo_a_shape)
    else:
        out["attn.wo_a.weight"] = (BF16, wo_a_shape)
    fp8_linear("attn.wo_b", d, wo_rank)
    out["attn.attn_sink"] = (F32, (cfg.n_heads,))
    if spec.kind == FULL:
        # ratio 2 softmax-gates two rows in FP32; ratio 1 is a plain BF16 projection (spec 3.4)
        out["attn.compressor.wkv.weight"] = (F32 if spec.ratio == 2 else BF16, (hd, d))
        if spec.ratio == 2:
            out["attn.compressor.wgate.weight"] = (F32, (hd, d))
        out["attn.compressor.norm.weight"] = (BF16, (hd,))
        out["attn.indexer.wk.weight"] = (BF16, (cfg.index_head_dim, hd))
        out["attn.indexer.k_norm.weight"] = (BF16, (cfg.index_head_dim,))
    if spec.kind in (FULL, REINDEX):
        fp8_linear("attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, ql)
        out["attn.indexer.weights_proj.weight"] = (BF16, (cfg.index_n_heads, d))
    for site in ("attn", "ffn"):
        out[f"hc_{site}_fn"] = (F32, (n_mix, cfg.hc_mult * d))
        out[f"hc_{site}_base"] = (F32, (n_mix,))
        out[f"hc_{site}_scale"] = (F32, (3,))
    return out


def expected_tensors(cfg: ModelConfig, layer: int, wo_a_fp8: bool = False) -> dict[str, TensorSpec]:
    """Every checkpoint tensor of one layer: full official name -> (dtype, shape) (spec section 7).

    cfg: the model configuration; the layer's kind comes from `cfg.plan[layer]`.
    layer: layer id in [0, cfg.n_layers); ValueError otherwise.
    wo_a_fp8: expect `attn.wo_a` as an FP8 weight with a `.scale` instead of a BF16 weight.
    Names carry the `layers.N.` prefix, e.g. `layers.3.attn.wq_a.weight`.
    """
    return {f"layers.{layer}.{k}": v for k, v in _layer_spec(cfg, layer, wo_a_fp8).items()}


def _describe(cfg: ModelConfig, layer: int) -> str:
    s = cfg.plan[layer]
    parts = [s.label, f"ratio {s.ratio}"]
    if s.kv_source is not None and s.kv_source != layer:
        parts.append(f"KV source {s.kv_source}")
    if s.index_source is not None and s.index_source != layer:
        parts.append(f"index source {s.index_source}")
    return f"layer {layer} ({', '.join(parts)} per the config)"


# ----------------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class Checkpoint:
    """The validated attention-side tensors of some layers of a checkpoint.

    config: the model configuration the tensors were checked against.
    layers: layer id -> {name without `layers.N.` (e.g. `attn.wq_a.weight`) -> tensor}, in the
        storage dtypes of spec section 7, on the device given to `load_checkpoint`.
    path: the directory it was loaded from (None when built in memory).
    shard: (tp, rank): the tensor-parallel part the sharded tensors hold (`sharding.shard_ranges`);
        (1, 0) for whole tensors.
    """

    config: ModelConfig
    layers: Mapping[int, Mapping[str, torch.Tensor]]
    path: Path | None = None
    shard: tuple[int, int] = (1, 0)

    def layer(self, i: int) -> Mapping[str, torch.Tensor]:
        """Layer i's tensors; LayerNotLoadedError (a KeyError) naming i when it was not loaded."""
        try:
            return self.layers[i]
        except KeyError:
            raise LayerNotLoadedError(
                f"layer {i} is not loaded (loaded: {sorted(self.layers)}); "
                f"pass it in load_checkpoint(..., layers=...)") from None


def dequantized(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """The float32 value of a linear's weight: `weight * scale` per 32x32 block, or `weight.float()`.

    tensors: one layer's dict (`Checkpoint.layer(i)`).
    name: the linear (`attn.wq_a`) or its weight (`attn.wq_a.weight`).
    KeyError naming the weight when it is absent; CheckpointError for an FP8 weight without a scale.
    """
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    w = tensors.get(f"{base}.weight")
    if w is None:
        raise KeyError(f"{base}.weight: no such tensor in this layer")
    scale = tensors.get(f"{base}.scale")
    if scale is not None:
        return fp8_block_dequantize(w, scale)
    if w.dtype == FP8:
        raise CheckpointError(f"{base}.weight is FP8 but {base}.scale is missing")
    return w.float()


def has_weight_files(root: Path) -> bool:
    """Whether folder `root` holds weights in a layout `load_checkpoint` reads (an index, one file,
    or shards); when it does not, loading raises CheckpointError saying `NO_WEIGHT_FILES`."""
    return (root / INDEX_FILE).exists() or (root / SINGLE_FILE).exists() or any(root.glob("*.safetensors"))


NO_WEIGHT_FILES = f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors shard"


class _Shards:
    """Which file holds each tensor name; files are opened (header only) when first needed."""

    def __init__(self, root: Path, stack: ExitStack) -> None:
        self.root = root
        self._stack = stack
        self._handles: dict[Path, object] = {}
        self.where: dict[str, Path] = {}
        self._by_layer: dict[int, list[str]] | None = None
        index = root / INDEX_FILE
        if index.exists():
            self.source = str(index)
            self._read_index(index)
        elif (root / SINGLE_FILE).exists():
            self.source = str(root / SINGLE_FILE)
            self._scan([root / SINGLE_FILE])
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{root}: {NO_WEIGHT_FILES}")
            self.source = f"the {len(files)} *.safetensors shard(s) of {root}"
            self._scan(files)
        self.stored: dict[str, str] = {}   # official name -> the name in the file, where they differ
        self._strip_prefix()

    def _strip_prefix(self) -> None:
        """Map a checkpoint whose layer tensors all carry one prefix before `layers.N.` (the `model.`
        of a Hugging Face folder) onto the official names, keeping the stored names for reading."""
        if any(_LAYER_NAME.match(n) for n in self.where):
            return
        prefixes = {m.group(1) for n in self.where if (m := _PREFIXED_LAYER.match(n))}
        if len(prefixes) != 1:
            return
        (pre,) = prefixes
        mapped = {n[len(pre):]: n for n in self.where if n.startswith(pre)}
        if not any(_LAYER_NAME.sub("", k, count=1) in KNOWN_SUFFIXES for k in mapped):
            return   # another naming altogether: _naming_hint explains it
        self.where = {k: self.where[v] for k, v in mapped.items()}
        self.stored = mapped
        self.source += f" (names read without their {pre!r} prefix)"

    def naming_hint(self, layer: int) -> str:
        """For a layer with missing tensors: what the folder holds instead and what to rename ("" when
        it holds the layer under the official names, so the missing ones are simply missing)."""
        held = [self.stored.get(n, n) for n in self.layer_names(layer)]
        hf = [n for n in (held or sorted(self.where)) if any(k in n for k in _HF_MARKERS)]
        if hf:
            return (f" (its names, e.g. {hf[0]}, are a Hugging Face transformers naming: convert the "
                    f"checkpoint to the official inference names first, e.g. "
                    f"model.layers.N.self_attn.q_a_proj.weight -> layers.N.attn.wq_a.weight and "
                    f"weight_scale_inv -> scale; README 'Checkpoints' lists every name read)")
        if held:
            return ""
        if not self.where:
            return " (the folder holds no tensors)"
        mine = [n for n in sorted(self.where) if f".{layer}." in n] or sorted(self.where)
        return (f" (the folder holds no layers.{layer}.* tensors; its names look like {mine[0]}; expected e.g. "
                f"layers.{layer}.attn.wq_a.weight: rename them as README 'Checkpoints' lists)")

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            items = [(str(k), str(v)) for k, v in weight_map.items()]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index "
                                  f"(expected {{\"weight_map\": {{name: file}}}}; {e!r})") from None
        for name, file in items:
            self.where[name] = self.root / file

    def _scan(self, files: list[Path]) -> None:
        for file in files:
            for name in self._open(file).keys():
                if name in self.where:
                    raise CheckpointError(f"{name}: stored twice, in {self.where[name]} and {file}")
                self.where[name] = file

    def _open(self, file: Path):
        h = self._handles.get(file)
        if h is None:
            if not file.exists():
                raise CheckpointError(f"{file}: shard named in {self.source} does not exist")
            try:
                h = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as e:  # SafetensorError (truncated, bad header) or OSError
                raise CheckpointError(f"{file}: not a readable safetensors file "
                                      f"(truncated or corrupt?): {e}") from None
            self._handles[file] = h
        return h

    def layer_names(self, layer: int) -> list[str]:
        """The stored names that start with `layers.{layer}.`."""
        if self._by_layer is None:
            self._by_layer = {}
            for name in self.where:
                m = _LAYER_NAME.match(name)
                if m:
                    self._by_layer.setdefault(int(m.group(1)), []).append(name)
        return self._by_layer.get(layer, [])

    def get_shape(self, name: str) -> list[int]:
        """The stored shape of a present tensor (from the header)."""
        return self._slice(name).get_shape()

    def dtype_code(self, name: str) -> str:
        """The stored safetensors dtype code (`F8_E4M3`, `BF16`, ...) of a present tensor."""
        return self._slice(name).get_dtype()

    def _slice(self, name: str):
        h = self._open(self.where[name])
        try:
            return h.get_slice(self.stored.get(name, name))
        except Exception as e:
            raise CheckpointError(f"{name}: listed in {self.source} but not readable from "
                                  f"{self.where[name]}: {e}") from None

    def get_part(self, name: str, axis: int, start: int, stop: int) -> torch.Tensor:
        """Rows (axis 0) or columns (axis 1) start:stop of a tensor, reading only those bytes."""
        sl = self._slice(name)
        try:
            return sl[start:stop] if axis == 0 else sl[:, start:stop]
        except Exception as e:
            raise CheckpointError(f"{name}: cannot read part {start}:{stop} of axis {axis} from "
                                  f"{self.where[name]}: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        file = self.where[name]
        h = self._open(file)
        try:
            return h.get_tensor(self.stored.get(name, name))
        except Exception as e:
            raise CheckpointError(f"{name}: listed in {self.source} but not readable from "
                                  f"{file}: {e}") from None


def _first_bad(mask: torch.Tensor) -> str:
    idx = mask.nonzero()[0].tolist()
    return f"{int(mask.sum())} element(s), first at {idx}"


def _check_tensor(name: str, file: Path, t: torch.Tensor, dtype: torch.dtype,
                  shape: tuple[int, ...], why: str) -> None:
    where = f"{name} in {file}"
    if t.dtype != dtype:
        raise CheckpointError(f"{where}: expected dtype {dtype}, found {t.dtype}{why}")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{where}: expected shape {list(shape)}, found {list(t.shape)}{why}")
    if dtype == UE8M0:
        bad = t.view(torch.uint8) == 0xFF
        if bool(bad.any()):
            raise CheckpointError(f"{where}: expected UE8M0 scale bytes, found 0xFF (NaN) in "
                                  f"{_first_bad(bad)}")
    elif dtype == FP8:
        bad = (t.view(torch.uint8) & 0x7F) == 0x7F  # E4M3FN has no inf; S.1111.111 is NaN
        if bool(bad.any()):
            raise CheckpointError(f"{where}: expected finite E4M3 weights, found NaN in "
                                  f"{_first_bad(bad)}")
    else:
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            kinds = "NaN" if bool(t[bad].isnan().all()) else "NaN/inf"
            raise CheckpointError(f"{where}: expected finite {dtype} values, found {kinds} in "
                                  f"{_first_bad(bad)}")


def _load_layer(cfg: ModelConfig, layer: int, shards: _Shards, device: torch.device,
                parts: Mapping[str, tuple[int, int, int]] | None = None) -> dict[str, torch.Tensor]:
    prefix = f"layers.{layer}."
    wo_a = f"{prefix}attn.wo_a.weight"
    wo_a_fp8 = wo_a in shards.where and shards.dtype_code(wo_a) == "F8_E4M3"
    expected = expected_tensors(cfg, layer, wo_a_fp8=wo_a_fp8)
    what = _describe(cfg, layer)

    missing = [n for n in expected if n not in shards.where]
    if missing:
        hint = shards.naming_hint(layer)
        names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"missing tensor(s) {names} for {what}; looked in {shards.source}{hint}")
    for name in shards.layer_names(layer):
        if name not in expected and name[len(prefix):] in KNOWN_SUFFIXES:
            hint = (" (attn.wo_a.weight is BF16, so it takes no scale)"
                    if name.endswith("wo_a.scale") else "")
            raise CheckpointError(f"unexpected tensor {name} in {shards.where[name]}: not held by "
                                  f"{what}{hint}; do the checkpoint and config.json "
                                  f"(kv_source_layers, index_source_layers, compress_ratios) match?")

    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in expected.items():
        part = (parts or {}).get(name[len(prefix):])
        if part is None:
            t = shards.get(name)
        else:   # this rank's rows or columns only; the check sees the part's shape
            axis, start, stop = part
            stored = shards.get_shape(name)
            if list(stored) != list(shape):
                raise CheckpointError(f"{name} in {shards.where[name]}: expected shape {list(shape)}, "
                                      f"found {list(stored)}")
            t = shards.get_part(name, axis, start, stop)
            shape = tuple(stop - start if a == axis else n for a, n in enumerate(shape))
        why = ""
        if name.endswith("compressor.wkv.weight"):
            why = f" (compress ratio {cfg.ratio(layer)} stores it in {dtype})"
        _check_tensor(name, shards.where[name], t, dtype, shape, why)
        out[name[len(prefix):]] = t.to(device)
    return out


def _select(cfg: ModelConfig, layers: Iterable[int] | None) -> list[int]:
    if layers is None:
        return list(range(cfg.n_layers))
    try:
        ids = None if isinstance(layers, (str, bytes)) else list(layers)
    except TypeError:            # not iterable: one int, say
        ids = None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"layers: expected layer ids (integers), got {layers!r}")
    sel = sorted(set(ids))
    bad = [i for i in sel if not 0 <= i < cfg.n_layers]
    if bad:
        raise ValueError(f"layers: {bad} out of range [0, {cfg.n_layers})")
    return sel


def load_checkpoint(path: str | Path, layers: Iterable[int] | None = None,
                    device: str | torch.device = "cpu",
                    config: ModelConfig | None = None, tp: int = 1, rank: int = 0) -> Checkpoint:
    """Read and validate the attention-side tensors of the selected layers of a checkpoint.

    path: a directory holding `config.json` (official or HF keys) and either `model.safetensors`,
        or shards listed by `model.safetensors.index.json` (`{"weight_map": {name: file}}`), or
        shards without an index (every `*.safetensors` in the directory is scanned).
    layers: layer ids to load (None = all); only their tensors are read. ValueError if out of range.
    device: where the returned tensors live (validation runs on the CPU first).
    config: use this configuration instead of `path/config.json`.
    Checks every tensor of `expected_tensors` (wo_a as BF16, or FP8 with a scale): present, dtype,
    shape, no 0xFF UE8M0 scale byte, no NaN/inf; and that no selected layer holds compressor or
    indexer tensors its kind does not own. Each fault raises CheckpointError naming the tensor and
    the file; an unreadable (truncated, corrupt) file raises CheckpointError naming the file.
    Tensors of other layers and non-attention tensors are ignored.
    tp, rank: read only rank `rank`'s part of the tensors tensor parallelism shards
    (`sharding.shard_ranges`: wq_b and attn_sink by heads, wo_a by groups, wo_b by input columns);
    the result's `shard` is (tp, rank).
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    if config is not None and not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig (or None: {root}/config.json), got a "
                        f"{type(config).__name__}: {config!r}")
    dev = require_device(device)
    cfg = config if config is not None else ModelConfig.from_json(root)
    sel = _select(cfg, layers)
    for name, v in (("tp", tp), ("rank", rank)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    cfg.check_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must lie in [0, {tp}), got {rank}")
    parts = shard_ranges(cfg, tp, rank) if tp > 1 else None
    console = Console(stderr=True)
    out: dict[int, dict[str, torch.Tensor]] = {}
    with ExitStack() as stack:
        shards = _Shards(root, stack)
        with Progress(console=console, transient=True,
                      disable=len(sel) <= 4 or not console.is_terminal) as progress:
            task = progress.add_task(f"loading {root.name}", total=len(sel))
            for i in sel:
                out[i] = _load_layer(cfg, i, shards, dev, parts)
                progress.advance(task)
    return Checkpoint(config=cfg, layers=out, path=root, shard=(tp, rank) if tp > 1 else (1, 0))


# ----------------------------------------------------------------------------- synthetic


def _generator(seed: int, name: str) -> torch.Generator:
    # One stream per tensor: a layer's tensors do not depend on which other layers are written.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _synthetic_layer(cfg: ModelConfig, layer: int, seed: int,
                     wo_a_fp8: bool) -> dict[str, torch.Tensor]:
    """Random tensors of one layer, shaped like the official-tiny checkpoint's statistics."""
    expected = expected_tensors(cfg, layer, wo_a_fp8=wo_a_fp8)
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in expected.items():
        if name in out or dtype == UE8M0:
            continue
        g = _generator(seed, name)
        suffix = name.split(".", 2)[2]
        if suffix.endswith("_fn"):  # hc_*_fn [24, 4*dim]
            t = torch.randn(shape, generator=g) / math.sqrt(cfg.dim)
        elif suffix.endswith("_base") or suffix == "attn.attn_sink":
            t = 0.5 * torch.randn(shape, generator=g)
        elif suffix.endswith("_scale"):  # hc_*_scale [3]
            t = (0.5 + 0.5 * torch.rand(shape, generator=g)).to(BF16).float()
        elif len(shape) == 1:  # RMSNorm weights
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:  # a linear [out, in]
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        if dtype == FP8:
            base = name[: -len(".weight")]
            w, s = fp8_block_quantize(t, block=QUANT_BLOCK)
            out[name], out[f"{base}.scale"] = w.contiguous(), s.contiguous()
        else:
            out[name] = t.to(dtype).contiguous()
    return {n: out[n] for n in expected}


def write_synthetic_checkpoint(cfg: ModelConfig, path: str | Path, seed: int = 0,
                               layers: Iterable[int] | None = None, shards: int = 1,
                               wo_a_fp8: bool = False) -> Path:
    """Write `config.json` and random attention weights of realistic magnitude; return the directory.

    cfg: configuration, written in the official key style (`cfg.to_dict()`).
    path: the directory (created if needed). Existing `model.safetensors`,
        `model-*-of-*.safetensors` and `model.safetensors.index.json` there are replaced.
    seed: the same (seed, tensor name) always gives the same tensor, whatever else is written.
    layers: layer ids to write (None = all).
    shards: 1 writes `model.safetensors`; n > 1 deals the tensors round-robin over
        `model-0000k-of-0000n.safetensors` and writes `model.safetensors.index.json`.
    wo_a_fp8: store `attn.wo_a` as FP8 + scale instead of BF16.
    Magnitudes follow the official-tiny checkpoint: linear weights N(0, 1/in) (FP8 through
    `fp8_block_quantize`, 32x32 UE8M0 scales), RMSNorm weights 1 + N(0, 0.1^2), `attn_sink` and
    `hc_*_base` N(0, 0.5^2), `hc_*_fn` N(0, 1/dim), `hc_*_scale` U(0.5, 1) rounded to BF16.
    The same arguments write byte-identical files (file metadata: `{"format": "pt"}` only).
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig (ModelConfig.preset(name) makes one), got a "
                        f"{type(cfg).__name__}: {cfg!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards: must be an int >= 1, got {shards!r}")
    sel = _select(cfg, layers)                 # before the folder is made: nothing left on a refusal
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for i in sel:
        tensors.update(_synthetic_layer(cfg, i, seed, wo_a_fp8))
    if shards > max(len(tensors), 1):
        raise ValueError(f"shards: {shards} files for {len(tensors)} tensors")

    for stale in [root / SINGLE_FILE, root / INDEX_FILE, *root.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    # One metadata key only: safetensors 0.8 writes the metadata map in a random order when it holds
    # several keys, and a synthetic checkpoint must be byte-identical for the same seed.
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(root / SINGLE_FILE), metadata=meta)
        return root
    names = list(tensors)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map = {n: files[j % shards] for j, n in enumerate(names)}
    for k, file in enumerate(files):
        part = {n: tensors[n] for j, n in enumerate(names) if j % shards == k}
        save_file(part, str(root / file), metadata=meta)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return root
