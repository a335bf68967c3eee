"""`outbox.ui.roles.resolve`: who a request is, from its token or the proxy's role header; and
the console's token settings (`outbox.ui.app.access`)."""

from __future__ import annotations

import pytest

from outbox.errors import ConfigError
from outbox.ui import security
from outbox.ui.app import access
from outbox.ui.roles import LOCAL, Access, Identity, Refused, Role, resolve

VIEWER, OPERATOR, ADMIN = "viewer-token-0123456789", "operator-token-0123456789", "admin-token-0123456789"
ROLES = Access(tokens={VIEWER: Role.VIEWER, OPERATOR: Role.OPERATOR, ADMIN: Role.ADMIN})


def test_each_token_has_its_role_and_is_named_by_its_digest() -> None:
    for token, role in ((VIEWER, Role.VIEWER), (OPERATOR, Role.OPERATOR), (ADMIN, Role.ADMIN)):
        me = resolve(ROLES, token=token, header=None)
        assert me == Identity(role, security.who(token))
        assert token not in me.who


@pytest.mark.parametrize("token", [None, "", "wrong", VIEWER + "x", VIEWER[:-1]])
def test_no_or_a_wrong_token_is_a_401(token: str | None) -> None:
    with pytest.raises(Refused) as refused:
        resolve(ROLES, token=token, header=None)
    assert refused.value.status == 401 and "token is required" in refused.value.message


def test_without_tokens_or_header_everyone_is_the_local_admin() -> None:
    assert resolve(Access(), token=None, header=None) == LOCAL == Identity(Role.ADMIN, "local")
    assert resolve(Access(), token="anything", header="viewer") == LOCAL  # no header configured: ignored


def test_the_role_header_only_when_enabled_and_then_it_decides() -> None:
    proxied = Access(tokens={ADMIN: Role.ADMIN}, role_header="X-Outbox-Role")
    assert resolve(proxied, token=None, header="Viewer") == Identity(Role.VIEWER, "proxy:viewer")
    assert resolve(proxied, token=ADMIN, header="operator") == Identity(Role.OPERATOR, "proxy:operator")
    assert resolve(proxied, token=ADMIN, header=None) == Identity(Role.ADMIN, security.who(ADMIN))
    with pytest.raises(Refused) as refused:
        resolve(proxied, token=None, header="root")
    assert refused.value.status == 403 and "X-Outbox-Role header names no role" in refused.value.message
    with pytest.raises(Refused) as refused:  # tokens without the header's help
        resolve(ROLES, token=None, header="admin")
    assert refused.value.status == 401
    header_only = Access(role_header="X-Outbox-Role")
    with pytest.raises(Refused) as refused:  # roles are configured: no more local admin
        resolve(header_only, token=None, header=None)
    assert refused.value.status == 401 and "X-Outbox-Role header is required" in refused.value.message


def test_roles_are_ordered() -> None:
    me = Identity(Role.OPERATOR, "x")
    assert me.may(Role.VIEWER) and me.may(Role.OPERATOR) and not me.may(Role.ADMIN)
    assert Role.parse(" ADMIN ") is Role.ADMIN and Role.parse("root") is None


def test_the_single_token_is_the_admins_and_more_tokens_have_their_roles() -> None:
    assert access(ADMIN, None, None) == Access(tokens={ADMIN: Role.ADMIN})
    assert access(ADMIN, {VIEWER: "viewer", OPERATOR: Role.OPERATOR}, " X-Role ") == Access(
        tokens={ADMIN: Role.ADMIN, VIEWER: Role.VIEWER, OPERATOR: Role.OPERATOR}, role_header="X-Role")
    assert access(None, None, None).open


@pytest.mark.parametrize(("token", "tokens", "header", "error"), [
    (None, {VIEWER: "root"}, None, "'root' is not a role"),
    (ADMIN, {ADMIN: "viewer"}, None, "one token is given two roles (admin and viewer)"),
    (None, {"": "viewer"}, None, "the viewer token is empty"),
    (None, None, " ", "role_header: must name a header"),
])
def test_bad_token_settings_are_config_errors(
    token: str | None, tokens: dict[str, str] | None, header: str | None, error: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        access(token, tokens, header)
    assert error in str(raised.value)
    assert ADMIN not in str(raised.value) and VIEWER not in str(raised.value)
