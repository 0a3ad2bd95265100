"""Re-reads the first large-shape check (results/jagged_attention-check-large-20261130.json) and shows
that padded SDPA's dK/dV "errors" in it are an error of the check, not of SDPA.

    python benchmarks/check_large_reanalysis.py [--source benchmarks/results/jagged_attention-check-large-20261130.json] [--out DIR]

That check drew the upstream gradient at every query row, padded rows included, while its float64
reference used the n valid rows of each sequence only. Padded SDPA gives a padded query row a real output
(it attends to the valid keys), so the upstream gradient of the L - n padded rows flows into SDPA's dK and
dV, and into nothing the reference computes. With independent standard normal upstream rows, the part of
dV that the reference leaves out has, relative to the part it keeps, a norm of about sqrt((L - n) / n).
This script computes that predicted "error" for every checked row and puts it beside the reported one.
No GPU, nothing re-measured: a new file written by this script, with its own command; the source file
is not touched. The corrected check (upstream gradient zero at padded rows) is
benchmarks/jagged_attention_check_large.py, to be re-run on the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from harness import write_json  # noqa: E402

SOURCE = _HERE / "results" / "jagged_attention-check-large-20261130.json"


def reanalyse(source: dict) -> list[dict]:
    L = source["shape"]["L"]
    rows = []
    for row in source["rows"]:
        n = row["length"]
        predicted = math.sqrt((L - n) / n)
        sdpa = row["sdpa_padded_mask"]
        rows.append({
            "batch": row["batch"], "length": n,
            "predicted_sqrt_padded_over_valid": predicted,
            "sdpa_dk_reported": sdpa["dk"], "sdpa_dv_reported": sdpa["dv"],
            "dv_reported_over_predicted": sdpa["dv"] / predicted if predicted else None,
            "dk_reported_over_predicted": sdpa["dk"] / predicted if predicted else None,
            "sdpa_dq_reported": sdpa["dq"], "gemcompile_dq_reported": row["gemcompile"]["dq"],
        })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--out", default=None, help="directory of the JSON (default: $OUT, else results/)")
    args = parser.parse_args(argv)
    source = json.loads(args.source.read_text())
    rows = reanalyse(source)
    ratios = [r["dv_reported_over_predicted"] for r in rows if r["dv_reported_over_predicted"] is not None]
    payload = {
        "benchmark": "jagged_attention_check_large_reanalysis",
        "source": str(args.source.resolve().relative_to(_HERE.parent)) if args.source.resolve().is_relative_to(
            _HERE.parent) else str(args.source),
        "source_shape": source["shape"],
        "method": "predicted = sqrt((L - n) / n): the relative norm of the upstream gradient of the padded query "
                  "rows against that of the valid rows; reported = the source file's SDPA dK/dV relative errors",
        "rows": rows,
        "dv_reported_over_predicted_min": min(ratios),
        "dv_reported_over_predicted_max": max(ratios),
    }
    for r in rows:
        print(f"batch {r['batch']:5d} n {r['length']:5d}  predicted {r['predicted_sqrt_padded_over_valid']:.4f}  "
              f"SDPA dV {r['sdpa_dv_reported']:.4f}  dK {r['sdpa_dk_reported']:.4f}")
    print(f"results in {write_json('jagged_attention-check-large-reanalysis', payload, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
