"""A gateway served on a free loopback port for a script's requests:

    with served(binary, model, data_dir, env=None) as (url, name):
        ...

waits for /readyz, gives the base URL and the model's name (GET /v1/models),
and stops the gateway on leaving; its output goes to DATA_DIR/gateway.log.
"""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(binary, model, data_dir, env=None):
    port = free_port()
    os.makedirs(data_dir, exist_ok=True)
    log = open(os.path.join(data_dir, "gateway.log"), "w")
    gw = subprocess.Popen(
        [binary, "serve", "-p", str(port), "-m", os.path.abspath(model), "--data-dir", data_dir],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(6000):
            try:
                urllib.request.urlopen(url + "/readyz", timeout=1)
                break
            except Exception:
                if gw.poll() is not None:
                    sys.exit(f"the gateway exited: see {log.name}")
                time.sleep(0.1)
        else:
            sys.exit(f"the gateway was not ready after 10 minutes: see {log.name}")
        models = json.load(urllib.request.urlopen(url + "/v1/models", timeout=10))
        yield url, models["data"][0]["id"]
    finally:
        gw.terminate()
        gw.wait()
        log.close()
