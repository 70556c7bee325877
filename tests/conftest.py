"""Shared fixtures (the embedded tiny H3, built once per test run and shared by the xdist workers) and the tiers.

Set H3_TINY_DIR to reuse an existing build while iterating locally (CI always builds fresh).

Tiers: every test module is classified in `TIERS` below (tests/test_layout.py checks it: a new module must be
added). The markers are registered in pyproject.toml; the fast tier
(`bash scripts/test.sh --fast`) is every test with none of them:
  slow     runs the tiny H3 or diffusers' reference models (any test that needs the `tiny_dir` build is slow)
  comfyui  a real ComfyUI server (and its frontend in Chromium)
  ray      a local Ray instance (one per machine)
  process  starts encoder servers, sandboxes or fresh Pythons as real processes
"""

import os
from pathlib import Path

import pytest
import torch
from support import cpu_report, wall_report

from h3_core.testing import SERVER_THREADS

# The per-user weight digests (h3_core/weights/digest.py) go to a folder of this run, inherited by every process the
# tests start, never the user's ~/.cache (tests that check the cache itself set their own).
if "H3_WEIGHT_DIGEST_CACHE" not in os.environ:
    import tempfile

    os.environ["H3_WEIGHT_DIGEST_CACHE"] = tempfile.mkdtemp(prefix="h3-digests-")

# Bitwise parity between stages assumes one thread count in every process (docs/ARCHITECTURE.md §2.1, trap 5).
torch.set_num_threads(int(os.environ.get("H3_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    reuse = os.environ.get("H3_TINY_DIR")
    if reuse and (Path(reuse) / "tiny.json").is_file():
        return Path(reuse)
    from h3_core import tiny

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: its own build
        return tiny.build(tmp_path_factory.mktemp("tiny"), seed=0)
    # pytest-xdist workers share one build (~25 CPU-s each on 2 busy cores): the first to take the lock builds
    # it in the run's common temporary folder, the others wait for it and read it. Tests only read the build.
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "tiny" / "tiny.json").is_file():
            tiny.build(shared / "tiny", seed=0)
    return shared / "tiny"


@pytest.fixture(scope="session")
def encoder_stage(tiny_dir):
    """The tiny H3's `EncoderStage` (text, video and audio encoders), loaded once per session: its modules are only
    read, and torch's thread count (what bitwise results depend on) is set per module by `one_thread`."""
    from h3_core.encoder import EncoderStage
    from h3_core.models import ModelSource

    return EncoderStage(ModelSource.from_path(tiny_dir))


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's local encodes on SERVER_THREADS torch threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(SERVER_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def parity_threads():
    """Pin a parity module to H3_THREADS torch threads, whatever an earlier module left (restored afterwards):
    its in-process results are compared bitwise with subprocesses that run at H3_THREADS."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("H3_THREADS", "2")))
    yield
    torch.set_num_threads(before)


# --- test tiers ----------------------------------------------------------------------------------------------

SLOW, COMFYUI, RAY, PROCESS = "slow", "comfyui", "ray", "process"

#: module -> the markers of every test in it; () is the fast tier (tests that need `tiny_dir` are slow anyway).
#: Slow modules that need no tiny build: they build diffusers' reference models or release-size headers.
TIERS: dict[str, tuple[str, ...]] = {
    "test_assembly": (SLOW,),
    "test_audio_decode_cancel": (SLOW,),
    "test_bench_quick": (SLOW,),
    "test_cli_components": (SLOW,),
    "test_client_watchdog": (),
    "test_clock": (),
    "test_body_streams": (),
    "test_comfy_run": (),
    "test_comfy0375_smoke": (COMFYUI,),
    "test_comfyui_server": (COMFYUI,),
    "test_community_formats": (SLOW,),
    "test_component_cache": (SLOW,),
    "test_component_cache_server": (SLOW, PROCESS),
    "test_conditioning_listing": (),
    "test_contract_comfy": (),
    "test_contract_comfy_edits": (),
    "test_contract_conditioning": (),
    "test_contract_hygiene": (),
    "test_contract_layout": (),
    "test_contract_vllm": (),
    "test_contract_wire": (),
    "test_contract_wire_hostile": (),
    "test_contract_wire_zero_copy": (),
    "test_wire_scan": (),
    "test_core033_comfyui": (COMFYUI,),
    "test_core_conditioning_comfyui": (COMFYUI,),
    "test_core_fidelity": (SLOW, PROCESS),
    "test_guides": (),
    "test_guides_comfyui": (COMFYUI,),
    "test_guides_core": (SLOW, PROCESS),
    "test_credentials": (),
    "test_decode_cancel_comfyui": (COMFYUI,),
    "test_deploy_docs": (PROCESS,),
    "test_deploy_install": (PROCESS,),
    "test_deploy_sandbox": (PROCESS,),
    "test_diffusers_adapter": (),
    "test_docs_commands": (PROCESS,),
    "test_dtypes": (),
    "test_encode_ahead_comfyui": (COMFYUI,),
    "test_encode_ahead_seam_comfyui": (COMFYUI,),
    "test_facts": (),
    "test_fair_queue_sharing": (SLOW,),
    "test_gguf": (SLOW,),
    "test_gguf_comfyui": (COMFYUI,),
    "test_gguf_llamacpp": (SLOW,),
    "test_gpu_check": (SLOW,),
    "test_headless_api_comfyui": (COMFYUI,),
    "test_hostile_bounds": (),
    "test_hostile_cache": (),
    "test_hostile_client": (),
    "test_hostile_files": (),
    "test_hostile_files_comfyui": (COMFYUI,),
    "test_hostile_gguf": (),
    "test_hostile_gguf_comfyui": (COMFYUI,),
    "test_hostile_gguf_models": (SLOW,),
    "test_hostile_media": (PROCESS,),
    "test_hostile_process": (SLOW, PROCESS),
    "test_hostile_sandbox_lifetime": (SLOW, PROCESS),
    "test_hostile_server": (SLOW,),
    "test_hostile_sp_channel": (PROCESS,),
    "test_layout": (),
    "test_lengths": (SLOW,),
    "test_loader_lists": (),
    "test_lock": (),
    "test_lora": (SLOW,),
    "test_lora_formats": (SLOW,),
    "test_low_vram_comfyui": (COMFYUI,),
    "test_media": (),
    "test_needed_encoders": (),
    "test_node_words": (PROCESS,),
    "test_nodes_comfyui": (COMFYUI,),
    "test_nodes_remote_progress": (COMFYUI,),
    "test_nodes_security": (COMFYUI,),
    "test_offload": (SLOW,),
    "test_planner": (),
    "test_previews": (SLOW,),
    "test_previews_comfyui": (COMFYUI,),
    "test_progress_text_ui": (COMFYUI,),
    "test_pruned_dit": (SLOW,),
    "test_quant_formats": (),
    "test_quant_pipeline": (SLOW,),
    "test_quant_registry": (),
    "test_quant_release": (SLOW,),
    "test_quant_twins": (SLOW,),
    "test_queue_time_errors_comfyui": (COMFYUI,),
    "test_queue_time_rules": (),
    "test_qwen_assets": (SLOW,),
    "test_readme_assets": (PROCESS,),
    "test_remote_errors": (),
    "test_remote_fairness": (SLOW,),
    "test_remote_faults": (SLOW, PROCESS),
    "test_remote_guides": (SLOW,),
    "test_remote_metrics": (SLOW,),
    "test_remote_progress": (SLOW,),
    "test_remote_protocol": (),
    "test_remote_ray": (SLOW, RAY),
    "test_remote_ray_config": (),
    "test_remote_server": (SLOW,),
    "test_remote_service": (SLOW,),
    "test_remote_sharding": (SLOW,),
    "test_request_fuzz": (SLOW,),
    "test_rules": (),
    "test_safe_paths": (),
    "test_safetensors_header": (),
    "test_sampling_options": (),
    "test_sequence_parallel": (SLOW, PROCESS),
    "test_sequence_parallel_comfyui": (COMFYUI, PROCESS),
    "test_sequence_parallel_workers": (SLOW, PROCESS),
    "test_stage_split": (SLOW,),
    "test_step_cache": (SLOW,),
    "test_stress_script": (PROCESS,),
    "test_template_identity": (),
    "test_templates_newest_frontend": (COMFYUI,),
    "test_tiny": (SLOW,),
    "test_vae_encode": (SLOW,),
    "test_warm_cli": (SLOW, PROCESS),
    "test_vae_stream": (SLOW,),
    "test_weight_identity": (),
    "test_weights_detect_check": (SLOW,),
    "test_weights_registry": (SLOW,),
    "test_weights_release_meta": (SLOW,),
    "test_weights_roundtrip": (SLOW,),
    "test_weights_text_encoder": (SLOW,),
    "test_workflow_fixtures": (COMFYUI,),
}

#: The slow tests of otherwise fast modules, "module::function" (all its parameters), measured with --durations.
SLOW_TESTS: dict[str, tuple[str, ...]] = {
    "test_hostile_client::test_cli_encode_with_a_trickling_server_ends_at_its_timeout": (SLOW, PROCESS),
    "test_hostile_files::test_a_93_mb_header_is_refused_before_parsing_under_50_mb": (SLOW, PROCESS),
    "test_hostile_files::test_cli_refuses_a_canvas_beyond_the_trained_range": (SLOW, PROCESS),
    "test_hostile_files::test_a_file_truncated_after_load_does_not_kill_the_reader": (SLOW, PROCESS),
    "test_quant_formats::test_lora_on_quant_linear_is_a_branch_beside_the_codes": (SLOW,),
    "test_lora_formats::test_formats_core_loads_change_what_core_changes": (SLOW, PROCESS),
}


FAST = "not slow and not comfyui and not ray and not process"


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help=f"the fast tier: -m '{FAST}', without even importing the modules that have no fast test")


def pytest_configure(config):
    if config.getoption("fast"):
        given = config.option.markexpr
        config.option.markexpr = f"({given}) and {FAST}" if given else FAST


def pytest_ignore_collect(collection_path, config):
    """Under --fast, a module whose every test is in a slow tier is not imported (ray, diffusers' models...)."""
    if config.getoption("fast") and collection_path.suffix == ".py" and TIERS.get(collection_path.stem):
        return True
    return None


# --- pytest-xdist workers (scripts/test.sh: -n 3 --dist loadscope --no-loadscope-reorder) -----------------------

#: Modules that share a machine-wide resource run on one worker, one after the other: Ray (one local instance per
#: machine) and the README's fixed port 8190. Every other module is a scheduling unit of its own.
SHARED_RESOURCE: dict[str, str] = {
    "test_remote_ray": "ray-and-port-8190",
    "test_docs_commands": "ray-and-port-8190",
}

#: Seconds the longest modules took in a serial full run on 2 cores (2026-12-02). Workers take whole modules in this
#: order, longest first, so the run does not end waiting on one long module. Only the order depends on it.
MEASURED_S: dict[str, int] = {
    "test_nodes_comfyui": 308, "test_hostile_process": 180, "test_docs_commands": 168, "test_stage_split": 167,
    "test_core_conditioning_comfyui": 165, "test_bench_quick": 139, "test_workflow_fixtures": 118,
    "test_remote_ray": 115, "test_sequence_parallel": 109, "test_gpu_check": 83, "test_gguf_comfyui": 62,
    "test_gguf": 60, "test_sequence_parallel_workers": 58, "test_encode_ahead_comfyui": 51, "test_remote_faults": 44,
    "test_quant_pipeline": 42, "test_component_cache_server": 38, "test_remote_server": 35,
    "test_sequence_parallel_comfyui": 34, "test_comfyui_server": 33, "test_stress_script": 32,
    "test_hostile_server": 31, "test_gguf_llamacpp": 29, "test_low_vram_comfyui": 29, "test_tiny": 27,
    "test_core033_comfyui": 330, "test_core_fidelity": 180,
}


def _unit(module: str) -> str:
    """The scheduling unit of a test module: the module, or the shared resource it needs."""
    return SHARED_RESOURCE.get(module, module)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) when xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Whole modules per worker, so a module's fixtures (servers, Ray, loaded models) are built once, on one worker.

    xdist's own `loadgroup` would do this with `xdist_group` marks, but it renames node ids through `Item._nodeid`,
    which pytest 9's items no longer read, so the marks are silently ignored; the scope is decided here instead."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(Path(nodeid.split("::", 1)[0]).stem)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # on a pytest-xdist worker: the order the scheduler hands modules out
        # Longest first; a stable sort keeps each module's own order, which some modules rely on (docs_commands'
        # later blocks use the first block's files).
        seconds: dict[str, int] = {}
        for module in {item.path.stem for item in items}:
            seconds[_unit(module)] = seconds.get(_unit(module), 0) + MEASURED_S.get(module, 0)
        items.sort(key=lambda item: (-seconds[_unit(item.path.stem)], _unit(item.path.stem)))
    for item in items:
        module = item.path.stem
        markers = set(TIERS.get(module, ()))
        markers.update(SLOW_TESTS.get(f"{module}::{item.originalname}", ()))
        if "tiny_dir" in item.fixturenames:  # the session's tiny build alone takes a minute on 2 busy cores
            markers.add(SLOW)
        for name in sorted(markers):
            item.add_marker(name)


# --- CPU per tier (tests/support/cpu_report.py): printed at the end of every run, summed over xdist workers ------

_CPU = cpu_report.CpuByTier()


_WALL = wall_report.WallReport()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started = cpu_report.cpu_seconds(), wall_report.now()
    yield
    _CPU.add(cpu_report.tier_of({mark.name for mark in item.iter_markers()}), cpu_report.cpu_seconds() - before)
    _WALL.add(item.path.stem, started, wall_report.now())


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints the sum
        session.config.workeroutput["h3_cpu_by_tier"] = _CPU.as_dict()
        session.config.workeroutput["h3_wall"] = _WALL.as_dict()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    _CPU.merge(output.get("h3_cpu_by_tier", {}))
    _WALL.merge(getattr(getattr(node, "gateway", None), "id", f"gw{len(_WALL.workers)}"), output.get("h3_wall", {}))


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not _CPU.seconds:
        return
    terminalreporter.write_sep("-", "CPU-minutes per tier (tests' processes and the children they reaped)")
    for line in _CPU.lines():
        terminalreporter.write_line(line)
    terminalreporter.write_sep("-", "wall per xdist worker (tests/support/wall_report.py)")
    for line in _WALL.lines():
        terminalreporter.write_line(line)
