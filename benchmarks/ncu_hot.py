"""Prints the SASS lines of an ncu report's kernel with the most stall samples.

    ncu --import-source yes --set full -o rep ...   (on the device)
    python3 -m benchmarks.ncu_hot rep.ncu-rep [N]

It reads `ncu --page source --csv --print-source sass` and sorts by the
"Warp Stall Sampling (All Samples)" column; each line shows the samples, the
instruction and the top stall reasons ncu gives for it.
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    report, top = argv[0], int(argv[1]) if len(argv) > 1 else 40
    text = subprocess.run(
        ["/usr/local/cuda/bin/ncu", "--import", report, "--page", "source", "--csv", "--print-source", "sass"],
        capture_output=True, text=True, check=False,
    ).stdout
    rows = list(csv.reader(io.StringIO(text)))
    head = next((i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r)), None)
    if head is None:
        print("no source table in the report:", text[:500])
        return
    header = rows[head]
    col = next(i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c)
    src = next((i for i, c in enumerate(header) if c.strip() == "Source"), 1)
    body = []
    for r in rows[head + 1:]:
        if len(r) != len(header):
            continue
        try:
            body.append((float(r[col] or 0), r))
        except ValueError:
            continue
    total = sum(v for v, _ in body) or 1.0
    print(f"{len(body)} SASS lines, {total:.0f} samples")
    for v, r in sorted(body, key=lambda x: -x[0])[:top]:
        print(f"{v:8.0f} {100 * v / total:5.1f}%  {r[src][:110]}")


if __name__ == "__main__":
    main()
