"""Start the real server (python -m lightllm.server.api_server) as a child process, and read
what it answers: strict JSON, server-sent events, the /metrics page. For tests, benchmarks and
tools (``lightllm/tools/client.py`` builds on it); httpx is imported only where a request is made."""
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

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


Labels = Tuple[Tuple[str, str], ...]  # sorted (name, value) pairs


@dataclass(frozen=True)
class MetricsPage:
    """A /metrics page parsed by prometheus_client: every sample's value by name and labels."""

    samples: Dict[Tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str) -> "MetricsPage":
        from prometheus_client.parser import text_string_to_metric_families

        return cls({(s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples})

    def value(self, name: str, default: Optional[float] = None, **labels: str) -> float:
        """The sample ``name`` with exactly these labels; ``default`` (else KeyError) when there is none."""
        key = (name, tuple(sorted(labels.items())))
        if key not in self.samples and default is None:
            raise KeyError(f"/metrics has no sample {name} {labels or ''}".rstrip())
        return self.samples.get(key, default)

    def by_key(self, key: str) -> float:
        """The sample written ``name`` or ``name{label="value",...}`` as on the page."""
        for (name, labels), v in self.samples.items():
            if key == name + ("{" + ",".join(f'{k}="{x}"' for k, x in labels) + "}" if labels else ""):
                return v
        raise KeyError(key)

    def histogram(self, name: str) -> Dict[int, int]:
        """Observations per integer bucket of the histogram ``name`` (integer observations: bucket
        ``le=k`` minus bucket ``le=k-1``); {} when the page has no such histogram."""
        cumulative = {float(dict(labels)["le"]): v for (n, labels), v in self.samples.items() if n == name + "_bucket"}
        bounds = sorted(b for b in cumulative if math.isfinite(b))
        return {int(b): int(cumulative[b] - (cumulative[prev] if prev is not None else 0))
                for prev, b in zip([None] + bounds, bounds)}

    def quantile(self, name: str, q: float) -> Optional[float]:
        """The ``q``-quantile of the histogram ``name`` as Prometheus' histogram_quantile estimates it:
        linear within the bucket that holds it (the largest finite bound when it falls in +Inf); None when the
        histogram has no observations."""
        cumulative = sorted((float(dict(labels)["le"]), v) for (n, labels), v in self.samples.items()
                            if n == name + "_bucket")
        if not cumulative or cumulative[-1][1] <= 0:
            return None
        rank = q * cumulative[-1][1]
        lower, below = 0.0, 0.0
        for upper, count in cumulative:
            if count >= rank and count > below:
                if math.isinf(upper):
                    return lower
                return lower + (upper - lower) * (rank - below) / (count - below)
            lower, below = upper, count
        return lower

    def __sub__(self, earlier: "MetricsPage") -> "MetricsPage":
        """How much every sample grew since ``earlier`` (counters and histograms of one server)."""
        return MetricsPage({k: v - earlier.samples.get(k, 0.0) for k, v in self.samples.items()})


def scrape(url: str) -> MetricsPage:
    """The /metrics page of the server at ``url``."""
    import httpx

    return MetricsPage.parse(httpx.get(url + "/metrics").text)


def process_cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds process ``pid`` has used so far (Linux /proc; None elsewhere or once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the fields after the command name, from the state on
    except OSError:
        return None
    utime, stime = int(fields[11]), int(fields[12])  # stat(5) fields 14 and 15
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


# The line each extra HTTP process (--httpserver_workers) logs at its start (api_start._http_worker)
HTTP_PROCESS_PID_LINE = re.compile(r"HTTP process \d+ of \d+: pid (\d+)")


def http_process_pids(main_pid: int, log_path: str) -> List[int]:
    """The server's HTTP processes: the API server's ``main_pid`` and those its log names."""
    with open(log_path) as f:
        return [main_pid] + [int(pid) for pid in HTTP_PROCESS_PID_LINE.findall(f.read())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def client(self, timeout: float = 300.0):
        import httpx

        return httpx.Client(base_url=self.url, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def metric(self, key: str) -> float:
        """One sample, written as on the page: ``name`` or ``name{label="value"}``."""
        return scrape(self.url).by_key(key)


def launch_server(args: List[str], log_path: str, env: Optional[dict] = None) -> Server:
    import httpx

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
