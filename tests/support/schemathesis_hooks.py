"""Schemathesis hooks for tests/api/test_schemathesis.py, loaded by the CLI through SCHEMATHESIS_HOOKS.

- POST /v1/code takes a zip archive: it is sent zips of a few small files (what application/zip means, which no
  JSON Schema states).
- The "pep508" string format (a pip requirement, JobSpec.runtime_env.pip) is generated as requirements.
- positive_data_acceptance is replaced by a stricter reading of ringmaster's contract: a request the schema allows
  is accepted, or refused with 422 only for rules no JSON Schema can state (service.errors.RULES_BEYOND_SCHEMA:
  a rule between fields, the cluster, the quota, something that does not exist), each entry naming its field.
- Every 422, whatever the request, names the field of each of its entries.
"""

from __future__ import annotations

import io
import json
import zipfile

import schemathesis
from hypothesis import strategies as st

from ringmaster.service.errors import RULES_BEYOND_SCHEMA
from ringmaster.service.spec import PEP508_FORMAT


def _zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return buffer.getvalue()


_PATHS = st.from_regex(r"\A[a-z][a-z0-9_]{0,7}(/[a-z][a-z0-9_]{0,7}){0,2}\.py\Z")
schemathesis.openapi.media_type(
    "application/zip", st.dictionaries(_PATHS, st.binary(max_size=64), min_size=1, max_size=3).map(_zipped)
)

_NAME = st.from_regex(r"\A[A-Za-z][A-Za-z0-9]{0,15}\Z")
_VERSION = st.from_regex(r"\A[0-9]{1,3}(\.[0-9]{1,3}){0,2}\Z")
schemathesis.openapi.format(
    PEP508_FORMAT,
    st.builds(
        lambda name, pin: name + pin,
        _NAME,
        st.one_of(st.just(""), _VERSION.map(lambda v: f"=={v}"), _VERSION.map(lambda v: f">={v}")),
    ),
)

# What positive_data_acceptance allows by default besides 2xx and 3xx: credentials, a resource that is gone or
# busy, throttling. 5xx is not_a_server_error's to report.
_ALLOWED_REFUSALS = frozenset({401, 403, 404, 409, 429})


@schemathesis.check
def positive_data_accepted_unless_a_rule_beyond_the_schema(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    if response.status_code < 400 or response.status_code >= 500 or response.status_code in _ALLOWED_REFUSALS:
        return None
    if response.status_code == 422:
        try:
            errors = json.loads(response.content)["detail"]
        except (ValueError, KeyError, TypeError):
            errors = None
        if (
            isinstance(errors, list)
            and errors
            and all(
                isinstance(error, dict) and error.get("type") in RULES_BEYOND_SCHEMA and error.get("field")
                for error in errors
            )
        ):
            return None
    raise AssertionError(
        f"A request the schema allows was refused with {response.status_code}, not for a rule "
        f"beyond the schema ({', '.join(RULES_BEYOND_SCHEMA)}) naming its field: "
        f"{response.content[:600].decode('utf-8', 'replace')}"
    )


@schemathesis.check
def every_422_names_its_field(ctx, response, case):
    if response.status_code != 422:
        return None
    errors = json.loads(response.content)["detail"]
    unnamed = [error for error in errors if not isinstance(error.get("field"), str) or not error["field"]]
    if unnamed:
        raise AssertionError(f"A 422 entry names no field: {json.dumps(unnamed)[:600]}")
    return None
