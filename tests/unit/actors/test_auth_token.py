"""The embedded Ray instance's auth token stays private to its owner (actors.roles.private_auth_token)."""

import os

from actors.roles import private_auth_token


def test_a_token_file_readable_by_others_is_made_private_and_a_missing_one_is_written_private(tmp_path, monkeypatch):
    said = []
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    token = tmp_path / "auth_token"
    token.write_text("a" * 64)
    os.chmod(token, 0o644)  # as Ray writes it under the usual umask
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    private_auth_token(said.append)
    assert token.stat().st_mode & 0o777 == 0o600 and token.read_text() == "a" * 64
    assert len(said) == 1 and "readable by other users" in said[0]
    private_auth_token(said.append)  # private already: nothing said
    assert len(said) == 1
    fresh = tmp_path / "ray" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(fresh))
    private_auth_token(said.append)
    assert fresh.stat().st_mode & 0o777 == 0o600 and len(fresh.read_text()) == 64 and len(said) == 1


def test_auth_turned_off_on_purpose_is_respected_and_said(tmp_path, monkeypatch):
    said = []
    token = tmp_path / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    private_auth_token(said.append)
    assert not token.exists() and "takes calls from anyone" in said[0]
