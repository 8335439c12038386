"""The `/v1` API: a router per resource, all behind the API-key check."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from pagedbatch.api.auth import get_owner
from pagedbatch.api.routes import batches, files, models

api_router = APIRouter(prefix="/v1", dependencies=[Depends(get_owner)])
api_router.include_router(batches.router)
api_router.include_router(files.router)
api_router.include_router(models.router)
