"""Where the INT4 Gluon kernel's one-row time goes (issue 38): the kernel as it is beside copies of it that read the
same bytes again every step instead of the next ones, graph-timed at the 8B shapes.

    python3 benchmarks/int4_ablate.py --json benchmarks/results/int4-ablate-h200.json

The kernel (`kernels/lowbit_mma.py`) reads 1.9 TB/s of INT4 words at one row on an H100 where its loads alone, in
the same pattern, are served at 2.85-2.9 (`load_pattern.py`, run 136). Each copy here changes one argument in the
kernel's source (found by text, so a change to the kernel that moves it fails here loudly) and is compiled as a
module of its own:
- `x_once`: every step reads the piece's first step's activations (after the first, from the L1), so the
  activations' loads leave each step's path;
- `x_params_once`: also the first group's scales and zero points;
- `all_once`: also the first step's words: nothing comes from DRAM after the first step, and what is left is the
  arithmetic's own time (the dequantization, the MMAs, the loop).
The outputs of the copies are wrong by design; only their times are kept. The difference between `asis` and each
copy bounds what moving those loads off the path could give. The compiler hoists what no longer changes out of the
loop, so the copies also hold fewer registers (sm_90, the default tiling: 122 as it is, 124 `x_once`, 96
`x_params_once` and `all_once`): more programs a multiprocessor may be part of what a copy gains. Also the kernel
with its words in 16-byte loads (`wide`, the default since run 141; `asis` and the copies load them in 8-byte
pairs) at one and 8 rows. Each launch reads its own copy of the weight (past the L2); the table is printed last.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import write_json
from fp8_gemm_sweep import graph_us
from int4_mma import SHAPES, copies_for, nbytes
from lowbit import clone

from tinypaged.kernels import lowbit_mma
from tinypaged.model.quant import lowbit

# Each copy: the text replaced in the kernel's source (applied in order, each on top of the one before).
CHANGES = {
    "x_once": [("(_x_tile(x_rows, m_ok, k0,", "(_x_tile(x_rows, m_ok, k_lo,")],
    "x_params_once": [("_params(s_ptr, z_ptr, kn // GROUP,", "_params(s_ptr, z_ptr, k_lo // GROUP,")],
    "all_once": [
        ("_words_wide(w_ptr, kn,", "_words_wide(w_ptr, k_lo,"),
        ("_words(w_ptr, rows, row_ok, kn,", "_words(w_ptr, rows, row_ok, k_lo,"),
    ],
}


def copies(tmp: Path) -> dict[str, Any]:
    """The kernel's module as it is and each copy, the relative imports made absolute."""
    src = Path(lowbit_mma.__file__).read_text().replace("from .", "from tinypaged.kernels.")
    mods = {"asis": lowbit_mma}
    for name, changes in CHANGES.items():
        for old, new in changes:
            assert old in src, f"{name}: {old!r} is not in the kernel's source"
            src = src.replace(old, new)
        path = tmp / f"int4_ablate_{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod  # Gluon reads the kernel's globals through its module
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "layers": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        mods = copies(Path(tmp))
        for layer, n, k in SHAPES:
            wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
            w = lowbit.quantize_rtn(wb, 4, 128, False)  # the engine's INT4: zero points, groups of 128
            ws = [w] + [clone(w) for _ in range(copies_for(nbytes(w)) - 1)]
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                cfg = lowbit_mma.mma_config(m, n, k, bits=4)[:5]
                row: dict[str, Any] = {"layer": layer, "m": m, "config": cfg}
                for name, mod in mods.items():
                    for wide in (False, True):
                        if (m > 1 or wide) and name != "asis":
                            continue  # the copies at one row, the plain words
                        key = name + ("_wide" if wide else "")
                        row[key] = graph_us(
                            lambda i, mod=mod, c=(*cfg, wide), x=x, ws=ws: mod.wint_mma(x, ws[i], config=c),
                            len(ws),
                        )
                print(row, flush=True)
                res["layers"].append(row)
                write_json(args.json, res)
            del ws
            torch.cuda.empty_cache()
    for m in (1, 8):
        rows = [r for r in res["layers"] if r["m"] == m]
        keys = [k for k in rows[0] if k not in ("layer", "m", "config")]
        print(f"\n| {m} row(s), a layer's four (us) | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        print(
            "| "
            + " / ".join(r["layer"] for r in rows)
            + " | "
            + " | ".join(f"{sum(r[k] for r in rows):.1f}" for k in keys)
            + " |"
        )


if __name__ == "__main__":
    main()
