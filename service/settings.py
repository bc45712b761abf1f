"""One settings object for the whole control plane, read from RINGMASTER_* variables."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ringmaster.service.ray_auth import RayAuth
from ringmaster.service.scheduling.model import PolicyName


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RINGMASTER_", extra="ignore")

    data_dir: Path = Field(
        default=Path(".ringmaster"), description="Where the embedded database, Ray head state and checkpoints live."
    )
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; default: SQLite file under data_dir.")
    ray_address: str | None = Field(
        default=None, description="GCS address of an existing Ray cluster; unset starts an embedded head."
    )
    ray_dashboard_url: str | None = Field(
        default=None, description="That cluster's dashboard / Jobs API URL; derived when embedded."
    )
    storage_uri: str | None = Field(default=None, description="Checkpoint storage; default: data_dir/checkpoints.")
    api_host: str = "127.0.0.1"
    api_port: int = 8765
    api_url: str | None = Field(
        default=None, description="URL the job driver uses to report back; default from host and port."
    )
    dispatch_interval_s: float = Field(default=0.5, gt=0)
    lease_s: float = Field(
        default=30.0, gt=0, description="How long a dispatcher owns a claimed job before another may take it."
    )
    admission_wait_s: float = Field(
        default=1.0, gt=0, description="How long to wait for a placement group before leaving a job queued."
    )
    scheduling_policy: PolicyName = Field(
        default=PolicyName.ELASTIC,
        description="How queued jobs share the cluster: fifo (priority, then age; a job that does not fit is passed "
        "over), backfill (fifo with a reservation for the head of the queue), fair (backfill, equal priorities by "
        "tenant fair share), elastic (fair, plus preemption of lower-priority jobs), las (least attained service).",
    )
    min_run_before_preemption_s: float = Field(
        default=300.0, ge=0, description="How long a job runs before a job of higher priority may preempt it."
    )
    min_resize_interval_s: float = Field(default=60.0, ge=0, description="The least time between two resizes of a job.")
    fair_share_half_life_s: float = Field(
        default=3600.0,
        gt=0,
        description="Fair share weighs a tenant's usage this long ago half as much as its usage now.",
    )
    reserve_after_s: float = Field(
        default=1800.0,
        ge=0,
        description="elastic: a job that has waited this long ranks first among its tenant's jobs of its priority and "
        "may take room from the jobs ranked after it; until then, capacity it cannot use goes to the jobs behind it.",
    )
    hold_after_s: float = Field(
        default=7200.0,
        ge=0,
        description="elastic: a job that has waited this long and still cannot start has free capacity held for it: "
        "from every job when what it lacks is held by jobs it may take once their protection ends, else only from "
        "jobs that are not preemptible.",
    )
    fair_share_preemption_above: float = Field(
        default=2.0,
        gt=0,
        description="elastic: between equal priorities a tenant's job is preempted (not only shrunk) for fair share "
        "only while its tenant holds more than this many times its weighted share.",
    )
    preemption_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="How long a preempted job has to save and stop; then its attempt is stopped, and it resumes from "
        "its latest checkpoint.",
    )
    driver_python: str = Field(default="python", description="Interpreter that runs the job driver on the Ray cluster.")
    driver_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources a job's driver needs "
        '(the Jobs API\'s entrypoint_resources), e.g. {"ringmaster_driver": 1} '
        "where only worker nodes have that resource: with GCS fault tolerance, "
        "a driver off the head lives through the head's restart. Default: none "
        "(Ray places drivers on the head).",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=0,
        description="GPUs on each node workers run on, when the cluster "
        "does not say; the submit-time check keeps tensor-parallel groups inside a node.",
    )
    cpus_per_node: float | None = Field(
        default=None, gt=0, description="CPUs on each node workers run on (CPU jobs), as above."
    )
    nodes: int | None = Field(default=None, ge=1, description="Nodes in the cluster, when fixed.")
    code_path: str | None = Field(
        default=None,
        description="PYTHONPATH for job drivers and workers, where user models "
        "('package.module:function') are imported from; embedded default: the current directory.",
    )
    warm_workers_per_node: int = Field(
        default=2,
        ge=0,
        description="Idle CPU worker processes, torch imported, that "
        "the dispatcher keeps on each node for any job to claim: a job's CPU workers "
        "start without a process start or `import torch`. 0 turns the pool off.",
    )
    warm_runtime_envs: int = Field(
        default=2,
        ge=0,
        description="Runtime envs of jobs that bring their own (code, pip "
        "requirements or variables) that keep a warm pool of their own, the most recently "
        "submitted first: the next job in one of these envs starts warm. 0: such jobs always "
        "start cold workers.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="With it, each job is an MLflow run there: the "
        "JobSpec as parameters, per-step metrics, checkpoint URIs as tags, final state.",
    )
    mlflow_experiment: str = Field(default="ringmaster", description="The MLflow experiment jobs' runs go in.")
    ray_start_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long the embedded Ray head may take to "
        "answer before its start counts as failed (it is tried twice).",
    )
    ray_head_node_ip: str = Field(
        default="127.0.0.1",
        description="The address the embedded Ray head advertises and its processes listen on. 127.0.0.1: loopback "
        "alone, nothing of Ray is reachable from the network. Another address (this machine's, for other machines to "
        "join the head with `ray start --address`) makes Ray listen on every interface: Ray binds loopback or all.",
    )
    ray_auth_token: SecretStr | None = Field(
        default=None,
        description="The token of an external Ray cluster (RINGMASTER_RAY_ADDRESS) that runs with token "
        "authentication (RAY_AUTH_MODE=token). The embedded head needs none: it makes its own, "
        "data_dir/ray-auth-token.",
    )
    ray_auth_token_file: Path | None = Field(
        default=None,
        description="A file that holds that token, read at each use, instead of ray_auth_token. Neither set: the "
        "external cluster is called without a token.",
    )
    ray_client_server: bool = Field(
        default=False,
        description="Start the Ray client server (ray://) on the embedded head; ringmaster itself does not need it.",
    )
    stop_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="How long `serve` may take to stop on SIGTERM, SIGINT or `ringmaster stop`: in-flight requests, "
        "the dispatcher and the embedded Ray head stop within it, and whatever of the server's processes is left "
        "then is killed. The default fits the shortest grace period a container gets (`docker stop`'s 10 s).",
    )
    log_format: Literal["auto", "json", "text"] = Field(
        default="auto",
        description="`serve`'s log lines: text on a terminal and JSON otherwise (auto), or always json or text.",
    )
    token: SecretStr | None = Field(
        default=None,
        description="API token the CLI and client send; default: the local "
        "admin token an embedded server writes to data_dir/admin.token.",
    )
    max_request_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="Largest request body the API reads; a larger one is refused with 413 before it is read.",
    )
    max_code_bytes: int = Field(
        default=100 * 1024 * 1024,
        ge=1024,
        description="Largest code archive a job may ship "
        "(POST /v1/code), packed and unpacked alike; a larger one is refused with 413.",
    )

    @model_validator(mode="after")
    def _one_ray_token_source(self) -> Settings:
        if self.ray_auth_token is not None and self.ray_auth_token_file is not None:
            raise ValueError("set RINGMASTER_RAY_AUTH_TOKEN or RINGMASTER_RAY_AUTH_TOKEN_FILE, not both")
        return self

    def ray_auth(self) -> RayAuth | None:
        """The token ringmaster's Ray clients present, or None for a cluster without authentication."""
        if self.ray_auth_token is not None:
            return RayAuth(token=self.ray_auth_token.get_secret_value())
        if self.ray_auth_token_file is not None:
            return RayAuth(token_path=self.ray_auth_token_file)
        return None

    def ray_token_hint(self) -> str:
        """Where a person finds the token the Ray dashboard asks for, said after the dashboard's URL."""
        if self.ray_auth_token_file is not None:
            return f" (it asks for the token in {self.ray_auth_token_file})"
        if self.ray_auth_token is not None:
            return " (it asks for the token in RINGMASTER_RAY_AUTH_TOKEN)"
        return ""

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'ringmaster.db').resolve()}"

    def resolved_storage_uri(self) -> str:
        if self.storage_uri:
            return self.storage_uri
        return str((self.data_dir / "checkpoints").resolve())

    def code_cache_dir(self) -> Path:
        """Where the dispatcher writes the code archives it hands Ray (copies of the database's, by tenant and hash)."""
        return (self.data_dir / "code").resolve()

    def local_token_path(self) -> Path:
        """Where a server on the embedded database keeps its local admin token (mode 0600)."""
        return self.data_dir / "admin.token"

    def client_token(self) -> str | None:
        """The token to call the API with: RINGMASTER_TOKEN, else the local admin token file if there is one."""
        if self.token is not None:
            return self.token.get_secret_value()
        try:
            return self.local_token_path().read_text().strip() or None
        except OSError:
            return None

    def client_token_source(self) -> str:
        """Where client_token comes from, as a person would look for it."""
        if self.token is not None:
            return "RINGMASTER_TOKEN"
        path = self.local_token_path().resolve()
        return str(path) if path.exists() else f"nowhere (RINGMASTER_TOKEN is unset and there is no {path})"

    def resolved_api_url(self) -> str:
        if self.api_url:
            return self.api_url.rstrip("/")
        host = "127.0.0.1" if self.api_host in ("0.0.0.0", "::") else self.api_host
        return f"http://{host}:{self.api_port}"

    def api_address_path(self) -> Path:
        """Where a running `ringmaster serve` writes the URL it listens on, for the CLI to find it there."""
        return self.data_dir / "api-url"

    def server_pid_path(self) -> Path:
        """The pid file a running `ringmaster serve` holds locked (service/server_lock.py): one server a directory."""
        return self.data_dir / "server.pid"

    def write_api_address(self, url: str) -> None:
        """Say where this server listens (api_address_path); written whole then renamed, so a CLI reading it at the
        same moment sees the old file or the new one, never an empty one."""
        path = self.api_address_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(url + "\n")
        os.replace(partial, path)

    def client_api_url(self) -> str:
        """The URL the CLI calls: RINGMASTER_API_URL, else RINGMASTER_API_HOST/PORT when set, else where the local
        server said it listens (api_address_path), else the default host and port."""
        if self.api_url or {"api_host", "api_port"} & self.model_fields_set:
            return self.resolved_api_url()
        try:
            return self.api_address_path().read_text().strip().rstrip("/") or self.resolved_api_url()
        except OSError:
            return self.resolved_api_url()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
