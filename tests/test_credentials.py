"""The token-binding policy (h3_core.remote.client.credentials): which endpoints get H3_ENCODER_TOKEN."""

import pytest

from h3_core.remote.client import credentials
from h3_core.remote.client.credentials import CredentialPolicyError, EndpointNotAllowedError, InsecureEndpointError

TOKEN = "t" * 40


def test_origins_are_normalised():
    assert credentials.origin("HTTPS://Enc.Example/v1/") == "https://enc.example:443"
    assert credentials.origin("http://127.0.0.1") == "http://127.0.0.1:80"
    assert credentials.origin("http://[::1]:8190/prefix") == "http://[::1]:8190"
    for bad in ("ftp://x", "enc.example:8443", "https://user:pw@enc.example", "https://", "http://h:99999"):
        with pytest.raises(CredentialPolicyError):
            credentials.origin(bad)


def test_nothing_configured_means_any_endpoint_and_no_token():
    assert credentials.token_for("http://10.0.0.5:8190", env={}) is None
    assert credentials.token_for("https://a.example, https://b.example", env={}) is None


def test_token_goes_only_to_listed_origins():
    env = {"H3_ENCODER_TOKEN": TOKEN, "H3_ENCODER_URLS": "https://enc.example:8443, http://127.0.0.1:8190"}
    assert credentials.token_for("https://ENC.example:8443/h3", env=env) == TOKEN
    assert credentials.token_for("http://127.0.0.1:8190", env=env) == TOKEN
    for foreign in ("https://evil.example:8443", "https://enc.example", "http://enc.example:8443",
                    "http://127.0.0.1:8191", "http://localhost:8190"):
        with pytest.raises(EndpointNotAllowedError, match="H3_ENCODER_URLS"):
            credentials.token_for(foreign, env=env)
    with pytest.raises(EndpointNotAllowedError):  # one foreign URL in a failover list refuses the list
        credentials.token_for("https://enc.example:8443,https://evil.example", env=env)


def test_a_token_without_a_binding_goes_nowhere():
    with pytest.raises(EndpointNotAllowedError, match="listed now: nothing"):
        credentials.token_for("http://127.0.0.1:8190", env={"H3_ENCODER_TOKEN": TOKEN})


def test_an_allow_list_without_a_token_still_restricts():
    env = {"H3_ENCODER_URL": "https://enc.example"}
    assert credentials.token_for("https://enc.example:443", env=env) is None
    with pytest.raises(EndpointNotAllowedError):
        credentials.token_for("https://other.example", env=env)


def test_per_origin_tokens():
    env = {"H3_ENCODER_TOKENS": "https://a.example:8443=tok-a, https://b.example=tok=b"}
    assert credentials.token_for("https://a.example:8443", env=env) == "tok-a"
    assert credentials.token_for("https://b.example:443/x", env=env) == "tok=b"
    with pytest.raises(CredentialPolicyError, match="share one token"):
        credentials.token_for("https://a.example:8443,https://b.example", env=env)
    with pytest.raises(EndpointNotAllowedError):
        credentials.token_for("https://c.example", env=env)
    with pytest.raises(CredentialPolicyError, match="URL=TOKEN") as caught:
        credentials.token_for("https://a.example:8443", env={"H3_ENCODER_TOKENS": "secret-without-url"})
    assert "secret-without-url" not in str(caught.value)


def test_no_token_over_plain_http_beyond_loopback():
    env = {"H3_ENCODER_TOKEN": TOKEN, "H3_ENCODER_URLS": "http://10.1.2.3:8190,http://[::1]:8190,http://localhost:1"}
    with pytest.raises(InsecureEndpointError, match="https://"):
        credentials.token_for("http://10.1.2.3:8190", env=env)
    assert credentials.token_for("http://[::1]:8190", env=env) == TOKEN
    assert credentials.token_for("http://localhost:1", env=env) == TOKEN
    # listed without a token: plain http is fine (nothing secret travels)
    assert credentials.token_for("http://10.1.2.3:8190", env={"H3_ENCODER_URLS": "http://10.1.2.3:8190"}) is None


def test_is_configured():
    env = {"H3_ENCODER_URLS": "https://enc.example"}
    assert credentials.is_configured("https://enc.example:443/p", env=env)
    assert not credentials.is_configured("https://enc.example:444", env=env)
    assert not credentials.is_configured("not a url", env=env)


def test_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("H3_ENCODER_TOKEN", TOKEN)
    monkeypatch.setenv("H3_ENCODER_URLS", "https://enc.example")
    monkeypatch.delenv("H3_ENCODER_TOKENS", raising=False)
    monkeypatch.delenv("H3_ENCODER_URL", raising=False)
    assert credentials.token_for("https://enc.example") == TOKEN
    with pytest.raises(EndpointNotAllowedError):
        credentials.token_for("https://elsewhere.example")
