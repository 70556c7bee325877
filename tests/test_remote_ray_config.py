"""deploy/ray_serve.yaml and `serve --engine ray` flags: they build the Serve application without starting Ray."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from h3_core.cli import build_parser  # noqa: E402
from h3_core.remote.engines import ray_run  # noqa: E402
from h3_core.remote.engines import ray_serve as ray_engine  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "ray_serve.yaml"


def _built(app):
    from ray.serve._private.build_app import build_app

    return build_app(app, name=ray_engine.APP_NAME)


def test_the_example_config_is_a_valid_serve_config_that_builds(tiny_dir):
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (application,) = config.applications
    module, _, name = application.import_path.partition(":")
    builder = getattr(importlib.import_module(module), name)
    args = dict(application.args, models=str(tiny_dir))
    built = _built(builder(args))
    assert built.ingress_deployment_name == ray_engine.INGRESS
    names = {d.name for d in built.deployments}
    assert names == {ray_engine.INGRESS, ray_engine.ENCODER}
    assert {d.name for d in application.deployments} <= names  # the YAML's overrides name real deployments
    encoder = next(d for d in built.deployments if d.name == ray_engine.ENCODER)
    assert encoder.ray_actor_options["num_gpus"] == 1
    # The ingress bounds the queue (4 replicas x 2 slots + 64 waiting); Ray's own queue in front of them is unbounded.
    assert encoder.max_queued_requests == -1 and encoder._deployment_config.autoscaling_config.max_replicas == 4
    ingress = next(d for d in built.deployments if d.name == ray_engine.INGRESS)
    assert ingress.init_args[1].capacity() == 4 * 2 + 64
    with pytest.raises(ValueError, match="models"):
        builder({})


def test_cli_flags_become_ray_settings(tiny_dir):
    args = build_parser().parse_args(["serve", "--engine", "ray", "--models", str(tiny_dir), "--autoscale", "1:3",
                                      "--gpus-per-replica", "2", "--deadline", "60", "--cache-mb", "64"])
    settings = ray_run.settings_from_args(args, "127.0.0.1")
    assert settings.autoscale == (1, 3) and settings.gpus_per_replica == 2 and settings.device == "cuda"
    assert settings.config.max_deadline_s == 60 and settings.config.cache_bytes == 64 << 20
    assert settings.capacity() == 3 * 2 + 64
    built = _built(ray_engine.application(settings))
    encoder = next(d for d in built.deployments if d.name == ray_engine.ENCODER)
    assert encoder._deployment_config.autoscaling_config.max_replicas == 3
    assert encoder.ray_actor_options["num_gpus"] == 2
    for bad in ("3", "3:1", "a:b", "0:0"):
        with pytest.raises(ValueError, match="MIN:MAX"):
            ray_engine.parse_autoscale(bad)


def test_ray_flags_need_the_ray_engine(capsys):
    from h3_core.remote.engines import options as engines

    args = build_parser().parse_args(["serve", "--models", "x", "--replicas", "2"])
    assert engines.main(args) == 2 and "--replicas needs --engine ray" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one way to size the replicas
        build_parser().parse_args(["serve", "--engine", "ray", "--replicas", "2", "--autoscale", "1:2"])
    assert isinstance(build_parser().parse_args(["serve", "--engine", "ray"]), argparse.Namespace)


def test_readme_words_without_dtype_load_a_replica_by_the_dtype_rule(tiny_dir, monkeypatch):
    """`serve --engine ray --models DIR --replicas 2` (README), no --dtype: "auto" is the dtype rule's (float32 on
    CPU), as for the single server; it used to crash every replica with KeyError 'auto'. The replicas' thread count
    is the command's own (H3_THREADS, else torch's default), fixed in the driver."""
    import torch

    monkeypatch.setenv("H3_THREADS", "3")
    args = build_parser().parse_args(["serve", "--engine", "ray", "--models", str(tiny_dir), "--replicas", "2"])
    settings = ray_run.settings_from_args(args, "127.0.0.1")
    assert settings.dtype == "auto" and settings.threads == 3 and settings.cpus_needed() == 6
    monkeypatch.delenv("H3_THREADS")
    assert ray_run.settings_from_args(args, "127.0.0.1").threads == torch.get_num_threads()  # the CLI's default
    stage, info = ray_engine.load_stage(settings)
    assert info["dtype"] == "float32" and info["device"] == "cpu" and "threads" in info
    assert next(stage.text_encoder.parameters()).dtype == torch.float32
    bad = build_parser().parse_args(["serve", "--engine", "ray", "--models", str(tiny_dir)])
    bad.dtype = "float8"
    with pytest.raises(ValueError, match="unknown dtype"):
        ray_run.settings_from_args(bad, "127.0.0.1")


def test_the_old_import_path_of_saved_configs_still_deploys():
    # Configs saved before the engines moved to h3_core/remote/engines/ say `h3_core.remote.ray_engine:build`.
    assert importlib.import_module("h3_core.remote.ray_engine").build is ray_engine.build
