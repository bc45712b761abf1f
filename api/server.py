"""The composition root of `ringmaster serve` and `demo`: database, Ray, dispatcher and API together."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI

from ringmaster.api.app import create_app
from ringmaster.service.client import RingmasterClient
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.embedded_ray import RayHead, start_head, stop_head
from ringmaster.service.errors import LogsUnavailable
from ringmaster.service.logs import configure_logging
from ringmaster.service.ray_agent import agent_command
from ringmaster.service.ray_cluster import RayCluster
from ringmaster.service.settings import Settings

log = logging.getLogger(__name__)


class ControlPlane:
    """Owns the embedded Ray head (when no cluster is named) and the dispatcher thread."""

    def __init__(self, settings: Settings) -> None:
        self.head: RayHead | None = None
        # The cluster's addresses, as the settings hold them once filled in below.
        address, dashboard_url = settings.ray_address, settings.ray_dashboard_url
        if address is None:
            self.head = start_head(
                settings.data_dir, ray_client_server=settings.ray_client_server, timeout_s=settings.ray_start_timeout_s
            )
            address, dashboard_url = self.head.gcs_address, self.head.dashboard_url
            settings = settings.model_copy(
                update={
                    "ray_address": address,
                    "ray_dashboard_url": dashboard_url,
                    # The embedded head runs drivers on this machine: use this very interpreter.
                    "driver_python": sys.executable,
                    "code_path": settings.code_path or os.getcwd(),
                }
            )
        elif dashboard_url is None:
            host = urlsplit(address if "://" in address else f"//{address}").hostname
            dashboard_url = f"http://{host}:8265"
            settings = settings.model_copy(update={"ray_dashboard_url": dashboard_url})
        self.settings = settings
        # The Ray agent with the warm pool: the control plane's Ray connection, in a process that can be replaced.
        self.cluster = RayCluster(
            address,
            dashboard_url,
            agent=agent_command("ringmaster.api.warm_pool_agent", address),
            driver_resources=settings.driver_resources,
        )
        self.cluster.connect()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def logs(self, submission_id: str) -> str:
        try:
            return self.cluster.logs(submission_id)
        except Exception as error:
            raise LogsUnavailable(f"Ray could not serve logs for {submission_id}: {error}") from error

    def start_dispatcher(self, app: FastAPI) -> Callable[[], None]:
        dispatcher = Dispatcher(app.state.db.sessions, self.cluster, self.settings)
        app.state.wake_dispatcher = dispatcher.wake
        self._thread = threading.Thread(target=dispatcher.run, args=(self._stop,), name="dispatcher", daemon=True)
        self._thread.start()

        exporter = None
        if self.settings.mlflow_tracking_uri:
            from ringmaster.service.mlflow_export import MlflowExporter  # imports mlflow: only when asked for

            exporter = threading.Thread(
                target=MlflowExporter(
                    app.state.db.sessions, self.settings.mlflow_tracking_uri, self.settings.mlflow_experiment
                ).run,
                args=(self._stop,),
                name="mlflow-export",
                daemon=True,
            )
            exporter.start()

        def stop() -> None:
            self._stop.set()
            dispatcher.wake()
            if self._thread is not None:
                self._thread.join(timeout=10)
            if exporter is not None:
                exporter.join(timeout=10)

        return stop

    def app(self) -> FastAPI:
        return create_app(self.settings, start_background=self.start_dispatcher, logs_provider=self.logs)

    def close(self) -> None:
        """Stop the Ray agent (it leaves the cluster) before an embedded head goes."""
        self.cluster.disconnect()
        if self.head is not None:
            stop_head(self.head, self.settings.data_dir)


def run_server(settings: Settings) -> None:
    """Serve until interrupted; an embedded Ray head is stopped with the server. While it serves, the URL it listens
    on is in the data directory (Settings.api_address_path), where the CLI looks for it."""
    configure_logging(log_format=settings.log_format)
    plane = ControlPlane(settings)
    log.info("Ray dashboard: %s", plane.settings.ray_dashboard_url)
    address = settings.api_address_path()
    try:
        settings.write_api_address(plane.settings.resolved_api_url())
        # log_config=None: uvicorn keeps the handlers configure_logging installed.
        uvicorn.run(plane.app(), host=plane.settings.api_host, port=plane.settings.api_port, log_config=None)
    finally:
        address.unlink(missing_ok=True)
        plane.close()


class BackgroundServer:
    """The whole control plane in a background thread, for the demo, tests and benchmarks."""

    def __init__(self, settings: Settings) -> None:
        self.plane = ControlPlane(settings)
        self.ray_metrics_url: str | None = self.plane.head.metrics_url if self.plane.head else None
        self.app = self.plane.app()
        config = uvicorn.Config(
            self.app, host=self.plane.settings.api_host, port=self.plane.settings.api_port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="api", daemon=True)

    @property
    def url(self) -> str:
        return self.plane.settings.resolved_api_url()

    @property
    def dashboard_url(self) -> str | None:
        return self.plane.settings.ray_dashboard_url

    @property
    def token(self) -> str | None:
        """RINGMASTER_TOKEN, else the local admin token this server wrote to its data directory (embedded database)."""
        return self.plane.settings.client_token()

    def client(self) -> RingmasterClient:
        """A REST client of this server with its token."""
        return RingmasterClient(self.url, token=self.token, max_code_bytes=self.plane.settings.max_code_bytes)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.plane.close()
                raise RuntimeError(f"the API server did not start on {self.url}")
            time.sleep(0.05)
        self.plane.settings.write_api_address(self.url)  # where the CLI finds it (as `serve`'s)
        return self

    def __exit__(self, *_: object) -> None:
        self.plane.settings.api_address_path().unlink(missing_ok=True)
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.plane.close()
