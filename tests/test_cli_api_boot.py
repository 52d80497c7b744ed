"""The CLI boots Prefect's ephemeral API beside the flow's imports: the server it starts is the one Prefect's client
then uses (no second server), and with PREFECT_API_URL set it starts none. Run in a subprocess of its own, so that
no other test shares (or stops) the server."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
from cli.main import _boot_prefect_api
from prefect.server.api.server import SubprocessASGIServer
wait = _boot_prefect_api()
wait()
server = SubprocessASGIServer()
print("running", server.running, server.server_process is not None)
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    print("same", str(client.api_url).rstrip("/") == server.api_url.rstrip("/"))
server.stop()
"""


def _probe(env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    return r.stdout + r.stderr


def test_the_booted_server_is_the_one_the_client_uses(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    out = _probe(env)
    assert "running True True" in out and "same True" in out, out


def test_with_an_api_url_it_starts_nothing(tmp_path):
    code = ("from cli.main import _boot_prefect_api\n"
            "from prefect.server.api.server import SubprocessASGIServer\n"
            "_boot_prefect_api()()\n"
            "print('running', SubprocessASGIServer().running)\n")
    env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api", PREFECT_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "running False" in r.stdout, r.stdout + r.stderr
