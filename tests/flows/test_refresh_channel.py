"""The refresh-update-channel deployment on a real Prefect (prefect_test_harness): a run without a
release signs a new timestamp of the repository the monthly deployment's defaults name."""

from __future__ import annotations

import datetime as dt

import pytest
from prefect.flow_engine import run_flow

from flows.monthly_release import register_defaults
from flows.refresh_channel import REFRESH_CRON, REFRESH_DEPLOYMENT, refresh_update_channel
from tasks.config import ReleaseConfig, with_settings
from tasks.release.update_channel import Channel, ensure_repository, load_state


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):  # None: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        yield


def test_a_deployment_run_renews_the_timestamp_of_the_registered_channel(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.schedules import Cron

    config = with_settings(ReleaseConfig(), {"publish.tuf_dir": str(tmp_path / "tuf"),
                                             "publish.tuf_keys_dir": str(tmp_path / "keys"),
                                             "publish.timestamp_expiry_days": 2}, source="test")
    channel = Channel.from_config(config.publish)
    ensure_repository(channel, now=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3))  # stale by now
    register_defaults(config)  # what flows.serve and flows.deploy keep for both deployments
    deployment_id = refresh_update_channel.to_deployment(name=REFRESH_DEPLOYMENT,
                                                         schedules=[Cron(REFRESH_CRON)]).apply()
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment_id)
        result = run_flow(refresh_update_channel, flow_run=flow_run, parameters=flow_run.parameters)
        assert client.read_deployment(deployment_id).schedules[0].schedule.cron == REFRESH_CRON
    timestamp = load_state(channel).timestamp.signed
    assert result["written"] == ["timestamp"] and result["timestamp_version"] == timestamp.version == 2
    now = dt.datetime.now(dt.timezone.utc)
    assert now + dt.timedelta(days=2) - dt.timedelta(minutes=5) < timestamp.expires <= now + dt.timedelta(days=2)
