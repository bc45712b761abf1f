"""The composition root of `ringmaster serve` and `demo`: database, Ray, dispatcher and API together."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI

from ringmaster.api.app import create_app
from ringmaster.service.client import RingmasterClient
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.embedded_ray import HEAD_STOP_GRACE_S, RayHead, start_head, stop_head
from ringmaster.service.errors import ClusterUnavailable, LogsUnavailable
from ringmaster.service.logs import configure_logging
from ringmaster.service.process_tree import ProcessTree
from ringmaster.service.ray_agent import AgentRefused, ClusterUnreachable, agent_command
from ringmaster.service.ray_cluster import RayCluster
from ringmaster.service.server_lock import ServerLock
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
                settings.data_dir,
                ray_client_server=settings.ray_client_server,
                timeout_s=settings.ray_start_timeout_s,
                node_ip_address=settings.ray_head_node_ip,
            )
            address, dashboard_url = self.head.gcs_address, self.head.dashboard_url
            settings = settings.model_copy(
                update={
                    "ray_address": address,
                    "ray_dashboard_url": dashboard_url,
                    "ray_auth_token": None,
                    "ray_auth_token_file": self.head.auth and self.head.auth.token_path,
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
            auth=settings.ray_auth(),
        )
        self.cluster.connect()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dispatcher: Dispatcher | None = None
        # Set when a stop with a grace period begins (run_server): each step of the stop takes a share of what is left.
        self.stop_deadline: float | None = None

    def _share_of_grace(self, share: float, otherwise_s: float) -> float:
        if self.stop_deadline is None:
            return otherwise_s
        return max(0.0, (self.stop_deadline - time.monotonic()) * share)

    def logs(self, submission_id: str) -> str:
        try:
            return self.cluster.logs(submission_id)
        except Exception as error:
            raise LogsUnavailable(f"Ray could not serve logs for {submission_id}: {error}") from error

    def drain_node(self, node_id: str, deadline: float | None, reason: str) -> None:
        try:
            self.cluster.drain_node(node_id, deadline, reason)
        except (ClusterUnreachable, AgentRefused) as error:
            raise ClusterUnavailable(f"the Ray cluster could not drain node {node_id}: {error}") from error
        if self._dispatcher is not None:
            self._dispatcher.note_drain(node_id, deadline)

    def start_dispatcher(self, app: FastAPI) -> Callable[[], None]:
        dispatcher = self._dispatcher = Dispatcher(app.state.db.sessions, self.cluster, self.settings)
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
            # A tick in flight finishes (its database writes are whole); one stuck on the cluster is left to the exit.
            if self._thread is not None:
                self._thread.join(timeout=self._share_of_grace(0.3, 10))
            if exporter is not None:
                exporter.join(timeout=self._share_of_grace(0.3, 10))

        return stop

    def app(self) -> FastAPI:
        return create_app(
            self.settings, start_background=self.start_dispatcher, logs_provider=self.logs, node_drainer=self.drain_node
        )

    def close(self) -> None:
        """Stop the Ray agent (it leaves the cluster) before an embedded head goes."""
        # The agent leaves the cluster in a second or two; one that takes longer is ended with the server's processes.
        leaving = threading.Thread(target=self.cluster.disconnect, name="ray-agent-close", daemon=True)
        leaving.start()
        leaving.join(timeout=self._share_of_grace(0.25, 30))
        if self.head is not None:
            left_s = self._share_of_grace(1.0, HEAD_STOP_GRACE_S + _KILL_RESERVE_S) - _KILL_RESERVE_S
            stop_head(self.head, self.settings.data_dir, grace_s=max(0.0, min(left_s, HEAD_STOP_GRACE_S)))


# What a stop keeps of its grace period for killing what is left (a few looks at /proc, SIGKILL) and exiting.
_KILL_RESERVE_S = 1.5
# What is left of the server's processes once the agent and the head have had their turn (an agent that did not leave,
# a head whose start a signal cut short) gets this long after SIGTERM.
_LEFTOVER_GRACE_S = 1.0


class _StopRequested(BaseException):
    """A signal arrived while the server was starting: what has started is stopped at once."""


class _Stop:
    """How `serve` stops: the first SIGTERM or SIGINT (`ringmaster stop` sends SIGTERM) starts a stop that ends the
    server and every process it started within grace_s; a second one cuts uvicorn's part short."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested_at: float | None = None
        self.plane: ControlPlane | None = None
        self.server: uvicorn.Server | None = None
        self.starting = True

    def begin(self) -> float:
        """The stop's deadline; the grace period starts now unless a signal started it (the server may also end by
        itself: its port taken, its head failed)."""
        if self.requested_at is None:
            self.requested_at = time.monotonic()
        return self.requested_at + self.grace_s

    def left_s(self) -> float:
        return max(0.0, self.begin() - time.monotonic())

    def elapsed_s(self) -> float:
        return time.monotonic() - (self.requested_at or time.monotonic())

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        first = self.requested_at is None
        if first:
            self.requested_at = time.monotonic()
            log.info("%s: stopping within %.0f s", signal.Signals(signum).name, self.grace_s)
        if self.plane is not None:
            self.plane.stop_deadline = self.begin()
        if self.server is not None:
            self.server.should_exit = True
            self.server.force_exit = not first  # skip waiting for open connections
        elif self.starting and first:
            self.starting = False
            raise _StopRequested(signal.Signals(signum).name)


class _Server(uvicorn.Server):
    """uvicorn without signal handling of its own: _Stop's handlers ask it to exit. (uvicorn's re-raises the signal
    it caught once it has shut down; SIGTERM's default action then killed the process before the Ray head was
    stopped, which left the whole cluster running.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def run_server(settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT, then stop within settings.stop_grace_s: the API, the dispatcher, an embedded
    Ray head and every other process the server started. While it serves, the URL it listens on is in the data
    directory (Settings.api_address_path), where the CLI looks for it, and it holds the data directory's pid file
    (Settings.server_pid_path; DataDirInUse while another server holds it)."""
    configure_logging(log_format=settings.log_format)
    lock = ServerLock(settings.server_pid_path())
    stop = _Stop(settings.stop_grace_s)
    # Before anything starts: a signal at any moment from here on stops whatever has started by then.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop.handle)
    try:
        _serve(settings, stop)
    except _StopRequested as signalled:
        log.info("%s while starting: stopping what has started", signalled)
    finally:
        stop.starting = False
        try:
            if stop.plane is not None:
                stop.plane.stop_deadline = stop.begin()
                stop.plane.close()
        finally:
            # Whatever else this process started and is still there: a head whose start a signal cut short, an agent
            # that did not leave in time.
            leftovers = ProcessTree(os.getpid(), include_root=False)
            leftovers.end(grace_s=max(0.0, min(_LEFTOVER_GRACE_S, stop.left_s() - _KILL_RESERVE_S)))
            lock.release()
            if stop.plane is not None:  # not after a start that failed: its error is the one line to show
                log.info("stopped in %.1f s", stop.elapsed_s())


def _serve(settings: Settings, stop: _Stop) -> None:
    address = settings.api_address_path()
    try:
        stop.plane = plane = ControlPlane(settings)
        log.info("Ray dashboard: %s%s", plane.settings.ray_dashboard_url, plane.settings.ray_token_hint())
        stop.server = _Server(
            uvicorn.Config(
                plane.app(),
                host=plane.settings.api_host,
                port=plane.settings.api_port,
                log_config=None,  # uvicorn keeps the handlers configure_logging installed
                timeout_graceful_shutdown=max(1, round(settings.stop_grace_s * 0.2)),  # open connections, e.g. streams
            )
        )
        settings.write_api_address(plane.settings.resolved_api_url())
        stop.server.run()
    finally:
        address.unlink(missing_ok=True)


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
