"""Which encoder endpoints get the bearer token: the token is bound to endpoints the operator listed beside it.

A workflow (or a command line) names the endpoint; the environment holds the token. Without a binding, a shared
workflow that names its own URL would collect the token. So the token goes only to an origin the operator listed
in the environment, and only over https:// or plain http:// to a loopback host.

Environment (read on every call, so a test or a long-running process sees changes):

    H3_ENCODER_TOKEN   the bearer token ...
    H3_ENCODER_URLS    ... and the endpoints it is for: comma-separated URLs (H3_ENCODER_URL, one URL, also works)
    H3_ENCODER_TOKENS  per-origin tokens: "https://enc-a:8443=tok1,https://enc-b=tok2"
                       (each entry split at its first "="; a token may not contain ",")

Origins are compared after normalisation: scheme and host lower-cased, the port made explicit (443/80), the path
ignored. The policy, as `token_for` applies it:

* nothing configured: any http(s) endpoint may be contacted, without a token;
* anything configured: only listed origins may be contacted (`EndpointNotAllowedError` otherwise, naming
  H3_ENCODER_URLS) -- a workflow pointing elsewhere is refused, never sent unauthenticated requests;
* a token is never sent over plain http:// to a non-loopback host (`InsecureEndpointError`).

Use: ``EncoderClient(urls, token=credentials.token_for(urls) or "")`` -- `""` tells the client "no token" (None
would make it read H3_ENCODER_TOKEN itself).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..protocol import is_loopback

TOKEN_ENV = "H3_ENCODER_TOKEN"
URLS_ENV = "H3_ENCODER_URLS"
URL_ENV = "H3_ENCODER_URL"
TOKENS_ENV = "H3_ENCODER_TOKENS"


class CredentialPolicyError(ValueError):
    """An endpoint the token policy does not allow, or a malformed policy variable."""


class EndpointNotAllowedError(CredentialPolicyError):
    """The endpoint is not among those listed in the environment."""


class InsecureEndpointError(CredentialPolicyError):
    """The token would travel over plain HTTP to a host that is not this machine."""


def split_urls(urls: str | list[str] | tuple[str, ...]) -> list[str]:
    """One URL, a comma-separated string, or a list -> the non-empty URLs."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return [item.strip() for item in items if isinstance(item, str) and item.strip()]


def origin(url: str) -> str:
    """`scheme://host:port`, normalised; ValueError for anything that is not a plain http(s) URL."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise CredentialPolicyError(f"encoder URL must start with http:// or https://, got {_short(url)}")
    if parts.username is not None or parts.password is not None:
        raise CredentialPolicyError(f"do not put credentials in the encoder URL {_short(url)}; the token comes "
                                    f"from the environment ({TOKEN_ENV} / {TOKENS_ENV})")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise CredentialPolicyError(f"encoder URL has an invalid port: {_short(url)}") from None
    if not host:
        raise CredentialPolicyError(f"encoder URL has no host: {_short(url)}")
    port = port or (443 if scheme == "https" else 80)
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


@dataclass(frozen=True)
class Policy:
    """The token binding read from the environment."""

    token: str | None  # H3_ENCODER_TOKEN
    bound: frozenset[str]  # origins listed in H3_ENCODER_URLS / H3_ENCODER_URL
    per_origin: Mapping[str, str]  # H3_ENCODER_TOKENS

    @property
    def configured(self) -> bool:
        return bool(self.token or self.bound or self.per_origin)

    @property
    def allowed(self) -> frozenset[str]:
        return self.bound | frozenset(self.per_origin)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Policy":
        env = os.environ if env is None else env
        token = (env.get(TOKEN_ENV) or "").strip() or None
        bound = set()
        for name in (URLS_ENV, URL_ENV):
            for url in split_urls(env.get(name) or ""):
                try:
                    bound.add(origin(url))
                except CredentialPolicyError as error:
                    raise CredentialPolicyError(f"{name}: {error}") from None
        per_origin: dict[str, str] = {}
        for item in split_urls(env.get(TOKENS_ENV) or ""):
            url, sep, value = item.partition("=")  # the first "=": tokens may end in base64 padding
            if not sep or not url.strip() or not value.strip():
                raise CredentialPolicyError(f"{TOKENS_ENV} entries are URL=TOKEN, comma-separated; one entry is "
                                            "not (its text is not shown: it may hold a token)")
            try:
                per_origin[origin(url)] = value.strip()
            except CredentialPolicyError as error:
                raise CredentialPolicyError(f"{TOKENS_ENV}: {error}") from None
        return cls(token, frozenset(bound), per_origin)

    def token_for(self, url: str) -> str | None:
        """The token to send to `url` (None: send none); raises when the policy forbids contacting it."""
        key = origin(url)
        if self.configured and key not in self.allowed:
            listed = ", ".join(sorted(self.allowed)) or "nothing"
            raise EndpointNotAllowedError(
                f"encoder endpoint {key} is not allowed: with {TOKEN_ENV}, {URLS_ENV} or {TOKENS_ENV} set, this "
                f"machine contacts only the endpoints listed in {URLS_ENV} (or {TOKENS_ENV}); listed now: {listed}. "
                "Add the URL there (comma-separated) if you trust it with the token.")
        token = self.per_origin.get(key) or (self.token if key in self.bound else None)
        if token and key.startswith("http://") and not is_loopback(urlsplit(key).hostname or ""):
            raise InsecureEndpointError(
                f"refusing to send the encoder token to {key} over plain http://: use https:// (a TLS proxy in "
                "front of the server, docs/DEPLOY.md) or a loopback address")
        return token


def token_for(urls: str | list[str] | tuple[str, ...], env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token for an endpoint or failover list, per the environment's policy (see module doc).

    Raises `EndpointNotAllowedError` / `InsecureEndpointError` (both `CredentialPolicyError`, a ValueError) when
    any URL may not be contacted; all URLs of a failover list must share one token.
    """
    policy = Policy.from_env(env)
    items = split_urls(urls)
    if not items:
        raise CredentialPolicyError("no encoder endpoint given")
    tokens = {policy.token_for(url) for url in items}
    if len(tokens) > 1:
        raise CredentialPolicyError("the endpoints of one failover list must share one token (or all have none); "
                                    f"split them, or give them the same token in {TOKENS_ENV}")
    return tokens.pop()


def is_configured(url: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether the operator listed this endpoint's origin in the environment (trusted enough to show its
    error messages)."""
    try:
        return origin(url) in Policy.from_env(env).allowed
    except CredentialPolicyError:
        return False


def _short(url: object, limit: int = 200) -> str:
    text = str(url)
    return repr(text if len(text) <= limit else text[:limit] + "...")
