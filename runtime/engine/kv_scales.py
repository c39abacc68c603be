"""A release's static KV-cache scales: their files, their one reader and writer, and the engine inputs made of them.

The pipeline calibrates and writes them (``tasks/stages/calibrate.py``), a release carries them
(``runtime.release.verify``) and a quantized-KV engine takes them as inputs (``kv_scale_inputs``).
Torch-free (json, numpy, safetensors.numpy).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.engine.errors import RefusedInput
from runtime.engine.interface import KV_ROTATION_INPUT, EngineInterface

KV_SCALES_FILE = "kv_scales.safetensors"
KV_SCALES_JSON = "kv_scales.json"
KV_SCALES_FILES = (KV_SCALES_FILE, KV_SCALES_JSON)
# 1: per-channel scales and zero points. 2: plus an optional ``layer.{i}.rotation`` (d, d) per layer,
# the orthogonal matrix the cache turns post-RoPE K and V by before quantizing (absent = identity:
# version-1 files read as before).
KV_SCALES_FORMAT_VERSION = 2
# Fields of kv_scales.json copied into the safetensors metadata: the tensors carry their own identity.
KV_SCALES_IDENTITY = ("format_version", "base_model_hash", "adapter_sha256", "interface", "spec")
KV_SCALE_KINDS = ("k_scale", "k_zero", "v_scale", "v_zero")
_KV_TENSOR = re.compile(r"^layer\.(\d+)\.\w+$")  # layer.{i}.k_scale ... (nkv, d) float32
KV_ROTATION = "rotation"  # layer.{i}.rotation (d, d) float32
_ORTHOGONAL_TOLERANCE = 1e-5  # max |R R^T - I|: a Hadamard matrix in float32 is within 1e-7


class KVScalesError(RefusedInput):
    """KV scales that must not be used. ``reason`` is one of: missing, malformed, non_finite, zero,
    adapter_mismatch, base_mismatch, interface_mismatch, spec_mismatch (the first problem found;
    the message lists them all)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, eq=False)
class KVScales:
    """A release's static KV-cache scales: (L, nkv, d) float32 arrays, zeros None when symmetric.

    ``spec`` is the KV scheme as a dict (``kernels.kv_spec.KVQuantSpec.to_dict``, the manifest's
    ``kv_format``); ``record`` is kv_scales.json: how they were computed and for what.
    ``rotation`` (L, d, d): per layer, the orthogonal matrix R the cache stores K R and V R with
    (``kernels.kv_quant.KVRotation``); None = no rotation (the identity)."""

    spec: dict
    k_scale: np.ndarray
    k_zero: np.ndarray | None
    v_scale: np.ndarray
    v_zero: np.ndarray | None
    record: dict = field(default_factory=dict)
    rotation: np.ndarray | None = None

    def rotation_or_identity(self) -> np.ndarray:
        """(L, d, d) float32: ``rotation``, or identities when there is none."""
        if self.rotation is not None:
            return self.rotation
        L, d = self.k_scale.shape[0], self.k_scale.shape[-1]
        return np.broadcast_to(np.eye(d, dtype=np.float32), (L, d, d)).copy()

    def stacked(self) -> dict[str, np.ndarray]:
        """{kind: (L, nkv, d)} of the arrays present."""
        arrays = {"k_scale": self.k_scale, "k_zero": self.k_zero, "v_scale": self.v_scale, "v_zero": self.v_zero}
        return {kind: a for kind, a in arrays.items() if a is not None}


def _identity_metadata(record: dict) -> dict[str, str]:
    return {k: (v if isinstance(v, str) else json.dumps(v, sort_keys=True)) for k, v in
            ((k, record.get(k)) for k in KV_SCALES_IDENTITY)}


def _value_problems(tensors: dict[str, np.ndarray]) -> list[tuple[str, str]]:
    """(reason, sentence) of every non-float32, non-finite or non-positive scale."""
    problems = []
    for name, t in sorted(tensors.items()):
        if t.dtype != np.float32:
            problems.append(("malformed", f"{name} is {t.dtype}, expected float32"))
        elif not np.isfinite(t).all():
            problems.append(("non_finite", f"{name} has {int((~np.isfinite(t)).sum())} non-finite values"))
        elif name.endswith("scale") and not (t > 0).all():
            problems.append(("zero", f"{name} has {int((t <= 0).sum())} zero or negative scales"))
        elif name.endswith(KV_ROTATION):
            off = float(np.abs(t.astype(np.float64) @ t.T.astype(np.float64) - np.eye(t.shape[0])).max()) \
                if t.ndim == 2 and t.shape[0] == t.shape[1] else math.inf
            if off > _ORTHOGONAL_TOLERANCE:
                problems.append(("malformed", f"{name} is not an orthogonal square matrix (max |R R^T - I| {off:.3g})"))
    return problems


def _refuse(file: Path, problems: list[tuple[str, str]]) -> None:
    if problems:
        raise KVScalesError(problems[0][0], f"{file}: " + "; ".join(dict.fromkeys(p for _, p in problems)))


def write_kv_scales(directory: str | Path, scales: KVScales) -> Path:
    """Write kv_scales.safetensors (``layer.{i}.{kind}``, identity metadata) and kv_scales.json into
    the existing ``directory``; bad scales are refused before anything is written. Returns the
    .safetensors path. The pipeline makes the directory all-or-nothing (``tasks.artifacts``)."""
    from safetensors.numpy import save

    directory = Path(directory)
    file = directory / KV_SCALES_FILE
    arrays = scales.stacked() | ({} if scales.rotation is None else {KV_ROTATION: scales.rotation})
    tensors = {f"layer.{i}.{kind}": np.ascontiguousarray(a[i], dtype=np.float32)
               for kind, a in arrays.items() for i in range(a.shape[0])}
    _refuse(file, [(reason, f"refusing to write KV scales: {p}") for reason, p in _value_problems(tensors)])
    file.write_bytes(_sorted_header(save(tensors, metadata=_identity_metadata(scales.record))))
    (directory / KV_SCALES_JSON).write_text(json.dumps(scales.record, indent=2, sort_keys=True) + "\n")
    return file


def _sorted_header(data: bytes) -> bytes:
    """safetensors bytes with the header's keys sorted. safetensors writes its metadata map in hash
    order, which changes from process to process, so the same scales came out as other bytes and DVC
    re-ran everything downstream; sorted, equal scales are equal files. The header keeps its length
    (same keys, same values), so every data offset stays valid."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    ordered = json.dumps({k: dict(sorted(v.items())) if k == "__metadata__" else v for k, v in sorted(header.items())},
                         separators=(",", ":"), ensure_ascii=False).encode()
    if len(ordered) > size:
        raise ValueError("safetensors header grew when sorted")  # the writer's own format changed: refuse, never corrupt
    return data[:8] + ordered.ljust(size) + data[8 + size :]


def read_kv_scales(
    path: str | Path,
    adapter_sha256: str,
    base_model_hash: str,
    interface: str | None = None,
    spec: dict | None = None,
    num_layers: int | None = None,
    channels: tuple[int, int] | None = None,
) -> KVScales:
    """Read and check KV scales; raise ``KVScalesError`` instead of guessing (never a 1.0 default).

    ``path``: the directory holding them or the .safetensors file. They must be calibrated for
    ``adapter_sha256`` on ``base_model_hash``; ``interface`` / ``spec`` / ``num_layers`` /
    ``channels`` (nkv, d) None skip that check (the recorded value is taken).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    file = path / KV_SCALES_FILE if path.is_dir() or not path.suffix else path
    record_file = file.with_name(KV_SCALES_JSON)
    for f in (file, record_file):
        if not f.exists():
            raise KVScalesError("missing", f"{f} is missing: calibrate this release (python -m tasks.stages.calibrate); "
                                "KV scales are never defaulted to 1.0")
    try:
        record = json.loads(record_file.read_text())
        with safe_open(str(file), framework="np") as fh:
            meta = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except (OSError, ValueError, SafetensorError) as err:
        raise KVScalesError("malformed", f"{file}: cannot read KV scales ({err})") from None
    spec_recorded = record.get("spec") if isinstance(record, dict) else None
    symmetry = ("k_symmetric", "v_symmetric")  # which zero points the file must hold
    if not isinstance(spec_recorded, dict) or not all(isinstance(spec_recorded.get(k), bool) for k in symmetry):
        raise KVScalesError("malformed", f"{file}: {record_file.name} records no KV spec (with {', '.join(symmetry)})")

    problems = []
    if meta != _identity_metadata(record):
        problems.append(("malformed", f"safetensors metadata disagrees with {record_file.name}"))
    recorded = {k: record.get(k) for k in ("adapter_sha256", "base_model_hash", "interface")}
    if recorded["adapter_sha256"] != adapter_sha256:
        problems.append(("adapter_mismatch", f"scales were calibrated for adapter {str(recorded['adapter_sha256'])[:12]}, "
                         f"not for this adapter {adapter_sha256[:12]}; recalibrate"))
    if recorded["base_model_hash"] != base_model_hash:
        problems.append(("base_mismatch", f"scales were calibrated on backbone {str(recorded['base_model_hash'])[:12]}, "
                         f"not {base_model_hash[:12]}"))
    if interface is not None and (recorded["interface"] or "") != interface:
        problems.append(("interface_mismatch", f"scales record engine interface {recorded['interface']!r}, "
                         f"the engine has {interface!r}"))
    if spec is not None and spec_recorded != spec:
        problems.append(("spec_mismatch", f"scales were made for KV spec {spec_recorded}, not {spec}"))
    problems += _value_problems(tensors)
    for name, t in sorted(tensors.items()):
        if channels is not None and not name.endswith(KV_ROTATION) and tuple(t.shape) != tuple(channels):
            problems.append(("malformed", f"{name} has shape {tuple(t.shape)}, the engine has {tuple(channels)}"))
    layers = sorted({int(m.group(1)) for m in map(_KV_TENSOR.match, tensors) if m})
    L = num_layers if num_layers is not None else len(layers)
    if layers != list(range(L)) or any(_KV_TENSOR.match(n) is None for n in tensors):
        problems.append(("malformed", f"scales for layers {layers}, expected 0..{L - 1}"))
    _refuse(file, problems)

    def stack(kind: str, needed: bool) -> np.ndarray | None:
        if not needed:
            return None
        names = [f"layer.{i}.{kind}" for i in range(L)]
        missing = [n for n in names if n not in tensors]
        _refuse(file, [("malformed", f"missing {missing}")] if missing else [])
        return np.stack([tensors[n] for n in names])  # (L, nkv, d)

    rotated = any(n.endswith("." + KV_ROTATION) for n in tensors)
    out = KVScales(spec_recorded, stack("k_scale", True), stack("k_zero", not spec_recorded["k_symmetric"]),
                   stack("v_scale", True), stack("v_zero", not spec_recorded["v_symmetric"]), record,
                   stack(KV_ROTATION, rotated))
    if out.rotation is not None and out.rotation.shape[1:] != (out.k_scale.shape[-1],) * 2:
        _refuse(file, [("malformed", f"rotation {out.rotation.shape[1:]} is not (head_dim, head_dim)")])
    if out.k_scale.shape != out.v_scale.shape:
        _refuse(file, [("malformed", f"k_scale {out.k_scale.shape} and v_scale {out.v_scale.shape} differ")])
    return out


def kv_scale_inputs(iface: EngineInterface, kv_scales: KVScales) -> dict[str, np.ndarray]:
    """The static KV-scale inputs (``k_scale.{i}`` ... (nkv, d) float32) of a quantized-KV engine,
    from a release's scales (``read_kv_scales``). Refuses another spec or backbone,
    missing, mis-shaped, non-finite or non-positive scales, every problem at once; nothing is defaulted."""
    problems = []
    if kv_scales.spec != iface.kv_spec:
        problems.append(f"scales were calibrated for KV spec {kv_scales.spec}, the engine implements {iface.kv_spec}")
    base = kv_scales.record.get("base_model_hash")
    if base is not None and base != iface.backbone_hash:
        problems.append(f"scales were calibrated on backbone {base[:12]}, the engine runs {iface.backbone_hash[:12]}")
    stacked_by_kind = kv_scales.stacked()
    wanted = [t for t in iface.inputs if t.name.split(".")[0] in KV_SCALE_KINDS]
    inputs = {}
    for t in wanted:
        field, layer = t.name.split(".")
        stacked = stacked_by_kind.get(field)
        if stacked is None:
            problems.append(f"{field} is missing")
            continue
        stacked = np.asarray(stacked, dtype=np.float32)
        shape = iface.adapter_shape(t)
        if stacked.ndim != 3 or stacked.shape[0] != iface.num_layers or tuple(stacked.shape[1:]) != shape:
            problems.append(f"{field} has shape {stacked.shape}, the engine needs ({iface.num_layers}, *{shape})")
            continue
        value = np.ascontiguousarray(stacked[int(layer)])
        if not np.isfinite(value).all():
            problems.append(f"{t.name} has non-finite values")
        elif field.endswith("scale") and not (value > 0).all():
            problems.append(f"{t.name} has zero or negative scales")
        inputs[t.name] = value
    rotations = [t for t in iface.inputs if t.name.split(".")[0] == KV_ROTATION_INPUT]
    if rotations:
        stacked = kv_scales.rotation_or_identity()
        for t in rotations:
            if tuple(stacked.shape[1:]) != iface.adapter_shape(t):
                problems.append(f"the KV rotation is {stacked.shape[1:]}, the engine needs {iface.adapter_shape(t)}")
                break
            inputs[t.name] = np.ascontiguousarray(stacked[int(t.name.split(".")[1])], dtype=np.float32)
    elif kv_scales.rotation is not None:
        problems.append("the scales come with a KV rotation and this engine has no rotation input "
                        f"(interface version {iface.version}); recompile the engine")
    if problems:
        raise RefusedInput("KV scales do not fit this engine: " + "; ".join(dict.fromkeys(problems)))
    return inputs
