"""The coordinator's settings: environment variables with the `HSX_` prefix.

`hsx serve` builds one `Settings` (flags override the environment) and hands it to
`create_app`; routes read it through the `deps.get_settings` dependency, so a test can
pass its own.

Allowed roots: with `HSX_ALLOWED_ROOTS` unset, a server that only listens on loopback and
has no API token accepts any dataset and output path (the laptop case: whoever can reach
it already owns the files). A server that is exposed — a non-loopback host, or an API
token, which means it is meant to be shared — restricts paths to the directory it was
started in, so forgetting the setting never opens the whole file system. Set
`HSX_ALLOWED_ROOTS` (a JSON list, or paths separated by `:` or `,`) to choose. With
users, each user reads and writes only their own folder in each root (`<root>/<user>`,
or what the tokens file gives them: users.py); admins the whole roots; everyone also
reads `HSX_READ_ROOTS` (a shared folder of models and datasets).

Who may call: no token (the laptop case, loopback only), one token (`HSX_API_TOKEN`, one
user named `operator`), a tokens file (`HSX_TOKENS_FILE`: each token with its user name and
whether that user is an admin), or a header set by an authenticating proxy in front
(`HSX_USER_HEADER`). A server on a non-loopback address with none of these refuses to
start unless `HSX_ALLOW_OPEN=1` says so (docs/SECURITY.md).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_PORT = 8642


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")


def _host_name(host_header: str) -> str:
    """`example.org:8642` -> `example.org`, `[::1]:8642` -> `[::1]`."""
    if host_header.startswith("["):
        return host_header.partition("]")[0] + "]"
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


class Settings(BaseSettings):
    """Everything the coordinator needs to know before it starts."""

    model_config = SettingsConfigDict(env_prefix="HSX_", extra="ignore")

    host: str = Field(
        "127.0.0.1",
        description="Address to bind. Loopback by default: exposing the API is a decision.",
    )
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port to listen on.")
    ledger_path: Path = Field(
        Path("~/.hsx/ledger.sqlite"),
        description="SQLite file of the job ledger (jobs, units, attempts, commits).",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join (e.g. ray://head:10001); None starts a local Ray.",
    )
    allowed_roots: Annotated[list[Path | str] | None, NoDecode] = Field(
        None,
        description=(
            "Directories (symlinks resolved) and bucket prefixes (`s3://bucket/prefix`) "
            "that job datasets and outputs must lie in. Unset: no restriction on a "
            "loopback server without a token, else the directory the server was started "
            "in. A JSON list, or entries separated by `,` (or `:` between local paths)."
        ),
    )
    read_roots: Annotated[list[Path | str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Directories and bucket prefixes every caller's jobs may read (models, "
            "tokenizers, datasets) but not write: a shared dataset root beside the users' "
            "own. Written as HSX_ALLOWED_ROOTS is."
        ),
    )
    api_token: str | None = Field(
        None,
        repr=False,
        description=(
            "Bearer token every /v1 call must carry (at least 16 characters); None leaves "
            "the API open."
        ),
    )
    allow_trust_remote_code: bool = Field(
        False, description="Accept jobs with trust_remote_code: true (runs the model's code)."
    )
    max_unit_attempts: int = Field(
        3, ge=1, description="Attempts of one work unit before it is recorded as failed."
    )
    quota_bytes: int | None = Field(
        None,
        ge=0,
        description=(
            "Most bytes one job's output may hold: its shards, and its draft's checkpoints "
            "(the trainer refuses one past it); None for no limit. The same variable "
            "(HSX_QUOTA_BYTES) limits `hsx extract` and `hsx train`."
        ),
    )
    ingest_workers: int | None = Field(
        None,
        ge=0,
        description=(
            "Slices of a job's dataset tokenized at once. None: as Ray tasks of one CPU, "
            "as many as Ray has CPUs for (beside one per GPU; on this node for a local "
            "dataset, anywhere for a bucket's; on a cluster without GPUs, beside its CPU "
            "engines, one at a time); 1: one after the other in the "
            "coordinator's process; N: N Ray tasks (0: one per core). The same variable "
            "(HSX_INGEST_WORKERS) sets it for `hsx extract`, whose ingestion starts before "
            "it connects Ray: unset, in its own process; N, a pool of N processes."
        ),
    )

    standby: bool = Field(
        False,
        description=(
            "When another live coordinator holds the ledger, wait and take over when it "
            "stops (its lease expires, or its process is gone) instead of refusing to start."
        ),
    )
    lease_ttl_s: float = Field(
        20.0,
        gt=0,
        description=(
            "Seconds a coordinator's lease on the ledger lasts without a heartbeat (one "
            "every quarter of it); a coordinator that stalls longer is taken over by a "
            "standby and fenced: its ledger writes fail."
        ),
    )
    engine_options: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "vLLM engine options a job may set beyond hsx's list (hsx_workers.engines.vllm."
            "rules.ENGINE_OPTIONS), passed as the job gives them: an option added here may "
            "load code or files (docs/SECURITY.md). Names separated by `,`, or a JSON list."
        ),
    )
    image_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Hosts a job's `images.allow_hosts` may name: the coordinator's ingestion "
            "fetches image URLs from them (docs/SECURITY.md). Empty: no job fetches any. "
            "Names separated by `,`, or a JSON list."
        ),
    )
    allow_hub: bool | None = Field(
        None,
        description=(
            "Accept models, tokenizers and datasets named by hub id (downloaded by the "
            "engines). Unset: only where paths are unrestricted (a loopback server "
            "without a token)."
        ),
    )
    allow_open: bool = Field(
        False,
        description=(
            "Serve a non-loopback address with no token, tokens file or user header: "
            "anyone who reaches it may submit jobs. Without it such a server refuses to "
            "start; with it the dashboard says the server is open."
        ),
    )
    allowed_hosts: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description=(
            "Host header values (names, optionally with :port) the API answers. Unset: on "
            "a loopback bind only localhost, 127.0.0.1 and [::1] (a web page that points "
            "a DNS name at this machine cannot reach it), anything elsewhere."
        ),
    )
    tokens_file: Path | None = Field(
        None,
        description=(
            "YAML or JSON file of API tokens, one entry per user: `{token: ..., user: ..., "
            "admin: false}` in a list under `tokens:`, optionally with the user's `roots` "
            "(read and write) and `read_roots` (read only). Each user sees and changes only "
            "their own jobs, and writes only in their roots (by default their own folder "
            "in each allowed root); admins all. Read at start: a file with no token, a "
            "token under 16 characters or a placeholder stops the start."
        ),
    )
    user_header: str | None = Field(
        None,
        description=(
            "Header that names the caller, set by an authenticating proxy in front of the "
            "coordinator (e.g. X-Forwarded-User). Trusted as it comes: the coordinator "
            "must be reachable only through that proxy."
        ),
    )
    admins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="User names (from HSX_USER_HEADER) who see and change every job.",
    )
    public_metrics: bool = Field(
        False,
        description="Serve /metrics without a token (a scraper then sends none).",
    )
    max_active_jobs: int = Field(
        1000, ge=1,
        description="Queued and running jobs one user may have at once; more are refused.",
    )
    max_checks: int = Field(
        8, ge=1,
        description=(
            "Submits and inspects checked at once, in all (each holds a request thread and "
            "a child process that estimates the dataset); one more is answered 429 with "
            "Retry-After (throttle.py)."
        ),
    )
    max_user_checks: int = Field(
        2, ge=1,
        description="Submits and inspects of one user checked at once; one more is a 429.",
    )
    user_quota_bytes: int | None = Field(
        None, ge=0,
        description=(
            "Most bytes the outputs of one user's jobs may hold together (shards and "
            "drafts); None for no limit. A job that would pass it is refused at submit."
        ),
    )
    max_body_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="Largest request body accepted; a larger one is refused with 413.",
    )

    @field_validator("ledger_path")
    @classmethod
    def _expand_ledger(cls, path: Path) -> Path:
        return path.expanduser()

    @field_validator("allowed_roots", "read_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any, info: ValidationInfo) -> Any:
        # The environment gives a string; a JSON list and a PATH-like list both make sense.
        if not isinstance(value, str):
            return value
        text = value.strip()
        if not text:
            # `HSX_ALLOWED_ROOTS=` means unset, as for the token
            return None if info.field_name == "allowed_roots" else []
        if text.startswith("["):
            return json.loads(text)
        # `:` separates local paths; inside `s3://...` it is the scheme's.
        parts = re.split(rf",|{re.escape(os.pathsep)}(?!//)", text)
        return [part for part in parts if part]

    @field_validator("allowed_roots", "read_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[Path | str] | None) -> list[Path | str] | None:
        # As written (absolute, `~` expanded): refusals show them so, and each check
        # resolves them anew (paths.py).
        if roots is None:
            return None
        from hsx_service.paths import root_as_given

        return [root_as_given(root) for root in roots]

    @field_validator("engine_options", "allowed_hosts", "admins", "image_hosts",
                     mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]

    @field_validator("user_header")
    @classmethod
    def _empty_header_is_none(cls, header: str | None) -> str | None:
        return header or None

    @field_validator("api_token")
    @classmethod
    def _empty_token_is_none(cls, token: str | None) -> str | None:
        # `HSX_API_TOKEN=` in a shell script means "no token", not "the empty token".
        return token or None

    @property
    def authenticates(self) -> bool:
        """Callers are told apart: a token, a tokens file or a proxy's user header."""
        return (self.api_token is not None or self.tokens_file is not None
                or self.user_header is not None)

    @property
    def exposed(self) -> bool:
        """Meant to be reached by others: a non-loopback bind, or callers to tell apart."""
        return self.authenticates or not is_loopback(self.host)

    @property
    def open_to_all(self) -> bool:
        """A non-loopback server that lets anyone in (only with `allow_open`)."""
        return not is_loopback(self.host) and not self.authenticates

    def refusal_to_start(self) -> str | None:
        """Why this server must not start as configured; None if it may."""
        if self.open_to_all and not self.allow_open:
            return (f"refusing to serve {self.host} without an API token: anyone who "
                    "reaches it could submit jobs. Set HSX_API_TOKEN (or --token, "
                    "HSX_TOKENS_FILE, HSX_USER_HEADER), bind 127.0.0.1, or run it open on "
                    "purpose with HSX_ALLOW_OPEN=1 (--allow-open)")
        return None

    @property
    def hub_allowed(self) -> bool:
        """Whether jobs may name hub ids (see `allow_hub`)."""
        if self.allow_hub is not None:
            return self.allow_hub
        return self.effective_roots() is None

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether the API answers a request with this Host header (DNS rebinding)."""
        if self.allowed_hosts is None and not is_loopback(self.host):
            return True
        if host_header is None:
            return False
        allowed = self.allowed_hosts if self.allowed_hosts is not None else list(
            LOOPBACK_NAMES)
        name = _host_name(host_header)
        return host_header in allowed or name in allowed

    @property
    def address(self) -> str:
        """Where this coordinator serves, as the ledger's lease names it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def effective_roots(self) -> list[Path | str] | None:
        """The roots paths are checked against; None means no restriction."""
        if self.allowed_roots is not None:
            return self.allowed_roots
        if self.exposed:
            return [Path(os.path.realpath(os.getcwd()))]
        return None
