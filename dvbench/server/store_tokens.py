"""API tokens: created for an owner under a name, stored hashed, listed, revoked, expiring.

A mixin of ``db.Store``. Example::

  owner_id, token = store.create_token("alice", name="alice-laptop", expires_in_days=30)
  store.token_owner(token)  # TokenCheck(owner="alice", problem=None)
  store.revoke_token("alice-laptop")
"""

import dataclasses
import hashlib
import re
import secrets
import time

import sqlalchemy as sa

from dvbench.server.schema import owners, tokens

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NAME_RULE = ("1-100 characters of letters, digits, '.', '_' or '-', starting with a letter or "
             "digit")

# Built once: every request checks its token (building the statement cost more CPU than
# running it).
_TOKEN_OWNER = (sa.select(owners.c.name, tokens.c.name.label("token"), tokens.c.expires_at,
                          tokens.c.revoked_at).select_from(tokens.join(owners))
                .where(tokens.c.token_hash == sa.bindparam("token_hash")))


class BadName(ValueError):
  """An owner or token name outside ``NAME``."""


def check_name(name: str, what: str) -> str:
  """``name`` when it matches ``NAME``; BadName saying the rule otherwise."""
  if not isinstance(name, str) or not NAME.fullmatch(name):
    raise BadName(f"{what} {name!r} is not acceptable: use {NAME_RULE}.")
  return name


def hash_token(token: str) -> str:
  return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class TokenCheck:
  """The owner a token writes for, or why it may not (``problem``); both None: unknown."""

  owner: str | None
  problem: str | None = None


class TokenQueries:
  """Create, check, list and revoke tokens."""

  def create_token(self, owner: str, name: str | None = None,
                   expires_in_days: float | None = None) -> tuple[int, str]:
    """Creates ``owner`` if needed and a new token for it; returns (owner id, token)."""
    check_name(owner, "owner name")
    name = check_name(name or f"{owner}-{secrets.token_hex(3)}", "token name")
    if expires_in_days is not None and not 0 < expires_in_days <= 36500:
      raise ValueError(f"--expires-in is a number of days in (0, 36500], got {expires_in_days}.")
    token, now = "dvb_" + secrets.token_urlsafe(32), time.time()
    with self.engine.begin() as conn:
      if conn.execute(sa.select(tokens.c.id).where(tokens.c.name == name)).first():
        raise BadName(f"a token named {name!r} exists; pick another name (see "
                      "'dvbench token list').")
      owner_id = self._owner_id(conn, owner, create=True)
      conn.execute(tokens.insert().values(
          owner_id=owner_id, token_hash=hash_token(token), created_at=now, name=name,
          expires_at=None if expires_in_days is None else now + expires_in_days * 86400))
    return owner_id, token

  def token_owner(self, token: str) -> TokenCheck:
    with self.engine.connect() as conn:
      row = conn.execute(_TOKEN_OWNER, {"token_hash": hash_token(token)}).mappings().first()
    if row is None:
      return TokenCheck(None)
    if row["revoked_at"] is not None:
      return TokenCheck(None, f"API token '{row['token']}' was revoked; ask the server's "
                        f"operator for a new one ('dvbench token create {row['name']}').")
    if row["expires_at"] is not None and row["expires_at"] <= time.time():
      return TokenCheck(None, f"API token '{row['token']}' expired; ask the server's operator "
                        f"for a new one ('dvbench token create {row['name']}').")
    return TokenCheck(row["name"])

  def owner_of_token(self, token: str) -> str | None:
    """The owner of a usable token; None for unknown, revoked or expired ones."""
    return self.token_owner(token).owner

  def list_tokens(self, owner: str | None = None) -> list[dict]:
    """Every token (never the secret): name, owner, created, expires, revoked."""
    query = (sa.select(tokens.c.name, owners.c.name.label("owner"), tokens.c.created_at,
                       tokens.c.expires_at, tokens.c.revoked_at)
             .select_from(tokens.join(owners)).order_by(tokens.c.created_at, tokens.c.id))
    if owner is not None:
      query = query.where(owners.c.name == owner)
    with self.engine.connect() as conn:
      return [dict(r) for r in conn.execute(query).mappings()]

  def revoke_token(self, name: str) -> bool:
    """Revokes the token ``name``; False when no unrevoked token has that name."""
    with self.engine.begin() as conn:
      return conn.execute(tokens.update().where(
          (tokens.c.name == name) & tokens.c.revoked_at.is_(None)
      ).values(revoked_at=time.time())).rowcount == 1
