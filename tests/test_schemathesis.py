"""Property-based: every operation of the OpenAPI schema, fed generated input with an admin's token, never answers
5xx and always answers as the schema says (status code, content type, headers, body), on both databases."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ringmaster.api.app import create_app
from api_tokens import mint
from ringmaster.service.auth import new_report_token
from ringmaster.service.db import session_scope
from ringmaster.service.jobs import cancel_job, get_job, mark_admitted, submit_job
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec

EXAMPLES_PER_OPERATION = 30
# POST /v1/code takes a zip's bytes: sent as they are, as schemathesis sends application/octet-stream.
schemathesis.serializer.alias("application/zip", "application/octet-stream")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, ignored_auth]


class Seeded:
    """An admin token, and jobs the generated cases are pointed at now and then: queued, admitted, cancelled."""

    token = ""
    job_ids: list[str] = []
    finished = ""  # a stream ends only with its job: streams are pointed at this one


@pytest.fixture
def api_schema(db_url: str, tmp_path: Path) -> Iterator[schemathesis.BaseSchema]:
    app = create_app(Settings(database_url=db_url, data_dir=tmp_path))
    app.state.stream_poll_s = 0.01
    app.state.logs_provider = lambda submission_id: f"log of {submission_id}\n"
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)  # starts the app's lifespan: the schema is current
    Seeded.token = mint(app, "fuzz", admin=True)
    spec = JobSpec.model_validate({"name": "seeded", "model": "mlp"})
    with session_scope(app.state.db.sessions) as session:
        queued, admitted, cancelled = submit_job(session, spec), submit_job(session, spec), submit_job(session, spec)
        mark_admitted(session, get_job(session, admitted.id), 1, f"ringmaster-{admitted.id}-1", None, 1,
                      report_token_hash=new_report_token()[1])
        cancel_job(session, cancelled.id)
        Seeded.job_ids, Seeded.finished = [queued.id, admitted.id, cancelled.id], cancelled.id
    yield schema
    asgi.shutdown_lifespans()


def test_no_input_makes_a_5xx_or_breaks_the_schema(api_schema: schemathesis.BaseSchema) -> None:
    """Every operation in turn on one database (one schema upgrade); all failing operations are reported together."""
    failures: dict[str, BaseException] = {}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:
        try:
            _fuzz(operation)
        except Exception as error:  # noqa: BLE001 — collected: one broken operation must not hide another
            failures[operation.label] = error
    assert not failures, "\n\n".join(f"{label}:\n{error}" for label, error in failures.items())


def _fuzz(operation: schemathesis.APIOperation) -> None:
    generated = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    streaming = operation.path.endswith("/stream")

    @given(case=generated)
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def call(case: schemathesis.Case) -> None:
        job_id = case.path_parameters.get("job_id") if case.path_parameters else None
        if isinstance(job_id, str) and len(job_id) % 2:  # half the time, a job that exists
            case.path_parameters["job_id"] = Seeded.finished if streaming else Seeded.job_ids[len(job_id) % len(Seeded.job_ids)]
        case.call_and_validate(headers={"Authorization": f"Bearer {Seeded.token}"}, checks=CHECKS)

    call()
