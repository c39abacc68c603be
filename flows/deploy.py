"""Deploy ``monthly-release`` to a process work pool: production mode, run by a long-lived worker.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.deploy      # `make deploy` does this
    prefect worker start --pool adapter-release --type process --limit 1  # `make worker`: runs the deployment

Unlike ``flows/serve.py`` (the deployment lives as long as that process), this registers the
deployment with the Prefect server once; any worker polling the work pool runs it, on the same
monthly schedule (``flows.serve``'s cron and time zone) and whenever it is triggered from the UI or API.
The work pool (type ``process``) is created if it does not exist; ``refresh-update-channel``
(``flows/refresh_channel.py``, every six hours) is deployed beside it on the same pool. The flow is loaded from
``--source`` (this checkout by default) and each run executes with that directory as its working
directory (a ``set_working_directory`` pull step): the flow's project root is ``Path.cwd()``.

The deployment's defaults are ``--params`` with ``publish.tracking_uri`` pointing at the MLflow
tracking server (``--set`` changes that or any other key, e.g. the shared DVC remote), kept as
``flows.monthly_release.register_defaults`` keeps them; a run's parameters are set onto them:

    python -m flows.deploy --set publish.tracking_uri=http://127.0.0.1:5000 --set publish.remote_dir=/srv/dvc-remote

The flow can run on GPUs instead (docs/scale-out.md): ``--pool-type kubernetes`` or ``docker`` creates
the named pool with its worker type's default base job template plus a request for ``--gpus`` NVIDIA
GPUs per run (the pod's ``resources.limits["nvidia.com/gpu"]``; the container's ``device_requests``,
what ``docker run --gpus N`` sends), and deploys ``monthly-release`` there from ``--image`` (this
repository installed, as in docs/scale-out.md); its fine-tune then picks CUDA (``train.device: auto``).
``--print-job`` prints the job configuration a run would get, rendered as the worker renders it, and
contacts no server:

    python -m flows.deploy --pool-type kubernetes --work-pool gpu --gpus 1 --image registry/adapter-release:SHA --print-job
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flows.monthly_release import register_defaults
from flows.refresh_channel import REFRESH_CRON, REFRESH_DEPLOYMENT
from flows.serve import DEFAULT_CRON, DEFAULT_TIMEZONE, DEPLOYMENT
from tasks.config import ConfigError, ReleaseConfig, load_config, parse_assignments, with_settings

WORK_POOL = "adapter-release"
ENTRYPOINT = "flows/monthly_release.py:monthly_release"
REFRESH_ENTRYPOINT = "flows/refresh_channel.py:refresh_update_channel"
# `make mlflow-server` listens here; a tracking server chooses where artifacts go (tasks/release/tracking.py).
TRACKING_URI = "http://127.0.0.1:5000"
GPU_POOL_TYPES = ("kubernetes", "docker")
# Prefect's server ships every worker type's default base job template (what `prefect work-pool
# get-default-base-job-template --type T` prints); it is read here when the worker's package is absent.
WORKER_METADATA = "collections_data/views/aggregate-worker-metadata.json"


def default_job_template(pool_type: str) -> dict:
    """The default base job template of a worker type: its installed worker's, else the one Prefect ships."""
    import copy
    from importlib.resources import files

    from prefect.workers.base import BaseWorker

    worker = BaseWorker.get_worker_class_from_type(pool_type)
    if worker is not None:
        return copy.deepcopy(worker.get_default_base_job_template())
    metadata = json.loads((files("prefect.server.api") / WORKER_METADATA).read_text())
    for collection in metadata.values():
        for candidate in collection.values():
            if candidate.get("type") == pool_type:
                return candidate["default_base_job_configuration"]
    raise SystemExit(f"error: Prefect knows no work pool type {pool_type!r}")


def gpu_job_template(pool_type: str, gpus: int) -> dict:
    """``pool_type``'s default base job template, asking every run for ``gpus`` NVIDIA GPUs (a job variable
    a deployment may change): Kubernetes ``resources.limits["nvidia.com/gpu"]`` on the flow's container (the
    NVIDIA device plugin then schedules the pod on a GPU node); Docker ``device_requests`` through the
    worker's ``container_create_kwargs``, what ``docker run --gpus`` sends (the NVIDIA container toolkit)."""
    template = default_job_template(pool_type)
    variables = template["variables"]["properties"]
    if pool_type == "kubernetes":
        container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
        container.setdefault("resources", {}).setdefault("limits", {})["nvidia.com/gpu"] = "{{ gpus }}"
        variables["gpus"] = {"title": "GPUs", "type": "integer", "minimum": 1, "default": gpus,
                             "description": "NVIDIA GPUs of the run's pod (resources.limits nvidia.com/gpu)"}
    elif pool_type == "docker":
        template["job_configuration"]["container_create_kwargs"] = "{{ container_create_kwargs }}"
        variables["container_create_kwargs"] = {
            "title": "Container Configuration", "type": "object",
            "description": "docker-py containers.create arguments; device_requests = docker run --gpus",
            "default": {"device_requests": [{"driver": "nvidia", "count": gpus, "capabilities": [["gpu"]]}]},
        }
    else:
        raise SystemExit(f"error: --gpus needs a pool type of {GPU_POOL_TYPES}, not {pool_type!r}")
    return template


def render_job(template: dict, job_variables: dict) -> dict:
    """The job configuration a worker builds for a run: the variables' defaults, then the deployment's
    ``job_variables``, put into the template's placeholders (Prefect's own templating)."""
    from prefect.utilities.templating import apply_values

    defaults = {name: spec["default"] for name, spec in template["variables"]["properties"].items() if "default" in spec}
    return apply_values(template["job_configuration"], defaults | job_variables)


def ensure_pool(name: str, pool_type: str, template: dict) -> None:
    """Create the work pool with ``template`` unless it exists; one of another type is an error."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))
            print(f"work pool {name!r} ({pool_type}) created")
            return
    if pool.type != pool_type:
        raise SystemExit(f"error: work pool {name!r} exists with type {pool.type!r}, not {pool_type!r}")


def ensure_process_pool(name: str) -> None:
    """Create the work pool (type process, the worker's default job template) unless it exists."""
    from prefect.workers.process import ProcessWorker

    ensure_pool(name, ProcessWorker.type, ProcessWorker.get_default_base_job_template())


def deploy_to_gpu_pool(config: ReleaseConfig, work_pool: str, pool_type: str, gpus: int, image: str, cron: str,
                       timezone: str) -> str:
    """Register ``monthly-release`` on a Kubernetes or Docker pool whose runs get ``gpus`` GPUs; the flow is
    loaded from ``image`` (built and pushed beforehand), where it runs in the image's checkout."""
    from prefect.schedules import Cron

    from flows.monthly_release import monthly_release

    ensure_pool(work_pool, pool_type, gpu_job_template(pool_type, gpus))
    return str(monthly_release.deploy(
        name=DEPLOYMENT, work_pool_name=work_pool, image=image, build=False, push=False,
        schedules=[Cron(cron, timezone=timezone)], parameters=register_defaults(config),
        description="The monthly release on a GPU work pool: the fine-tune trains on CUDA (train.device auto).",
        tags=["adapter-release", "gpu"], concurrency_limit=1, print_next_steps=False,
        job_variables={"env": {"HF_HUB_OFFLINE": "1", "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}},
    ))


def deploy(config: ReleaseConfig, source: Path, work_pool: str, cron: str, timezone: str) -> str:
    """Register the deployment; return its id."""
    from prefect import flow
    from prefect.schedules import Cron

    ensure_process_pool(work_pool)
    # from_source with a local directory: the deployment's pull step is set_working_directory(source).
    remote = flow.from_source(source=str(source.resolve()), entrypoint=ENTRYPOINT)
    deployment_id = remote.deploy(
        name=DEPLOYMENT,
        work_pool_name=work_pool,
        schedules=[Cron(cron, timezone=timezone)],
        parameters=register_defaults(config),
        description="Fine-tune, calibrate, evaluate on the engine, gate, package and publish this month's adapter.",
        tags=["adapter-release"],
        concurrency_limit=1,  # DVC holds one repository lock: runs of the month never overlap
        print_next_steps=False,
        ignore_warnings=True,  # the process-pool hint to use .serve: production mode wants a worker
    )
    flow.from_source(source=str(source.resolve()), entrypoint=REFRESH_ENTRYPOINT).deploy(
        name=REFRESH_DEPLOYMENT, work_pool_name=work_pool, schedules=[Cron(REFRESH_CRON, timezone=timezone)],
        description="Re-sign the update channel's timestamp (snapshot, targets near expiry) without a release.",
        tags=["adapter-release"], concurrency_limit=1, print_next_steps=False, ignore_warnings=True,
    )
    return str(deployment_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="default parameters of the deployment")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a parameter (repeatable); publish.tracking_uri defaults to {TRACKING_URI}")
    parser.add_argument("--source", type=Path, default=Path.cwd(),
                        help="project directory the worker loads the flow from and runs it in (default: here)")
    parser.add_argument("--work-pool", default=WORK_POOL)
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--timezone", default=DEFAULT_TIMEZONE)
    parser.add_argument("--pool-type", choices=("process", *GPU_POOL_TYPES), default="process",
                        help="process (this checkout, the default) or a GPU pool of that worker type (needs --image)")
    parser.add_argument("--gpus", type=int, default=1, help="NVIDIA GPUs per run on a GPU pool (default 1)")
    parser.add_argument("--image", help="image with this repository installed, for a GPU pool (docs/scale-out.md)")
    parser.add_argument("--print-job", action="store_true",
                        help="print the job configuration a run on the GPU pool gets, rendered; contact no server")
    args = parser.parse_args(argv)
    gpu_pool = args.pool_type != "process"
    if gpu_pool and not args.image:
        parser.error(f"--pool-type {args.pool_type} needs --image (the flow is loaded from it)")
    if args.print_job:
        if not gpu_pool:
            parser.error("--print-job shows a GPU pool's job: give --pool-type kubernetes or docker")
        print(json.dumps(render_job(gpu_job_template(args.pool_type, args.gpus), {"image": args.image}), indent=2))
        return 0
    try:
        settings = parse_assignments([f"publish.tracking_uri={TRACKING_URI}", *args.overrides], source="--set")
        config = with_settings(load_config(args.params), settings, source="--set")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if gpu_pool:
        deployment_id = deploy_to_gpu_pool(config, args.work_pool, args.pool_type, args.gpus, args.image, args.cron,
                                           args.timezone)
        where = f"image {args.image}, {args.gpus} GPU(s) per run"
    else:
        deployment_id = deploy(config, args.source, args.work_pool, args.cron, args.timezone)
        where = f"runs in {args.source.resolve()}"
    print(f"deployment {DEPLOYMENT}/{DEPLOYMENT} ({deployment_id}) on work pool {args.work_pool!r} ({args.pool_type}), "
          f"cron {args.cron!r} {args.timezone}; MLflow {config.publish.tracking_uri}; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
