"""Read the SASS of every ahead-of-time kernel on a machine with a CUDA toolkit (cuobjdump).

    python scripts/gpu_check_kernels.py [ARTIFACT_DIR] [--out DIR]

For each manifest entry: 128-bit global loads (LDG.E.128) present, registers
per thread, local-memory spills. Writes kernels_sass.csv under --out.
"""

import argparse
import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", nargs="?", default=None)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import os

    folder = Path(args.artifacts or os.environ.get("KIMI_DECODE_ARTIFACTS", ".bundle/artifacts"))
    manifest = json.loads((folder / "manifest.json").read_text())
    tool = shutil.which("cuobjdump") or next(iter(Path("/usr/local").glob("cuda*/bin/cuobjdump")), None)
    if tool is None:
        print("no cuobjdump here; SASS not checked")
        return 0
    if not (folder / "cubin").is_dir():
        print(f"no {folder / 'cubin'}: this bundle was built without its cubins (dropped to fit the device call's "
              "64 MiB); SASS not checked")
        return 0
    rows, bad = [], 0
    for e in manifest["kernels"]:
        cubin = folder / "cubin" / (e["symbol"] + ".cubin")
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True).stdout
        res = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        ldg128 = len(re.findall(r"LDG\.E\.128", sass))
        regs = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        lmem = re.search(r"LOCAL:(\d+)", res)
        row = dict(kernel=e["kernel"], key=json.dumps(e["key"], sort_keys=True), ldg_e_128=ldg128,
                   ldg_total=len(re.findall(r"\bLDG\.", sass)), registers=regs and regs.group(1),
                   stack=stack and stack.group(1), local=lmem and lmem.group(1))
        rows.append(row)
        bad += ldg128 == 0
        print(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kernels_sass.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} kernels, {bad} without LDG.E.128")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
