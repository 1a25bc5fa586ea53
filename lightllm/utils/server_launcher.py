"""Start the real server (python -m lightllm.server.api_server) as a child process: tests, benchmarks, eval."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 600


SSE_DATA_PREFIX = "data: "


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as a strict client does."""
    def bad(constant):
        raise ValueError(f"non-JSON constant {constant}")
    return json.loads(text, parse_constant=bad)


def sse_data(lines) -> List[str]:
    """The payloads of a server-sent event stream's ``data:`` lines."""
    return [line[len(SSE_DATA_PREFIX):] for line in lines if line.startswith(SSE_DATA_PREFIX)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def launch_server(args: List[str], log_path: str, env: Optional[dict] = None) -> Server:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightllm.server.api_server", "--port", str(port), *args],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log_path).read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Server(proc, url, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{open(log_path).read()}")
