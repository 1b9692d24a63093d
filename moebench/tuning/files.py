"""What the `configs` commands do with tuned files beyond the store (moebench.kernels.tuned_files:
names, reading, lookup, writing and merging for every kernel): differences between two tables,
vLLM's token counts, and committing files into the package's folder of the kernel they are for."""

from __future__ import annotations

from pathlib import Path

from moebench.errors import MoebenchError
from moebench.kernels import tuned_files as TF


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
            d = [f"{k} {a[m][k]}->{b[m][k]}" for k in TF.TILE_KEYS if a[m][k] != b[m][k]]
            if d:
                out.append((m, "; ".join(d)))
    return out


def commit_files(files, kernel: str, allow_cpu: bool = False) -> list[tuple[str, Path]]:
    """Validate tuned files and copy them into the package's config folder of `kernel`
    (moebench/configs/<kernel>/, `tuned_files.package_dir`); all are checked before any is copied.
    Returns (added | replaced | unchanged, destination) per file."""
    import filecmp

    from moebench.fileio import atomic_write_bytes

    checked = []
    for f in map(Path, files):
        if not f.is_file():
            raise MoebenchError(f"config file {f} does not exist")
        parts = TF.parse_file_name(f.name)
        if parts is None:
            raise MoebenchError(f"{f.name} is not a vLLM config file name "
                                f"(E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]][,per_channel_quant=True][_down].json)")
        if kernel == "moebench":
            TF.read(kernel, f)  # raises with the file and entry named
            dest_dir = TF.package_dir(kernel)
        else:
            if parts["down"] or parts["per_channel_quant"]:
                raise MoebenchError(f"{f.name}: --kernel {kernel} files have no _down / per_channel_quant part "
                                    "(the vllm-triton experts run one config for both GEMMs, fp8 block scales only)")
            spaced = ", " in f.name
            if (kernel == "vllm") == spaced and parts["block_shape"]:
                want = "block_shape=[bn,bk] (vLLM's)" if kernel == "vllm" else "block_shape=[bn, bk] (SGLang's)"
                raise MoebenchError(f"{f.name} is not named as {kernel} names its files: {want}")
            TF.read(kernel, f)
            folder = f.parent.resolve().name
            dest_dir = TF.package_dir(kernel, folder if kernel == "sglang" and TF._TRITON_DIR_RE.match(folder) else None)
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
            TF.write_tuned_routing(dest, TF.tuned_routing(f))
        done.append((verb, dest))
    TF.clear_lookup_cache()  # the package's folder changed: this process's lookups look again
    return done
