"""Starts the real `snooze` binary (built by `cargo test`) for the Python client tests."""

import os
import re
import signal
import subprocess
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODELS = os.path.join(ROOT, "models")
BINARY = os.environ.get("SNOOZE_BIN", os.path.join(ROOT, "target", "debug", "snooze"))


class Server:
    """`with Server(config_toml) as s:` — s.base is http://127.0.0.1:PORT. Leaving the block
    stops the server and closes its pipe and folder; `Server.for_class` does the same for a
    test class, even when its setUpClass fails after the start."""

    def __init__(self, config: str, *args: str):
        self.config = config
        self.args = args
        self.lines = []
        self.grpc = None  # host:port of the gRPC service

    def __enter__(self):
        if not os.path.exists(BINARY):
            raise RuntimeError(f"{BINARY} is missing: run `make test` (cargo builds it)")
        self.tmp = tempfile.TemporaryDirectory(prefix="snooze-py-")
        path = os.path.join(self.tmp.name, "snooze.toml")
        with open(path, "w") as f:
            f.write(self.config)
        env = dict(os.environ, NO_COLOR="1")
        self.proc = subprocess.Popen(
            [BINARY, "serve", "--config", path, "--http-address", "127.0.0.1:0", "--grpc-address", "127.0.0.1:0",
             "--state-dir", os.path.join(self.tmp.name, "state"), *self.args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        found = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.lines.append(line)
                g = re.search(r"gRPC on grpc://([^\s\"]+)", line)
                if g:
                    self.grpc = g.group(1)
                m = re.search(r"listening on http://(\S+)", line)
                if m and not found.is_set():
                    self.addr = m.group(1)
                    found.set()
            found.set()  # the process closed stderr: it exited, no need to wait on

        self.addr = None
        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        found.wait(30)
        if self.addr is None:
            self.stop(signal.SIGKILL)
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        self.base = f"http://{self.addr}"
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    @classmethod
    def for_class(cls, test_class, config: str, *args: str) -> "Server":
        """Starts a server for `test_class` (from its setUpClass), stopped by a class
        cleanup: unittest runs those even when setUpClass raises after this call."""
        server = cls(config, *args).__enter__()
        test_class.addClassCleanup(server.stop)
        return server

    def stop(self, sig=signal.SIGTERM):
        """Stops the process (SIGKILL after 30 s), then closes its stderr pipe once the
        pump has read it to the end, and removes the temp folder. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.pump.join(10)
        self.proc.stderr.close()
        self.tmp.cleanup()


def reference(model: str):
    import json

    import numpy as np

    with open(os.path.join(MODELS, model, "reference.json")) as f:
        r = json.load(f)
    shape = r["shape"]
    x = np.array(r["input"]["x"], dtype=np.float32).reshape(shape)
    y = np.array(r["output"]["y"], dtype=np.float32).reshape(shape)
    return x, y


def wait_until(pred, timeout=30.0):
    end = time.time() + timeout
    while not pred():
        if time.time() > end:
            raise AssertionError("timed out")
        time.sleep(0.02)
