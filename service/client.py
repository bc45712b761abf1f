"""A small REST client for the CLI, the demo and the benchmarks."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from ringmaster.service.code_packing import pack_directory
from ringmaster.service.settings import Settings

UPLOAD_TIMEOUT_S = 600.0  # an archive may be RINGMASTER_MAX_CODE_BYTES (100 MiB by default)


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class TokenRefused(ApiError):
    """401: the API did not accept the token; `source` says where the token came from."""

    def __init__(self, status: int, detail: Any, source: str) -> None:
        super().__init__(status, detail)
        self.source = source


class RingmasterClient:
    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        max_code_bytes: int = Settings.model_fields["max_code_bytes"].default,
        token_source: str = "the caller",
    ) -> None:
        """`max_code_bytes`: the largest code archive this client packs (the server refuses larger ones with 413);
        `token_source`: where the token came from, named when the API refuses it."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self.max_code_bytes = max_code_bytes
        self.token_source = token_source

    @classmethod
    def from_settings(cls, settings: Settings, api_url: str | None = None) -> RingmasterClient:
        """A client of api_url (default: Settings.client_api_url) with the settings' token (Settings.client_token)."""
        return cls(
            api_url or settings.client_api_url(),
            token=settings.client_token(),
            max_code_bytes=settings.max_code_bytes,
            token_source=settings.client_token_source(),
        )

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except (json.JSONDecodeError, AttributeError):
                detail = response.text
            if response.status_code == 401:
                raise TokenRefused(response.status_code, detail, self.token_source)
            raise ApiError(response.status_code, detail)
        return (
            response.json()
            if response.headers.get("content-type", "").startswith("application/json")
            else response.text
        )

    def _object(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """_call to an endpoint that answers a JSON object (every one but the logs)."""
        answer: dict[str, Any] = self._call(method, path, **kwargs)
        return answer

    def healthy(self) -> bool:
        try:
            return self._http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the API did not become healthy within {timeout_s:.0f}s")
            time.sleep(0.2)

    def submit_yaml(self, text: str, code: Path | None = None) -> dict[str, Any]:
        """Submit a YAML (or JSON) spec; with `code`, that directory is packed and uploaded first and the spec names
        it."""
        if code is None:
            return self._object("POST", "/v1/jobs", content=text, headers={"Content-Type": "application/yaml"})
        spec = yaml.safe_load(text)
        if not isinstance(spec, dict):
            raise ValueError("a job spec must be a mapping of fields")
        return self.submit(spec, code=code)

    def submit(self, spec: dict[str, Any], code: Path | None = None) -> dict[str, Any]:
        """Submit a spec; with `code`, that directory is packed and uploaded first (upload_code) and the spec names
        it."""
        if code is not None:
            if spec.get("code") is not None:
                raise ValueError(
                    f"the spec names its code already ({spec['code']}); leave out either that field or the directory"
                )
            spec = {**spec, "code": self.upload_code(code)["code"]}
        return self._object("POST", "/v1/jobs", json=spec)

    def upload_code(self, directory: Path) -> dict[str, Any]:
        """Pack a directory (service.code_packing) and store it for this token's tenant, unless it is stored already;
        the answer's `code` is what a spec names it by. Raises CodeTooLarge, CodeDirectoryError or ApiError."""
        packed = pack_directory(Path(directory), self.max_code_bytes)
        try:
            return self._object("GET", f"/v1/code/{packed.ref}")
        except ApiError as error:
            if error.status != 404:
                raise
        return self._object(
            "POST",
            "/v1/code",
            content=packed.content,
            headers={"Content-Type": "application/zip"},
            timeout=UPLOAD_TIMEOUT_S,
        )

    def job(self, job_id: str) -> dict[str, Any]:
        return self._object("GET", f"/v1/jobs/{job_id}")

    def jobs(
        self, state: str | None = None, limit: int = 50, offset: int = 0, id_prefix: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if state:
            params["state"] = state
        if id_prefix:
            params["id_prefix"] = id_prefix
        return self._object("GET", "/v1/jobs", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._object("POST", f"/v1/jobs/{job_id}/cancel")

    def events(self, job_id: str) -> dict[str, Any]:
        return self._object("GET", f"/v1/jobs/{job_id}/events")

    def metrics(self, job_id: str, limit: int = 1000, offset: int = 0) -> dict[str, Any]:
        return self._object("GET", f"/v1/jobs/{job_id}/metrics", params={"limit": limit, "offset": offset})

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return self._object("GET", f"/v1/jobs/{job_id}/checkpoints")

    def queue(self, tenant: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        """GET /v1/queue: the queued jobs in plan order with why each waits, and the tenants' fair-share standing."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if tenant:
            params["tenant"] = tenant
        return self._object("GET", "/v1/queue", params=params)

    def drain_node(self, node_id: str, deadline_s: float | None = None, reason: str | None = None) -> dict[str, Any]:
        """POST /v1/nodes/{id}/drain (an admin's): Ray places nothing new on the node, and its jobs move off it."""
        body: dict[str, Any] = {"deadline_s": deadline_s}
        if reason is not None:
            body["reason"] = reason
        return self._object("POST", f"/v1/nodes/{node_id}/drain", json=body)

    def me(self) -> dict[str, Any]:
        """GET /v1/me: the token's tenant (quotas and usage) and whether it is an admin's."""
        return self._object("GET", "/v1/me")

    def plan(self, request: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/plan: the options table and the recommendation for a model on a cluster."""
        return self._object("POST", "/v1/plan", json=request)

    def logs(self, job_id: str) -> str:
        text: str = self._call("GET", f"/v1/jobs/{job_id}/logs")  # answered as text/plain
        return text

    def follow(self, job_id: str, interval_s: float = 0.5) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Yield (job, new metric rows) until the job reaches a terminal state."""
        seen = 0
        while True:
            job = self.job(job_id)
            rows = self.metrics(job_id)["items"]
            yield job, rows[seen:]
            seen = len(rows)
            if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                return
            time.sleep(interval_s)

    def stream(self, job_id: str, last_event_id: str | None = None, reconnects: int = 5) -> Iterator[dict[str, Any]]:
        """Server-sent events of GET /v1/jobs/{id}/stream as {"id", "event", "data"} dicts, until the job ends.

        A dropped connection is resumed with Last-Event-ID (up to ``reconnects`` times in a row); an HTTP error
        status raises ApiError before anything was yielded, so a caller can fall back to polling.
        """
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_event_id is not None:
                headers["Last-Event-ID"] = last_event_id
            try:
                # The client's timeouts but a minute's read (the server sends a keepalive comment every 15 s). A tuple,
                # not an httpx.Timeout, so a client of httpx2 (starlette's TestClient, where it is installed) takes it
                # too.
                timeout = self._http.timeout
                with self._http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/stream",
                    headers=headers,
                    timeout=(timeout.connect, 60.0, timeout.write, timeout.pool),
                ) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise ApiError(response.status_code, response.text)
                    fields: dict[str, str] = {}
                    for line in response.iter_lines():
                        if line:
                            if not line.startswith(":") and ":" in line:
                                name, _, value = line.partition(":")
                                fields[name] = value[1:] if value.startswith(" ") else value
                            continue
                        if "data" in fields:
                            last_event_id = fields.get("id", last_event_id)
                            failures = 0
                            yield {
                                "id": last_event_id,
                                "event": fields.get("event", "message"),
                                "data": json.loads(fields["data"]),
                            }
                        fields = {}
                return  # the server ends the stream once the job is terminal
            except (httpx.TransportError, httpx.RemoteProtocolError):
                failures += 1
                if failures > reconnects:
                    raise
                time.sleep(min(0.5 * failures, 5.0))
