"""Writing tuned-config files: moebench's own (vLLM's format, with "triton_version"), the routing a
folder's files were tuned under (`tuned_routing.json`), and the engines' files (token keys only).
Names, formats and the readers are the kernels' (moebench.kernels.triton.configs,
moebench.kernels.engine_configs); every write is atomic (a temporary file, then a rename), and
makes the kernels' lookup of this process look again (it reads each file once)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from moebench.errors import MoebenchError
from moebench.fileio import atomic_write_text
from moebench.kernels import engine_configs as EC
from moebench.kernels.triton import configs as C

if TYPE_CHECKING:  # pragma: no cover
    from moebench.quant import QuantScheme


def write_config_file(
    path: str | os.PathLike, table: Mapping[int | str, Mapping[str, int]], triton_version: str | None = None
) -> Path:
    """Write {tokens: config} as vLLM's JSON (keys sorted by token count, plus "triton_version"),
    atomically: a temporary file in the same folder, then a rename."""
    p = Path(path)
    entries = {int(k): C.validate_tile_config(v, f"entry {k!r}", down=C.is_down_file(p))
               for k, v in table.items() if k != "triton_version"}
    if triton_version is None:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:  # pragma: no cover - triton is a dependency
            triton_version = "unknown"
    doc: dict[str, Any] = {"triton_version": triton_version}
    doc.update({str(k): dict(entries[k]) for k in sorted(entries)})
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(doc, indent=4) + "\n")
    C.clear_lookup_cache()
    return p


def merge_config_file(
    path: str | os.PathLike, entries: Mapping[int, Mapping[str, int]], dtype: torch.dtype | str | None = None,
    quant: "QuantScheme | None" = None,
) -> Path:
    """Merge `entries` ({tokens: config}, tuned with `dtype` / `quant`) into the file at `path`
    (its entries for other token counts are kept; an unreadable old file is replaced), atomically.
    Refused (MoebenchError) when the file's name stands for another scheme than the entries'
    (per-tensor and per-token fp8 entries never share a file)."""
    p = Path(path)
    tag, block = C.name_parts(dtype, quant)
    mine = C.scheme_text(C.dtype_tag(tag), block, C.per_channel_quant(quant))
    theirs = C.file_scheme(p)
    if theirs is None:
        raise MoebenchError(f"{p.name} is not a tuned-config file name "
                            "(E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]][,per_channel_quant=True][_down].json)")
    if mine != theirs:
        raise MoebenchError(f"refusing to merge {mine} entries into {p}: its name is that of a {theirs} file")
    merged: dict[int, Any] = {}
    if p.is_file():
        try:
            merged.update(C.load_config_file(p))
        except MoebenchError:
            pass  # an unreadable old file is replaced
    merged.update({int(k): dict(v) for k, v in entries.items()})
    return write_config_file(p, merged)


def write_tuned_routing(path: str | os.PathLike, routing: tuple[int, int] | None) -> None:
    """Record (experts, topk) for the config file at `path` in its folder's ROUTING_FILE (None:
    drop its entry), atomically."""
    p = Path(path)
    table = dict(C.read_tuned_routing(p.parent))
    if routing is None:
        if table.pop(p.name, None) is None:
            return
    else:
        table[p.name] = {"experts": int(routing[0]), "topk": int(routing[1])}
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p.parent / C.ROUTING_FILE, json.dumps(dict(sorted(table.items())), indent=4) + "\n")
    C.clear_lookup_cache()


def claim_tuned_routing(path: str | os.PathLike, experts: int, topk: int) -> None:
    """Before a tune writes into the file at `path`: record that it routes top-`topk` over
    `experts`, where the file is new or already says so. Refused (MoebenchError) for a file tuned
    under another routing (its entries would mix two meanings of a token key); a file whose
    routing is unknown is left so."""
    p = Path(path)
    have = C.tuned_routing(p)
    if have is not None and have != (experts, topk):
        raise MoebenchError(f"{p} holds entries tuned for routing top-{have[1]} over {have[0]} experts; this tune "
                            f"routes top-{topk} over {experts}: give another --out")
    if have is None and not p.exists():
        write_tuned_routing(p, (experts, topk))


def write_engine_file(path: str | os.PathLike, table: Mapping[int | str, Mapping[str, int]]) -> Path:
    """Write {tokens: config} in the engines' format (sorted token keys, the six keys, nothing else), atomically."""
    p = Path(path)
    entries = {int(k): C.validate_tile_config(v, f"entry {k!r}") for k, v in table.items() if k != "triton_version"}
    doc = {str(k): {kk: int(entries[k][kk]) for kk in C.TILE_KEYS} for k in sorted(entries)}
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(doc, indent=4) + "\n")
    EC.clear_lookup_cache()
    return p


def merge_engine_file(path: str | os.PathLike, entries: Mapping[int, Mapping[str, int]]) -> Path:
    """Merge `entries` into the engine file at `path` (other token counts kept; an unreadable
    old file is replaced)."""
    p = Path(path)
    merged: dict[int, Mapping[str, int]] = {}
    if p.is_file():
        try:
            merged.update(C.load_config_file(p))
        except MoebenchError:
            pass
    merged.update({int(k): dict(v) for k, v in entries.items()})
    return write_engine_file(p, merged)


# ---------------------------------------------------------------------------------------------
# Reading a folder of tuned files: differences, coverage of the presets, committing into the package

#: vLLM's token counts: what a complete file holds (its tuner's default list)
TUNE_TOKENS_CUDA = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]


def diff_tables(a: dict, b: dict) -> list[tuple[int, str]]:
    """Per token count of either table, what differs: 'only in A', 'only in B', or
    'FIELD a->b; ...'. Token counts with identical entries are left out."""
    out = []
    for m in sorted(set(a) | set(b)):
        if m not in b:
            out.append((m, "only in A"))
        elif m not in a:
            out.append((m, "only in B"))
        else:
            d = [f"{k} {a[m][k]}->{b[m][k]}" for k in C.TILE_KEYS if a[m][k] != b[m][k]]
            if d:
                out.append((m, "; ".join(d)))
    return out


def commit_files(files, kernel: str, allow_cpu: bool = False) -> list[tuple[str, Path]]:
    """Validate tuned files and copy them into the package's config folder of `kernel` (moebench ->
    moebench/configs/, an engine -> its folder there); all are checked before any is copied.
    Returns (added | replaced | unchanged, destination) per file."""
    import filecmp

    from moebench.fileio import atomic_write_bytes

    checked = []
    for f in map(Path, files):
        if not f.is_file():
            raise MoebenchError(f"config file {f} does not exist")
        parts = C.parse_file_name(f.name)
        if parts is None:
            raise MoebenchError(f"{f.name} is not a vLLM config file name "
                                f"(E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]][,per_channel_quant=True][_down].json)")
        if kernel == "moebench":
            C.load_config_file(f)  # raises with the file and entry named
            dest_dir = Path(C.PACKAGE_CONFIG_DIR)
        else:
            if parts["down"] or parts["per_channel_quant"]:
                raise MoebenchError(f"{f.name}: --kernel {kernel} files have no _down / per_channel_quant part "
                                    "(the vllm-triton experts run one config for both GEMMs, fp8 block scales only)")
            spaced = ", " in f.name
            if (kernel == "vllm") == spaced and parts["block_shape"]:
                want = "block_shape=[bn,bk] (vLLM's)" if kernel == "vllm" else "block_shape=[bn, bk] (SGLang's)"
                raise MoebenchError(f"{f.name} is not named as {kernel} names its files: {want}")
            EC.load_engine_file(f)
            folder = f.parent.resolve().name
            dest_dir = EC.package_dir(kernel, folder if kernel == "sglang" and EC._TRITON_DIR_RE.match(folder) else None)
        if parts["device"] == "cpu" and not allow_cpu:
            raise MoebenchError(f"{f.name} was tuned on a CPU (Triton-interpreter times say nothing of GPU speed): "
                                f"commit files tuned on the GPU they name, or pass --allow-cpu for a plumbing check")
        checked.append((f, dest_dir))
    done = []
    for f, dest_dir in checked:
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / f.name
        same = dest.exists() and filecmp.cmp(f, dest, shallow=False)
        verb = "unchanged" if same else "replaced" if dest.exists() else "added"
        if not same:
            atomic_write_bytes(dest, f.read_bytes())
        if kernel == "moebench":  # the routing its keys mean goes with it (unknown: none recorded)
            write_tuned_routing(dest, C.tuned_routing(f))
        done.append((verb, dest))
    C.clear_lookup_cache()  # the package's folder changed: this process's lookups look again
    EC.clear_lookup_cache()
    return done
