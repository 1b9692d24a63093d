"""The vendor libraries' index builds: which build goes with which torch, what `env` / `vendor
status` say per library, and `vendor install` / `download`: the pip command (always --no-deps,
never torch), its refusals (one line, exit 2), and a real install of a stand-in wheel from a
local folder."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import sys
import zipfile

import pytest

from moebench import vendor
from moebench.errors import MoebenchError
from moebench.vendor import Here, library_status, pick_build
from test_cli import assert_bad_input, moebench_inproc

T211 = Here(torch="2.11.0+cu130", cuda="13.0", python="3.12")
T214 = Here(torch="2.14.0+cu130", cuda="13.0", python="3.12")


@pytest.mark.parametrize("spec,version,ok", [
    ("2.11", "2.11.0+cu130", True), ("2.11", "2.11.1", True), ("2.11", "2.1.0", False), ("2.11", "2.12.0", False),
    ("2.14.0", "2.14.0+cu130", True), ("2.14.0", "2.14.1", False), ("2.14.0", "2.14", True),
])
def test_torch_matches(spec, version, ok):
    assert vendor.torch_matches(spec, version) is ok


def test_picks_the_build_that_ran_with_this_torch():
    b, note = pick_build("deepgemm", T211)
    assert (b.package, b.version) == ("tokenspeed-deepgemm", "2.5.0.post20260424") and "ran with torch 2.11" in note
    b, _ = pick_build("deepep", T211)
    assert (b.package, b.version) == ("tokenspeed-deepep", "1.2.1.post20251110")
    b, _ = pick_build("deep_ep", Here(torch="2.11.1+cu130", cuda="13.0", python="3.10"))  # module name works too
    assert b.version == "1.2.1.post20251110"


def test_pinned_builds_are_picked_only_for_their_torch_and_pythons():
    b, note = pick_build("deepgemm", T214)
    assert b.version == "2.8.2.post20261020" and "not yet run by moebench" in note
    b, _ = pick_build("deepgemm", Here(torch="2.14.0+cu130", cuda="13.0", python="3.10"))  # 2.8.2 has no cp310
    assert b.version == "2.8.0.post20260924"
    b, why = pick_build("deepep", T214)
    assert b is None and "no tokenspeed-deepep build is known to go with torch 2.14.0+cu130" in why
    assert "1.2.1.post20251110 runs with torch 2.11" in why and "from source" in why
    b, why = pick_build("deepgemm", Here(torch="2.13.0+cu130", cuda="13.0", python="3.12"))
    assert b is None and "2.8.2.post20261020 requires torch==2.14.0" in why


@pytest.mark.parametrize("here,needle", [
    (Here(torch="2.11.0+cpu", cuda=None, python="3.12"), "is a CPU build"),
    (Here(torch="2.11.0+cu128", cuda="12.8", python="3.12"), "built for CUDA 12.8"),
    (Here(torch="2.11.0+rocm7.0", cuda=None, hip="7.0", python="3.12"), "ROCm build"),
    (Here(torch="2.11.0+cu130", cuda="13.0", python="3.9"), "this is Python 3.9"),
    (Here(torch="2.11.0", cuda="13.0", python="3.12", system="Darwin", machine="arm64"), "this is Darwin arm64"),
])
def test_no_build_where_no_wheel_fits(here, needle):
    for key in ("deepgemm", "deepep"):
        b, why = pick_build(key, here)
        assert b is None and needle in why, why


def test_asked_for_versions():
    b, why = pick_build("deepep", T211, version="2.1.0.post20260810")
    assert b is None and "known to fail" in why and "ncclCommQueryProperties" in why
    b, why = pick_build("deepgemm", T211, version="2.8.2.post20261020")
    assert b is None and "requires torch==2.14.0" in why and "never replaces torch" in why
    b, note = pick_build("deepgemm", T211, version="2.6.1.post20260827")  # not in the table: taken, said so
    assert b.version == "2.6.1.post20260827" and "not run by moebench" in note
    b, why = pick_build("deepgemm", Here(torch="2.11.0+cu130", cuda="13.0", python="3.10"),
                        version="2.8.2.post20261020")
    assert b is None
    with pytest.raises(MoebenchError, match="unknown vendor library 'deepgem'"):
        pick_build("deepgem", T211)


def test_pip_commands_never_take_dependencies():
    b, _ = pick_build("deepep", T211)
    for cmd in (vendor.install_command(b), vendor.install_command(b, "py", "/w", "/t")):
        assert "--no-deps" in cmd and not any("torch" in c for c in cmd)
        assert cmd[-1] == "tokenspeed-deepep==1.2.1.post20251110"
    assert vendor.install_command(b, find_links="/w")[5:8] == ["--no-index", "--find-links", "/w"]
    d = vendor.download_command(b, "/w", "3.12", "manylinux_2_28_x86_64")
    assert {"--no-deps", "--only-binary=:all:"} <= set(d) and d[-1] == "tokenspeed-deepep==1.2.1.post20251110"


def _status(name, here, found, imp=None, dev=None):
    return library_status(name, here, installed_fn=lambda m: found, import_fn=lambda m: imp,
                          device_fn=lambda m: dev)


def test_status_missing_names_the_build_for_this_torch():
    s = _status("deepep", T211, None)
    assert not s.usable and s.reason == "deep_ep is not installed"
    assert "moebench vendor install deepep" in s.install
    assert "pip install --no-deps tokenspeed-deepep==1.2.1.post20251110" in s.install
    assert s.pick["version"] == "1.2.1.post20251110"
    s = _status("deepep", T214, None)
    assert s.install.startswith("no index build for this torch") and s.pick is None


def test_status_of_a_build_known_to_fail_here():
    err = "deep_ep does not import: ImportError: undefined symbol: ncclCommQueryProperties"
    s = _status("deepep", T211, ("tokenspeed-deepep", "2.1.0.post20260810"), imp=err)
    assert not s.usable and err in s.reason and "known to fail with torch 2.11" in s.reason
    assert "tokenspeed-deepep==1.2.1.post20251110" in s.install
    # a pinned build beside another torch: imports (say), but is not the build for it
    s = _status("deepgemm", T211, ("tokenspeed-deepgemm", "2.8.2.post20261020"))
    assert s.usable and "requires torch==2.14.0" in s.reason and "2.5.0.post20260424" in s.install


def test_status_installed_and_working_needs_nothing():
    s = _status("deepep", T211, ("tokenspeed-deepep", "1.2.1.post20251110"), dev="deep_ep needs a CUDA GPU")
    assert not s.usable and s.reason == "deep_ep needs a CUDA GPU" and s.install == ""
    s = _status("deepgemm", T211, ("deep_gemm", "2.6.1"))  # a source build that imports: left alone
    assert s.usable and s.reason == "" and s.install == ""
    s = _status("aiter", T211, None)
    assert "github.com/ROCm/aiter" in s.install and s.pick is None


def test_env_json_lists_every_vendor_library():
    res = moebench_inproc("env", "--json")
    assert res.returncode == 0, res.stderr
    libs = {v["module"]: v for v in json.loads(res.stdout)["vendor"]}
    assert set(libs) == {"deep_gemm", "deep_ep", "triton_kernels", "aiter"}
    for v in libs.values():
        assert set(v) >= {"distribution", "version", "usable", "reason", "install"}
    res = moebench_inproc("vendor", "status", "--json")
    assert res.returncode == 0 and "known_builds_source" in json.loads(res.stdout)


@pytest.fixture
def torch_211(monkeypatch):
    monkeypatch.setattr(vendor.Here, "detect", classmethod(lambda cls: T211))


def test_install_dry_run_prints_the_exact_command(torch_211):
    res = moebench_inproc("vendor", "install", "deepgemm", "--dry-run")
    assert res.returncode == 0, res.stderr
    cmd = res.stdout.splitlines()[0]
    assert cmd == f"{sys.executable} -m pip install --no-deps tokenspeed-deepgemm==2.5.0.post20260424"


@pytest.mark.parametrize("args,needles", [
    (["install", "deepep", "--version", "2.1.0.post20260810"], ["known to fail", "ncclCommQueryProperties"]),
    (["install", "deepgemm", "--version", "2.8.2.post20261020"], ["requires torch==2.14.0"]),
    (["install", "deepgemm", "--find-links", "/no/such/folder"], ["no such folder"]),
    (["install", "aiter"], ["does not install aiter"]),
    (["install", "deepgem"], ["unknown vendor library"]),
    (["download", "deepep", "--dest", "w", "--platform", "win_amd64"], ["--platform"]),
    (["download", "deepep", "--dest", "w", "--torch", "2.14.0+cu130"], ["no tokenspeed-deepep build"]),
    (["download", "deepep", "--dest", "w", "--torch", "2.11.0+cu128"], ["CUDA 12.8"]),
])
def test_refusals_are_one_line(torch_211, tmp_path, args, needles):
    assert_bad_input(moebench_inproc("vendor", *args, cwd=tmp_path), *needles)
    assert list(tmp_path.iterdir()) == []


def test_refused_on_this_cpu_torch():
    import torch

    if torch.version.cuda and torch.version.cuda.startswith("13"):
        pytest.skip("this torch is a CUDA 13 build")
    assert_bad_input(moebench_inproc("vendor", "install", "deepep"), "torch")


def test_download_picks_for_the_other_machines_torch(tmp_path):
    res = moebench_inproc("vendor", "download", "deepep", "--dest", str(tmp_path / "w"), "--torch", "2.11.0+cu130",
                          "--python", "3.12", "--platform", "manylinux_2_28_x86_64", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].endswith(
        "--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d "
        f"{tmp_path / 'w'} tokenspeed-deepep==1.2.1.post20251110")


def _wheel(folder, package, version, init_text):
    """A pure-Python stand-in wheel of `package` holding module deep_ep."""
    name = package.replace("-", "_")
    dist_info = f"{name}-{version}.dist-info"
    files = {"deep_ep/__init__.py": init_text,
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\nRequires-Dist: torch==9.9\n",
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{dist_info}/top_level.txt": "deep_ep\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist_info}/RECORD"] = "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n"
    folder.mkdir(exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.mark.parametrize("works", [True, False], ids=["imports", "broken"])
def test_install_from_a_folder_of_wheels(torch_211, tmp_path, works):
    """The real pip run, offline: the stand-in declares torch==9.9, which --no-deps ignores;
    torch is untouched; the import check runs in a new process against --target."""
    _wheel(tmp_path / "w", "tokenspeed-deepep", "1.2.1.post20251110",
           "X = 1\n" if works else "raise ImportError('undefined symbol: ncclCommQueryProperties')\n")
    torch_before = importlib.metadata.version("torch")
    res = moebench_inproc("vendor", "install", "deepep", "--find-links", str(tmp_path / "w"),
                          "--target", str(tmp_path / "site"))
    assert importlib.metadata.version("torch") == torch_before
    assert (tmp_path / "site" / "deep_ep" / "__init__.py").exists()
    assert not (tmp_path / "site" / "torch").exists()
    if works:
        assert res.returncode == 0, res.stdout + res.stderr
        assert "deep_ep imports" in res.stdout
    else:
        assert res.returncode == 1, res.stdout + res.stderr
        assert "does not import" in res.stdout and "ncclCommQueryProperties" in res.stdout


# triton_kernels: a pure-Python wheel whose builds go with a triton, not a torch

def _with_triton(here: Here, triton: str | None) -> Here:
    import dataclasses

    return dataclasses.replace(here, triton=triton)


@pytest.mark.parametrize("here", [T211, Here(torch="2.13.0+cpu", cuda=None, python="3.11")], ids=["cu130", "cpu"])
def test_triton_kernels_build_goes_with_the_triton(here):
    b, note = pick_build("triton-kernels", _with_triton(here, "3.8.0"))
    assert (b.package, b.version) == ("tokenspeed-triton-kernels", "1.0.0.post20260510")
    assert "triton 3.8" in note and "not yet run on a GPU" in note
    b, why = pick_build("triton-kernels", _with_triton(here, "3.6.0"))
    assert b is None and "known to go with triton 3.6.0" in why and "is_hip_gfx1250" in why
    b, why = pick_build("triton-kernels", _with_triton(here, "3.6.0"), version="1.0.0.post20260510")
    assert b is None and "known to fail with triton 3.6.0" in why
    b, note = pick_build("triton-kernels", _with_triton(here, "3.10.0"), version="1.1.0")
    assert b.version == "1.1.0" and "not known to moebench with triton 3.10.0" in note
    b, why = pick_build("triton-kernels", _with_triton(here, None))
    assert b is None and "triton is not installed" in why


def test_triton_kernels_status_and_known_failure():
    s = _status("triton-kernels", _with_triton(T211, "3.6.0"), ("tokenspeed-triton-kernels", "1.0.0.post20260510"),
                imp="triton_kernels does not import: ImportError: cannot import name 'is_hip_gfx1250'")
    assert not s.usable and "known to fail with triton 3.6" in s.reason and s.backends == ["triton-kernels"]
    s = _status("triton-kernels", _with_triton(T211, "3.9.0"), None)
    assert "moebench vendor install triton-kernels" in s.install and "tokenspeed-triton-kernels==1.0.0.post20260510" in s.install


def test_triton_kernels_install_and_download_dry_run(monkeypatch, tmp_path):
    monkeypatch.setattr(vendor.Here, "detect", classmethod(lambda cls: _with_triton(T211, "3.9.0")))
    res = moebench_inproc("vendor", "install", "triton-kernels", "--dry-run", "--find-links", str(tmp_path),
                          "--target", str(tmp_path / "site"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == (f"{sys.executable} -m pip install --no-deps --no-index --find-links {tmp_path} "
                                          f"--target {tmp_path / 'site'} tokenspeed-triton-kernels==1.0.0.post20260510")
    res = moebench_inproc("vendor", "download", "triton-kernels", "--dest", str(tmp_path / "w"), "--python", "3.12",
                          "--platform", "manylinux_2_28_x86_64", "--triton", "3.8.0", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].endswith(f"-d {tmp_path / 'w'} tokenspeed-triton-kernels==1.0.0.post20260510")
    assert "for triton 3.8.0" in res.stdout
    assert_bad_input(moebench_inproc("vendor", "download", "triton-kernels", "--dest", str(tmp_path / "w"),
                                     "--triton", "3.6.0", "--dry-run"), "is_hip_gfx1250")


def test_deepep_ll_dispatch_tokens_are_what_deepep_takes():
    """DeepEP's low-latency kernels need ranks x num_max_dispatch_tokens_per_rank a multiple of 4:
    the adapter rounds the tokens per rank up to the next such count, never down."""
    from moebench.dispatch.deepep_ll import DeepEPLLPrepareAndFinalize, dispatch_tokens_for

    for world in (2, 3, 4, 6, 8, 16):
        for tokens in (1, 2, 3, 5, 16, 127, 128):
            n = dispatch_tokens_for(tokens, world)
            assert n >= tokens and (world * n) % 4 == 0 and n - tokens < 4, (world, tokens, n)
    assert [dispatch_tokens_for(1, w) for w in (2, 3, 4, 8)] == [2, 4, 1, 1]
    assert DeepEPLLPrepareAndFinalize(max_tokens_per_rank=1).dispatch_tokens(2) == 2


def test_preload_declares_nvshmem_for_deep_ep_and_is_quiet_without_it(monkeypatch):
    from moebench import vendor

    assert vendor.library("deepep").preload == ("nvidia.nvshmem", ("libnvshmem_host.so.3",))
    loaded = []
    monkeypatch.setattr("ctypes.CDLL", lambda path, mode=0: loaded.append(path))
    monkeypatch.setattr(vendor.importlib.util, "find_spec", lambda name: None)
    vendor.preload_libraries("deep_ep")  # no nvidia.nvshmem here: nothing loaded, no error
    vendor.preload_libraries("deep_gemm")  # declares nothing
    assert loaded == []
