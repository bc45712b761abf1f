"""How a command ends on an expected failure: one line on the console and exit code 1, never a traceback."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import NoReturn, ParamSpec, TypeVar

import httpx
import typer
from rich.markup import escape

from ringmaster.cli.render import console
from ringmaster.service.client import ApiError, TokenRefused
from ringmaster.service.embedded_ray import HeadStartFailed
from ringmaster.service.settings import get_settings

_Parameters = ParamSpec("_Parameters")
_Result = TypeVar("_Result")


def _fail(message: str) -> NoReturn:
    # Unwrapped, and the message's own brackets (paths, a spec's text) printed as they are, not read as markup.
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code=1)


def _unreachable(error: httpx.TransportError) -> str:
    try:
        url = error.request.url
        where = f"{url.scheme}://{url.netloc.decode()}"
    except RuntimeError:  # an error raised before a request existed
        where = get_settings().client_api_url()
    if isinstance(error, httpx.TimeoutException):
        return f"ringmaster at {where} did not answer in time ({type(error).__name__})"
    return f"cannot reach ringmaster at {where} — is `ringmaster serve` running? set RINGMASTER_API_URL or --api"


def _handled(command: Callable[_Parameters, _Result]) -> Callable[_Parameters, _Result]:
    """The expected failures of a command that calls the API end it with one line and exit code 1, never a
    traceback: the server unreachable, a refused token (naming where it came from), any 4xx/5xx answer."""

    @functools.wraps(command)
    def run(*args: _Parameters.args, **kwargs: _Parameters.kwargs) -> _Result:
        try:
            return command(*args, **kwargs)
        except TokenRefused as error:
            _fail(
                f"the API refused the token from {error.source} ({error.detail}); set RINGMASTER_TOKEN to a token "
                "from `ringmaster token create`, or run the server on embedded defaults, which writes a local "
                "admin token this command picks up"
            )
        except ApiError as error:
            _fail(_describe(error))
        except httpx.TransportError as error:
            _fail(_unreachable(error))
        except HeadStartFailed as error:
            _fail(str(error))

    return run


def _describe(error: ApiError, subject: str = "job spec") -> str:
    if error.status == 422 and isinstance(error.detail, list):
        lines = []
        for item in error.detail:
            field = ".".join(str(part) for part in item.get("loc", [])[1:]) or "(spec)"
            lines.append(f"  {_naming_field_once(str(item.get('msg')), field)}")
        return f"invalid {subject}:\n" + "\n".join(lines)
    detail = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
    return f"{detail} (HTTP {error.status})"


def _naming_field_once(message: str, field: str) -> str:
    """`field: message`, naming the field once: a message that begins with its field (as one read without the field
    must: "field: …", or a sentence about it, "field (3) must …") is shown as it is, after the field's whole name."""
    named, separator, rest = message.partition(": ")
    if separator and (field == named or field.endswith("." + named)):
        return f"{field}: {rest}"
    if message.startswith(field + " "):
        return message
    return f"{field}: {message}"
