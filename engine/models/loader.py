"""Find a model directory (local or hub id), identify its weights, and load its safetensors."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from engine.models.quant_config import WeightQuant
from engine.models.quantized import dequantize

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """A local directory as is; ``None`` -> the demo model; anything else is a hub id.

    Hub ids resolve through ``huggingface_hub.snapshot_download`` (at ``revision``: a branch, tag or
    commit, default main; into ``download_dir``, default the Hugging Face cache) when it is
    installed and the network allows, or from that cache when the revision was downloaded before;
    otherwise the error names the id and asks for a local directory.
    """
    if model is None:
        from engine.demo import demo_model_dir

        return demo_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model path {model!r} is not a directory; pass a Hugging Face model directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(
            f"model {model!r} is not a local directory and huggingface_hub is not installed to fetch it; "
            "pass a local model directory"
        ) from None
    try:
        patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
        return Path(
            snapshot_download(
                repo_id=model, revision=revision, cache_dir=download_dir, allow_patterns=patterns
            )
        )
    except Exception as exc:  # network down, unknown repo, gated repo…: all mean "give us a directory"
        reason = " ".join(str(exc).split())
        at = f" at revision {revision!r}" if revision else ""
        raise ValueError(
            f"model {model!r}{at} is not a local directory and could not be downloaded from the Hugging "
            f"Face hub ({type(exc).__name__}: {reason}); pass a local model directory"
        ) from None


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    return files


# What ``weights_id`` reads of each tensor's bytes: all of a tensor up to SAMPLE_WHOLE bytes; of a
# larger one, SAMPLES slices of SAMPLE_BYTES spread evenly over it, the first and last included.
SAMPLE_WHOLE = 64 * 1024
SAMPLES = 16
SAMPLE_BYTES = 4096


def weights_id(model_dir: Path, hf_overrides: dict | None = None, dummy: bool = False) -> str:
    """A digest of config.json (and ``--hf-overrides``) plus every safetensors file's name, size,
    header and a sample of each tensor's bytes; with ``dummy`` (random weights), of the config alone.

    It keys the KV tier (through the model fingerprint), which every replica shares: two fine-tunes
    of one base, or a checkpoint a trainer rewrote in place, have the same names, shapes and file
    sizes, so the header alone would let one model's KV blocks be read as the other's. Hashing all
    the bytes would cost seconds per GB at every start; every tensor's samples (about 64 KiB of a
    large one, all of a small one: norms, biases, scales) tell apart any update that touches more
    than a sliver of a tensor, and are read from the page cache the weights are loaded through.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update((model_dir / "config.json").read_bytes())
    if hf_overrides:
        h.update(b"\0hf_overrides\0" + json.dumps(hf_overrides, sort_keys=True).encode())
    if dummy:
        h.update(b"\0dummy weights")
        return h.hexdigest()
    for path in safetensors_files(model_dir):
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = f.read(n)
            h.update(header)
            for begin, end in _tensor_ranges(header):
                for offset, size in _samples(end - begin):
                    f.seek(8 + n + begin + offset)
                    h.update(f.read(size))
    return h.hexdigest()


def _tensor_ranges(header: bytes) -> list[tuple[int, int]]:
    """Each tensor's byte range in the data section, in file order."""
    entries = json.loads(header)
    ranges = [tuple(v["data_offsets"]) for k, v in entries.items() if k != "__metadata__"]
    return sorted((int(b), int(e)) for b, e in ranges)


def _samples(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the slices ``weights_id`` reads of a tensor of ``size`` bytes."""
    if size <= SAMPLE_WHOLE:
        return [(0, size)]
    step = (size - SAMPLE_BYTES) / (SAMPLES - 1)
    return [(round(i * step), SAMPLE_BYTES) for i in range(SAMPLES)]


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype, except float16 on CPU (slow and lossy there) -> float32."""
    if requested == "auto":
        name = checkpoint_dtype if checkpoint_dtype in _DTYPES else "float32"
        if name == "float16" and device.type == "cpu":
            name = "float32"
        return _DTYPES[name]
    if requested not in _DTYPES:
        raise ValueError(f"unsupported dtype {requested!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[requested]


def load_weights(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    keep_fp32: tuple[str, ...] = (),
    num_layers: int | None = None,
    renames: tuple[tuple[str, str], ...] = (),
    fp8_block: tuple[int, int] | None = None,
    quant: WeightQuant | None = None,
    layer: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor in ``dtype``, except names ending with one of ``keep_fp32`` (a router's
    weights, which transformers also keeps in fp32 whatever the model dtype). Layers from
    ``num_layers`` on are not read: checkpoints append extra ones that the decoder does not run
    (DeepSeek-V3's multi-token-prediction layer, ``model.layers.61``, holds ~11B parameters).
    With ``layer``, only ``model.layers.{layer}.…`` is read (that MTP layer, for engine/mtp.py).
    ``renames`` maps name prefixes (a multimodal checkpoint's ``language_model.model.`` to
    ``model.``); with renames, tensors matching none of them (a vision tower) are not read.
    With ``fp8_block``, fp8 weights are dequantized with their ``…weight_scale_inv`` (one scale per
    block of that shape; the scale may sit in another shard than its weight). With ``quant``, each
    GPTQ / AWQ / compressed-tensors module's pieces (``<prefix>.qweight``…) are gathered, wherever the
    shard, and dequantized into ``<prefix>.weight`` (MXFP4's ``<name>_blocks`` / ``_scales`` into
    ``<name>``)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    fp8: dict[str, torch.Tensor] = {}  # fp8 weights and their scales, until both are read
    pieces: dict[str, dict[str, torch.Tensor]] = {}  # quantized modules' tensors, by module prefix
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = _rename(stored, renames)
                if name is None or (num_layers is not None and _layer_index(name) >= num_layers):
                    continue
                if layer is not None and _layer_index(name) != layer:
                    continue
                tensor = f.get_tensor(stored)
                if fp8_block is not None and (tensor.dtype in _FP8 or name.endswith("_scale_inv")):
                    fp8[name] = tensor
                    continue
                if quant is not None and quant.holds(name, tensor):
                    prefix, part = quant.split(name)
                    pieces.setdefault(prefix, {})[part] = tensor
                    continue
                target = torch.float32 if name.endswith(keep_fp32) else dtype
                out[name] = tensor.to(device=device, dtype=target)
    for name in [n for n in fp8 if not n.endswith("_scale_inv")]:
        scale = fp8.pop(name + "_scale_inv", None)
        if scale is None:
            raise ValueError(f"fp8 weight {name} has no {name}_scale_inv in the checkpoint")
        weight = dequantize_fp8(fp8.pop(name), scale, fp8_block)  # type: ignore[arg-type]
        target = torch.float32 if name.endswith(keep_fp32) else dtype
        out[name] = weight.to(device=device, dtype=target)
    for prefix, parts in pieces.items():
        name = quant.weight_name(prefix)  # type: ignore[union-attr]
        target = torch.float32 if name.endswith(keep_fp32) else dtype
        weight = dequantize(prefix, parts, quant, target)  # type: ignore[arg-type]
        if weight is not None:
            out[name] = weight.to(device=device, dtype=target)
    if fp8:
        raise ValueError(f"scales without an fp8 weight in the checkpoint: {sorted(fp8)[:3]}")
    if not renames and "embed_tokens.weight" in out and "model.embed_tokens.weight" not in out:
        # A base model saved alone (Qwen3-Embedding, e5-mistral: ``Qwen3Model``): its tensors
        # carry no ``model.`` prefix, and it has no lm_head.
        out = {"model." + name: t for name, t in out.items()}
    return out


_FP8 = (torch.float8_e4m3fn,)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``weight * scale`` where ``scale_inv[i, j]`` covers rows ``i*b0 …`` and columns ``j*b1 …``
    (DeepSeek's and transformers' block-wise fp8 layout; edge blocks may be partial)."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"fp8 scales of shape {tuple(scale_inv.shape)} do not fit a {rows}x{cols} weight in {block} blocks"
        )
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str | None:
    if not renames:
        return name
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return None


def _layer_index(name: str) -> int:
    """N for ``model.layers.N.…``; -1 for every other tensor."""
    if not name.startswith("model.layers."):
        return -1
    index = name[len("model.layers.") :].split(".", 1)[0]
    return int(index) if index.isdigit() else -1


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
