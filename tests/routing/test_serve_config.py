"""ray_configs/serve_routing.yaml: Serve's own schema accepts it and its import path builds the app
(no cluster started)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve._private.utils import import_attr
from ray.serve.schema import ServeDeploySchema

CONFIG = Path(__file__).resolve().parents[2] / "ray_configs" / "serve_routing.yaml"


def test_serve_config_validates_and_builds_the_app():
    schema = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = schema.applications
    builder = import_attr(app.import_path)
    built = builder({k: str(v) for k, v in app.args.items()})
    dep = built._bound_deployment
    assert dep.num_replicas == int(app.args["num_replicas"])
    router = dep._deployment_config.request_router_config
    assert router.request_router_class == "hicache.routing.serve_router.HiCacheRequestRouter"
    assert router.request_router_kwargs == {"probe_timeout_s": float(app.args["probe_timeout_s"])}
    with pytest.raises(ValueError, match="l3_url"):
        builder({"num_replicas": "2"})
