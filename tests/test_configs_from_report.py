"""scripts/configs_from_report.py: a tune report's winners become the file the tuner wrote."""

import json
import subprocess
import sys
from pathlib import Path

from moebench.kernels.tuned_files import load_config_file

ROOT = Path(__file__).resolve().parents[1]
REPORT = """# moebench tune: deepseek-v3 (E=256, topk=8, H=7168, I=2048), EP8 (dp 8 x tp 1)

- file: `/root/out/configs/E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json`

| tokens | winner | winner_us | runner_up | runner_up_us | default | default_us | speedup | candidates | failed | search_s |
|---|---|---|---|---|---|---|---|---|---|---|
| 1 | M16,N64,K128,G1,w4,s3 | 60.3 | M16,N64,K128,G16,w4,s5 | 66.2 | M16,N64,K128,G16,w4,s3 | 66.6 | 1.104 | 6 | 0 | 6.8 |
| 4096 | M64,N128,K128,G1,w4,s3 | 1398.4 | M64,N128,K128,G1,w4,s4 | 1399.8 | M128,N256,K128,G8,w8,s4 | 3423.3 | 2.448 | 37 | 0 | 67.7 |
"""


def test_rebuilds_the_vllm_file(tmp_path):
    rep = tmp_path / "report.md"
    rep.write_text(REPORT)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "configs_from_report.py"), str(rep), "--out",
                          str(tmp_path), "--triton-version", "3.6.0"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert res.returncode == 0, res.stderr
    path = tmp_path / "E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    doc = json.loads(path.read_text())
    assert doc["triton_version"] == "3.6.0" and set(doc) == {"triton_version", "1", "4096"}
    assert doc["4096"] == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                           "num_warps": 4, "num_stages": 3}
    assert sorted(load_config_file(path)) == [1, 4096]
