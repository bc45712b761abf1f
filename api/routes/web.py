"""The web view (`/ui`) and the API's docs (`/docs`), every asset served from this package (api/web/), nothing from
a CDN: clusters are often offline. The pages call the REST API with the token a person enters in the browser."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

WEB = Path(__file__).resolve().parents[1] / "web"
STATIC = "/ui/static"
_SWAGGER = f"{STATIC}/vendor/swagger-ui-5.35.0"

router = APIRouter(include_in_schema=False)


@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/ui")


@router.get("/ui")
@router.get("/ui/{page:path}")
def page(page: str = "") -> FileResponse:
    """Every page of the view is the one document; its script draws what the path names (jobs, a job, the queue, plan,
    submit)."""
    return FileResponse(WEB / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/docs")
def docs() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="ringmaster API",
        swagger_js_url=f"{_SWAGGER}/swagger-ui-bundle.js",
        swagger_css_url=f"{_SWAGGER}/swagger-ui.css",
        swagger_favicon_url=f"{_SWAGGER}/favicon-32x32.png",
    )


def install(app: FastAPI) -> None:
    # The static mount first: /ui/{page:path} would otherwise answer for the assets too.
    app.mount(STATIC, StaticFiles(directory=WEB), name="ui-static")
    app.include_router(router)
