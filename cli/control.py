"""``moetrace start|stop|dump|status``: drive a running process's control endpoint.

moetrace endpoint (``moetrace.control.serve_control``): ``POST /start``,
``POST /stop``, ``POST /dump`` (JSON body ``{"name": "file.h5"}`` optional),
``GET /status``; errors are JSON ``{"error": "..."}``; bearer token in
``Authorization: Bearer T``.

SGLang (``--sglang``): ``POST /start_expert_distribution_record``,
``/stop_expert_distribution_record``, ``/dump_expert_distribution_record``
(no body; plain-text answers; the server writes the ``.pt`` into its
``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``); ``status`` reads the recorder
settings from ``GET /server_info`` (``/get_server_info`` on older servers).
The token is sent as a bearer token (SGLang's admin API key).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Annotated
from urllib.parse import urlsplit

import typer

from moetrace.http.auth import TOKEN_ENV

from .errors import EXIT_FAILED, CommandError, guarded

__all__ = ["dump", "start", "status", "stop"]

URL_ENV = "MOETRACE_CONTROL_URL"
_SGLANG_PATHS = {
    "start": "/start_expert_distribution_record",
    "stop": "/stop_expert_distribution_record",
    "dump": "/dump_expert_distribution_record",
}
_SGLANG_STATUS_KEYS = ("expert_distribution_recorder_mode", "expert_distribution_recorder_buffer_size", "enable_expert_distribution_metrics", "ep_size", "model_path")

Url = Annotated[str, typer.Option("--url", envvar=URL_ENV, help=f"Base URL of the control endpoint, e.g. http://127.0.0.1:9401 (or ${URL_ENV}).")]
Token = Annotated[str | None, typer.Option("--token", envvar=TOKEN_ENV, help=f"Bearer token (or ${TOKEN_ENV}).")]
Sglang = Annotated[bool, typer.Option("--sglang", help="Drive an SGLang server's expert-distribution endpoints instead.")]
Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the answer.")]


def _base(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CommandError(f"--url {url!r}: expected http://host:port or https://host:port")
    return url.rstrip("/")


def _request(url: str, path: str, method: str, token: str | None, timeout: float, body: dict[str, object] | None = None) -> tuple[int, str, str]:
    """``(status, content_type, text)``; HTTP errors come back as statuses, network failures raise CommandError."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(_base(url) + path, data=data, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", "") if exc.headers else "", exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CommandError(f"cannot reach {url}{path}: {reason}", EXIT_FAILED) from None


def _json_or_fail(url: str, path: str, status_code: int, content_type: str, text: str) -> dict[str, object]:
    try:
        payload = json.loads(text) if text else {}
    except json.JSONDecodeError:
        payload = None
    if status_code >= 400:
        detail = payload.get("error") if isinstance(payload, dict) and "error" in payload else text.strip()[:200]
        raise CommandError(f"{url}{path} answered {status_code}: {detail}", EXIT_FAILED)
    if not isinstance(payload, dict):
        raise CommandError(f"{url}{path} did not answer JSON ({content_type or 'no content type'}); is this a moetrace control endpoint? (use --sglang for SGLang)", EXIT_FAILED)
    return payload


def _sglang(url: str, action: str, token: str | None, timeout: float) -> None:
    path = _SGLANG_PATHS[action]
    code, _, text = _request(url, path, "POST", token, timeout)
    if code >= 400:
        raise CommandError(f"{url}{path} answered {code}: {text.strip()[:200]}", EXIT_FAILED)
    typer.echo(text.strip() or f"{action}: ok")


def _moetrace(url: str, action: str, token: str | None, timeout: float, body: dict[str, object] | None = None) -> dict[str, object]:
    path = f"/{action}"
    code, ctype, text = _request(url, path, "GET" if action == "status" else "POST", token, timeout, body)
    return _json_or_fail(url, path, code, ctype, text)


def _summary(payload: dict[str, object]) -> str:
    status_info = payload.get("status")
    if not isinstance(status_info, dict):
        return ""
    return f" (mode={status_info.get('mode')}, recording={status_info.get('recording')}, passes={status_info.get('passes')})"


@guarded
def start(url: Url, token: Token = None, sglang: Sglang = False, timeout: Timeout = 10.0) -> None:
    """Start recording in a running process."""
    if sglang:
        _sglang(url, "start", token, timeout)
        return
    typer.echo("recording started" + _summary(_moetrace(url, "start", token, timeout)))


@guarded
def stop(url: Url, token: Token = None, sglang: Sglang = False, timeout: Timeout = 10.0) -> None:
    """Stop recording in a running process (what was recorded stays for dump)."""
    if sglang:
        _sglang(url, "stop", token, timeout)
        return
    typer.echo("recording stopped" + _summary(_moetrace(url, "stop", token, timeout)))


@guarded
def dump(
    url: Url,
    token: Token = None,
    name: Annotated[str | None, typer.Option("--name", help="File name for the dump inside the server's output directory.")] = None,
    sglang: Sglang = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait (dumps of long recordings take a while).")] = 300.0,
) -> None:
    """Write what the process recorded to a trace and print its path (on the server's machine)."""
    if sglang:
        if name is not None:
            raise CommandError("--name is not supported with --sglang: SGLang picks the file name in its SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR")
        _sglang(url, "dump", token, timeout)
        return
    payload = _moetrace(url, "dump", token, timeout, {"name": name} if name is not None else None)
    typer.echo(str(payload.get("path")))


@guarded
def status(url: Url, token: Token = None, sglang: Sglang = False, timeout: Timeout = 10.0) -> None:
    """Print the recorder status of a running process as JSON."""
    if not sglang:
        typer.echo(json.dumps(_moetrace(url, "status", token, timeout), indent=2))
        return
    for path in ("/server_info", "/get_server_info"):
        code, ctype, text = _request(url, path, "GET", token, timeout)
        if code != 404:
            info = _json_or_fail(url, path, code, ctype, text)
            typer.echo(json.dumps({k: info.get(k) for k in _SGLANG_STATUS_KEYS}, indent=2))
            return
    raise CommandError(f"{url} has neither /server_info nor /get_server_info; is it an SGLang server?", EXIT_FAILED)
