"""API tokens for the HTTP endpoint: who may call, with which role, and how much at once.

Ray Serve has no API keys of its own and Ray's cluster token does not guard Serve's HTTP port, so
the ingress checks a bearer token on every request against a tokens document read from a file
(a mounted Kubernetes Secret) or an environment variable, never from the serve config::

    tokens:
      - {name: alice, token: "s3cret-a", role: code}                 # may send programs
      - {name: bob, sha256: "<hex of the token>", role: ops, max_in_flight: 4}

Roles: ``ops`` (declarative ops only: nothing a request sends is ever executed as code on the
server) and ``code`` (programs too). Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from interlace.cluster.config import AuthConfig


class TokenEntry(BaseModel):
    """One API token of the tokens document."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Who holds it: in metrics and logs instead of the token.")
    token: str | None = Field(None, min_length=16, description="The token itself (at least 16 characters).")
    sha256: str | None = Field(None, description="Or the hex SHA-256 of the token.")
    role: str = Field("ops", description="ops (declarative only) or code (programs too).")
    max_in_flight: int | None = Field(None, gt=0, description="Traces this token may run at once; None: the "
                                      "server's max_in_flight_per_token.")

    @model_validator(mode="after")
    def _check(self) -> "TokenEntry":
        if (self.token is None) == (self.sha256 is None):
            raise ValueError(f"token {self.name!r}: give exactly one of token and sha256")
        if self.role not in ("ops", "code"):
            raise ValueError(f"token {self.name!r}: role {self.role!r}; choose ops or code")
        return self

    def digest(self) -> bytes:
        return bytes.fromhex(self.sha256) if self.sha256 else hashlib.sha256(self.token.encode()).digest()


class TokensDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: list[TokenEntry] = Field(default_factory=list)


@dataclass(frozen=True)
class Caller:
    """Who made a request."""

    name: str
    role: str
    max_in_flight: int | None

    @property
    def may_send_code(self) -> bool:
        return self.role == "code"


class Tokens:
    """The API tokens a server accepts (see the module docstring)."""

    def __init__(self, entries: list[TokenEntry], anonymous_role: str | None = None):
        self._by_digest = {e.digest(): e for e in entries}
        self.anonymous_role = anonymous_role

    @classmethod
    def load(cls, cfg: AuthConfig) -> "Tokens":
        """From ``cfg.tokens_file``, else the ``cfg.tokens_env`` variable; none at all is allowed only
        with an anonymous role (the server would refuse everyone)."""
        text = None
        if cfg.tokens_file:
            text = Path(cfg.tokens_file).read_text()
        elif os.environ.get(cfg.tokens_env):
            text = os.environ[cfg.tokens_env]
        if text is None:
            if cfg.anonymous_role is None:
                raise ValueError(f"no API tokens: set auth.tokens_file or the environment variable {cfg.tokens_env} "
                                 "(tokens: [{name, token, role}]), or auth.anonymous_role for a local server")
            return cls([], cfg.anonymous_role)
        raw = yaml.safe_load(text) if not text.lstrip().startswith("{") else json.loads(text)
        return cls(TokensDocument.model_validate(raw).tokens, cfg.anonymous_role)

    def digests_document(self) -> str:
        """The tokens document (JSON) with every token replaced by its SHA-256: what may be shown
        to whoever can read a process's environment."""
        entries = [{"name": e.name, "sha256": digest.hex(), "role": e.role, "max_in_flight": e.max_in_flight}
                   for digest, e in self._by_digest.items()]
        return json.dumps({"tokens": entries})

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller of a request with this ``Authorization`` header; None: refused (401)."""
        if not authorization:
            return Caller("anonymous", self.anonymous_role, None) if self.anonymous_role else None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        for known, entry in self._by_digest.items():  # every entry compared: constant time per request
            if hmac.compare_digest(known, digest):
                return Caller(entry.name, entry.role, entry.max_in_flight)
        return None
