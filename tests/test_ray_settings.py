"""The Ray Serve path without a cluster: stage settings (user_config) both ways, deployment
options, deploy/ray-serve.yaml against Serve's own schema, the cached load, and how Ray's
exceptions become voxpipe's. Fast: no Ray instance is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import LlmConfig, SchedulerConfig, VoxpipeConfig
from pipeline.errors import Busy
from pipeline.remote.settings import (
    FRONTEND_SECTIONS,
    capacity,
    config_from_user,
    deployment_options,
    frontend_user_config,
    read_serve_config,
    stage_user_config,
)
from pipeline.remote.stats import STALE_S, StatsCache
from pipeline.remote.types import DeploymentLoad, ReplicaStats, StageUnavailable
from pipeline.serving.types import StageLoad

ROOT = Path(__file__).resolve().parent.parent
YAML = ROOT / "deploy" / "ray-serve.yaml"
CONFIGS = sorted((ROOT / "deploy").glob("ray-serve*.yaml"))


def test_user_config_round_trips_the_stage_sections():
    cfg = VoxpipeConfig(llm=LlmConfig(model="smollm2", device="cpu-fp32", max_new_tokens=40),
                        llm_batch=SchedulerConfig(max_batch_size=4))
    cfg.degrade.faults = ("llm:error@3",)
    back = config_from_user(stage_user_config(cfg, "llm"))
    assert back.llm == cfg.llm and back.llm_batch == cfg.llm_batch and back.degrade.faults == ("llm:error@3",)
    assert back.asr == VoxpipeConfig().asr  # sections the stage does not carry keep their defaults
    assert set(stage_user_config(cfg, "tts")) == {"tts", "degrade"}


@pytest.mark.parametrize("bad, words", [({"gpu": {}}, "unknown section"), ({"llm": {"modle": "x"}}, "unknown keys"),
                                        ({"llm": "qwen"}, "mapping"),
                                        ({"llm_batch": {"max_batch_size": 0}}, "max_batch_size >= 1")])
def test_bad_user_config_is_a_clear_value_error(bad, words):
    with pytest.raises(ValueError, match=words):
        config_from_user(bad)


def test_deployment_options_layer_defaults_then_overrides():
    cfg = VoxpipeConfig()
    opts = deployment_options("llm", cfg, {"name": "llm", "ray_actor_options": {"num_gpus": 0.5},
                                          "user_config": {"llm": {"model": "smollm2"}},
                                          "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}})
    assert opts["ray_actor_options"]["num_cpus"] == 1 and opts["ray_actor_options"]["num_gpus"] == 0.5
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert opts["user_config"]["llm"]["model"] == "smollm2"
    assert opts["user_config"]["llm"]["max_new_tokens"] == cfg.llm.max_new_tokens  # merged, not replaced
    assert "num_replicas" not in opts and "name" not in opts
    assert opts["health_check_period_s"] > 0 and opts["max_queued_requests"] > 0
    with pytest.raises(ValueError, match="not both"):
        deployment_options("asr", cfg, {"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}})
    assert capacity({"max_ongoing_requests": 4, "max_queued_requests": 2}, 3) == 14
    assert capacity({"max_ongoing_requests": 4, "max_queued_requests": -1}, 3) is None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_repo_configs_name_the_stages_with_valid_settings(path):
    stages = read_serve_config(str(path), "voxpipe")
    assert set(stages) == {"asr", "llm", "tts"}
    for opts in stages.values():
        assert opts["max_ongoing_requests"] > 0 and opts["max_queued_requests"] > 0
        config_from_user(opts["user_config"])
    with pytest.raises(ValueError, match="no application"):
        read_serve_config(str(path), "other")


def test_the_repo_configs_pass_serves_schema_and_build():
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from pipeline.remote.app import build_app

    assert YAML in CONFIGS
    for path in CONFIGS:
        ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
        build_app(VoxpipeConfig(), read_serve_config(str(path), "voxpipe"))  # Serve validates every option


def test_the_ingress_config_sizes_the_frontend_to_sessions():
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    import yaml

    from pipeline.config import is_loopback
    from server.ingress import DEFAULT_MAX_ONGOING, build_ingress_app

    doc = yaml.safe_load((ROOT / "deploy" / "ray-serve-ingress.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "server.ingress:app" and app["route_prefix"] == "/"
    (front,) = [d for d in app["deployments"] if d["name"] == "frontend"]
    cfg = config_from_user(front["user_config"], FRONTEND_SECTIONS)
    assert cfg.server.max_sessions == 0 and front["max_ongoing_requests"] == DEFAULT_MAX_ONGOING == 64 + 16
    assert cfg.server.host == doc["http_options"]["host"] and is_loopback(cfg.server.host)
    overrides = {**read_serve_config(str(ROOT / "deploy" / "ray-serve-ingress.yaml"), "voxpipe"),
                 "frontend": {k: v for k, v in front.items() if k != "name"}}
    build_ingress_app(VoxpipeConfig(), overrides)  # Serve validates every option
    capped = VoxpipeConfig()
    capped.server.max_sessions = 10
    built = build_ingress_app(capped)  # max_ongoing_requests follows the session cap
    assert built._bound_deployment._deployment_config.max_ongoing_requests == 10 + 16


def test_frontend_user_config_round_trips_every_section():
    cfg = VoxpipeConfig()
    cfg.server.allow_origins = ("https://app.example",)
    cfg.turn.end_silence_ms = 700
    back = config_from_user(frontend_user_config(cfg), FRONTEND_SECTIONS)
    assert back.server == cfg.server and back.turn == cfg.turn and back.llm == cfg.llm
    with pytest.raises(ValueError, match="unknown section"):
        config_from_user({"server": {}})  # a stage's user_config has no server section


def test_stage_load_sums_replicas_and_scales_to_the_unheard():
    one = ReplicaStats(replica="a", replicas=2, load=StageLoad(depth=3, active=4, slots=8, kv_budget=100, step_ms=10.0))
    dep = DeploymentLoad.of([one])
    load = dep.load
    assert (dep.replicas, load.depth, load.active, load.slots, load.kv_budget, load.step_ms) == (2, 6, 8, 16, 200, 10)
    assert DeploymentLoad.of([]) == DeploymentLoad() and DeploymentLoad().load == StageLoad()


def test_stats_cache_forgets_silent_replicas():
    now = [0.0]
    cache = StatsCache(clock=lambda: now[0])
    cache.update(ReplicaStats(replica="a", replicas=2, load=StageLoad(depth=1)))
    now[0] = 1.0
    cache.update(ReplicaStats(replica="b", replicas=2, load=StageLoad(depth=2)))
    assert cache.load.depth == 3
    now[0] = 1.0 + STALE_S + 0.1  # "a" died; "b" answers again
    cache.update(ReplicaStats(replica="b", replicas=1, load=StageLoad(depth=2)))
    assert (cache.load.depth, cache.replicas) == (2, 1)


def test_rays_exceptions_become_voxpipes():
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import BackPressureError

    from pipeline.remote.errors import translate

    busy = translate("asr", BackPressureError(num_queued_requests=4, max_queued_requests=4))
    assert isinstance(busy, Busy) and busy.reason == "stage"
    wrapped = RayTaskError("run", "Traceback ...", Busy("tts breaker", reason="breaker", retry_after_ms=2000))
    busy = translate("tts", wrapped)
    assert isinstance(busy, Busy) and (busy.reason, busy.retry_after_ms) == ("breaker", 2000)
    dead = translate("llm", ActorDiedError())
    assert isinstance(dead, StageUnavailable) and dead.stage == "llm" and "restarts" in str(dead)
    failed = translate("asr", RayTaskError("run", "Traceback ...", ValueError("bad audio")))
    assert isinstance(failed, StageUnavailable) and "bad audio" in str(failed)
    other = KeyError("ours")
    assert translate("asr", other) is other


def test_serve_ray_flags():
    from cli.main import build_parser
    from cli.serve import ray_options as _ray_options

    def opts(*argv: str):
        return _ray_options(build_parser().parse_args(["serve", *argv]))

    assert opts() is None
    assert opts("--ray", "auto", "--ray-replicas", "llm=2", "--ray-config", "x.yaml") == {
        "address": "auto", "config_path": "x.yaml", "replicas": {"llm": 2}, "existing": False, "num_cpus": None}
    for bad in (["--ray", "auto", "--ray-replicas", "gpu=2"], ["--ray", "auto", "--ray-replicas", "llm=0"],
                ["--ray-replicas", "llm=2"]):
        with pytest.raises(ValueError):
            opts(*bad)
