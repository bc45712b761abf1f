"""The FastAPI application: schema upgrade at startup, routers, error mapping, limits, optional background work.

Every /v1 route needs a bearer token (api.deps). /healthz and /metrics stay open: liveness probes and
Prometheus scrapers carry no token, and neither answers with anything a token would guard beyond job counts and
rates. /docs and /openapi.json stay open too: the schema is public.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CollectorRegistry

from ringmaster.api.errors import FiniteJSONResponse, install_error_handlers
from ringmaster.api.limits import JSON_VALUE, BodySizeLimit, json_value_schema, state_document_rules
from ringmaster.api.routes import code, health, internal, jobs, metrics, nodes, plan, queue, tenants, web
from ringmaster.service import telemetry
from ringmaster.service.auth import CheckedReportTokens, ensure_local_admin_token
from ringmaster.service.db import Database, upgrade_schema
from ringmaster.service.errors import RULES_BEYOND_SCHEMA
from ringmaster.service.job_plan import ClusterShapeProvider
from ringmaster.service.settings import Settings, get_settings
from ringmaster.service.spec import JobSpec

LogsProvider = Callable[[str], str]
"""Returns the log text of a Ray job given its submission id; raises service.errors.LogsUnavailable."""

NodeDrainer = Callable[[str, float | None, str], None]
"""Has Ray drain a node (its id, the deadline in seconds since the epoch or None, the reason); raises
service.errors.NodeNotFound, DrainRefused or ClusterUnavailable."""

BackgroundStarter = Callable[[FastAPI], Callable[[], None]]
"""Called once the schema is current and app.state.db is set; returns the function that stops it."""


def create_app(
    settings: Settings | None = None,
    *,
    start_background: BackgroundStarter | None = None,
    logs_provider: LogsProvider | None = None,
    node_drainer: NodeDrainer | None = None,
    cluster_shape_provider: ClusterShapeProvider | None = None,
) -> FastAPI:
    """Build the API; without start_background it only records jobs (nothing dispatches them).

    cluster_shape_provider tells submit the shape of the nodes (tp must divide the workers per node);
    when it is absent or returns None, the settings' gpus_per_node / cpus_per_node are used, if set.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url()
        upgrade_schema(url)
        app.state.db = Database.connect(url)
        if settings.database_url is None:
            # Embedded defaults: one local admin token in the data directory, which the CLI picks up.
            ensure_local_admin_token(app.state.db.sessions, settings.local_token_path())
        detach_telemetry = telemetry.attach(app.state.db.engine, app.state.telemetry)
        stop = start_background(app) if start_background else None
        try:
            yield
        finally:
            if stop is not None:
                stop()
            detach_telemetry()
            app.state.db.dispose()

    # docs_url and redoc_url off: FastAPI's pages load their scripts from a CDN; routes/web.py serves /docs itself.
    app = FastAPI(
        title="ringmaster",
        version="0.1.0",
        summary="Elastic distributed training as a service.",
        lifespan=lifespan,
        default_response_class=FiniteJSONResponse,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.logs_provider = logs_provider
    app.state.node_drainer = node_drainer
    app.state.cluster_shape_provider = cluster_shape_provider
    # One registry per app, never prometheus_client's global one: several apps in a process must not clash.
    app.state.metrics_registry = registry = CollectorRegistry()
    app.state.telemetry = telemetry.Telemetry(registry)
    registry.register(telemetry.DatabaseCollector(lambda: getattr(app.state, "db", None)))
    app.state.stream_poll_s = 0.5
    app.state.checked_report_tokens = CheckedReportTokens()
    install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_request_bytes,
        per_path={code.UPLOAD_PATH: (settings.max_code_bytes, "RINGMASTER_MAX_CODE_BYTES")},
    )
    app.include_router(jobs.router)
    app.include_router(queue.router)
    app.include_router(code.router)
    app.include_router(tenants.router)
    app.include_router(nodes.router)
    app.include_router(plan.router)
    app.include_router(internal.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    web.install(app)
    _document_spec_schema(app)
    return app


def _document_spec_schema(app: FastAPI) -> None:
    """POST /v1/jobs reads its body itself (JSON or YAML), so JobSpec's schema is added to OpenAPI by hand."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
            json_value_ref = f"#/components/schemas/{JSON_VALUE}"
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            spec_parts = spec_schema.pop("$defs", {})
            components.update(spec_parts)
            components["JobSpec"] = spec_schema
            # api.limits.check_document's rules (and service.json_types'), which every request body is held to.
            for name in (*REQUEST_BODIES, *spec_parts, "JobSpec"):
                state_document_rules(components[name], json_value_ref)
            components[JSON_VALUE] = json_value_schema(json_value_ref)
            _document_validation_errors(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# The request bodies FastAPI documents itself (JobSpec's are added above), with the models within them.
REQUEST_BODIES = (
    "PlanRequest",
    "QuotaIn",
    "DrainIn",
    "TokenIn",
    "DriverReport",
    "MetricPoint",
    "CheckpointRecord",
    "RankMemory",
)


def _document_validation_errors(components: dict[str, Any]) -> None:
    """FastAPI's 422 entry, with what api.errors adds: the field every entry names, and the types of the rules the
    schema itself cannot state (a request valid by this schema may break only those)."""
    entry = components["ValidationError"]
    entry["properties"]["field"] = {
        "type": "string",
        "title": "Field",
        "description": "The dotted path of the value at fault in the body, query or path (e.g. "
        "train.global_batch_size), or the part's own name (body) when the part as a whole is at fault: not JSON, "
        "not a zip.",
    }
    entry["required"] = [*entry["required"], "field"]
    entry["properties"]["type"]["description"] = (
        "The rule broken. Those this schema cannot state: " + ", ".join(RULES_BEYOND_SCHEMA) + " (a rule between "
        "fields; the cluster's nodes or GPUs; the tenant's quota; a job, code archive or model class that does not "
        "exist)."
    )
