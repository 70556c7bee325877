"""The benchmarks (bench/) kept from rotting, and the quick bench's named targets run as a smoke (bench/smoke.py).

The real numbers come from `python bench/run.py` (bench/results/). `test_bench_smoke_runs_every_target` runs the smoke
(every target of the report on a small slice of its section: the wire over the real server code, the split, the
server's load driver and cache-hit probe, the VAE comparison, the component cache, the step cache) and checks only
that each target ran and the table was printed: a ratio beyond its band fails in the bench (exit 3), and shows here
as a warning, never as a failed timing assertion. The rest exercises the machinery the smoke does not: statistics
and interleaving, the synthetic contracts in the wire form, the smoke's verdicts on fabricated ratios, the streamed
VAE encode and the wide decoder benches (their workers in this process), one VAE memory worker, the stage-1-only
folder, and the report (targets, markdown, JSON, plots) from a fabricated result.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import warnings

import pytest
import torch
from support import warm_cli

from bench import common, report, smoke, split, vae, wire
from bench.synth import raw_tensor_bytes, synth_conditioning


def test_statistics_and_abba_interleaving():
    s = common.summary([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["n"] == 5 and s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0 and s["p99"] > 90
    p = common.paired([1.0, 2.0, 4.0], [1.1, 2.2, 4.4])
    assert abs(p["median_ratio"] - 1.1) < 1e-9 and p["ci95"][0] <= 1.1 <= p["ci95"][1]
    order = []
    runs = common.interleaved({"a": lambda i: order.append(("a", i)), "b": lambda i: order.append(("b", i))},
                              pairs=3, warmup=1)
    assert order == [("a", -1), ("b", -1), ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert len(runs["a"]["wall"]) == 3 and all(t >= 0 for t in runs["b"]["cpu"])


def test_synthetic_contract_round_trips_through_the_wire_form():
    from h3_core.contract import H3Conditioning

    cond = synth_conditioning(20, text_dim=5120)
    data = cond.to_bytes()
    assert cond.prompt_embeds.dtype == torch.bfloat16 and raw_tensor_bytes(cond) == 20 * 5120 * 2 + 20 * 8
    assert len(data) / raw_tensor_bytes(cond) < 1.01
    assert H3Conditioning.from_buffer(bytearray(cond.to_wire().tobytes())) == cond


@contextlib.contextmanager
def _own_threads():
    """A bench worker run in this process sets torch's thread count: give the test process its own back after."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_tile_grid_matches_diffusers(tiny_dir):
    from h3_core.models import ModelSource

    model = ModelSource.from_path(tiny_dir).load("vae")
    for pixels in (64, 256, 288, 384, 512, 768, 1024):
        assert vae.tile_grid(pixels) == len(model._split_tiles(pixels, 256, 64)[0])


def test_streamed_vae_encode_bench_compares_both_arms(tiny_dir, monkeypatch):
    """bench/vae_encode.py's arms and table, its workers run in this process (a fresh process per worker is the
    bench's own business, exercised by the VAE memory worker below): 4 worker processes cost a minute of CPU."""
    from bench import vae_encode

    monkeypatch.setattr(vae_encode.common, "run_worker", lambda module, args, threads: vae_encode.worker(args))
    with _own_threads():
        out = vae_encode.run(str(tiny_dir), size=64, lengths=(22, 39))
    assert all(row["bit_identical"] for row in out["lengths"].values())
    assert all(row[arm]["peak_bytes"] >= 0 and row[arm]["seconds"] > 0 for row in out["lengths"].values()
               for arm in vae_encode.ARMS)
    assert "bit-identical" in vae_encode.table(out)


def test_released_width_decoder_bench_runs_the_streamed_decode(tiny_dir, monkeypatch):
    """bench/vae_wide.py's points, its workers in this process (as above: the process per point is the bench's)."""
    from bench import vae_wide

    monkeypatch.setattr(vae_wide.common, "run_worker", lambda module, args, threads, **kw: vae_wide.worker(args))
    with _own_threads():
        out = vae_wide.run(str(tiny_dir), sizes=(64, 128))
    assert out["points"][64]["decoder_width"] == 2048 and out["points"][128]["handed_frames"] == 22
    assert out["peak_ratios"]["4x"] > 0 and out["working_ratios"]["4x"] > 0
    assert out["points"][128]["clip_bytes"] == 22 * 128 * 128 * 3
    # on CPU the peak is the RSS high-water mark (on CUDA, --device cuda: the device peak, host peak beside it)
    assert out["device"] == "cpu" and out["points"][128]["device_peak_bytes"] is None
    assert out["points"][128]["peak_bytes"] == out["points"][128]["host_peak_bytes"]


def test_vae_memory_worker_and_stage1_folder(tiny_dir, tmp_path):
    points = vae.sweep(tiny_dir, 1, [dict(op="video_decode", height=64, width=64, frames=22, reps=1),
                                     dict(op="audio_encode", seconds=2.0, reps=1)], per_process=False)
    assert points[0]["output_shape"] == [1, 3, 22, 64, 64] and points[0]["tiles"] == 1
    assert all(p["peak_bytes"] > 0 and p["time_s"] > 0 for p in points)
    from h3_core.models import ModelSource

    folder = split.stage1_only_folder(tiny_dir, tmp_path)
    source = ModelSource.from_path(folder)
    assert "text_encoder" not in source.paths and {"transformer", "vae", "audio_vae"} <= set(source.paths)


def _fake_compare() -> dict:
    arms = ("diffusers", "stream_f32", "stream_u8")
    points = [dict(size=s, frames=22, tiles=vae.tile_grid(s) ** 2, clips=1, bit_exact_warmup=True,
                   arms={a: dict(peak_bytes=[s * s * k * 100] * 3, time_s=[s / 256 * k] * 3, output_bytes=0,
                                        product_bytes=s * s * 66)
                         for k, a in enumerate(arms, 1)}) for s in (384, 768, 1536)]
    ratio = dict(ratio=2.0, ci95=[1.9, 2.1])
    paired = dict(median_ratio=0.9, ci95=[0.8, 1.0], iqr=[0.85, 0.95], ratio_of_medians=0.9)
    return dict(points=points, arms=list(arms), bit_exact=True,
                peak_ratios={f: dict({"from": 384, "to": to}, **{a: ratio for a in arms})
                             for f, to in (("4x", 768), ("16x", 1536))},
                working_ratios={f: dict({"from": 384, "to": to}, **{a: ratio for a in arms})
                                for f, to in (("4x", 768), ("16x", 1536))},
                time_ratios={str(s): {"stream_f32": paired, "stream_u8": paired} for s in (384, 768, 1536)})


def _fake_results() -> dict:
    def summ(x):
        return common.summary([x, x * 1.01, x * 0.99])

    canvas = [dict(width=s, height=s, frames=22, tiles=vae.tile_grid(s) ** 2, tile_px=256, tile_overlap_px=64,
                   time_s=s / 256, peak_bytes=int(s * s * 1000), working_bytes=int(s * s * 800),
                   output_bytes=int(s * s * 200)) for s in (256, 384, 512, 768)]
    frames = [dict(c, frames=f) for c, f in zip(canvas[:2], (22, 56))]
    audio = [dict(seconds=s, time_s=s / 10, peak_bytes=int(s * 1e6), working_bytes=int(s * 1e6), output_bytes=10)
             for s in (2.5, 10.0)]
    size = dict(tokens=20, raw_tensor_bytes=204960, contract_bytes=205648, request_bytes=566, response_bytes=206078,
                wire_bytes=206644, wire_ratio=1.008, handshake_bytes=1917, wire_bytes_per_token=10332.0,
                h3_s=summ(0.08), raw_s=summ(0.06), h3_mb_s=880.0, raw_mb_s=1100.0, throughput_ratio=0.8,
                throughput_ratio_ci95=[0.75, 0.84], breakdown_s=dict(to_wire=0.003, from_buffer=0.003, xxh3=0.002,
                                                                     copy=0.03))
    level = lambda c, rps, lat: dict(clients=c, requests=8, errors=[], error_count=0, throughput_rps=rps,
                                     latency_s=summ(lat), latencies=[lat] * 3, server_encode_s=summ(0.03),
                                     server_queue_s=summ(lat - 0.03), client_mean_spread=1.05)
    hit = dict(latency_s=summ(0.004), errors=0, throughput_rps=300.0, busy_misses_done=4)
    load = dict(levels={"1": level(1, 20.0, 0.05), "16": level(16, 19.5, 0.8)}, throughput_ratio=0.975,
                fair_share_limit_s=0.96, p99_over_fair_share=1.3, p99_over_service_share=1.4, service_slowdown=1.1,
                cache_hit_confirmed=True,
                cache_hits=dict(sequential=hit, concurrent_16=hit, under_load=hit))
    rvl = dict(local_s=summ(0.04), remote_s=summ(0.05), local_samples=[0.04] * 3, remote_samples=[0.05] * 3,
               remote_over_local=1.25, remote_over_local_ci95=[1.1, 1.4], added_ms_median=10.0, bit_identical=True,
               request_media_bytes=0, decoded_media_bytes=0, contract_bytes=5696)
    load_arm = dict(cold_s=summ(5.0), warm_s=summ(1.0), rss_delta_bytes=400_000_000,
                    param_bytes={"transformer": 1_000_000}, param_bytes_total=1_000_000,
                    source_components=["transformer", "vae"])
    split_part = {k: summ(0.01) for k in ("encode", "to_bytes", "from_bytes", "sample", "decode")}
    return {
        "meta": dict(mode="quick", started="2026-01-01 00:00", wall_s=60.0, threads=1, notes=["a note"],
                     loadavg_end=[1.0, 1.0, 1.0],
                     environment=dict(cpu="test cpu", usable_cores=2, loadavg_start=[1.0, 1.0, 1.0],
                                      versions=dict(torch="x", diffusers="y"))),
        "split": dict(job=dict(task="t2va", width=64, height=64, num_frames=124, steps=50, seed=0, pairs=3,
                               order="ABBA"),
                      mono_wall_s=summ(1.5), split_wall_s=summ(1.49), mono_cpu_s=summ(1.5), split_cpu_s=summ(1.49),
                      mono_wall_samples=[1.5, 1.51, 1.49], split_wall_samples=[1.49, 1.5, 1.48],
                      wall=dict(ratios=[0.99, 0.993, 0.995], ratio_of_medians=0.993), overhead=-0.007,
                      overhead_ci95=[-0.01, 0.0], overhead_cpu=-0.006, split_parts_s=split_part, contract_bytes=5696,
                      bit_exact_video=True, load={"monolithic": load_arm, "diffusion_stage1_only": load_arm}),
        "wire": dict(sizes={"0.2MB": size, "70MB": size}, previous=wire.PREVIOUS, target=wire.TARGET),
        "remote": dict(server_start_s=9.0, remote_vs_local={"text": rvl}, load=load),
        "vae": dict(decode_canvas=canvas, decode_frames=frames, encode_canvas=canvas[:2], encode_frames=frames,
                    audio_decode=audio, audio_encode=audio, pixel_ratios=vae.pixel_ratios(canvas),
                    compare=_fake_compare()),
        "components": dict(rounds=3, restarts=1, target=0.35, cold_s=summ(10.0), prompt_s=summ(2.0),
                           restart_s=summ(2.2), prompt_ratio=common.paired([10.0, 10.1, 9.9], [2.0, 2.1, 1.9]),
                           restart_ratio=dict(ratios=[0.22], median_ratio=0.22, ci95=[0.22, 0.22]),
                           vision=dict(text_s=0.3, vision_s=0.06, vision_share=0.2)),
    }


def test_report_targets_markdown_json_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    results = _fake_results()
    names = [t["name"] for t in report.targets(results)]
    assert len(names) == 11 and "component cache" in names[9]
    written = report.write(results, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "## Targets: " in md and "**missed**" in md and "What reaches the target" in md
    assert "working at 4x pixels" in md and "needs the decode's working memory" in md
    assert json.loads((tmp_path / "results.json").read_text())["targets"][0]["name"] == names[0]
    assert set(written["plots"]) == {"split.png", "wire.png", "remote.png", "vae.png"}
    lines = report.status_lines(results)
    assert lines[-1].startswith("targets met: ") and lines[-1].endswith("/11") and len(lines) == 12
    # a partial run reports the sections it skipped as not measured
    partial = report.status_lines({"meta": results["meta"], "wire": results["wire"]})
    assert partial[-1] == "targets met: 1/11" and "not measured" in partial[0]


def test_smoke_verdicts_on_fabricated_ratios():
    """bench/smoke.py's verdicts read the report's targets: within threshold + noise is ok, beyond is a regression;
    a band with its own threshold (a known miss on the tiny H3) is judged against that."""
    results = _fake_results()
    rows = {r["key"]: r for r in smoke.verdicts(results, ("wire", "split", "remote", "vae", "components"))}
    assert rows["wire_bytes"]["verdict"] == "ok" and rows["wire_throughput"]["verdict"].startswith("ok")
    results["wire"]["sizes"]["70MB"] = dict(results["wire"]["sizes"]["70MB"], throughput_ratio=0.2,
                                            throughput_ratio_ci95=[0.19, 0.21])
    rows = {r["key"]: r for r in smoke.verdicts(results, ("wire",))}
    assert rows["wire_throughput"]["verdict"] == "REGRESSION" and set(rows) == {"wire_bytes", "wire_throughput"}
    text = "\n".join(smoke.table(list(rows.values())))
    assert "| wire_throughput | 0.2000 | >= 0.85 | ±0.450 | REGRESSION |" in text


class _WarmH3Subprocess:
    """`bench.component_cache`'s `subprocess` in the smoke: its `python -m h3_core serve` servers forked warm
    (tests/support/warm_cli.py: no 8 CPU-s of imports per start), anything else as `subprocess` runs it."""

    PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT

    @staticmethod
    def Popen(cmd, **kwargs):
        if list(cmd[:3]) == [sys.executable, "-m", "h3_core"]:
            return warm_cli.popen(cmd[3:], **kwargs)
        return subprocess.Popen(cmd, **kwargs)


def test_bench_smoke_runs_every_target(tiny_dir, capsys, monkeypatch):
    """The quick bench's named targets as a smoke: every target ran (a measured ratio in its row of the table). A
    regression exits 3 and is reported as a warning: timing is judged in the bench, not here."""
    from bench import component_cache

    monkeypatch.setattr(component_cache, "subprocess", _WarmH3Subprocess)
    code = smoke.main(["--models", str(tiny_dir)])
    captured = capsys.readouterr()
    assert code in (0, smoke.REGRESSION_EXIT), captured.err[-2000:]
    assert "| target | ratio | threshold | noise | verdict |" in captured.out
    rows = {line.split("|")[1].strip(): line for line in captured.out.splitlines() if line.startswith("| ")}
    for band in smoke.BANDS:
        assert band.key in rows, f"{band.key} did not run"
        assert "n/a" not in rows[band.key] and "not measured" not in rows[band.key], rows[band.key]
    # the step cache's wall ratio with its spread over the rounds, and the sentence saying it is the tiny H3's
    assert any(line.startswith("| every:2 | ") and "rounds)" in line for line in captured.out.splitlines())
    assert "The wall ratio is the tiny H3's" in captured.out
    if code == smoke.REGRESSION_EXIT:
        warnings.warn("bench smoke: " + "; ".join(line for line in captured.err.splitlines()
                                                  if "REGRESSION" in line), stacklevel=1)
