"""The paper's evaluation driver (benchmarks/paper_eval.py) end to end on the default model at a tiny scale,
with lengths from a tiny Alpaca file: requests served under arrivals with their latencies and the engine's step
statistics, the sharing comparison, the figures, and the policies the engine does not have yet recorded as
such; the pure pieces on made-up numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import paper_plots
import pytest
from paper_eval import LLAMA_13B_MHA, engine_args, parse_args, policy_supported, run, sustained, table


def test_tiny_run_end_to_end(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "paper.json"
    alpaca = tmp_path / "alpaca.json"  # short outputs: few steps
    items = [("Name a colour.", "", "Blue."), ("Translate to French:", "good morning", "Bonjour.")]
    alpaca.write_text(json.dumps([{"instruction": i, "input": x, "output": o} for i, x, o in items]))
    args = parse_args(
        ["--smoke", "--model", str(model_dir), "--sections", "rates", "sharing", "block_sizes"]
        + ["--workloads", "alpaca", "--block-sizes", "16", "256"]
        + ["--alpaca-rates", "40", "--policies", "paged", "orca-oracle", "--json", str(out)]
        + ["--alpaca-file", str(alpaca)]
    )
    args.num_requests, args.sharing_requests = 3, 2
    res = run(args)
    assert json.loads(out.read_text())["benchmark"] == "paper_eval"
    sweep = res["rates"]["paged"]["alpaca"]
    (r,) = sweep["runs"]
    assert r["rate"] == 40 and r["completed"] == 3 and r["num_errors"] == 0
    assert 0 < r["mean_latency_s"] and 0 < r["mean_norm_latency_s"] <= r["mean_latency_s"]
    assert sweep["saturated"]["rate"] == math.inf and sweep["saturated"]["completed"] == 3
    assert 1 <= r["max_batch_seqs"] <= 3 and 0 < r["peak_kv_usage"] <= 1
    assert 0 < r["peak_slot_utilization"] <= 1
    assert len(r["series"]["t_s"]) == len(r["series"]["kv_usage"]) > 0
    assert sweep["sustained"]["max_rate"] == 40  # one rate: the bound is twice its own latency
    assert policy_supported("orca-oracle")
    orca = res["rates"]["orca-oracle"]["alpaca"]["runs"][0]
    assert orca["completed"] == 3 and orca["num_errors"] == 0
    assert r["peak_waste"]["reserved"] == r["peak_waste"]["external"] == 0  # paged reserves nothing ahead
    assert 0 <= orca["peak_waste"]["reserved"] < 1 and len(orca["series"]["kv_waste"]) > 0
    assert res["sharing"]["workload"]["source"].endswith("alpaca.json")  # lengths from the file
    for kind in ("parallel_sampling_2", "beam_search_2"):
        row = res["sharing"][kind]
        assert row["shared"]["peak_blocks"] <= row["independent"]["peak_blocks"]
        assert row["shared"]["block_steps"] <= row["independent"]["block_steps"]
    assert "sharing (Alpaca shape)" in table(res)
    assert res["block_sizes"]["16"]["alpaca"]["completed"] == 3
    assert "block_size" in res["block_sizes"]["256"]["error"]  # the engine refuses it; the sweep goes on
    paper_plots.main([str(out), "--out", str(tmp_path / "img")])
    drawn = {p.name for p in (tmp_path / "img").iterdir()}
    assert drawn == {
        f"paper_{n}.png"
        for n in ("latency_vs_rate", "kv_waste", "batch_kv_over_time", "sharing", "block_size")
    }


def test_engine_args_carry_the_policy_and_capacity() -> None:
    args = parse_args(["--kv-tokens", "15000", "--policies", "paged", "orca-max"])
    kw = engine_args(args, "orca-max", block_size=32)
    assert kw["kv_reservation"] == "orca-max"  # passed on once the engine takes it; refused there until then
    assert kw["num_gpu_blocks_override"] == 15000 // 32 and kw["enable_prefix_caching"] is False
    assert kw["max_model_len"] == 2048
    assert ("kv_reservation" in engine_args(args, "paged")) == policy_supported("orca-max")


def test_sustained_rate_under_the_bound() -> None:
    def r(rate: float, norm: float, errors: int = 0) -> dict:
        return {"rate": rate, "completed": 10, "mean_norm_latency_s": norm, "num_errors": errors}

    runs = [r(4, 0.030), r(1, 0.010), r(2, 0.019), r(8, 0.5), r(math.inf, 0.9)]
    assert sustained(runs, None, 2.0) == {"bound_s_per_token": pytest.approx(0.02), "max_rate": 2}
    assert sustained(runs, 0.04, 2.0)["max_rate"] == 4
    assert sustained([r(1, 0.01), r(2, 0.011, errors=1)], None, 2.0)["max_rate"] == 1
    assert sustained([r(math.inf, 0.1)], None, 2.0)["max_rate"] is None


def test_the_13b_shape_is_multi_head_with_ids_in_its_vocabulary() -> None:
    shape = LLAMA_13B_MHA
    assert shape["num_attention_heads"] == shape["num_key_value_heads"] == 40
    assert (
        256 <= shape["bos_token_id"] < shape["vocab_size"]
        and 256 <= shape["eos_token_id"] < shape["vocab_size"]
    )


def test_sweeps_join_across_files() -> None:
    """A policy's runs from a later file join its sweep: a run at the same rate is replaced, and the sustained
    rate is found again under the first sweep's bound."""

    def run(rate: float, lat: float, errors: int = 0) -> dict:
        return {"rate": rate, "mean_norm_latency_s": lat, "num_errors": errors, "completed": 3 - errors}

    a = {"runs": [run(3, 0.01), run(6, 0.03)], "sustained": {"bound_s_per_token": 0.02, "max_rate": 3}}
    b = {"runs": [run(4, 0.015), run(5, 0.019, 1), run(6, 0.018)], "sustained": {"bound_s_per_token": None}}
    j = paper_plots.join_sweeps(a, b)
    assert [r["rate"] for r in j["runs"]] == [3, 4, 5, 6]
    assert j["runs"][-1]["mean_norm_latency_s"] == 0.018  # the later file's run at 6
    assert j["sustained"] == {"bound_s_per_token": 0.02, "max_rate": 6}  # 5 failed requests: not sustained


def test_paper_all_runs_valid_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`paper_all.py`, the one command that runs the evaluation again: every step's arguments parse as
    `paper_eval.py`'s, on the 13B shape at the paper's capacity where the step is a 13B one, each writing its
    own file, and the figures drawn from every file the steps write; a dry run prints them and runs nothing."""
    import paper_all

    plan = paper_all.steps("/m8", "/m13", tmp_path, "-t")
    files = set()
    for name, argv in plan.items():
        args = parse_args(argv)
        assert args.json not in files and Path(args.json).parent == tmp_path
        files.add(args.json)
        if name.endswith(("13b", "13b-orca-between", "13b-paged-between", "paged", "orca", "sharegpt10")):
            assert (args.model, args.random_shape, args.kv_tokens) == ("/m13", "llama-13b-mha", 15000), name
    assert paper_all.main(["--results", str(tmp_path), "--tag", "t", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert all(f in printed.split("=== plots: ")[1] for f in files)
    assert "model-8b" in printed and not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        paper_all.main(["--steps", "nonesuch", "--dry-run"])
