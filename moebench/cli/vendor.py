"""`vendor`: the optional vendor libraries: what is installed and runs here (`vendor status`), the
package-index build that goes with the installed torch (`vendor install`), its wheel for a
machine without network (`vendor download`). torch is never installed, upgraded or removed."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import click
from rich.text import Text

from moebench.cli.options import console
from moebench.errors import MoebenchError
from moebench.report import say


def status_lines(rows: list[dict]) -> list[Text]:
    """`env`'s and `vendor status`'s lines: one per library, then what to install where it helps."""
    out = []
    for r in rows:
        what = "not installed" if r["distribution"] is None else (
            f"{r['distribution']} {r['version']}" if r["distribution"] else "importable (no package metadata)")
        state = ("usable", "green") if r["usable"] else ("not usable", "red")
        uses = f" (backends {', '.join(r['backends'])})" if r["backends"] else " (no moebench backend uses it yet)"
        line = Text.assemble((r["module"], "bold"), f": {what}, ", state, uses)
        if r["reason"] and r["distribution"] is not None:
            line.append(f": {r['reason']}")
        out.append(line)
        if r["install"]:
            out.append(Text(f"  to install: {r['install']}"))
    return out


@click.group()
def vendor():
    """Optional vendor libraries (DeepGEMM, DeepEP, triton_kernels, aiter): status and install."""


@vendor.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(as_json: bool):
    """Per library: installed version, whether it runs here and why not, what to install for this torch."""
    from moebench.vendor import KNOWN_BUILDS_SOURCE, Here, statuses

    here = Here.detect()
    rows = [s.as_dict() for s in statuses(here)]
    if as_json:
        click.echo(json.dumps({"torch": here.torch, "cuda": here.cuda, "python": here.python,
                               "libraries": rows, "known_builds_source": KNOWN_BUILDS_SOURCE}, indent=2))
        return
    say(console, f"torch {here.torch} (CUDA {here.cuda or 'none'}), Python {here.python}", "bold")
    for line in status_lines(rows):
        say(console, line)
    say(console, f"known builds: {KNOWN_BUILDS_SOURCE}")


def _check_installed_from(lib, build) -> bool:
    """True when exactly `build` is installed already; refuses a module installed by another
    distribution (a source build would be overwritten file by file)."""
    from moebench.vendor import installed

    found = installed(lib.module)
    if found is None:
        return False
    dist, version = found
    if not dist:
        raise MoebenchError(f"{lib.module} is importable from a folder without package metadata; take it off the "
                            f"Python path before installing {build.package}, or keep it")
    if dist.lower().replace("_", "-") != build.package:
        raise MoebenchError(f"{lib.module} is installed by '{dist}' {version} (a source build?); remove it first "
                            f"(python -m pip uninstall {dist}) to install {build.package}, or keep it")
    return version == build.version


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


@vendor.command("install")
@click.argument("name")
@click.option("--version", "version", default=None, help="Install this build instead of the one picked for this torch.")
@click.option("--dry-run", is_flag=True, help="Print the pip command and what the pick rests on; install nothing.")
@click.option("--find-links", "find_links", default=None, type=click.Path(file_okay=False),
              help="Install from this folder of wheels (no index), e.g. wheels carried to a machine without network.")
@click.option("--target", default=None, type=click.Path(file_okay=False),
              help="Install into this folder (put it on PYTHONPATH) instead of this Python's site-packages.")
def install(name: str, version: str | None, dry_run: bool, find_links: str | None, target: str | None):
    """Install NAME (deepgemm | deepep | triton-kernels) from the package index: the build that goes
    with the torch (triton-kernels: the triton) installed here, with --no-deps (torch stays as it
    is), then check that it imports."""
    from moebench.vendor import install_command, library, pick_build, shell

    lib = library(name)
    if lib.package is None:
        raise MoebenchError(f"moebench does not install {lib.module}: get it from {lib.source}")
    if find_links is not None and not os.path.isdir(find_links):
        raise MoebenchError(f"--find-links {find_links}: no such folder")
    build, note = pick_build(lib.key, version=version)
    if build is None:
        raise MoebenchError(note)
    cmd = install_command(build, sys.executable, find_links, target)
    if dry_run:
        click.echo(shell(cmd))
        say(console, f"{build.package} {build.version}: {note}")
        return
    if target is None and _check_installed_from(lib, build):
        say(console, f"{build.package} {build.version} is installed already ({note})")
        return
    torch_before = _torch_version()
    say(console, f"installing {build.package} {build.version} without dependencies (torch {torch_before} stays): "
                 f"{shell(cmd)}")
    res = subprocess.run(cmd)
    if res.returncode != 0:
        say(console, f"pip failed (exit status {res.returncode}); nothing of torch was touched")
        sys.exit(1)
    if _torch_version() != torch_before:  # --no-deps never touches torch; checked all the same
        raise MoebenchError(f"torch changed from {torch_before} to {_torch_version()} during the install")
    env = dict(os.environ)
    if target:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(target), env.get("PYTHONPATH")) if p)
    # the import as moebench makes it: the libraries the module declares (NVSHMEM's for deep_ep) loaded first
    probe = f"from moebench.vendor import preload_libraries; preload_libraries({lib.module!r}); import {lib.module}"
    check = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    if check.returncode != 0:
        last = (check.stderr.strip().splitlines() or [f"exit status {check.returncode}"])[-1]
        say(console, f"{build.package} {build.version} installed, but {lib.module} does not import: {last}")
        sys.exit(1)
    where = f" (from {target}: put it on PYTHONPATH)" if target else ""
    say(console, f"{build.package} {build.version} installed; {lib.module} imports{where}. `moebench env` says which "
                 f"backends run here.")


def _for(lib, target) -> str:
    return f"triton {target.triton}" if lib.pure_python else f"torch {target.torch}"


def _cuda_of(torch_version: str) -> str | None:
    """'2.11.0+cu130' -> '13.0'; None without a +cuNNN tag."""
    m = re.search(r"\+cu(\d+)(\d)$", torch_version)
    return f"{int(m.group(1))}.{m.group(2)}" if m else None


@vendor.command("download")
@click.argument("name")
@click.option("--dest", required=True, type=click.Path(file_okay=False), help="Folder the wheel goes into.")
@click.option("--torch", "torch_version", default=None,
              help="The torch of the machine the wheel is for, e.g. 2.11.0+cu130 [this torch].")
@click.option("--cuda", default=None, help="Its CUDA version [from --torch's +cuNNN tag, else this torch's].")
@click.option("--python", "python_version", default=None, help="Its Python, e.g. 3.12 [this Python].")
@click.option("--platform", "platform_tag", default=None,
              help="Its wheel platform [manylinux_2_28_<this machine>], e.g. manylinux_2_28_x86_64.")
@click.option("--triton", "triton_version", default=None,
              help="The triton of the machine the wheel is for (triton-kernels' builds go with a triton) [this triton].")
@click.option("--version", "version", default=None, help="This build instead of the one picked for that torch.")
@click.option("--dry-run", is_flag=True, help="Print the pip command; download nothing.")
def download(name, dest, torch_version, cuda, python_version, platform_tag, triton_version, version, dry_run):
    """Download NAME's wheel (deepgemm | deepep | triton-kernels) for another machine's torch (or
    triton), without dependencies: install it there with `moebench vendor install NAME --find-links DEST`."""
    from moebench.vendor import Here, download_command, library, pick_build, shell

    lib = library(name)
    if lib.package is None:
        raise MoebenchError(f"moebench does not install {lib.module}: get it from {lib.source}")
    here = Here.detect()
    tag = re.fullmatch(r"manylinux_\d+_\d+_(x86_64|aarch64)", platform_tag) if platform_tag is not None else None
    if platform_tag is not None and tag is None:
        raise MoebenchError(f"--platform {platform_tag}: expected manylinux_2_N_x86_64 or manylinux_2_N_aarch64")
    if python_version is not None and not re.fullmatch(r"3\.\d+", python_version):
        raise MoebenchError(f"--python {python_version}: expected a version such as 3.12")
    tv = torch_version or here.torch
    target = Here(torch=tv, cuda=cuda or _cuda_of(tv) or (here.cuda if torch_version is None else None),
                  python=python_version or here.python, system="Linux" if tag else here.system,
                  machine=tag.group(1) if tag else here.machine, triton=triton_version or here.triton)
    build, note = pick_build(lib.key, target, version=version)
    if build is None:
        raise MoebenchError(note)
    cmd = download_command(build, dest, target.python, platform_tag or f"manylinux_2_28_{target.machine}", sys.executable)
    if dry_run:
        click.echo(shell(cmd))
        say(console, f"{build.package} {build.version} for {_for(lib, target)}: {note}")
        return
    res = subprocess.run(cmd)
    if res.returncode != 0:
        say(console, f"pip failed (exit status {res.returncode})")
        sys.exit(1)
    say(console, f"{build.package} {build.version} for {_for(lib, target)} is in {dest}; on that machine: "
                 f"moebench vendor install {lib.key} --find-links {dest}")
