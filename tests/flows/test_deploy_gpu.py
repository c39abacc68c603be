"""``flows.deploy`` routes the monthly flow to a Kubernetes or Docker work pool whose runs ask for GPUs.

No Kubernetes cluster or Docker daemon runs here: the job a worker would submit is rendered with Prefect's
templating from the template the pool is created with, and the pool and deployment are registered on a
real Prefect server (prefect_test_harness), which validates the template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.deploy import deploy_to_gpu_pool, gpu_job_template, render_job
from tasks.config import ReleaseConfig

REPO = Path(__file__).resolve().parents[2]
IMAGE = "registry.example.com/adapter-release:0ca319c"


def flow_container(job: dict) -> dict:
    return job["job_manifest"]["spec"]["template"]["spec"]["containers"][0]


def test_a_kubernetes_pool_asks_each_run_for_its_gpus_and_a_deployment_may_change_them():
    template = gpu_job_template("kubernetes", gpus=2)
    container = flow_container(render_job(template, {"image": IMAGE}))
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}  # unset cpu/memory limits are dropped
    assert container["image"] == IMAGE and container["name"] == "prefect-job"
    changed = flow_container(render_job(template, {"image": IMAGE, "gpus": 4, "cpu_limit": "8"}))
    assert changed["resources"]["limits"] == {"cpu": "8", "nvidia.com/gpu": 4}


def test_a_docker_pool_sends_the_device_request_of_docker_run_gpus():
    job = render_job(gpu_job_template("docker", gpus=1), {"image": IMAGE})
    assert job["image"] == IMAGE
    assert job["container_create_kwargs"] == {"device_requests": [{"driver": "nvidia", "count": 1,
                                                                   "capabilities": [["gpu"]]}]}


def test_print_job_renders_the_run_without_a_server_and_a_gpu_pool_needs_an_image():
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # nothing listens
    cmd = [sys.executable, "-m", "flows.deploy", "--pool-type", "kubernetes", "--work-pool", "gpu", "--gpus", "1"]
    shown = subprocess.run([*cmd, "--image", IMAGE, "--print-job"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert flow_container(json.loads(shown.stdout))["resources"]["limits"] == {"nvidia.com/gpu": 1}
    refused = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--pool-type kubernetes needs --image" in refused.stderr


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):  # the shared machine is slow to start a server
        yield


@pytest.mark.parametrize("pool_type", ["kubernetes", "docker"])
def test_the_server_takes_the_gpu_pool_and_the_deployment_renders_to_a_gpu_job(prefect_server, pool_type):
    from prefect.client.orchestration import get_client

    deployment_id = deploy_to_gpu_pool(ReleaseConfig(), f"gpu-{pool_type}", pool_type, 2, IMAGE, "0 6 1 * *", "UTC")
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(f"gpu-{pool_type}")
        deployment = client.read_deployment(deployment_id)
    assert pool.type == pool_type and deployment.work_pool_name == f"gpu-{pool_type}"
    job = render_job(pool.base_job_template, deployment.job_variables)
    if pool_type == "kubernetes":
        assert flow_container(job)["image"] == IMAGE
        assert flow_container(job)["resources"]["limits"] == {"nvidia.com/gpu": 2}
    else:
        assert job["image"] == IMAGE and job["container_create_kwargs"]["device_requests"][0]["count"] == 2
    assert job["env"]["HF_HUB_OFFLINE"] == "1"
