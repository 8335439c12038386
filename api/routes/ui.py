"""`/ui`: the status page, a static page whose script asks the `/v1` API with the user's key.

The page itself needs no key (it holds no data), so it sits outside `/v1`; everything it shows
comes from API calls that do.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from pagedbatch.protocol.errors import OpenAIError

router = APIRouter(include_in_schema=False)

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
ASSETS = {"ui.js": "text/javascript", "ui.css": "text/css"}
HEADERS = {
    # Only the page's own script, styles and API: the data it renders cannot run code.
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # Revalidated each load (cheaply, by ETag), so an upgraded server serves its own page.
    "cache-control": "no-cache",
}


@router.get("/ui")
def status_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=HEADERS)


@router.get("/ui/{asset}")
def status_page_asset(asset: str) -> FileResponse:
    if asset not in ASSETS:
        raise OpenAIError(f"No such asset: {asset}", status_code=404, code="unknown_url")
    return FileResponse(STATIC_DIR / asset, media_type=ASSETS[asset], headers=HEADERS)
