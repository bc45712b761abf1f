"""Each job as an MLflow run (RINGMASTER_MLFLOW_TRACKING_URI): the JobSpec as parameters, every step's metrics, the
checkpoints' URIs as tags, and the final state as the run's status.

The control plane exports from its database, where every driver report lands, so a job that never started (its
runtime env failed) still ends its run FAILED. A background thread does it every few seconds; a replica takes a job's
row with FOR UPDATE SKIP LOCKED, so two never export the same job, and cursors in the row (mlflow_runs) make a
restart go on where the last export stopped. MLflow being down only delays the export.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from ringmaster.service.db import session_scope
from ringmaster.service.models import Checkpoint, Job, Metric, MlflowRun
from ringmaster.service.states import TERMINAL, JobState

log = logging.getLogger(__name__)

EXPORT_INTERVAL_S = 2.0
_METRIC_FIELDS = ("loss", "val_loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "world_size")
_BATCH_METRICS = 900  # MLflow's log_batch takes at most 1000 metrics
_BATCH_PARAMS = 100  # ... and 100 params
_ROWS_PER_PASS = 1000  # metric rows exported per job and pass (the rest at the next)
_PARAM_VALUE_CHARS = 6000
_STATUS = {JobState.SUCCEEDED: "FINISHED", JobState.FAILED: "FAILED", JobState.CANCELLED: "KILLED"}


def spec_params(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The spec flattened to MLflow params: `train.lr` → "0.001"; lists and nulls as JSON."""
    params: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(spec_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[name] = text[:_PARAM_VALUE_CHARS]
    return params


def metric_rows_after(session: Session, job_id: str, cursor: int, limit: int = _ROWS_PER_PASS) -> list[Metric]:
    """The job's metric rows stored after row `cursor`, oldest first (read through the (job_id, id) index)."""
    return list(
        session.scalars(
            select(Metric).where(Metric.job_id == job_id, Metric.id > cursor).order_by(Metric.id).limit(limit)
        )
    )


def _mlflow_values(metric: Metric) -> dict[str, float]:
    """A metric row's values by MLflow key: its fields', then the user's own metrics under their names (which the
    trainer keeps apart from the fields')."""
    values = {field: float(getattr(metric, field)) for field in _METRIC_FIELDS if getattr(metric, field) is not None}
    return values | (metric.user_metrics or {})


class MlflowExporter:
    def __init__(self, sessions: sessionmaker[Session], tracking_uri: str, experiment: str) -> None:
        from mlflow.tracking import MlflowClient

        self.sessions = sessions
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment = experiment
        self._experiment_id: str | None = None

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:
                log.warning("MLflow export failed; retrying", exc_info=True)
            stop.wait(EXPORT_INTERVAL_S)

    def run_once(self) -> None:
        """Export what is new of every job whose run is not finished yet."""
        with self.sessions() as session:
            pending = list(
                session.scalars(
                    select(Job.id)
                    .outerjoin(MlflowRun, MlflowRun.job_id == Job.id)
                    .where((MlflowRun.finished.is_(None)) | (MlflowRun.finished.is_(False)))
                )
            )
        for job_id in pending:
            self._export(job_id)

    def _experiment(self) -> str:
        if self._experiment_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            self._experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        return self._experiment_id

    def _export(self, job_id: str) -> None:
        from mlflow.entities import Metric as MlflowMetric
        from mlflow.entities import Param, RunTag

        with self.sessions() as session:
            known = session.get(MlflowRun, job_id) is not None
        if not known and not self._claim(job_id):
            return
        with session_scope(self.sessions) as session:
            row = session.scalars(
                select(MlflowRun).where(MlflowRun.job_id == job_id).with_for_update(skip_locked=True)
            ).one_or_none()
            if row is None:
                return  # another replica is exporting it now
            job = session.get_one(Job, job_id)  # there is one: the mlflow_runs row references it
            if row.run_id is None:
                run = self.client.create_run(
                    self._experiment(),
                    run_name=job.name,
                    tags={
                        "ringmaster.job_id": job.id,
                        "ringmaster.tenant": job.tenant,
                        # A script job (command) splits its model itself: "script" says so.
                        "ringmaster.strategy": "script" if job.spec.get("command") else job.spec.get("strategy", ""),
                    },
                )
                row.run_id = run.info.run_id
                params = [Param(key, value) for key, value in spec_params(job.spec).items()]
                for start in range(0, len(params), _BATCH_PARAMS):
                    self.client.log_batch(row.run_id, params=params[start : start + _BATCH_PARAMS])
            metrics = metric_rows_after(session, job_id, row.metric_cursor)
            batch = [
                MlflowMetric(key, value, int((metric.wall_time or metric.recorded_at.timestamp()) * 1000), metric.step)
                for metric in metrics
                for key, value in _mlflow_values(metric).items()
            ]
            for start in range(0, len(batch), _BATCH_METRICS):
                self.client.log_batch(row.run_id, metrics=batch[start : start + _BATCH_METRICS])
            if metrics:
                row.metric_cursor = metrics[-1].id
            checkpoints = list(
                session.scalars(
                    select(Checkpoint)
                    .where(Checkpoint.job_id == job_id, Checkpoint.id > row.checkpoint_cursor)
                    .order_by(Checkpoint.id)
                )
            )
            if checkpoints:
                tags = [RunTag(f"checkpoint.step-{c.step:08d}", c.uri) for c in checkpoints]
                tags.append(RunTag("checkpoint.latest", checkpoints[-1].uri))
                self.client.log_batch(row.run_id, tags=tags)
                row.checkpoint_cursor = checkpoints[-1].id
            state = JobState(job.state)
            more = len(metrics) == _ROWS_PER_PASS
            if state in TERMINAL and not more:
                tags = [RunTag("ringmaster.state", state.value)] + (
                    [RunTag("ringmaster.error", job.error[:5000])] if job.error else []
                )
                self.client.log_batch(row.run_id, tags=tags)
                self.client.set_terminated(row.run_id, status=_STATUS[state])
                row.finished = True

    def _claim(self, job_id: str) -> bool:
        """Insert the job's row; False when another replica did first."""
        try:
            with session_scope(self.sessions) as session:
                session.add(MlflowRun(job_id=job_id, metric_cursor=0, checkpoint_cursor=0, finished=False))
            return True
        except IntegrityError:
            return False
