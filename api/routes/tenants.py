"""Tenants, their quotas and API tokens: the caller's own view (/v1/me) and the admins' routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from ringmaster.api.deps import AdminPrincipal, CurrentPrincipal, SessionDep
from ringmaster.api.errors import error_responses
from ringmaster.api.schemas import PrincipalOut, QuotaIn, TenantOut, TokenCreatedOut, TokenIn, TokenOut
from ringmaster.service import auth, tenants

router = APIRouter(prefix="/v1", tags=["tenants"], responses=error_responses(400, 401, 403, 413))

TenantName = Annotated[str, Path(pattern=tenants.NAME_PATTERN, max_length=64)]
TokenId = Annotated[int, Path(ge=1, le=2**31 - 1)]


def _tenant_out(session: SessionDep, name: str) -> TenantOut:
    return TenantOut.from_row(tenants.get_tenant(session, name), tenants.usage(session, name))


@router.get("/me")
def me(principal: CurrentPrincipal, session: SessionDep) -> PrincipalOut:
    """Who the token speaks for, with the tenant's quotas and what its jobs hold now."""
    return PrincipalOut(
        tenant=_tenant_out(session, principal.tenant), admin=principal.admin, token_id=principal.token_id
    )


@router.get("/tenants")
def list_tenants(_admin: AdminPrincipal, session: SessionDep) -> list[TenantOut]:
    return [TenantOut.from_row(tenant, tenants.usage(session, tenant.name)) for tenant in tenants.list_tenants(session)]


@router.get("/tenants/{name}", responses=error_responses(404))
def get_tenant(name: TenantName, principal: CurrentPrincipal, session: SessionDep) -> TenantOut:
    """A tenant's quotas and usage; a tenant's token sees only its own (another answers 404, as for jobs)."""
    if principal.scope is not None and principal.scope != name:
        raise tenants.TenantNotFound(name)
    return _tenant_out(session, name)


@router.put("/tenants/{name}")
def put_tenant(name: TenantName, body: QuotaIn, _admin: AdminPrincipal, session: SessionDep) -> TenantOut:
    """Create the tenant, or replace its quotas (and its fair-share weight, when given); a quota lowered below what it
    holds stops further admissions only."""
    tenants.put_tenant(session, name, body.quota(), weight=body.weight)
    return _tenant_out(session, name)


@router.post("/tokens", status_code=status.HTTP_201_CREATED)
def create_token(body: TokenIn, _admin: AdminPrincipal, session: SessionDep) -> TokenCreatedOut:
    """A new token (its tenant created without quotas when missing); the secret is in this answer only."""
    issued = auth.create_token(session, body.tenant, admin=body.admin, description=body.description)
    return TokenCreatedOut(
        **TokenOut.model_validate(issued.row).model_dump(), token=issued.secret, tenant_created=issued.tenant_created
    )


@router.get("/tokens")
def list_tokens(
    _admin: AdminPrincipal,
    session: SessionDep,
    tenant: Annotated[str | None, Query(pattern=tenants.NAME_PATTERN, max_length=64)] = None,
) -> list[TokenOut]:
    """Every token (never its secret), optionally of one tenant."""
    return [TokenOut.model_validate(token) for token in auth.list_tokens(session, tenant)]


@router.post("/tokens/{token_id}/revoke", responses=error_responses(404, 409))
def revoke_token(token_id: TokenId, admin: AdminPrincipal, session: SessionDep) -> TokenOut:
    """Refuse the token from the next request on; 409 for the token of this very request."""
    return TokenOut.model_validate(auth.revoke_token(session, token_id, by=admin))
