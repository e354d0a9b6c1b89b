"""benchmarks/serve_bench.py against the live server: every request completes with
exactly the output length it asked for, and a sweep writes its plot."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.serve_bench import main, make_workload, parse_args


@pytest.mark.parametrize("workload", ["random", "shared-prefix"])
def test_sweep_completes_every_request_at_its_fixed_length(live_server, tmp_path, workload):
    plot = tmp_path / "sweep.png"
    args = parse_args([
        "--base-url", live_server.url, "--api-key", "test-key", "--num-requests", "6",
        "--sweep", "1,4", "--plot", str(plot), "--workload", workload, "--prefix-len", "8",
        "--min-input-len", "4", "--max-input-len", "20",
        "--min-output-len", "3", "--max-output-len", "9",
    ])  # fmt: skip
    expected_tokens = sum(make_workload(args).output_lens)

    summaries = asyncio.run(main(args))

    assert [s["concurrency"] for s in summaries] == [1, 4]
    for s in summaries:
        assert (s["completed"], s["failed"]) == (6, 0)
        assert s["output_throughput"] * s["duration_s"] == pytest.approx(expected_tokens)
        assert 0 < s["ttft"]["median"] <= s["ttft"]["p99"]
        assert s["itl"]["mean"] > 0 and s["tpot"]["mean"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")
